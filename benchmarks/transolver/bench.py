"""Transolver (physics attention on an irregular point set, DrivAerML surface configuration) with the points
sharded: strong and weak scaling of inference and a training step, per-rank memory and communication, after a
correctness check against one device (on an uneven split of the points).

The points (B, N, C) are sharded along N (``Shard(1)``): every per-point op is local; per layer, the two sums
over the points (slice weights' total, weighted feature sum) are pending sums reduced once; the slice attention
runs on the small replicated slice tokens.

    python benchmarks/transolver/bench.py --ranks 2
    python benchmarks/transolver/bench.py --ranks 2 --quick
    python benchmarks/transolver/bench.py --ranks 4 --mesh 2x2 --data-parallel ddp
    torchrun --nproc-per-node 8 benchmarks/transolver/bench.py --device cuda --sizes 300000,1200000
    python benchmarks/transolver/bench.py --plot-only
Sizes: number of points, comma-separated.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch.nn.functional as F  # noqa: E402

from benchmarks.models import build, configs, synthetic  # noqa: E402
from benchmarks.scaling import runner  # noqa: E402
from benchmarks.scaling.workload import Workload  # noqa: E402


class Transolver(Workload):
    name, title, unit = "transolver", "Transolver (DrivAerML surface)", "points"

    def add_args(self, ap):
        ap.add_argument("--model", default=None, help="registry config (tiny, drivaerml); default: drivaerml on "
                        "CUDA, tiny widened (hidden 64, 4 heads, 32 slices) on CPU, tiny with --quick")
        ap.add_argument("--layers", type=int, default=None, help="override the config's layers")
        ap.add_argument("--hidden", type=int, default=None, help="override the config's hidden width")
        ap.add_argument("--slices", type=int, default=None, help="override the config's slices")

    def config(self, args) -> dict:
        name = args.model or ("tiny" if args.quick or args.device == "cpu" else "drivaerml")
        over = {} if args.quick or args.model or args.device != "cpu" else {"n_hidden": 64, "n_head": 4, "slice_num": 32}
        for key, val in (("n_layers", args.layers), ("n_hidden", args.hidden), ("slice_num", args.slices)):
            if val is not None:
                over[key] = val
        return {"name": name, "overrides": over}

    def sizes(self, args):
        if args.sizes:
            return [int(s) for s in args.sizes.split(",")]
        if args.quick:
            return [2048, 8192]
        return [4096, 16384, 32768] if args.device == "cpu" else [100_000, 300_000, 1_200_000]

    def weak_base(self, args):
        if args.weak_base:
            return int(args.weak_base)
        return 2048 if args.quick else 8192 if args.device == "cpu" else 300_000

    def weak_size(self, base, ranks):
        return base * ranks

    def check_size(self, args):
        return 515  # odd: the ranks hold different numbers of points

    def elements(self, size):
        return int(size)

    def build(self, cfg, size):
        return build("transolver", cfg["name"], **cfg["overrides"])

    def make_input(self, cfg, size, batch, seed):
        s = synthetic.ellipsoid_surface(size, seed=seed, batch=batch)
        return (s["embedding"], s["fx"]), s["target"]

    def input_specs(self, cfg, size, batch):
        import torch
        from dataclasses import replace
        c = replace(configs("transolver")[cfg["name"]], **cfg["overrides"])
        n = int(size)
        return (((batch, n, 6), torch.float32), ((batch, n, 2), torch.float32)), ((batch, n, c.out_dim), torch.float32)

    def shard_dims(self):
        return (1, 1), 1

    def loss(self, out, target, inputs):
        return F.mse_loss(out, target)

    def notes(self, cfg):
        from dataclasses import replace

        c = replace(configs("transolver")[cfg["name"]], **cfg["overrides"])
        return [f"Points (B, N, {c.in_dim}) as embedding (B, N, 6) and fx (B, N, 2), target (B, N, {c.out_dim}), all "
                "sharded along N (`Shard(1)`); synthetic potential flow around an ellipsoid "
                "(`benchmarks.models.synthetic.ellipsoid_surface`).",
                "Per-rank FLOPs are proportional to the local points (the slice attention is O(S²) and replicated), "
                "so weak scaling needs no FLOP normalisation."]


if __name__ == "__main__":
    runner.main(Transolver())
