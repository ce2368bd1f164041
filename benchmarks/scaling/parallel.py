"""Meshes and the data-parallel wrapper of the 2-D (data x domain) mode.

The sample is a ShardTensor on the *domain* sub-mesh only: every data group holds a different sample, so the
data axis is not a placement of the activations. Plain parameters get the single-device gradient of the
group's sample from the library (one reduction over the domain axis per use); the wrapper then averages those
over the data axis: torch DDP on the data axis' process group, or FSDP2 (``fully_shard``) on the data sub-mesh.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import shardtensor as st

# Set to the exact failure (and the CLI refuses the mode) when a wrapper does not work with ShardTensor inputs;
# None while it works (the correctness check before timing proves it on every run).
DDP_REFUSAL = None
FSDP2_REFUSAL = None


def build_meshes(args, world: int, device: torch.device, data: int, domain: int) -> dict:
    if data == 1:
        domain_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("domain",))
        return {"data": 1, "domain": domain, "data_rank": 0, "data_group": None, "data_mesh": None,
                "domain_mesh": domain_mesh}
    mesh = init_device_mesh(device.type, (data, domain), mesh_dim_names=("data", "domain"))
    return {"data": data, "domain": domain, "data_rank": mesh.get_local_rank("data"),
            "data_group": mesh.get_group("data"), "data_mesh": mesh["data"], "domain_mesh": mesh["domain"]}


def wrap_data_parallel(model: nn.Module, args, meshes: dict, device: torch.device) -> nn.Module:
    """Same weights on every domain rank (broadcast), then the data-axis wrapper when the mesh has one."""
    st.sync_module(model, meshes["domain_mesh"])
    if meshes["data"] == 1:
        return model
    if args.data_parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, process_group=meshes["data_group"],
                   device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=meshes["data_mesh"])
    return model
