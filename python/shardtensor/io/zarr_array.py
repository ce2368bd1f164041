"""Zarr arrays through zarr-python: each rank reads the chunks its slab intersects; writers never share a chunk.

Writing: concurrent writes to distinct chunks are safe (each chunk is its own object in the store), but two
ranks writing parts of one chunk would each read, modify and write the whole chunk, and one update would be lost.
So each writing rank first writes, concurrently with the others, the part of its slab that covers whole chunks
(chunks that lie inside its slab belong to no other rank); the rest of its slab, the rim around it in chunks
shared with neighbours, is written in turns, one rank at a time with a barrier after each turn. The default
chunks are aligned with the shards where the extents allow it (their greatest common divisor, when that is at
least 1/16 of the largest extent), so evenly divisible layouts have no rims and no turns; otherwise chunks of
1/16 of the largest extent keep the rims thin. Chunks larger than 32 MiB are halved along their largest unsharded
dim first.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import numpy as np

from ..placement import Shard
from .layout import Layout
from .loader import ArraySource, load, require
from .writer import local_array, prepare, remove_quietly, run_phases, temporary_path

MAX_CHUNK_BYTES = 32 << 20


def _zarr(what):
    return require("zarr", "zarr", what)


def open_array(zarr, source, name: Optional[str], what: str):
    """The zarr array at ``source`` (a path or store, a ``zarr.Group`` plus ``name``, or a ``zarr.Array``)."""
    if isinstance(source, zarr.Array):
        if name is not None:
            raise ValueError(f"{what}: got a zarr array and name={name!r}; give a group (or a path) with the name, "
                             "or the array alone")
        return source
    node = source if isinstance(source, zarr.Group) else zarr.open(store=source, mode="r")
    if isinstance(node, zarr.Array):
        if name is not None:
            raise ValueError(f"{what}: {source} is an array, not a group with {name!r} in it")
        return node
    if name is None:
        raise ValueError(f"{what}: {source} is a zarr group; name the array to read (name=...); arrays there: "
                         f"{sorted(k for k, _ in node.arrays()) or 'none'}")
    try:
        arr = node[name]
    except KeyError:
        arr = None
    if not isinstance(arr, zarr.Array):
        raise ValueError(f"{what}: no array {name!r} in the zarr group {source} (arrays there: "
                         f"{sorted(k for k, _ in node.arrays()) or 'none'})")
    return arr


def load_zarr(path_or_array, mesh, placements, sharding_shapes=None, *, name: Optional[str] = None,
              global_shape=None, device=None, dtype=None, check: bool = True):
    """A ShardTensor of a zarr array; each rank reads (and decompresses) only the chunks its slab intersects.

    ``path_or_array``: a path or zarr store (an array, or a group with the array's ``name`` in it), a
    ``zarr.Group`` with ``name``, or a ``zarr.Array``. A missing array raises ``ValueError`` naming those there.
    The other arguments as for ``load_npy``."""
    zarr = _zarr("load_zarr")

    @contextlib.contextmanager
    def open_source():
        yield ArraySource(open_array(zarr, path_or_array, name, "load_zarr"), "load_zarr")

    return load("load_zarr", open_source, mesh, placements, sharding_shapes, global_shape, device, dtype, check)


# ---- writing ----

def default_chunks(layout: Layout, itemsize: int) -> tuple:
    """Chunks aligned with the shards where the extents allow (see the module doc)."""
    sharded = {p.dim: m for m, p in enumerate(layout.placements) if isinstance(p, Shard)}
    chunks = []
    for d, n in enumerate(layout.global_shape):
        if d not in sharded:
            chunks.append(max(n, 1))
            continue
        extents = layout.extents[sharded[d]]
        offsets = [sum(extents[:i]) for i in range(1, len(extents))]
        g = math.gcd(*[o for o in offsets if 0 < o < n]) or n
        biggest = max(extents)
        chunks.append(max(1, g if 16 * g >= biggest else -(-biggest // 16)))
    # Smaller chunks: halve the largest unsharded dim (no effect on alignment), else an even sharded chunk.
    while math.prod(chunks) * itemsize > MAX_CHUNK_BYTES:
        free = [d for d in range(len(chunks)) if d not in sharded and chunks[d] > 1] or \
               [d for d in range(len(chunks)) if d in sharded and chunks[d] % 2 == 0]
        if not free:
            break
        d = max(free, key=lambda d: chunks[d])
        chunks[d] = -(-chunks[d] // 2)
    return tuple(chunks)


def split_by_chunks(start, stop, shape, chunks):
    """(inner, rims) of the slab ``[start, stop)``: ``inner`` the box of whole chunks inside it (or None), ``rims``
    the boxes covering the rest, each a (start, stop) pair."""
    if any(a == b for a, b in zip(start, stop)):
        return None, []
    lo, hi = [], []
    for a, b, n, c in zip(start, stop, shape, chunks):
        lo.append(-(-a // c) * c)
        hi.append(b if b == n else b // c * c)
    if any(a >= b for a, b in zip(lo, hi)):
        return None, [(tuple(start), tuple(stop))]
    rims = []
    for d in range(len(start)):
        before_lo = tuple(lo[:d]) + (start[d],) + tuple(start[d + 1:])
        before_hi = tuple(hi[:d]) + (lo[d],) + tuple(stop[d + 1:])
        after_lo = tuple(lo[:d]) + (hi[d],) + tuple(start[d + 1:])
        after_hi = tuple(hi[:d]) + (stop[d],) + tuple(stop[d + 1:])
        for box in ((before_lo, before_hi), (after_lo, after_hi)):
            if all(a < b for a, b in zip(*box)):
                rims.append(box)
    return (tuple(lo), tuple(hi)), rims


def _write_box(arr, data, slab_start, box):
    a, b = box
    target = tuple(slice(x, y) for x, y in zip(a, b))
    source = tuple(slice(x - s, y - s) for x, y, s in zip(a, b, slab_start))
    arr[target] = data[source]


def _is_local_path(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path)


def save_zarr(x, path, name: Optional[str] = None, *, chunks=None, mode: str = "w", **create_kwargs) -> None:
    """Write the ShardTensor ``x`` as a zarr array at ``path`` (a path or store; ``name``: the array's path in the
    group there), each rank writing only its slab (collective over ``x``'s mesh; nothing is gathered; no chunk is
    written by two ranks at once: see the module doc). ``chunks``: default aligned with the shards.
    ``mode``: ``"w"`` replaces an array there, ``"a"`` refuses to. ``create_kwargs`` go to
    ``zarr.create_array`` (``compressors=``, ``zarr_format=``, ``fill_value=``, ...). ``Partial`` values raise
    ``ValueError``. On a local path the array is built under a temporary name (a sibling directory, or a sibling
    array in the group) and renamed into place once every rank wrote its slab, so a save that fails or is killed
    never leaves an array under the name that loads (an array it replaces stays until the rename); other stores
    are written in place."""
    zarr = _zarr("save_zarr")
    if mode not in ("w", "a"):
        raise ValueError(f"save_zarr: mode must be 'w' (replace) or 'a' (refuse to replace), got {mode!r}")
    what = f"save_zarr({path!r}{', ' + repr(name) if name else ''})"
    layout, mesh, dtype = prepare(x, what)
    data = local_array(x)
    chunks = tuple(int(c) for c in chunks) if chunks is not None else default_chunks(layout, dtype.itemsize)
    if len(chunks) != len(layout.global_shape):
        raise ValueError(f"save_zarr: chunks {chunks} for a {len(layout.global_shape)}-d tensor")
    arrays = []
    staged = _is_local_path(path)
    if staged:
        path = os.fspath(path)
        target = os.path.join(path, name) if name else path        # the array's directory
        temp = temporary_path(target)
        store, array_name = (path, os.path.relpath(temp, path)) if name else (temp, None)
    else:
        store, array_name = path, name

    def create():
        if staged and mode == "a" and os.path.exists(target):
            raise ValueError(f"save_zarr: {target} exists; mode='a' refuses to replace it (mode='w' replaces it)")
        zarr.create_array(store=store, name=array_name, shape=layout.global_shape, dtype=dtype, chunks=chunks,
                          overwrite=staged or mode == "w", **create_kwargs)

    def opened():
        if not arrays:
            arrays.append(zarr.open_array(store=store, path=array_name or "", mode="r+"))
        return arrays[0]

    def write_inner(box):
        _write_box(opened(), data, layout.start, box)

    def write_rims(rims):
        for box in rims:
            _write_box(opened(), data, layout.start, box)

    def publish():
        if os.path.exists(target):
            old = temp + "-replaced"
            remove_quietly(old)
            os.rename(target, old)
            os.rename(temp, target)
            remove_quietly(old)
        else:
            os.rename(temp, target)

    # Every rank derives the same turns from the layout (the writers' slabs, in mesh order).
    mine_inner, mine_rims = split_by_chunks(layout.start, layout.stop, layout.global_shape, chunks)
    turns = []
    for coord, start, stop in layout.writer_slabs():
        _, rims = split_by_chunks(start, stop, layout.global_shape, chunks)
        if rims:
            turns.append(coord)
    phases = [create if layout.is_root else None,
              (lambda: write_inner(mine_inner)) if layout.is_writer and mine_inner else None]
    phases += [(lambda: write_rims(mine_rims)) if coord == layout.coordinate else None for coord in turns]
    if staged:
        phases.append(publish if layout.is_root else None)
    run_phases(mesh, what, phases,
               cleanup=(lambda: remove_quietly(temp)) if staged and layout.is_root else None)
