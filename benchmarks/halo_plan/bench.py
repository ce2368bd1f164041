"""Collectives and time per training step of layer stacks on the halo planner, to compare two builds of the library.

Each run measures the library it imports (select a build with PYTHONPATH) and writes its rows to --json; --compare
merges two such files into a Markdown table. Per workload and rank: the library's collectives (kind, calls, bytes
as st.CommCounter counts them) in the forward and in the backward of one training step (zero_grad, forward,
y.square().mean(), backward), and the median step time (max over ranks), of a no_grad forward too.

    PYTHONPATH=/path/to/before/python .venv/bin/python benchmarks/halo_plan/bench.py --json before.json --label before
    PYTHONPATH=python .venv/bin/python benchmarks/halo_plan/bench.py --json after.json --label after
    .venv/bin/python benchmarks/halo_plan/bench.py --before before*.json --after after*.json --md out.md

With several runs per side (interleaved, on a shared machine) the table takes each side's median step time over the
runs; the collective counts must agree between runs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import init_cpu_rank  # noqa: E402


class UNetBlock(nn.Module):
    """Conv, max pool, conv, bilinear upsampling, a reflect-padded conv: every windowed op family of a UNet."""

    def __init__(self, c):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 3, padding=1)
        self.c = nn.Conv2d(c, c, 3, padding=1, padding_mode="reflect")

    def forward(self, x):
        y = F.gelu(self.a(x))
        y = F.gelu(self.b(F.max_pool2d(y, 2)))
        y = F.interpolate(y, scale_factor=2, mode="bilinear")
        return self.c(y + x)


class PartialInput(nn.Module):
    """A channel-sharded convolution gives a pending sum (Partial) that the next convolution completes."""

    def __init__(self, c):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.b(self.a(x))


class NeighbourhoodAttention(nn.Module):
    def __init__(self, heads, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads

    def forward(self, x):  # x: (B, H, W, C)
        b, h, w, c = x.shape
        q, k, v = self.qkv(x).view(b, h, w, 3, self.heads, c // self.heads).unbind(3)
        from shardtensor.ops import neighborhood_attention2d
        return neighborhood_attention2d(q, k, v, (5, 5)).reshape(b, h, w, c)


def workloads(quick: bool):
    """(name, module, input shape, placements)."""
    def conv_stack(dims, c):
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        return nn.Sequential(conv(c, c, 3, padding=1), nn.GELU(), conv(c, c, 5, padding=2), nn.GELU(),
                             conv(c, c, 3, padding=2, dilation=2))
    s2, s3 = (64, 16) if quick else (128, 24)
    return [
        ("conv stack 2-D (halo_conv)", conv_stack(2, 8), (1, 8, s2, s2), [st.Shard(2)]),
        ("conv stack 3-D (halo_conv)", conv_stack(3, 4), (1, 4, s3, s3, s3), [st.Shard(2)]),
        ("UNet block (conv, max pool, bilinear, reflect pad)", UNetBlock(8), (1, 8, s2, s2), [st.Shard(2)]),
        ("Partial input (channel-sharded conv, then conv)", PartialInput(8), (1, 8, s2 // 2, s2 // 2), [st.Shard(1)]),
        ("neighbourhood attention 5x5", NeighbourhoodAttention(4, 32), (1, s2 // 2, s2 // 2, 32), [st.Shard(1)]),
    ]


def _median_max(fn, iters, warmup):
    """Median over iterations of the max over ranks: (wall time, this thread's CPU time). The CPU time is the rank's
    own work (kernels, copies, planning, dispatch) without waiting for other ranks or for the cores, which other
    processes share here."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(iters):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        dt = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        wall.append(dt[0].item())
        cpu.append(dt[1].item())
    return statistics.median(wall), statistics.median(cpu)


def run_rank(rank, world, port, args, out_path):
    mesh = init_cpu_rank(rank, world, port)
    rows = []
    for name, module, shape, placements in workloads(args.quick):
        torch.manual_seed(0)
        x = torch.randn(shape)
        xs = st.distribute_tensor(x, mesh, placements).requires_grad_()

        def step():
            module.zero_grad(set_to_none=True)
            xs.grad = None
            y = module(xs)
            y.square().mean().backward()

        def forward():
            with torch.no_grad():
                module(xs)

        step()  # warm: plans built, allocator settled
        module.zero_grad(set_to_none=True)
        xs.grad = None
        with st.CommCounter() as fwd:
            y = module(xs)
            loss = y.square().mean()
        with st.CommCounter() as bwd:
            loss.backward()
        row = {"name": name, "shape": list(shape),
               "fwd_calls": fwd.calls, "fwd_bytes": fwd.bytes, "bwd_calls": bwd.calls, "bwd_bytes": bwd.bytes}
        row["step_s"], row["step_cpu_s"] = _median_max(step, args.iters, 1)
        row["forward_s"], row["forward_cpu_s"] = _median_max(forward, args.iters, 1)
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        if rank == 0:
            merged = dict(row)
            for key in ("fwd_calls", "fwd_bytes", "bwd_calls", "bwd_bytes"):
                kinds = set().union(*(g[key] for g in gathered))
                merged[key] = {k: max(g[key].get(k, 0) for g in gathered) for k in sorted(kinds)}
            rows.append(merged)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def measure(args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = args.json + ".part"
    mp.spawn(run_rank, args=(args.ranks, port, args, tmp), nprocs=args.ranks, join=True)
    with open(tmp) as f:
        rows = json.load(f)
    os.remove(tmp)
    meta = {"label": args.label, "library": os.path.dirname(os.path.dirname(st.__file__)), "ranks": args.ranks,
            "quick": args.quick, "iters": args.iters, "torch": torch.__version__, "threads_per_rank": 1,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average": list(os.getloadavg())}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for r in rows:
        print(r["name"], "fwd", r["fwd_calls"], "bwd", r["bwd_calls"],
              f"step {r['step_s'] * 1e3:.1f} ms (CPU {r['step_cpu_s'] * 1e3:.1f} ms)")


def _comm(calls, nbytes):
    if not calls:
        return "none"
    return ", ".join(f"{k} {calls[k]} ({nbytes.get(k, 0) / 1024:.1f} KiB)" for k in sorted(calls))


def _ratio(a, b, key):
    return f"{a[key] / b[key]:.2f} ({a[key] * 1e3:.1f} / {b[key] * 1e3:.1f} ms)"


def _load(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    rows = []
    for i, first in enumerate(runs[0]["rows"]):
        same = [r["rows"][i] for r in runs]
        for r in same:
            for key in ("fwd_calls", "fwd_bytes", "bwd_calls", "bwd_bytes"):
                assert r[key] == first[key], f"{first['name']}: {key} differs between runs"
        row = dict(first)
        for key in ("step_s", "step_cpu_s", "forward_s", "forward_cpu_s"):
            row[key] = statistics.median(r[key] for r in same)
        rows.append(row)
    return rows


def compare(args):
    before, after = _load(args.before), _load(args.after)
    lines = ["| workload | input | library collectives per step, forward: before / after | backward: before / after | "
             "train step after / before: wall, CPU | no_grad forward after / before: wall, CPU |", "|---|---|---|---|---|---|"]
    for b, a in zip(before, after):
        assert b["name"] == a["name"]
        fwd = _comm(b["fwd_calls"], b["fwd_bytes"]), _comm(a["fwd_calls"], a["fwd_bytes"])
        bwd = _comm(b["bwd_calls"], b["bwd_bytes"]), _comm(a["bwd_calls"], a["bwd_bytes"])
        lines.append(f"| {a['name']} | {a['shape']} | {fwd[0]} / {fwd[1]} | {bwd[0]} / {bwd[1]} | "
                     f"{_ratio(a, b, 'step_s')}, {_ratio(a, b, 'step_cpu_s')} | "
                     f"{_ratio(a, b, 'forward_s')}, {_ratio(a, b, 'forward_cpu_s')} |")
    table = "\n".join(lines)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--json", help="write this run's rows here")
    ap.add_argument("--label", default="")
    ap.add_argument("--before", nargs="+", help="runs of the first build (JSON of --json)")
    ap.add_argument("--after", nargs="+", help="runs of the second build: with --before, print the comparison")
    ap.add_argument("--md", help="with --before/--after: write the table here")
    args = ap.parse_args()
    if args.before and args.after:
        compare(args)
    else:
        assert args.json, "--json is required for a measurement"
        measure(args)


if __name__ == "__main__":
    main()
