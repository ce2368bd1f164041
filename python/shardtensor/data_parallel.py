"""Sharded parameters under the data-parallel wrappers (DDP, FSDP, FSDP2 ``fully_shard``, ``replicate``).

A ShardTensor parameter (a positional embedding partitioned over the domain like the tokens) is held by its module
as a plain ``nn.Parameter`` with this rank's shard; while the module runs, the attribute reads as the ShardTensor
built on it (``from_local`` with the recorded layout: no communication, differentiable), so the model's code sees
the sharded parameter and its gradient lands in the local parameter. The wrappers then see only plain parameters of
the local shape: DDP broadcasts, buckets and all-reduces local tensors over the data group, FSDP shards and gathers
them along the data axis, optimizers step them. This is what torch itself does for DTensor parameters on a
sub-mesh (``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform``).

Importing shardtensor makes the wrappers do this on their own when the module they receive holds ShardTensor
parameters or buffers (DDP's and FSDP's constructors, FSDP2's ``fully_shard``/``replicate``); ``localize_parameters``
does it by hand. Outside the forward, ``module.pos_embed`` is the local ``nn.Parameter``; ``state_dict()`` still
gives (and ``load_state_dict`` takes) the ShardTensor.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from . import _C

__all__ = ["localize_parameters", "is_localized"]

_MISSING = object()
_STATE = "_shardtensor_localized"   # on the root module: its _Localized record
_LAYOUT = "_shardtensor_layout"     # on a local parameter/buffer: its _Layout


@dataclass
class _Layout:
    mesh: object                 # the C++ mesh
    placements: tuple
    sharding_shapes: dict
    global_shape: tuple
    local_shape: tuple

    def view(self, local: torch.Tensor) -> torch.Tensor:
        from . import from_local
        return from_local(local, self.mesh, self.placements, sharding_shapes=self.sharding_shapes,
                          global_shape=self.global_shape, check=False)


@dataclass
class _Entry:
    owner: torch.nn.Module
    attr: str
    kind: str                    # "param" or "buffer"
    layout: _Layout
    saved: list = field(default_factory=list)


@dataclass
class _Localized:
    entries: dict                # qualified name -> _Entry
    depth: int = 0


def _layout_of(t: torch.Tensor) -> _Layout:
    from . import placements, sharding_shapes
    return _Layout(_C.mesh_of(t), placements(t), sharding_shapes(t), tuple(t.shape), tuple(_C.to_local(t).shape))


def _sharded_states(module: torch.nn.Module):
    """(qualified name, owner, attribute, kind, tensor) of every ShardTensor parameter and buffer."""
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for kind, table in (("param", owner._parameters), ("buffer", owner._buffers)):
            for attr, t in table.items():
                if t is not None and _C.is_shard_tensor(t):
                    yield (f"{owner_name}.{attr}" if owner_name else attr), owner, attr, kind, t


def has_sharded_states(module) -> bool:
    return isinstance(module, torch.nn.Module) and next(_sharded_states(module), None) is not None


def is_localized(t: torch.Tensor) -> bool:
    """True for the local parameter or buffer that stands for a ShardTensor one (see ``localize_parameters``)."""
    return getattr(t, _LAYOUT, None) is not None


def localize_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every ShardTensor parameter and buffer of ``module`` by a plain one holding this rank's shard (the
    same storage, no copy), and make the attribute read as the ShardTensor while ``module`` runs. Returns ``module``.

    Call it before wrapping ``module`` in a data-parallel wrapper that needs plain parameters; DDP, FSDP, FSDP2
    ``fully_shard`` and ``replicate`` call it themselves once shardtensor is imported. Idempotent; parameters made
    ShardTensors later are localized by another call. Tied parameters stay tied. Hooks are on ``module``: run the
    model through it (a submodule called on its own sees the local parameters)."""
    state = getattr(module, _STATE, None)
    fresh = state is None
    if fresh:
        state = _Localized({})
    replaced: dict[int, torch.Tensor] = {}
    for name, owner, attr, kind, t in list(_sharded_states(module)):
        layout = _layout_of(t)
        local = replaced.get(id(t))
        if local is None:
            data = _C.to_local(t.detach())
            if kind == "param":
                local = torch.nn.Parameter(data, requires_grad=t.requires_grad)
                if t.grad is not None:
                    local.grad = _C.to_local(t.grad)
            else:
                local = data
            setattr(local, _LAYOUT, layout)
            replaced[id(t)] = local
        (owner._parameters if kind == "param" else owner._buffers)[attr] = local
        state.entries[name] = _Entry(owner, attr, kind, layout)
    if fresh and state.entries:
        setattr(module, _STATE, state)
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_exit, always_call=True)
        module._register_state_dict_hook(_state_dict_hook)
        module._register_load_state_dict_pre_hook(_load_state_dict_pre_hook, with_module=True)
    return module


def _current(entry: _Entry):
    """What the owner holds now: our local tensor, a wrapper's replacement (FSDP2's unsharded parameter) or FSDP1's
    plain attribute view."""
    table = entry.owner._parameters if entry.kind == "param" else entry.owner._buffers
    t = table.get(entry.attr)
    return entry.owner.__dict__.get(entry.attr) if t is None else t


def _enter(module, args):
    state = getattr(module, _STATE)
    state.depth += 1
    if state.depth > 1:
        return
    for entry in state.entries.values():
        cur = _current(entry)
        entry.saved.append(entry.owner.__dict__.get(entry.attr, _MISSING))
        if cur is None or _C.is_shard_tensor(cur) or _is_dtensor(cur) or tuple(cur.shape) != entry.layout.local_shape:
            continue   # nothing there, or a wrapper's sharded container outside its unshard (left alone)
        # An instance attribute shadows the module's _parameters/_buffers entry for attribute reads only.
        entry.owner.__dict__[entry.attr] = entry.layout.view(cur)


def _exit(module, args, output):
    state = getattr(module, _STATE)
    state.depth -= 1
    if state.depth > 0:
        return
    for entry in state.entries.values():
        if not entry.saved:
            continue
        saved = entry.saved.pop()
        if saved is _MISSING:
            entry.owner.__dict__.pop(entry.attr, None)
        else:
            entry.owner.__dict__[entry.attr] = saved


def _is_dtensor(t) -> bool:
    from . import _is_dtensor as is_dtensor
    return is_dtensor(t)


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    for name, entry in getattr(module, _STATE).entries.items():
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter) and \
                not _C.is_shard_tensor(value) and tuple(value.shape) == entry.layout.local_shape:
            state_dict[key] = entry.layout.view(value.detach())
    return state_dict


def _load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
    """A ShardTensor value is brought to the parameter's layout and loaded as its local tensor; a plain value of
    the global shape is the whole tensor (each rank keeps its slice)."""
    from . import distribute_tensor, redistribute, to_local
    for name, entry in getattr(module, _STATE).entries.items():
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        lay = entry.layout
        if _C.is_shard_tensor(value):
            value = to_local(redistribute(value, lay.placements, sharding_shapes=lay.sharding_shapes))
        elif tuple(value.shape) == lay.global_shape and lay.global_shape != lay.local_shape:
            value = to_local(distribute_tensor(value, lay.mesh, lay.placements, sharding_shapes=lay.sharding_shapes))
        state_dict[key] = value


def localizing_init(init):
    """DDP's/FSDP1's ``__init__``, localizing the wrapped module's ShardTensor parameters first (_patches.py)."""
    @functools.wraps(init)
    def wrapper(self, module, *args, **kwargs):
        if has_sharded_states(module):
            localize_parameters(module)
        return init(self, module, *args, **kwargs)
    return wrapper


def localizing_get_modules_and_states(original):
    """FSDP2's ``fully_shard`` and the composable ``replicate`` collect the managed parameters through this
    function of their init module (looked up at call time), so the module is localized before FSDP sees its
    parameters (_patches.py)."""
    @functools.wraps(original)
    def get_modules_and_states(module, *args, **kwargs):
        for m in (module,) if isinstance(module, torch.nn.Module) else tuple(module):
            if has_sharded_states(m):
                localize_parameters(m)
        return original(module, *args, **kwargs)
    return get_modules_and_states


def waiting_post_backward(original):
    """FSDP2's ``FSDPParamGroup.post_backward`` reads its parameters' ``.grad`` during the backward; parameter-gradient
    reductions still in their buckets (``set_grad_bucket_bytes``) complete first. Every rank runs it at the same
    point of the backward, so the collectives this issues match."""
    @functools.wraps(original)
    def post_backward(self, *args, **kwargs):
        _C.wait_grad_reductions()
        return original(self, *args, **kwargs)
    return post_backward
