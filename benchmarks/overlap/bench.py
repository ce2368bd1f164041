"""How much of a training step's communication the library hides (issue 28 items 3 and 6), per kind of collective,
on 2 Gloo CPU ranks: the halo_conv stack (4 x Conv2d(16->16, k3) + ReLU, input split on H) at 256^2 and 1024^2, the
tiny ViT of the compile benchmark (tokens split on H) and the 3-D U-Net of unet_memory (input split on depth).

    .venv/bin/python benchmarks/overlap/bench.py [--steps N] [--rounds R] [--only conv256,vit] [--out DIR]
                                                 # overlap.{json,md}

Per workload, interleaved rounds of `steps` training steps (forward + loss + backward), with the library's
communication accounting on (`st._C.set_comm_timing(True)`, comm/comm_timing.h):
- exposed, per kind of collective (halo exchanges of the forward, halo-gradient returns of the backward, blocking
  all-reduces, gradient buckets, ...): the wall time the issuing and waiting threads spend inside the transport's
  issue calls and blocked waiting for completion (`st._C.comm_timing_stats()`);
- alone: the same collectives, recorded as issued (group, message sizes, peers, tags), replayed back to back on fresh
  buffers without any compute, each waited before the next (`st._C.replay_recorded_collectives()`), mean of 3 passes;
- hidden = 1 - exposed / alone, per kind and for the whole step.
A rank also waits for a slower peer (uneven shards, other processes time-slicing it): that shows as exposed time on
the faster rank. The min over the ranks (the last rank to reach the collective waits for the transfer only) and the
max are both reported; the headline uses the min, as benchmarks/grad_buckets does.
Settings compared within one run: `bucket 1 MiB` (the default) and `bucket 0` (each layer's gradient summed at once
by a blocking all-reduce), and `no overlap` rows are not measured here (SHARDTENSOR_HALO_OVERLAP is read once per
process). DIR defaults to the git-ignored benchmarks/results/local.
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
from workloads import relu_conv_spec, specs, training_step, uneven  # noqa: E402

SETTINGS = {"bucket 1 MiB": 1 << 20, "bucket 0": 0}


def unet3d(size):
    import importlib.util
    path = os.path.join(HERE, "..", "unet_memory", "bench.py")
    spec = importlib.util.spec_from_file_location("unet_memory_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    UNet3d = module.UNet3d

    def factory():
        torch.manual_seed(0)
        return UNet3d()
    return (f"3-D U-Net (unet_memory: conv, strided conv, transposed conv, skip cat, GroupNorm), input (1, 2, "
            f"{size}^3) split on depth, loss mean(y^2)", factory, (1, 2, size, size, size), uneven(size, 2, 2),
            lambda: None, lambda out, target: out.square().mean())


def workloads():
    vit = specs(quick=False)["vit"]
    return {"conv256": relu_conv_spec(256), "conv1024": relu_conv_spec(1024), "vit": vit, "unet3d": unet3d(32)}


def kind_group(kind):
    """The projection's kind for a timing kind (benchmarks/scaling/projection.py reads these)."""
    base = kind.removesuffix(" [backward]")
    if base == "halo":
        return "halo (backward)" if kind.endswith("[backward]") else "halo (forward)"
    if base == "all_reduce (gradient bucket)":
        return "gradient buckets"
    if base == "ring send/recv":
        return "ring_pass"
    return base


def transfer_exposed(records):
    """Per kind: the part of this rank's waits after the last rank of the group posted the collective (the transfer
    that compute did not hide); the part before is imbalance (waiting for a peer still computing). Posting times are
    steady_clock (CLOCK_MONOTONIC) seconds, one clock for every process on this host. The benchmark's groups are the
    world (2 ranks, a 1-D mesh), so "the last rank" is the max over the world."""
    n = torch.tensor([len(records)], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    if len({int(v) for v in sizes}) != 1:
        raise RuntimeError(f"ranks recorded different numbers of collectives: {[int(v) for v in sizes]}")
    posted = torch.tensor([r[1] for r in records], dtype=torch.float64)
    all_posted = [torch.zeros_like(posted) for _ in range(dist.get_world_size())]
    dist.all_gather(all_posted, posted)
    last = torch.stack(all_posted).max(0).values.tolist() if records else []
    out = {}
    for (kind, _, waits), t in zip(records, last):
        out[kind] = out.get(kind, 0.0) + sum(max(0.0, end - max(start, t)) for start, end in waits)
    return out


def measure(name, spec, mesh, steps, rounds, reps):
    desc = spec[0]
    _, step = training_step(spec, mesh)
    for b in SETTINGS.values():  # warm-up: plans cached, allocator settled
        st.set_grad_bucket_bytes(b)
        step()
        step()
    per = {s: {"step": [], "exposed": [], "transfer": [], "alone": [], "kinds": []} for s in SETTINGS}
    for _ in range(rounds):
        for setting, b in SETTINGS.items():
            st.set_grad_bucket_bytes(b)
            dist.barrier()
            st._C.set_comm_timing(True)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            elapsed = (time.perf_counter() - t0) / steps
            stats = st._C.comm_timing_stats()
            transfer = transfer_exposed(st._C.comm_timing_records())
            alone = st._C.replay_recorded_collectives(reps)
            st._C.set_comm_timing(False)
            kinds = {}
            blank = {"exposed": 0.0, "transfer": 0.0, "alone": 0.0, "issued": 0}
            for k, v in stats.items():
                g = kinds.setdefault(kind_group(k), dict(blank))
                g["exposed"] += v["exposed_s"] / steps
                g["issued"] += v["issued"] / steps
            for k, v in transfer.items():
                kinds.setdefault(kind_group(k), dict(blank))["transfer"] += v / steps
            for k, v in alone.items():
                kinds.setdefault(kind_group(k), dict(blank))["alone"] += v / steps
            # Per kind: exposed min and max over the ranks, alone max over the ranks (a pair's replay takes as long
            # as its slower side).
            names = sorted(kinds)
            per_kind = {}
            for k in names:
                e = kinds[k]["exposed"]
                per_kind[k] = {"exposed_min": reduce_over_ranks(e, dist.ReduceOp.MIN),
                               "exposed_max": reduce_over_ranks(e, dist.ReduceOp.MAX),
                               "transfer": reduce_over_ranks(kinds[k]["transfer"], dist.ReduceOp.MAX),
                               "alone": reduce_over_ranks(kinds[k]["alone"], dist.ReduceOp.MAX),
                               "per_step": kinds[k]["issued"]}
            tot_e = sum(v["exposed"] for v in kinds.values())
            tot_a = sum(v["alone"] for v in kinds.values())
            tot_t = sum(v["transfer"] for v in kinds.values())
            per[setting]["transfer"].append(reduce_over_ranks(tot_t, dist.ReduceOp.MAX))
            per[setting]["step"].append(reduce_over_ranks(elapsed, dist.ReduceOp.MAX))
            per[setting]["exposed"].append((reduce_over_ranks(tot_e, dist.ReduceOp.MIN),
                                            reduce_over_ranks(tot_e, dist.ReduceOp.MAX)))
            per[setting]["alone"].append(reduce_over_ranks(tot_a, dist.ReduceOp.MAX))
            per[setting]["kinds"].append(per_kind)
    rows = []
    for setting, d in per.items():
        med = statistics.median
        kinds = {}
        for k in d["kinds"][0]:
            samples = [r[k] for r in d["kinds"] if k in r]
            kinds[k] = {f: med(s[f] for s in samples)
                        for f in ("exposed_min", "exposed_max", "transfer", "alone", "per_step")}
            kinds[k]["hidden"] = 1 - kinds[k]["transfer"] / kinds[k]["alone"] if kinds[k]["alone"] > 0 else None
        e_min = med(e[0] for e in d["exposed"])
        e_max = med(e[1] for e in d["exposed"])
        alone = med(d["alone"])
        transfer = med(d["transfer"])
        rows.append({"workload": name, "what": desc, "setting": setting, "step_ms": med(d["step"]) * 1e3,
                     "step_spread_ms": [v * 1e3 for v in spread(d["step"])], "alone_ms": alone * 1e3,
                     "exposed_min_ms": e_min * 1e3, "exposed_max_ms": e_max * 1e3, "transfer_ms": transfer * 1e3,
                     "hidden": 1 - transfer / alone if alone > 0 else None,
                     "hidden_wait_min": 1 - e_min / alone if alone > 0 else None,
                     "kinds": {k: {f: (v * 1e3 if f in ("exposed_min", "exposed_max", "transfer", "alone") else v)
                                   for f, v in kv.items()} for k, kv in kinds.items()}})
    return rows


def run(rank, world, port, scratch, only, steps, rounds, reps):
    mesh = init_cpu_rank(rank, world, port)
    rows = []
    for name, spec in workloads().items():
        if only and name not in only:
            continue
        n = max(1, steps // 3) if name == "conv1024" else steps
        rows += measure(name, spec, mesh, n, rounds, reps)
    write_rank0_rows(rank, rows, scratch)
    dist.barrier()
    # Leave without tearing the process groups down (see benchmarks/grad_buckets/bench.py).
    sys.stdout.flush()
    os._exit(0)


def pct(v):
    return f"{100 * v:.0f} %" if v is not None else "-"


def transport_note(shm_bytes):
    if shm_bytes == 0:
        return ("Transport: Gloo for every collective (`SHARDTENSOR_SHM_BYTES=0`: the shared-memory rings off).")
    return (f"Transport: the shared-memory rings of src/comm/shm_transport.h ({shm_bytes // 1024} KiB per ring) for "
            "the neighbour exchanges and the all-reduces that fit a ring; Gloo for all-gathers, all-to-alls and larger "
            "messages.")


def render(rows, command, start, end, steps, rounds, shm_bytes):
    lines = [
        "# Communication hidden per training step, per kind of collective",
        "",
        f"2 Gloo CPU ranks (1 thread each), {rounds} interleaved rounds of {steps} steps (1024^2: {max(1, steps // 3)}) "
        f"per setting; medians. {load_caveat(start, end)} The host has 2 cores: the two ranks' compute threads fill "
        f"them and Gloo's transport threads (and any other load) compete with them for the CPU, so compare ratios "
        f"within one run. {datetime.date.today()}; `{command}`. {transport_note(shm_bytes)}",
        "",
        "- **Alone**: the step's collectives (every one the library issued, recorded as issued: group, message sizes, "
        "peers, tags) replayed back to back on fresh buffers without compute, each waited before the next "
        "(`st._C.replay_recorded_collectives()`), max over the ranks.",
        "- **Blocked**: wall time the step's threads spend in the transport's issue calls and blocked waiting for "
        "each collective (`st._C.comm_timing_stats()`, src/comm/comm_timing.h); min over the ranks (max in "
        "brackets). It includes waiting for a peer that has not posted the collective yet (imbalance: uneven "
        "shards, or a rank time-sliced out by the other processes).",
        "- **Transfer exposed**: the part of each wait after the last rank posted the collective "
        "(`st._C.comm_timing_records()`: posting and wait times on the host's monotonic clock; max over the ranks): "
        "communication that compute did not hide.",
        "- **Hidden** = 1 - transfer exposed / alone (the headline); *hidden (blocked)* = 1 - blocked (min) / alone "
        "counts imbalance as exposed too. **Exposed / step** = transfer exposed / step time: what communication "
        "costs the step. When the collectives alone take tens of µs (the rings), a single wake-up of a receiver "
        "that went to sleep exceeds them, so the ratio goes negative while the step loses a fraction of a percent: "
        "read the last column then.",
        "",
        "Settings: `bucket 1 MiB` = the default gradient buckets; `bucket 0` = each layer's weight gradient summed at "
        "once by a blocking all-reduce (the behaviour before buckets).",
        "",
        "| workload | setting | step (ms) | comm alone (ms) | blocked (ms) | transfer exposed (ms) | hidden | "
        "hidden (blocked) | exposed / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = f"{100 * r['transfer_ms'] / r['step_ms']:.2f} %" if r["step_ms"] > 0 else "-"
        lines.append(f"| {r['workload']} | {r['setting']} | {r['step_ms']:.1f} ({r['step_spread_ms'][0]:.1f}-"
                     f"{r['step_spread_ms'][1]:.1f}) | {r['alone_ms']:.2f} | {r['exposed_min_ms']:.2f} "
                     f"({r['exposed_max_ms']:.2f}) | {r['transfer_ms']:.2f} | {pct(r['hidden'])} | "
                     f"{pct(r['hidden_wait_min'])} | {share} |")
    lines += ["", "Per kind (default setting `bucket 1 MiB`): collectives per step, alone, blocked (min, max over "
              "ranks), transfer exposed, hidden.", "",
              "| workload | kind | per step | alone (ms) | blocked (ms) | transfer exposed (ms) | hidden |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["setting"] != "bucket 1 MiB":
            continue
        for k, v in sorted(r["kinds"].items()):
            lines.append(f"| {r['workload']} | {k} | {v['per_step']:.0f} | {v['alone']:.2f} | "
                         f"{v['exposed_min']:.2f} ({v['exposed_max']:.2f}) | {v['transfer']:.2f} | {pct(v['hidden'])} |")
    lines += ["", "Workloads:", ""] + sorted({f"- {r['workload']}: {r['what']}" for r in rows})
    lines += ["", "Reading:", "",
              "- Where the library waits: the forward's halo is posted before the interior convolution and waited "
              "after it (comm/halo_borders.h); the backward's gradient-row exchange is posted before the main "
              "`convolution_backward` (input, weight and bias gradients) and waited after it (ops/conv.cpp "
              "border_backward); windows that cannot split (HaloPlan::gather: rows off the stride grid, transposed convolutions over several dims) and "
              "the blocking collectives (GroupNorm statistics, re-layouts, all-gathers) wait at once, by construction. "
              "The conv stack's weight gradients (37 KB) fill one bucket, issued and waited at the end of the "
              "backward: the first layer's weight gradient is the backward's last computation, so at least one "
              "all-reduce is exposed whatever the bucket policy (smaller or per-layer buckets add collectives but "
              "leave the last one's latency exposed).",
              "- Over Gloo (`SHARDTENSOR_SHM_BYTES=0`) on this host (2 cores, both computing) a transfer progresses only "
              "when Gloo's transport threads get a core: a wait after long interior compute still finds the transfer "
              "unfinished, and the replayed collectives (the main thread asleep, its core free) run faster than the "
              "same ones during the step. Over the rings a message is in the receiver's ring when its sender's post "
              "returns, so what a wait exposes is the receiver's own copy and, when it had to sleep, one futex "
              "wake-up; the blocked time beyond that is imbalance between the ranks. On a GPU the copies run on "
              "their own engines and NCCL beside the compute."]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3, help="replay passes averaged for the alone time")
    parser.add_argument("--only", default="", help="comma-separated workloads (conv256, conv1024, vit, unet3d)")
    parser.add_argument("--rows", help="re-render the report from rank 0's recorded rows (JSON) instead of measuring")
    parser.add_argument("--name", default="overlap", help="report name (NAME.md, NAME.json in --out)")
    add_out_argument(parser)
    args = parser.parse_args()
    out = prepare(args.out, measuring=not args.rows)
    only = [w for w in args.only.split(",") if w]
    if args.rows:
        import json
        with open(args.rows) as f:
            payload = json.load(f)
        rows, start, end = payload["rows"], payload["load_start"], payload["load_end"]
        shm_bytes = payload.get("shm_bytes", 0)
    else:
        start = loadavg()
        shm_bytes = st.shm_capacity()  # the ranks inherit SHARDTENSOR_SHM_BYTES
        rows = spawn_rank0_rows(run, 2, os.path.join(out, f"{args.name}.scratch.json"), only, args.steps, args.rounds,
                                args.reps)
        end = loadavg()
    command = (f"benchmarks/overlap/bench.py --steps {args.steps} --rounds {args.rounds} --reps {args.reps}"
               + (f" --only {args.only}" if args.only else ""))
    if shm_bytes == 0:
        command = "SHARDTENSOR_SHM_BYTES=0 " + command
    if args.name != "overlap":
        command += f" --name {args.name}"
    lines = render(rows, command, start, end, args.steps, args.rounds, shm_bytes)
    write_report(out, args.name, {"rows": rows, "steps": args.steps, "rounds": args.rounds, "load_start": start,
                                  "load_end": end, "command": command, "shm_bytes": shm_bytes}, lines)


if __name__ == "__main__":
    main()
