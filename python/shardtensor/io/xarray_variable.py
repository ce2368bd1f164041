"""xarray variables (netCDF/HDF5 through h5netcdf, Zarr): xarray opens a dataset lazily, so indexing a variable
with this rank's slab and taking ``.values`` reads only that slab through the engine (zarr reads the chunks it
intersects, h5netcdf an HDF5 hyperslab). CF decoding (scale/offset, fill values as NaN) applies as in xarray."""
from __future__ import annotations

import contextlib
from typing import Optional

from .loader import ArraySource, load, require


def _variable(xr, ds, variable, where, what):
    if variable is None or variable not in ds.variables:
        raise ValueError(f"{what}: {'name the variable to read (variable=...)' if variable is None else f'no variable {variable!r}'}"
                         f" in {where} (data variables: {sorted(map(str, ds.data_vars)) or 'none'})")
    return ds[variable]


@contextlib.contextmanager
def _open(xr, source, variable, engine, open_kwargs, what):
    if isinstance(source, xr.DataArray):
        if variable is not None and variable != source.name:
            raise ValueError(f"{what}: got the DataArray {source.name!r} and variable={variable!r}; give one")
        da, ds = source, None
    elif isinstance(source, xr.Dataset):
        da, ds = _variable(xr, source, variable, "the dataset", what), None
    else:
        # cache=False: xarray would otherwise keep what it reads; chunks=None: no dask, plain lazy indexing.
        ds = xr.open_dataset(source, engine=engine, chunks=None, cache=False, **(open_kwargs or {}))
        try:
            da = _variable(xr, ds, variable, source, what)
        except BaseException:
            ds.close()
            raise
    try:
        yield ArraySource(da, what, getitem=lambda index: da[index].values)
    finally:
        if ds is not None:
            ds.close()


def load_xarray(path_or_dataset, variable: Optional[str], mesh, placements, sharding_shapes=None, *,
                engine: Optional[str] = None, open_kwargs: Optional[dict] = None, global_shape=None, device=None,
                dtype=None, check: bool = True):
    """A ShardTensor of one variable of an xarray dataset; each rank reads only its slab.

    ``path_or_dataset``: a path or store opened with ``xarray.open_dataset(..., engine=engine, chunks=None,
    cache=False, **open_kwargs)`` (``engine``: ``"zarr"``, ``"h5netcdf"``, ... or ``None`` for xarray's guess;
    closed afterwards), an open ``xarray.Dataset``, or a ``DataArray`` (then ``variable`` may be ``None``). The
    variable's dims, in order, are the tensor dims. A missing variable raises ``ValueError`` naming the data
    variables. The other arguments as for ``load_npy``."""
    xr = require("xarray", "xarray", "load_xarray")
    return load("load_xarray", lambda: _open(xr, path_or_dataset, variable, engine, open_kwargs, "load_xarray"),
                mesh, placements, sharding_shapes, global_shape, device, dtype, check)
