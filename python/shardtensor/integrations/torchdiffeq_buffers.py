"""torchdiffeq's solver buffers, laid out like the state they hold.

torchdiffeq's solvers keep the solution at the requested times and each Runge-Kutta step's stage derivatives in
buffers they allocate with ``torch.empty`` from the state's global shape -- ``torch.empty(len(t), *y0.shape)``
(``odeint``, the fixed-grid and adaptive solvers' ``integrate``) and ``torch.empty(*f0.shape, stages)``
(``rk_common._runge_kutta_step``) -- and then fill them from the state. With a ShardTensor state those buffers were
plain tensors of the global shape on every rank: each write gathered the whole field into them (an all-gather per
stage of every step), every rank held the whole solution, and the solution returned was plain.

Here those ``torch.empty`` calls, made by torchdiffeq's own code in the modules above, allocate a ShardTensor laid
out like the state when a ShardTensor state is in the calling frame (a local variable, or a solver's ``y0``) and the
requested shape is the state's with one dim added in front or behind: the state's placements moved past the new
dim, its extents, only this rank's part allocated. The solver's code then runs unchanged on ShardTensors, so the
values are the single-device ones. Every other call is ``torch.empty`` itself.

The modules' ``torch`` global is replaced by a stand-in that forwards every other attribute to torch (only
torchdiffeq's own code in these modules sees it; the vector field the user integrates does not).
"""
from __future__ import annotations

import sys

import torch

from .. import Shard, device_mesh, from_local, is_shard_tensor, placements, sharding_shapes

__all__ = ["install"]


def _states_in(frame):
    """The ShardTensor states the calling code holds: its local ShardTensors and its objects' ``y0``."""
    for value in frame.f_locals.values():
        if isinstance(value, torch.Tensor):
            if is_shard_tensor(value):
                yield value
        else:
            y0 = getattr(value, "y0", None)
            if isinstance(y0, torch.Tensor) and is_shard_tensor(y0):
                yield y0


def _layout_like(state, size, lead, dtype, device):
    """An empty ShardTensor of the global ``size``: ``state``'s layout with ``lead`` new dims in front (1) or a new
    dim behind (0); only this rank's part allocated."""
    mesh = device_mesh(state)
    pl, extents = [], {}
    shapes = sharding_shapes(state)
    local_shape = list(size)
    coord = mesh.get_coordinate()
    for m, p in enumerate(placements(state)):
        if p.is_shard():
            d = p.dim + lead
            pl.append(Shard(d))
            extents[m] = list(shapes[m])
            local_shape[d] = extents[m][coord[m]]
        elif p.is_partial():
            return None     # a pending sum is no layout to allocate in (the solvers hold complete states)
        else:
            pl.append(p)
    local = torch.empty(local_shape, dtype=dtype if dtype is not None else state.dtype,
                        device=device if device is not None else state.device)
    return from_local(local, mesh, pl, sharding_shapes=extents, global_shape=list(size), check=False)


def _sharded_empty(*size, dtype=None, device=None, **kwargs):
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    if not kwargs and all(isinstance(s, int) for s in size):
        shape = list(size)
        for state in _states_in(sys._getframe(1)):
            dims = list(state.shape)
            if len(shape) == len(dims) + 1 and shape[1:] == dims:
                out = _layout_like(state, shape, 1, dtype, device)
            elif len(shape) == len(dims) + 1 and shape[:-1] == dims:
                out = _layout_like(state, shape, 0, dtype, device)
            else:
                continue
            if out is not None:
                return out
    return torch.empty(*size, dtype=dtype, device=device, **kwargs)


class _Torch:
    """``torch`` for torchdiffeq's solver modules: ``empty`` laid out like the state, everything else torch's."""

    empty = staticmethod(_sharded_empty)

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH = _Torch()


def install(module) -> None:
    module.torch = _TORCH
