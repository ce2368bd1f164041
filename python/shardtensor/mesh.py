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


def device_mesh_of(cpp_mesh):
    """The user's DeviceMesh for a C++ mesh, or the C++ mesh when it was built in C++."""
    return _user_meshes.get(cpp_mesh.id, cpp_mesh)


