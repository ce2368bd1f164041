"""The one writing flow every format shares: each rank writes only its own slab, nothing is gathered.

Phases, each followed by ``agree`` over the whole mesh (a barrier that also makes a failure on one rank raise on
every rank): the mesh's first rank creates the file at the global shape and dtype; then the writing ranks fill
their slabs (ranks holding copies along replicated mesh dims leave it to coordinate 0 of those dims, so every
element is written once); formats that cannot take concurrent writers to some region add phases in which one rank
writes at a time. Every rank computes the same phases from the ShardTensor's layout, so the collectives match.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .layout import Layout, layout_of
from .sync import agree, mesh_groups


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


def run_phases(mesh, what: str, phases: Sequence[Optional[Callable[[], None]]]) -> None:
    """Run each phase (``None``: nothing to do on this rank), then ``agree``; the number of phases must be the
    same on every rank."""
    for phase in phases:
        failure = None
        if phase is not None:
            try:
                phase()
            except Exception as e:  # every rank learns of it in agree, and raises
                failure = e
        agree(mesh, failure, what)


def create_then_write(x, what: str, create: Callable[[Layout, np.dtype], None],
                      write: Callable[[Layout, np.ndarray], None]) -> None:
    """The two phases most formats need: the first rank creates, then every writing rank writes its slab."""
    layout, mesh, dtype = prepare(x, what)
    data = local_array(x)
    run_phases(mesh, what, [
        (lambda: create(layout, dtype)) if layout.is_root else None,
        (lambda: write(layout, data)) if layout.is_writer and data.size else None,
    ])
