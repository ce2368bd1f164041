"""HDF5 datasets through h5py: hyperslab reads of each rank's slab; writes without MPI-enabled HDF5.

Reading: a contiguous, unfiltered dataset in an ordinary file is one dense array at a byte offset
(``h5py.h5d.DatasetID.get_offset``), read like ``.npy`` data with positioned reads of exactly the slab's bytes
(raw.py); HDF5's own hyperslab read would sieve whole spans of the file for a strided slab (the columns of a
C-order array: every rank would read the whole file). Other datasets (chunked, compressed, in memory or opened on
a Python file object) go through ``Dataset.read_direct`` of the slab's hyperslab, straight into the result's
buffer; HDF5 then reads and decompresses the chunks the slab intersects.

Writing: h5py built without MPI cannot take concurrent writers to one file (its metadata cache would be
corrupted), and per-rank files joined by a virtual dataset leave the output spread over files that must move
together. So the mesh's first rank creates the dataset, contiguous, uncompressed, in native byte order, with its
storage allocated at once and no fill value written, and closes the file; then every writing rank finds the
dataset's byte offset in the file (``h5py.h5d.DatasetID.get_offset``) and writes its slab's bytes there with
positioned writes, as for ``.npy`` (raw.py). HDF5's metadata is written once, by one process; the data in
parallel, each byte by one rank. The result is one ordinary HDF5 file. For a chunked, compressed output use
``save_zarr``.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

from . import raw
from .loader import load, require
from .writer import local_array, prepare, remove_quietly, run_phases, temporary_path


def _h5py(what):
    return require("h5py", "h5py", what)


def _dataset(h5py, group, name, what):
    if name is None:
        raise ValueError(f"{what}: name the dataset to read (dataset=...) in {group.file.filename}")
    obj = group.get(name)
    if obj is None or not isinstance(obj, h5py.Dataset):
        found = []
        group.visititems(lambda n, o: found.append(n) if isinstance(o, h5py.Dataset) else None)
        kind = "no dataset" if obj is None else f"a {type(obj).__name__}, not a dataset, at"
        raise ValueError(f"{what}: {kind} {name!r} in {group.file.filename} (datasets: {found or 'none'})")
    return obj


def raw_location(h5py, dataset):
    """(file name, byte offset) of a dataset whose data is one dense array in one ordinary file (contiguous layout,
    no filters, no external storage, a numeric type, storage allocated), else None."""
    if dataset.file.driver not in ("sec2", "stdio") or dataset.dtype.kind not in "biufc":
        return None
    plist = dataset.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() or plist.get_external_count():
        return None
    # Storage not yet allocated (a dataset never written holds its fill value): HDF5 answers with an undefined
    # address, shifted by a user block, rather than None; ask for the allocation itself.
    if dataset.id.get_space_status() != h5py.h5d.SPACE_STATUS_ALLOCATED:
        return None
    offset = dataset.id.get_offset()
    if offset is None:
        return None
    if dataset.file.mode != "r":
        dataset.file.flush()  # what this process wrote through h5py must be in the file before reading around it
    return dataset.file.filename, offset


class _Hdf5Source:
    def __init__(self, h5py, dataset, path=None):
        self.dataset, self.path = dataset, path
        self.shape, self.dtype = tuple(dataset.shape), np.dtype(dataset.dtype)
        self.raw = raw_location(h5py, dataset)

    def identity(self):
        """A file opened by its path: its inode, size and modification time, and the dataset read (compared across
        ranks, so a file replaced between their reads is refused). Objects the caller opened: the dataset only."""
        key = (self.dataset.name, self.shape, self.dtype.str, self.raw)
        if self.path is None:
            return key
        st_ = os.stat(self.path)
        return key + (st_.st_ino, st_.st_size, st_.st_mtime_ns)

    def read(self, start, stop):
        if self.raw is not None:
            # A contiguous dataset read as .npy data is: exactly the slab's bytes. HDF5's own hyperslab read of a
            # strided slab (columns of a C-order array) sieves whole spans of the file instead.
            fd = os.open(self.raw[0], os.O_RDONLY)
            try:
                return raw.read_slab(fd, self.raw[1], self.shape, self.dtype, start, stop)
            finally:
                os.close(fd)
        out = np.empty(tuple(b - a for a, b in zip(start, stop)), self.dtype.newbyteorder("="))
        if out.size:
            selection = tuple(slice(a, b) for a, b in zip(start, stop)) if start else None  # None: a 0-d dataset
            self.dataset.read_direct(out, source_sel=selection)
        return out


@contextlib.contextmanager
def _open(source, dataset, what):
    h5py = _h5py(what)
    if isinstance(source, h5py.Dataset):
        if dataset is not None and dataset != source.name:
            raise ValueError(f"{what}: got the dataset {source.name!r} and dataset={dataset!r}; give one")
        yield _Hdf5Source(h5py, source)
    elif isinstance(source, h5py.Group):  # a File is a Group
        yield _Hdf5Source(h5py, _dataset(h5py, source, dataset, what))
    else:  # a path, or a Python file object
        with h5py.File(source, "r") as f:
            yield _Hdf5Source(h5py, _dataset(h5py, f, dataset, what),
                              os.fspath(source) if isinstance(source, (str, os.PathLike)) else None)


def load_hdf5(path, dataset, mesh, placements, sharding_shapes=None, *, global_shape=None, device=None, dtype=None,
              check: bool = True):
    """A ShardTensor of an HDF5 dataset; each rank reads only its slab (a hyperslab read).

    ``path``: a file name, a Python binary file object, or an open ``h5py.File``/``Group`` (then ``dataset`` is
    the name in it) or ``h5py.Dataset`` (then ``dataset`` may be ``None``). A missing dataset raises
    ``ValueError`` naming the datasets there. The other arguments as for ``load_npy``."""
    _h5py("load_hdf5")
    return load("load_hdf5", lambda: _open(path, dataset, "load_hdf5"), mesh, placements, sharding_shapes,
                global_shape, device, dtype, check)


def save_hdf5(x, path, dataset, *, mode: str = "w") -> None:
    """Write the ShardTensor ``x`` as the dataset ``dataset`` of the HDF5 file ``path``, each rank writing only its
    slab (collective over ``x``'s mesh; nothing is gathered; no MPI-enabled h5py needed: see the module doc).
    ``mode``: ``"w"`` creates or replaces the file, ``"a"`` adds the dataset to an existing file (a dataset of
    that name there raises ``ValueError``). Published only once every rank wrote its slab: ``"w"`` builds the file
    under a temporary name beside ``path`` and renames it; ``"a"`` builds the dataset under a temporary name in the
    file and renames it (an HDF5 link move). So a save that fails or is killed on any rank never leaves a file or
    dataset under the name that loads. ``Partial`` values raise ``ValueError``."""
    h5py = _h5py("save_hdf5")
    if mode not in ("w", "a"):
        raise ValueError(f"save_hdf5: mode must be 'w' (create or truncate the file) or 'a' (add the dataset), "
                         f"got {mode!r}")
    path = os.fspath(path)
    what = f"save_hdf5({path!r}, {dataset!r})"
    layout, mesh, dtype = prepare(x, what)
    data = local_array(x)
    # mode "w": a whole new file under a temporary name; "a": a temporary dataset in the existing file.
    file = temporary_path(path) if mode == "w" else path
    name = dataset if mode == "w" else f"{dataset}.shardtensor-partial"

    def create():
        with h5py.File(file, "w" if mode == "w" else "a") as f:
            if mode == "a":
                if dataset in f:
                    raise ValueError(f"save_hdf5: {path} already holds {dataset!r}; delete it first or write the "
                                     "whole file with mode='w'")
                if name in f:
                    del f[name]   # left by an earlier save that did not finish
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # the data's place in the file is fixed now
            f.create_dataset(name, shape=layout.global_shape, dtype=dtype, dcpl=dcpl, fill_time="never")

    def write():
        with h5py.File(file, "r") as f:
            location, shape = raw_location(h5py, f[name]), f[name].shape
        if location is None:  # only writers of a non-empty slab get here: the dataset was created contiguous
            raise RuntimeError(f"save_hdf5: {name!r} in {file} has no contiguous storage to write into")
        fd = os.open(file, os.O_WRONLY)
        try:
            raw.write_slab(fd, location[1], shape, data, layout.start)
        finally:
            os.close(fd)

    def publish():
        if mode == "w":
            os.replace(file, path)
        else:
            with h5py.File(file, "a") as f:
                f.move(name, dataset)

    def cleanup():
        if mode == "w":
            remove_quietly(file)
        else:
            with h5py.File(file, "a") as f:
                if name in f:
                    del f[name]

    run_phases(mesh, what, [
        create if layout.is_root else None,
        write if layout.is_writer and data.size else None,
        publish if layout.is_root else None,
    ], cleanup=cleanup if layout.is_root else None)
