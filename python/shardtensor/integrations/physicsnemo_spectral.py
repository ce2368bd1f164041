"""PhysicsNeMo's Fourier layers with their spectrum buffers kept divided: the FNO's ``SpectralConv1d`` ... ``4d``
(``physicsnemo.nn.module.spectral_layers``) and AFNO's ``AFNO2DLayer`` / ``ModAFNO2DLayer``
(``physicsnemo.nn.module.afno_layers``: FourCastNet's token mixer), and DPOT's AFNO mixers ``DPOT2DLayer`` /
``AFNO3DLayer`` (``physicsnemo.models.dpot``).

Each allocates the spectrum it fills with ``torch.zeros`` of the global shape after transforming its input. The 1-D
spectral convolution and the AFNO layers write the retained modes into it by slices (the buffer then held the whole value on
every rank, and every rank ran the inverse transform and the rest of the layer on the whole field); the 2-D to 4-D
spectral convolutions add padded modes to it (a global-size buffer filled on every rank). Routed here
(``st.register_function``) when a ShardTensor is among a layer's arguments, the layer's own forward runs with those
buffers laid out like the transformed field (``spectral_buffers``)."""
from __future__ import annotations

from .spectral_buffers import sharded_buffers_handler

# library module -> the classes whose forward is routed
_LAYERS = {
    "physicsnemo.nn.module.spectral_layers": ("SpectralConv1d", "SpectralConv2d", "SpectralConv3d", "SpectralConv4d"),
    "physicsnemo.nn.module.afno_layers": ("AFNO2DLayer", "ModAFNO2DLayer"),
    "physicsnemo.models.dpot.dpot": ("DPOT2DLayer",),
    "physicsnemo.models.dpot.dpot3d": ("AFNO3DLayer",),
}


def install(module) -> None:
    """Route the forward of every layer of ``_LAYERS`` that the imported module defines."""
    from . import _route_forwards
    _route_forwards(module, _LAYERS[module.__name__], sharded_buffers_handler)
