"""Neighbourhood attention (NATTEN semantics, Hassani et al.) on plain tensors and ShardTensors.

Tensors are tokens-first, heads-last: ``q`` and ``k`` are ``(B, X, H, D)`` (1-d), ``(B, X, Y, H, D)`` (2-d) or
``(B, X, Y, Z, H, D)`` (3-d); ``v`` has the same shape with its own head dim ``Dv``. Along each spatial dim of
extent ``L`` with odd kernel size ``K <= L``, the query at position ``i`` attends to the ``K`` keys starting at
``clamp(i - K // 2, 0, L - K)``: the window shifts inward at the borders, so every query sees exactly ``K`` keys
per dim. With ``dilation`` d (``K * d <= L``) the positions split into d interleaved groups (``i mod d``) and the
same clamped window is taken inside the query's group, so its keys are ``d`` apart. The attention weights are
``softmax(q . k * scale)`` over the window (the product over dims); the default ``scale`` is ``D ** -0.5``. The
output has shape ``(B, spatial..., H, Dv)``.

ShardTensor inputs may be sharded on the batch, spatial and heads dims (uneven and zero extents, 1-D or 2-D
meshes, one mesh dim per sharded spatial dim). Each sharded spatial dim exchanges a halo of ``K // 2`` key/value
rows each side (more next to the global borders, and from several ranks away when shards are narrow); the
gradients of those rows are sent back in backward. ``k``/``v`` laid out differently from ``q`` are redistributed
to ``q``'s layout. Sharding the head dim (last) raises ``NotImplementedError``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .. import _C  # noqa: F401  (loads the library that defines torch.ops.shardtensor)

__all__ = ["neighborhood_attention", "neighborhood_attention1d", "neighborhood_attention2d",
           "neighborhood_attention3d"]

KernelSize = Union[int, Sequence[int]]


def _per_dim(value: KernelSize, spatial: int, name: str, what: str) -> list:
    if isinstance(value, int):
        return [int(value)] * spatial
    vs = [int(k) for k in value]
    if len(vs) != spatial:
        raise ValueError(f"{name}: {what} {tuple(vs)} must have {spatial} entries (one per spatial dim)")
    return vs


def _call(query, key, value, kernel_size, dilation, scale, spatial, name):
    return torch.ops.shardtensor.neighborhood_attention(query, key, value,
                                                        _per_dim(kernel_size, spatial, name, "kernel_size"),
                                                        _per_dim(dilation, spatial, name, "dilation"), scale)


def neighborhood_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size: KernelSize,
                           dilation: KernelSize = 1, scale: Optional[float] = None) -> torch.Tensor:
    """Neighbourhood attention over ``query.dim() - 3`` spatial dims (1 to 3).

    Args:
        query, key: ``(B, spatial..., H, D)``; value: ``(B, spatial..., H, Dv)``. Plain tensors or ShardTensors.
        kernel_size: odd window size, one int for every spatial dim or one per dim.
        dilation: distance between the window's keys (int or one per dim); ``kernel_size * dilation`` must not
            exceed the extent.
        scale: multiplier of the dot products (default ``D ** -0.5``).

    Returns:
        ``(B, spatial..., H, Dv)``; a ShardTensor laid out like ``query`` when any input is one.
    """
    spatial = query.dim() - 3
    if spatial not in (1, 2, 3):
        raise ValueError(f"neighborhood_attention: query must have 4 to 6 dims (B, spatial..., H, D), got shape "
                         f"{tuple(query.shape)}")
    return _call(query, key, value, kernel_size, dilation, scale, spatial, "neighborhood_attention")


def _fixed(spatial: int, name: str):
    def fn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size: KernelSize,
           dilation: KernelSize = 1, scale: Optional[float] = None) -> torch.Tensor:
        if query.dim() != spatial + 3:
            raise ValueError(f"{name}: query must have {spatial + 3} dims (B, {spatial} spatial, H, D), got shape "
                             f"{tuple(query.shape)}")
        return _call(query, key, value, kernel_size, dilation, scale, spatial, name)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"{spatial}-d neighbourhood attention: query/key ``(B, {', '.join('XYZ'[:spatial])}, H, D)``, "
                  f"value ``(..., H, Dv)``; see :func:`neighborhood_attention`.")
    return fn


neighborhood_attention1d = _fixed(1, "neighborhood_attention1d")
neighborhood_attention2d = _fixed(2, "neighborhood_attention2d")
neighborhood_attention3d = _fixed(3, "neighborhood_attention3d")
