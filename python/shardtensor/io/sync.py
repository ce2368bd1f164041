"""Agreement and barriers over a whole mesh with torch.distributed, for file I/O that can fail on one rank.

A file that one rank cannot open (a path that is not shared, a full disk) must not leave the other ranks waiting
in the next collective: every step that can fail is followed by ``agree``, one small all-reduce per mesh dim that
tells every rank which ranks failed, and then every rank raises. The same call is the barrier between a rank
creating a file and the others writing into it. The mesh's own per-dim process groups are used (a group over the
whole mesh would need ``new_group``, a collective over the world); reducing along each mesh dim in turn reduces
over the whole mesh, and a rank returns only after every rank of the mesh has entered.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def mesh_groups(mesh, what: str) -> list:
    """The process group of every mesh dim (a DeviceMesh is needed: a mesh built in C++ has no Python groups)."""
    if not hasattr(mesh, "get_group"):
        raise TypeError(f"{what}: needs the torch DeviceMesh of the ShardTensor (a mesh built in C++ has no "
                        "Python process groups to synchronise the writers with)")
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def _flag_device(group, mesh) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend or mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _flat_index(mesh) -> int:
    coordinate, index = mesh.get_coordinate(), 0
    for c, s in zip(coordinate, mesh.mesh.shape):
        index = index * int(s) + int(c)
    return index


def agree(mesh, failure: Optional[BaseException], what: str) -> None:
    """Collective over every rank of ``mesh``: returns when no rank failed; otherwise raises on every rank, the
    failing ranks their own exception, the others a ``RuntimeError`` naming the failed ranks and the first error.
    Also a barrier: no rank returns before every rank of the mesh has called it."""
    groups = mesh_groups(mesh, what)
    device = _flag_device(groups[0], mesh)
    failed = torch.zeros(mesh.mesh.numel(), dtype=torch.int32, device=device)
    if failure is not None:
        failed[_flat_index(mesh)] = 1
    for g in groups:
        dist.all_reduce(failed, group=g)
    ranks = [int(r) for r, f in zip(mesh.mesh.flatten().tolist(), failed.tolist()) if f]
    if not ranks:
        return
    # Every rank knows the same list, so every rank takes this path: the failed ranks' messages travel too.
    mine = [] if failure is None else [(dist.get_rank(), f"{type(failure).__name__}: {failure}")]
    for g in groups:
        gathered = [None] * dist.get_world_size(g)
        dist.all_gather_object(gathered, mine, group=g)
        mine = [m for part in gathered for m in part]
    if failure is not None:
        raise failure
    rank, first = min(mine)
    raise RuntimeError(f"{what} failed on rank(s) {ranks} of the mesh (global ranks); rank {rank}: {first}")
