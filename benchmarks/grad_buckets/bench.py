"""How much of the parameter-gradient communication a training step hides (gradient buckets, issue 28 item 3), on
2 Gloo CPU ranks: the halo_conv stack (4 x Conv2d(16->16, k3) + ReLU, input split on H) and the tiny ViT of the
compile benchmark (tokens split on H).

    .venv/bin/python benchmarks/grad_buckets/bench.py [--size 256] [--steps N] [--rounds R] [--out DIR]
                                                     # grad_buckets.{json,md}

Per workload and bucket size (`st.set_grad_bucket_bytes`: 0 = each layer's weight+bias gradient summed by one
blocking all-reduce where its rule produces it, the behaviour before buckets; 1 byte = one bucket per parameter,
each all-reduce issued as soon as its term exists; 64 KiB; 1 MiB, the default), interleaved rounds, medians:
- step: forward + loss + backward (max over the ranks of each round's mean step);
- collectives alone: the wall time of the same parameter-gradient all-reduces (the same count and bytes per step:
  one per parameter-owning module with buckets off, the step's buckets otherwise) issued back to back,
  synchronously, without any compute;
- exposed: the time the backward's thread spends on them: with buckets, flattening + issuing + waiting (the
  library's counters, `st._C.grad_reduction_stats()`); with buckets off everything is exposed (each is blocking);
- hidden = 1 - exposed / alone, with the exposed part of the last rank to finish its backward (min over the ranks:
  the others also wait for it, rank skew that the blocking per-layer reductions absorb elsewhere).
DIR defaults to the git-ignored benchmarks/results/local.
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
from bench_util import init_cpu_rank, reduce_over_ranks, spawn_rank0_rows, write_rank0_rows, write_report  # noqa: E402
from results_dir import add_out_argument, load_caveat, loadavg, prepare, spread  # noqa: E402
from workloads import relu_conv_spec, specs, training_step  # noqa: E402

SETTINGS = [0, 1, 64 << 10, 1 << 20]


def param_messages(model):
    """Bytes of each blocking all-reduce with buckets off: one per module owning parameters (weight + bias fused)."""
    sizes = []
    for mod in model.modules():
        own = [p for p in mod.parameters(recurse=False) if p.requires_grad]
        if own:
            sizes.append(sum(p.numel() * p.element_size() for p in own))
    return sizes


def collectives_alone(sizes, reps):
    """Wall time of all-reduces of `sizes` bytes (float32), issued back to back and waited one by one."""
    bufs = [torch.zeros(max(1, s // 4)) for s in sizes]
    for b in bufs:
        dist.all_reduce(b)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        for b in bufs:
            dist.all_reduce(b)
    return (time.perf_counter() - t0) / reps


def measure(name, spec, mesh, steps, rounds):
    desc = spec[0]
    model, step = training_step(spec, mesh)
    times = {s: [] for s in SETTINGS}
    exposed = {s: [] for s in SETTINGS}
    exposed_min = {s: [] for s in SETTINGS}
    buckets = {}
    for s in SETTINGS:   # warm-up of every setting: plans cached, allocator settled
        st.set_grad_bucket_bytes(s)
        step()
        step()
    for _ in range(rounds):
        for s in SETTINGS:
            st.set_grad_bucket_bytes(s)
            dist.barrier()
            st._C.reset_grad_reduction_stats()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            elapsed = (time.perf_counter() - t0) / steps
            stats = st._C.grad_reduction_stats()
            times[s].append(reduce_over_ranks(elapsed))
            exposed[s].append(reduce_over_ranks((stats["wait_s"] + stats["issue_s"]) / steps))
            exposed_min[s].append(reduce_over_ranks((stats["wait_s"] + stats["issue_s"]) / steps, dist.ReduceOp.MIN))
            buckets[s] = (stats["buckets"] / steps, stats["bytes"] / steps)
    st.set_grad_bucket_bytes(1 << 20)
    sync_sizes = param_messages(model)
    rows = []
    for s in SETTINGS:
        if s == 0:
            sizes = sync_sizes
        else:
            n, nbytes = buckets[s]
            n = max(1, round(n))
            sizes = [int(nbytes / n)] * n
        alone = statistics.median(reduce_over_ranks(collectives_alone(sizes, 5)) for _ in range(rounds))
        # The last rank to finish its backward waits only for the communication; the others also wait for it (rank
        # skew, which the blocking per-layer reductions absorb elsewhere): min and max over the ranks.
        exp = alone if s == 0 else statistics.median(exposed_min[s])
        exp_max = alone if s == 0 else statistics.median(exposed[s])
        rows.append({"workload": name, "what": desc, "bucket_bytes": s, "messages": len(sizes),
                     "bytes": sum(sizes), "step_ms": statistics.median(times[s]) * 1e3,
                     "step_spread_ms": [v * 1e3 for v in spread(times[s])],
                     "alone_ms": alone * 1e3, "exposed_ms": exp * 1e3, "exposed_max_ms": exp_max * 1e3,
                     "hidden": 1 - exp / alone if alone > 0 else float("nan")})
    return rows


def run(rank, world, port, scratch, size, steps, rounds):
    mesh = init_cpu_rank(rank, world, port)
    workloads = {"conv": relu_conv_spec(size), "vit": specs(quick=False)["vit"]}
    rows = [r for name, spec in workloads.items() for r in measure(name, spec, mesh, steps, rounds)]
    write_rank0_rows(rank, rows, scratch)
    dist.barrier()
    # Leave without tearing the process groups down: a Gloo group destroyed while its run loop still holds finished
    # work on Python tensors (this script's own all-reduces) can deadlock on the GIL at exit.
    sys.stdout.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="height and width of the conv stack's input")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", help="re-render the report from rank 0's recorded rows (JSON) instead of measuring")
    parser.add_argument("--load", type=float, nargs=2, metavar=("START", "END"),
                        help="with --rows: the 1-minute load averages recorded around that run")
    add_out_argument(parser)
    args = parser.parse_args()
    out = prepare(args.out, measuring=not args.rows)
    if args.rows:
        import json
        with open(args.rows) as f:
            rows = json.load(f)
        start, end = ([args.load[0]], [args.load[1]]) if args.load else (None, None)
    else:
        start = loadavg()
        rows = spawn_rank0_rows(run, 2, os.path.join(out, "grad_buckets.scratch.json"), args.size, args.steps,
                                args.rounds)
        end = loadavg()
    command = (f"benchmarks/grad_buckets/bench.py --size {args.size} --steps {args.steps} --rounds {args.rounds}")
    lines = [
        "# Parameter-gradient reductions: communication hidden per training step",
        "",
        f"2 Gloo CPU ranks (1 thread each), {args.rounds} interleaved rounds of {args.steps} steps per bucket size; "
        f"medians, max over the ranks. {load_caveat(start, end)} {datetime.date.today()}; `{command}`.",
        "",
        "Bucket bytes 0: each layer's gradient summed by a blocking all-reduce in its rule (all exposed). "
        "Collectives alone: the same all-reduces back to back without compute. Exposed: flatten + issue + wait on "
        "the backward's thread (`st._C.grad_reduction_stats()`): the min over the ranks is the last rank to finish "
        "its backward, which waits for the communication only; the max adds the rank skew (the first rank waits for "
        "the last). Hidden = 1 - exposed (min) / alone.",
        "",
        "| workload | bucket bytes | all-reduces / step | KiB / step | step (ms) | collectives alone (ms) "
        "| exposed, min over ranks (ms) | exposed, max over ranks (ms) | hidden (min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['what']} | {r['bucket_bytes']} | {r['messages']} | {r['bytes'] / 1024:.1f} "
                     f"| {r['step_ms']:.1f} ({r['step_spread_ms'][0]:.1f}-{r['step_spread_ms'][1]:.1f}) "
                     f"| {r['alone_ms']:.2f} | {r['exposed_ms']:.2f} | {r['exposed_max_ms']:.2f} | {100 * r['hidden']:.0f} % |")
    write_report(out, "grad_buckets", {"rows": rows, "size": args.size, "steps": args.steps, "rounds": args.rounds,
                                       "load_start": start, "load_end": end, "command": command}, lines)


if __name__ == "__main__":
    main()
