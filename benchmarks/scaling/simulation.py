"""``--simulate P[,rank]``: one process plays rank r of P (``shardtensor.simulate``) for a workload, at any size.

Per simulated rank, for inference (no_grad forward) and a training step (zero_grad, forward, loss, backward,
AdamW step), the same protocol as measure.py: local-kernel FLOPs and memory traffic, collectives and bytes sent per
kind, peak memory above the live state, the live state itself (parameters, optimizer state, local inputs), and with
``--sim-device cpu`` the local compute time (median of ``--iters``; the fake process group returns at once, so this
is the rank's own compute and dispatch without waiting for anyone). ``--sim-device meta`` allocates nothing:
memory is the allocation tally of the fake tensors (see shardtensor/local_ops.py), and there is no time.

P = 1 is the plain single-device model (no ShardTensor), the baseline of memory ratios and projected speed-ups.
Ranks: the one given, else ``--sim-ranks`` (default: 0, 1, P//2 and P-1 — both edges and interior ranks, which
differ in halo bytes and, with uneven splits, in extents); the bounding rank of each figure is the max over them.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch

import shardtensor as st

from . import memory

SIM_NOTE = ("simulated: one process played each listed rank over torch's fake process group (no data moved, values "
            "garbage); FLOPs, bytes and memory are that rank's")


def add_args(ap):
    ap.add_argument("--simulate", action="append", default=None, metavar="P[,RANK]",
                    help="simulate rank RANK (default: --sim-ranks) of P ranks in this process instead of launching "
                    "ranks (shardtensor.simulate); repeat for several P (P=1: the single-device model)")
    ap.add_argument("--sim-device", default="meta", choices=["cpu", "meta"],
                    help="simulated local tensors: cpu = real tensors of the shard's size (memory and time measured), "
                    "meta = fake tensors, nothing allocated (FLOPs, bytes and an allocation-tracked memory estimate)")
    ap.add_argument("--sim-ranks", default="edges", help="ranks to simulate when --simulate gives none: 'edges' (0, 1, "
                    "P//2, P-1), 'all', or a comma-separated list")


def parse_simulate(specs) -> list[tuple[int, int | None]]:
    out = []
    for spec in specs:
        p, _, r = spec.partition(",")
        P = int(p)
        if P < 1 or (r and not 0 <= int(r) < P):
            raise SystemExit(f"--simulate {spec}: need P >= 1 and 0 <= rank < P")
        out.append((P, int(r) if r else None))
    return out


def ranks_for(P: int, rank: int | None, how: str) -> list[int]:
    if rank is not None:
        return [rank]
    if how == "all":
        return list(range(P))
    if how == "edges":
        return sorted({0, min(1, P - 1), P // 2, P - 1})
    return sorted({int(v) for v in how.split(",") if int(v) < P})


def local_inputs(workload, cfg, size, batch, sim, single: bool):
    """This rank's inputs and target: under a cpu simulation exactly what a real run builds (the global synthetic
    data, each sharded tensor cut to this rank's default-split slice); under meta, fake tensors of the same shapes
    (``workload.input_specs``), only this rank's shard of the sharded ones."""
    in_dims, tgt_dim = workload.shard_dims()
    if sim.device == "cpu":
        inputs, target = workload.make_input(cfg, size, batch, 1000)
        if single:
            return inputs, target
        from .data import shard_inputs
        return shard_inputs(workload, inputs, target, sim.mesh, torch.device("cpu"))
    in_specs, tgt_spec = workload.input_specs(cfg, size, batch)

    def one(spec, dim):
        shape, dtype = spec
        if single or dim is None:
            return torch.zeros(shape, dtype=dtype)  # a fake factory inside the meta simulation
        return sim.shard(shape, [st.Shard(dim)], dtype=dtype)

    return tuple(one(s, d) for s, d in zip(in_specs, in_dims)), one(tgt_spec, tgt_dim)


def _pass(fn, prepare=None, device=torch.device("cpu")) -> dict:
    if prepare is not None:
        prepare()
    with st.RankStats(device=device) as s:
        fn()
    return {"flops": s.flops, "traffic_bytes": s.traffic_bytes, "flops_by_op": s.flops_by_op,
            "comm": {"calls": s.comm_calls, "bytes": s.comm_bytes}, "peak_bytes": s.peak_bytes,
            "memory_source": s.memory_source,
            "op_instances": sorted(s.op_instances, key=lambda t: -(t[1] * t[3]))}


def _time(fn, iters: int, warmup: int, prepare=None) -> dict:
    for _ in range(warmup):
        if prepare:
            prepare()
        fn()
    wall, cpu = [], []
    for _ in range(iters):
        if prepare:
            prepare()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return {"median": statistics.median(wall), "min": min(wall), "max": max(wall),
            "cpu_median": statistics.median(cpu), "samples": [round(s, 6) for s in wall]}


def simulate_rank(workload, cfg, args, size, P: int, rank: int) -> dict:
    """Everything measured for rank ``rank`` of ``P`` at global ``size`` (P = 1: the plain model)."""
    single = P == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SimulationWarning)
        with st.simulate(rank, P, device=args.sim_device) as sim:
            torch.manual_seed(0)
            model = workload.build(cfg, size)
            if not single:
                st.sync_module(model, sim.mesh)
            inputs, target = local_inputs(workload, cfg, size, args.batch, sim, single)
            param_bytes = memory.live_bytes(model)
            fwd, zero, step, opt = memory.training_closures(workload, model, inputs, target)

            row = {"size": workload.label(size), "elements": workload.elements(size), "ranks": P, "rank": rank,
                   "domain": P, "single": single, "sim_device": args.sim_device, "flops_model": workload.flops(cfg, size)}
            row["fwd"] = _pass(fwd)
            row["param_bytes"] = param_bytes
            if not args.no_train:
                step()  # creates the optimizer state, so the measured step is a steady-state one
                row["step"] = _pass(step, prepare=zero)
                zero()
                row["live_state"] = memory.live_bytes(model, opt)
            else:
                row["live_state"] = param_bytes
            from .data import local_bytes
            row["input_bytes"] = sum(local_bytes(t) for t in inputs) + local_bytes(target)
            if args.sim_device == "cpu":
                row["fwd"]["time"] = _time(fwd, args.iters, args.warmup)
                if not args.no_train:
                    row["step"]["time"] = _time(step, args.iters, args.warmup)
            del model, opt, inputs, target
    gc.collect()
    return row


def bounding(rows: list[dict], kind: str) -> dict:
    """Over the simulated ranks of one (size, P): the max of each figure and the rank that holds it."""
    def arg(key):
        best = max(rows, key=key)
        return {"rank": best["rank"], "value": key(best)}
    out = {"flops": arg(lambda r: r[kind]["flops"] or 0),
           "comm_bytes": arg(lambda r: sum(r[kind]["comm"]["bytes"].values())),
           "peak_total_bytes": arg(lambda r: total_bytes(r, kind))}
    if rows and "time" in rows[0][kind]:
        out["time"] = arg(lambda r: r[kind]["time"]["median"])
    return out


def total_bytes(row: dict, kind: str) -> int:
    """Per-rank total of a pass: its peak above the live state, plus the live state (parameters, and for a step
    the optimizer state) and the local inputs — the figure comparable with one device's total."""
    live = row["live_state"] if kind == "step" else row["param_bytes"]
    return (row[kind]["peak_bytes"] or 0) + live + row["input_bytes"]


def run(workload, args):
    """The --simulate CLI: every size of the sweep (or --sizes) for every requested P; writes <name>_sim*.json/.md."""
    from benchmarks import results_dir
    from .report import fmt_bytes

    cfg = workload.config(args)
    results_dir.prepare(args.out)
    rows = []
    plan = parse_simulate(args.simulate)
    t0 = time.perf_counter()
    for size in workload.sizes(args):
        for P, rank in plan:
            why = workload.supports(size, P) if P > 1 else None
            if why:
                print(f"{workload.label(size)} on {P} ranks: skipped ({why})", flush=True)
                continue
            for r in ranks_for(P, rank, args.sim_ranks):
                t = time.perf_counter()
                row = simulate_rank(workload, cfg, args, size, P, r)
                rows.append(row)
                kinds = ["fwd"] + ([] if args.no_train else ["step"])
                print(f"{workload.label(size)} P={P} rank {r}: " + "; ".join(
                    f"{k}: {row[k]['flops'] / 1e9:.1f} GFLOP, sent {fmt_bytes(sum(row[k]['comm']['bytes'].values()))}, "
                    f"memory {fmt_bytes(total_bytes(row, k))}" +
                    (f", {row[k]['time']['median'] * 1e3:.1f} ms" if "time" in row[k] else "") for k in kinds) +
                    f" ({time.perf_counter() - t:.1f} s)", flush=True)
    stem = f"{workload.name}_sim_{args.sim_device}" + (f"_{args.tag}" if args.tag else "")
    path = os.path.join(args.out, stem)
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    meta = {"command": "python " + os.path.relpath(sys.argv[0]) + " " + " ".join(args.argv), "workload": workload.name,
            "commit": commit + ("+dirty" if results_dir.tree_is_dirty() else ""),
            "config": cfg, "sim_device": args.sim_device, "batch": args.batch, "torch": torch.__version__,
            "note": SIM_NOTE, "wall_s": round(time.perf_counter() - t0, 1), "iters": args.iters,
            "notes": workload.notes(cfg)}
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    write_markdown({"meta": meta, "rows": rows}, path + ".md", no_train=args.no_train)
    print(f"wrote {path}.json/.md")


def memory_ratio(rows: list[dict], row: dict, kind: str):
    """(P x total / single total, P x peak-above-live+input / single) of ``row``'s rank against the simulated
    P = 1 row of the same size (None without one): 1 = a perfect split; see report.memory_ratios."""
    base = [b for b in rows if b["single"] and b["size"] == row["size"] and kind in b]
    if row["single"] or not base or kind not in row:
        return None
    b, P = base[0], row["ranks"]
    act = lambda r: (r[kind]["peak_bytes"] or 0) + r["input_bytes"]
    return (P * total_bytes(row, kind) / max(total_bytes(b, kind), 1), P * act(row) / max(act(b), 1))


def groups(rows):
    """Rows by (size, P) in order."""
    out = {}
    for r in rows:
        out.setdefault((r["size"], r["ranks"]), []).append(r)
    return out


def write_markdown(data: dict, path: str, no_train: bool = False):
    from .report import fmt_bytes, fmt_comm
    meta, rows = data["meta"], data["rows"]
    lines = [f"# {meta['workload']}: simulated ranks ({meta['sim_device']} local tensors)", "",
             f"Command: `{meta['command']}`; torch {meta['torch']}; batch {meta['batch']}.", "", meta["note"] + ".", "",
             "Memory ratios against the simulated P = 1 row of the same size (absent without one): P x this rank's "
             "total / the single-device total (1 = a perfect split; replicated parameters and optimizer state raise "
             "it), and the same for the part a split divides, the peak above the live state plus the input shard "
             "(above 1 = halos, regathered windows, replicated intermediates).", ""]
    for kind in ["fwd"] + ([] if no_train else ["step"]):
        lines += [f"## {'inference (no_grad forward)' if kind == 'fwd' else 'training step'}", "",
                  "| size | P | rank | local GFLOP | sent per rank | memory per rank (total) | of which peak above live |"
                  " P x total / single | P x (peak above live + input) / single |"
                  + (" local time |" if meta["sim_device"] == "cpu" else ""),
                  "|---|---|---|---|---|---|---|---|---|" + ("---|" if meta["sim_device"] == "cpu" else "")]
        for (size, P), rs in groups(rows).items():
            for r in rs:
                k = r[kind]
                lines.append(f"| {size} | {P} | {r['rank']} | {k['flops'] / 1e9:.2f} | {fmt_comm(k['comm'])} | "
                             f"{fmt_bytes(total_bytes(r, kind))} | {fmt_bytes(k['peak_bytes'])} | "
                             + (" | ".join(f"{v:.2f}" for v in m) if (m := memory_ratio(rows, r, kind)) else "- | -")
                             + " |" +
                             (f" {k['time']['median'] * 1e3:.1f} ms |" if "time" in k else ""))
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
