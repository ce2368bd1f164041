"""grid_sample over a spatially split volume (a registration network's warp): what travels and what it costs, at 1,
2 and 4 CPU ranks against one process, counted by shardtensor.CommCounter and shardtensor.peak_memory.

A 3-D volume (1, C, n, n, n) split along D is warped by a displacement field split alike (the identity grid plus a
displacement of at most `--shift` voxels, VoxelMorph's case) and by a grid that points anywhere (the worst case: each
rank reads what its points need, up to the whole input). Per case: the collectives and bytes of rank 0, the input
rows its window holds against its own rows, the forward + backward time of the sharded call against the same
kernel on the rank's own block without communication (local-only), and the per-rank peak memory against one process.

    .venv/bin/python benchmarks/grid_sample/bench.py [--out DIR] [--size 32] [--channels 8] [--shift 2]

DIR defaults to the git-ignored benchmarks/results/local; --out benchmarks/results updates the committed results
(from a clean tree only). Writes grid_sample.json and grid_sample.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_util import format_collectives as fmt  # noqa: E402
from bench_util import init_cpu_rank, reduce_over_ranks, spawn_rank0_rows, timed, write_rank0_rows  # noqa: E402
from bench_util import write_report  # noqa: E402
from results_dir import add_out_argument, git, prepare  # noqa: E402


def identity_grid(n):
    axis = (torch.arange(n, dtype=torch.float32) * 2 + 1) / n - 1   # align_corners=False voxel centres
    d, h, w = torch.meshgrid(axis, axis, axis, indexing="ij")
    return torch.stack((w, h, d), -1).unsqueeze(0)


def grids(n, shift):
    g = torch.Generator().manual_seed(3)
    warp = identity_grid(n) + (torch.rand(1, n, n, n, 3, generator=g) * 2 - 1) * (2 * shift / n)
    anywhere = torch.rand(1, n, n, n, 3, generator=g) * 2 - 1
    return [(f"warp (displacement <= {shift} voxels)", warp), ("grid pointing anywhere", anywhere)]


def run(rank, world, port, out_path, c, n, shift):
    mesh = init_cpu_rank(rank, world, port)
    x = torch.randn(1, c, n, n, n, generator=torch.Generator().manual_seed(1))
    rows = []
    for name, grid in grids(n, shift):
        xs = st.distribute_tensor(x, mesh, [st.Shard(2)]).requires_grad_()
        gs = st.distribute_tensor(grid, mesh, [st.Shard(1)]).requires_grad_()

        def step():
            F.grid_sample(xs, gs, align_corners=False).square().mean().backward()

        with st.CommCounter() as cc:
            out = F.grid_sample(xs, gs, align_corners=False)
        err = ((out.full_tensor() - F.grid_sample(x, grid, align_corners=False)).abs().max()).item()
        own = xs.to_local().shape[2]
        # The window this rank's points read: the rows of the (single) halo exchange it received, plus its own.
        window_rows = own + (cc.bytes.get("halo", 0) // (c * n * n * 4) if world > 1 else 0)
        xl = xs.to_local().detach().requires_grad_()
        gl = gs.to_local().detach().requires_grad_()

        def local_step():
            F.grid_sample(xl, gl, align_corners=False).square().mean().backward()

        t_sharded = reduce_over_ranks(timed(step))
        t_local = reduce_over_ranks(timed(local_step))
        peak = st.peak_memory(step)
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        single = None
        if rank == 0:
            xr, gr = x.clone().requires_grad_(), grid.clone().requires_grad_()
            single = st.peak_memory(lambda: F.grid_sample(xr, gr, align_corners=False).square().mean().backward())
        rows.append({"case": name, "calls": cc.calls, "bytes": cc.bytes, "own_rows": own, "window_rows": window_rows,
                     "seconds_sharded": t_sharded, "seconds_local_only": t_local, "peak_bytes_per_rank": peaks,
                     "single_peak_bytes": single, "max_abs_error": err})
    write_rank0_rows(rank, rows, out_path)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_out_argument(ap)
    ap.add_argument("--size", type=int, default=32, help="volume side n (n x n x n)")
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--shift", type=float, default=2.0, help="largest displacement of the warp, in voxels")
    ap.add_argument("--ranks", default="1,2,4", help="world sizes to run")
    args = ap.parse_args()
    out = prepare(args.out)
    results = {world: spawn_rank0_rows(run, world, os.path.join(out, f".grid_sample_rank0_{world}.json"),
                                       args.channels, args.size, args.shift)
               for world in [int(w) for w in args.ranks.split(",")]}
    commit = git("rev-parse", "--short", "HEAD")
    load = os.getloadavg()[0]
    command = (f"python benchmarks/grid_sample/bench.py --size {args.size} --channels {args.channels} "
               f"--shift {args.shift:g} --ranks {args.ranks}")
    meta = {"command": command, "torch": torch.__version__, "commit": commit, "load_1min": load,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    n, c = args.size, args.channels
    lines = ["# grid_sample over a split volume", "",
             f"A (1, {c}, {n}, {n}, {n}) float32 volume split along D over P Gloo ranks (one intra-op thread each), "
             f"warped by a grid split alike; forward + backward of `F.grid_sample(..., align_corners=False)` and a "
             f"mean-square loss. torch {torch.__version__}, commit {commit}, {meta['date']}, 1-minute load "
             f"{load:.1f} on 2 cores. Command: `{command}`. Collectives and bytes: rank 0's forward (the range "
             "all-gather and the halo exchange). Window: the input rows rank 0's points read (its own block and the "
             "halo). Times: the median of 7, the slowest rank; local-only is the same kernel on the rank's own "
             "block and grid, no communication (the compute a divided step cannot avoid).", ""]
    for world, res in results.items():
        lines += [f"## P = {world}", "",
                  "| grid | forward collectives | rank 0 rows: own / window | step sharded | local-only | ratio "
                  "| peak per rank / one process | max abs error |", "|---|---|---|---|---|---|---|---|"]
        for r in res:
            peak = max(r["peak_bytes_per_rank"]) / r["single_peak_bytes"]
            lines.append(f"| {r['case']} | {fmt(r['calls'], r['bytes'])} | {r['own_rows']} / {r['window_rows']} | "
                         f"{r['seconds_sharded'] * 1e3:.1f} ms | {r['seconds_local_only'] * 1e3:.1f} ms | "
                         f"{r['seconds_sharded'] / r['seconds_local_only']:.2f} | {peak:.2f} | "
                         f"{r['max_abs_error']:.1e} |")
        lines.append("")
    write_report(out, "grid_sample", {"meta": meta, "results": results}, lines)


if __name__ == "__main__":
    main()
