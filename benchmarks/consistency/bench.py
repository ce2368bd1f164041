"""What the per-op consistency check (SHARDTENSOR_CHECK_CONSISTENCY=1) costs on a training step, on 2 CPU ranks:
a conv stack with GroupNorm and the tiny ViT of the compile benchmark (uneven height shards).

    .venv/bin/python benchmarks/consistency/bench.py [--steps N] [--rounds R] [--out DIR]   # consistency.{json,md}

Per workload: the step time with the check off and on (interleaved rounds; medians and spread), the ops the check
saw per step (its all-reduces), the collectives the step issues anyway, the cost of one check, and what a check
carried by every collective instead of every op would cost (collectives per step x the cost of one check): the
numbers behind docs/python-api.md's "What every rank must keep identical". DIR defaults to the git-ignored
benchmarks/results/local.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "compile"))
from bench_util import init_cpu_rank, spawn_rank0_rows, write_rank0_rows, write_report  # noqa: E402
from results_dir import add_out_argument, loadavg, prepare, spread  # noqa: E402
from workloads import make_input, specs  # noqa: E402


def step(model, x, target, loss_fn):
    out = model(x)
    loss = loss_fn(out, target)
    loss.backward()
    return loss


def measure(name, spec, mesh, steps, rounds):
    desc, factory, shape, extents, target_fn, loss_fn = spec
    model = factory()
    st.sync_module(model, mesh)
    x = make_input(shape, extents, mesh)
    target = target_fn()
    for _ in range(2):   # warm-up: plans cached, allocator settled
        step(model, x, target, loss_fn)
    times = {False: [], True: []}
    calls = {}
    for _ in range(rounds):
        for checked in (False, True):
            previous = st._C.set_consistency_check(checked)
            try:
                dist.barrier()
                with st.CommCounter() as c:
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        step(model, x, target, loss_fn)
                    elapsed = time.perf_counter() - t0
            finally:
                st._C.set_consistency_check(previous)
            times[checked].append(elapsed / steps)
            calls[checked] = {k: v / steps for k, v in c.calls.items()}
    off, on = statistics.median(times[False]), statistics.median(times[True])
    checks = calls[True].get("all_reduce", 0) - calls[False].get("all_reduce", 0)
    collectives = sum(calls[False].values())
    per_check = (on - off) / checks if checks else float("nan")
    return {"workload": name, "what": desc, "step_ms_off": off * 1e3, "step_ms_on": on * 1e3,
            "spread_ms_off": [v * 1e3 for v in spread(times[False])],
            "spread_ms_on": [v * 1e3 for v in spread(times[True])],
            "checked_ops_per_step": checks, "collectives_per_step": collectives, "calls_off": calls[False],
            "us_per_check": per_check * 1e6, "overhead": on / off - 1,
            "projected_per_collective_ms": collectives * per_check * 1e3}


def run(rank, world, port, scratch, steps, rounds):
    mesh = init_cpu_rank(rank, world, port)
    rows = [measure(name, spec, mesh, steps, rounds) for name, spec in specs(quick=False).items() if name != "conv"]
    write_rank0_rows(rank, rows, scratch)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    add_out_argument(parser)
    args = parser.parse_args()
    out = prepare(args.out)
    start = loadavg()
    rows = spawn_rank0_rows(run, 2, os.path.join(out, "consistency.scratch.json"), args.steps, args.rounds)
    end = loadavg()
    lines = [
        "# The per-op consistency check: its cost on a training step",
        "",
        f"2 Gloo CPU ranks (1 thread each), {args.rounds} interleaved rounds of {args.steps} steps per setting; "
        f"medians (spread). Load average {start} at start, {end} at end, {os.cpu_count()} CPUs. "
        f"{datetime.date.today()}; `benchmarks/consistency/bench.py`.",
        "",
        "| workload | step off (ms) | step on (ms) | overhead | ops checked / step | µs per check | collectives / step "
        "| a check per collective instead (ms / step) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['what']} | {r['step_ms_off']:.1f} ({r['spread_ms_off'][0]:.1f}-{r['spread_ms_off'][1]:.1f}) "
                     f"| {r['step_ms_on']:.1f} ({r['spread_ms_on'][0]:.1f}-{r['spread_ms_on'][1]:.1f}) "
                     f"| {100 * r['overhead']:+.0f}% | {r['checked_ops_per_step']:.0f} | {r['us_per_check']:.0f} "
                     f"| {r['collectives_per_step']:.0f} | {r['projected_per_collective_ms']:.1f} |")
    write_report(out, "consistency", {"rows": rows, "steps": args.steps, "rounds": args.rounds,
                                      "load_start": start, "load_end": end}, lines)


if __name__ == "__main__":
    main()
