"""Which part of a global array a rank holds: its slab (start and stop along every dim), from the mesh, the
placements and the extents, computed exactly as the library lays out a ShardTensor (ShardSpec: extents given per
sharded mesh dim, the default split ``torch.tensor_split`` sizes, a tensor dim sharded by at most one mesh dim, the
offset of a coordinate the sum of the extents before it). Pure arithmetic on values every rank knows alike: no
communication."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

from ..compat import extents_by_mesh_dim
from ..placement import Partial, Replicate, Shard, normalize_placements


def default_split(n: int, k: int) -> list:
    """``torch.tensor_split`` sizes of ``n`` over ``k`` (the first ``n % k`` parts one more): the library's default."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def mesh_shape_and_coordinate(mesh):
    """(mesh shape, this rank's coordinate) of a DeviceMesh or a C++ mesh."""
    from .. import _C
    if isinstance(mesh, _C.Mesh):
        return tuple(mesh.shape), tuple(mesh.coordinate)
    if not hasattr(mesh, "get_coordinate"):
        raise TypeError(f"expected a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the mesh")
    return tuple(mesh.mesh.shape), tuple(coordinate)


@dataclass(frozen=True)
class Layout:
    """A global shape laid out over a mesh: the extents of every sharded mesh dim and this rank's slab."""

    global_shape: tuple
    mesh_shape: tuple
    coordinate: tuple
    placements: tuple           # shardtensor placements, Shard dims wrapped into [0, ndim)
    extents: dict               # {mesh_dim: [extent of coordinate 0, 1, ...]} for every sharded mesh dim
    start: tuple                # this rank's slab, per tensor dim
    stop: tuple

    @property
    def local_shape(self) -> tuple:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes its slab: ranks holding copies along replicated mesh dims leave it to the first
        coordinate of each such dim, so every element is written exactly once."""
        return all(c == 0 for c, p in zip(self.coordinate, self.placements) if isinstance(p, Replicate))

    @property
    def is_root(self) -> bool:
        """The mesh's first rank (coordinate 0 everywhere): it creates the files writers fill."""
        return all(c == 0 for c in self.coordinate)

    def slab_of(self, coordinate: Sequence[int]):
        """(start, stop) of the slab held at another mesh coordinate."""
        start, stop = [0] * len(self.global_shape), list(self.global_shape)
        for m, p in enumerate(self.placements):
            if isinstance(p, Shard):
                e = self.extents[m]
                start[p.dim] = sum(e[:coordinate[m]])
                stop[p.dim] = start[p.dim] + e[coordinate[m]]
        return tuple(start), tuple(stop)

    def writer_slabs(self):
        """[(coordinate, start, stop)] of every writing rank, in mesh order (the same list on every rank)."""
        out = []
        for coord in itertools.product(*(range(s) for s in self.mesh_shape)):
            if all(c == 0 for c, p in zip(coord, self.placements) if isinstance(p, Replicate)):
                out.append((coord,) + self.slab_of(coord))
        return out


def plan(what: str, global_shape: Sequence[int], mesh, placements, sharding_shapes=None,
         expected_shape: Optional[Sequence[int]] = None) -> Layout:
    """The layout of an array of ``global_shape`` (read from the file) over ``mesh``. Raises ``ValueError`` for
    ``Partial`` placements, a ``global_shape`` that differs from ``expected_shape`` and extents that do not fit,
    ``NotImplementedError`` for a tensor dim sharded by two mesh dims (as ShardSpec does)."""
    global_shape = tuple(int(s) for s in global_shape)
    ndim = len(global_shape)
    if expected_shape is not None and tuple(int(s) for s in expected_shape) != global_shape:
        raise ValueError(f"{what}: the file holds an array of shape {list(global_shape)}, but global_shape="
                         f"{list(expected_shape)} was given")
    mesh_shape, coordinate = mesh_shape_and_coordinate(mesh)
    pl = normalize_placements(placements, len(mesh_shape))
    if any(isinstance(p, Partial) for p in pl):
        raise ValueError(f"{what}: placements {pl} include Partial: a file holds complete values, not terms of a "
                         "pending reduction; use Replicate() (every rank reads the same slab) or Shard(d)")
    wrapped, sharded_by = [], {}
    for m, p in enumerate(pl):
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ValueError(f"{what}: Shard({p.dim}) on mesh dim {m} is out of range for the file's "
                                 f"{ndim}-d array of shape {list(global_shape)}")
            if d in sharded_by:
                raise NotImplementedError(
                    f"{what}: tensor dim {d} is sharded on mesh dims {sharded_by[d]} and {m} {pl}; sharding one "
                    "tensor dim over several mesh dims is not supported, shard another dim or flatten the mesh")
            sharded_by[d] = m
            p = Shard(d)
        wrapped.append(p)
    wrapped = tuple(wrapped)
    given = extents_by_mesh_dim(sharding_shapes, wrapped)
    extents = {}
    for m, p in enumerate(wrapped):
        if not isinstance(p, Shard):
            if m in given:
                raise ValueError(f"{what}: sharding_shapes given for mesh dim {m}, whose placement is {p}")
            continue
        n, k = global_shape[p.dim], mesh_shape[m]
        e = given.get(m)
        if e is None:
            e = default_split(n, k)
        elif len(e) != k or any(v < 0 for v in e) or sum(e) != n:
            raise ValueError(f"{what}: sharding_shapes for mesh dim {m} ({p}) are {e}: expected {k} non-negative "
                             f"extents adding up to {n}, the file's size of tensor dim {p.dim} (shape "
                             f"{list(global_shape)})")
        extents[m] = list(e)
    for m in given:
        if not 0 <= m < len(mesh_shape):
            raise ValueError(f"{what}: sharding_shapes for mesh dim {m} of a {len(mesh_shape)}-d mesh")
    layout = Layout(global_shape, mesh_shape, coordinate, wrapped, extents, (), ())
    start, stop = layout.slab_of(coordinate)
    return Layout(global_shape, mesh_shape, coordinate, wrapped, extents, start, stop)


def layout_of(x, what: str) -> Layout:
    """The layout of a ShardTensor (for the writers); ``Partial`` refused with ``ValueError``."""
    from .. import device_mesh, local_offsets, placements, sharding_shapes
    pl = placements(x)
    if any(isinstance(p, Partial) for p in pl):
        raise ValueError(f"{what}: a ShardTensor with placements {pl} holds a pending reduction (Partial), not "
                         "values to write; resolve it first, e.g. x.redistribute([Replicate() if p.is_partial() "
                         "else p for p in x.placements])")
    layout = plan(what, tuple(x.shape), device_mesh(x), pl, sharding_shapes(x))
    assert layout.start == tuple(local_offsets(x)), (layout.start, local_offsets(x))
    return layout
