"""The spellings DTensor and PhysicsNeMo users bring with them.

- ``device_mesh=`` (and DTensor's ``shape=``, PhysicsNeMo's ``global_src=``) as keyword aliases;
- DTensor's ``x.redistribute(device_mesh, placements)`` next to ``x.redistribute(placements)``;
- PhysicsNeMo's ``sharding_shapes`` format (full local shapes per rank) next to ours (extents per rank);
- ``isinstance(x, st.ShardTensor)`` and PhysicsNeMo's ``ShardTensor.from_local``;
- the error a plain tensor raises for ShardTensor-only attributes: a ``TypeError`` that is also an
  ``AttributeError``, so ``hasattr(torch.zeros(1), "placements")`` is ``False`` instead of raising;
- conversion to and from ``torch.distributed.tensor.DTensor`` (whose shards follow ``torch.chunk``).
"""
from __future__ import annotations

import functools
import inspect

import torch

from .. import _C

__all__ = ["NotAShardTensorError", "ShardTensor", "keyword_aliases", "redistribute_arguments",
           "extents_by_mesh_dim", "chunk_extents", "to_dtensor", "from_dtensor"]


class NotAShardTensorError(TypeError, AttributeError):
    """A ShardTensor-only function, method or property was used on something else. A ``TypeError`` (the
    documented error) and an ``AttributeError`` (so ``hasattr``/``getattr(x, name, default)`` work on plain
    tensors)."""


# PhysicsNeMo's ShardTensor class attributes, reached on ours: where they live here.
_PHYSICSNEMO_CLASS_NAMES = {
    "register_function_handler": "st.register_function(fn, handler) (a Python function) or st.register_handler(op, "
                                 "handler) (an aten op); PhysicsNeMo's (func, types, args, kwargs) signature: "
                                 "shardtensor.compat.physicsnemo.ShardTensor.register_function_handler",
    "register_dispatch_handler": "st.register_handler(op, handler) (or shardtensor.compat.physicsnemo.ShardTensor."
                                 "register_dispatch_handler)",
    "register_named_function_handler": "st.register_handler('namespace::op', handler) (or shardtensor.compat."
                                       "physicsnemo.ShardTensor.register_named_function_handler)",
    "patches_enabled": "nothing: the library's rules are always on (st.set_strict controls the fallback)",
    "promotion_mode": "nothing: plain tensors mixed with ShardTensors are always Replicate",
    "set_promotion_mode": "nothing: plain tensors mixed with ShardTensors are always Replicate",
    "get_promotion_mode": "nothing: plain tensors mixed with ShardTensors are always Replicate",
}


class _ShardTensorType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.Tensor) and _C.is_shard_tensor(obj)

    def __getattr__(cls, name):
        if name in _PHYSICSNEMO_CLASS_NAMES:
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r} (a PhysicsNeMo name): use "
                                 f"{_PHYSICSNEMO_CLASS_NAMES[name]}")
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")


class ShardTensor(metaclass=_ShardTensorType):
    """``isinstance(x, shardtensor.ShardTensor)`` is ``True`` exactly for ShardTensors.

    ShardTensors are ordinary ``torch.Tensor`` objects backed by the C++ ``ShardTensorImpl`` (``type(x)`` is
    ``torch.Tensor`` or ``torch.nn.Parameter``), so this class is a type check, not their Python type, and it is
    not constructed: build ShardTensors with ``from_local``, ``distribute_tensor`` or ``scatter_tensor``.
    """

    def __new__(cls, *args, **kwargs):
        raise TypeError("shardtensor.ShardTensor is a type check (isinstance(x, st.ShardTensor)), not a "
                        "constructor: build ShardTensors with st.from_local, st.distribute_tensor or "
                        "st.scatter_tensor")

    @staticmethod
    def from_local(local_tensor, device_mesh=None, placements=None, sharding_shapes="infer", global_shape=None):
        """PhysicsNeMo's ``ShardTensor.from_local``: the same as ``shardtensor.from_local``."""
        from .. import from_local
        return from_local(local_tensor, device_mesh, placements, sharding_shapes=sharding_shapes,
                          global_shape=global_shape)

    @staticmethod
    def from_dtensor(dtensor):
        """PhysicsNeMo's ``ShardTensor.from_dtensor``: the same as ``shardtensor.from_dtensor``."""
        return from_dtensor(dtensor)


def keyword_aliases(**aliases):
    """Accept ``alias=value`` for parameter ``name`` (``keyword_aliases(device_mesh="mesh")``); giving both
    raises ``TypeError``."""
    def decorate(fn):
        names = list(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for alias, name in aliases.items():
                if alias in kwargs:
                    value = kwargs.pop(alias)
                    if name in kwargs or names.index(name) < len(args):
                        raise TypeError(f"{fn.__name__}: got both {alias}= and {name}; give one of them")
                    kwargs[name] = value
            return fn(*args, **kwargs)
        return wrapper
    return decorate


def _is_mesh(obj) -> bool:
    from torch.distributed.device_mesh import DeviceMesh
    return isinstance(obj, (DeviceMesh, _C.Mesh))


def redistribute_arguments(x, args, placements, sharding_shapes, device_mesh):
    """(placements, sharding_shapes) from the spellings ``(placements[, sharding_shapes])`` and DTensor's
    ``(device_mesh, placements)``; the mesh, when given, must be ``x``'s own."""
    args = list(args)
    if args and _is_mesh(args[0]):
        if device_mesh is not None:
            raise TypeError("redistribute: got the mesh both positionally and as device_mesh=")
        device_mesh = args.pop(0)
    if len(args) > 2:
        raise TypeError(f"redistribute: too many positional arguments ({len(args)}); expected "
                        "(placements, sharding_shapes) or (device_mesh, placements)")
    for name, value in zip(("placements", "sharding_shapes"), args):
        if (placements if name == "placements" else sharding_shapes) is not None:
            raise TypeError(f"redistribute: got {name} both positionally and by keyword")
        if name == "placements":
            placements = value
        else:
            sharding_shapes = value
    if placements is None:
        raise ValueError("redistribute: placements are required, one per mesh dim (e.g. [shardtensor.Replicate()])")
    if device_mesh is not None:
        from ..mesh import as_cpp_mesh
        if not as_cpp_mesh(device_mesh).same_as(_C.mesh_of(x)):
            raise NotImplementedError(f"redistribute: moving a ShardTensor to another mesh ({device_mesh}) is not "
                                      f"supported; its mesh is {_C.mesh_of(x)}. Pass that mesh (or none), or "
                                      "full_tensor() and distribute on the new mesh")
    return placements, sharding_shapes


def extents_by_mesh_dim(sharding_shapes, placements) -> dict:
    """``{mesh_dim: [extent, ...]}`` from ours or PhysicsNeMo's ``{mesh_dim: [full local shape of each rank]}``
    (the sharded tensor dim's entry of each shape is taken)."""
    out = {}
    for k, v in (sharding_shapes or {}).items():
        k = int(k)
        entries = list(v)
        if entries and not isinstance(entries[0], int) and hasattr(entries[0], "__len__"):
            if not 0 <= k < len(placements) or not hasattr(placements[k], "dim") or not placements[k].is_shard():
                raise ValueError(f"sharding_shapes: mesh dim {k} does not shard a tensor dim (placements "
                                 f"{tuple(placements)}); give entries only for Shard mesh dims")
            d = placements[k].dim
            entries = [shape[d] for shape in entries]
        out[k] = [int(e) for e in entries]
    return out


def chunk_extents(n: int, k: int) -> list:
    """``torch.chunk``'s sizes for ``n`` over ``k`` (DTensor's layout): ceil(n/k) each, the last ones shorter
    or empty."""
    step = -(-n // k) if n else 0
    return [max(0, min(step, n - i * step)) for i in range(k)]


def to_dtensor(x):
    """A DTensor with ``x``'s values, mesh and placements (differentiable). DTensor shards follow
    ``torch.chunk``; when ``x``'s extents differ, ``x`` is first redistributed to them (a collective; decided by
    the spec, which every rank knows alike)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from .. import _check, device_mesh, placements, redistribute, sharding_shapes, to_local
    _check(x, "to_dtensor")
    mesh, pl = device_mesh(x), placements(x)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError("to_dtensor: the ShardTensor's mesh was built in C++, not from a DeviceMesh")
    chunked = {m: chunk_extents(x.shape[p.dim], mesh.size(m)) for m, p in enumerate(pl) if p.is_shard()}
    if chunked != sharding_shapes(x):
        x = redistribute(x, pl, chunked)
    return DTensor.from_local(to_local(x), mesh, pl, run_check=False, shape=x.shape, stride=x.stride())


def from_dtensor(dtensor):
    """A ShardTensor with ``dtensor``'s values, mesh and placements (``torch.chunk`` extents; no communication;
    differentiable)."""
    from torch.distributed.tensor import DTensor

    from .. import from_local
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"from_dtensor: expected a DTensor, got {type(dtensor).__name__}")
    mesh, pl = dtensor.device_mesh, dtensor.placements
    for p in pl:
        if not (p.is_shard() or p.is_replicate() or p.is_partial()) or type(p).__name__.startswith("_"):
            raise NotImplementedError(f"from_dtensor: placement {p!r} has no ShardTensor equivalent")
    extents = {m: chunk_extents(dtensor.shape[p.dim], mesh.size(m)) for m, p in enumerate(pl) if p.is_shard()}
    return from_local(dtensor.to_local(), mesh, pl, sharding_shapes=extents, global_shape=dtensor.shape)
