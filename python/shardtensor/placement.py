"""Placements: how a tensor is laid out along one mesh dimension."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shard", "Replicate", "Partial", "to_wire", "from_wire", "normalize_placements"]


@dataclass(frozen=True)
class Shard:
    """Tensor dim ``dim`` is split along this mesh dim (uneven extents allowed)."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank along this mesh dim holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """Every rank holds one term of a pending reduction (``sum``, ``avg``, ``max`` or ``min``)."""

    op: str = "sum"

    def __post_init__(self):
        if self.op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"Partial: unknown reduce op {self.op!r}; expected sum, avg, max or min")

    def __repr__(self) -> str:
        return f"Partial({self.op})"


def _from_torch_placement(p):
    """Accept torch.distributed.tensor placements too."""
    name = type(p).__name__
    if name == "Shard" and hasattr(p, "dim"):
        return Shard(int(p.dim))
    if name == "Replicate":
        return Replicate()
    if name == "Partial" and hasattr(p, "reduce_op"):
        return Partial({"sum": "sum", "avg": "avg", "max": "max", "min": "min"}.get(str(p.reduce_op), "sum"))
    raise TypeError(f"not a placement: {p!r}; use shardtensor.Shard(d), Replicate() or Partial(op)")


def normalize_placements(placements, ndim_mesh: int):
    """A tuple of shardtensor placements, one per mesh dim."""
    if isinstance(placements, (Shard, Replicate, Partial)):
        placements = [placements]
    out = []
    for p in placements:
        out.append(p if isinstance(p, (Shard, Replicate, Partial)) else _from_torch_placement(p))
    if len(out) != ndim_mesh:
        raise ValueError(f"got {len(out)} placements {tuple(out)} for a {ndim_mesh}-d mesh; give one per mesh dim")
    return tuple(out)


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
