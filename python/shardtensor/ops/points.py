"""Exact neighbour searches over point clouds: ``knn`` and ``radius_search``.

Both accept plain tensors (CPU or CUDA) and ShardTensors. Points ``[N, C]`` or batched ``[B, N, C]``, queries
``[M, C]`` / ``[B, M, C]`` (same dtype, float32 or float64). Results are ordered by ascending Euclidean distance,
equal distances by ascending point index, so they are deterministic and identical for every sharding.

ShardTensor layouts: points and queries may be sharded along the point dim (-2, uneven extents and empty shards
allowed) on one mesh dim of a 1-D or 2-D mesh, and along the batch dim (local). Points sharded with queries
sharded, replicated or plain, and points replicated with queries sharded all work. The indices are global, and
both outputs are laid out like the queries. Sharding the coordinate dim (-1) raises ``NotImplementedError``.
Points sharded along the point dim are searched with a ring: every rank sends n - 1 point blocks (forward, and
again in backward).

The distances are differentiable with respect to points and queries (d dist / d q = (q - p) / dist, defined as 0
at distance 0); the indices are integers without gradient.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import _C  # noqa: F401  (loads the library that defines torch.ops.shardtensor)

__all__ = ["knn", "radius_search"]


def knn(points: torch.Tensor, queries: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest points of every query.

    Args:
        points: ``[N, C]`` or ``[B, N, C]``.
        queries: ``[M, C]`` or ``[B, M, C]``.
        k: neighbours per query, ``1 <= k <= N`` (``ValueError`` otherwise).

    Returns:
        ``(indices, distances)``, each ``[M, k]`` (``[B, M, k]``): int64 indices into the point dim (global for
        ShardTensors) and Euclidean distances, ascending; equal distances are ordered by lower index.
    """
    return torch.ops.shardtensor.knn(points, queries, int(k))


def radius_search(points: torch.Tensor, queries: torch.Tensor, radius: float,
                  max_neighbors: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_neighbors`` points within ``radius`` (distance <= radius) of every query, nearest first.

    Args:
        points: ``[N, C]`` or ``[B, N, C]``.
        queries: ``[M, C]`` or ``[B, M, C]``.
        radius: search radius, ``>= 0``.
        max_neighbors: slots per query, ``>= 1``; the nearest ones are kept when more points lie within radius.

    Returns:
        ``(indices, distances)``, each ``[M, max_neighbors]`` (``[B, M, max_neighbors]``), ordered like
        :func:`knn`. Unused slots hold index ``-1`` and distance ``+inf`` (rows stay sorted; mask with
        ``indices >= 0``; neighbours found per query: ``(indices >= 0).sum(-1)``).
    """
    return torch.ops.shardtensor.radius_search(points, queries, float(radius), int(max_neighbors))
