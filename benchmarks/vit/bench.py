"""ViT (the paper's HybridViT) on a height-sharded image: strong and weak scaling of inference and a training
step, per-rank memory and communication, after a correctness check against one device.

The image (B, 3, H, W) is sharded along H (``Shard(2)``); the patch convolution (kernel = stride = patch) is
local, the tokens come out sharded along the sequence, attention runs sequence-parallel (ring or all-to-all,
``st.attention_strategy()``), the mean over tokens is a pending sum reduced once before the head.

    python benchmarks/vit/bench.py --ranks 2                      # CPU, self-spawned Gloo ranks
    python benchmarks/vit/bench.py --ranks 2 --quick              # CI-sized
    python benchmarks/vit/bench.py --ranks 4 --mesh 2x2           # 2 data groups x 2 domain ranks, DDP
    torchrun --nproc-per-node 8 benchmarks/vit/bench.py --device cuda --sizes 1024,2048,4096 --no-train
    python benchmarks/vit/bench.py --plot-only                    # redraw from the JSON
Sizes: ``S`` (square) or ``HxW``, comma-separated.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch.nn.functional as F  # noqa: E402

from benchmarks.models import build, configs, synthetic  # noqa: E402
from benchmarks.scaling import runner  # noqa: E402
from benchmarks.scaling.workload import PatchGridWorkload  # noqa: E402


def parse_size(s: str):
    h, _, w = s.lower().partition("x")
    return (int(h), int(w or h))


class ViT(PatchGridWorkload):
    name, title, unit = "vit", "ViT (HybridViT)", "tokens"

    def add_args(self, ap):
        ap.add_argument("--model", default=None, help="registry config (tiny, full); default: full on CUDA, tiny "
                        "widened to embed 128 on CPU, tiny with --quick")
        ap.add_argument("--embed-dim", type=int, default=None, help="override the config's width")
        ap.add_argument("--depth", type=int, default=None, help="override the config's depth")
        ap.add_argument("--heads", type=int, default=None, help="override the config's heads")
        ap.add_argument("--attention", default="auto", choices=["auto", "ring", "all_to_all"],
                        help="sequence-parallel attention strategy (st.set_attention_strategy)")

    def config(self, args) -> dict:
        name = args.model or ("tiny" if args.quick or args.device == "cpu" else "full")
        over = {} if args.quick or args.model or args.device != "cpu" else {"embed_dim": 128}
        for key, val in (("embed_dim", args.embed_dim), ("depth", args.depth), ("num_heads", args.heads)):
            if val is not None:
                over[key] = val
        self._patch = configs("vit")[name].patch_size
        self._strategy = args.attention
        return {"name": name, "overrides": over, "attention": args.attention}

    def sizes(self, args):
        if args.sizes:
            return [parse_size(s) for s in args.sizes.split(",")]
        if args.quick:
            return [(64, 64), (128, 128)]
        return [(128, 128), (256, 256), (384, 384)] if args.device == "cpu" else [(512, 512), (1024, 1024), (2048, 2048)]

    def weak_base(self, args):
        if args.weak_base:
            return parse_size(args.weak_base)
        return (64, 64) if args.quick else (128, 128) if args.device == "cpu" else (1024, 1024)

    def weak_size(self, base, ranks):
        return (base[0] * ranks, base[1])  # more image rows per rank count: per-rank rows fixed

    def check_size(self, args):
        return (32, 32)

    def elements(self, size):
        return (size[0] // self._patch) * (size[1] // self._patch)

    def build(self, cfg, size):
        import shardtensor as st

        st.set_attention_strategy(cfg["attention"])
        return build("vit", cfg["name"], img_size=size, **cfg["overrides"])

    def _cfg(self, cfg):
        from dataclasses import replace

        return replace(configs("vit")[cfg["name"]], **cfg["overrides"])

    def make_input(self, cfg, size, batch, seed):
        c = self._cfg(cfg)
        x, labels = synthetic.random_images(batch, c.in_channels, size, c.num_classes, seed=seed)
        return (x,), labels

    def input_specs(self, cfg, size, batch):
        import torch
        c = self._cfg(cfg)
        return (((batch, c.in_channels, *size), torch.float32),), ((batch,), torch.int64)

    def shard_dims(self):
        return (2,), None

    def loss(self, out, target, inputs):
        return F.cross_entropy(out, target)

    def flops(self, cfg, size):
        c = self._cfg(cfg)
        n, d = self.elements(size), c.embed_dim
        per_layer = 2 * n * d * (3 * d + d + 2 * c.mlp_ratio * d) + 4 * n * n * d  # linears + QK^T and PV
        return float(c.depth * per_layer + 2 * n * d * c.in_channels * c.patch_size ** 2)

    def notes(self, cfg):
        c = self._cfg(cfg)
        return [f"Input (B, {c.in_channels}, H, W) sharded along H (`Shard(2)`); tokens = (H/{c.patch_size})·(W/"
                f"{c.patch_size}), sharded along the sequence; attention strategy `{cfg['attention']}`.",
                "Weak scaling grows H with the rank count (W fixed): per-rank tokens are constant, but global "
                "attention's per-rank FLOPs grow with P, hence the FLOP-normalised efficiency."]


if __name__ == "__main__":
    runner.main(ViT())
