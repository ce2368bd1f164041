"""This rank's share of the synthetic input: sharding the global CPU tensors onto the domain mesh."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import shardtensor as st


def to_device(t, device):
    return t.to(device) if isinstance(t, torch.Tensor) else t


def shard_inputs(workload, inputs, target, domain_mesh, device):
    """This rank's inputs and target: sharded ones become ShardTensors on the domain mesh (each rank keeps its
    default-split slice of the global CPU tensor, so only the shard ever reaches the device), the rest stay
    plain (replicated)."""
    in_dims, tgt_dim = workload.shard_dims()

    def one(t, dim):
        if t is None or dim is None or domain_mesh is None:
            return to_device(t, device)
        coord = domain_mesh.get_local_rank()
        local = torch.tensor_split(t, domain_mesh.size(), dim=dim)[coord].contiguous().to(device)
        return st.from_local(local, domain_mesh, [st.Shard(dim)], sharding_shapes="even", global_shape=tuple(t.shape))

    return tuple(one(t, d) for t, d in zip(inputs, in_dims)), one(target, tgt_dim)


def full(t):
    return st.full_tensor(t) if st.is_shard_tensor(t) else t


def is_st(t):
    return st.is_shard_tensor(t)


def local_bytes(t) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    local = t.to_local() if is_st(t) or isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
