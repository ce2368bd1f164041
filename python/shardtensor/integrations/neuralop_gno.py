"""neuraloperator's graph neural operator block (``neuralop.layers.gno_block.GNOBlock``) on split point sets.

A GNO block integrates a learned kernel over the data points ``y`` within a radius of each query point ``x``: a
neighbour search (a dense ``cdist`` of queries against data, ``nonzero`` into a CSR list), a channel MLP on every
(neighbour, query) pair and a segment reduction per query. Op by op on ShardTensors the CSR list and the per-query
segment loop are data-dependent flat lists and thousands of single-row slices: right values, but gathered. GINO and
FNOGNO (a car surface of a million points, the output queries of a latent FNO) run it on the point sets that domain
parallelism splits, so ``GNOBlock.forward`` is routed here (``st.register_function``) when a ShardTensor is among
its arguments:

- **queries split** (``x`` split along its points; GNO-out, from a latent grid to the output points): the data
  ``y`` and its features ``f_y`` are made whole on every rank (an all-gather when they are split: a latent grid,
  far smaller than the point set), and each rank runs the block on its own queries. The output is split along its
  points like the queries; nothing else is communicated.
- **data split, queries whole** (``y`` and ``f_y`` split alike along their points, ``x`` whole; GNO-in, from the
  input points to the latent grid): each rank integrates over its own data points into every query, so the output
  is a pending sum (``Partial``); for the default ``mean`` reduction each query's neighbour count is summed over
  the ranks too (one all-reduce of one number per query) and the pending sum is divided by it, as one device
  divides by the whole neighbourhood's size (an empty neighbourhood gives 0 there as here).

In both the block's own code runs on plain local tensors (``st.local_map``): parameter gradients are summed over the
mesh dims that split the points, whole inputs that require grad get their summed gradient. Other layouts (a split
coordinate or feature dim, data and features split differently) run the library's own body on the ShardTensors.
"""
from __future__ import annotations

import torch

from ..compile import local_map
from ..ring import completed, whole
from .. import (Partial, Replicate, Shard, full_tensor, is_shard_tensor, placements, redistribute,
                sharding_shapes)

def install(module) -> None:
    """Route ``GNOBlock.forward`` of the imported ``neuralop.layers.gno_block``."""
    from ..functions import register_function
    register_function(module.GNOBlock.forward, gno_forward_sharded)


class _LocalBlock(torch.nn.Module):
    """The block's forward on plain local tensors with the reduction it is told, returning the output and each
    query's neighbour count (a module, so that ``local_map`` sums the block's parameter gradients)."""

    def __init__(self, block, reduction):
        super().__init__()
        self.block, self.reduction = block, reduction

    def forward(self, y, x, f_y):
        block = self.block
        if x.shape[0] == 0 or y.shape[0] == 0:
            # A rank without queries or data points (an empty or short shard): no neighbours (the library's search
            # cannot take an empty set).
            neighbors = {"neighbors_index": torch.zeros(0, dtype=torch.long, device=x.device),
                         "neighbors_row_splits": torch.zeros(x.shape[0] + 1, dtype=torch.long, device=x.device)}
            if block.neighbor_search.return_norm:
                neighbors["weights"] = torch.zeros(0, dtype=y.dtype, device=y.device)
        else:
            neighbors = block.neighbor_search(data=y, queries=x, radius=block.radius)
        y_e, x_e = y, x
        if block.pos_embedding is not None:
            y_e, x_e = _embedded(block.pos_embedding, y), _embedded(block.pos_embedding, x)
        transform = block.integral_transform
        saved = transform.reduction
        transform.reduction = self.reduction
        try:
            out = transform(y=y_e, x=x_e, neighbors=neighbors, f_y=f_y)
        finally:
            transform.reduction = saved
        # Every parameter and input in this rank's graph (a zero term when no pair reached them: no neighbours, an
        # empty shard), so each rank's backward reaches the summation of their gradients over the ranks that the
        # others wait in.
        anchors = [t for t in (*self.parameters(), y, x, f_y) if t is not None and t.requires_grad]
        if anchors:
            out = out + sum(t.reshape(-1)[:0].sum() for t in anchors).to(out.dtype)
        splits = neighbors["neighbors_row_splits"]
        return out, (splits[1:] - splits[:-1]).to(out.dtype)


def _embedded(embedding, points):
    """The positional embedding of ``points``; of none, the embedding's empty rows (the library's sinusoidal
    embedding cannot reshape an empty set)."""
    if points.shape[0] > 0:
        return embedding(points)
    return embedding(points.new_zeros((1,) + tuple(points.shape[1:])))[:0]


def _split_only_along(t, dim):
    """True when ``t`` is a ShardTensor split along ``dim`` (and no other dim), with no pending sum."""
    pl = placements(t)
    return any(p.is_shard() for p in pl) and all(p.is_replicate() or (p.is_shard() and p.dim == dim) for p in pl)


def gno_forward_sharded(block, y, x, f_y=None):
    """``GNOBlock.forward(y, x, f_y)`` with ShardTensor arguments (see the module's docstring)."""
    y, x = completed(y), completed(x)
    f_y = completed(f_y) if f_y is not None else None
    body = type(block).forward  # its own body: routed calls made from here run it
    batched = f_y is not None and f_y.dim() == 3
    out_point_dim = 1 if batched else 0
    if is_shard_tensor(x) and x.dim() == 2 and _split_only_along(x, 0):
        # Queries split: every rank reads the whole data for its own queries.
        pl = [Shard(out_point_dim) if p.is_shard() else Replicate() for p in placements(x)]
        shapes = sharding_shapes(x)
        local = _LocalBlock(block, block.integral_transform.reduction)
        out, _ = local_map(local, out_placements=[pl, None], sharding_shapes=shapes)(
            whole(y), x, whole(f_y) if f_y is not None else None)
        return out
    f_point_dim = f_y.dim() - 2 if f_y is not None else None
    if is_shard_tensor(x) and all(p.is_replicate() for p in placements(x)):
        x = full_tensor(x)  # whole queries as a plain tensor: local_map then sums their gradient over the ranks
    if (is_shard_tensor(y) and y.dim() == 2 and _split_only_along(y, 0) and not is_shard_tensor(x)
            and (f_y is None or (is_shard_tensor(f_y) and placements(f_y) == tuple(
                Shard(f_point_dim) if p.is_shard() else p for p in placements(y))
                and sharding_shapes(f_y) == sharding_shapes(y)))):
        # Data split, queries whole: each rank's points into every query, a pending sum over the ranks.
        transform = block.integral_transform
        mean = transform.reduction == "mean" and transform.weighting_fn is None
        partial = [Partial() if p.is_shard() else Replicate() for p in placements(y)]
        out, counts = local_map(_LocalBlock(block, "sum"), out_placements=[partial, partial],
                                sharding_shapes={})(y, x, f_y)
        if mean:
            total = redistribute(counts, [Replicate()] * len(partial)).clamp(min=1).unsqueeze(-1)
            out = out / total
        return out
    return body(block, y, x, f_y)
