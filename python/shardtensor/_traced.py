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

import contextlib
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
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
        cargs, ckwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if not _recording(args, kwargs):
            # A frame of compiled code that runs eagerly (Dynamo skipped it: a graph break in a loop, the recompile
            # limit): the locals are real, and the C++ rules run exactly as on ShardTensors -- their write-back of
            # select copies included (keyed by the local's buffer, which the wrapper shares). No graph, so no ties
            # (they would replace an output's buffer on ranks with an empty shard only, making aliasing and the
            # C++ write-back differ between ranks) and no second, Python write-back.
            with _rules_running():
                return tree_map(_to_traced, func(*cargs, **ckwargs))
        written = _written_select_copies(func, args, kwargs)
        source = _select_source(func, args)
        view_root = None
        if source is None and func.is_view:
            view_root = next((r for r in map(_copy_root, tree_leaves((args, kwargs))) if r is not None), None)
        # The Python dispatcher (on while Dynamo fakeifies inputs and AOT traces) resolves kernels in Python and has
        # none for the ShardTensor key; the C++ dispatcher does.
        with _rules_running(), _RuleBoundary(_locals_of((cargs, ckwargs))) as rule:
            out = rule.tie(func(*cargs, **ckwargs))
        out = tree_map(_to_traced, out)
        if source is not None:
            base, dim, index = source
            for t in tree_leaves(out):
                if isinstance(t, TracedShard):
                    t._select_source = (base, dim, index)
        elif _unbinds_split_dim(func, args):
            base, dim = args[0], (args[1] if len(args) > 1 else 0) % args[0].dim()
            for index, t in enumerate(out):     # each output is x.select(dim, index): carried home alike
                t._select_source = (base, dim, index)
        elif view_root is not None:
            for t in tree_leaves(out):
                if isinstance(t, TracedShard):
                    t._select_root = view_root
        for root in written:
            _write_back(root)
        return out

    # The gradient of a Partial output is complete: tangents are traced as Replicate on those mesh dims (as DTensor
    # does), and _FromTraced.backward brings every runtime gradient to exactly the traced tangent's layout.
    def __coerce_tangent_metadata__(self):
        want = _tangent_layout(self._layout)
        if want == self._layout:
            return self
        with _rules_running(), _RuleBoundary([self._local]) as rule:
            cpp = rule.tie(
                _C.redistribute(_to_cpp(self._local, self._layout), [tuple(p) for p in want[1]], dict(want[2])))
        return _to_traced(cpp)

    # A runtime gradient in another layout than the traced tangent (it comes from code that ran eagerly: a skipped
    # frame, a graph break) is redistributed to it: the layouts are global, so every rank moves alike.
    def __coerce_same_metadata_as_tangent__(self, expected_layout, expected_type=None):
        if expected_type not in (None, TracedShard):
            return None
        if expected_layout is None or expected_layout == self._layout:
            return self
        if not isinstance(expected_layout, tuple) or len(expected_layout) != 4 or \
                expected_layout[0] != self._layout[0] or tuple(expected_layout[3]) != tuple(self._layout[3]):
            return None
        with _rules_running():
            return _to_traced(_as_layout(_to_cpp(self._local, self._layout), expected_layout))


def _recording(args, kwargs) -> bool:
    """True while a tracer records the op (a local is a fake or functional tensor); False where the locals are real
    tensors: compiled code's frame running eagerly."""
    return any(isinstance(t._local, (FakeTensor, FunctionalTensor)) or torch._is_functional_tensor(t._local)
               for t in tree_leaves((args, kwargs)) if isinstance(t, TracedShard))


def _select_source(func, args):
    """``x[i]`` along a dim a mesh dim splits: a copy on every rank (the owner's row), eagerly carried back to ``x``
    after a write into it by the library (dispatch/write_back.h), here by ``_write_back``. Returns (x, dim, index) or
    None. (unbind's outputs along such a dim are tracked alike: ``_unbinds_split_dim``.)"""
    if func.name() != "aten::select.int" or not args or not isinstance(args[0], TracedShard):
        return None
    x = args[0]
    dim = args[1] if len(args) > 1 else 0
    dim = dim % x.dim() if x.dim() else 0
    if not _split_along(x, dim):
        return None
    return x, dim, args[2] % x.shape[dim]


def _split_along(x, dim: int) -> bool:
    """Whether a mesh dim splits dim ``dim`` of the traced shard ``x`` (wire placements: (1, dim, "") is Shard)."""
    return any(kind == 1 and d == dim for kind, d, _ in x._layout[1])


def _unbinds_split_dim(func, args) -> bool:
    """``x.unbind(dim)`` along a dim a mesh dim splits (its outputs are copies of the owners' rows, as ``x[i]``)."""
    if func.name() != "aten::unbind.int" or not args or not isinstance(args[0], TracedShard) or not args[0].dim():
        return False
    return _split_along(args[0], (args[1] if len(args) > 1 else 0) % args[0].dim())


def _copy_root(t):
    """The select copy ``t`` is, or is a view of (None: neither)."""
    if getattr(t, "_select_source", None) is not None:
        return t
    return getattr(t, "_select_root", None)


def _written_select_copies(func, args, kwargs) -> list:
    """The select copies an in-place or out= op writes (directly or through a view of them)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    roots = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        root = _copy_root(args[i] if i < len(args) else kwargs.get(a.name))
        if root is not None and all(r is not root for r in roots):
            roots.append(root)
    return roots


def _write_back(root) -> None:
    """Carry a written select copy back into its row of ``x``: a write into x's one-row slice along the split dim (a
    view of each rank's own rows: only the row's owner writes, nothing communicated), recorded by the tracer as an
    in-place write into x's local tensor, as any in-place op on x is."""
    while root is not None:
        base, dim, index = root._select_source
        b, r = _to_cpp(base._local, base._layout), _to_cpp(root._local, root._layout)
        with _rules_running(), _RuleBoundary([base._local, root._local]):
            row = torch.ops.aten.slice.Tensor(b, dim, index, index + 1)
            torch.ops.aten.copy_.default(row, torch.ops.aten.unsqueeze.default(r, dim))
        root = _copy_root(base)     # x[i][j] along two split dims: the outer copy goes home too


def _zero_from(tensors):
    """A 0-dim zero that depends on each tensor (a sum over an empty slice of it: no data read)."""
    zero = None
    for t in tensors:
        if isinstance(t, torch.Tensor):
            u = t.reshape(-1)[:0]
            u = torch.view_as_real(u) if u.is_complex() else u
            term = u.sum(dtype=torch.float32)
            zero = term if zero is None else zero + term
    return zero


class _RuleBoundary:
    """Around one traced rule call (entered under _RuleMode, so the modes below record what it adds), so that each
    rank's graph keeps every collective the rule issues. AOTAutograd's partitioner drops a collective no output needs,
    and moves one that no tangent reaches into the forward graph, assuming every rank's graph alike; but on one rank
    a rule may have no use for what it receives (an empty halo, the ring blocks a rank without queries passes on), send
    what does not depend on its inputs (zero gradient blocks), or build an empty output without reading an empty input
    (which cuts the chain to the collectives upstream). So:
    - every collective's input depends on the rule's inputs (``inputs``: local tensors; src/comm/functional.h
      set_trace_anchor);
    - ``tie(out)``: the rule's first tensor output depends on every result it waited for, and, where an input or that
      output is empty on this rank, on the rule's inputs.
    Each dependency is ``+ 0`` from sums over empty slices (no data read)."""

    def __init__(self, inputs):
        self.inputs = inputs

    def __enter__(self):
        _C._take_traced_receives()      # nothing left over from an earlier rule that raised
        self.previous = _C._set_trace_anchor(self.inputs)
        return self

    def __exit__(self, *exc):
        _C._set_trace_anchor(self.previous)
        return False

    def tie(self, out):
        received = _C._take_traced_receives()
        leaves, spec = torch.utils._pytree.tree_flatten(out)
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                continue
            local = _C._local_of(t) if _C.is_shard_tensor(t) else t
            with torch.no_grad():           # a data dependency only, never a gradient path
                sources = received
                if local.numel() == 0 or any(x.numel() == 0 for x in self.inputs):
                    sources = received + self.inputs
                zero = _zero_from(sources)
            if zero is None:
                return out
            local = local + zero.to(local.dtype)
            leaves[i] = _to_cpp(local, _layout_of(t)) if _C.is_shard_tensor(t) else local
            return torch.utils._pytree.tree_unflatten(leaves, spec)
        if received:
            raise AssertionError("a traced rule received collective results but returned no tensor")
        return out


def _locals_of(values):
    """The local tensors of the (C++ ShardTensor or plain) tensors among ``values``."""
    return [_C._local_of(t) if _C.is_shard_tensor(t) else t
            for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _to_traced(t):
    if isinstance(t, torch.Tensor) and _C.is_shard_tensor(t):
        return TracedShard(_C._local_of(t), _layout_of(t))
    return t


def _has_cpp_shard(args, kwargs) -> bool:
    return any(isinstance(t, torch.Tensor) and not isinstance(t, TracedShard) and _C.is_shard_tensor(t)
               for t in tree_leaves((args, kwargs)))


class _RuleMode(TorchDispatchMode):
    """On top of the tracer's modes while a rule runs: ShardTensor ops to the ShardTensor slot (with this mode
    active again for the rule's own nested ops), local ops to the modes below -- with the Python dispatcher as the
    tracer had it (``python_dispatcher``): the rule runs without it (the C++ dispatcher resolves the ShardTensor
    key), but a fake tensor's Python meta kernels need it for their own nested ops (``lerp``'s meta broadcasts by
    ``expand``, whose C++ kernel takes concrete sizes only: a local whose size is a symbol raised "SymIntArrayRef
    expected to contain only concrete integers")."""

    def __init__(self, python_dispatcher: bool = False):
        super().__init__()
        self.python_dispatcher = python_dispatcher

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _has_cpp_shard(args, kwargs):
            with self:
                return func.redispatch(_SLOT, *args, **kwargs)
        if self.python_dispatcher:
            with torch._C._EnablePythonDispatcher():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _rules_running():
    """While a rule runs: the Python dispatcher off (it has no kernel for the ShardTensor key; the C++ dispatcher
    does) and ``_RuleMode`` on, which gives local ops the Python dispatcher back if the tracer had it on."""
    tracer_had_it = torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
    with torch._C._DisablePythonDispatcher(), _RuleMode(tracer_had_it):
        yield


class _ToTraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.layout = _layout_of(x)
        return TracedShard(_C._local_of(x), ctx.layout)

    @staticmethod
    def backward(ctx, g):
        # The input's gradient in the input's layout, as eagerly (a derivative formula may have left it Replicate,
        # e.g. sum's expand); decided from the layouts alone, alike on every rank.
        if isinstance(g, TracedShard):
            g = _to_cpp(g._local, g._layout)
        if isinstance(g, torch.Tensor):
            g = _as_layout(g, _tangent_layout(ctx.layout))
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


# Above-autograd rules (linear, matmul, scaled_dot_product_attention, batch_norm, upsample .vec, _pad_circular,
# max_pool1d, the library's custom ops, ...): eagerly a C++ ShardTensor reaches them at AutogradPrivateUse1, before
# the op decomposes. A TracedShard has no such key, and while Dynamo fake-propagates and AOTAutograd traces, the
# composite-implicit ops decompose (SDPA into _scaled_dot_product_flash_attention_for_cpu, ...) before
# TracedShard.__torch_dispatch__ sees them. Both tracers run the Python dispatcher, which takes Python kernels
# registered for an op's dispatch keys: this bridge registers one at the autograd keys of those ops. For TracedShard
# arguments it runs the op's C++ rule on transient ShardTensors with C++ autograd recording (the rule's own backward),
# wrapped in one autograd.Function whose backward runs that C++ graph; for every other call it runs the kernel the
# Python dispatcher would have run. Nothing changes outside the Python dispatcher (eager code never sees it).
_BRIDGE_KEYS = (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA)


def _op_overload(qualified: str):
    ns, rest = qualified.split("::")
    name, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload or "default")


def _to_cpp_arg(t, needs_grad: bool):
    """A transient C++ argument for the rule: a ShardTensor around a TracedShard's local, a plain tensor detached;
    a leaf requiring grad where the bridge's input does."""
    x = _to_cpp(t._local.detach(), t._layout) if isinstance(t, TracedShard) else t.detach()
    return x.requires_grad_(True) if needs_grad and (x.is_floating_point() or x.is_complex()) else x


class _AboveAutograd(torch.autograd.Function):
    """One call of an above-autograd rule on traced arguments: forward runs the rule on transient C++ ShardTensors
    (C++ autograd recording), backward differentiates that C++ graph."""

    @staticmethod
    def forward(ctx, op, rebuild, *tensors):
        cpp = [_to_cpp_arg(t, ctx.needs_input_grad[2 + i]) for i, t in enumerate(tensors)]
        args, kwargs = rebuild(cpp)
        with torch.enable_grad(), _rules_running(), \
                _RuleBoundary(_locals_of(cpp)) as rule:
            out = op(*args, **kwargs)
            tied = rule.tie(out)    # the C++ graph keeps `out`; the traced results carry the tie
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        ctx.cpp_inputs = cpp
        ctx.cpp_outputs = outs
        # No op on the C++ results here (outside _RuleMode the fake mode would see them): _to_traced only reads
        # their local tensor and layout.
        result = tree_map(_to_traced, tied)
        ctx.mark_non_differentiable(*[r for r, o in zip(tree_leaves(result), tree_leaves(out))
                                      if isinstance(o, torch.Tensor) and not o.requires_grad])
        return result

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(o, g) for o, g in zip(ctx.cpp_outputs, grads) if g is not None and o.requires_grad]
        wanted = [i for i, x in enumerate(ctx.cpp_inputs) if x.requires_grad]
        result = [None] * len(ctx.cpp_inputs)
        if pairs and wanted:
            gs = [_to_cpp(g._local, g._layout) if isinstance(g, TracedShard) else g for _, g in pairs]
            with _rules_running(), _RuleBoundary(_locals_of(gs)) as rule:
                got = torch.autograd.grad([o for o, _ in pairs], [ctx.cpp_inputs[i] for i in wanted], gs,
                                          allow_unused=True)
                got = rule.tie(list(got))
            for i, g in zip(wanted, got):
                result[i] = _to_traced(g)
        return (None, None, *result)


def _bridge_kernel(op, fallback, *args, **kwargs):
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    if not any(isinstance(t, TracedShard) for t in leaves):
        return fallback(*args, **kwargs)
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]

    def rebuild(tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        return torch.utils._pytree.tree_unflatten(filled, spec)
    return _AboveAutograd.apply(op, rebuild, *[leaves[i] for i in positions])


def install_autograd_bridge() -> None:
    """Register the bridge kernels (once per process; listed in _patches.py as AUTOGRAD_BRIDGE)."""
    from torch._ops import resolve_key
    for name in _C.rules_above_autograd():
        try:
            op = _op_overload(name)
        except AttributeError:
            continue        # an overload Python cannot name
        for key in _BRIDGE_KEYS:
            if getattr(op.py_kernels.get(key), "_shardtensor", False):
                continue
            # What the Python dispatcher runs at this key without the bridge: a Python kernel, or a C++ one.
            own = op.py_kernels.pop(key, None)
            if own is not None:
                fallback = own
            else:
                final = resolve_key(op, key)
                fallback = op.py_kernels[final] if final in op.py_kernels else functools.partial(op._op_dk, final)
            kernel = functools.partial(_bridge_kernel, op, fallback)
            kernel._shardtensor = True
            op.py_impl(key)(kernel)


# torch.compile(model)(x) and torch.compile(fn)(x) take ShardTensors: compiled modules (OptimizedModule.__call__) and
# compiled functions (what OptimizeContext returns) convert at their boundary (_patches.py installs both). Nothing
# changes for calls without ShardTensor arguments.

def materialized_tangent(original):
    """AOTAutograd's ``process_runtime_tangent``, where a graph's runtime gradient is not of the traced kind (torch's
    note "AOTAutograd Backward Guards": AOTAutograd raises then). Both cases are whole gradients, alike on every
    rank, and each is converted from the layouts alone (every rank alike):
    - plain where a traced shard's tangent was traced: the zeros autograd inserts for a graph output that took no
      part in the loss (or any plain gradient of a ShardTensor): distributed to the traced layout;
    - a traced shard where a plain tangent was traced: a plain output (computed alike on every rank, as Deformable
      DETR's query-side sampling offsets) used with ShardTensors by a later graph or eager code: made whole."""
    func = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(func)
    def process_runtime_tangent(x, meta):
        expected = getattr(meta, "original_subclass_type", None)
        if expected is TracedShard and type(x) is torch.Tensor:
            with _rules_running():
                x = _to_traced(_as_layout(x, meta.meta))
        elif expected is None and isinstance(x, TracedShard):
            with _rules_running():
                x = _C.full_tensor(_to_cpp(x._local, x._layout))
        return func(x, meta)
    return staticmethod(process_runtime_tangent)


def wrap_optimized_module_call(module_call):
    @functools.wraps(module_call)
    def optimized_module_call(self, *args, **kwargs):
        if not _has_cpp_shard(args, kwargs):
            return module_call(self, *args, **kwargs)
        _hook_plain_grads(self._orig_mod.parameters())
        args, kwargs = _enter(args, kwargs)
        return tree_map(from_traced, module_call(self, *args, **kwargs))
    return optimized_module_call


def wrap_optimize_context_call(optimize_call):
    @functools.wraps(optimize_call)
    def optimize_context_call(self, fn):
        compiled = optimize_call(self, fn)
        if isinstance(compiled, torch.nn.Module) or not callable(compiled):
            return compiled
        return compile_entry(compiled)
    return optimize_context_call
