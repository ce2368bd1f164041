"""``x._spec``: a read-only view of a ShardTensor's layout in the shape DTensor and PhysicsNeMo code reads it.

PhysicsNeMo handlers read ``x._spec.placements``, ``x._spec.mesh``, ``x._spec.sharding_shapes()`` (per mesh dim,
the full local shape of every coordinate) and ``x._spec.offsets()`` (per mesh dim, this rank's start along the
tensor dim that mesh dim shards). The view is a snapshot taken without communication (the C++ spec is immutable);
assigning to it raises.
"""
from __future__ import annotations

import torch

from .. import _C

__all__ = ["ShardTensorSpec", "spec_of", "mesh_dim_offsets"]


class ShardTensorSpec:
    """Read-only layout of one ShardTensor (``x._spec``): ``placements``, ``mesh`` (also ``device_mesh``),
    ``shape``, ``stride``, ``dtype``, ``ndim``, ``tensor_meta``, ``local_shape``, ``sharding_shapes(mesh_dim=None)``,
    ``offsets(mesh_dim=None)``; ``_sharding_shapes`` is the dict ``sharding_shapes()`` returns."""

    __slots__ = ("_placements", "_mesh", "_shape", "_stride", "_dtype", "_local_shape", "_extents", "_coordinate",
                 "_local_offsets")

    def __init__(self, x: torch.Tensor):
        from .. import device_mesh, placements
        values = {
            "_placements": placements(x),
            "_mesh": device_mesh(x),
            "_shape": torch.Size(x.shape),
            "_stride": tuple(x.stride()),
            "_dtype": x.dtype,
            "_local_shape": torch.Size(_C.local_shape(x)),
            "_extents": {int(k): [int(e) for e in v] for k, v in _C.sharding_shapes(x).items()},
            "_coordinate": tuple(_C.mesh_of(x).coordinate),
            "_local_offsets": tuple(_C.local_offsets(x)),
        }
        for k, v in values.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value):
        raise AttributeError(f"x._spec is a read-only view of a ShardTensor's layout (setting {name!r}); build a new "
                             "ShardTensor with st.redistribute(x, placements, sharding_shapes) or st.from_local")

    @property
    def placements(self) -> tuple:
        return self._placements

    @property
    def mesh(self):
        return self._mesh

    device_mesh = mesh

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def stride(self) -> tuple:
        return self._stride

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def tensor_meta(self):
        from torch.distributed.tensor._dtensor_spec import TensorMeta
        return TensorMeta(self._shape, self._stride, self._dtype)

    @property
    def local_shape(self) -> torch.Size:
        return self._local_shape

    def sharding_shapes(self, mesh_dim=None):
        """``{mesh_dim: (local shape of coordinate 0, 1, ...)}`` for every sharded mesh dim (PhysicsNeMo's format:
        the entries differ only in the dim that mesh dim shards; other sharded dims are this rank's extents), or the
        tuple of one mesh dim. Plain extents: ``st.sharding_shapes(x)``."""
        out = {}
        for m, extents in self._extents.items():
            d = self._placements[m].dim
            out[m] = tuple(torch.Size(self._local_shape[:d] + (e,) + self._local_shape[d + 1:]) for e in extents)
        if mesh_dim is None:
            return out
        if int(mesh_dim) not in out:
            raise ValueError(f"sharding_shapes: mesh dim {mesh_dim} does not shard a tensor dim (placements "
                             f"{self._placements})")
        return out[int(mesh_dim)]

    @property
    def _sharding_shapes(self) -> dict:
        return self.sharding_shapes()

    def offsets(self, mesh_dim=None):
        """Per mesh dim, this rank's first index along the tensor dim that mesh dim shards (0 for mesh dims that
        shard nothing) — PhysicsNeMo's convention. Per tensor dim: ``st.local_offsets(x)``."""
        out = tuple(self._local_offsets[p.dim] if p.is_shard() else 0 for p in self._placements)
        return out if mesh_dim is None else out[int(mesh_dim)]

    def __eq__(self, other) -> bool:
        if not isinstance(other, ShardTensorSpec):
            return NotImplemented
        return (self._placements == other._placements and self._mesh == other._mesh and
                self._shape == other._shape and self._extents == other._extents and self._dtype == other._dtype)

    def __hash__(self):
        return hash((self._placements, self._shape, tuple(sorted((k, tuple(v)) for k, v in self._extents.items()))))

    def __repr__(self) -> str:
        return (f"ShardTensorSpec(placements={self._placements}, shape={list(self._shape)}, "
                f"extents={self._extents}, local_shape={list(self._local_shape)}, mesh={self._mesh})")


def spec_of(x: torch.Tensor) -> ShardTensorSpec:
    return ShardTensorSpec(x)


def mesh_dim_offsets(x: torch.Tensor, mesh_dim=None):
    """PhysicsNeMo's ``x.offsets(mesh_dim=None)``: see ``ShardTensorSpec.offsets``."""
    return ShardTensorSpec(x).offsets(mesh_dim)
