"""The ShardTensor paper's three workloads as plain ``torch.nn`` models, plus synthetic data for them.

    from benchmarks.models import build          # repository root on sys.path
    model = build("vit", "tiny")                 # or "full", "tiny3d", "full3d"
    model = build("transolver", "drivaerml")     # or "tiny"
    model = build("stormscope", "small")         # or "full"

The models know nothing about sharding: give them a ShardTensor input (``shardtensor.scatter_tensor`` /
``distribute_tensor`` / ``from_local``) and they run domain-parallel. Keyword arguments override config fields
(e.g. ``build("vit", "full", img_size=(2048, 2048))``).
"""
from __future__ import annotations

from . import stormscope, synthetic, transolver, vit

_MODULES = {"vit": vit, "transolver": transolver, "stormscope": stormscope}


def configs(name: str) -> dict:
    """The named configurations of model ``name``."""
    return dict(_module(name).CONFIGS)


def build(name: str, config=None, **overrides):
    """Build model ``name`` ("vit", "transolver", "stormscope") from a named or explicit configuration."""
    mod = _module(name)
    if config is None:
        config = next(iter(c for c in ("tiny", "small") if c in mod.CONFIGS))
    if isinstance(config, str) and config not in mod.CONFIGS:
        raise ValueError(f"unknown {name} config {config!r}; choose from {sorted(mod.CONFIGS)}")
    return mod.build(config, **overrides)


def _module(name: str):
    if name not in _MODULES:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(_MODULES)}")
    return _MODULES[name]


__all__ = ["build", "configs", "vit", "transolver", "stormscope", "synthetic"]
