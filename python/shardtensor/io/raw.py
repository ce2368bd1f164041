"""Reading and writing one slab (a box of a dense array) of a raw, uncompressed array stored at a byte offset of
a file: a ``.npy`` file's data, an HDF5 contiguous dataset. Positioned reads and writes (``preadv``/``pwrite``)
of exactly the slab's bytes, straight into (or from) the slab's buffer, so a rank transfers its slab and nothing
else, concurrent writers of disjoint slabs never touch each other's bytes (no page-granular sharing, as memory
maps have), and the bytes show in the process's I/O counters (``/proc/self/io``).

The slab is split into runs that are contiguous in the file (the dims inside the innermost partial dim are whole).
Runs shorter than ``MIN_RUN`` bytes (e.g. the last dim of a C-order array sharded) would cost a system call per
few elements; for reading, such slabs are read as whole rows of the next dim out, at most ``MAX_BLOCK`` bytes at a
time, and the slab copied out of them (the operating system reads whole pages around such runs anyway). Writes
are always exact, one call per run.
"""
from __future__ import annotations

import itertools
import math
import os

import numpy as np

MIN_RUN = 4096          # bytes: shorter contiguous runs are read as whole rows (see above)
MAX_BLOCK = 16 << 20    # bytes: scratch buffer for such rows
MAX_IO = 1 << 30        # bytes per system call (Linux transfers at most 2 GiB - 4 KiB in one)


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.preadv(fd, [buf[:MAX_IO]], offset)
        if n == 0:
            raise ValueError(f"unexpected end of file at byte {offset}: the file is shorter than its header says")
        buf, offset = buf[n:], offset + n


def _pwrite_from(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwrite(fd, buf[:MAX_IO], offset)
        buf, offset = buf[n:], offset + n


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


def _split(shape, start, stop):
    """(k, element strides): dims after ``k`` are whole in the slab, so each run spans dims ``k..``."""
    n = len(shape)
    strides = [math.prod(shape[d + 1:]) for d in range(n)]
    k = n - 1
    while k > 0 and start[k] == 0 and stop[k] == shape[k]:
        k -= 1
    return k, strides


def _runs(shape, start, stop, itemsize, k, strides):
    """(byte offset in the array, byte length) of every run, in file order (= the slab's C order)."""
    length = (stop[k] - start[k]) * strides[k] * itemsize
    for outer in itertools.product(*(range(start[d], stop[d]) for d in range(k))):
        first = sum(i * strides[d] for d, i in enumerate(outer)) + start[k] * strides[k]
        yield first * itemsize, length


def read_slab(fd: int, base: int, shape, dtype, start, stop, fortran: bool = False) -> np.ndarray:
    """The slab ``[start, stop)`` of the array of ``shape`` and ``dtype`` stored from byte ``base`` of ``fd``
    (C order, or Fortran order: then the result is a Fortran-ordered array)."""
    shape, start, stop = tuple(shape), tuple(start), tuple(stop)
    if fortran:
        return read_slab(fd, base, shape[::-1], dtype, start[::-1], stop[::-1]).T
    dtype = np.dtype(dtype)
    out = np.empty(tuple(b - a for a, b in zip(start, stop)), dtype)
    if out.size == 0:
        return out
    if not shape:
        _pread_into(fd, _bytes(out), base)
        return out
    k, strides = _split(shape, start, stop)
    w = k
    while w > 0 and (stop[w] - start[w]) * strides[w] * dtype.itemsize < MIN_RUN:
        w -= 1
    if w == k:
        dest, pos = _bytes(out), 0
        for offset, length in _runs(shape, start, stop, dtype.itemsize, k, strides):
            _pread_into(fd, dest[pos:pos + length], base + offset)
            pos += length
        return out
    # Short runs: whole rows of dim w (every dim inside it whole), a block of rows at a time.
    row = strides[w] * dtype.itemsize
    rows_per_block = max(1, MAX_BLOCK // row)
    inner = tuple(slice(a, b) for a, b in zip(start[w + 1:], stop[w + 1:]))
    for outer in itertools.product(*(range(start[d], stop[d]) for d in range(w))):
        first = sum(i * strides[d] for d, i in enumerate(outer))
        rel = tuple(i - start[d] for d, i in enumerate(outer))
        for r0 in range(start[w], stop[w], rows_per_block):
            r1 = min(stop[w], r0 + rows_per_block)
            scratch = np.empty((r1 - r0,) + shape[w + 1:], dtype)
            _pread_into(fd, _bytes(scratch), base + (first + r0 * strides[w]) * dtype.itemsize)
            out[rel + (slice(r0 - start[w], r1 - start[w]),)] = scratch[(slice(None),) + inner]
    return out


def write_slab(fd: int, base: int, shape, data: np.ndarray, start) -> None:
    """Write ``data`` as the slab starting at ``start`` of the C-order array of ``shape`` (and ``data``'s dtype)
    stored from byte ``base`` of ``fd``: exactly the slab's bytes, one positioned write per run."""
    shape, start = tuple(shape), tuple(start)
    data = np.ascontiguousarray(data)
    if data.size == 0:
        return
    stop = tuple(a + e for a, e in zip(start, data.shape))
    if not shape:
        _pwrite_from(fd, _bytes(data), base)
        return
    k, strides = _split(shape, start, stop)
    src, pos = _bytes(data), 0
    for offset, length in _runs(shape, start, stop, data.dtype.itemsize, k, strides):
        _pwrite_from(fd, src[pos:pos + length], base + offset)
        pos += length
