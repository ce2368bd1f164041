"""neuraloperator's spectral convolution (``neuralop.layers.spectral_convolution.SpectralConv``: FNO, TFNO, UNO and
every model built on their Fourier layers) with its spectrum kept divided.

The layer transforms its input (the library's FFT rule keeps the result split, along the channels when every spatial
dim is transformed), contracts the retained modes with the weights and writes them into
``torch.zeros([batch, out_channels, *fft_size])``, a buffer it allocates itself: plain and of the global shape, so the
write gave it the whole value on every rank and every rank ran the inverse transform on the whole field. Routed here
(``st.register_function``) when a ShardTensor is among its arguments, the layer's own forward runs with that buffer
laid out like the transformed field (``spectral_buffers``)."""
from __future__ import annotations

from .spectral_buffers import sharded_buffers_handler


def install(module) -> None:
    """Route ``SpectralConv.forward`` of the imported ``neuralop.layers.spectral_convolution``."""
    from . import _route_forwards
    _route_forwards(module, ("SpectralConv",), sharded_buffers_handler)
