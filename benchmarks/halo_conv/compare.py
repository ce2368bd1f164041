"""Side by side, in one run: a stack of L x (Conv(C->C, k3, padding 1) + ReLU) split on the first spatial dim over
N Gloo ranks — this library, PhysicsNeMo's ShardTensor (when importable) and the same layers on each rank's own rows
without communication (local-only) — forward (no grad) and a training step (zero_grad, forward, mean of squares,
backward), 2-D and 3-D.

Samples are interleaved (every sample times each variant once, in a rotating order, each started by a barrier), so
a busy machine slows all variants alike; a sample's time is the slowest rank's. Reported: the median over samples
of sharded / local-only per sample (and its range), and the medians of the times. Writes
halo_conv_compare[_TAG].{json,md} into --out (default: the git-ignored benchmarks/results/local).

    .venv/bin/python benchmarks/halo_conv/compare.py [--ranks 2] [--sizes2d 256,512,1024] [--sizes3d 32,64]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import shardtensor as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import init_cpu_rank, spawn_rank0_rows  # noqa: E402
from results_dir import add_out_argument, git, loadavg, prepare  # noqa: E402


def stack(dims: int, channels: int, layers: int) -> nn.Module:
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    mods = []
    for _ in range(layers):
        mods += [conv(channels, channels, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*mods)


def physicsnemo_module():
    """PhysicsNeMo's domain_parallel package with its op handlers registered (it registers them by itself only when
    CUDA is available), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import physicsnemo.domain_parallel as pdp
        pdp.register_custom_ops()
        return pdp
    except Exception as e:  # not installed, or an incompatible version
        print(f"PhysicsNeMo not used: {type(e).__name__}: {e}", flush=True)
        return None


def run_rank(rank, world, port, out_path, args):
    mesh = init_cpu_rank(rank, world, port, retain_heap=args.malloc == "retain")
    pdp = None if args.no_physicsnemo else physicsnemo_module()
    cases = [(2, s) for s in args.sizes2d] + [(3, s) for s in args.sizes3d]
    rows = []
    for dims, size in cases:
        torch.manual_seed(0)
        net = stack(dims, args.channels, args.layers)
        x = torch.randn((1, args.channels) + (size,) * dims)
        inputs = {"sharded": st.distribute_tensor(x, mesh, [st.Shard(2)])}
        inputs["local"] = st.to_local(inputs["sharded"]).clone()
        if pdp is not None:
            from torch.distributed.tensor import Shard
            inputs["physicsnemo"] = pdp.ShardTensor.from_local(inputs["local"].clone(), mesh, [Shard(2)],
                                                                sharding_shapes="chunk", global_shape=x.shape)
            # Both libraries split alike (torch.tensor_split sizes) and give the single-device values.
            with torch.no_grad():
                ours, theirs = net(inputs["sharded"]).full_tensor(), net(inputs["physicsnemo"]).full_tensor()
            torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
        leaves = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}

        def fwd(k):
            def go():
                with torch.no_grad():
                    net(inputs[k])
            return go

        def train(k):
            def go():
                net.zero_grad(set_to_none=True)
                net(leaves[k]).square().mean().backward()
            return go

        variants = list(inputs)
        load = loadavg()
        row = {"dims": dims, "size": size, "shape": list(x.shape), "load_avg_at_start": load}
        for mode, make in (("fwd", fwd), ("train", train)):
            fns = {k: make(k) for k in variants}
            for k in variants:
                for _ in range(args.warmup):
                    fns[k]()
            samples = {k: [] for k in variants}
            for i in range(args.samples):
                order = variants[i % len(variants):] + variants[:i % len(variants)]
                for k in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fns[k]()
                    samples[k].append((time.perf_counter() - t0) / args.calls)
            row[mode] = samples
        rows.append(row)
        if rank == 0:
            print(f"{dims}-D {size}: done (load {load})", flush=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        merged = []
        for r, row in enumerate(gathered[0]):
            m = {k: v for k, v in row.items() if k not in ("fwd", "train")}
            for mode in ("fwd", "train"):
                # A sample's time is the slowest rank's (the step is done when every rank is).
                m[mode] = {k: [max(g[r][mode][k][i] for g in gathered) for i in range(args.samples)]
                           for k in row[mode]}
            merged.append(m)
        with open(out_path, "w") as f:
            json.dump(merged, f)
    dist.destroy_process_group()


def summary(samples: dict, variant: str) -> tuple:
    """(median of per-sample variant / local, [min, max] of those ratios)."""
    ratios = [a / b for a, b in zip(samples[variant], samples["local"])]
    return statistics.median(ratios), [min(ratios), max(ratios)]


def render(rows, meta) -> str:
    has_pn = any("physicsnemo" in r["fwd"] for r in rows)
    lines = [f"# Halo convolution stacks side by side on {meta['ranks']} Gloo CPU ranks", "",
             f"{meta['layers']} × (Conv(C→C, k3, padding 1) + ReLU), C = {meta['channels']}, split on the first "
             f"spatial dim (torch.tensor_split sizes); 1 thread per rank; {meta['samples']} interleaved samples per "
             "variant (each started by a barrier, a sample's time the slowest rank's). torch "
             f"{meta['torch']}, commit {meta['commit']}, {meta['date']}, {meta['cpu_count']} CPUs; 1-minute load "
             f"average {meta['load_avg_start'][0] if meta['load_avg_start'] else '?'} at start, "
             f"{meta['load_avg_end'][0] if meta['load_avg_end'] else '?'} at end (per case below); glibc heap: "
             f"{meta.get('malloc', 'default')} (see --malloc); {meta.get('calls', 1)} consecutive call(s) per sample (--calls); "
             + (f"this library's exchanges through the shared-memory rings ({meta['shm_bytes'] // 1024} KiB, "
                "src/comm/shm_transport), PhysicsNeMo's through Gloo. " if meta.get("shm_bytes")
                else "every exchange through Gloo (SHARDTENSOR_SHM_BYTES=0). " if "shm_bytes" in meta else "")
             + f"Command: `{meta['command']}`.", "",
             "Ratios: the median over samples of (variant / local-only) in the same sample, in brackets their range; "
             "local-only = the same layers on the rank's own rows, no communication. Times: medians in ms.", ""]
    head = "| input | load | fwd: this library | " + ("fwd: PhysicsNeMo | " if has_pn else "") + \
           "train: this library | " + ("train: PhysicsNeMo | " if has_pn else "") + "fwd ms (local / ours" + \
           (" / PN" if has_pn else "") + ") | train ms (local / ours" + (" / PN" if has_pn else "") + ") |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r['dims']}-D {r['shape'][2:]}", f"{r['load_avg_at_start'][0] if r['load_avg_at_start'] else '?'}"]
        for mode in ("fwd", "train"):
            for v in ("sharded",) + (("physicsnemo",) if has_pn else ()):
                if v in r[mode]:
                    med, (lo, hi) = summary(r[mode], v)
                    cells.append(f"{med:.2f} [{lo:.2f}–{hi:.2f}]")
                else:
                    cells.append("—")
        for mode in ("fwd", "train"):
            ms = [statistics.median(r[mode][v]) * 1e3 for v in ("local", "sharded", "physicsnemo") if v in r[mode]]
            cells.append(" / ".join(f"{t:.1f}" for t in ms))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes2d", default="256,512,1024", help="2-D spatial sizes (square), comma-separated")
    ap.add_argument("--sizes3d", default="32,64", help="3-D spatial sizes (cube), comma-separated ('' for none)")
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calls", type=int, default=1,
                    help="consecutive calls per sample (its time: their mean): > 1 times a rank's sustained step, the "
                         "ranks' skew at the sample's barrier spread over the calls")
    ap.add_argument("--malloc", choices=("retain", "default"), default="retain",
                    help="retain: glibc keeps freed memory mapped (bench_util.retain_freed_memory), so no variant "
                         "re-faults its activations every step by chance of heap layout; default: glibc's settings")
    ap.add_argument("--no-physicsnemo", action="store_true", help="leave PhysicsNeMo out even when importable")
    ap.add_argument("--plot-only", action="store_true", help="re-render the table from the JSON in --out")
    ap.add_argument("--tag", default="", help="suffix of the result files (halo_conv_compare_TAG.*), for runs kept side by side")
    add_out_argument(ap)
    args = ap.parse_args()
    prepare(args.out, measuring=not args.plot_only)
    name = "halo_conv_compare" + (f"_{args.tag}" if args.tag else "")
    json_path = os.path.join(args.out, name + ".json")
    if args.plot_only:
        with open(json_path) as f:
            data = json.load(f)
    else:
        args.sizes2d = [int(s) for s in args.sizes2d.split(",") if s]
        args.sizes3d = [int(s) for s in args.sizes3d.split(",") if s]
        load_start = loadavg()
        rows = spawn_rank0_rows(run_rank, args.ranks, os.path.join(args.out, f".{name}.json"), args)
        cmd = ".venv/bin/python benchmarks/halo_conv/compare.py " + " ".join(sys.argv[1:])
        meta = {"command": cmd.strip(), "ranks": args.ranks, "channels": args.channels, "layers": args.layers,
                "samples": args.samples, "torch": torch.__version__, "commit": git("rev-parse", "--short", "HEAD"),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "cpu_count": os.cpu_count(), "load_avg_start": load_start, "load_avg_end": loadavg(),
                "shm_bytes": st.shm_capacity(),
                "malloc": args.malloc, "calls": args.calls}
        data = {"meta": meta, "rows": rows}
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
    text = render(data["rows"], data["meta"])
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
