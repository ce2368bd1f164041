"""FFTs along sharded dims: collectives and bytes per transform against the all-to-all lower bound, and the per-rank
peak memory of an FNO-style training step (spectral convolution + 1x1 convolution + GELU) at 1, 2 and 4 CPU ranks
against one process, counted by shardtensor.CommCounter and shardtensor.peak_memory.

    .venv/bin/python benchmarks/fft/bench.py [--out DIR] [--size 128] [--channels 16]

DIR defaults to the git-ignored benchmarks/results/local; --out benchmarks/results updates the committed results
(from a clean tree only). Writes fft.json and fft.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_util import format_collectives as fmt  # noqa: E402
from results_dir import add_out_argument, prepare  # noqa: E402


class SpectralBlock(torch.nn.Module):
    """One FNO layer in plain torch: rfft2, per-mode complex weights on the low modes, irfft2, plus a 1x1 skip."""

    def __init__(self, channels, modes):
        super().__init__()
        self.modes = modes
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(channels, channels, modes, modes, 2, generator=g) / channels)
        self.skip = torch.nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        h, w = x.shape[-2:]
        low = torch.fft.rfft2(x)[..., : self.modes, : self.modes]
        mixed = torch.einsum("bixy,ioxy->boxy", low, torch.view_as_complex(self.weight))
        spectral = torch.fft.irfft2(F.pad(mixed, (0, w // 2 + 1 - self.modes, 0, h - self.modes)), s=(h, w))
        return F.gelu(spectral + self.skip(x))


def transforms(c, n):
    """(name, input shape, sharded dim, fn, lower bound in elements of the input's dtype moved by this rank)."""
    return [
        (f"rfft2 (1, {c}, {n}, {n}), H sharded: pencil to C", (1, c, n, n), 2, lambda t: torch.fft.rfft2(t)),
        (f"fft2 (1, {c}, {n}, {n}), H sharded: pencil to C", (1, c, n, n), 2, lambda t: torch.fft.fft2(t)),
        (f"rfft2 (1, 1, {n}, {n}), H sharded: staged", (1, 1, n, n), 2, lambda t: torch.fft.rfft2(t)),
        (f"irfft2 of the pencil spectrum (1, {c}, {n}, {n})", (1, c, n, n), 2,
         lambda t: torch.fft.irfft2(torch.fft.rfft2(t), s=t.shape[-2:])),
        (f"rfft along H of (4, {c}, {n}), H sharded: pencil to C", (4, c, n), 2, lambda t: torch.fft.rfft(t, dim=2)),
    ]


def run(rank, world, port, out_path, c, n):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    rows = []
    for name, shape, dim, fn in transforms(c, n):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        xs = st.distribute_tensor(x, mesh, [st.Shard(dim)])
        with st.CommCounter() as cc:
            y = fn(xs)
        err = ((y.full_tensor() - fn(x)).abs().max() / fn(x).abs().max()).item()
        local_bytes = xs.to_local().numel() * xs.element_size()
        # A transpose moves at least the (P-1)/P of the local shard that another rank owns afterwards.
        bound = local_bytes * (world - 1) / world
        rows.append({"transform": name, "calls": cc.calls, "bytes": cc.bytes, "lower_bound_bytes": bound,
                     "output_placements": str(st.placements(y)), "max_rel_error": err})
    # An FNO training step: per-rank peak memory against one process.
    torch.manual_seed(0)
    block = SpectralBlock(c, 8)
    x = torch.randn(1, c, n, n, generator=torch.Generator().manual_seed(2))
    xs = st.distribute_tensor(x, mesh, [st.Shard(2)])

    def step():
        out = block(xs)
        out.square().mean().backward()

    step()  # warm-up (plans, caches)
    block.zero_grad()
    peak = st.peak_memory(step)
    single = None
    if rank == 0:
        ref = SpectralBlock(c, 8)
        ref.load_state_dict(block.state_dict())

        def ref_step():
            ref(x).square().mean().backward()

        ref_step()
        single = st.peak_memory(ref_step)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"transforms": rows, "fno_peak_bytes_per_rank": peaks, "fno_single_device_peak_bytes": single},
                      f)
    dist.destroy_process_group()



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_out_argument(ap)
    ap.add_argument("--size", type=int, default=128, help="grid side n (n x n)")
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--ranks", default="1,2,4", help="world sizes to run")
    args = ap.parse_args()
    out = prepare(args.out)
    results = {}
    for world in [int(w) for w in args.ranks.split(",")]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        tmp = os.path.join(out, f".fft_rank0_{world}.json")
        mp.spawn(run, args=(world, port, tmp, args.channels, args.size), nprocs=world, join=True)
        with open(tmp) as f:
            results[world] = json.load(f)
        os.remove(tmp)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    command = f"python benchmarks/fft/bench.py --size {args.size} --channels {args.channels} --ranks {args.ranks}"
    meta = {"command": command, "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "counted_on": "rank 0 (bytes are what rank 0 passes to each collective)"}
    with open(os.path.join(out, "fft.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    lines = ["# FFTs along sharded dims", "",
             f"Rank 0 of P Gloo ranks; torch {torch.__version__}, commit {commit}, {meta['date']}. Command: `{command}`. "
             "Bytes are what rank 0 hands to each collective (its piece for itself included); the lower bound is the "
             "part of its input shard another rank owns after a transpose, (P-1)/P of the shard.", ""]
    for world, res in results.items():
        lines += [f"## P = {world}", "", "| transform | collectives | lower bound | output layout | max rel. error |",
                  "|---|---|---|---|---|"]
        for r in res["transforms"]:
            lines.append(f"| {r['transform']} | {fmt(r['calls'], r['bytes'])} | {r['lower_bound_bytes'] / 1024:.1f} KiB"
                         f" | {r['output_placements']} | {r['max_rel_error']:.1e} |")
        peaks = res["fno_peak_bytes_per_rank"]
        single = res["fno_single_device_peak_bytes"]
        lines += ["", f"FNO training step (1, {args.channels}, {args.size}, {args.size}), H sharded: per-rank peak "
                  + ", ".join(f"{p / 2**20:.1f} MiB" for p in peaks)
                  + f"; one process {single / 2**20:.1f} MiB; max/single = {max(peaks) / single:.2f}"
                  + f" (ideal 1/P = {1 / world:.2f})", ""]
    with open(os.path.join(out, "fft.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
