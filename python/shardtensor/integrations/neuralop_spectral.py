"""neuraloperator's spectral convolution (``neuralop.layers.spectral_convolution.SpectralConv``: FNO, TFNO, UNO and
every model built on their Fourier layers) with its spectrum kept divided.

The layer's forward transforms its input (``rfftn``/``fftn``; the library's FFT rule keeps the result split, along the
channels when every spatial dim is transformed), contracts the retained modes with the weights, and writes them into
a buffer it allocates itself, ``torch.zeros([batch, out_channels, *fft_size])``, before the inverse transform. That
buffer is a plain tensor of the global shape: the write gives it the whole value on every rank, and every rank ran
the inverse transform, and everything after it in the layer, on the whole field (right values, work not divided).

Routed here (``st.register_function``) when a ShardTensor is among its arguments, the layer's own forward runs
unchanged with one difference: a ``torch.zeros`` it calls without tensor arguments after a transform returned a
ShardTensor (the spectrum) is a ShardTensor laid out like that spectrum -- the same placements and, on each split
dim, the spectrum's extents where the sizes agree, the default split where they do not (the output channels). Only
this rank's part is allocated; the write into it keeps each rank's modes; the inverse transform runs on each rank's
part. The values are the single-device ones (the same ops in the same order)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .. import device_mesh, from_local, is_shard_tensor, placements, sharding_shapes

_spectral_forward = None    # SpectralConv.forward: inside the handler, calls of it run its own body

# The transforms whose ShardTensor result is the spectrum the buffer is written from.
_TRANSFORMS = {torch.fft.rfftn, torch.fft.fftn, torch.fft.rfft2, torch.fft.fft2, torch.fft.rfft, torch.fft.fft,
               torch.fft.fftshift}


def install(module) -> None:
    """Route ``SpectralConv.forward`` of the imported ``neuralop.layers.spectral_convolution``."""
    global _spectral_forward
    from ..functions import register_function
    _spectral_forward = module.SpectralConv.forward
    register_function(module.SpectralConv.forward, spectral_forward_sharded)


def spectral_forward_sharded(conv, x, *args, **kwargs):
    """``SpectralConv.forward(x, ...)`` with a ShardTensor among its arguments (see the module's docstring)."""
    with _SpectrumBuffers():
        return _spectral_forward(conv, x, *args, **kwargs)


def _default_extents(n: int, k: int) -> list:
    """The library's default split of ``n`` over ``k`` ranks (torch.tensor_split's sizes)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _zeros_like_layout(size, spectrum, dtype, device, requires_grad):
    """Zeros of the global ``size`` laid out like ``spectrum``: only this rank's part allocated."""
    mesh = device_mesh(spectrum)
    pl = placements(spectrum)
    shapes = sharding_shapes(spectrum)
    coord = mesh.get_coordinate()
    local_shape, extents = list(size), {}
    for m, p in enumerate(pl):
        if not p.is_shard():
            continue
        d = p.dim
        ext = list(shapes[m]) if size[d] == spectrum.shape[d] else _default_extents(size[d], mesh.size(m))
        extents[m] = ext
        local_shape[d] = ext[coord[m]]
    local = torch.zeros(local_shape, dtype=dtype if dtype is not None else spectrum.dtype,
                        device=device if device is not None else spectrum.device)
    out = from_local(local, mesh, pl, sharding_shapes=extents, global_shape=list(size), check=False)
    return out.requires_grad_(requires_grad) if requires_grad else out


def _size_of(args):
    if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
        return [int(s) for s in args[0]]
    return [int(s) for s in args]


class _SpectrumBuffers(TorchFunctionMode):
    """Inside the routed forward: the last transform's ShardTensor result, and ``torch.zeros`` laid out like it."""

    def __init__(self):
        super().__init__()
        self.spectrum = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and self.spectrum is not None and kwargs.get("out") is None \
                and not any(isinstance(a, torch.Tensor) for a in args):
            size = _size_of(args)
            if len(size) == self.spectrum.dim() and all(
                    not p.is_shard() or size[p.dim] >= 1 for p in placements(self.spectrum)):
                return _zeros_like_layout(size, self.spectrum, kwargs.get("dtype"), kwargs.get("device"),
                                          bool(kwargs.get("requires_grad", False)))
        out = func(*args, **kwargs)
        if func in _TRANSFORMS and is_shard_tensor(out):
            self.spectrum = out
        return out
