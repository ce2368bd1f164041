"""Sequence-parallel attention: F.scaled_dot_product_attention with (B, H, S, D) q/k/v sharded along S on N ranks
(CPU Gloo by default; --device cuda on GPUs), sweeping the sequence length.

For each S, causal and non-causal: the ring strategy (K/V blocks travel around the ranks, log-sum-exp merge;
causal attention in the balanced zigzag layout), the contiguous ring (no zigzag) and
the head-parallel all-to-all strategy (sequence shards -> head shards, local attention, back) against the
single-device computation on the full tensors; forward and forward+backward latency (median after warm-up, max
over ranks), per-rank peak memory of a forward+backward step (allocator peak from st.peak_memory's allocator tracker on CPU,
max_memory_allocated on CUDA) against the single-device peak, and the collectives and bytes per call
(st.CommCounter). Before timing, the smallest size is checked against the single-device output and gradients.
Writes ring_attention.{json,md,png} into --out (default: the git-ignored benchmarks/results/local; --out
benchmarks/results updates the committed results, from a clean tree only).

    .venv/bin/python benchmarks/ring_attention/bench.py [--ranks 2] [--device cpu] [--sizes 256,512,...] [--quick]
    .venv/bin/python benchmarks/ring_attention/bench.py --plot-only --out benchmarks/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import socket
import statistics
import subprocess
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import shardtensor as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import peak_bytes  # noqa: E402
from results_dir import add_caveat, add_out_argument, load_caveat, prepare, spread  # noqa: E402
from scaling.launch import backend_for  # noqa: E402

STRATEGIES = ("ring", "ring_contiguous", "all_to_all")
DEFAULT_SIZES = (256, 512, 1024, 2048, 4096)
QUICK_SIZES = (256, 512, 1024)

try:
    from tqdm import tqdm
except ImportError:  # optional
    tqdm = None


def iters_for(size: int) -> int:
    """Timed iterations: a function of S only, so every rank runs the same number of collectives."""
    return 7 if size <= 512 else 5 if size <= 1024 else 3


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters, warmup=1, barrier=True, samples=None):
    for _ in range(warmup):
        fn()
    sync(device)
    samples = [] if samples is None else samples
    for _ in range(iters):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)




def make_inputs(args, size, device):
    g = torch.Generator().manual_seed(size)
    shape = (args.batch, args.heads, size, args.head_dim)
    q, k, v, go = (torch.randn(shape, generator=g).to(device) for _ in range(4))
    return q, k, v, go


def attention(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def check(args, mesh, device, size):
    """Sharded output and q/k/v gradients against single device, for every strategy, causal or not."""
    q, k, v, go = make_inputs(args, size, device)
    lay = [st.Shard(2)]
    worst = {}
    for causal in (False, True):
        ref_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        ref = attention(*ref_leaves, causal)
        ref.backward(go)
        for strategy in STRATEGIES:
            leaves = [st.distribute_tensor(t, mesh, lay).detach().requires_grad_(True) for t in (q, k, v)]
            with st.use_attention_strategy(strategy):
                out = attention(*leaves, causal)
                out.backward(st.distribute_tensor(go, mesh, lay))
            got = [st.full_tensor(out.detach())] + [st.full_tensor(t.grad) for t in leaves]
            want = [ref.detach()] + [t.grad for t in ref_leaves]
            err = 0.0
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                    raise AssertionError(f"{strategy} causal={causal} S={size}: {name} differs from single device "
                                         f"by {(a - b).abs().max().item():.3g}")
                err = max(err, (a - b).abs().max().item())
            worst[f"{strategy}{'_causal' if causal else ''}"] = err
    return worst


def run_rank(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())  # ranks may share a GPU (Gloo staging)
        torch.cuda.set_device(device)
        # NCCL refuses two ranks on one GPU: plain Gloo then, and the library stages through host memory.
        dist.init_process_group(backend_for(device, world), rank=rank, world_size=world)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("seq",))
    lay = [st.Shard(2)]

    check_err = check(args, mesh, device, args.sizes[0])
    if rank == 0:
        print(f"correctness at S={args.sizes[0]}: max abs error vs single device "
              + ", ".join(f"{k} {v:.2g}" for k, v in check_err.items()), flush=True)

    total = len(args.sizes) * 2 * (len(STRATEGIES) + 1)
    bar = tqdm(total=total, desc="ring_attention", unit="case") if (tqdm and rank == 0) else None
    rows = []
    for size in args.sizes:
        iters = iters_for(size)
        q, k, v, go = make_inputs(args, size, device)
        qs, ks, vs, gos = (st.distribute_tensor(t, mesh, lay) for t in (q, k, v, go))
        for causal in (False, True):
            for strategy in STRATEGIES:
                if bar:
                    bar.set_postfix_str(f"S={size} causal={causal} {strategy}")
                leaves = [t.detach().requires_grad_(True) for t in (qs, ks, vs)]

                def fwd():
                    with torch.no_grad():
                        attention(qs, ks, vs, causal)

                def clear():
                    for t in leaves:
                        t.grad = None

                def step():
                    clear()
                    attention(*leaves, causal).backward(gos)

                with st.use_attention_strategy(strategy):
                    with st.CommCounter() as cf:
                        fwd()
                    with st.CommCounter() as cs:
                        step()
                    fs, ss = [], []
                    row = {"size": size, "causal": causal, "strategy": strategy,
                           "fwd_s": timed(fwd, device, iters, samples=fs), "step_s": timed(step, device, iters, samples=ss),
                           "fwd_range_s": spread(fs), "step_range_s": spread(ss),
                           "peak_bytes": peak_bytes(step, device, clear),
                           "fwd_calls": cf.calls, "fwd_bytes": cf.bytes, "step_calls": cs.calls, "step_bytes": cs.bytes}
                gathered = [None] * world
                dist.all_gather_object(gathered, row)
                if rank == 0:
                    merged = dict(gathered[0])
                    for key in ("fwd_s", "step_s", "peak_bytes"):
                        merged[key] = max(g[key] for g in gathered)
                    for key in ("fwd_range_s", "step_range_s"):  # max over ranks, like the medians
                        merged[key] = [max(g[key][0] for g in gathered), max(g[key][1] for g in gathered)]
                    merged["peak_bytes_per_rank"] = [g["peak_bytes"] for g in gathered]
                    merged["fwd_s_per_rank"] = [g["fwd_s"] for g in gathered]
                    merged["step_s_per_rank"] = [g["step_s"] for g in gathered]
                    rows.append(merged)
                if bar:
                    bar.update()
            # The single-device computation on the full tensors, on rank 0 while the others wait.
            if rank == 0:
                if bar:
                    bar.set_postfix_str(f"S={size} causal={causal} single")
                leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

                def fwd_single():
                    with torch.no_grad():
                        attention(q, k, v, causal)

                def clear_single():
                    for t in leaves:
                        t.grad = None

                def step_single():
                    clear_single()
                    attention(*leaves, causal).backward(go)

                fs, ss = [], []
                rows.append({"size": size, "causal": causal, "strategy": "single",
                             "fwd_s": timed(fwd_single, device, iters, barrier=False, samples=fs),
                             "step_s": timed(step_single, device, iters, barrier=False, samples=ss),
                             "fwd_range_s": spread(fs), "step_range_s": spread(ss),
                             "peak_bytes": peak_bytes(step_single, device, clear_single),
                             "fwd_calls": {}, "fwd_bytes": {}, "step_calls": {}, "step_bytes": {}})
                if bar:
                    bar.update()
            dist.barrier()
    if bar:
        bar.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "check_max_abs_err": check_err, "check_size": args.sizes[0]}, f)
    dist.destroy_process_group()


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def fmt_calls(calls: dict, nbytes: dict) -> str:
    if not calls:
        return "-"
    return ", ".join(f"{k} {calls[k]} ({fmt_bytes(nbytes.get(k, 0))})" for k in sorted(calls))


def find(rows, size, causal, strategy):
    for r in rows:
        if r["size"] == size and r["causal"] == causal and r["strategy"] == strategy:
            return r
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="Gloo ranks to spawn")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where q, k, v live")
    ap.add_argument("--sizes", default=None, help="comma-separated sequence lengths (default "
                    + ",".join(map(str, DEFAULT_SIZES)) + "; --quick: " + ",".join(map(str, QUICK_SIZES)) + ")")
    ap.add_argument("--batch", type=int, default=1, help="B")
    ap.add_argument("--heads", type=int, default=4, help="H")
    ap.add_argument("--head-dim", type=int, default=32, help="D")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (and for single device)")
    ap.add_argument("--quick", action="store_true", help=f"sizes {','.join(map(str, QUICK_SIZES))}")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON recorded in --out")
    add_out_argument(ap)
    args = ap.parse_args()
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    prepare(args.out, measuring=not args.plot_only)
    if args.plot_only:
        with open(os.path.join(args.out, f"ring_attention{suffix}.json")) as f:
            data = json.load(f)
        plot(data["rows"], data["meta"], suffix, args.out)
        return
    args.sizes = sorted(int(s) for s in args.sizes.split(",")) if args.sizes else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"note: {args.ranks} ranks share {torch.cuda.device_count()} GPU(s); collectives stage through host "
              "memory over Gloo, so timings are not representative (per-rank memory is)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = os.path.join(args.out, f".ring_attention_{args.device}.json")
    load_start = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    mp.spawn(run_rank, args=(args.ranks, port, args, tmp), nprocs=args.ranks, join=True)
    wall = time.perf_counter() - t0
    with open(tmp) as f:
        out = json.load(f)
    os.remove(tmp)
    rows = out["rows"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    cmd = f".venv/bin/python benchmarks/ring_attention/bench.py --ranks {args.ranks} --device {args.device}"
    if args.quick:
        cmd += " --quick"
    elif args.sizes != list(DEFAULT_SIZES):
        cmd += " --sizes " + ",".join(map(str, args.sizes))
    for flag, val, default in (("--batch", args.batch, 1), ("--heads", args.heads, 4), ("--head-dim", args.head_dim, 32),
                               ("--threads", args.threads, 1)):
        if val != default:
            cmd += f" {flag} {val}"
    meta = {"command": cmd, "ranks": args.ranks, "device": args.device, "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "threads_per_rank": args.threads, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
            "dtype": "float32", "sizes": args.sizes, "wall_s": round(wall, 1),
            "check_size": out["check_size"], "check_max_abs_err": out["check_max_abs_err"],
            "cpu_count": os.cpu_count(), "load_avg_start": load_start,
            "load_avg_end": [round(x, 2) for x in os.getloadavg()]}
    with open(os.path.join(args.out, f"ring_attention{suffix}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    write_markdown(rows, meta, suffix, args.out)
    plot(rows, meta, suffix, args.out)


def load_note(meta) -> str:
    """The machine's load during the run, and a warning when other processes competed for the cores."""
    start, end, cores = meta.get("load_avg_start"), meta.get("load_avg_end"), meta.get("cpu_count")
    if not start:
        return "Load average of the machine not recorded."
    note = (f"Load average (1, 5, 15 min) of the machine: {start} at the start, {end} at the end (the ranks "
            f"themselves add up to {meta['ranks']}), {cores} cores.")
    if meta["device"] == "cpu" and start[0] > 0.5 * cores:
        note += (f" **Timings may be noisy**: the 1-minute load was already {start[0]:.1f} when the run started "
                 "(other jobs, or a run just before); read the ratios as rough, not precise.")
    return note


def write_markdown(rows, meta, suffix, out):
    n = meta["ranks"]
    shape = f"(B={meta['batch']}, H={meta['heads']}, S, D={meta['head_dim']})"
    lines = [f"# Sequence-parallel attention (ring, contiguous ring, all-to-all) on {n} {meta['device']} ranks", "",
             f"`F.scaled_dot_product_attention` on {meta['dtype']} q/k/v of shape {shape}, sharded evenly along S "
             f"(`Shard(2)`) on {n} ranks, against the single-device computation on the full tensors (one process). "
             f"torch {meta['torch']}, commit {meta['commit']}, {meta['date']}, {meta['threads_per_rank']} thread(s) "
             f"per rank and for single device. Command: `{meta['command']}` (whole run {meta['wall_s']} s).", "",
             f"Correctness checked first at S={meta['check_size']} (outputs and q/k/v gradients of every strategy, "
             f"causal and not, against single device; max abs error "
             f"{max(meta['check_max_abs_err'].values()):.2g}).", "",
             "Times: median after one warm-up (7 iterations up to S=512, 5 up to 1024, 3 beyond; a barrier before "
             "each), max over ranks. fwd+bwd = forward and `backward` with a given output gradient. ratio = sharded "
             f"time / single-device time (ideal 1/{n} = {1 / n:.2f}, ignoring communication). Memory = allocator "
             "peak of one fwd+bwd step above the inputs, max over ranks / single device "
             f"(ideal 1/{n}). Collectives = kind, calls per rank per call of the op (bytes sent by this rank), "
             "forward / forward+backward.", "",
             "Memory is measured by `st.peak_memory` (c10's CPU allocator reports, without the profiler) or max_memory_allocated "
             "(CUDA). On the CPU both sides use PyTorch's flash kernels forward and backward (the sharded path for "
             "its fully visible blocks and aligned causal diagonal blocks, docs/attention.md), so no S-by-S score "
             "matrix is materialized and both peaks grow linearly in S. The per-rank peak is still not 1/n of the "
             "single-device one: a rank also holds the visiting K/V block and the dK/dV accumulators that travel "
             "with it (ring), the permuted copies of q, k, v and the output gradient (zigzag causal ring), or "
             "full-sequence head-sharded copies (all-to-all).", "",
             load_note(meta), "",
             "| S | causal | strategy | fwd ms | fwd+bwd ms | fwd ratio | fwd+bwd ratio | peak mem / rank | mem / single | collectives fwd | collectives fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for size in meta["sizes"]:
        for causal in (False, True):
            single = find(rows, size, causal, "single")
            for strategy in ("single",) + STRATEGIES:
                r = find(rows, size, causal, strategy)
                if r is None:
                    continue
                if strategy == "single":
                    ratios = ("1", "1", fmt_bytes(r["peak_bytes"]), "1")
                else:
                    ratios = (f"{r['fwd_s'] / single['fwd_s']:.2f}", f"{r['step_s'] / single['step_s']:.2f}",
                              fmt_bytes(r["peak_bytes"]), f"{r['peak_bytes'] / max(single['peak_bytes'], 1):.2f}")
                lines.append(f"| {size} | {'yes' if causal else 'no'} | {strategy} | {r['fwd_s'] * 1e3:.1f} | "
                             f"{r['step_s'] * 1e3:.1f} | {ratios[0]} | {ratios[1]} | {ratios[2]} | {ratios[3]} | "
                             f"{fmt_calls(r['fwd_calls'], r['fwd_bytes'])} | {fmt_calls(r['step_calls'], r['step_bytes'])} |")
    with open(os.path.join(out, f"ring_attention{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _bars_ms(sel, key):
    """Error bars: the range of the timed iterations around the median (None for results recorded without it)."""
    if not all(key + "_range_s" in r for r in sel):
        return None
    return [[(r[key + "_s"] - r[key + "_range_s"][0]) * 1e3 for r in sel],
            [(r[key + "_range_s"][1] - r[key + "_s"]) * 1e3 for r in sel]]


def plot(rows, meta, suffix, out):
    ranks = meta["ranks"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    sizes = sorted({r["size"] for r in rows})
    style = {"single": ("k", "o"), "ring": ("tab:blue", "s"), "ring_contiguous": ("tab:green", "v"), "all_to_all": ("tab:orange", "^")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for causal, ls in ((False, "-"), (True, "--")):
        for strategy in ("single",) + STRATEGIES:
            sel = [find(rows, s, causal, strategy) for s in sizes]
            if any(r is None for r in sel):
                continue
            color, marker = style[strategy]
            label = f"{'single device' if strategy == 'single' else strategy}{' causal' if causal else ''}"
            axes[0].errorbar(sizes, [r["fwd_s"] * 1e3 for r in sel], yerr=_bars_ms(sel, "fwd"), ls=ls, marker=marker,
                             color=color, capsize=3, label=label)
            axes[1].errorbar(sizes, [r["step_s"] * 1e3 for r in sel], yerr=_bars_ms(sel, "step"), ls=ls,
                             marker=marker, color=color, capsize=3, label=label)
            axes[2].plot(sizes, [r["peak_bytes"] / 2**20 for r in sel], ls=ls, marker=marker, color=color,
                         label=label + ("" if strategy == "single" else " (per rank)"))
    axes[0].set(title=f"forward ({ranks} ranks)", ylabel="ms (median, max over ranks; bars: range)")
    axes[1].set(title=f"forward + backward ({ranks} ranks)", ylabel="ms (median, max over ranks; bars: range)")
    axes[2].set(title="peak memory of fwd+bwd", ylabel="MiB (allocator peak)")
    for a in axes:
        a.set(xlabel="sequence length S")
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.grid(True, which="both", lw=0.3)
        a.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    add_caveat(fig, load_caveat(meta.get("load_avg_start"), meta.get("load_avg_end"), meta.get("cpu_count")))
    fig.savefig(os.path.join(out, f"ring_attention{suffix}.png"), dpi=110)


if __name__ == "__main__":
    main()
