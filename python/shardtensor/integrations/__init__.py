"""Domain-parallel versions of other libraries' Python functions, installed when those libraries are imported.

Most of a library reaches ShardTensors op by op through the dispatcher. A few library functions cannot: they
allocate their output as a plain tensor of the *global* shape (``torch.zeros(B, C, T)`` from ``x.shape``) and let a
custom kernel fill it, so every rank would hold, and the kernel would compute, the whole result. For those the
library routes the Python function itself (``st.register_function``) to an implementation that keeps the work
divided. (Two integrations route nothing: one tells opt_einsum which backend serves a traced shard inside
torch.compile; one gives torchdiffeq's solver modules a ``torch`` whose ``empty`` lays their buffers out like the
state.) Each integration module names the functions it routes; ``INTEGRATIONS`` maps the library module that
defines them to the module that routes them.

The routing is installed the moment the library module is imported (before or after ``import shardtensor``): an
import hook on ``sys.meta_path`` runs the integration right after the module's own code. Nothing is imported that
the user did not import; ``SHARDTENSOR_NO_INTEGRATIONS=1`` turns every integration off.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading

__all__ = ["INTEGRATIONS", "install", "installed"]

# library module -> integration module (in this package) whose ``install(module)`` routes its functions
INTEGRATIONS = {
    "torchaudio.functional.filtering": "torchaudio_filtering",
    "neuralop.layers.gno_block": "neuralop_gno",
    "neuralop.layers.spectral_convolution": "neuralop_spectral",
    "physicsnemo.nn.module.hpx.padding": "physicsnemo_healpix",
    "physicsnemo.nn.module.spectral_layers": "physicsnemo_spectral",
    "physicsnemo.nn.module.afno_layers": "physicsnemo_spectral",
    "physicsnemo.models.dpot.dpot": "physicsnemo_spectral",
    "physicsnemo.models.dpot.dpot3d": "physicsnemo_spectral",
    "torch_harmonics.disco.convolution": "torch_harmonics_disco",
    "opt_einsum.backends.dispatch": "opt_einsum_backend",
    "transformers.models.wavlm.modeling_wavlm": "relative_position_bias",
    "torchaudio.models.wav2vec2.wavlm_attention": "relative_position_bias",
    "torch._higher_order_ops.while_loop": "torch_control_flow",
    "torch._higher_order_ops.cond": "torch_control_flow",
    "torchvision.ops.poolers": "torchvision_roi_pooling",
    "diffusers.models.transformers.transformer_ltx": "rotary_positions",
    "timm.models.gemma4_vit": "rotary_positions",
    "torchdiffeq._impl.odeint": "torchdiffeq_buffers",
    "torchdiffeq._impl.solvers": "torchdiffeq_buffers",
    "torchdiffeq._impl.rk_common": "torchdiffeq_buffers",
}

_installed: set = set()
_lock = threading.Lock()


def _route_forwards(module, class_names, handler_for) -> None:
    """Route the ``forward`` each named class of ``module`` defines itself to ``handler_for(forward)``."""
    from ..functions import register_function
    for name in class_names:
        cls = getattr(module, name, None)
        forward = cls.__dict__.get("forward") if cls is not None else None
        if forward is not None:
            register_function(forward, handler_for(forward))


def installed() -> tuple:
    """The library modules whose functions are routed in this process."""
    return tuple(sorted(_installed))


def _apply(name: str, module) -> None:
    with _lock:
        if name in _installed:
            return
        _installed.add(name)
    integration = importlib.import_module(f"{__name__}.{INTEGRATIONS[name]}")
    integration.install(module)


class _Loader(importlib.abc.Loader):
    """The library module's own loader, then the integration."""

    def __init__(self, name, loader):
        self.name, self.loader = name, loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _apply(self.name, module)

    def __getattr__(self, attr):  # get_code, get_source, is_package, ... of the wrapped loader
        return getattr(self.loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the integrated library modules with the other finders and wraps their loaders."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in INTEGRATIONS or fullname in _installed:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(fullname, spec.loader)
                return spec
        return None


_finder = _Finder()


def install() -> None:
    """Route the integrated functions of every library module already imported, and those imported later."""
    if os.environ.get("SHARDTENSOR_NO_INTEGRATIONS", "") not in ("", "0"):
        return
    for name in INTEGRATIONS:
        module = sys.modules.get(name)
        if module is not None:
            _apply(name, module)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
