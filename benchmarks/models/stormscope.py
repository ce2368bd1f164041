"""A StormScope-like diffusion transformer (DiT) on a 2-D grid, as a plain ``torch.nn`` model.

Patch embedding (Conv2d, kernel = stride = patch) -> token grid ``(B, X, Y, C)`` plus a learned positional
embedding of shape ``(1, X, Y, C)``; ``depth`` DiT blocks with adaLN-Zero conditioning (a noise-level
embedding -> MLP -> per-block shift/scale/gate, zero-initialised) and 2-D neighbourhood attention; a final
adaLN + linear layer to ``patch * patch * out_channels`` values per token, unpatchified back to the grid.

The grid stays tokens-first (``(B, X, Y, ...)``) throughout, so an input sharded along its height (``Shard(2)``
of ``(B, C, H, W)``) gives tokens sharded along ``X``: the patch convolution, the linears and the norms are
local, the positional embedding (a plain parameter) is sliced to each rank's rows by the library, the
conditioning vectors are plain ``(B, C)`` tensors broadcast over the grid, and the neighbourhood attention
exchanges ``kernel // 2`` halo rows.

Neighbourhood attention: ``attention_fn(q, k, v, kernel_size)`` with ``q, k, v`` of shape ``(B, X, Y, heads,
head_dim)`` and NATTEN's border rule (the K-wide window of position ``i`` starts at ``clamp(i - K // 2, 0,
L - K)``). By default it is ``shardtensor.ops.neighborhood_attention2d``; set ``model.attention_fn`` (or pass
``attention_fn=`` to ``build``) to use another implementation with the same semantics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# GOES-East ABI bands of the 3 km StormScope GOES model (the state and the forecast target).
GOES_BANDS = ("abi01c", "abi02c", "abi03c", "abi07c", "abi08c", "abi09c", "abi10c", "abi13c")
# Conditioning: the previous GOES state, normalised lat/lon, cos-zenith at input and target times, invariants.
CONDITION_CHANNELS = GOES_BANDS + ("lat", "lon", "cos_zenith_in", "cos_zenith_out", "topo", "nexrad_proximity")
IN_CHANNELS = len(GOES_BANDS) + len(CONDITION_CHANNELS)  # the noisy target concatenated with the condition: 22
OUT_CHANNELS = len(GOES_BANDS)                           # 8


@dataclass(frozen=True)
class StormScopeConfig:
    img_size: Tuple[int, int] = (1024, 1792)  # the HRRR CONUS 3 km crop
    in_channels: int = IN_CHANNELS
    out_channels: int = OUT_CHANNELS
    patch_size: int = 4
    hidden_size: int = 768
    depth: int = 16
    num_heads: int = 16
    mlp_ratio: float = 4.0
    attn_kernel: int = 31
    freq_dim: int = 256       # sinusoidal noise-level embedding width

    @property
    def grid(self) -> Tuple[int, int]:
        return (self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size)


CONFIGS = {
    "full": StormScopeConfig(),
    # The paper report's CPU-sized configuration: real channel counts, the 4:7 aspect ratio.
    "small": StormScopeConfig(img_size=(64, 112), hidden_size=64, depth=2, num_heads=4, attn_kernel=5, freq_dim=32),
}


def default_attention(q, k, v, kernel_size: int):
    """The library's sharded 2-D neighbourhood attention (q/k/v ``(B, X, Y, heads, head_dim)``)."""
    try:
        from shardtensor.ops import neighborhood_attention2d
    except ImportError as e:  # the op lands in a separate branch
        raise NotImplementedError(
            "shardtensor.ops.neighborhood_attention2d is not available in this build; set model.attention_fn "
            "to an implementation with NATTEN semantics (q, k, v of shape (B, X, Y, heads, head_dim))") from e
    return neighborhood_attention2d(q, k, v, kernel_size)


def modulate(x, shift, scale):
    """adaLN: ``x * (1 + scale) + shift`` with (B, C) conditioning broadcast over the token grid (B, X, Y, C)."""
    return x * (1 + scale[:, None, None, :]) + shift[:, None, None, :]


class NoiseLevelEmbedding(nn.Module):
    """Sinusoidal features of the (log) noise level -> MLP (the DiT timestep embedder)."""

    def __init__(self, hidden: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, sigma):
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half)
        args = (sigma.float().log() / 4)[:, None] * 1000.0 * freqs[None]  # EDM's c_noise = ln(sigma) / 4
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.mlp[0].weight.dtype))


class NeighborhoodSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, kernel: int, attention_fn: Callable):
        super().__init__()
        assert dim % num_heads == 0, "hidden_size must be divisible by num_heads"
        self.num_heads, self.kernel = num_heads, kernel
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attention_fn = attention_fn  # set for every block through StormScopeDiT.attention_fn

    def forward(self, x):
        b, h, w, c = x.shape
        qkv = self.qkv(x).reshape(b, h, w, 3, self.num_heads, c // self.num_heads)
        q, k, v = qkv.unbind(3)                       # each (B, X, Y, heads, head_dim)
        out = self.attention_fn(q, k, v, self.kernel)
        return self.proj(out.reshape(b, h, w, c))


class DiTBlock(nn.Module):
    def __init__(self, cfg: StormScopeConfig, attention_fn: Callable):
        super().__init__()
        c = cfg.hidden_size
        self.norm1 = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.attn = NeighborhoodSelfAttention(c, cfg.num_heads, cfg.attn_kernel, attention_fn)
        self.norm2 = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        hidden = int(c * cfg.mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(c, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, c))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c, 6 * c))

    def forward(self, x, cond):
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaLN_modulation(cond).chunk(6, dim=-1)
        x = x + gate_a[:, None, None, :] * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        return x + gate_m[:, None, None, :] * self.mlp(modulate(self.norm2(x), shift_m, scale_m))


class FinalLayer(nn.Module):
    def __init__(self, cfg: StormScopeConfig):
        super().__init__()
        c = cfg.hidden_size
        self.norm = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(c, cfg.patch_size * cfg.patch_size * cfg.out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c, 2 * c))

    def forward(self, x, cond):
        shift, scale = self.adaLN_modulation(cond).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


class StormScopeDiT(nn.Module):
    """``forward(x, sigma)``: ``x`` of shape ``(B, in_channels, H, W)`` (the noisy target concatenated with the
    conditioning channels), ``sigma`` of shape ``(B,)`` (the noise level); returns ``(B, out_channels, H, W)``."""

    def __init__(self, cfg: StormScopeConfig, attention_fn: Optional[Callable] = None):
        super().__init__()
        for s in cfg.img_size:
            assert s % cfg.patch_size == 0, f"image size {cfg.img_size} not divisible by patch {cfg.patch_size}"
        gx, gy = cfg.grid
        assert min(gx, gy) >= cfg.attn_kernel, f"token grid {cfg.grid} smaller than the attention kernel"
        self.cfg = cfg
        self.x_embedder = nn.Conv2d(cfg.in_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        # Token grid layout (1, X, Y, C): broadcast against sharded tokens, it is sliced to each rank's rows.
        self.pos_embed = nn.Parameter(torch.zeros(1, gx, gy, cfg.hidden_size))
        self.t_embedder = NoiseLevelEmbedding(cfg.hidden_size, cfg.freq_dim)
        self.blocks = nn.ModuleList(DiTBlock(cfg, attention_fn or default_attention) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg)
        self._init_weights()

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        w = self.x_embedder.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.bias)
        for lin in self.t_embedder.mlp:
            if isinstance(lin, nn.Linear):
                nn.init.normal_(lin.weight, std=0.02)
        # adaLN-Zero: every block starts as the identity, the output as zero.
        for blk in self.blocks:
            nn.init.zeros_(blk.adaLN_modulation[-1].weight)
            nn.init.zeros_(blk.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    @property
    def attention_fn(self) -> Callable:
        return self.blocks[0].attn.attention_fn if len(self.blocks) else default_attention

    @attention_fn.setter
    def attention_fn(self, fn: Callable):
        for blk in self.blocks:
            blk.attn.attention_fn = fn

    def unpatchify(self, x):
        """(B, X, Y, p*p*C_out) -> (B, C_out, X*p, Y*p)."""
        b, gx, gy, _ = x.shape
        p, c = self.cfg.patch_size, self.cfg.out_channels
        x = x.reshape(b, gx, gy, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, c, gx * p, gy * p)

    def forward(self, x, sigma):
        x = self.x_embedder(x).permute(0, 2, 3, 1) + self.pos_embed   # (B, X, Y, C)
        cond = self.t_embedder(sigma)                                   # (B, C), replicated
        for blk in self.blocks:
            x = blk(x, cond)
        return self.unpatchify(self.final_layer(x, cond))


def build(config="small", attention_fn: Optional[Callable] = None, **overrides) -> StormScopeDiT:
    cfg = CONFIGS[config] if isinstance(config, str) else config
    if "img_size" in overrides:
        overrides["img_size"] = tuple(overrides["img_size"])
    return StormScopeDiT(replace(cfg, **overrides), attention_fn=attention_fn)
