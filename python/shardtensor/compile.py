"""Running per-shard computation, compiled or not: ``local_map``.

``torch.compile`` traces ShardTensor arguments through their traced representation (``_traced.py``) for the rule
families docs/python-api.md lists; for the rest, and to compile code written per shard, compile the part that is
*local* -- each output element depends only on this rank's shard: pointwise ops, channel mixing, per-position
MLPs -- and run it on the local shards::

    mlp = torch.compile(Mlp())
    y = st.local_map(mlp)(x)          # x: ShardTensor; mlp sees x.to_local(); y: ShardTensor

Plain parameters and plain tensor arguments that require grad are ``Replicate``: like plain tensors mixed with
ShardTensors in ordinary ops, their gradient is summed over the mesh dims on which the inputs are sharded, so
they get the single-device gradient on every rank.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["local_map"]


class _SumGradOverMesh(torch.autograd.Function):
    """Identity forward; backward sums the gradients over the given process groups (one all-reduce per group
    for all tensors together)."""

    @staticmethod
    def forward(ctx, groups, *tensors):
        ctx.groups = groups
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        for group in ctx.groups:
            dist.all_reduce(flat, group=group)
        out, start = [], 0
        for g in grads:
            out.append(flat[start:start + g.numel()].view_as(g))
            start += g.numel()
        return (None, *out)


def _flatten(args, kwargs):
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    return leaves, spec


def _reference_input(leaves):
    from . import is_shard_tensor
    for leaf in leaves:
        if is_shard_tensor(leaf):
            return leaf
    return None


def _sharded_groups(mesh, shard_tensors):
    """Process groups of the mesh dims on which any input is sharded (a plain replicated tensor's gradient is
    summed over them)."""
    from . import placements
    dims = sorted({d for t in shard_tensors for d, p in enumerate(placements(t)) if p.is_shard()})
    return [mesh.get_group(d) for d in dims]


def _out_layouts(out_placements, n_outputs, default):
    """One placements sequence (or None: leave the output plain) per tensor output."""
    from .placement import Partial, Replicate, Shard
    single = (Shard, Replicate, Partial, torch.distributed.tensor.Placement)
    if out_placements is None:
        return [default] * n_outputs
    if isinstance(out_placements, single) or (len(out_placements) and isinstance(out_placements[0], single)):
        return [out_placements] * n_outputs
    if len(out_placements) != n_outputs:
        raise ValueError(f"local_map: {len(out_placements)} out_placements for {n_outputs} tensor outputs")
    return list(out_placements)


def local_map(fn, out_placements=None, *, in_placements=None, redistribute_inputs: bool = False,
              sharding_shapes="infer"):
    """``fn`` run on the local shards of its ShardTensor arguments, its tensor results wrapped as ShardTensors.

    - ShardTensor arguments (anywhere in ``args``/``kwargs``, all on one mesh) become ``x.to_local()``
      (differentiable; ``Partial`` inputs arrive as this rank's term). Other arguments pass unchanged. Without
      ShardTensor arguments ``fn`` is simply called.
    - ``fn`` may be an ``nn.Module`` (compiled or not): its plain parameters, and plain tensor arguments that
      require grad, are taken as ``Replicate``; their gradients are summed over the mesh dims on which the
      inputs are sharded (one all-reduce per such mesh dim and call, in backward).
    - ``out_placements``: the placements of every tensor output (default: those of the first ShardTensor
      argument), or one entry per tensor output (``None``: return that output as a plain tensor).
    - ``in_placements``: optional placements per ShardTensor argument, in order; an argument laid out otherwise
      raises ``ValueError`` unless ``redistribute_inputs=True`` (then it is redistributed, a collective).
    - ``sharding_shapes`` of the outputs: ``"infer"`` (default; one small all-gather per sharded mesh dim and
      output), ``"input"`` (the first ShardTensor argument's extents, no communication: for ``fn`` that keeps the
      sizes of the sharded dims; the local shape is checked on each rank) or an explicit dict.

    ``fn`` must be local (each output element depends only on this rank's shard); convolutions across shard
    boundaries, norms or attention over a sharded dim belong outside, as ordinary ShardTensor ops.
    """
    from . import from_local, is_shard_tensor, placements, redistribute, sharding_shapes as shapes_of
    from . import device_mesh, to_local
    from .placement import normalize_placements

    if sharding_shapes not in ("infer", "input") and not isinstance(sharding_shapes, dict):
        raise ValueError(f"local_map: sharding_shapes must be 'infer', 'input' or a dict, got {sharding_shapes!r}")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        leaves, spec = _flatten(args, kwargs)
        ref = _reference_input(leaves)
        if ref is None:
            return fn(*args, **kwargs)
        mesh = device_mesh(ref)
        if not hasattr(mesh, "get_group"):
            raise TypeError("local_map: the ShardTensors' mesh was built in C++; build it from a DeviceMesh")
        ndim = len(placements(ref))
        shard_args = [leaf for leaf in leaves if is_shard_tensor(leaf)]
        if in_placements is not None:
            if len(in_placements) != len(shard_args):
                raise ValueError(f"local_map: {len(in_placements)} in_placements for {len(shard_args)} "
                                 "ShardTensor arguments")
            for i, (arg, want) in enumerate(zip(shard_args, in_placements)):
                if want is None:
                    continue
                want = normalize_placements(want, ndim)
                if placements(arg) != want:
                    if not redistribute_inputs:
                        raise ValueError(f"local_map: ShardTensor argument {i} has placements {placements(arg)}, "
                                         f"in_placements wants {want}; pass redistribute_inputs=True to "
                                         "redistribute it")
                    shard_args[i] = redistribute(arg, want)
        ref = shard_args[0]
        groups = _sharded_groups(mesh, shard_args)
        ref_placements, ref_shapes = placements(ref), shapes_of(ref)

        # Replicated inputs that require grad: their gradient is summed over the sharded mesh dims.
        plain = [i for i, leaf in enumerate(leaves)
                 if isinstance(leaf, torch.Tensor) and not is_shard_tensor(leaf) and leaf.requires_grad]
        params = {}
        if isinstance(fn, torch.nn.Module):
            params = {n: p for n, p in fn.named_parameters() if p.requires_grad and not is_shard_tensor(p)}
        to_sum = [leaves[i] for i in plain] + list(params.values())
        summed = _SumGradOverMesh.apply(groups, *to_sum) if (to_sum and groups and torch.is_grad_enabled()) else to_sum

        it = iter(shard_args)
        local_leaves = [to_local(next(it)) if is_shard_tensor(leaf) else leaf for leaf in leaves]
        for i, t in zip(plain, summed):
            local_leaves[i] = t
        local_args, local_kwargs = torch.utils._pytree.tree_unflatten(local_leaves, spec)
        if params and summed is not to_sum:
            new_params = dict(zip(params, summed[len(plain):]))
            out = torch.func.functional_call(fn, new_params, local_args, local_kwargs, strict=False)
        else:
            out = fn(*local_args, **local_kwargs)

        out_leaves, out_spec = torch.utils._pytree.tree_flatten(out)
        tensor_idx = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
        layouts = _out_layouts(out_placements, len(tensor_idx), ref_placements)
        for i, layout in zip(tensor_idx, layouts):
            if layout is None:
                continue
            layout = normalize_placements(layout, ndim)
            if sharding_shapes == "input":
                if [p.dim for p in layout if p.is_shard()] != [p.dim for p in ref_placements if p.is_shard()] or \
                        [d for d, p in enumerate(layout) if p.is_shard()] != list(ref_shapes):
                    raise ValueError(f"local_map: sharding_shapes='input' needs outputs sharded like the input "
                                     f"({ref_placements}), got {layout}")
                shapes = ref_shapes
            else:
                shapes = sharding_shapes
            out_leaves[i] = from_local(out_leaves[i], mesh, layout, sharding_shapes=shapes)
        return torch.utils._pytree.tree_unflatten(out_leaves, out_spec)

    return run
