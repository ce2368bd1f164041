"""torch-harmonics' DISCO convolutions (``torch_harmonics.disco.convolution.DiscreteContinuousConvS2`` and
``DiscreteContinuousConvTransposeS2``) inside ``torch.compile``.

Eagerly the library's rule for the custom ops the layers call (``disco_kernels._disco_s2_contraction_optimized``
and its transpose, ``src/ops/torch_harmonics_disco.cpp``) computes each rank's latitude rows from a filter cut to its
block: it reads the filter's CSR index tensors, which a tracer's fake tensors do not hold (Dynamo raised "The tensor
has a non-zero number of elements, but its data is not allocated yet" for a spherical U-Net). Routed here
(``st.register_function``), a layer's ``forward`` runs its own body unchanged -- so eagerly nothing changes -- and
inside compiled code the route breaks the graph and runs the layer eagerly on the traced shards, like every routed
function (``functions.call_eagerly``)."""
from __future__ import annotations

_LAYERS = ("DiscreteContinuousConvS2", "DiscreteContinuousConvTransposeS2")


def install(module) -> None:
    """Route the forward of both DISCO layers of the imported ``torch_harmonics.disco.convolution``."""
    from . import _route_forwards
    _route_forwards(module, _LAYERS, _own_body)


def _own_body(forward):
    def handler(*args, **kwargs):
        return forward(*args, **kwargs)    # inside the handler the routed function runs its own body
    handler.__name__ = f"{forward.__qualname__}_eager"
    return handler
