"""ShardTensor: domain parallelism for PyTorch.

One huge sample is split spatially across ranks; every rank holds a shard; ordinary ``torch`` code runs on
the sharded tensor and gives the single-device result. The tensors you get are ordinary ``torch.Tensor``
objects backed by a C++ ``ShardTensorImpl``; every op is handled in C++ (no Python on the per-op path).
"""
from __future__ import annotations

import datetime
import os
import types
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _patches

_patches.check_torch()  # before the compiled module loads: a torch it was not built for fails there obscurely
from . import _C  # noqa: E402
from .compat import (NotAShardTensorError, ShardTensor, extents_by_mesh_dim, from_dtensor, keyword_aliases,
                     redistribute_arguments, to_dtensor)
from .mesh import as_cpp_mesh, device_mesh_of
from .placement import Partial, Replicate, Shard, from_wire, normalize_placements, to_wire
from .profiling import peak_memory

__all__ = [
    "Shard", "Replicate", "Partial", "ShardTensor", "NotAShardTensorError", "ShardTensorHostAccessError", "to_dtensor", "from_dtensor",
    "scatter_tensor", "distribute_tensor", "from_local", "to_local", "full_tensor", "redistribute",
    "is_shard_tensor", "placements", "device_mesh", "sharding_shapes", "local_offsets",
    "sync_module", "register_handler", "init_distributed", "comm_stats", "reset_comm_stats", "CommCounter", "peak_memory",
    "set_attention_strategy", "attention_strategy", "use_attention_strategy", "local_map",
    "set_strict", "strict", "use_strict", "set_replication_threshold", "replication_threshold", "set_fallback_budget",
    "fallback_budget", "set_grad_bucket_bytes", "grad_bucket_bytes", "wait_grad_reductions", "localize_parameters",
    "set_comm_backend", "comm_backend",
    "use_comm_backend", "set_shm_capacity", "shm_capacity", "register_function", "function_handler", "unregister_function", "ring_pass",
    "simulate", "simulating", "SimulationWarning", "SimulationError", "RankStats", "DEFAULT_TIMEOUT",
]

__version__ = "0.1.0"


def _check(x, what: str):
    if type(x).__name__ == "TracedShard":
        raise NotImplementedError(f"{what} inside a torch.compile'd region is not supported yet: call it outside the "
                                  "compiled function (ShardTensors enter and leave compiled code as they are)")
    if isinstance(x, torch.Tensor) and _wraps_shard_tensor(x):
        raise NotImplementedError(f"{what} inside a torch.func transform (grad, vjp, jvp, vmap, ...) is not supported: "
                                  "the transform hands its own wrapper of the ShardTensor to it. Call it on the "
                                  "transform's result, or use st.full_tensor (supported there) or ShardTensor ops "
                                  "inside (x.sum(), x.mean(): their results are complete on every rank)")
    if not isinstance(x, torch.Tensor) or not _C.is_shard_tensor(x):
        raise NotAShardTensorError(f"{what}: expected a ShardTensor, got {'a plain tensor' if isinstance(x, torch.Tensor) else type(x).__name__}; "
                        "build one with shardtensor.from_local, distribute_tensor or scatter_tensor")


def _wraps_shard_tensor(x: torch.Tensor) -> bool:
    """Whether ``x`` is a functorch wrapper (torch.func's transforms) around a ShardTensor, at any depth."""
    functorch = torch._C._functorch
    if not functorch.is_functorch_wrapped_tensor(x):
        return False
    while functorch.is_functorch_wrapped_tensor(x):
        x = functorch.get_unwrapped(x)
    return _C.is_shard_tensor(x)


def _shapes(sharding_shapes, placements) -> dict:
    return extents_by_mesh_dim(sharding_shapes, placements)


def is_shard_tensor(x) -> bool:
    """True if ``x`` is a ShardTensor."""
    return isinstance(x, torch.Tensor) and _C.is_shard_tensor(x)


def placements(x) -> tuple:
    """The placements of ``x``, one per mesh dim."""
    _check(x, "placements")
    return from_wire(_C.placements(x))


def device_mesh(x):
    """The mesh of ``x`` (the DeviceMesh it was built with)."""
    _check(x, "device_mesh")
    return device_mesh_of(_C.mesh_of(x))


def sharding_shapes(x) -> dict:
    """``{mesh_dim: [extent on coordinate 0, 1, ...]}`` for every sharded mesh dim of ``x``."""
    _check(x, "sharding_shapes")
    return dict(_C.sharding_shapes(x))


def local_offsets(x) -> tuple:
    """The global index of this rank's first element along every tensor dim."""
    _check(x, "local_offsets")
    return tuple(_C.local_offsets(x))


@keyword_aliases(device_mesh="mesh", shape="global_shape")
def from_local(local: torch.Tensor, mesh, placements, sharding_shapes="infer", global_shape=None,
               check: bool = True) -> torch.Tensor:
    """Wrap this rank's ``local`` tensor as a ShardTensor (differentiable).

    ``sharding_shapes``: ``"infer"`` (one small all-gather of local shapes per sharded mesh dim), ``"even"``
    (the default split of ``global_shape``, which is then required) or an explicit
    ``{mesh_dim: [extent_of_coordinate_0, ...]}``. ``check`` (default): every rank verifies that all ranks passed
    the same placements, dtype, ndim, shapes and that every local tensor fits the layout, and raises ``ValueError``
    on every rank otherwise (one small all-reduce per mesh dim); ``check=False`` skips it (no communication
    except ``"infer"``'s), e.g. inside handlers that build the layout from an existing ShardTensor.
    """
    cpp = as_cpp_mesh(mesh)
    pl = normalize_placements(placements, len(cpp.shape))
    if isinstance(sharding_shapes, str):
        if sharding_shapes not in ("infer", "even"):
            raise ValueError(f"sharding_shapes must be 'infer', 'even' (torch.tensor_split sizes of global_shape) or "
                             f"a dict, got {sharding_shapes!r}; for PhysicsNeMo's 'chunk' rule give the extents "
                             "explicitly")
        mode, shapes = sharding_shapes, {}
    else:
        mode, shapes = "explicit", _shapes(sharding_shapes, pl)
    gs = None if global_shape is None else [int(s) for s in global_shape]
    return _C.from_local(local, cpp, to_wire(pl), mode, shapes, gs, bool(check))


def _linear_on_dual(fn, x):
    """``fn(x)`` for a linear layout change ``fn``; for a dual tensor of forward-mode AD (``torch.autograd.forward_ad``)
    the primal and the tangent are mapped alike and paired again: the C++ autograd functions behind these calls have
    no forward derivative of their own."""
    primal, tangent = torch.autograd.forward_ad.unpack_dual(x)
    if tangent is None:
        return fn(x)
    return torch.autograd.forward_ad.make_dual(fn(primal), fn(tangent))


def to_local(x) -> torch.Tensor:
    """This rank's local tensor (differentiable; its gradient is rewrapped with ``x``'s layout)."""
    _check(x, "to_local")
    return _linear_on_dual(_C.to_local, x)


def full_tensor(x) -> torch.Tensor:
    """The whole global tensor on every rank (a collective; differentiable)."""
    if isinstance(x, torch.Tensor) and _wraps_shard_tensor(x):
        # Inside a torch.func transform: the dispatcher op functorch records at each level (its gradient comes back
        # Replicate, as the input's layout is not known there).
        return torch.ops.shardtensor.full_plain(x)
    _check(x, "full_tensor")
    return _linear_on_dual(_C.full_tensor, x)


def redistribute(x, *args, placements=None, sharding_shapes=None, device_mesh=None, async_op=False) -> torch.Tensor:
    """``x`` with new placements (collectives only along mesh dims that change; differentiable).

    ``redistribute(x, placements, sharding_shapes=None)``, or DTensor's ``x.redistribute(device_mesh,
    placements)`` / ``x.redistribute(device_mesh=..., placements=...)`` (the mesh must be ``x``'s own).
    ``async_op`` is accepted for DTensor code; the result is always complete on return."""
    _check(x, "redistribute")
    placements, sharding_shapes = redistribute_arguments(x, args, placements, sharding_shapes, device_mesh)
    pl = normalize_placements(placements, len(_C.mesh_of(x).shape))
    return _linear_on_dual(lambda t: _C.redistribute(t, to_wire(pl), _shapes(sharding_shapes, pl)), x)


@keyword_aliases(device_mesh="mesh")
def distribute_tensor(tensor: torch.Tensor, mesh, placements, sharding_shapes=None) -> torch.Tensor:
    """Every rank holds the same full ``tensor``; each keeps its slice (differentiable)."""
    cpp = as_cpp_mesh(mesh)
    pl = normalize_placements(placements, len(cpp.shape))
    return _C.distribute_tensor(tensor, cpp, to_wire(pl), _shapes(sharding_shapes, pl))


@keyword_aliases(device_mesh="mesh", global_src="src")
def scatter_tensor(tensor: Optional[torch.Tensor], src: int, mesh, placements, sharding_shapes=None,
                   requires_grad: bool = False) -> torch.Tensor:
    """Scatter ``tensor`` from global rank ``src``; other ranks may pass ``None`` (shape and dtype travel
    with the data). Each rank receives only its own shard."""
    cpp = as_cpp_mesh(mesh)
    pl = normalize_placements(placements, len(cpp.shape))
    # Anything but a tensor counts as no tensor: the src rank's problem then travels with the metadata and every
    # rank raises it.
    tensor = tensor if isinstance(tensor, torch.Tensor) else None
    out = _C.scatter_tensor(tensor, int(src), cpp, to_wire(pl), _shapes(sharding_shapes, pl))
    return out.requires_grad_(requires_grad) if requires_grad else out


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed tensors
        return False
    return isinstance(t, DTensor)


def sync_module(module: torch.nn.Module, mesh, src_rank: Optional[int] = None) -> torch.nn.Module:
    """Broadcast every plain parameter and buffer of ``module`` over the mesh from ``src_rank`` (default: the
    mesh's first rank), so all domain ranks start from the same weights. ShardTensor and DTensor parameters and
    buffers are skipped (and the local parameters standing for ShardTensor ones, see ``localize_parameters``):
    each rank already holds its own part of them (a broadcast would overwrite other ranks' shards)."""
    if hasattr(mesh, "get_group"):
        groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        ranks = mesh.mesh.flatten().tolist()
    else:
        raise TypeError("sync_module: pass the torch DeviceMesh")
    src = ranks[0] if src_rank is None else int(src_rank)
    coord_src = mesh.mesh.flatten().tolist().index(src)
    shape = list(mesh.mesh.shape)
    src_coord = []
    rest = coord_src
    for s in reversed(shape):
        src_coord.append(rest % s)
        rest //= s
    src_coord.reverse()
    me = mesh.get_coordinate()
    tensors = [t for t in list(module.parameters()) + list(module.buffers())
               if not is_shard_tensor(t) and not _is_dtensor(t) and not data_parallel.is_localized(t)]
    with torch.no_grad():
        # Along each mesh dim in turn, from the line that already holds src's values.
        for d in reversed(range(len(shape))):
            if any(me[k] != src_coord[k] for k in range(d)):
                continue
            group = groups[d]
            root = dist.get_global_rank(group, src_coord[d])
            for t in tensors:
                dist.broadcast(t.data, src=root, group=group)
    return module


def register_handler(op, fn) -> None:
    """Register a domain-parallel handler for an aten op or a ``torch.library`` custom op.

    ``op`` is an ``OpOverload`` (``torch.ops.aten.add.Tensor``) or a name (``"aten::add.Tensor"``). ``fn``
    receives the op's arguments (ShardTensors, plain tensors, scalars) and returns its result(s); it runs below
    autograd, so it should work on ``to_local()`` values and wrap results with ``from_local``.
    """
    if not callable(fn):
        raise TypeError(f"register_handler: the handler must be callable, got {type(fn).__name__}")
    name = op if isinstance(op, str) else op.name() if hasattr(op, "name") else str(op)
    if "::" not in name:
        name = "aten::" + name
    _C.register_handler(name, fn)


DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def init_distributed(backend: Optional[str] = None, timeout=None):
    """``init_process_group`` from torchrun's environment: NCCL (with Gloo for CPU tensors) when CUDA is
    available, else Gloo. ``timeout`` (a ``datetime.timedelta`` or seconds; default ``DEFAULT_TIMEOUT``, 5 minutes)
    bounds every collective, so a rank whose peer died or raised fails with an error naming the op instead of
    waiting for torch's default (10 to 30 minutes). Does nothing when a process group exists. Without a launcher's
    environment (no ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``: ``python train.py`` rather than torchrun) it starts a
    one-process world on a free local port, so the same script is its own single-device reference. Returns
    (rank, world_size)."""
    if not dist.is_initialized():
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        elif not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        if timeout <= datetime.timedelta(0):
            raise ValueError(f"init_distributed: timeout must be positive, got {timeout}")
        if backend is None:
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if _launched_by_torchrun():
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _launched_by_torchrun() -> bool:
    """True when a launcher set the env:// rendezvous variables (torchrun, or a user exporting them by hand)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comm_stats() -> dict:
    """Collectives issued by this process so far: ``{"calls": {kind: n}, "bytes": {kind: n}, "messages": {kind: n},
    "replications": {op: n}, "replicated_bytes": {op: n}}`` (messages: the point-to-point messages sent, for the
    kinds made of them; replications: tensors sharded along a large dim that an op made replicated; see
    ``CommCounter``)."""
    calls, nbytes, messages, replications, replicated = _C.comm_stats()
    return {"calls": dict(calls), "bytes": dict(nbytes), "messages": dict(messages),
            "replications": dict(replications), "replicated_bytes": dict(replicated)}


class _SettingBlock:
    """A process-wide setting changed for a ``with`` block and restored after it (``setter`` returns the previous
    value)."""

    _setter = None

    def __init__(self, value):
        self.value = value
        self.previous = None

    def __enter__(self):
        self.previous = type(self)._setter(self.value)
        return self

    def __exit__(self, *exc):
        type(self)._setter(self.previous)
        return False


def set_attention_strategy(strategy: str) -> str:
    """How ``F.scaled_dot_product_attention`` runs when the sequence (dim -2) is sharded: ``"ring"`` (K/V
    blocks pass around the mesh dim, log-sum-exp merge; causal self-attention runs in the load-balanced zigzag
    layout), ``"ring_contiguous"`` (the ring without the zigzag permutation), ``"all_to_all"`` (sequence shards -> head shards,
    local attention, back) or ``"auto"`` (the default: all-to-all when the key/value heads divide evenly by the
    mesh dim size and the attention is causal or it moves no more bytes than the ring). The process-wide default:
    set it alike on every rank, before threads that run attention start (a change while another thread runs
    attention could reach the ranks at different points; ``use_attention_strategy`` changes the calling thread
    only). Each attention call reads the setting once and its backward reuses that choice. Returns the previous
    default."""
    return _C.set_attention_strategy(str(strategy))


def attention_strategy() -> str:
    """The attention strategy in effect on this thread (see ``set_attention_strategy``)."""
    return _C.attention_strategy()


class use_attention_strategy:
    """``with st.use_attention_strategy("ring"): ...`` — the attention strategy for a block, on the calling thread
    only (attention running on other threads meanwhile keeps its own setting, so no thread can make the ranks
    diverge). Blocks nest; the previous setting comes back on exit."""

    def __init__(self, strategy: str):
        self.value = str(strategy)
        self.previous = None

    def __enter__(self):
        self.previous = _C.set_thread_attention_strategy(self.value)
        return self

    def __exit__(self, *exc):
        _C.set_thread_attention_strategy(self.previous)
        return False


def set_strict(strict: bool) -> bool:
    """Strict mode: an op without a domain-parallel rule (or whose rule declines) raises ``NotImplementedError``
    instead of running through the gather-compute fallback (every sharded argument gathered to every rank, the op
    run on the full tensors, a one-time warning per op). Off by default; ``SHARDTENSOR_STRICT=1`` in the
    environment turns it on at start-up. Process-wide; set it alike on every rank. Returns the previous setting."""
    return _C.set_strict(bool(strict))


def strict() -> bool:
    """Whether strict mode is on (see ``set_strict``)."""
    return _C.strict()


def set_fallback_budget(nbytes: Optional[int]) -> Optional[int]:
    """The size guard of the gather-compute fallback: the most bytes one call may hold on each rank (its sharded
    arguments gathered at their global size, plus room for the result; estimated from the layouts before anything
    moves). Above it the op raises ``NotImplementedError`` on every rank, naming the op, the bytes and this setting.
    ``None`` (the default): the memory available on the arguments' device, so a gather that cannot fit never starts;
    ``0`` refuses every gather. The ranks use the smallest budget among them (one small all-reduce per fallback
    call, which also checks that strict mode is alike everywhere). ``SHARDTENSOR_FALLBACK_MAX_BYTES`` (bytes or
    ``auto``) sets it at start-up. Returns the previous setting."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
        raise ValueError(f"set_fallback_budget: expected a number of bytes >= 0 or None, got {nbytes!r}")
    previous = _C.set_fallback_budget(-1 if nbytes is None else int(nbytes))
    return None if previous < 0 else previous


def fallback_budget() -> Optional[int]:
    """The fallback's size guard in bytes, or None when automatic (see ``set_fallback_budget``)."""
    budget = _C.fallback_budget()
    return None if budget < 0 else budget


def set_replication_threshold(numel: int) -> int:
    """When an op's rule turns a tensor sharded along a large dim into a replicated one (a gather inside a rule, a
    view that must gather), the work stops being divided from there on: it is counted (``CommCounter().replications``,
    ``RankStats().replications``), warned about once per op and call site ("the work is no longer divided"), and in
    strict mode (``set_strict``) refused with ``NotImplementedError`` on every rank. "Large": the gathered dim is
    longer than the mesh dim and the tensor has at least ``numel`` elements (default 16384;
    ``SHARDTENSOR_REPLICATION_MIN_NUMEL`` sets it at start-up), so statistics and losses never count. Explicit requests
    (``full_tensor()``, ``redistribute``) never count; the gather-compute fallback's gathers are counted and keep its
    own warning. Process-wide; set it alike on every rank. Returns the previous setting."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"set_replication_threshold: expected an element count >= 0, got {numel!r}")
    return _C.set_replication_threshold(int(numel))


def replication_threshold() -> int:
    """The element count from which a replication counts (see ``set_replication_threshold``)."""
    return _C.replication_threshold()


def set_grad_bucket_bytes(nbytes: int) -> int:
    """Bucket size of the parameter-gradient reductions, in bytes. A plain parameter used with sharded inputs
    (a conv, linear or norm weight and bias) gets a per-rank term of its gradient that must be summed over the mesh
    dims that shard the inputs. During ``backward()`` these terms gather in buckets; a bucket's all-reduce is issued
    asynchronously once it holds ``nbytes`` (one flat buffer, one message per mesh dim) and the backward goes on;
    what is left is issued, waited and accumulated into ``.grad`` before ``backward()`` returns. ``0`` turns
    bucketing off: each rule sums its parameters' gradients where it produces them (one blocking all-reduce per
    layer). Default 1 MiB, or ``SHARDTENSOR_GRAD_BUCKET_BYTES`` at start-up. Process-wide; set it alike on every rank
    (bucket boundaries decide which collectives are issued). Returns the previous value.

    Parameters whose gradient something observes during the backward are reduced at once, whatever this setting:
    those with a tensor hook, a post-accumulate-grad hook or an accumulator hook (DDP, FSDP1, ``replicate``), and
    every gradient of ``torch.autograd.grad``, ``backward(inputs=...)`` and ``create_graph=True``. FSDP2 reads
    ``.grad`` in its post-backward: the pending reductions complete there first. A hook of your own that reads a
    parameter's ``.grad`` mid-backward calls ``wait_grad_reductions()`` first."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"set_grad_bucket_bytes: expected a number of bytes >= 0, got {nbytes!r}")
    return _C.set_grad_bucket_bytes(int(nbytes))


def grad_bucket_bytes() -> int:
    """Bucket size of the parameter-gradient reductions in bytes (0: off); see ``set_grad_bucket_bytes``."""
    return _C.grad_bucket_bytes()


def wait_grad_reductions() -> None:
    """Complete every pending parameter-gradient reduction now: issue, wait and accumulate into ``.grad``. A
    collective point: every rank calls it at the same place. ``backward()`` does it itself before returning; call it
    only in a hook that reads ``.grad`` during the backward."""
    _C.wait_grad_reductions()


class use_strict(_SettingBlock):
    """``with st.use_strict(): ...`` — strict mode (or, with ``False``, the fallback) for a block."""

    _setter = staticmethod(set_strict)

    def __init__(self, strict: bool = True):
        super().__init__(strict)


def set_comm_backend(backend: str) -> str:
    """How the library issues its collectives: ``"process_group"`` (the default: c10d ProcessGroup calls) or
    ``"functional"`` (torch's ``_c10d_functional`` ops, waited by ``wait_tensor``: the form torch.compile traces).
    The functional form is used automatically while tensors are being traced; this selects it for eager runs too.
    ``SHARDTENSOR_COMM_BACKEND=functional`` selects it at start-up. Process-wide; set it alike on every rank.
    Returns the previous setting."""
    return _C.set_comm_backend(str(backend))


def comm_backend() -> str:
    """The collective backend for eager runs (see ``set_comm_backend``)."""
    return _C.comm_backend()


class use_comm_backend(_SettingBlock):
    """``with st.use_comm_backend("functional"): ...`` — a collective backend for a block."""

    _setter = staticmethod(set_comm_backend)


def set_shm_capacity(nbytes: int) -> int:
    """Bytes of each shared-memory ring (one per ordered pair of ranks) that neighbour exchanges, ring passes,
    all-reduces, all-to-alls and all-gathers of CPU tensors use between ranks of one host, for process groups whose first exchange comes later
    (docs/halo-exchange.md, "Transport"); ``0`` keeps such groups on the process group's send/recv. Default 1 MiB, or
    ``SHARDTENSOR_SHM_BYTES`` at start-up. A group takes the smallest value of its ranks (off if any rank has it
    off). Returns the previous value."""
    return _C.set_shm_capacity(int(nbytes))


def shm_capacity() -> int:
    """The ring size for groups set up from now on (see ``set_shm_capacity``)."""
    return _C.shm_capacity()


def reset_comm_stats() -> None:
    """Zero the communication counters."""
    _C.reset_comm_stats()


class CommCounter:
    """Context manager counting the collectives issued inside it (like torch's CommDebugMode)::

        with st.CommCounter() as c:
            y = model(x)
        print(c.calls, c.bytes, c.messages)

    ``messages``: the point-to-point messages this rank sent, for the kinds made of them (an ``all_to_all`` talks to
    every other rank of its group; a ``halo`` exchange and a ``ring_pass`` only to the peers they have data for).

    ``replications`` / ``replicated_bytes`` (per op name): how often an op turned a tensor sharded along a large dim
    into a replicated one, and the bytes of those tensors: the points where the work stopped being divided (see
    ``set_replication_threshold``; ``full_tensor()`` and ``redistribute(...)`` are not counted).
    """

    def __enter__(self):
        self._start = comm_stats()
        return self

    def __exit__(self, *exc):
        end = comm_stats()
        self.calls = {k: v - self._start["calls"].get(k, 0) for k, v in end["calls"].items()
                      if v - self._start["calls"].get(k, 0)}
        self.bytes = {k: v - self._start["bytes"].get(k, 0) for k, v in end["bytes"].items()
                      if v - self._start["bytes"].get(k, 0)}
        self.messages = {k: v - self._start["messages"].get(k, 0) for k, v in end["messages"].items()
                         if v - self._start["messages"].get(k, 0)}
        self.replications = {k: v - self._start["replications"].get(k, 0) for k, v in end["replications"].items()
                             if v - self._start["replications"].get(k, 0)}
        self.replicated_bytes = {k: v - self._start["replicated_bytes"].get(k, 0)
                                 for k, v in end["replicated_bytes"].items()
                                 if v - self._start["replicated_bytes"].get(k, 0)}
        return False

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


# ---- torch.Tensor methods and properties for ShardTensors ----

class ShardTensorHostAccessError(TypeError, RuntimeError):
    """``tolist()``, ``numpy()`` or ``data_ptr()`` on a ShardTensor. A TypeError (the operation does not apply to
    the type); also a RuntimeError, which PyTorch raised here before (a wrapper without storage)."""


from . import ops  # noqa: E402,F401  (shardtensor.ops: neighbourhood attention, knn, radius_search)
from . import checkpoint  # noqa: E402,F401  (torch.distributed.checkpoint support)
from . import io  # noqa: E402,F401  (shardtensor.io: inputs read and outputs written shard by shard)
from .compile import local_map  # noqa: E402
from . import _traced  # noqa: E402  (torch.compile of ShardTensor code: the traced representation)
from . import data_parallel  # noqa: E402  (sharded parameters under DDP/FSDP: localized by the wrappers)
from .data_parallel import localize_parameters  # noqa: E402
from .simulate import SimulationError, SimulationWarning, simulate, simulating  # noqa: E402  (one rank of P, fake group)
from .accounting import RankStats  # noqa: E402  (per-rank FLOPs, bytes, memory)
from .functions import function_handler, register_function, unregister_function  # noqa: E402
from .ring import ring_pass  # noqa: E402

_patches.install()  # every change to torch, listed in _patches.py
from . import integrations  # noqa: E402  (other libraries' functions that allocate global outputs, routed)
integrations.install()

# PhysicsNeMo's names, reached on the package: say where they live.
_PHYSICSNEMO_NAMES = {
    "DistributedManager": "shardtensor.compat.physicsnemo.DistributedManager (built on st.init_distributed())",
    "ShardTensorSpec": "x._spec (a read-only view) or st.placements / st.sharding_shapes / st.device_mesh",
    "distribute_module": "shardtensor.compat.physicsnemo.distribute_module, or st.sync_module(module, mesh)",
    "sync_module_over_mesh": "st.sync_module(module, mesh)",
    "perform_ring_iteration": "st.ring_pass(tensor, mesh, mesh_dim, recv_shapes=...) (or "
                              "shardtensor.compat.physicsnemo.perform_ring_iteration)",
    "RingPassingConfig": "st.ring_pass(..., direction='forward'|'backward') (or "
                         "shardtensor.compat.physicsnemo.RingPassingConfig)",
    "register_function_handler": "st.register_function(fn, handler) for Python functions, st.register_handler(op, "
                                 "handler) for aten ops (PhysicsNeMo's signature: "
                                 "shardtensor.compat.physicsnemo.ShardTensor.register_function_handler)",
    "register_dispatch_handler": "st.register_handler(op, handler)",
}


# The public namespace: __all__ and the documented subpackages. Everything else the package holds (its own
# imports, internal modules) is left out of dir(shardtensor) and tab completion.
_SUBPACKAGES = ("io", "ops", "compat", "checkpoint", "integrations")


def __dir__():
    return sorted(set(__all__) | set(_SUBPACKAGES))


def __getattr__(name):
    if name in _PHYSICSNEMO_NAMES:
        raise AttributeError(f"module 'shardtensor' has no attribute {name!r} (a PhysicsNeMo name): use "
                             f"{_PHYSICSNEMO_NAMES[name]}")
    raise AttributeError(f"module 'shardtensor' has no attribute {name!r}")
