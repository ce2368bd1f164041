"""Where a training step's time goes: a stack of L x (Conv(C->C, k3, padding 1) + ReLU) split on the first spatial dim
over N Gloo ranks, profiled (torch.profiler, CPU) once sharded and once as the same layers on each rank's own rows
without communication (local-only), in alternating steps. Per rank: the self time per step of every aten op and of
the library's communication ranges (`shardtensor::post <kind>`: issuing a collective; `shardtensor::wait <kind>`:
the wall a rank is blocked in it), grouped by the phase they run in (zero_grad, forward, loss, backward, the
backward's final gradient reductions). The difference per component is what domain parallelism adds.

    .venv/bin/python benchmarks/halo_conv/step_profile.py [--ranks 2] [--size 256] [--steps 20] [--mode train|fwd]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import shardtensor as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import init_cpu_rank, spawn_rank0_rows, write_rank0_rows, write_report  # noqa: E402
from results_dir import add_out_argument, git, loadavg, prepare  # noqa: E402
from compare import stack  # noqa: E402  (the same layers as the side-by-side run)


def step_fn(net, x, mode):
    rf = torch.profiler.record_function

    def train():
        with rf("phase: zero_grad"):
            net.zero_grad(set_to_none=True)
        with rf("phase: forward"):
            y = net(x)
        with rf("phase: loss"):
            loss = y.square().mean()
        with rf("phase: backward"):
            loss.backward()

    def fwd():
        with torch.no_grad(), rf("phase: forward"):
            net(x)
    return train if mode == "train" else fwd


def self_times(prof, steps):
    """{(phase, op): self µs per step} over the profile's events; `phase` the innermost enclosing phase range."""
    events = prof.events()
    phases = [e for e in events if e.name.startswith("phase: ")]
    out = collections.defaultdict(float)
    counts = collections.defaultdict(int)
    for e in events:
        if e.name == "step":
            continue
        if e.name.startswith("phase: "):
            phase, name = e.name[len("phase: "):], "(untraced: Python, autograd engine)"
        else:
            start = e.time_range.start
            phase, name = "other thread", e.name
            for p in phases:
                if p.thread == e.thread and p.time_range.start <= start <= p.time_range.end:
                    phase = p.name[len("phase: "):]
        out[(phase, name)] += e.self_cpu_time_total / steps
        counts[(phase, name)] += 1
    return out, counts


def run_rank(rank, world, port, out_path, args):
    mesh = init_cpu_rank(rank, world, port, retain_heap=args.malloc == "retain")
    torch.manual_seed(0)
    net = stack(2, args.channels, args.layers)
    x = torch.randn((1, args.channels, args.size, args.size))
    xs = st.distribute_tensor(x, mesh, [st.Shard(2)])
    inputs = {"sharded": xs, "local": st.to_local(xs).clone()}
    if args.mode == "train":
        inputs = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}
    fns = {k: step_fn(net, v, args.mode) for k, v in inputs.items()}
    for k in fns:
        for _ in range(3):
            fns[k]()
    result = {}
    # Timed without the profiler first (its per-op cost is not in these), interleaved: wall, this thread's CPU and
    # the process's CPU (every thread: Gloo's transport and worker threads too) per step.
    walls = {k: {"wall": [], "thread_cpu": [], "process_cpu": []} for k in fns}
    for i in range(args.steps):
        for k in fns:
            dist.barrier()
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            fns[k]()
            walls[k]["wall"].append(time.perf_counter() - t0)
            walls[k]["thread_cpu"].append(time.thread_time() - c0)
            walls[k]["process_cpu"].append(time.process_time() - p0)
    for k in fns:
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                dist.barrier()
                with torch.profiler.record_function("step"):
                    fns[k]()
        times, counts = self_times(prof, args.steps)
        result[k] = {"|".join(key): [v, counts[key] / args.steps] for key, v in times.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"profile": result, "walls": walls})
    write_rank0_rows(rank, gathered, out_path)
    dist.destroy_process_group()


def render(gathered, meta, top):
    lines = [f"# Training-step profile: {meta['layers']} × (Conv2d {meta['channels']}→{meta['channels']} k3 + ReLU), "
             f"[{meta['size']}, {meta['size']}] split on H over {meta['ranks']} Gloo ranks", "",
             f"torch {meta['torch']}, commit {meta['commit']}, {meta['date']}; 1-minute load average "
             f"{meta['load_avg_start'][0]} at start, {meta['load_avg_end'][0]} at end; glibc heap: {meta['malloc']}. Command: `{meta['command']}`.", "",
             "Wall per step (median, no profiler) and, per phase and op, self CPU µs per step under the profiler "
             "(`shardtensor::wait …`: wall blocked in a collective; `shardtensor::post …`: issuing it).", ""]
    import statistics
    for r, g in enumerate(gathered):
        m = {k: {q: statistics.median(s) * 1e3 for q, s in v.items()} for k, v in g["walls"].items()}
        lo, sh = m["local"], m["sharded"]
        lines.append(f"rank {r}: ms local / sharded: wall {lo['wall']:.2f} / {sh['wall']:.2f} "
                     f"(ratio {sh['wall'] / lo['wall']:.2f}); main thread CPU {lo['thread_cpu']:.2f} / "
                     f"{sh['thread_cpu']:.2f}; process CPU {lo['process_cpu']:.2f} / {sh['process_cpu']:.2f}")
    lines.append("")
    for r, g in enumerate(gathered):
        loc, sh = g["profile"]["local"], g["profile"]["sharded"]
        keys = set(loc) | set(sh)
        phase_tot = collections.defaultdict(lambda: [0.0, 0.0])
        for k in keys:
            ph = k.split("|")[0]
            phase_tot[ph][0] += loc.get(k, [0, 0])[0]
            phase_tot[ph][1] += sh.get(k, [0, 0])[0]
        lines += [f"## rank {r}", "", "| phase | local µs | sharded µs | added µs |", "|---|---:|---:|---:|"]
        for ph, (a, b) in sorted(phase_tot.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"| {ph} | {a:.0f} | {b:.0f} | {b - a:+.0f} |")
        lines += ["", "| phase | op | local µs (calls) | sharded µs (calls) | added µs |", "|---|---|---:|---:|---:|"]
        rows = []
        for k in keys:
            a, ca = loc.get(k, [0, 0])
            b, cb = sh.get(k, [0, 0])
            rows.append((b - a, k, a, ca, b, cb))
        rows.sort(key=lambda t: -abs(t[0]))
        for d, k, a, ca, b, cb in rows[:top]:
            ph, op = k.split("|", 1)
            lines.append(f"| {ph} | {op} | {a:.0f} ({ca:g}) | {b:.0f} ({cb:g}) | {d:+.0f} |")
        lines.append("")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", choices=("train", "fwd"), default="train")
    ap.add_argument("--top", type=int, default=30, help="ops listed per rank (largest added time first)")
    ap.add_argument("--malloc", choices=("retain", "default"), default="retain",
                    help="as compare.py's --malloc")
    ap.add_argument("--tag", default="")
    add_out_argument(ap)
    args = ap.parse_args()
    prepare(args.out, measuring=True)
    name = f"halo_conv_step_profile_{args.size}" + (f"_{args.tag}" if args.tag else "")
    load_start = loadavg()
    gathered = spawn_rank0_rows(run_rank, args.ranks, os.path.join(args.out, f".{name}.json"), args)
    meta = {"command": (".venv/bin/python benchmarks/halo_conv/step_profile.py " + " ".join(sys.argv[1:])).strip(),
            "ranks": args.ranks, "channels": args.channels, "layers": args.layers, "size": args.size,
            "torch": torch.__version__, "commit": git("rev-parse", "--short", "HEAD"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_avg_start": load_start, "load_avg_end": loadavg(), "malloc": args.malloc}
    write_report(args.out, name, {"meta": meta, "ranks": gathered}, render(gathered, meta, args.top))


if __name__ == "__main__":
    main()
