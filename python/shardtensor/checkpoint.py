"""ShardTensors in ``torch.distributed.checkpoint`` (DCP), the standard distributed checkpoint.

DCP plans a save by asking each state-dict value for its write items and a load by asking for its chunk list;
DTensor answers through the methods ``__create_write_items__``, ``__create_chunk_list__`` and
``__get_tensor_shard__``, which DCP looks up with ``hasattr``. ShardTensors are plain ``torch.Tensor`` objects,
so importing shardtensor installs those three names on ``torch.Tensor`` as properties that answer for
ShardTensors and raise ``AttributeError`` for every other tensor (DCP then treats those as before).

Each rank saves its own shard with its global offsets (uneven and zero extents alike; copies on replicated
mesh dims are written once, by DCP's de-duplication); nothing is gathered. Loading fills the ShardTensors of the
target state dict in place, each rank reading the parts of the saved shards that overlap its own shard, so a
checkpoint loads into any layout and any number of ranks. ``Partial`` values (pending reductions) are refused:
redistribute them to ``Replicate`` first.

    import torch.distributed.checkpoint as dcp
    dcp.save({"field": x, "model": model.state_dict()}, checkpoint_id=path)     # on every rank
    dcp.load({"field": y, "model": model.state_dict()}, checkpoint_id=path)     # y: any layout of that shape
"""
from __future__ import annotations

import torch

from . import _C

__all__ = ["install"]


def _checked_layout(x, what: str):
    from . import placements
    pl = placements(x)
    if any(p.is_partial() for p in pl):
        raise NotImplementedError(
            f"torch.distributed.checkpoint ({what}): a ShardTensor with placements {pl} holds a pending reduction "
            "(Partial); resolve it first, e.g. x.redistribute([Replicate() if p.is_partial() else p for p in "
            "x.placements])")


def _chunk(x):
    """This rank's chunk (global offsets and local sizes), or None when it is empty and the tensor is not."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from . import local_offsets
    sizes = torch.Size(_C.local_shape(x))
    if sizes.numel() == 0 and x.numel() != 0:
        # An empty chunk can share its offsets with a neighbour's; DCP de-duplicates by offsets and could keep
        # the empty one. It carries no data, so it is left out.
        return None
    return ChunkStorageMetadata(offsets=torch.Size(local_offsets(x)), sizes=sizes)


def create_write_items(x, fqn, obj=None):
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    _checked_layout(x, f"saving {fqn!r}")
    chunk = _chunk(x)
    if chunk is None:
        return []
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk,
                                                  properties=TensorProperties.create_from_tensor(_C.to_local(x)),
                                                  size=x.size()))]


def create_chunk_list(x):
    _checked_layout(x, "loading")
    chunk = _chunk(x)
    return [] if chunk is None else [chunk]


def get_tensor_shard(x, index):
    return _C.to_local(x).detach()
