"""Collectives along mesh dims: ``st.ring_pass``, one step of a ring on plain local tensors (the C++
``shardtensor::ring_pass``), and the internal helpers the routed library functions share (``rnn.py``, the
integrations): ``sum_over_mesh_dims`` (the all-reduce of their backward passes), ``completed`` and ``whole``."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import _C
from .mesh import as_cpp_mesh

__all__ = ["ring_pass"]


def _mesh_dim_index(mesh, mesh_dim) -> int:
    if isinstance(mesh_dim, str):
        names = list(getattr(mesh, "mesh_dim_names", None) or as_cpp_mesh(mesh).dim_names)
        if mesh_dim not in names:
            raise ValueError(f"ring_pass: the mesh has no dim named {mesh_dim!r} (its dims: {names})")
        return names.index(mesh_dim)
    return int(mesh_dim)


def ring_pass(tensors: Union[torch.Tensor, Sequence[torch.Tensor]], mesh, mesh_dim=0,
              recv_shapes: Optional[Sequence] = None, direction: str = "forward"):
    """Send ``tensors`` to the next rank along ``mesh_dim`` and return what the previous rank sent (*collective*
    over that mesh dim: every rank of it calls this with as many tensors).

    - ``tensors``: a plain tensor or a list/tuple of them (a ShardTensor's ``to_local()``); the result has the same
      form.
    - ``mesh``: a DeviceMesh (or C++ mesh); ``mesh_dim``: its index or name.
    - ``recv_shapes``: the shape of each tensor this rank receives (default: the shapes its sender sends). Before
      any data moves, the ranks of the ring agree on the shapes (one small all-gather of a fixed-size header; a
      second one only when some rank gave no shapes or gave shapes its sender does not send): a rank whose given
      shapes differ from what its sender sends, or ranks passing different numbers, dtypes or directions of tensors,
      raise ``ValueError`` on every rank of the ring.
    - ``direction``: ``"forward"`` sends to coordinate ``c + 1`` and receives from ``c - 1`` (cyclically);
      ``"backward"`` the other way.

    Received tensors have the dtype and device of the matching sent tensor. Zero-element tensors cost nothing; on a
    mesh dim of size 1 the result is a copy. Differentiable: the gradient of a received tensor goes back to its
    sender by the reverse ring (as zeros where a rank has none, so the backward pass communicates alike on every
    rank).
    """
    single = isinstance(tensors, torch.Tensor)
    items = [tensors] if single else list(tensors)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ring_pass: tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
    if direction not in ("forward", "backward"):
        raise ValueError(f"ring_pass: direction must be 'forward' or 'backward', got {direction!r}")
    if recv_shapes is None:
        shapes = []
    else:
        nested = len(recv_shapes) > 0 and not isinstance(recv_shapes[0], int)
        shapes = [recv_shapes] if single and not nested else list(recv_shapes)
        # A count that does not match the tensors is checked in C++, with the other ranks (so all of them raise).
        shapes = [[int(s) for s in shape] for shape in shapes]
    out = _C.ring_pass(items, as_cpp_mesh(mesh), _mesh_dim_index(mesh, mesh_dim), shapes, direction == "backward")
    return out[0] if single else (tuple(out) if isinstance(tensors, tuple) else list(out))


def sum_over_mesh_dims(tensor: torch.Tensor, mesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """``tensor`` (this rank's term, a plain tensor) summed over the ranks of the mesh dims ``mesh_dims``, through the
    library's redistribution of a pending sum (counted like its other collectives); ``tensor`` itself when
    ``mesh_dims`` is empty. Every rank of those dims must call it alike."""
    if not mesh_dims:
        return tensor
    from . import Partial, Replicate, from_local, redistribute, to_local
    ndim = mesh.ndim
    pending = [Partial() if d in mesh_dims else Replicate() for d in range(ndim)]
    return to_local(redistribute(from_local(tensor.contiguous(), mesh, pending, sharding_shapes={}, check=False),
                                 [Replicate()] * ndim))


def completed(t):
    """``t`` with its pending sums completed (``Partial`` mesh dims made ``Replicate``; the shards kept), for routed
    code that works on whole values; ``t`` itself when it is plain or has none. Differentiable."""
    from . import Replicate, is_shard_tensor, placements, redistribute
    if not is_shard_tensor(t) or not any(p.is_partial() for p in placements(t)):
        return t
    return redistribute(t, [Replicate() if p.is_partial() else p for p in placements(t)])


def whole(t):
    """``t`` whole on every rank as a plain tensor (a ShardTensor is assembled: a collective); a plain ``t`` as it
    is. Differentiable."""
    from . import full_tensor, is_shard_tensor
    return full_tensor(t) if is_shard_tensor(t) else t
