"""Halo-exchange overhead of sharded convolution stacks, on N ranks (CPU Gloo by default; --device cuda on GPUs).

For each size: the sharded stack (halo exchange + local convolutions) against the same local computation on the
rank's own rows without any communication (what the halo costs), forward and forward+backward; and per-rank
peak memory of a training step (allocator peak from the profiler on CPU, max_memory_allocated on CUDA) against
the single-device step. Writes halo_conv.{json,md,png} into --out (default: the git-ignored
benchmarks/results/local; --out benchmarks/results updates the committed results, from a clean tree only).

    .venv/bin/python benchmarks/halo_conv/bench.py [--ranks 2] [--device cpu] [--quick] [--out DIR]
    .venv/bin/python benchmarks/halo_conv/bench.py --simulate 8 [--sim-device meta] [--sizes 2048]   # rank r of 8 here
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import socket
import subprocess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import shardtensor as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import init_cpu_rank, peak_bytes, timed  # noqa: E402
from results_dir import add_caveat, add_out_argument, load_caveat, loadavg, prepare, spread  # noqa: E402


def timed_range(fn, **kw):
    """(median, [min, max]) of the timed iterations."""
    samples = []
    return timed(fn, samples=samples, **kw), spread(samples)


def stack(dims: int, channels: int) -> nn.Module:
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    return nn.Sequential(conv(channels, channels, 3, padding=1), nn.GELU(), conv(channels, channels, 5, padding=2),
                         nn.GELU(), conv(channels, channels, 3, padding=2, dilation=2))


def cases(quick: bool):
    two = [(2, 8, s) for s in ((64, 128) if quick else (64, 128, 256))]
    three = [(3, 4, s) for s in ((16, 24) if quick else (16, 24, 32))]
    return two + three






def run_rank(rank, world, port, args, out_path):
    # Ranks may share a GPU (collectives then stage through host memory over Gloo).
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_cpu_rank(rank, world, port)
    rows = []
    for dims, channels, size in cases(args.quick):
        torch.manual_seed(0)
        net = stack(dims, channels).to(device)
        shape = (1, channels) + (size,) * dims
        x = torch.randn(shape, device=device)
        xs = st.distribute_tensor(x, mesh, [st.Shard(2)])
        local = st.to_local(xs).clone()

        def fwd_sharded():
            with torch.no_grad():
                net(xs)

        def fwd_local():
            with torch.no_grad():
                net(local)

        def step(inp):
            def go():
                net.zero_grad(set_to_none=True)
                y = net(inp)
                (y * y).mean().backward() if not st.is_shard_tensor(y) else y.square().mean().backward()
            return go

        leaf = xs.detach().requires_grad_(True)
        local_leaf = local.detach().requires_grad_(True)
        row = {"dims": dims, "channels": channels, "size": size, "shape": list(shape)}
        for key, fn in (("fwd_sharded", fwd_sharded), ("fwd_local", fwd_local), ("train_sharded", step(leaf)),
                        ("train_local", step(local_leaf))):
            row[key + "_s"], row[key + "_range_s"] = timed_range(fn)
        row["peak_sharded_bytes"] = peak_bytes(step(leaf), device)
        row["fwd_peak_sharded_bytes"] = peak_bytes(fwd_sharded, device)
        dist.barrier()
        if rank == 0:
            row["peak_single_bytes"] = peak_bytes(step(x.detach().requires_grad_(True)), device)

            def fwd_single():
                with torch.no_grad():
                    net(x)
            row["fwd_peak_single_bytes"] = peak_bytes(fwd_single, device)
            row["train_single_s"] = timed(step(x.detach().requires_grad_(True)), iters=3)
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        if rank == 0:
            merged = dict(gathered[0])
            for k in ("fwd_sharded_s", "fwd_local_s", "train_sharded_s", "train_local_s", "peak_sharded_bytes",
                      "fwd_peak_sharded_bytes"):
                merged[k] = max(g[k] for g in gathered)
            # per-rank / ideal (single / P): 1 = a perfect split of the pass's temporaries and activations
            merged["P_times_peak_over_single"] = world * merged["peak_sharded_bytes"] / max(merged["peak_single_bytes"], 1)
            merged["fwd_P_times_peak_over_single"] = \
                world * merged["fwd_peak_sharded_bytes"] / max(merged["fwd_peak_single_bytes"], 1)
            for k in ("fwd_sharded_range_s", "fwd_local_range_s", "train_sharded_range_s", "train_local_range_s"):
                merged[k] = [max(g[k][0] for g in gathered), max(g[k][1] for g in gathered)]  # max over ranks
            rows.append(merged)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def simulate_cases(args):
    """``--simulate P[,rank]``: each case as simulated ranks of P (shardtensor.simulate, one process): per rank the
    local FLOPs, the halo bytes (edge ranks send one side), peak memory and, on --sim-device cpu, the local time."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    import warnings
    from benchmarks.scaling.simulation import _pass, _time, parse_simulate, ranks_for
    from benchmarks.scaling.report import fmt_bytes, fmt_comm

    torch.set_num_threads(1)
    rows = []
    todo = cases(args.quick) if not args.sizes else [(2, 8, int(s)) for s in args.sizes.split(",")]
    for dims, channels, size in todo:
        for P, rank in parse_simulate(args.simulate):
            for r in ranks_for(P, rank, args.sim_ranks):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", st.SimulationWarning)
                    with st.simulate(r, P, device=args.sim_device) as sim:
                        torch.manual_seed(0)
                        net = stack(dims, channels)
                        shape = (1, channels) + (size,) * dims
                        x = sim.shard(shape, [st.Shard(2)], requires_grad=True) if P > 1 else \
                            torch.randn(shape, requires_grad=True)

                        def fwd():
                            with torch.no_grad():
                                net(x)

                        def step():
                            net.zero_grad(set_to_none=True)
                            net(x).square().mean().backward()

                        step()
                        row = {"dims": dims, "channels": channels, "size": size, "shape": list(shape), "ranks": P,
                               "rank": r, "sim_device": args.sim_device, "fwd": _pass(fwd), "step": _pass(step)}
                        if args.sim_device == "cpu":
                            row["fwd"]["time"] = _time(fwd, 3, 1)
                            row["step"]["time"] = _time(step, 3, 1)
                rows.append(row)
                print(f"{dims}-D {shape} P={P} rank {r}: train {row['step']['flops'] / 1e9:.2f} GFLOP, sent "
                      f"{fmt_comm(row['step']['comm'])}, peak {fmt_bytes(row['step']['peak_bytes'])}" +
                      (f", {row['step']['time']['median'] * 1e3:.1f} ms" if "time" in row["step"] else ""), flush=True)
    path = os.path.join(args.out, f"halo_conv_sim_{args.sim_device}.json")
    meta = {"command": "python benchmarks/halo_conv/bench.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
            "note": "simulated ranks (shardtensor.simulate): no data moved, values garbage"}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="Gloo ranks to spawn")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the local tensors live")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (CI-sized)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="synchronous halo exchange (SHARDTENSOR_HALO_OVERLAP=0), to measure what the overlap gains")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON recorded in --out")
    ap.add_argument("--simulate", action="append", default=None, metavar="P[,RANK]",
                    help="simulate rank RANK (default: --sim-ranks) of P in this process (shardtensor.simulate)")
    ap.add_argument("--sim-device", default="meta", choices=["cpu", "meta"], help="simulated local tensors")
    ap.add_argument("--sim-ranks", default="edges", help="'edges' (0, 1, P//2, P-1), 'all' or a list")
    ap.add_argument("--sizes", default=None, help="with --simulate: 2-D sizes (square), comma-separated")
    add_out_argument(ap)
    args = ap.parse_args()
    if args.simulate:
        prepare(args.out)
        return simulate_cases(args)
    suffix = ("" if args.device == "cpu" else f"_{args.device}") + ("_no_overlap" if args.no_overlap else "")
    prepare(args.out, measuring=not args.plot_only)
    if args.plot_only:
        with open(os.path.join(args.out, f"halo_conv{suffix}.json")) as f:
            data = json.load(f)
        plot(data["rows"], args, suffix, data["meta"])
        return
    if args.no_overlap:
        os.environ["SHARDTENSOR_HALO_OVERLAP"] = "0"  # inherited by the spawned ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = os.path.join(args.out, f".halo_conv_{args.device}.json")
    load_start = loadavg()
    mp.spawn(run_rank, args=(args.ranks, port, args, tmp), nprocs=args.ranks, join=True)
    with open(tmp) as f:
        rows = json.load(f)
    os.remove(tmp)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cmd = (f".venv/bin/python benchmarks/halo_conv/bench.py --ranks {args.ranks} --device {args.device}"
           + (" --quick" if args.quick else "") + (" --no-overlap" if args.no_overlap else ""))
    meta = {"command": cmd, "ranks": args.ranks, "device": args.device, "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "threads_per_rank": 1,
            "cpu_count": os.cpu_count(), "load_avg_start": load_start, "load_avg_end": loadavg()}
    with open(os.path.join(args.out, f"halo_conv{suffix}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Halo-exchange convolution stacks on {args.ranks} {args.device} ranks", "",
             f"Conv stack (k3, k5, k3 dilated) sharded along dim 2; max over ranks; torch {torch.__version__}, commit "
             f"{commit}, {meta['date']}, 1 thread per rank. Command: `{cmd}`.", "",
             "halo overhead = sharded time / the same layers on the rank's own rows without communication; memory = "
             "per-rank allocator peak of a training step (inference: a no_grad forward) above the live parameters "
             "and input / the single-device peak; "
             f"P × that = per-rank / ideal (single / P), 1.00 a perfect split, above it the halo rows and the "
             "windows the convolution regathers (max over ranks).", "",
             "| dims | input | fwd halo overhead | train halo overhead | train time sharded / single | peak memory per rank / single | P × per-rank peak / single | inference: P × per-rank peak / single |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dims']}-D | {r['shape']} | {r['fwd_sharded_s'] / r['fwd_local_s']:.2f}x | "
                     f"{r['train_sharded_s'] / r['train_local_s']:.2f}x | {r['train_sharded_s'] / r['train_single_s']:.2f} | "
                     f"{r['peak_sharded_bytes'] / max(r['peak_single_bytes'], 1):.2f} | "
                     f"{r['P_times_peak_over_single']:.2f} | {r['fwd_P_times_peak_over_single']:.2f} |")
    with open(os.path.join(args.out, f"halo_conv{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args, suffix, meta)


def _ratio_bars(sel, key):
    """Error bars of sharded / local: the range of the sharded timings over the local median."""
    if not all(key + "_range_s" in r for r in sel):
        return None
    base = [r[key.replace("sharded", "local") + "_s"] for r in sel]
    return [[(r[key + "_s"] - r[key + "_range_s"][0]) / b for r, b in zip(sel, base)],
            [(r[key + "_range_s"][1] - r[key + "_s"]) / b for r, b in zip(sel, base)]]


def plot(rows, args, suffix, meta):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for dims in (2, 3):
            sel = [r for r in rows if r["dims"] == dims]
            if not sel:
                continue
            sizes = [r["size"] for r in sel]
            axes[0].errorbar(sizes, [r["fwd_sharded_s"] / r["fwd_local_s"] for r in sel],
                             yerr=_ratio_bars(sel, "fwd_sharded"), fmt="o-", capsize=3, label=f"{dims}-D forward")
            axes[0].errorbar(sizes, [r["train_sharded_s"] / r["train_local_s"] for r in sel],
                             yerr=_ratio_bars(sel, "train_sharded"), fmt="s--", capsize=3, label=f"{dims}-D train step")
            axes[1].plot(sizes, [r["peak_sharded_bytes"] / max(r["peak_single_bytes"], 1) for r in sel], "o-", label=f"{dims}-D")
        axes[0].axhline(1.0, color="gray", lw=0.8)
        axes[0].set(xlabel="spatial size per dim", ylabel="time / local compute without halo",
                    title="halo overhead (bars: range of the sharded timings)")
        axes[1].axhline(1.0 / args.ranks, color="gray", lw=0.8, ls=":", label=f"ideal 1/{args.ranks}")
        axes[1].set(xlabel="spatial size per dim", ylabel="per-rank peak / single device", title="memory per rank")
        for a in axes:
            a.legend()
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        add_caveat(fig, load_caveat(meta.get("load_avg_start"), meta.get("load_avg_end"), meta.get("cpu_count")))
        fig.savefig(os.path.join(args.out, f"halo_conv{suffix}.png"), dpi=110)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
