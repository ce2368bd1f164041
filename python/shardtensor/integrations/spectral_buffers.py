"""Spectral layers' own output buffers, laid out like the field they are written from.

Fourier layers (Li et al.'s FNO and every library that kept its code, AFNO) transform their input, then allocate the
spectrum they write into themselves -- ``out_ft = torch.zeros([batch, out_channels, *fft_size])`` -- and fill the
retained modes from the transformed input (slice writes ``out_ft[..., :m] = ...`` or ``out_ft + F.pad(...)``). With
a ShardTensor input the buffer is a plain tensor of the global shape on every rank: a slice write gives it the whole
value and every rank runs the inverse transform and the rest of the layer on the whole field (right values, work not
divided), and even the padded sum fills a global-size buffer on every rank.

``run_with_sharded_buffers(fn, *args, **kwargs)`` runs a layer's own forward unchanged but for those buffers: a
``torch.zeros`` that the forward's own code calls without tensor arguments is a ShardTensor laid out like a
ShardTensor the layer computed just before (the newest of them whose split dims exist in the buffer's shape;
preferring one whose split dims have the buffer's sizes; a pending sum's mesh dims read as Replicate): the same
placements, that tensor's extents where the sizes agree and the default split where they differ (the output
channels). Only this rank's part is allocated.
The ops that follow are the layer's own, on ShardTensors, so the values are the single-device ones. Without such a
tensor before it (nothing split yet), a buffer stays plain."""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

from .. import Replicate, device_mesh, from_local, is_shard_tensor, placements, sharding_shapes

_HISTORY = 16     # how many of the layer's newest split results a buffer may take its layout from


def run_with_sharded_buffers(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its ``torch.zeros`` buffers laid out like the split field (module docstring).
    Only the zeros ``fn``'s own code allocates: helpers it calls (a factorised weight's reconstruction, ...) keep
    their plain ones. ``fn`` may be routed (``register_function``): its own body's code is then ``__wrapped__``'s."""
    with _ShardedBuffers(getattr(fn, "__wrapped__", fn).__code__):
        return fn(*args, **kwargs)


def sharded_buffers_handler(forward):
    """The route for a layer's ``forward`` (``register_function``): its own body under ``run_with_sharded_buffers``."""
    def handler(*args, **kwargs):
        return run_with_sharded_buffers(forward, *args, **kwargs)
    handler.__name__ = f"{forward.__qualname__}_sharded"
    return handler


def _default_extents(n: int, k: int) -> list:
    """The library's default split of ``n`` over ``k`` ranks (torch.tensor_split's sizes)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _size_of(args) -> list:
    if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
        return [int(s) for s in args[0]]
    return [int(s) for s in args]


def _split_dims(t) -> list:
    return [p.dim for p in placements(t) if p.is_shard()]


def _zeros_like_layout(size, source, dtype, device, requires_grad):
    """Zeros of the global ``size`` laid out like ``source``: only this rank's part allocated."""
    mesh = device_mesh(source)
    pl = [Replicate() if p.is_partial() else p for p in placements(source)]
    shapes = sharding_shapes(source)
    coord = mesh.get_coordinate()
    local_shape, extents = list(size), {}
    for m, p in enumerate(pl):
        if p.is_shard():
            d = p.dim
            ext = list(shapes[m]) if size[d] == source.shape[d] else _default_extents(size[d], mesh.size(m))
            extents[m] = ext
            local_shape[d] = ext[coord[m]]
    local = torch.zeros(local_shape, dtype=dtype if dtype is not None else torch.get_default_dtype(),
                        device=device if device is not None else source.device)
    out = from_local(local, mesh, pl, sharding_shapes=extents, global_shape=list(size), check=False)
    return out.requires_grad_(True) if requires_grad else out


class _ShardedBuffers(TorchFunctionMode):
    """The layer's newest split results, and ``torch.zeros`` laid out like one of them."""

    def __init__(self, code):
        super().__init__()
        self.code = code    # the layer's forward: only the zeros it allocates itself are laid out
        self.recent = []    # newest last

    def _source(self, size):
        fitting = [t for t in reversed(self.recent) if all(d < len(size) for d in _split_dims(t))]
        exact = [t for t in fitting if all(size[d] == t.shape[d] for d in _split_dims(t))]
        return (exact or fitting or [None])[0]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and self.recent and kwargs.get("out") is None \
                and not any(isinstance(a, torch.Tensor) for a in args) and sys._getframe(1).f_code is self.code:
            size = _size_of(args)
            source = self._source(size)
            if source is not None:
                return _zeros_like_layout(size, source, kwargs.get("dtype"), kwargs.get("device"),
                                          bool(kwargs.get("requires_grad", False)))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and is_shard_tensor(out) and _split_dims(out):
            self.recent = (self.recent + [out])[-_HISTORY:]
        return out
