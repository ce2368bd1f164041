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

``dcp.save`` into a directory that already holds a checkpoint overwrites it file by file, so a rank that dies
mid-save leaves a mix that DCP still loads. ``save`` / ``load`` below never overwrite: each save writes a fresh
directory under a root, marks it complete once every rank finished, and then switches the root's ``LATEST``
pointer to it (an atomic rename); ``load`` follows the pointer, and refuses a directory without the mark::

    st.checkpoint.save({"field": x, "model": model.state_dict()}, "ckpt")          # ckpt/step-1, ckpt/LATEST
    st.checkpoint.load({"field": y, "model": model.state_dict()}, "ckpt")          # the latest complete one
"""
from __future__ import annotations

import torch

from . import _C

__all__ = ["save", "load", "latest"]


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


# ---- checkpoints that are complete or absent ----

POINTER = "LATEST"
COMPLETE = ".shardtensor-complete"


def _leader(process_group):
    """(whether this rank leads, the leader's global rank) of ``process_group`` (None: the default group)."""
    import torch.distributed as dist
    leader = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    return dist.get_rank() == leader, leader


def _from_leader(value, process_group):
    """``value`` as the group's first rank has it, on every rank (one small broadcast)."""
    import torch.distributed as dist
    _, leader = _leader(process_group)
    box = [value]
    dist.broadcast_object_list(box, src=leader, group=process_group)
    return box[0]


def _raise_everywhere(problem, process_group, exception=ValueError):
    """``problem`` is the leader's verdict (a message or None), the same on every rank after the broadcast."""
    problem = _from_leader(problem, process_group)
    if problem:
        raise exception(problem)


def latest(root):
    """The directory ``root``'s pointer names (the last complete checkpoint ``save`` wrote), or None. Not a
    collective: it reads the pointer file."""
    import os
    pointer = os.path.join(os.fspath(root), POINTER)
    try:
        with open(pointer) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(os.fspath(root), name) if name else None


def save(state_dict, root, name=None, *, process_group=None, **dcp_kwargs) -> str:
    """Save ``state_dict`` with ``torch.distributed.checkpoint`` into a fresh directory ``root/name`` (default
    ``step-N``, one more than the largest there), then mark it complete and point ``root/LATEST`` at it (collective:
    every rank of ``process_group``, default the world). The directory must not exist: nothing is ever written over
    an earlier checkpoint, so a save that fails or whose rank dies leaves an unmarked directory that ``load``
    refuses, and the pointer still names the last complete one. The first rank decides the name, writes the mark and
    switches the pointer (write a temporary file, rename it over ``LATEST``); every rank returns the directory after
    that. ``dcp_kwargs`` go to ``dcp.save``."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    root = os.fspath(root)
    leads, _ = _leader(process_group)
    chosen, problem = None, None
    if leads:
        try:
            os.makedirs(root, exist_ok=True)
            if name is None:
                steps = [int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit()]
                name = f"step-{max(steps, default=0) + 1}"
            if os.path.sep in str(name) or str(name) in (POINTER, "", ".", ".."):
                problem = f"st.checkpoint.save: {name!r} is not a directory name under {root}"
            elif os.path.exists(os.path.join(root, str(name))):
                problem = (f"st.checkpoint.save: {os.path.join(root, str(name))} exists; a checkpoint goes into a "
                           "fresh directory (pick another name, or remove it)")
            chosen = str(name)
        except OSError as e:
            problem = f"st.checkpoint.save: cannot prepare {root}: {e}"
    _raise_everywhere(problem, process_group)
    directory = os.path.join(root, _from_leader(chosen, process_group))
    dcp.save(state_dict, checkpoint_id=directory, process_group=process_group, **dcp_kwargs)
    dist.barrier(group=process_group)     # every rank's files are written (dcp.save's own end: the metadata)
    problem = None
    if leads:
        try:
            with open(os.path.join(directory, COMPLETE), "w") as f:
                f.write("complete\n")
            temp = os.path.join(root, f".{POINTER}.shardtensor-partial")
            with open(temp, "w") as f:
                f.write(os.path.basename(directory) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, os.path.join(root, POINTER))
        except OSError as e:
            problem = f"st.checkpoint.save: {directory} was written but could not be marked complete: {e}"
    _raise_everywhere(problem, process_group, RuntimeError)
    return directory


def load(state_dict, path, *, process_group=None, **dcp_kwargs) -> str:
    """Load ``state_dict`` in place from a checkpoint ``save`` wrote (collective, like ``dcp.load``): ``path`` is the
    root (its ``LATEST`` pointer is followed) or one checkpoint directory. A directory ``save`` did not mark complete
    (a save that failed or was killed) raises ``ValueError`` on every rank. The first rank reads the pointer and
    checks the mark, and every rank uses its answer. Returns the directory loaded. ``dcp_kwargs`` go to
    ``dcp.load``."""
    import os

    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    leads, _ = _leader(process_group)
    directory, problem = None, None
    if leads:
        if os.path.exists(os.path.join(path, POINTER)) and not os.path.exists(os.path.join(path, COMPLETE)):
            directory = latest(path)
        else:
            directory = path
        if not os.path.isdir(directory):
            problem = f"st.checkpoint.load: no checkpoint at {directory}"
        elif not os.path.exists(os.path.join(directory, COMPLETE)):
            problem = (f"st.checkpoint.load: {directory} is not a complete checkpoint (no {COMPLETE} mark: its save "
                       "did not finish on every rank, or it was not written by st.checkpoint.save); load the root to "
                       "get the latest complete one")
    _raise_everywhere(problem, process_group)
    directory = _from_leader(directory, process_group)
    dcp.load(state_dict, checkpoint_id=directory, process_group=process_group, **dcp_kwargs)
    return directory
