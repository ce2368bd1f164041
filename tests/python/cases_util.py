"""Helpers used inside rank processes: meshes, seeded data, comparisons."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardtensor as st

_meshes = {}


def mesh(shape=None, names=None):
    """A cached CPU DeviceMesh over all ranks (1-D by default)."""
    world = dist.get_world_size()
    shape = tuple(shape or (world,))
    names = tuple(names or (("domain",) if len(shape) == 1 else tuple(f"d{i}" for i in range(len(shape)))))
    key = (shape, names)
    if key not in _meshes:
        _meshes[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[key]


def rank():
    return dist.get_rank()


def world():
    return dist.get_world_size()


def randn(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


def uneven_extents(n, k, seed=0):
    """A deterministic uneven split of n over k (zero extents allowed), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + seed)
    cuts = sorted(torch.randint(0, n + 1, (k - 1,), generator=g).tolist())
    bounds = [0] + cuts + [n]
    return [bounds[i + 1] - bounds[i] for i in range(k)]


def shard_of(full, m, placements, extents=None):
    """Distribute a full tensor (same on every rank) with optional explicit extents per mesh dim."""
    return st.distribute_tensor(full, m, placements, sharding_shapes=extents)


def close(actual, expected, rtol=1e-5, atol=1e-6, what=""):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def full(x):
    return st.full_tensor(x) if st.is_shard_tensor(x) else x
