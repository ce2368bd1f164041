"""The one writing flow every format shares: each rank writes only its own slab, nothing is gathered, and the result
appears under its name only once every rank has written its part.

Phases, each followed by ``agree`` over the whole mesh (a barrier that also makes a failure on one rank raise on
every rank): the mesh's first rank creates the output under a temporary name (``.NAME.shardtensor-partial`` beside
it, or a temporary dataset / array name inside an HDF5 file or zarr group) at the global shape and dtype; then the
writing ranks fill their slabs (ranks holding copies along replicated mesh dims leave it to coordinate 0 of those
dims, so every element is written once); formats that cannot take concurrent writers to some region add phases in
which one rank writes at a time; last, after every rank reported success, the first rank publishes the output
under its name (an atomic rename). A rank that fails or dies mid-write leaves no file under the name (an earlier
file there stays as it was); the survivors raise naming the save and, when the job's store can tell, the rank
that stopped, and the first rank removes the temporary output. Every rank computes the same phases from the
ShardTensor's layout, so the collectives match.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .layout import Layout, layout_of
from .sync import Progress, agree, mesh_groups


def numpy_dtype(what: str, dtype: torch.dtype) -> np.dtype:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise TypeError(f"{what}: {dtype} has no NumPy dtype, so no file format here can store it; cast first "
                        "(e.g. x.float())") from None


def local_array(x) -> np.ndarray:
    """This rank's slab as a C-ordered NumPy array on the CPU."""
    from .. import to_local
    local = to_local(x).detach()
    return np.ascontiguousarray(local.cpu().numpy())


def prepare(x, what: str):
    """(layout, mesh, NumPy dtype) of a ShardTensor to write; raises alike on every rank (from the spec only)."""
    from .. import _check, device_mesh
    _check(x, what)
    layout = layout_of(x, what)
    mesh = device_mesh(x)
    mesh_groups(mesh, what)
    return layout, mesh, numpy_dtype(what, x.dtype)


def temporary_path(path: str) -> str:
    """Where an output is built before it is published under ``path``: a hidden sibling."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.shardtensor-partial")


def run_phases(mesh, what: str, phases: Sequence[Optional[Callable[[], None]]],
               cleanup: Optional[Callable[[], None]] = None) -> None:
    """Run each phase (``None``: nothing to do on this rank), then ``agree``; the number of phases must be the
    same on every rank. When any rank fails (or dies), ``cleanup`` runs on this rank (when given) before the error
    propagates."""
    progress = Progress(mesh, what)
    try:
        for step, phase in enumerate(phases):
            failure = None
            if phase is not None:
                try:
                    phase()
                except Exception as e:  # every rank learns of it in agree, and raises
                    failure = e
            agree(mesh, failure, what, progress, step)
    except BaseException:
        if cleanup is not None:
            try:
                cleanup()
            except Exception:  # noqa: BLE001  (the save's own error is the one to report)
                pass
        raise
    progress.forget(len(phases))


def remove_quietly(path: str) -> None:
    import shutil
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def create_then_write(x, what: str, path: str, create: Callable[[str, Layout, np.dtype], None],
                      write: Callable[[str, Layout, np.ndarray], None]) -> None:
    """The phases of a single-file format: the first rank creates the file under a temporary name, every writing
    rank writes its slab there, and the first rank renames it to ``path`` once every rank succeeded."""
    layout, mesh, dtype = prepare(x, what)
    data = local_array(x)
    temp = temporary_path(path)
    run_phases(mesh, what, [
        (lambda: create(temp, layout, dtype)) if layout.is_root else None,
        (lambda: write(temp, layout, data)) if layout.is_writer and data.size else None,
        (lambda: os.replace(temp, path)) if layout.is_root else None,
    ], cleanup=(lambda: remove_quietly(temp)) if layout.is_root else None)
