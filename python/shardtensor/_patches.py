"""Every change ``import shardtensor`` makes to torch, in one table: where, what, why, and whether the target is a
torch internal. ``install()`` (called once, at the end of the package's import) is the only code that applies them;
``tests/python/test_patches.py`` checks that what import changes in torch is exactly this table.

The library's own C++ kernels on the ShardTensor dispatch keys are registrations, not patches: the dispatcher
offers those keys to out-of-tree backends. Everything below replaces or adds a Python attribute that torch owns.

Torch versions: the table was tested with ``TESTED_TORCH``. The compiled module is built against one torch and
cannot load into another, so ``check_torch()`` runs first, before ``_C`` is imported: on another torch it raises
ImportError naming the build's torch and the patches at risk (``SHARDTENSOR_ALLOW_UNTESTED_TORCH=1`` turns the
minor-version mismatch into a warning; a binary built for another torch is always refused).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import types
import warnings
from typing import Any, Callable, Optional

import torch

TESTED_TORCH = ("2.11",)


@dataclasses.dataclass(frozen=True)
class Patch:
    owner: str                      # dotted path of the object patched, e.g. "torch.Tensor"
    name: str                       # the attribute set on it
    why: str
    build: Callable[[Any], Any]     # the value to install, given torch's own (None when torch has none)
    private: bool = False           # the owner is a torch internal, with no compatibility promise
    optional: bool = False          # the owner may be absent from a torch build (then skipped)

    @property
    def target(self) -> str:
        return f"{self.owner}.{self.name}"


def _torch_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_torch() -> None:
    """Refuse (or, with SHARDTENSOR_ALLOW_UNTESTED_TORCH=1, warn about) a torch the library was not built and
    tested with. Runs before the compiled module loads, whose failure would otherwise be an undefined symbol."""
    running = torch.__version__
    try:
        from ._build_info import TORCH_VERSION as built
    except ImportError:  # a tree that was never built: the import of _C says so
        built = None
    if built is not None and built.split("+")[0] != running.split("+")[0]:
        raise ImportError(f"shardtensor was built against torch {built} but this Python has torch {running}: rebuild "
                          "it against this torch (`make build`, or `pip install --no-build-isolation .`)")
    if _torch_minor(running) in TESTED_TORCH:
        return
    private = ", ".join(p.target for p in PATCHES if p.private)
    message = (f"shardtensor was tested with torch {' / '.join(TESTED_TORCH)}, this is torch {running}; the patches "
               f"to torch internals may no longer fit: {private} (python/shardtensor/_patches.py lists them all)")
    if os.environ.get("SHARDTENSOR_ALLOW_UNTESTED_TORCH") == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise ImportError(message + "; set SHARDTENSOR_ALLOW_UNTESTED_TORCH=1 to proceed anyway")


# ---- the builders ----

def _api():
    import shardtensor
    return shardtensor


def _shard_method(fn_name: str):
    """A method of ShardTensors only: on a plain tensor the attribute lookup itself raises NotAShardTensorError (a
    TypeError and an AttributeError), so DTensor-style duck typing (``hasattr(t, "full_tensor")``) stays False."""
    def build(_original):
        api = _api()
        fn = getattr(api, fn_name)

        def getter(self):
            api._check(self, fn_name)
            return types.MethodType(fn, self)

        return property(getter, doc=fn.__doc__)
    return build


def _shard_property(fn_name: str):
    def build(_original):
        return property(getattr(_api(), fn_name))
    return build


def _soft_attribute(name: str, on_shard: Callable[[Any], Any]):
    """An attribute that exists only on ShardTensors (``on_shard(self)``). Other tensors keep any attribute of that
    name they set themselves (in their ``__dict__``: torch's DTensor decompositions set ``_spec`` on plain meta
    tensors); without one, reading it raises NotAShardTensorError, an AttributeError, so ``hasattr`` is False."""
    def build(_original):
        from . import _C
        from .compat import NotAShardTensorError

        def getter(self):
            if _C.is_shard_tensor(self):
                return on_shard(self)
            own = self.__dict__
            if name in own:
                return own[name]
            raise NotAShardTensorError(f"{name}: expected a ShardTensor, got a plain tensor (a ShardTensor/PhysicsNeMo "
                                       "attribute)")

        def setter(self, value):
            if _C.is_shard_tensor(self):
                raise AttributeError(f"ShardTensor.{name} is read-only")
            self.__dict__[name] = value

        def deleter(self):
            if name not in self.__dict__:
                raise AttributeError(name)
            del self.__dict__[name]

        return property(getter, setter, deleter)
    return build


def _spec_of(x):
    from .compat.spec_view import spec_of
    return spec_of(x)


def _offsets_of(x):
    from .compat.spec_view import mesh_dim_offsets
    return types.MethodType(mesh_dim_offsets, x)


def _local_tensor_hint(_x):
    raise AttributeError("ShardTensor has no _local_tensor (a DTensor/PhysicsNeMo field): use x.to_local() (this "
                         "rank's shard, differentiable) or st.to_local(x)")


def _on_shards(original: Callable, on_shard: Callable) -> Callable:
    """torch's method, except on ShardTensors, where ``on_shard`` answers."""
    from . import _C

    def method(self, *args, **kwargs):
        if _C.is_shard_tensor(self):
            return on_shard(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    method.__name__ = original.__name__
    method.__doc__ = original.__doc__
    return method


def _repr(original):
    from . import _C
    # Never communicates: printing on one rank must not hang the others.
    return _on_shards(original, lambda self, *a, **k: _C.shard_repr(self))


def _reduce_ex(original):
    def refuse(self, protocol):
        raise TypeError("a ShardTensor cannot be pickled or saved directly: save x.full_tensor() (the whole tensor, a "
                        "collective) or x.to_local() with its placements and sharding_shapes")
    return _on_shards(original, refuse)


def _refuse_host_access(name: str, values: bool = False):
    """Host views of the data need one buffer holding the whole tensor; a ShardTensor's wrapper has no storage.
    ``values``: an op that reads values (``tolist``, ``numpy``) answers where no shard stands in the way -- every
    placement ``Replicate`` (each rank's local tensor is the whole tensor: no communication), or one element (a
    collective where the element is sharded or a pending sum, as ``item()`` is: call it on every rank)."""
    def build(original):
        def refuse(self, *args, **kwargs):
            if values:
                if all(p.is_replicate() for p in self.placements):
                    return original(self.to_local(), *args, **kwargs)
                if self.numel() == 1:
                    return original(self.full_tensor(), *args, **kwargs)
            raise _api().ShardTensorHostAccessError(
                f"ShardTensor.{name}(): a ShardTensor has no single buffer (each rank holds a shard); use "
                f"x.full_tensor().{name}() for the whole tensor (a collective: call it on every rank) or "
                f"x.to_local().{name}() for this rank's shard")
        return _on_shards(original, refuse)
    return build


def _deepcopy(original):
    def copy(self, memo):
        out = self.detach().clone().requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out
    return _on_shards(original, copy)


def _dcp_method(fn_name: str):
    """torch.distributed.checkpoint asks a tensor for these protocol methods; only ShardTensors have them."""
    def build(_original):
        from . import _C, checkpoint
        fn = getattr(checkpoint, fn_name)

        def get(self):
            if not _C.is_shard_tensor(self):
                raise AttributeError(fn_name)
            return fn.__get__(self)
        return property(get)
    return build


def _data_parallel(builder_name: str):
    def build(original):
        from . import data_parallel
        return getattr(data_parallel, builder_name)(original)
    return build


def _rnn_forward(original):
    from . import rnn
    return rnn.routed_forward(original)


def _traced(builder_name: str):
    def build(original):
        from . import _traced
        return getattr(_traced, builder_name)(original)
    return build


# c10d collectives take plain tensors: a ShardTensor reaching one (a model's own data-parallel all_reduce, as in
# MONAI's VectorQuantizer with ddp_sync) failed deep in c10d with "No backend type associated with device type
# privateuseone".
_C10D_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
                     "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "gather", "send", "recv",
                     "isend", "irecv")


def _holds_shard_tensor(value) -> bool:
    from . import _C
    if isinstance(value, torch.Tensor):
        return _C.is_shard_tensor(value)
    if isinstance(value, (list, tuple)):
        return any(_holds_shard_tensor(v) for v in value)
    return False


def _refuse_shard_tensors(name: str):
    def build(original):
        @functools.wraps(original)
        def collective(*args, **kwargs):
            if any(_holds_shard_tensor(a) for a in args) or any(_holds_shard_tensor(v) for v in kwargs.values()):
                raise ValueError(
                    f"torch.distributed.{name} got a ShardTensor: c10d collectives move plain per-process tensors, "
                    "while a ShardTensor already stands for one global value over its mesh (a pending sum is "
                    "completed by the op that reads it). Pass x.full_tensor() (the whole value on every rank, a "
                    "collective) or x.to_local() (this rank's shard); a model's data-parallel synchronisation (e.g. "
                    "MONAI VectorQuantizer's ddp_sync) is not needed over the domain mesh: turn it off")
            return original(*args, **kwargs)
        return collective
    return build


# The sparse constructors: a sparse tensor is built of plain index and value tensors (its kernels read their data).
_SPARSE_CONSTRUCTORS = ("sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor",
                        "sparse_bsc_tensor", "sparse_compressed_tensor")


def _whole_sparse_parts(original):
    """A sparse tensor of ShardTensor indices or values (PyG's GraphUNet builds its adjacency from edge weights made
    by ``x.new_ones(E)``, a ShardTensor like x) is built of their whole values (``full_tensor``: free for replicated
    ones, a gather for split ones; differentiable) and is a plain sparse tensor; before, the ShardTensor was stored
    inside the sparse tensor and its first kernel failed ("Cannot access data pointer of Tensor that doesn't have
    storage"). Plain arguments pass through untouched."""
    @functools.wraps(original)
    def construct(*args, **kwargs):
        if any(_holds_shard_tensor(a) for a in args) or any(_holds_shard_tensor(v) for v in kwargs.values()):
            from . import full_tensor

            def whole(v):
                return full_tensor(v) if isinstance(v, torch.Tensor) and _holds_shard_tensor(v) else v
            args = tuple(whole(a) for a in args)
            kwargs = {k: whole(v) for k, v in kwargs.items()}
        return original(*args, **kwargs)
    return construct


def _plain_gradient_backward(backward):
    """A Function's ``backward`` whose gradients for the plain tensors it was applied to (positions recorded on the
    context by ``_promoting_apply``) come back plain: a ShardTensor gradient there is turned into its whole value
    (a pending sum all-reduced, a split one gathered: one collective, issued alike on every rank, since every rank
    runs the same backward)."""
    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        out = backward(ctx, *grads)
        plain = getattr(ctx, "_shardtensor_plain_inputs", None)
        if not plain:
            return out
        from . import _C
        single = not isinstance(out, tuple)
        items = [out] if single else list(out)
        for i in plain:
            if i < len(items) and isinstance(items[i], torch.Tensor) and _C.is_shard_tensor(items[i]):
                items[i] = items[i].full_tensor()
        return items[0] if single else tuple(items)
    wrapped._shardtensor_plain_gradients = True
    return wrapped


def _promoting_apply(original):
    """``torch.autograd.Function.apply`` for a Function given ShardTensors and plain tensors that require grad: the
    gradients its backward computes for the plain ones are ShardTensors (pending sums, replicas), which would land in
    a plain parameter's ``.grad`` (torch-harmonics' DISCO convolution takes its weight through a Function). The
    Function is applied to its arguments unchanged -- an adjoint method (torchdiffeq's ``odeint_adjoint``) passes
    the model's parameters only to name what its backward differentiates with ``torch.autograd.grad``, so a
    stand-in (a promoted copy, as this patch once passed) is unused there and its gradient silently zero -- and the
    class's ``backward`` turns those positions' ShardTensor gradients into plain whole values. torch's own Functions
    (DDP's output sink, FSDP's hooks, reentrant checkpointing) pass tensors through and are left alone."""
    func = original.__func__

    @functools.wraps(func)
    def apply(cls, *args, **kwargs):
        if not (args and torch.is_grad_enabled() and not cls.__module__.startswith("torch.")):
            return func(cls, *args, **kwargs)
        from . import _C
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        plain = [i for i, a in tensors if a.requires_grad and not _C.is_shard_tensor(a)]
        if not plain or not any(_C.is_shard_tensor(a) for _, a in tensors):
            return func(cls, *args, **kwargs)
        # The method autograd calls (BackwardCFunction.apply): `vjp` where the class defines it, else `backward`.
        name = "vjp" if cls.vjp is not torch.autograd.Function.vjp else "backward"
        user_fn = getattr(cls, name)    # the staticmethod's function, wherever in the class's bases it is defined
        if user_fn is not getattr(torch.autograd.Function, name) and \
                not getattr(user_fn, "_shardtensor_plain_gradients", False):
            setattr(cls, name, staticmethod(_plain_gradient_backward(user_fn)))
        out = func(cls, *args, **kwargs)
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and o.grad_fn is not None:
                try:
                    o.grad_fn._shardtensor_plain_inputs = plain   # the context the backward receives
                except AttributeError:
                    pass    # a node that takes no attributes (not a Python Function's context): nothing to mark
                break
        return out
    return classmethod(apply)


_TENSOR = "torch.Tensor"
_NEW = "a ShardTensor-only method (DTensor's name), absent from plain tensors"

PATCHES: tuple[Patch, ...] = (
    Patch(_TENSOR, "full_tensor", _NEW, _shard_method("full_tensor")),
    Patch(_TENSOR, "to_local", _NEW, _shard_method("to_local")),
    Patch(_TENSOR, "redistribute", _NEW, _shard_method("redistribute")),
    Patch(_TENSOR, "placements", "x.placements on ShardTensors (DTensor's name)", _shard_property("placements")),
    Patch(_TENSOR, "device_mesh", "x.device_mesh on ShardTensors (DTensor's name)", _shard_property("device_mesh")),
    Patch(_TENSOR, "sharding_shapes", "x.sharding_shapes on ShardTensors", _shard_property("sharding_shapes")),
    Patch(_TENSOR, "_spec", "PhysicsNeMo's x._spec (a read-only view); plain tensors keep their own",
          _soft_attribute("_spec", _spec_of)),
    Patch(_TENSOR, "offsets", "PhysicsNeMo's x.offsets()", _soft_attribute("offsets", _offsets_of)),
    Patch(_TENSOR, "_local_tensor", "DTensor's field: says to use x.to_local()",
          _soft_attribute("_local_tensor", _local_tensor_hint)),
    Patch(_TENSOR, "__repr__", "repr(x) of a ShardTensor shows the layout and never communicates", _repr),
    Patch(_TENSOR, "__reduce_ex__", "pickling a ShardTensor raises, naming full_tensor()/to_local()", _reduce_ex),
    Patch(_TENSOR, "tolist", "a ShardTensor has no single buffer: replicated or one element, else a clear error",
          _refuse_host_access("tolist", values=True)),
    Patch(_TENSOR, "numpy", "a ShardTensor has no single buffer: replicated or one element, else a clear error",
          _refuse_host_access("numpy", values=True)),
    Patch(_TENSOR, "data_ptr", "a ShardTensor has no single buffer: a clear error", _refuse_host_access("data_ptr")),
    Patch(_TENSOR, "__deepcopy__", "copy.deepcopy of a ShardTensor (a module with sharded parameters) clones it",
          _deepcopy),
    Patch(_TENSOR, "__create_write_items__", "torch.distributed.checkpoint saves each rank's shard",
          _dcp_method("create_write_items")),
    Patch(_TENSOR, "__create_chunk_list__", "torch.distributed.checkpoint loads into each rank's shard",
          _dcp_method("create_chunk_list")),
    Patch(_TENSOR, "__get_tensor_shard__", "torch.distributed.checkpoint reads each rank's shard",
          _dcp_method("get_tensor_shard")),
    Patch("torch.nn.parallel.DistributedDataParallel", "__init__",
          "DDP over a data mesh axis localizes ShardTensor parameters of the module it wraps",
          _data_parallel("localizing_init")),
    Patch("torch.distributed.fsdp.FullyShardedDataParallel", "__init__",
          "FSDP1 localizes ShardTensor parameters of the module it wraps", _data_parallel("localizing_init"),
          optional=True),
    Patch("torch.distributed.fsdp._fully_shard._fully_shard", "_get_modules_and_states",
          "FSDP2's fully_shard (and the composable replicate) localize ShardTensor parameters before collecting them",
          _data_parallel("localizing_get_modules_and_states"), private=True, optional=True),
    Patch("torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup", "post_backward",
          "FSDP2 reads .grad in its post-backward, mid-backward: pending gradient-bucket reductions complete first",
          _data_parallel("waiting_post_backward"), private=True, optional=True),
    Patch("torch._dynamo.eval_frame.OptimizedModule", "__call__",
          "torch.compile(model)(x): ShardTensor arguments enter compiled code as TracedShards",
          _traced("wrap_optimized_module_call"), private=True),
    Patch("torch._functorch._aot_autograd.runtime_wrappers.AOTDispatchAutograd", "process_runtime_tangent",
          "torch.compile: the plain zeros autograd gives a compiled graph's ShardTensor output that took no part in the "
          "loss become a ShardTensor gradient of the traced layout (AOTAutograd raised: tangent metadata guessed wrong)",
          _traced("materialized_tangent"), private=True),
    Patch("torch._dynamo.eval_frame.OptimizeContext", "__call__",
          "torch.compile(fn)(x): the compiled function converts ShardTensor arguments at its boundary",
          _traced("wrap_optimize_context_call"), private=True),
    *(Patch(f"torch.nn.{cls}", "forward", f"nn.{cls} on a ShardTensor sequence: each rank runs its own rows (batch "
            "split), or the ranks relay the state along a time split, instead of gathering every gate op by op "
            "(shardtensor/rnn.py)", _rnn_forward) for cls in ("RNN", "LSTM", "GRU")),
    Patch("torch.autograd.Function", "apply",
          "a Function taking ShardTensors and plain tensors that require grad: the gradients its backward returns for "
          "the plain ones are made plain (whole values), so plain parameters receive plain gradients",
          _promoting_apply),
    *(Patch("torch.distributed", name, "a ShardTensor passed to a c10d collective: a clear error naming the remedy",
            _refuse_shard_tensors(name)) for name in _C10D_COLLECTIVES),
    *(Patch("torch", name, "a sparse tensor built of ShardTensor indices or values holds their whole values (plain)",
            _whole_sparse_parts) for name in _SPARSE_CONSTRUCTORS),
)

# The one patch that is not an attribute: Python kernels at AutogradCPU/AutogradCUDA of the ops whose rules run
# above autograd, which only the tracers' Python dispatcher runs (eager code never sees them).
AUTOGRAD_BRIDGE = ("torch.ops (the rules above autograd: _C.rules_above_autograd())",
                   "py_kernels[AutogradCPU, AutogradCUDA]",
                   "torch.compile traces SDPA, linear, batch_norm, ... on TracedShards through the C++ rules")

_installed: dict[str, Any] = {}     # target -> the value install() set (absent: skipped, the owner is missing)


def _resolve(path: str) -> Optional[Any]:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def install() -> None:
    """Apply every patch of the table (once per process)."""
    if _installed:
        return
    for patch in PATCHES:
        owner = _resolve(patch.owner)
        if owner is None:
            if patch.optional:
                continue
            raise ImportError(f"shardtensor: {patch.owner} is missing from torch {torch.__version__}, so "
                              f"{patch.target} cannot be patched ({patch.why})")
        current = owner.__dict__.get(patch.name, getattr(owner, patch.name, None))
        if getattr(current, "_shardtensor_patch", None) == patch.target:  # a reloaded package: already patched
            _installed[patch.target] = current
            continue
        value = patch.build(current)
        try:
            value._shardtensor_patch = patch.target
        except AttributeError:  # a property: it cannot carry the mark, and a second install wraps nothing
            pass
        setattr(owner, patch.name, value)
        _installed[patch.target] = value
    from . import _traced
    _traced.install_autograd_bridge()


def installed() -> dict[str, bool]:
    """``{target: whether torch holds the value install() set}`` for every patch that was applied."""
    out = {}
    for patch in PATCHES:
        if patch.target in _installed:
            owner = _resolve(patch.owner)
            out[patch.target] = owner is not None and owner.__dict__.get(patch.name) is _installed[patch.target]
    return out
