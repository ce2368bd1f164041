"""The one loading flow every format shares: open the source, lay its global shape out over the mesh, read this
rank's slab only, wrap it with ``from_local`` and the explicit extents (so the layout is exactly
``distribute_tensor(full, mesh, placements, sharding_shapes)``'s, with no collective to infer it)."""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, Optional

import numpy as np
import torch

from .layout import Layout, plan
from .sync import agree


def require(module: str, pip_name: str, what: str):
    """Import an optional library, or an ImportError that names the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs the {module!r} package, which is not installed: pip install {pip_name}") \
            from e


def torch_dtype(what: str, dtype) -> torch.dtype:
    """The torch dtype of a NumPy dtype (``TypeError`` for strings, objects, records, ...)."""
    dtype = np.dtype(dtype)
    try:
        return torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: the stored dtype {dtype} has no torch equivalent ({e})") from None


def default_device(mesh) -> torch.device:
    """Where shards of ``mesh`` live: the CPU, or this rank's current device of the mesh's device type."""
    kind = getattr(mesh, "device_type", "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else None
    return torch.device(kind, index)


def to_tensor(array: np.ndarray, device, dtype) -> torch.Tensor:
    """A contiguous torch tensor of a NumPy slab (no copy for a native, C-ordered CPU result)."""
    array = np.asarray(array)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if not array.flags.writeable:
        array = array.copy()
    t = torch.from_numpy(array).contiguous()
    return t.to(device=device, dtype=dtype if dtype is not None else t.dtype)


class ArraySource:
    """An array-like (``shape``, ``dtype``, indexing with a tuple of slices returning a NumPy-convertible slab):
    a zarr array, an h5py dataset, an xarray variable, a NumPy memmap, a dask array."""

    def __init__(self, array, what: str, getitem: Optional[Callable] = None):
        for attr in ("shape", "dtype"):
            if not hasattr(array, attr):
                raise TypeError(f"{what}: expected an array-like with shape, dtype and slicing, got "
                                f"{type(array).__name__}")
        self.array, self.what = array, what
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.getitem = getitem or (lambda index: array[index])

    def read(self, start, stop) -> np.ndarray:
        shape = tuple(b - a for a, b in zip(start, stop))
        if 0 in shape:
            return np.empty(shape, self.dtype)
        out = np.asarray(self.getitem(tuple(slice(a, b) for a, b in zip(start, stop))))
        if out.shape != shape:
            raise ValueError(f"{self.what}: reading {[(a, b) for a, b in zip(start, stop)]} returned shape "
                             f"{list(out.shape)}, expected {list(shape)}")
        return out


def load(what: str, open_source, mesh, placements, sharding_shapes, global_shape, device, dtype,
         check: bool) -> torch.Tensor:
    """``open_source()`` is a context manager yielding a source (``shape``, ``dtype``, ``read(start, stop)``)."""
    from .. import from_local
    failure: Optional[BaseException] = None
    layout: Optional[Layout] = None
    local = None
    identity = None
    try:
        with open_source() as source:
            torch_dtype(what, source.dtype)
            layout = plan(what, source.shape, mesh, placements, sharding_shapes, global_shape)
            # What this rank reads (a file's inode, size, modification time, header), before and after its read:
            # the ranks compare it below, so a file replaced or changed between their reads is refused instead of
            # giving each rank a slab of another version.
            identity = source.identity() if hasattr(source, "identity") else None
            array = source.read(layout.start, layout.stop)
            if identity is not None and source.identity() != identity:
                raise ValueError(f"{what}: the file changed while this rank read it (its inode, size or modification "
                                 "time differs after the read); read it again when no one is writing it")
        local = to_tensor(array, default_device(mesh) if device is None else device, dtype)
    except Exception as e:  # every rank learns of it below, and raises
        failure = e
    if check and hasattr(mesh, "get_group"):
        agree(mesh, failure, what, identity=identity if identity is not None else ())
    elif failure is not None:
        raise failure
    return from_local(local, mesh, layout.placements, sharding_shapes=layout.extents,
                      global_shape=list(layout.global_shape), check=check)


def load_array(array, mesh, placements, sharding_shapes=None, *, global_shape=None, device=None, dtype=None,
               check: bool = True) -> torch.Tensor:
    """A ShardTensor of any array-like that slices lazily (a zarr array, an h5py dataset, an xarray
    ``DataArray``, a NumPy memmap, a dask array): ``array.shape`` is the global shape, and each rank reads
    ``array[its slab]`` only. Arguments as for ``load_npy``."""
    return load("load_array", lambda: contextlib.nullcontext(ArraySource(array, "load_array")), mesh, placements,
                sharding_shapes, global_shape, device, dtype, check)
