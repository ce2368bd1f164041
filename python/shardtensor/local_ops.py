"""Seeing the local kernels a rank runs under ShardTensors: a dispatch mode that passes ShardTensor ops on to the
library and observes the plain-tensor ops the library's C++ handlers issue on the local shards.

Why a mode of our own: ``torch.utils.flop_counter.FlopCounterMode`` sees an op on a ShardTensor as one op on the
*global* shape (and its handler pops the mode, so the local kernels underneath are never seen). ``LocalOpMode``
instead, for an op with a ShardTensor argument, puts itself back on the mode stack and redispatches straight to the
ShardTensor kernel (``PrivateUse1``): everything the handler then runs on local tensors comes back through the
mode, with local shapes, and is counted. Autograd is untouched (the mode sits below it), so the library's own
autograd kernels run exactly as without the mode, and so does every collective.

With ``fake=`` (a ``FakeTensorMode``), every op on fake tensors and every factory op runs under it: local tensors
are meta-backed ``FakeTensor`` objects reporting the CPU device (so dispatch sees the same keys as a real CPU
run), nothing is allocated, and the mode keeps a tally of the bytes the fake storages would hold (the
allocation-tracked memory estimate of the meta simulation). The library's small host-side metadata (agreement
checks, shape exchanges, halo index lists) is created in C++ with Python dispatch excluded, so it stays real.
"""
from __future__ import annotations

import time
import weakref
from collections import defaultdict

import torch
from torch._C import _pop_torch_dispatch_stack, _push_on_torch_dispatch_stack
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import _C

__all__ = ["LocalOpMode", "local_flops", "SimulationError", "active_local_mode"]

aten = torch.ops.aten
_SHARD_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


class SimulationError(NotImplementedError):
    """An operation that cannot run under simulation (it needs values other ranks would have sent, or reads values
    the meta simulation does not have). Raised with what to do instead."""


# ---- FLOPs of local kernels ------------------------------------------------------------------------------------

def _sdpa_cpu_flops(query, key, value, *args, out_val=None, **kwargs):
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs):
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _window(kernel_size) -> int:
    w = 1
    for k in kernel_size:
        w *= int(k)
    return w


def _na_forward_flops(query, key, value, kernel_size, *args, out_val=None, **kwargs):
    """Neighbourhood attention: every query scores and averages its window of prod(kernel_size) keys: two
    matmul-equivalents, 2·Nq·H·W·D + 2·Nq·H·W·Dv (the shardtensor op's own kernel)."""
    nq_h = query.numel() // query.shape[-1]
    return 2 * nq_h * _window(kernel_size) * (query.shape[-1] + value.shape[-1])


def _na_backward_flops(grad_out, query, key, value, out, lse, kernel_size, *args, out_val=None, **kwargs):
    """Recomputed scores, dV, dP, dQ, dK: 2·Nq·H·W·(3·D + 2·Dv), the rule torch uses for SDPA backward."""
    nq_h = query.numel() // query.shape[-1]
    return 2 * nq_h * _window(kernel_size) * (3 * query.shape[-1] + 2 * value.shape[-1])


def _registry() -> dict:
    """torch's FLOP formulas (matmuls, convolutions, the CUDA attention kernels) plus the CPU flash-attention
    kernels the library's ring/all-to-all attention calls on CPU (same counting rule: two matmuls forward, five
    backward, causal masks not discounted) and the library's neighbourhood-attention kernels."""
    from torch.utils.flop_counter import flop_registry
    reg = dict(flop_registry)
    reg[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_flops
    reg[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward_flops
    na = torch.ops.shardtensor
    reg[na.neighborhood_attention] = _na_forward_flops
    reg[na.neighborhood_attention_forward] = _na_forward_flops
    reg[na.neighborhood_attention_backward] = _na_backward_flops
    return reg


_FLOPS = None


def local_flops(func, args, kwargs, out) -> int:
    """FLOPs of one local op by torch's counting rules (0 for ops without a formula: pointwise ops, norms...)."""
    global _FLOPS
    if _FLOPS is None:
        _FLOPS = _registry()
    f = _FLOPS.get(func.overloadpacket)
    if f is None:
        return 0
    return int(f(*args, **(kwargs or {}), out_val=out))


def _traffic_bytes(func, args, kwargs, out) -> int:
    """Bytes an op reads and writes (its tensor arguments and results), the memory-bound term of a roofline; 0 for
    views, factories of uninitialised memory and queries that return no tensor (``prim::device``, sizes)."""
    if func.is_view or func.overloadpacket in _NO_TRAFFIC:
        return 0
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
        return 0
    total = 0
    for t in tree_leaves((args, kwargs, out)):
        if isinstance(t, torch.Tensor) and not _C.is_shard_tensor(t):
            total += t.numel() * t.element_size()
    return total


_NO_TRAFFIC = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
               aten.detach, aten.lift_fresh, aten._local_scalar_dense, aten.set_, aten.resize_}


# ---- the mode --------------------------------------------------------------------------------------------------

_active: list = []


def active_local_mode():
    """The innermost active ``LocalOpMode`` (None outside)."""
    return _active[-1] if _active else None


class LocalOpMode(TorchDispatchMode):
    """Observe the local kernels under ShardTensor ops (see the module docstring).

    ``listeners``: objects with ``on_op(name, flops, traffic_bytes, cpu_seconds)``, told about every local op (not the
    ShardTensor ops, not collectives); ``cpu_seconds`` is this thread's CPU time inside the kernel (0 for fake
    tensors). ``fake``: a ``FakeTensorMode`` (meta simulation) or None (real tensors)."""

    def __init__(self, fake=None):
        super().__init__()
        self.fake = fake
        self.listeners: list = []
        # Meta simulation: live bytes per fake storage (its StorageImpl address) and how many tensors refer to it.
        self._storage_bytes: dict[int, int] = {}
        self._storage_refs: dict[int, int] = defaultdict(int)
        self.live_bytes = 0
        self.peak_live_bytes = 0

    # -- enter/exit keep a Python-side stack so accounting can find the mode without walking torch's
    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _active.remove(self)

    def reset_peak(self):
        self.peak_live_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if any(_C.is_shard_tensor(t) for t in tensors):
            # The library's kernel, with this mode back on the stack for the local ops it issues.
            args, kwargs = _scalars_as_tensors(func, args, kwargs)
            _push_on_torch_dispatch_stack(self)
            try:
                return func.redispatch(_SHARD_KEYS, *args, **kwargs)
            finally:
                _pop_torch_dispatch_stack(None)
        if func.namespace in ("c10d", "_c10d_functional"):
            # Collectives: the process group's work (none under the fake group; fake tensors stay fake). Counted by
            # the library's CommCounter, not here.
            return func(*args, **kwargs)
        fake = self.fake
        if fake is not None and (not tensors or any(_is_fake(t) for t in tensors)):
            out = self._run_fake(func, args, kwargs)
            seconds = 0.0  # nothing computed
        else:
            # This thread's CPU time inside the kernel alone (the mode's own bookkeeping stays outside): the local
            # compute a simulated rank and a real one are compared on (benchmarks/scaling/validate_sim.py).
            c0 = time.thread_time()
            out = func(*args, **kwargs)
            seconds = time.thread_time() - c0
        if self.listeners:
            flops, traffic = local_flops(func, args, kwargs, out), _traffic_bytes(func, args, kwargs, out)
            name = str(func.overloadpacket.__name__)
            for listener in self.listeners:
                listener.on_op(name, flops, traffic, seconds)
        return out

    def _run_fake(self, func, args, kwargs):
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
        try:
            with self.fake:
                out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise SimulationError(
                f"{func}: reads tensor values (.item(), bool(), equal/allclose, nonzero, masked indexing, a "
                "data-dependent shape), which the meta simulation (device='meta') does not have. Simulate with "
                "device='cpu' (real local tensors, garbage values) at a size that fits, or keep the value out of the "
                f"simulated step. ({type(e).__name__})") from None
        for t in tree_leaves(out):
            if _is_fake(t):
                self._track(t)
        return out

    def _track(self, t):
        """Count a fake output's storage once; subtract it when the last tensor viewing it dies."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._storage_bytes:
            nbytes = storage.nbytes()
            self._storage_bytes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        self._storage_refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        self._storage_refs[key] -= 1
        if self._storage_refs[key] == 0:
            del self._storage_refs[key]
            self.live_bytes -= self._storage_bytes.pop(key)


def _scalar_tensor(v):
    """A 0-d tensor standing for a Python number where the schema wants a Tensor. The dispatcher wrapped it
    (a "wrapped number") and the Python mode unwrapped it again; redispatching boxed needs a tensor. Its dtype is
    the one a wrapped number takes (default float dtype, int64, bool, default complex), and 0-d tensors promote
    like wrapped numbers against tensors with dims, so results keep the dtypes of the plain call."""
    if isinstance(v, bool):
        return torch.scalar_tensor(v, dtype=torch.bool)
    if isinstance(v, int):
        return torch.scalar_tensor(v, dtype=torch.int64)
    if isinstance(v, complex):
        return torch.tensor(v, dtype=torch.complex64 if torch.get_default_dtype() == torch.float32 else torch.complex128)
    return torch.scalar_tensor(v, dtype=torch.get_default_dtype())


def _scalars_as_tensors(func, args, kwargs):
    schema = func._schema.arguments
    if not any(isinstance(a, (int, float, complex)) for a in list(args) + list(kwargs.values())):
        return args, kwargs
    args = list(args)
    for i, a in enumerate(args):
        if i < len(schema) and isinstance(a, (int, float, complex)) and _is_tensor_type(schema[i].type):
            args[i] = _scalar_tensor(a)
    names = {arg.name: arg for arg in schema}
    kwargs = {k: (_scalar_tensor(v) if isinstance(v, (int, float, complex)) and k in names
                  and _is_tensor_type(names[k].type) else v) for k, v in kwargs.items()}
    return tuple(args), kwargs


def _is_tensor_type(t) -> bool:
    return isinstance(t, torch.TensorType) or (isinstance(t, torch.OptionalType)
                                               and isinstance(t.getElementType(), torch.TensorType))


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)
