"""Collectives and bytes per normalization layer, forward and backward, counted by the library's own
communication counter (shardtensor.CommCounter), on 2 CPU ranks with uneven shards.

    .venv/bin/python benchmarks/norm_comm/bench.py [--out DIR]     # writes norm_comm.{json,md} into DIR

DIR defaults to the git-ignored benchmarks/results/local; --out benchmarks/results updates the committed results
(from a clean tree only).
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_util import format_collectives as fmt, spawn_rank0_rows, write_rank0_rows, write_report  # noqa: E402
from results_dir import add_out_argument, prepare  # noqa: E402


def layers():
    """(name, module factory, input shape, sharded dim)."""
    return [
        ("LayerNorm(64), tokens sharded", lambda: nn.LayerNorm(64), (2, 1001, 64), 1),
        ("LayerNorm(64), features sharded", lambda: nn.LayerNorm(64), (2, 1001, 64), 2),
        ("RMSNorm(64), tokens sharded", lambda: nn.RMSNorm(64), (2, 1001, 64), 1),
        ("GroupNorm(4, 32), height sharded", lambda: nn.GroupNorm(4, 32), (2, 32, 61, 64), 2),
        ("BatchNorm2d(32), height sharded", lambda: nn.BatchNorm2d(32), (2, 32, 61, 64), 2),
        ("InstanceNorm2d(32), height sharded", lambda: nn.InstanceNorm2d(32), (2, 32, 61, 64), 2),
        ("softmax over sharded tokens", lambda: nn.Softmax(dim=1), (2, 1001, 64), 1),
    ]


def run(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    rows = []
    for name, make, shape, dim in layers():
        torch.manual_seed(0)
        layer = make()
        st.sync_module(layer, mesh)
        x = torch.randn(shape)
        xs = st.distribute_tensor(x, mesh, [st.Shard(dim)]).requires_grad_(True)
        with st.CommCounter() as fwd:
            y = layer(xs)
        w = torch.randn(shape)
        loss = (y * w).sum()
        loss_full = loss.full_tensor()  # resolve the Partial loss outside the counted backward
        with st.CommCounter() as bwd:
            loss.backward()
        ref_layer = make()
        ref_layer.load_state_dict(layer.state_dict()) if list(layer.state_dict()) else None
        xr = x.clone().requires_grad_(True)
        ref = (ref_layer(xr) * w).sum()
        ref.backward()
        err = max((loss_full - ref).abs().item() / max(ref.abs().item(), 1e-12),
                  ((xs.grad.full_tensor() - xr.grad).abs().max() / xr.grad.abs().max()).item())
        rows.append({"layer": name, "input": list(shape), "sharded_dim": dim,
                     "forward_calls": fwd.calls, "forward_bytes": fwd.bytes,
                     "backward_calls": bwd.calls, "backward_bytes": bwd.bytes,
                     "max_rel_error_vs_single_device": err})
    write_rank0_rows(rank, rows, out_path)
    dist.destroy_process_group()



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_out_argument(ap)
    args = ap.parse_args()
    out = prepare(args.out)
    world = 2
    rows = spawn_rank0_rows(run, world, os.path.join(out, ".norm_comm_rank0.json"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    meta = {"command": "python benchmarks/norm_comm/bench.py", "world_size": world, "torch": torch.__version__,
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "counted_on": "rank 0 (bytes are what rank 0 passes to each collective)"}
    payload = {"meta": meta, "layers": rows}
    lines = ["# Communication per normalization layer", "",
             f"Collectives issued by rank 0 of {world} Gloo ranks, counted by `shardtensor.CommCounter`; torch "
             f"{torch.__version__}, commit {commit}, {meta['date']}. Backward includes the reduction of the "
             "parameter gradients. Command: `.venv/bin/python benchmarks/norm_comm/bench.py`.", "",
             "| layer | input | forward | backward | max rel. error vs one device |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['input']} | {fmt(r['forward_calls'], r['forward_bytes'])} | "
                     f"{fmt(r['backward_calls'], r['backward_bytes'])} | {r['max_rel_error_vs_single_device']:.1e} |")
    write_report(out, "norm_comm", payload, lines)


if __name__ == "__main__":
    main()
