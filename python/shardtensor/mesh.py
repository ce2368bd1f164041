"""Bridging torch's DeviceMesh to the C++ mesh (process groups travel by their registered names)."""
from __future__ import annotations

import weakref



from . import _C

__all__ = ["as_cpp_mesh", "device_mesh_of"]

# C++ mesh id -> the DeviceMesh the user passed (so x.device_mesh returns the user's object).
_user_meshes: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def as_cpp_mesh(mesh) -> "_C.Mesh":
    """The C++ mesh for a torch DeviceMesh (cached on the DeviceMesh) or a C++ mesh itself."""
    if isinstance(mesh, _C.Mesh):
        return mesh
    cached = getattr(mesh, "_shardtensor_mesh", None)
    if cached is not None:
        return cached
    if not hasattr(mesh, "get_group"):
        raise TypeError(f"expected a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the mesh")
    _agree_on_group_ranks(mesh, coordinate)
    names = [mesh.get_group(i).group_name for i in range(mesh.ndim)]
    dim_names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"dim{i}" for i in range(mesh.ndim)]
    cpp = _C.Mesh.from_group_names(list(mesh.mesh.shape), names, list(coordinate), dim_names,
                                   mesh.device_type, mesh.mesh.flatten().tolist())
    try:
        mesh._shardtensor_mesh = cpp
    except AttributeError:
        pass
    _user_meshes[cpp.id] = mesh
    return cpp


def _agree_on_group_ranks(mesh, coordinate) -> None:
    """Along each mesh dim, the process group must hold the mesh's line of ranks in the line's order (a rank's
    coordinate is its group rank). torch builds a 1-D mesh over every rank on the default group whatever the order
    the mesh lists, so in ``DeviceMesh("cpu", [2, 1, 0])`` ranks 0 and 2 have the wrong group rank and rank 1 the
    right one: checked by coordinate alone, two ranks raised and the third waited for them. Each rank compares its
    whole line with its group's ranks instead (no communication), so every rank of a bad line raises; on a mesh of
    several dims a line can be bad where this rank does not see it, so the verdicts are then combined (one small
    all-reduce per mesh dim, once per mesh)."""
    import torch
    import torch.distributed as dist

    grid = mesh.mesh
    bad = False
    for d in range(mesh.ndim):
        index = list(coordinate)
        index[d] = slice(None)
        line = grid[tuple(index)].tolist()
        if dist.get_process_group_ranks(mesh.get_group(d)) != line:
            bad = True
    if mesh.ndim > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
        flag = torch.tensor([int(bad)], dtype=torch.int64, device=device)
        for d in range(mesh.ndim):
            if grid.shape[d] > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
        bad = bool(flag.item())
    if bad:
        raise ValueError(
            f"DeviceMesh {grid.tolist()}: the process group of a mesh dim does not hold that dim's ranks in the mesh's "
            "order, so a rank's coordinate is not its rank in the group (torch reuses the default group for a 1-D mesh "
            "over every rank, and may hold a group's ranks in ascending order, whatever order the mesh lists). List the "
            "ranks in order (express a permutation of the data through the sharding instead), or build the mesh from "
            "groups made for it (DeviceMesh.from_group)")


def device_mesh_of(cpp_mesh):
    """The user's DeviceMesh for a C++ mesh. When the user no longer holds it (a DeviceMesh made inline and
    dropped), one is rebuilt over the same process groups, so code asking a ShardTensor for its mesh (the io writers,
    x.device_mesh) keeps working; a mesh built in C++ from groups torch does not know comes back as the C++ mesh."""
    mesh = _user_meshes.get(cpp_mesh.id)
    if mesh is not None:
        return mesh
    mesh = _rebuild(cpp_mesh)
    if mesh is None:
        return cpp_mesh
    _user_meshes[cpp_mesh.id] = mesh
    return mesh


def _rebuild(cpp_mesh):
    """A DeviceMesh over the C++ mesh's process groups (found by their registered names), or None."""
    try:
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.distributed_c10d import _resolve_process_group

        groups = [_resolve_process_group(name) for name in cpp_mesh.group_names]
        shape, names = list(cpp_mesh.shape), tuple(cpp_mesh.dim_names)
        ranks = list(cpp_mesh.ranks)
        if len(shape) == 1:
            mesh = DeviceMesh.from_group(groups[0], cpp_mesh.device_type, mesh_dim_names=names)
        else:
            if not ranks:
                return None
            mesh = DeviceMesh.from_group(groups, cpp_mesh.device_type, mesh=torch.tensor(ranks).view(shape),
                                         mesh_dim_names=names)
    except Exception:  # noqa: BLE001  (no registered groups: a mesh built in C++, or a torch without from_group)
        return None
    try:
        mesh._shardtensor_mesh = cpp_mesh   # the same C++ mesh again, with no new agreement round
    except AttributeError:
        pass
    return mesh


