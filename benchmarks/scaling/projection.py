"""Projected step time on a named GPU from simulated ranks (``--simulate`` results JSON), every assumption stated.

    T(P) = max over the simulated ranks r of [ T_compute(r) + T_comm_exposed(r) ]

- ``T_compute(r)``: a per-kernel roofline over rank r's local kernels (``RankStats.op_instances``: FLOPs and bytes
  read+written per op): each op takes max(FLOPs / (peak x compute efficiency), bytes / (HBM bandwidth x memory
  efficiency), launch overhead).
- ``T_comm(r)`` per collective kind, from the bytes rank r's library counted (``st.CommCounter``; see
  docs/architecture.md for what each kind counts): calls x latency + wire bytes / link bandwidth, with wire bytes
  2(P-1)/P x buffer for an all-reduce, (P-1)/P x output for an all-gather, and the bytes sent for all-to-all, ring
  passes, broadcasts and scatters. The link is NVLink while the P ranks fit in one node, the inter-node network
  (one NIC per GPU) otherwise.
- Exposed communication: ring passes overlap the attention kernels of the same pass (the ring is double-buffered),
  so only max(0, T_ring - T_attention) is exposed. Every other kind is exposed by (1 - h) x its time, h the share of
  that kind the library was *measured* to hide in a training step (``benchmarks/results/overlap.json``,
  benchmarks/overlap/bench.py: 2 CPU ranks of one host, over the shared-memory rings, the waits after every rank
  posted against the same collectives replayed alone), the least share measured over the workloads where the kind
  took at least 0.05 ms alone per step (``measured_hidden``); a kind never measured is exposed in full. These are
  CPU measurements, not GPU ones: on a GPU the compute they hide behind is faster and NCCL's latency lower, so the
  projection assumes the *share* carries over, no more. Over the rings a step's collectives take tens of µs and a
  receiver's wake-up exceeds them, so the shares measured are 0 (halo, all-to-all; the others too short to count):
  the projection hides nothing but the ring passes — no overlap that was not measured.
  ``--no-measured-hiding`` counts every kind but ring passes in full (the projection before these measurements).

Speed-up S(P) = T(1) / T(P), with T(1) the same projection of the plain single-device model (P = 1). The model
knows nothing about kernel fusion, stream concurrency or CPU-side dispatch stalls: it is a projection, to be
labelled so, and ``assumptions()`` returns every number it used.

    python -m benchmarks.scaling.projection benchmarks/results/vit_sim_meta.json --gpu H200
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

OVERLAP_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "overlap.json")

# The overlap benchmark's kinds (comm/comm_timing.h, grouped by benchmarks/overlap/bench.py) by the CommCounter kind
# a simulated rank counts them under.
COUNTER_KIND = {"halo (forward)": "halo", "halo (backward)": "halo", "all_reduce": "all_reduce",
                "gradient buckets": "all_reduce", "all_reduce (agreement check)": "all_reduce",
                "all_gather": "all_gather", "all_gather (metadata)": "all_gather", "all_to_all": "all_to_all",
                "broadcast": "broadcast", "scatter": "scatter", "ring_pass": "ring_pass"}


def measured_hidden(path: str = OVERLAP_RESULTS, setting: str = "bucket 1 MiB", min_alone_ms: float = 0.05) -> dict:
    """CommCounter kind -> the least share of its time hidden over the measured workloads (default library
    settings), from the overlap benchmark's JSON; {} when there is none. A workload counts for a kind when the kind's
    collectives took at least ``min_alone_ms`` alone per step there (below that the ratio is noise)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = json.load(f)["rows"]
    least = {}
    for r in rows:
        if r["setting"] != setting:
            continue
        per = {}
        for k, v in r["kinds"].items():
            ck = COUNTER_KIND.get(k)
            if ck is None:
                continue
            e, a = per.get(ck, (0.0, 0.0))
            per[ck] = (e + v["transfer"], a + v["alone"])
        for ck, (e, a) in per.items():
            if a < min_alone_ms:
                continue
            h = min(1.0, max(0.0, 1 - e / a))
            least[ck] = min(least.get(ck, 1.0), h)
    return {k: round(v, 3) for k, v in least.items()}

# Sources (docs/simulation.md cites them in full):
#   H200: NVIDIA H200 Tensor Core GPU datasheet / product page (nvidia.com/en-us/data-center/h200): SXM FP32 67 TFLOPS,
#         TF32 Tensor Core 989 TFLOPS and BF16 1,979 TFLOPS *with sparsity* (half dense), HBM3e 4.8 TB/s, 141 GB,
#         NVLink 900 GB/s (both directions together).
#   H100: NVIDIA H100 datasheet: SXM FP32 67 TFLOPS, BF16 1,979 TFLOPS with sparsity, HBM3 3.35 TB/s, 80 GB,
#         NVLink 900 GB/s.
#   Inter-node: one ConnectX-7 NDR InfiniBand NIC per GPU in an HGX H100/H200 node, 400 Gb/s = 50 GB/s per direction.


@dataclass
class GPU:
    name: str
    peak_flops: dict          # precision -> dense FLOP/s
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # one direction
    internode_bytes_per_s: float  # one direction, per GPU
    memory_bytes: float
    gpus_per_node: int = 8


GPUS = {
    "H200": GPU("NVIDIA H200 SXM", {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12}, 4.8e12, 450e9, 50e9,
                141e9),
    "H100": GPU("NVIDIA H100 SXM", {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12}, 3.35e12, 450e9, 50e9,
                80e9),
}


@dataclass
class Assumptions:
    gpu: str = "H200"
    precision: str = "fp32"         # the paper's workloads run in FP32 (PyTorch default: TF32 off for matmuls)
    compute_efficiency: float = 0.5  # sustained fraction of peak for matmul/conv/attention kernels (fp32)
    memory_efficiency: float = 0.7   # sustained fraction of HBM bandwidth for memory-bound kernels
    link_efficiency: float = 0.8     # sustained fraction of NVLink / network bandwidth
    launch_s: float = 5e-6           # floor per kernel (eager launch)
    latency_nvlink_s: float = 10e-6  # per collective call inside a node
    latency_internode_s: float = 20e-6
    hidden_kinds: dict = field(default_factory=lambda: {"ring_pass": "attention"})
    # kind -> share of its time hidden behind compute (measured on CPU/Gloo; see the module docstring)
    hidden_share: dict = field(default_factory=measured_hidden)

    def gpu_spec(self) -> GPU:
        return GPUS[self.gpu]


ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention")


def compute_seconds(op_instances, a: Assumptions) -> tuple[float, float]:
    """(total, attention-kernel part) of the roofline over ``[(op, flops, bytes, count), ...]``."""
    g = a.gpu_spec()
    peak = g.peak_flops[a.precision] * a.compute_efficiency
    bw = g.hbm_bytes_per_s * a.memory_efficiency
    total = attn = 0.0
    for name, flops, traffic, count in op_instances:
        if flops == 0 and traffic == 0:
            continue  # views, metadata
        t = max(flops / peak, traffic / bw, a.launch_s) * count
        total += t
        if any(k in name for k in ATTENTION_OPS):
            attn += t
    return total, attn


def comm_seconds(comm: dict, P: int, a: Assumptions) -> dict:
    """Seconds per collective kind for one rank's ``{"calls": {...}, "bytes": {...}}``."""
    if P == 1:
        return {}
    g = a.gpu_spec()
    inter = P > g.gpus_per_node
    beta = (g.internode_bytes_per_s if inter else g.nvlink_bytes_per_s) * a.link_efficiency
    alpha = a.latency_internode_s if inter else a.latency_nvlink_s
    out = {}
    for kind, calls in comm.get("calls", {}).items():
        b = comm.get("bytes", {}).get(kind, 0)
        base = kind.removeprefix("fallback_")
        wire = {"all_reduce": 2 * (P - 1) / P * b, "all_gather": (P - 1) / P * b}.get(base, b)
        out[kind] = calls * alpha + wire / beta
    return out


def project_rank(row: dict, kind: str, a: Assumptions) -> dict:
    """Projected seconds of one simulated rank's pass (``kind``: "fwd" or "step")."""
    p = row[kind]
    comp, attn = compute_seconds(p["op_instances"], a)
    comm = comm_seconds(p["comm"], row["ranks"], a)
    exposed = 0.0
    for k, t in comm.items():
        if a.hidden_kinds.get(k) == "attention":
            exposed += max(0.0, t - attn)
        else:
            exposed += t * (1 - a.hidden_share.get(k.removeprefix("fallback_"), 0.0))
    return {"rank": row["rank"], "compute_s": comp, "attention_s": attn, "comm_s": comm, "comm_exposed_s": exposed,
            "total_s": comp + exposed}


def project(rows: list[dict], kind: str, a: Assumptions) -> list[dict]:
    """Per (size, P): the bounding rank's projection and the speed-up over P = 1 of the same size."""
    by = {}
    for r in rows:
        by.setdefault((r["size"], r["ranks"]), []).append(r)
    out = []
    for (size, P), rs in by.items():
        per = [project_rank(r, kind, a) for r in rs]
        worst = max(per, key=lambda p: p["total_s"])
        out.append({"size": size, "ranks": P, "kind": kind, "bounding_rank": worst["rank"], **worst,
                    "per_rank_total_s": {p["rank"]: p["total_s"] for p in per}})
    for o in out:
        base = next((b for b in out if b["size"] == o["size"] and b["ranks"] == 1), None)
        o["speedup"] = base["total_s"] / o["total_s"] if base else None
    return out


def assumptions_text(a: Assumptions) -> str:
    g = a.gpu_spec()
    return (f"{g.name}: {a.precision} peak {g.peak_flops[a.precision] / 1e12:.0f} TFLOP/s x {a.compute_efficiency} "
            f"sustained; HBM {g.hbm_bytes_per_s / 1e12:.2f} TB/s x {a.memory_efficiency}; NVLink "
            f"{g.nvlink_bytes_per_s / 1e9:.0f} GB/s per direction, inter-node {g.internode_bytes_per_s / 1e9:.0f} GB/s "
            f"per GPU, x {a.link_efficiency}; {g.gpus_per_node} GPUs per node (P > {g.gpus_per_node}: inter-node "
            f"links); latency {a.latency_nvlink_s * 1e6:.0f} us / {a.latency_internode_s * 1e6:.0f} us per call; "
            f"{a.launch_s * 1e6:.0f} us floor per kernel; ring passes hidden behind the attention kernels up to "
            "their time; " + hidden_text(a))


def hidden_text(a: Assumptions) -> str:
    shares = {k: v for k, v in a.hidden_share.items() if k not in a.hidden_kinds}
    if not shares:
        return "all other collectives exposed"
    listed = ", ".join(f"{k} {100 * v:.0f} %" for k, v in sorted(shares.items()))
    return (f"other collectives exposed but for the share of each kind measured hidden in a training step on 2 CPU "
            f"ranks (benchmarks/results/overlap.md, least over the workloads where the kind took at least 0.05 ms "
            f"alone): {listed}; other kinds exposed")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a --simulate results JSON")
    ap.add_argument("--gpu", default="H200", choices=sorted(GPUS))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--compute-efficiency", type=float, default=Assumptions.compute_efficiency)
    ap.add_argument("--memory-efficiency", type=float, default=Assumptions.memory_efficiency)
    ap.add_argument("--link-efficiency", type=float, default=Assumptions.link_efficiency)
    ap.add_argument("--kind", default="both", choices=["fwd", "step", "both"])
    ap.add_argument("--no-measured-hiding", action="store_true",
                    help="count every collective but ring passes as exposed in full (ignore overlap.json)")
    args = ap.parse_args(argv)
    a = Assumptions(gpu=args.gpu, precision=args.precision, compute_efficiency=args.compute_efficiency,
                    memory_efficiency=args.memory_efficiency, link_efficiency=args.link_efficiency)
    if args.no_measured_hiding:
        a.hidden_share = {}
    with open(args.results) as f:
        data = json.load(f)
    print("PROJECTED (not measured). Assumptions: " + assumptions_text(a))
    for kind in (["fwd", "step"] if args.kind == "both" else [args.kind]):
        rows = [r for r in data["rows"] if kind in r]
        for p in project(rows, kind, a):
            sp = f"{p['speedup']:.2f}x" if p["speedup"] else "-"
            print(f"{kind:4s} {p['size']:>10s} P={p['ranks']:<3d} bounding rank {p['bounding_rank']:<3d} "
                  f"compute {p['compute_s'] * 1e3:9.2f} ms  comm exposed {p['comm_exposed_s'] * 1e3:8.2f} ms  "
                  f"total {p['total_s'] * 1e3:9.2f} ms  speed-up {sp}")
    print(json.dumps({"assumptions": asdict(a)}, indent=None))


if __name__ == "__main__":
    main()
