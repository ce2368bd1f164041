"""What a workload CLI provides to the runner: its model, synthetic input of a given size, how that input is
sharded, and its loss. Everything else (launching, timing, memory, communication, plots) is the runner's."""
from __future__ import annotations

import argparse
from typing import Any, Sequence

import torch
import torch.nn as nn


class Workload:
    name = "workload"          # file stem of the results: benchmarks/results/<name>.json
    title = "Workload"         # for titles and tables
    unit = "elements"          # what elements() counts (tokens, points, pixels), for plot axes

    # ---- configuration -------------------------------------------------------------------------------------
    def add_args(self, ap: argparse.ArgumentParser):
        """Model-size options of this workload."""

    def config(self, args) -> dict:
        """The model configuration (a registry config); ``args.quick`` selects the CI-sized one."""
        raise NotImplementedError

    def sizes(self, args) -> list:
        """Global input sizes of the strong-scaling and latency-vs-size sweep, smallest first."""
        raise NotImplementedError

    def weak_base(self, args):
        """Per-rank input size of weak scaling (the global size on one rank)."""
        raise NotImplementedError

    def weak_size(self, base, ranks: int):
        """Global size for weak scaling on ``ranks`` domain ranks with ``base`` per rank."""
        raise NotImplementedError

    def check_size(self, args):
        """A small size for the correctness check against one device."""
        raise NotImplementedError

    def elements(self, size) -> int:
        """Tokens / points / pixels of a size (the x axis of the plots)."""
        raise NotImplementedError

    def label(self, size) -> str:
        return str(size)

    def supports(self, size, ranks: int) -> str | None:
        """None when ``size`` can be sharded on ``ranks`` domain ranks, else the reason it cannot."""
        return None

    # ---- model and data ------------------------------------------------------------------------------------
    def build(self, cfg: dict, size) -> nn.Module:
        """The single-device model for inputs of ``size`` (same weights for the same torch seed)."""
        raise NotImplementedError

    def make_input(self, cfg: dict, size, batch: int, seed: int) -> tuple[tuple, Any]:
        """Full (global) synthetic inputs and target on the CPU for ``seed``: ``(inputs, target)``."""
        raise NotImplementedError

    def input_specs(self, cfg: dict, size, batch: int) -> tuple[tuple, Any]:
        """``((shape, dtype) per input, (shape, dtype) of the target)`` of ``make_input``'s global tensors, for
        simulations that must not build them (fake tensors). Default: built once and measured."""
        inputs, target = self.make_input(cfg, size, batch, 0)
        spec = lambda t: (tuple(t.shape), t.dtype)  # noqa: E731
        return tuple(spec(t) for t in inputs), spec(target)

    def shard_dims(self) -> tuple[Sequence, Any]:
        """The sharded dim of each input and of the target (None: replicated, passed as a plain tensor)."""
        raise NotImplementedError

    def loss(self, out, target, inputs) -> torch.Tensor:
        """Scalar loss of the model output against the target (``inputs``: what the model was called with)."""
        raise NotImplementedError

    def flops(self, cfg: dict, size) -> float | None:
        """Forward FLOPs of one sample (for the FLOP-normalised weak-scaling efficiency), if known."""
        return None

    def notes(self, cfg: dict) -> list[str]:
        """Workload-specific lines for the Markdown report (what is sharded, FLOP notes)."""
        return []


class PatchGridWorkload(Workload):
    """A model that patchifies an (H, W) grid sharded along H (ViT, the StormScope DiT): sizes are ``(H, W)``;
    ``config`` sets ``self._patch`` to the model's patch size."""
    _patch = 1

    def label(self, size) -> str:
        return f"{size[0]}x{size[1]}"

    def supports(self, size, ranks: int) -> str | None:
        if size[0] % (self._patch * ranks) or size[1] % self._patch:
            return f"H must be a multiple of patch x ranks ({self._patch} x {ranks}) and W of the patch"
        return None
