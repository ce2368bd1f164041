"""The model zoo's twenty-first set: Microsoft's Aurora weather foundation model (the thirty-fifth session), small
configurations of the real architecture -- surface, static and pressure-level variables patch-embedded per variable,
a Perceiver aggregating the pressure levels into latent levels, latitude/longitude position and patch-area scale
encodings (max pooling of the coordinate grid, spherical patch areas), lead-time and absolute-time embeddings, a 3-D
Swin U-Net backbone (shifted windows over latent level x latitude x longitude, with the longitude wrapping around)
and the per-variable Perceiver decoder; variants with LoRA, level conditioning, positive-variable clamps and an
autoregressive two-step roll-out (`aurora.rollout`: the prediction joins the history window).

Aurora takes an `aurora.Batch`, not a tensor: the adapter below is the data pipeline of a user who splits the
latitude rows across ranks -- it cuts the zoo's one input (B, T, variables, lat, lon) into the Batch's variables and
lays the latitude and longitude vectors out like the field's rows and columns (`distribute_tensor` with the field's
own extents), the way a user shards every tensor of the Batch alike. The model itself is unmodified. Registered like
zoo_models.py's (zoo_models.py imports this module at its end)."""
import datetime

import torch
import torch.nn as nn

from benchmarks.zoo.zoo_models import model

_SURF = ("2t", "10u", "10v", "msl")
_STATIC = ("lsm", "z", "slt")
_ATMOS = ("z", "u", "v", "t", "q")
_LEVELS = (100, 250, 500)
_CHANNELS = len(_SURF) + len(_ATMOS) * len(_LEVELS) + len(_STATIC)


def _laid_out_like(v: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """The full coordinate vector ``v`` laid out like ``x``'s ``dim`` (its extents on the mesh dims that split
    it; replicated over the others); ``v`` itself when ``x`` is a plain tensor."""
    import shardtensor as st
    if not st.is_shard_tensor(x):
        return v
    shapes = st.sharding_shapes(x)
    placements = [st.Shard(0) if isinstance(p, st.Shard) and p.dim % x.dim() == dim % x.dim() else st.Replicate()
                  for p in st.placements(x)]
    own = {i: shapes[i] for i, p in enumerate(placements) if isinstance(p, st.Shard)}
    return st.distribute_tensor(v, st.device_mesh(x), placements, sharding_shapes=own or None)


class _AuroraOnField(nn.Module):
    """One Aurora forward (or a roll-out of ``steps``) on the Batch cut from one (B, T, C, H, W) tensor; returns the
    predicted surface and atmospheric variables."""

    def __init__(self, steps: int = 1, **config):
        super().__init__()
        from aurora import Aurora
        defaults = dict(surf_vars=_SURF, static_vars=_STATIC, atmos_vars=_ATMOS, embed_dim=32, num_heads=4,
                        encoder_depths=(1, 1), encoder_num_heads=(2, 4), decoder_depths=(1, 1),
                        decoder_num_heads=(4, 2), window_size=(2, 2, 4), patch_size=2, latent_levels=2,
                        use_lora=False)
        self.aurora = Aurora(**{**defaults, **config})
        self.steps = steps

    def forward(self, x):
        from aurora import Batch, Metadata, rollout
        B, T, C, H, W = x.shape
        ns, na = len(_SURF), len(_ATMOS) * len(_LEVELS)
        atmos = x[:, :, ns:ns + na].unflatten(2, (len(_ATMOS), len(_LEVELS)))
        lat = torch.linspace(90, -90, H, dtype=torch.float64)
        lon = torch.linspace(0, 360, W + 1, dtype=torch.float64)[:-1]
        batch = Batch(surf_vars={k: x[:, :, i] for i, k in enumerate(_SURF)},
                      static_vars={k: x[0, 0, ns + na + i] for i, k in enumerate(_STATIC)},
                      atmos_vars={k: atmos[:, :, i] for i, k in enumerate(_ATMOS)},
                      metadata=Metadata(lat=_laid_out_like(lat, x, 3), lon=_laid_out_like(lon, x, 4),
                                        time=tuple(datetime.datetime(2020, 6, 1, 6 * b) for b in range(B)),
                                        atmos_levels=_LEVELS))
        if self.steps == 1:
            preds = [self.aurora(batch)]
        else:
            preds = list(rollout(self.aurora, batch, steps=self.steps))
        return tuple(v for p in preds for d in (p.surf_vars, p.atmos_vars) for v in d.values())


def _register(name, note, shape=(1, 2, _CHANNELS, 17, 32), **kw):
    model("aurora", f"aurora/{name}", shape, shard_dims=(3,), spatial=(3, 4), align=2, note=note)(
        lambda: _AuroraOnField(**kw))


_register("Aurora", "per-variable patch embedding, Perceiver level aggregation, 3-D Swin U-Net, 17 rows cropped to 16")
_register("Aurora_lora", "LoRA adapters in every attention (rollout step 0)", use_lora=True)
_register("Aurora_level_condition", "level-conditioned patch embedding (one embedding for all pressure levels)",
          level_condition=_LEVELS)
_register("Aurora_positive", "positive variables clamped at the input and the output",
          positive_surf_vars=("msl",), positive_atmos_vars=("q",), clamp_at_first_step=True)
_register("Aurora_rollout", "two autoregressive steps (aurora.rollout): the prediction joins the history",
          shape=(1, 2, _CHANNELS, 16, 32), steps=2)
