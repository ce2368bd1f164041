"""PhysicsNeMo's ShardTensor API on top of shardtensor: a PhysicsNeMo script ports by changing its imports.

    from physicsnemo.distributed import DistributedManager, scatter_tensor, ShardTensor     # before
    from physicsnemo.distributed.shard_utils.ring import perform_ring_iteration, RingPassingConfig
    from torch.distributed.tensor import distribute_module, distribute_tensor
    ->
    from shardtensor.compat.physicsnemo import (DistributedManager, scatter_tensor, ShardTensor,
        perform_ring_iteration, RingPassingConfig, distribute_module, distribute_tensor)

(``physicsnemo.domain_parallel`` and ``physicsnemo.domain_parallel.shard_utils.ring``, the newer homes of the same
names, port the same way.) What differs from PhysicsNeMo is said where it differs; docs/python-api.md has the
porting table.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import types
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _C
from .. import ShardTensor as _ShardTensorCheck
from .. import (Partial, Replicate, Shard, from_dtensor, from_local, init_distributed, is_shard_tensor,
                register_function, register_handler, ring_pass, sync_module)
from .. import distribute_tensor as _distribute_tensor
from .. import scatter_tensor as _scatter_tensor
from ..placement import normalize_placements
from . import keyword_aliases
from .spec_view import ShardTensorSpec

__all__ = ["DistributedManager", "ShardTensor", "ShardTensorSpec", "scatter_tensor", "distribute_tensor",
           "distribute_module", "sync_module_over_mesh", "RingPassingConfig", "perform_ring_iteration",
           "perform_ring_iteration_async", "compute_split_shapes", "Shard", "Replicate", "Partial"]


# ---- DistributedManager ----

_MANAGER_HINTS = {
    "create_process_subgroup": "torch.distributed.new_group(ranks) or a DeviceMesh dim (mesh.get_group(dim))",
    "create_orthogonal_process_group": "a 2-D DeviceMesh (dm.initialize_mesh) and its mesh.get_group(dim)",
    "create_groups_from_config": "a DeviceMesh (dm.initialize_mesh)",
    "create_group_from_node": "a DeviceMesh (dm.initialize_mesh)",
    "setup": "DistributedManager.initialize() (torchrun's environment, or a one-process world without it)",
    "initialize_env": "DistributedManager.initialize()",
    "initialize_slurm": "torchrun (or export RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and "
                        "DistributedManager.initialize()",
    "initialize_open_mpi": "torchrun (or export RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and "
                           "DistributedManager.initialize()",
}


class DistributedManager:
    """PhysicsNeMo's process-wide manager (a shared-state singleton): ``DistributedManager.initialize()`` once,
    then ``dm = DistributedManager()`` anywhere for ``rank``, ``world_size``, ``local_rank``, ``device``,
    ``distributed``, ``cuda`` and ``initialize_mesh``.

    ``initialize()`` is ``st.init_distributed()``: torchrun's environment, or a one-process world when launched as
    ``python script.py`` (PhysicsNeMo then runs without a process group, so its ``initialize_mesh`` fails; here the
    mesh is a 1-rank mesh and the script is its own single-device reference). SLURM/OpenMPI variables are not read:
    launch with torchrun. Like PhysicsNeMo it seeds NumPy with the rank and destroys the process group at exit.
    """

    _shared_state: dict = {}

    def __new__(cls):
        obj = super().__new__(cls)
        obj.__dict__ = cls._shared_state
        return obj

    def __init__(self):
        if not self._shared_state.get("_is_initialized", False):
            raise RuntimeError("DistributedManager() before DistributedManager.initialize(): call "
                               "DistributedManager.initialize() first (once per process)")

    def __getattr__(self, name):
        if name in _MANAGER_HINTS:
            raise AttributeError(f"DistributedManager.{name} is PhysicsNeMo's and not provided here: use "
                                 f"{_MANAGER_HINTS[name]}")
        raise AttributeError(f"'DistributedManager' object has no attribute {name!r}")

    @classmethod
    def is_initialized(cls) -> bool:
        return cls._shared_state.get("_is_initialized", False)

    @staticmethod
    def initialize(backend: Optional[str] = None, timeout=None) -> None:
        """Start (or join) the process group: ``st.init_distributed(backend, timeout)``."""
        if DistributedManager.is_initialized():
            warnings.warn("DistributedManager is already initialized", stacklevel=2)
            return
        rank, world = init_distributed(backend=backend, timeout=timeout)
        cuda = torch.cuda.is_available()
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()) if cuda else 0))
        state = DistributedManager._shared_state
        state.clear()
        state.update(_rank=rank, _world_size=world, _local_rank=local_rank, _cuda=cuda, _distributed=True,
                     _device=torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu"),
                     _global_mesh=None, _mesh_dims={}, _broadcast_buffers=False, _find_unused_parameters=False,
                     _initialization_method="env" if world > 1 or "RANK" in os.environ else "single-process",
                     _is_initialized=True)
        try:
            import numpy as np
            np.random.seed(seed=rank)  # PhysicsNeMo seeds NumPy per rank for data sampling
        except ImportError:
            pass

    @staticmethod
    def cleanup(barrier: bool = False) -> None:
        """Destroy the process group (PhysicsNeMo registers this at exit, and so does this module)."""
        state = DistributedManager._shared_state
        if state.get("_is_initialized") and dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
        DistributedManager._shared_state.clear()

    rank = property(lambda self: self._rank, doc="Global rank of this process.")
    local_rank = property(lambda self: self._local_rank, doc="Rank on this node (LOCAL_RANK).")
    world_size = property(lambda self: self._world_size, doc="Number of processes.")
    device = property(lambda self: self._device, doc="cuda:LOCAL_RANK when CUDA is available, else cpu.")
    distributed = property(lambda self: self._distributed, doc="Always True: a process group exists.")
    cuda = property(lambda self: self._cuda, doc="Whether CUDA is available.")
    mesh_dims = property(lambda self: self._mesh_dims, doc="{mesh dim name: size} of the last initialize_mesh.")
    broadcast_buffers = property(lambda self: self._broadcast_buffers,
                                 lambda self, v: self.__dict__.__setitem__("_broadcast_buffers", bool(v)))
    find_unused_parameters = property(lambda self: self._find_unused_parameters,
                                      lambda self, v: self.__dict__.__setitem__("_find_unused_parameters", bool(v)))

    def mesh_names(self):
        return self._mesh_dims.keys()

    def mesh_sizes(self):
        return self._mesh_dims.values()

    @property
    def global_mesh(self):
        """The mesh of the last ``initialize_mesh`` (a 1-D mesh over every rank, named "world", if none yet)."""
        if self._global_mesh is None:
            self.initialize_mesh(mesh_shape=(-1,), mesh_dim_names=("world",))
        return self._global_mesh

    def mesh(self, name: Optional[str] = None):
        """The global mesh, or its dim ``name`` as a sub-mesh."""
        if self._global_mesh is None:
            raise ValueError("DistributedManager.mesh: no mesh yet; call dm.initialize_mesh(mesh_shape, "
                             "mesh_dim_names) first")
        if name is None:
            return self._global_mesh
        if name not in (self._global_mesh.mesh_dim_names or ()):
            raise ValueError(f"DistributedManager.mesh: no mesh dim {name!r} (dims: "
                             f"{self._global_mesh.mesh_dim_names})")
        return self._global_mesh[name]

    def group(self, name: Optional[str] = None):
        """``None`` (the default group) for ``name=None``; a mesh dim's process group for its name."""
        return None if name is None else self.mesh(name).get_group()

    def group_size(self, name: Optional[str] = None) -> int:
        return self._world_size if name is None else self.mesh(name).size()

    def group_rank(self, name: Optional[str] = None) -> int:
        return self._rank if name is None else self.mesh(name).get_local_rank()

    def get_mesh_group(self, mesh):
        """The process group of a 1-D mesh (a multi-dim mesh needs a flattened group: ``mesh._flatten()``)."""
        if mesh.ndim != 1:
            return mesh._flatten().get_group()
        return mesh.get_group()

    def initialize_mesh(self, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str]):
        """A DeviceMesh over every rank: ``mesh_shape`` multiplies to the world size, with at most one ``-1``
        inferred (as in ``reshape``); one name per dim. Collective: every rank calls it alike."""
        shape = [int(s) for s in mesh_shape]
        names = tuple(str(n) for n in mesh_dim_names)
        if not shape:
            raise ValueError("initialize_mesh: mesh_shape needs at least one dim")
        if len(shape) != len(names):
            raise ValueError(f"initialize_mesh: {len(shape)} dims in mesh_shape={list(mesh_shape)} but "
                             f"{len(names)} names in mesh_dim_names={list(mesh_dim_names)}")
        if len(set(names)) != len(names):
            raise ValueError(f"initialize_mesh: mesh_dim_names must be unique, got {list(names)}")
        if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
            raise ValueError(f"initialize_mesh: mesh_shape={list(mesh_shape)}: sizes must be positive, with at most "
                             "one -1 (inferred)")
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        if -1 in shape:
            if self._world_size % known:
                raise ValueError(f"initialize_mesh: mesh_shape={list(mesh_shape)} cannot cover {self._world_size} "
                                 f"ranks ({self._world_size} is not a multiple of {known})")
            shape[shape.index(-1)] = self._world_size // known
        total = 1
        for s in shape:
            total *= s
        if total != self._world_size:
            raise ValueError(f"initialize_mesh: mesh_shape={list(mesh_shape)} has {total} ranks but the world has "
                             f"{self._world_size}")
        from torch.distributed.device_mesh import init_device_mesh
        self.__dict__["_global_mesh"] = init_device_mesh("cuda" if self._cuda else "cpu", tuple(shape),
                                                         mesh_dim_names=names)
        self.__dict__["_mesh_dims"] = dict(zip(names, shape))
        return self._global_mesh

    def __str__(self) -> str:
        return (f"Initialized process {self._rank} of {self._world_size} using method "
                f"'{self._initialization_method}'. Device set to {self._device}")


atexit.register(DistributedManager.cleanup)


# ---- ShardTensor (the class-level API) ----

def _handler_types():
    return (ShardTensor,)


def _promote_plain(args, kwargs):
    """PhysicsNeMo hands function handlers ShardTensors only: plain tensor arguments (top level) become Replicate
    ShardTensors on the mesh of the first ShardTensor argument (no communication; differentiable, so a plain
    parameter still gets its single-device gradient). Grad-free 0-d tensors stay plain, as there."""
    from .. import device_mesh
    first = next((a for a in list(args) + list(kwargs.values()) if is_shard_tensor(a)), None)
    if first is None:
        return args, kwargs
    mesh = device_mesh(first)
    ndim = len(_C.mesh_of(first).shape)

    def promote(a):
        if isinstance(a, torch.Tensor) and not is_shard_tensor(a) and (a.dim() > 0 or a.requires_grad):
            return from_local(a, mesh, [Replicate()] * ndim, sharding_shapes={}, check=False)
        return a

    return tuple(promote(a) for a in args), {k: promote(v) for k, v in kwargs.items()}


def _aten_overloads(func):
    """The functional aten overloads behind a torch function (``torch.dot`` -> aten::dot.default), an OpOverload
    itself, or every overload of an OpOverloadPacket."""
    if isinstance(func, torch._ops.OpOverload):
        return [func]
    packet = func if isinstance(func, torch._ops.OpOverloadPacket) else None
    if packet is None:
        name = getattr(func, "__name__", None)
        packet = getattr(torch.ops.aten, name, None) if name else None
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            return []
    out = []
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if "out" in overload.split("_") or any(a.kwarg_only and a.name == "out" for a in op._schema.arguments):
            continue
        out.append(op)
    return out


def _check_handler(what: str, handler) -> None:
    if not callable(handler):
        raise TypeError(f"{what}: handler must be callable (a function taking the call's arguments), got "
                        f"{type(handler).__name__} {handler!r:.60}")


def _register_aten(ops, func, handler, describe):
    registered, refused = [], []
    for op in ops:
        def adapter(*args, _op=op):
            with torch.no_grad():  # below autograd: the op's own autograd kernel records the graph
                return handler(func, _handler_types(), args, {})
        try:
            register_handler(op, adapter)
            registered.append(op)
        except (NotImplementedError, ValueError) as e:
            refused.append(f"{op.name()}: {e}")
    if not registered:
        raise NotImplementedError(f"register_function_handler: {describe} reaches no aten op that takes a handler"
                                  + (" (" + "; ".join(refused) + ")" if refused else "") +
                                  ". Register the aten ops it runs (st.register_handler), or route your own Python "
                                  "function with ShardTensor.register_function_handler(fn, handler)")
    return registered


class ShardTensor(_ShardTensorCheck):
    """PhysicsNeMo's ``ShardTensor`` class API. ``isinstance(x, ShardTensor)`` is True for ShardTensors (plain
    ``torch.Tensor`` objects backed by C++; this class is a check, not their type)."""

    @staticmethod
    def from_local(local_tensor, device_mesh=None, placements=None, sharding_shapes="infer", global_shape=None):
        """``st.from_local``, plus PhysicsNeMo's ``sharding_shapes="chunk"`` (``compute_split_shapes`` of
        ``global_shape``, which is then required). ``device_mesh=None`` is the DistributedManager's mesh."""
        if device_mesh is None:
            device_mesh = DistributedManager().global_mesh
        if isinstance(sharding_shapes, str) and sharding_shapes == "chunk":
            if global_shape is None:
                raise ValueError("from_local: sharding_shapes='chunk' needs global_shape")
            pl = normalize_placements(placements, device_mesh.ndim)
            sharding_shapes = {m: compute_split_shapes(int(global_shape[p.dim]), device_mesh.size(m))
                               for m, p in enumerate(pl) if p.is_shard()}
        return from_local(local_tensor, device_mesh, placements, sharding_shapes=sharding_shapes,
                          global_shape=global_shape)

    @staticmethod
    def from_dtensor(dtensor):
        return from_dtensor(dtensor)

    @staticmethod
    def register_function_handler(func: Callable, handler: Callable) -> None:
        """Route ``func`` to ``handler(func, types, args, kwargs)`` when ShardTensors are among its arguments.

        - A Python function (a user's ``knn``, also one written with PhysicsNeMo's ``has_torch_function`` /
          ``handle_torch_function`` guard) is routed in place by ``st.register_function``: every call with a
          ShardTensor argument reaches the handler, and ``func(...)`` inside the handler runs its own body (on local
          tensors, say). Plain tensor arguments arrive as Replicate ShardTensors, as in PhysicsNeMo.
        - A torch function (``torch.dot``), an ``OpOverload`` or ``OpOverloadPacket`` becomes a handler of its
          functional aten overloads (``st.register_handler``): it runs below autograd (the op's own derivative
          records the graph), under ``torch.no_grad()``, with the op's arguments in schema order in ``args``
          (``kwargs`` empty) and ``func`` the function you registered.

        ``handler`` must be callable (``TypeError`` otherwise, at registration rather than at the first call).
        """
        _check_handler("register_function_handler", handler)
        if isinstance(func, types.FunctionType):
            def adapter(*args, **kwargs):
                args, kwargs = _promote_plain(args, kwargs)
                return handler(func, _handler_types(), args, kwargs)
            register_function(func, adapter)
            return
        ops = _aten_overloads(func)
        if not ops:
            raise TypeError(f"register_function_handler: {func!r} is neither a Python function nor a torch "
                            "function with an aten op; pass a Python function, a torch function or an OpOverload")
        _register_aten(ops, func, handler, getattr(func, "__name__", repr(func)))

    @staticmethod
    def register_dispatch_handler(op, handler: Callable) -> None:
        """``handler(*args)`` for an aten op (``OpOverload``; an ``OpOverloadPacket`` registers every overload):
        ``st.register_handler``. Arguments arrive positionally in schema order."""
        _check_handler("register_dispatch_handler", handler)
        ops = [op] if isinstance(op, (str, torch._ops.OpOverload)) else _aten_overloads(op)
        if not ops:
            raise TypeError(f"register_dispatch_handler: expected an OpOverload, got {op!r}")
        for o in ops:
            register_handler(o, handler)

    @staticmethod
    def register_named_function_handler(func_name: str, handler: Callable) -> None:
        """A ``torch.library`` custom op by name (``"mylib.knn.default"`` or ``"mylib::knn"``), with PhysicsNeMo's
        ``(func, types, args, kwargs)`` handler signature; runs below autograd like ``register_function_handler``
        for aten ops."""
        name = func_name if "::" in func_name else func_name.replace(".", "::", 1)
        ns, rest = name.split("::", 1)
        opname, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, ns), opname)
        op = getattr(packet, overload or "default")
        _register_aten([op], op, handler, func_name)

    @staticmethod
    def patches_enabled() -> bool:
        """Always True: the library's rules are always on."""
        return True


# ---- Creating ShardTensors ----

def compute_split_shapes(size: int, num_chunks: int) -> list:
    """PhysicsNeMo's split of ``size`` over ``num_chunks``: div-up chunks with a shorter last one (7 over 4: 2, 2, 2,
    1); when div-up would leave the last one empty, floor chunks with the remainder on the last (6 over 4: 1, 1, 1,
    3). Pass it as ``sharding_shapes`` for PhysicsNeMo's layout; shardtensor's default is ``torch.tensor_split``'s."""
    size, num_chunks = int(size), int(num_chunks)
    if num_chunks < 1:
        raise ValueError(f"compute_split_shapes: num_chunks must be at least 1, got {num_chunks}")
    if size < 0:
        raise ValueError(f"compute_split_shapes: size must be non-negative, got {size}")
    if num_chunks == 1:
        return [size]
    chunk = (size + num_chunks - 1) // num_chunks
    last = max(0, size - chunk * (num_chunks - 1))
    if last == 0:
        chunk = size // num_chunks
        last = size - chunk * (num_chunks - 1)
    return [chunk] * (num_chunks - 1) + [last]


def _agree_on_metadata(out, mesh, src, global_shape, dtype):
    """Every rank compares the ``global_shape``/``dtype`` it passed with the tensor ``src`` scattered (its shape and
    dtype arrived with the data), then one small all-reduce per mesh dim tells every rank whether any rank
    disagreed, so all raise together. Issued on every call alike (whether a rank passed the keywords is its own
    business)."""
    bad_shape = global_shape is not None and tuple(int(s) for s in global_shape) != tuple(out.shape)
    bad_dtype = dtype is not None and dtype != out.dtype
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    flags = torch.tensor([int(bad_shape), int(bad_dtype)], dtype=torch.int64, device=device)
    for d in range(mesh.ndim):
        if mesh.size(d) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
    if int(flags.max()):
        what = [k for k, f in zip(("global_shape", "dtype"), flags.tolist()) if f]
        raise ValueError(f"scatter_tensor: the {' and '.join(what)} passed on at least one rank do not match the "
                         f"tensor on rank {src} (shape {list(out.shape)}, dtype {out.dtype}); this rank passed "
                         f"global_shape={None if global_shape is None else list(global_shape)}, dtype={dtype}. Pass "
                         "the source tensor's shape and dtype, or leave them out (they travel with the data)")


@keyword_aliases(src="global_src", device_mesh="mesh")
def scatter_tensor(tensor, global_src: int, mesh, placements, global_shape=None, dtype=None,
                   requires_grad: bool = False, sharding_shapes=None):
    """PhysicsNeMo's ``scatter_tensor``: ``tensor`` is read on global rank ``global_src`` (``None`` elsewhere);
    each rank receives only its shard (``st.scatter_tensor``).

    ``global_shape``/``dtype``, when given, are checked against the source tensor (they always travel with the data:
    PhysicsNeMo trusts them instead); a mismatch on any rank raises ``ValueError`` on every rank. Extents follow
    shardtensor's default split unless ``sharding_shapes`` says otherwise (``compute_split_shapes`` gives
    PhysicsNeMo's).
    """
    if isinstance(global_src, bool) or not isinstance(global_src, int):
        raise ValueError(f"scatter_tensor: global_src must be an integer rank, got {global_src!r}")
    out = _scatter_tensor(tensor, global_src, mesh, placements, sharding_shapes=sharding_shapes)
    _agree_on_metadata(out, mesh, global_src, global_shape, dtype)
    return out.requires_grad_(requires_grad) if requires_grad else out


def distribute_tensor(tensor, device_mesh=None, placements=None, *, src_data_rank: Optional[int] = 0,
                      sharding_shapes=None):
    """DTensor's ``distribute_tensor`` spelling, returning a ShardTensor: ``src_data_rank=0`` (the default, as in
    DTensor) scatters the data of the mesh's coordinate 0 (``st.scatter_tensor``), ``None`` keeps each rank's own
    copy sliced locally (``st.distribute_tensor``, differentiable). Placements default to Replicate. The result
    requires grad when ``tensor`` does (a new leaf, as in DTensor)."""
    if device_mesh is None:
        device_mesh = DistributedManager().global_mesh
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    if src_data_rank is None:
        return _distribute_tensor(tensor, device_mesh, placements, sharding_shapes=sharding_shapes)
    if isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int):
        raise TypeError(f"distribute_tensor: src_data_rank must be an int (an index into the mesh's ranks) or None, "
                        f"got {type(src_data_rank).__name__}")
    if not 0 <= src_data_rank < device_mesh.mesh.numel():
        raise ValueError(f"distribute_tensor: src_data_rank={src_data_rank} is not a rank of the mesh (0 to "
                         f"{device_mesh.mesh.numel() - 1}); pass the index of the rank holding the data, or None to "
                         "slice every rank's own copy")
    src = int(device_mesh.mesh.flatten()[src_data_rank])
    with torch.no_grad():
        out = _scatter_tensor(tensor.detach(), src, device_mesh, placements, sharding_shapes=sharding_shapes)
    return out.requires_grad_(tensor.requires_grad) if tensor.requires_grad else out


def distribute_module(module: torch.nn.Module, device_mesh=None, partition_fn: Optional[Callable] = None,
                      input_fn: Optional[Callable] = None, output_fn: Optional[Callable] = None):
    """DTensor's ``distribute_module`` as PhysicsNeMo scripts use it: ``st.sync_module(module, device_mesh)`` (plain
    parameters and buffers broadcast from the mesh's first rank; they stay plain and act as Replicate), then
    ``partition_fn(name, submodule, device_mesh)`` on every submodule (e.g. to replace a parameter by a sharded
    one), then ``input_fn(module, inputs, device_mesh)`` / ``output_fn(module, outputs, device_mesh)`` as forward
    hooks. Returns ``module``."""
    if device_mesh is None:
        device_mesh = DistributedManager().global_mesh
    sync_module(module, device_mesh)
    if partition_fn is not None:
        for name, submodule in list(module.named_modules()):
            partition_fn(name, submodule, device_mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module


def sync_module_over_mesh(model: torch.nn.Module, mesh):
    """PhysicsNeMo's name for ``st.sync_module(model, mesh)``."""
    return sync_module(model, mesh)


# ---- Ring helpers (physicsnemo.distributed.shard_utils.ring) ----

@dataclasses.dataclass
class RingPassingConfig:
    """PhysicsNeMo's ring configuration. ``communication_method`` (``"p2p"`` or ``"a2a"``) is accepted and checked;
    both run as the library's ring pass (neighbour send/receive)."""

    mesh_dim: int
    mesh_size: int
    ring_direction: str = "forward"
    communication_method: str = "a2a"

    VALID_COMM_METHODS = ("p2p", "a2a")
    VALID_RING_DIRECTIONS = ("forward", "backward")

    def __post_init__(self):
        if self.communication_method not in self.VALID_COMM_METHODS:
            raise ValueError(f"Invalid communication method: {self.communication_method}. Must be one of "
                             f"{list(self.VALID_COMM_METHODS)}")
        if self.ring_direction not in self.VALID_RING_DIRECTIONS:
            raise ValueError(f"Invalid ring direction: {self.ring_direction}. Must be one of "
                             f"{list(self.VALID_RING_DIRECTIONS)}")


def perform_ring_iteration(tensor: torch.Tensor, mesh, ring_config: RingPassingConfig, recv_shape=None):
    """One ring step: send ``tensor`` to the next rank along ``ring_config.mesh_dim`` (the previous one for
    ``ring_direction="backward"``) and return the tensor received, of ``recv_shape`` (default: the shape the sender
    sends; PhysicsNeMo assumes ``tensor``'s own, which is wrong for uneven shards). ``st.ring_pass``: the ranks agree
    on the shapes before any data moves, and a ``recv_shape`` the sender does not send raises ``ValueError`` on every
    rank; differentiable."""
    size = mesh.size(ring_config.mesh_dim)
    if ring_config.mesh_size != size:
        raise ValueError(f"perform_ring_iteration: ring_config.mesh_size={ring_config.mesh_size} but mesh dim "
                         f"{ring_config.mesh_dim} has {size} ranks")
    return ring_pass(tensor, mesh, ring_config.mesh_dim,
                     recv_shapes=None if recv_shape is None else list(recv_shape),
                     direction=ring_config.ring_direction)


class _CompletedWork:
    """A finished request: ``perform_ring_iteration_async`` completes before it returns."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def perform_ring_iteration_async(tensor: torch.Tensor, mesh, ring_config: RingPassingConfig, recv_tensor=None,
                                 recv_shape=None):
    """PhysicsNeMo's asynchronous ring step, run to completion: returns ``(received, [work])`` whose ``wait()``
    returns at once (``recv_tensor``, when given, receives the data)."""
    if ring_config.communication_method != "p2p":
        raise ValueError("perform_ring_iteration_async only supports p2p communication. Got: "
                         f"{ring_config.communication_method}")
    shape = recv_tensor.shape if recv_tensor is not None else recv_shape
    received = perform_ring_iteration(tensor, mesh, ring_config, recv_shape=shape)
    if recv_tensor is not None:
        with torch.no_grad():
            recv_tensor.copy_(received)
        received = recv_tensor
    return received, [_CompletedWork()]
