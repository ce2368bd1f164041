"""StormScope-like diffusion transformer (DiT with adaLN-Zero and 2-D neighbourhood attention) on a
height-sharded grid: strong and weak scaling of inference and a training step, per-rank memory and
communication, after a correctness check against one device.

The input (B, 22, H, W) (noisy target + conditioning channels) and the target (B, 8, H, W) are sharded along H
(``Shard(2)``); the noise level sigma (B,) is replicated. Patch embedding, linears and norms are local, the
positional embedding is sliced to each rank's token rows, the neighbourhood attention exchanges ``kernel // 2``
halo token rows (the library's ``shardtensor.ops.neighborhood_attention2d``).

    python benchmarks/stormscope/bench.py --ranks 2
    python benchmarks/stormscope/bench.py --ranks 2 --quick
    python benchmarks/stormscope/bench.py --ranks 4 --mesh 2x2 --data-parallel fsdp2
    torchrun --nproc-per-node 2 benchmarks/stormscope/bench.py --device cuda --sizes 512x896
    python benchmarks/stormscope/bench.py --plot-only
Sizes: ``HxW`` (or ``H``: width 7/4 of it, the CONUS aspect), comma-separated.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.models import build, configs, synthetic  # noqa: E402
from benchmarks.scaling import runner  # noqa: E402
from benchmarks.scaling.workload import PatchGridWorkload  # noqa: E402
from shardtensor.ops import neighborhood_attention2d  # noqa: E402

SIGMA_DATA = 0.5


def parse_size(s: str):
    h, _, w = s.lower().partition("x")
    return (int(h), int(w) if w else int(h) * 7 // 4)


class StormScope(PatchGridWorkload):
    name, title, unit = "stormscope", "StormScope DiT", "pixels"

    def add_args(self, ap):
        ap.add_argument("--model", default=None, help="registry config (small, full); default small")
        ap.add_argument("--hidden", type=int, default=None, help="override the config's hidden width")
        ap.add_argument("--depth", type=int, default=None, help="override the config's depth")
        ap.add_argument("--heads", type=int, default=None, help="override the config's heads")
        ap.add_argument("--kernel", type=int, default=None, help="neighbourhood attention kernel (odd)")

    def config(self, args) -> dict:
        name = args.model or "small"
        over = {}
        if args.device == "cuda" and not args.quick and not args.model:
            over = {"hidden_size": 384, "depth": 8, "num_heads": 8, "attn_kernel": 7, "freq_dim": 128}
        for key, val in (("hidden_size", args.hidden), ("depth", args.depth), ("num_heads", args.heads),
                         ("attn_kernel", args.kernel)):
            if val is not None:
                over[key] = val
        self._patch = configs("stormscope")[name].patch_size
        return {"name": name, "overrides": over}

    def sizes(self, args):
        if args.sizes:
            return [parse_size(s) for s in args.sizes.split(",")]
        if args.quick:
            return [(64, 112), (128, 224)]
        return [(64, 112), (128, 224), (256, 448)] if args.device == "cpu" else [(256, 448), (512, 896)]

    def weak_base(self, args):
        if args.weak_base:
            return parse_size(args.weak_base)
        return (64, 112) if args.quick or args.device == "cpu" else (256, 448)

    def weak_size(self, base, ranks):
        return (base[0] * ranks, base[1])

    def check_size(self, args):
        return (40, 56)

    def elements(self, size):
        return size[0] * size[1]

    def build(self, cfg, size):
        return build("stormscope", cfg["name"], attention_fn=neighborhood_attention2d, img_size=size,
                     **cfg["overrides"])

    def make_input(self, cfg, size, batch, seed):
        s = synthetic.stormscope_batch(size[0], size[1], seed=seed, batch=batch, sigma_data=SIGMA_DATA)
        return (s["x"], s["sigma"]), s["target"]

    def input_specs(self, cfg, size, batch):
        import torch
        from dataclasses import replace
        c = replace(configs("stormscope")[cfg["name"]], **cfg["overrides"])
        return ((((batch, c.in_channels, *size), torch.float32), ((batch,), torch.float32)),
                ((batch, c.out_channels, *size), torch.float32))

    def shard_dims(self):
        return (2, None), 2

    def loss(self, out, target, inputs):
        # EDM's weighted denoising loss: lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma * sigma_data)^2 per
        # sample (a plain (B,) tensor broadcast over the sharded grid).
        sigma = inputs[1]
        weight = (sigma ** 2 + SIGMA_DATA ** 2) / (sigma * SIGMA_DATA) ** 2
        return (weight[:, None, None, None] * (out - target).square()).mean()

    def notes(self, cfg):
        from dataclasses import replace

        c = replace(configs("stormscope")[cfg["name"]], **cfg["overrides"])
        return [f"Input (B, {c.in_channels}, H, W) and target (B, {c.out_channels}, H, W) sharded along H "
                f"(`Shard(2)`), sigma (B,) replicated; patch {c.patch_size}, neighbourhood kernel {c.attn_kernel} "
                f"(halo {c.attn_kernel // 2} token rows = {c.attn_kernel // 2 * c.patch_size} pixel rows).",
                "Neighbourhood attention: the library's `shardtensor.ops.neighborhood_attention2d` (NATTEN "
                "semantics, K/V halo exchange).",
                "Per-rank FLOPs are proportional to the local rows (plus the halo), so weak scaling needs no "
                "FLOP normalisation."]


if __name__ == "__main__":
    runner.main(StormScope())
