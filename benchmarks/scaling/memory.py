"""Per-rank peak memory and communication volume, gathered over ranks."""
from __future__ import annotations

import torch.distributed as dist

from torch.distributed.tensor import DTensor

import shardtensor as st


def peak_bytes(fn, device, prepare=None) -> int:
    """Allocator peak of ``fn()`` on this rank above what was live before (``shardtensor.peak_memory``: CUDA
    ``max_memory_allocated``; CPU `st.peak_memory`'s allocator tracker). Live parameters, gradients and
    optimizer state are *not* in the figure unless ``fn`` allocates them; ``live_bytes`` reports those."""
    return int(st.peak_memory(fn, device, prepare))


def live_bytes(module, optimizer=None) -> int:
    """Bytes held by the model's parameters (local shards for ShardTensor ones), their gradients and the
    optimizer state on this rank."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is None or not hasattr(t, "untyped_storage"):
            return
        if st.is_shard_tensor(t):
            local = st.to_local(t)
        elif isinstance(t, DTensor):  # FSDP2's sharded parameters and their state: the local shard
            local = t.to_local()
        else:
            local = t
        # The storage's identity: views share it; fake (meta-backed) tensors of a meta simulation have no data.
        key = local.untyped_storage()._cdata
        if key in seen:
            return
        seen.add(key)
        total += local.numel() * local.element_size()

    for p in module.parameters():
        add(p)
        add(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if hasattr(v, "numel") and v.dim() > 0:
                    add(v)
    return total


def comm(fn) -> dict:
    """Collectives the library issued on this rank while ``fn()`` ran: calls and bytes per kind."""
    with st.CommCounter() as c:
        fn()
    return {"calls": dict(c.calls), "bytes": dict(c.bytes)}


def gather(obj, group=None) -> list:
    """Every rank's ``obj`` in rank order (a collective; a one-element list alone)."""
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def training_closures(workload, model, inputs, target):
    """The three measured callables of a workload: ``fwd`` (no-grad forward), ``zero`` and ``step`` (zero grads,
    loss, backward, AdamW step), and the optimizer. AdamW's per-parameter loop keeps the committed results
    comparable (its foreach/fused kernels also run on ShardTensor parameters now)."""
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, foreach=False)

    def fwd():
        with torch.no_grad():
            model(*inputs)

    def zero():
        opt.zero_grad(set_to_none=True)

    def step():
        zero()
        workload.loss(model(*inputs), target, inputs).backward()
        opt.step()

    return fwd, zero, step, opt
