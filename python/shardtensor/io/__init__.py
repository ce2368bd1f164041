"""Sharded inputs read shard by shard, and sharded outputs written shard by shard (``shardtensor.io``).

At the sizes domain parallelism is for, no rank can hold the whole input, so ``scatter_tensor`` from one rank is
not the way in. The loaders read only this rank's slab of a file and return a ShardTensor with the requested
placements and extents, laid out exactly as ``distribute_tensor(full, mesh, placements, sharding_shapes)`` would
(the extents are explicit, so no collective infers them); ranks along a replicated mesh dim read the same slab.
The writers have each rank write only its slab; nothing is gathered.

    x = st.io.load_npy("field.npy", mesh, [st.Shard(2)])                  # .npy (C or Fortran order)
    x = st.io.load_hdf5("run.h5", "fields/u", mesh, [st.Shard(0)])       # h5py
    x = st.io.load_zarr("run.zarr", mesh, [st.Shard(0)], name="u")       # zarr-python
    x = st.io.load_xarray("era5.zarr", "t2m", mesh, [st.Shard(1)], engine="zarr")
    x = st.io.load_array(any_lazy_array, mesh, [st.Shard(0)])            # dask, memmap, netCDF4 variable, ...
    st.io.save_npy(y, "out.npy"); st.io.save_hdf5(y, "out.h5", "u"); st.io.save_zarr(y, "out.zarr")

h5py, zarr and xarray are optional: they are imported when used, and a missing one raises ``ImportError``
naming the package to install.
"""
from .hdf5 import load_hdf5, save_hdf5
from .loader import load_array
from .npy import load_npy, save_npy
from .xarray_variable import load_xarray
from .zarr_array import load_zarr, save_zarr

__all__ = ["load_npy", "load_hdf5", "load_zarr", "load_xarray", "load_array", "save_npy", "save_hdf5", "save_zarr"]
