"""NumPy ``.npy`` files, read and written slab by slab with positioned I/O (see raw.py).

The header (shape, dtype, C or Fortran order) is parsed with NumPy's own ``numpy.lib.format``; the data that
follows it is a dense array, of which each rank reads or writes its slab's bytes only. (``np.load(mmap_mode="r")``
would map the same bytes; positioned reads transfer exactly the slab, into the result's buffer, and the bytes show
in ``/proc/self/io``; concurrent writers of a memory map on a network file system can lose each other's updates to
a shared page, positioned writes of disjoint byte ranges cannot.)
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

from . import raw
from .loader import load
from .writer import create_then_write

_format = np.lib.format


def read_header(f):
    """(shape, fortran_order, dtype, data offset) of an open ``.npy`` file positioned at its start."""
    version = _format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = _format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = _format.read_array_header_2_0(f)
    else:  # 3.0: utf-8 field names; numpy has no public reader for it
        shape, fortran, dtype = _format._read_array_header(f, version)
    if dtype.hasobject:
        raise TypeError(f"{f.name}: an array of Python objects (dtype {dtype}) is pickled, not stored as data; it "
                        "cannot be read slab by slab")
    return tuple(shape), bool(fortran), dtype, f.tell()


class _NpySource:
    def __init__(self, f):
        self.f = f
        self.shape, self.fortran, self.dtype, self.offset = read_header(f)

    def identity(self):
        """What this rank reads: the open file's inode, size and modification time (a replacement by rename keeps
        this rank's open file; another rank opening later gets the new one) and the header."""
        st_ = os.fstat(self.f.fileno())
        return (st_.st_ino, st_.st_size, st_.st_mtime_ns, self.shape, self.fortran, self.dtype.str, self.offset)

    def read(self, start, stop):
        return raw.read_slab(self.f.fileno(), self.offset, self.shape, self.dtype, start, stop, self.fortran)


@contextlib.contextmanager
def _open(path):
    # Unbuffered: the header is read in the few bytes it takes, not in a buffer's worth.
    with open(path, "rb", buffering=0) as f:
        yield _NpySource(f)


def load_npy(path, mesh, placements, sharding_shapes=None, *, global_shape=None, device=None, dtype=None,
             check: bool = True):
    """A ShardTensor of the ``.npy`` file at ``path``; each rank reads only its slab (C or Fortran order).

    ``placements``: one per mesh dim (``Shard(d)`` or ``Replicate()``: ranks along a replicated mesh dim read the
    same slab; ``Partial`` raises ``ValueError``). ``sharding_shapes``: extents per sharded mesh dim as for
    ``distribute_tensor`` (default: ``torch.tensor_split`` sizes of the file's shape). ``global_shape``: when
    given, the file's shape must equal it (``ValueError`` otherwise). ``device``: default the mesh's (the CPU, or
    the current CUDA device of a CUDA mesh). ``dtype``: cast to it (default: the file's). ``check`` (default):
    every rank learns whether every rank read its slab (one small all-reduce per mesh dim), so a rank-local
    failure raises on every rank, and ``from_local`` checks that all ranks passed the same layout; ``check=False``
    communicates nothing (every rank must then pass the same arguments and be able to read the file).
    """
    return load("load_npy", lambda: _open(path), mesh, placements, sharding_shapes, global_shape, device, dtype,
                check)


def save_npy(x, path) -> None:
    """Write the ShardTensor ``x`` as one ``.npy`` file (C order) at ``path``, each rank writing only its slab
    (collective over ``x``'s mesh; nothing is gathered). The mesh's first rank writes the header and sizes the
    file under a temporary name beside ``path``; after a barrier each writing rank writes its slab's bytes in place
    (copies on replicated mesh dims are written by coordinate 0 of those dims only); once every rank reported
    success the first rank renames the file to ``path``, so a save that fails or is killed on any rank never leaves
    a file there that loads (an earlier file at ``path`` stays as it was). ``Partial`` values raise ``ValueError``."""
    path = os.fspath(path)

    def create(temp, layout, dtype):
        header = {"descr": _format.dtype_to_descr(dtype), "fortran_order": False, "shape": layout.global_shape}
        with open(temp, "wb") as f:
            try:
                _format.write_array_header_1_0(f, header)
            except ValueError:  # a header over 64 KiB (thousands of dims)
                f.seek(0)
                _format.write_array_header_2_0(f, header)
            f.truncate(f.tell() + dtype.itemsize * int(np.prod(layout.global_shape, dtype=np.int64)))

    def write(temp, layout, data):
        with open(temp, "rb", buffering=0) as f:
            shape, _, _, offset = read_header(f)
        fd = os.open(temp, os.O_WRONLY)
        try:
            raw.write_slab(fd, offset, shape, data, layout.start)
        finally:
            os.close(fd)

    create_then_write(x, f"save_npy({path!r})", path, create, write)
