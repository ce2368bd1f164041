"""Pooling over two split dims (a 2x2 mesh splitting H and W), to compare two builds of the library: adaptive average
pooling to PSPNet's pyramid sizes and adaptive max pooling on a map no size divides (509 x 509), a UNet's k2 s2 max /
average pooling of even extents and k3 windows with halos along both dims (512 x 512). Per workload the median time
of a training step (forward, backward) and of a no_grad forward, the allocator peak over the step, and the halo
bytes (st.CommCounter); max over the ranks. Beside them the same op on each rank's own block as a plain tensor (no
communication, the border outputs computed with padding): the local-only step and forward, measured in the same run.

    PYTHONPATH=python .venv/bin/python benchmarks/halo_plan/pool_mesh2d.py --label after --json after.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardtensor as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import (init_cpu_rank, peak_bytes, reduce_over_ranks, spawn_rank0_rows, timed,  # noqa: E402
                        write_rank0_rows)

WORKLOADS = [("adaptive_avg_pool2d 2", 509, lambda t: F.adaptive_avg_pool2d(t, 2)),
             ("adaptive_avg_pool2d 3", 509, lambda t: F.adaptive_avg_pool2d(t, 3)),
             ("adaptive_avg_pool2d 6", 509, lambda t: F.adaptive_avg_pool2d(t, 6)),
             ("adaptive_max_pool2d 3", 509, lambda t: F.adaptive_max_pool2d(t, 3)),
             ("adaptive_max_pool2d 6", 509, lambda t: F.adaptive_max_pool2d(t, 6)),
             ("max_pool2d k2 s2", 512, lambda t: F.max_pool2d(t, 2)),
             ("avg_pool2d k2 s2", 512, lambda t: F.avg_pool2d(t, 2)),
             ("max_pool2d k3 s2 p1", 512, lambda t: F.max_pool2d(t, 3, 2, 1)),
             ("avg_pool2d k3 s2 p1", 512, lambda t: F.avg_pool2d(t, 3, 2, 1)),
             ("avg_pool2d k3 s1 p1", 512, lambda t: F.avg_pool2d(t, 3, 1, 1, count_include_pad=False))]


def step_and_forward(op, t):
    """A training step of ``op`` on ``t`` (the gradient cleared first) and a no_grad forward."""
    def step():
        t.grad = None
        op(t).square().mean().backward()

    def forward():
        with torch.no_grad():
            op(t)
    return step, forward


def run_rank(rank, world, port, scratch, args):
    mesh = init_cpu_rank(rank, world, port, mesh_shape=(2, 2), mesh_dim_names=("h", "w"))
    rows = []
    for name, size, op in WORKLOADS:
        torch.manual_seed(0)
        x = torch.randn(1, args.channels, size, size)
        xs = st.distribute_tensor(x, mesh, [st.Shard(2), st.Shard(3)]).requires_grad_()

        step, forward = step_and_forward(op, xs)
        # The same op on this rank's own block as a plain tensor: no communication.
        local_step, local_forward = step_and_forward(op, xs.to_local().detach().clone().requires_grad_())

        step_s = timed(step, warmup=2, iters=args.iters)
        fwd_s = timed(forward, warmup=2, iters=args.iters)
        local_step_s = timed(local_step, warmup=2, iters=args.iters)
        local_fwd_s = timed(local_forward, warmup=2, iters=args.iters)
        peak = peak_bytes(step, torch.device("cpu"))
        with st.CommCounter() as c:
            step()
        measured = {"step_s": step_s, "forward_s": fwd_s, "local_step_s": local_step_s, "local_forward_s": local_fwd_s,
                    "peak_bytes": peak, "halo_bytes": c.bytes.get("halo", 0)}
        rows.append({"workload": name, "input": [1, args.channels, size, size],
                     **{k: type(v)(reduce_over_ranks(v)) for k, v in measured.items()}})
    write_rank0_rows(rank, rows, scratch)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    rows = spawn_rank0_rows(run_rank, 4, args.json + ".rows", args)
    with open(args.json, "w") as f:
        json.dump({"label": args.label, "rows": rows}, f, indent=1)
    for r in rows:
        print(args.label, r)


if __name__ == "__main__":
    main()
