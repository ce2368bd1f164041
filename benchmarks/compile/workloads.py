"""The two training steps the compile benchmark measures, and the backends it compiles them with (counting graphs).

Each workload builds its model from a fixed seed (every mode starts from the same weights, so the first losses must
agree), one sharded input and a target. The step is ``torch.compile(model)`` (or the model itself, eagerly) for the
forward, then the loss, backward and an SGD step eagerly: the supported ``torch.compile(model)(shard_tensor)`` use.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)     # `benchmarks.models`


def uneven(size: int, world: int, unit: int = 1) -> list:
    """Extents of ``size`` over ``world`` ranks in multiples of ``unit``, rank 0 one unit-block longer than an even
    split where possible (uneven shards: each rank's graph has its own shapes)."""
    blocks = size // unit
    base, extra = divmod(blocks, world)
    ext = [base + (1 if r < extra else 0) for r in range(world)]
    if extra == 0 and base > 1:
        ext[0], ext[-1] = ext[0] + 1, ext[-1] - 1
    return [e * unit for e in ext]


def conv_stack(channels: int, layers: int, norm: bool, act=nn.GELU) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods.append(nn.Conv2d(channels, channels, 3, padding=1))
        if norm:
            mods.append(nn.GroupNorm(2, channels))
        mods.append(act())
    return nn.Sequential(*mods)


def relu_conv_spec(size: int) -> tuple:
    """The halo benchmarks' stack, 4 x (Conv2d 16->16 3x3 + ReLU) on a (1, 16, size, size) input, as a spec like
    ``specs``' entries (benchmarks/grad_buckets and benchmarks/overlap time its training step)."""
    return (f"4 x (Conv2d 16->16 3x3 + ReLU), input (1, 16, {size}, {size}) split on H, loss mean(y^2)",
            lambda: conv_stack(16, 4, False, nn.ReLU), (1, 16, size, size), uneven(size, 2), lambda: None,
            square_mean)


def square_mean(out, target):
    return out.square().mean()


def cross_entropy(out, target):
    return F.cross_entropy(out, target)


def specs(quick: bool) -> dict:
    """name -> (description, model factory, global input shape, extents of dim 2, target factory, loss)."""
    c, hw, layers = (4, 32, 2) if quick else (8, 64, 3)
    img = 32 if quick else 64
    conv = lambda norm: lambda: conv_stack(c, layers, norm)  # noqa: E731
    vit = lambda: _vit(img)  # noqa: E731
    no_target = lambda: None  # noqa: E731
    labels = lambda: torch.randint(0, 10, (2,), generator=torch.Generator().manual_seed(1))  # noqa: E731
    return {
        "conv": (f"{layers} x (Conv2d 3x3 + GELU), input (1, {c}, {hw}, {hw}), loss mean(y^2)", conv(False),
                 (1, c, hw, hw), uneven(hw, 2), no_target, square_mean),
        "conv_gn": (f"{layers} x (Conv2d 3x3 + GroupNorm(2) + GELU), input (1, {c}, {hw}, {hw}), loss mean(y^2)",
                    conv(True), (1, c, hw, hw), uneven(hw, 2), no_target, square_mean),
        "vit": (f"ViT tiny (embed 64, depth 2, 2 heads, patch 8), input (2, 3, {img}, {img}), cross-entropy", vit,
                (2, 3, img, img), uneven(img, 2, 8), labels, cross_entropy),
    }


def _vit(img: int) -> nn.Module:
    from benchmarks.models import build
    torch.manual_seed(0)
    return build("vit", "tiny", img_size=(img, img))


def make_input(shape, extents, mesh) -> torch.Tensor:
    full = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    return st.distribute_tensor(full, mesh, [st.Shard(2)], {0: extents})


def training_step(spec, mesh):
    """A spec's model (synced over ``mesh``) and its training step on the spec's sharded input: ``(model, step)``,
    ``step()`` = zero the gradients, forward, loss, backward (benchmarks/grad_buckets and benchmarks/overlap)."""
    _, factory, shape, extents, target_fn, loss_fn = spec
    model = factory()
    st.sync_module(model, mesh)
    x = make_input(shape, extents, mesh)
    target = target_fn()

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), target).backward()

    return model, step


class CountingBackend:
    """Backend ``name`` ("aot_eager" or "inductor") with its graphs counted: ``dynamo`` (graphs Dynamo hands the
    backend: one per graph break + 1, plus recompiles), ``fw`` and ``bw`` (the AOTAutograd forward and backward graphs
    compiled). Same compilers as the named backend; only the counting is added."""

    def __init__(self, name: str):
        if name not in ("aot_eager", "inductor"):
            raise ValueError(f"unknown backend {name!r}")
        self.name, self.dynamo, self.fw, self.bw = name, 0, 0, 0

    def _count(self, compiler, backward: bool):
        def compile_one(gm, example_inputs, **kw):
            if backward or kw.get("is_backward"):
                self.bw += 1
            else:
                self.fw += 1
            return compiler(gm, example_inputs, **kw)
        return compile_one

    def __call__(self, gm, example_inputs, **kw):
        self.dynamo += 1
        if self.name == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager, boxed_nop
            return aot_eager(gm, example_inputs, fw_compiler=self._count(boxed_nop, False),
                             bw_compiler=self._count(boxed_nop, True), **kw)
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        # inductor calls inner_compile for the forward and (is_backward=True) the backward graph.
        return compile_fx(gm, example_inputs, inner_compile=self._count(compile_fx_inner, False), **kw)
