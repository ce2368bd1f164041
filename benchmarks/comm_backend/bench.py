"""Eager cost of the functional collective backend against the ProcessGroup one: time per collective-bound step
(ratios within one run, alternating the backends), collectives and bytes (which must be equal), on 2 CPU ranks.

    .venv/bin/python benchmarks/comm_backend/bench.py [--repeats N] [--out DIR]   # comm_backend.{json,md} into DIR

DIR defaults to the git-ignored benchmarks/results/local; --out benchmarks/results updates the committed results
(from a clean tree only).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_util import format_collectives as fmt, spawn_rank0_rows, write_rank0_rows, write_report  # noqa: E402
from results_dir import add_out_argument, prepare  # noqa: E402


def workloads(mesh):
    """(name, step) pairs; each step issues the library's collectives of one kind of layer."""
    torch.manual_seed(0)
    x_small = st.distribute_tensor(torch.randn(64, 64), mesh, [st.Shard(0)])
    x_img = st.distribute_tensor(torch.randn(1, 8, 96, 96), mesh, [st.Shard(2)])
    w = torch.randn(8, 8, 3, 3)
    q = st.distribute_tensor(torch.randn(1, 4, 256, 32), mesh, [st.Shard(2)])
    return [
        ("all-gather (full_tensor of 64x64)", lambda: x_small.full_tensor()),
        ("all-to-all (Shard(0) -> Shard(1), 64x64)", lambda: st.redistribute(x_small, [st.Shard(1)])),
        ("all-reduce (softmax over the sharded dim)", lambda: x_small.softmax(0)),
        ("halo conv2d 3x3 (1, 8, 96, 96)", lambda: F.conv2d(x_img, w, padding=1)),
        ("ring attention (1, 4, 256, 32)", lambda: F.scaled_dot_product_attention(q, q, q)),
    ]


def run(rank, world, port, out_path, repeats):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    st.set_attention_strategy("ring_contiguous")
    rows = []
    for name, step in workloads(mesh):
        times = {"process_group": [], "functional": []}
        counts = {}
        for backend in ("process_group", "functional"):   # warm-up, and the collectives of one step
            with st.use_comm_backend(backend), st.CommCounter() as c:
                step()
            counts[backend] = (dict(c.calls), dict(c.bytes))
        for _ in range(repeats):
            for backend in ("process_group", "functional"):  # alternating: load changes hit both alike
                with st.use_comm_backend(backend):
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    times[backend].append(time.perf_counter() - t0)
        pg, fn = statistics.median(times["process_group"]), statistics.median(times["functional"])
        rows.append({"workload": name, "process_group_us": pg * 1e6, "functional_us": fn * 1e6, "ratio": fn / pg,
                     "calls": counts["process_group"][0], "bytes": counts["process_group"][1],
                     "same_collectives": counts["process_group"] == counts["functional"]})
    write_rank0_rows(rank, rows, out_path)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50)
    add_out_argument(ap)
    args = ap.parse_args()
    out = prepare(args.out)
    world = 2
    rows = spawn_rank0_rows(run, world, os.path.join(out, ".comm_backend_rank0.json"), args.repeats)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    command = f"python benchmarks/comm_backend/bench.py --repeats {args.repeats}"
    meta = {"command": command, "world_size": world, "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    payload = {"meta": meta, "workloads": rows}
    lines = ["# Functional vs ProcessGroup collectives, eager", "",
             f"Rank 0 of {world} Gloo CPU ranks; median of {args.repeats} alternating steps per backend; torch "
             f"{torch.__version__}, commit {commit}, {meta['date']}. Command: `{command}`. Ratios compare the two "
             "backends within this run (the machine is shared: absolute times are noisy).", "",
             "| workload | collectives (rank 0) | same with both | process_group | functional | functional / pg |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {fmt(r['calls'], r['bytes'])} | {'yes' if r['same_collectives'] else 'NO'} "
                     f"| {r['process_group_us']:.0f} µs | {r['functional_us']:.0f} µs | {r['ratio']:.2f} |")
    write_report(out, "comm_backend", payload, lines)


if __name__ == "__main__":
    main()
