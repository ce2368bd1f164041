"""DLWP-HEALPix's padded convolutions on a split sphere: the HEALPix padding routed (one peer exchange per split mesh
dim, ``shardtensor.integrations.physicsnemo_healpix``) against the same module run op by op on the ShardTensor (its
own code: a split, slice, rot90 and cat per face and strip), the same convolutions on the rank's own rows without
communication (local-only: zero-padded), and one process, in one run.

A stack of ``HEALPixLayer(Conv2d(C -> C, k3)) + GELU`` (PhysicsNeMo's padding before each convolution) on one
sample's 12 faces folded into the batch, ``(12, C, nside, nside)``, split along H over P Gloo CPU ranks; a training
step (forward, mean-square loss, backward). Per size: collectives per step and the step's median time (slowest rank).

    .venv/bin/python benchmarks/healpix/bench.py [--out DIR] [--sizes 32,64] [--channels 16] [--layers 2] [--ranks 2]

DIR defaults to the git-ignored benchmarks/results/local; --out benchmarks/results updates the committed results
(from a clean tree only). Writes healpix.json and healpix.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_util import init_cpu_rank, reduce_over_ranks, spawn_rank0_rows, timed, write_rank0_rows  # noqa: E402
from bench_util import write_report  # noqa: E402
from results_dir import add_out_argument, git, prepare  # noqa: E402


def stack(c, layers):
    from physicsnemo.nn import HEALPixLayer
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [HEALPixLayer(torch.nn.Conv2d, in_channels=c, out_channels=c, kernel_size=3), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def zero_padded(c, layers):
    """The same convolutions with zero padding (a face block of any shape: the HEALPix padding needs square faces)."""
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def total_calls(calls: dict) -> int:
    return sum(calls.values())


def run(rank, world, port, out_path, sizes, c, layers):
    from physicsnemo.nn.module.hpx import padding as hpx
    from shardtensor.integrations.physicsnemo_healpix import padding_forward_sharded
    mesh = init_cpu_rank(rank, world, port)
    net = stack(c, layers)
    rows = []
    for n in sizes:
        x = torch.randn(12, c, n, n, generator=torch.Generator().manual_seed(1))
        xs = st.distribute_tensor(x, mesh, [st.Shard(2)]).requires_grad_()
        xl = st.to_local(xs).detach().requires_grad_()
        row = {"nside": n}
        for variant in ("routed", "op_by_op"):
            if variant == "op_by_op":
                st.unregister_function(hpx.HEALPixPadding.forward)

            def step():
                net(xs).square().mean().backward()

            step()
            with st.CommCounter() as cc:
                step()
            row[f"calls_{variant}"] = cc.calls
            row[f"seconds_{variant}"] = reduce_over_ranks(timed(step, iters=5))
        st.register_function(hpx.HEALPixPadding.forward, padding_forward_sharded)
        local = zero_padded(c, layers)
        row["seconds_local_only"] = reduce_over_ranks(timed(lambda: local(xl).square().mean().backward(), iters=5))
        if rank == 0:
            xr = x.clone().requires_grad_()
            row["seconds_single"] = timed(lambda: net(xr).square().mean().backward(), iters=5)
        rows.append(row)
    write_rank0_rows(rank, rows, out_path)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_out_argument(ap)
    ap.add_argument("--sizes", default="32,64", help="nside values (faces nside x nside)")
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    out = prepare(args.out)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = spawn_rank0_rows(run, args.ranks, os.path.join(out, ".healpix_rank0.json"), sizes, args.channels,
                            args.layers)
    commit = git("rev-parse", "--short", "HEAD")
    load = os.getloadavg()[0]
    command = (f"python benchmarks/healpix/bench.py --sizes {args.sizes} --channels {args.channels} "
               f"--layers {args.layers} --ranks {args.ranks}")
    meta = {"command": command, "torch": torch.__version__, "commit": commit, "load_1min": load,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    c, L, P = args.channels, args.layers, args.ranks
    lines = ["# DLWP-HEALPix padded convolutions on a split sphere", "",
             f"{L} x (`HEALPixLayer(Conv2d({c} -> {c}, k3))` + GELU) on one sample's 12 faces `(12, {c}, nside, "
             f"nside)` float32, split along H over {P} Gloo ranks (one intra-op thread each); a training step "
             f"(forward, mean-square loss, backward). torch {torch.__version__}, commit {commit}, {meta['date']}, "
             f"1-minute load {load:.1f} on 2 cores. Command: `{command}`. *Routed*: the padding through "
             "`shardtensor.integrations.physicsnemo_healpix` (one peer exchange per padding); *op by op*: the same "
             "module's own code on the ShardTensor (`st.unregister_function`); *local-only*: the same convolutions on the "
             "rank's own rows as a plain tensor, zero-padded (the HEALPix padding needs square faces), no "
             "communication (the compute a divided step cannot avoid); "
             "*one process*: the whole sphere. Times: the median of 5, the slowest rank.", "",
             "| nside | collectives per step: routed / op by op | routed | op by op | local-only | one process "
             "| routed / local-only | op by op / routed | one process / routed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['nside']} | {total_calls(r['calls_routed'])} / {total_calls(r['calls_op_by_op'])} | "
                     f"{r['seconds_routed'] * 1e3:.1f} ms | {r['seconds_op_by_op'] * 1e3:.1f} ms | "
                     f"{r['seconds_local_only'] * 1e3:.1f} ms | {r['seconds_single'] * 1e3:.1f} ms | "
                     f"{r['seconds_routed'] / r['seconds_local_only']:.2f} | "
                     f"{r['seconds_op_by_op'] / r['seconds_routed']:.1f} | "
                     f"{r['seconds_single'] / r['seconds_routed']:.2f} |")
    write_report(out, "healpix", {"meta": meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
