"""The traced representation of a ShardTensor: a Python wrapper subclass that exists only while torch.compile traces.

A ShardTensor is a storage-less C++ TensorImpl, which Dynamo cannot fakeify. At the boundary of a compiled callable
(``compile_entry``) each ShardTensor argument becomes a ``TracedShard``: a traceable wrapper subclass whose inner
tensor is the local shard and whose flatten context is the layout as a hashable tuple of literals (mesh id,
placements, extents, global shape). Dynamo fakeifies the inner tensor; AOTAutograd traces the joint graph on it.

Every aten op reaching a ``TracedShard`` (``__torch_dispatch__``) re-enters the library's C++ rules — there is no second
implementation of any rule: transient C++ ShardTensors are built around the (fake or functional) local tensors and
the op is dispatched to the ShardTensor slot under ``_RuleMode``, a dispatch mode pushed on top of the tracer's modes.
It sends ops whose arguments are ShardTensors (the op itself, and ops the rules issue on ShardTensors) to the slot,
and passes every op on local tensors to the modes below (fake, functional, proxy), which record them. Collectives
inside the rules take the functional path while tracing (src/comm/functional.h), so the graph holds
``_c10d_functional`` nodes. Results are wrapped back into ``TracedShard``s; at the exit of the compiled callable they
become C++ ShardTensors again.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from . import _C
from .placement import from_wire, to_wire

_meshes: dict = {}          # mesh id -> C++ mesh (layouts carry the id: a literal)
_SLOT = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


def _layout_of(x: torch.Tensor) -> tuple:
    """The hashable, picklable layout of a C++ ShardTensor: (mesh id, wire placements, extents, global shape)."""
    mesh = _C.mesh_of(x)
    _meshes[mesh.id] = mesh
    shapes = _C.sharding_shapes(x)
    return (mesh.id, tuple(tuple(p) for p in to_wire(_placements(x))),
            tuple(sorted((int(k), tuple(int(e) for e in v)) for k, v in shapes.items())), tuple(x.shape))


def _placements(x):
    return from_wire(_C.placements(x))


def _to_cpp(local: torch.Tensor, layout: tuple) -> torch.Tensor:
    mesh_id, wire, extents, global_shape = layout
    return _C._wrap_local(local, _meshes[mesh_id], [tuple(p) for p in wire], {k: list(v) for k, v in extents},
                          list(global_shape))


class TracedShard(torch.Tensor):
    """A ShardTensor while torch.compile traces: inner tensor ``_local`` (this rank's shard), context ``_layout``."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: tuple, requires_grad: bool = False):
        shape = layout[3]
        strides = torch._prims_common.make_contiguous_strides_for(shape) if shape else ()
        t = torch.Tensor._make_wrapper_subclass(cls, shape, strides=strides, dtype=local.dtype, device=local.device,
                                                requires_grad=requires_grad)
        t._local = local
        t._layout = layout
        return t

    def __repr__(self):
        return f"TracedShard(layout={self._layout}, local={self._local!r})"

    def __tensor_flatten__(self):
        return ["_local"], self._layout

    @staticmethod
    def __tensor_unflatten__(inner, layout, outer_size, outer_stride):
        return TracedShard(inner["_local"], layout)

    __torch_function__ = torch._C._disabled_torch_function_impl

    # Never traced by Dynamo: after a graph break the op runs eagerly on the TracedShard, and Dynamo would otherwise
    # compile this frame too and fail fakeifying the transient C++ ShardTensors (hiding the op's real error).
    @classmethod
    @torch.compiler.disable
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unwrap = lambda t: _to_cpp(t._local, t._layout) if isinstance(t, TracedShard) else t  # noqa: E731
        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        # The Python dispatcher (on while Dynamo fakeifies inputs and AOT traces) resolves kernels in Python and has
        # none for the ShardTensor key; the C++ dispatcher does.
        with torch._C._DisablePythonDispatcher(), _RuleMode():
            out = func(*args, **kwargs)
        return tree_map(_to_traced, out)

    # The gradient of a Partial output is complete: tangents are traced as Replicate on those mesh dims (as DTensor
    # does), and _FromTraced.backward brings every runtime gradient to exactly the traced tangent's layout.
    def __coerce_tangent_metadata__(self):
        want = _tangent_layout(self._layout)
        if want == self._layout:
            return self
        with torch._C._DisablePythonDispatcher(), _RuleMode():
            cpp = _C.redistribute(_to_cpp(self._local, self._layout), [tuple(p) for p in want[1]], dict(want[2]))
        return _to_traced(cpp)

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        if expected_type not in (None, TracedShard):
            return None
        return self if flatten_spec is None or flatten_spec[1] == self._layout else None


def _to_traced(t):
    if isinstance(t, torch.Tensor) and _C.is_shard_tensor(t):
        return TracedShard(_C._local_of(t), _layout_of(t))
    return t


def _has_cpp_shard(args, kwargs) -> bool:
    return any(isinstance(t, torch.Tensor) and not isinstance(t, TracedShard) and _C.is_shard_tensor(t)
               for t in tree_leaves((args, kwargs)))


class _RuleMode(TorchDispatchMode):
    """On top of the tracer's modes while a rule runs: ShardTensor ops to the ShardTensor slot (with this mode
    active again for the rule's own nested ops), local ops to the modes below."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _has_cpp_shard(args, kwargs):
            with self:
                return func.redispatch(_SLOT, *args, **kwargs)
        return func(*args, **kwargs)


class _ToTraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.layout = _layout_of(x)
        return TracedShard(_C._local_of(x), ctx.layout)

    @staticmethod
    def backward(ctx, g):
        if isinstance(g, TracedShard):
            return _to_cpp(g._local, g._layout)
        return g


def _tangent_layout(layout: tuple) -> tuple:
    """``layout`` with its Partial placements made Replicate (the layout of a complete gradient)."""
    mesh_id, wire, extents, shape = layout
    return (mesh_id, tuple((0, -1, "") if p[0] == 2 else tuple(p) for p in wire), extents, shape)


def _as_layout(g: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The C++ ShardTensor (or plain full tensor) ``g`` redistributed to ``layout`` (decided from the layouts alone,
    alike on every rank)."""
    mesh_id, wire, extents, shape = layout
    placements, shapes = [tuple(p) for p in wire], {k: list(v) for k, v in extents}
    if not _C.is_shard_tensor(g):
        return _C.distribute_tensor(g, _meshes[mesh_id], placements, shapes)
    if _layout_of(g) == layout:
        return g
    return _C.redistribute(g, placements, shapes)


class _FromTraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        ctx.tangent_layout = _tangent_layout(t._layout)
        return _to_cpp(t._local, t._layout)

    @staticmethod
    def backward(ctx, g):
        if not isinstance(g, torch.Tensor):
            return g
        g = _as_layout(g, ctx.tangent_layout)
        return TracedShard(_C._local_of(g), ctx.tangent_layout)


def to_traced(x):
    """A C++ ShardTensor as its traced representation (differentiable); other values unchanged."""
    if isinstance(x, torch.Tensor) and not isinstance(x, TracedShard) and _C.is_shard_tensor(x):
        return _ToTraced.apply(x)
    return x


def from_traced(t):
    """A traced representation back to its C++ ShardTensor (differentiable); other values unchanged."""
    if isinstance(t, TracedShard):
        return _FromTraced.apply(t)
    return t


# Plain tensors that require grad (module parameters, plain arguments) get their gradient from the compiled backward
# as a TracedShard (Replicate, or Partial when the reduction over the sharded dims is still pending); a hook turns it
# into the plain single-device gradient before it accumulates (a collective for a Partial one, in backward order,
# alike on every rank).
_HOOKED = "_shardtensor_plain_grad_hook"


def _plain_grad(g):
    if isinstance(g, TracedShard):
        return _C.full_tensor(_to_cpp(g._local, g._layout))
    return g


def _hook_plain_grads(tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad and not isinstance(t, TracedShard) and \
                not _C.is_shard_tensor(t) and not getattr(t, _HOOKED, False):
            t.register_hook(_plain_grad)
            setattr(t, _HOOKED, True)


def _enter(args, kwargs):
    _hook_plain_grads(tree_leaves((args, kwargs)))
    return tree_map(to_traced, args), tree_map(to_traced, kwargs)


def compile_entry(compiled):
    """Wrap a compiled callable: ShardTensor arguments enter as TracedShards, TracedShard results leave as
    ShardTensors. Calls without ShardTensor arguments pass straight through."""
    @functools.wraps(compiled)
    def call(*args, **kwargs):
        if not _has_cpp_shard(args, kwargs):
            return compiled(*args, **kwargs)
        args, kwargs = _enter(args, kwargs)
        return tree_map(from_traced, compiled(*args, **kwargs))
    return call


def install() -> None:
    """Make ``torch.compile(model)(x)`` and ``torch.compile(fn)(x)`` take ShardTensors (once per process): compiled
    modules (``OptimizedModule.__call__``) and compiled functions (what ``OptimizeContext`` returns) convert at their
    boundary. Nothing changes for calls without ShardTensor arguments."""
    from torch._dynamo import eval_frame
    module_call = eval_frame.OptimizedModule.__call__
    if not getattr(module_call, "_shardtensor", False):
        @functools.wraps(module_call)
        def optimized_module_call(self, *args, **kwargs):
            if not _has_cpp_shard(args, kwargs):
                return module_call(self, *args, **kwargs)
            _hook_plain_grads(self._orig_mod.parameters())
            args, kwargs = _enter(args, kwargs)
            return tree_map(from_traced, module_call(self, *args, **kwargs))
        optimized_module_call._shardtensor = True
        eval_frame.OptimizedModule.__call__ = optimized_module_call
    optimize_call = eval_frame.OptimizeContext.__call__
    if not getattr(optimize_call, "_shardtensor", False):
        @functools.wraps(optimize_call)
        def optimize_context_call(self, fn):
            compiled = optimize_call(self, fn)
            if isinstance(compiled, torch.nn.Module) or not callable(compiled):
                return compiled
            return compile_entry(compiled)
        optimize_context_call._shardtensor = True
        eval_frame.OptimizeContext.__call__ = optimize_context_call
