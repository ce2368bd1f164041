"""Placements: how a tensor is laid out along one mesh dimension.

``Shard``, ``Replicate`` and ``Partial`` subclass ``torch.distributed.tensor``'s placement types, so code written
for DTensor keeps working: ``st.Shard(2) == torch.distributed.tensor.Shard(2)`` in both directions, the hashes
agree (one key in a dict or set), ``isinstance(p, torch.distributed.tensor.Shard)`` holds and the methods
``is_shard()``, ``is_replicate()``, ``is_partial()`` are there. Torch's own placement objects are accepted
wherever placements are taken.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial as _TorchPartial
from torch.distributed.tensor import Replicate as _TorchReplicate
from torch.distributed.tensor import Shard as _TorchShard

__all__ = ["Shard", "Replicate", "Partial", "to_wire", "from_wire", "normalize_placements"]

_REDUCE_OPS = ("sum", "avg", "max", "min")


class Shard(_TorchShard):
    """Tensor dim ``dim`` is split along this mesh dim (uneven extents allowed)."""

    def __init__(self, dim: int):
        super().__init__(int(dim))

    def __repr__(self) -> str:
        return f"Shard({self.dim})"

    __str__ = __repr__


class Replicate(_TorchReplicate):
    """Every rank along this mesh dim holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"

    __str__ = __repr__


class Partial(_TorchPartial):
    """Every rank holds one term of a pending reduction (``sum``, ``avg``, ``max`` or ``min``).

    ``Partial("sum")``, ``Partial(op="sum")`` and DTensor's spelling ``Partial(reduce_op="sum")`` are the same.
    """

    def __init__(self, op: str = "sum", *, reduce_op: str | None = None):
        if reduce_op is not None:
            if op != "sum" and op != reduce_op:
                raise ValueError(f"Partial: op={op!r} and reduce_op={reduce_op!r} disagree; give one of them")
            op = reduce_op
        if op not in _REDUCE_OPS:
            raise ValueError(f"Partial: unknown reduce op {op!r}; expected sum, avg, max or min")
        super().__init__(op)

    @property
    def op(self) -> str:
        """The pending reduction (DTensor calls it ``reduce_op``)."""
        return self.reduce_op

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    __str__ = __repr__


def _from_torch_placement(p):
    """Our placement for one of torch.distributed.tensor's (exact types only: _StridedShard, _MaskPartial and
    other private subclasses describe layouts this library does not have)."""
    if type(p) is _TorchShard:
        return Shard(p.dim)
    if type(p) is _TorchReplicate:
        return Replicate()
    if type(p) is _TorchPartial:
        return Partial(str(p.reduce_op))
    raise TypeError(f"not a supported placement: {p!r}; use shardtensor.Shard(d), Replicate() or Partial(op) "
                    "(or torch.distributed.tensor's Shard, Replicate, Partial)")


def _as_placement(p):
    return p if isinstance(p, (Shard, Replicate, Partial)) else _from_torch_placement(p)


def normalize_placements(placements, ndim_mesh: int):
    """A tuple of shardtensor placements, one per mesh dim (a lone ``Replicate()`` stands for every mesh dim)."""
    if placements is None:
        raise ValueError("placements are required: one per mesh dim, e.g. [shardtensor.Shard(0)]")
    if isinstance(placements, (_TorchShard, _TorchReplicate, _TorchPartial)):
        placements = [placements]
    out = tuple(_as_placement(p) for p in placements)
    if len(out) == 1 and ndim_mesh > 1 and isinstance(out[0], Replicate):
        # A lone Replicate() on an N-D mesh can only mean "replicated everywhere" (PhysicsNeMo's Transolver writes
        # `redistribute(placements=[Replicate()])`, a 1-D-mesh idiom; DTensor rejects it on larger meshes).
        out = out * ndim_mesh
    if len(out) != ndim_mesh:
        raise ValueError(f"got {len(out)} placements {out} for a {ndim_mesh}-d mesh; give one per mesh dim")
    return out


def to_wire(placements):
    """(kind, dim, op) tuples for the C++ core."""
    wire = []
    for p in placements:
        if isinstance(p, Replicate):
            wire.append((0, -1, ""))
        elif isinstance(p, Shard):
            wire.append((1, p.dim, ""))
        else:
            wire.append((2, -1, p.op))
    return wire


def from_wire(wire):
    out = []
    for kind, dim, op in wire:
        out.append(Replicate() if kind == 0 else Shard(dim) if kind == 1 else Partial(op))
    return tuple(out)
