"""HybridViT of the ShardTensor paper's high-resolution benchmark, written as a plain ``torch.nn`` model.

Patch embedding (a Conv2d/Conv3d with kernel = stride = patch) turns the image into tokens ``(b, h*w, c)``
(row-major, so an image sharded along its height becomes a token sequence sharded along the sequence), then
LayerNorm and ReLU; a learned positional embedding; ``depth`` pre-norm transformer blocks (multi-head
self-attention through ``F.scaled_dot_product_attention`` with one ``nn.Linear`` for q, k and v, and a GELU
MLP); the tokens are mean-pooled and a linear head gives the class logits.

Nothing here knows about sharding: given an input sharded with ``Shard(2)`` (height), the convolution runs
locally, the flatten keeps the sequence sharded, the attention runs as ring attention, and the mean over the
sharded tokens is a pending sum reduced once before the head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ViTConfig:
    img_size: Tuple[int, ...] = (1024, 1024)  # (H, W) or (H, W, D); each divisible by patch_size
    patch_size: int = 8
    in_channels: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 16
    num_heads: int = 6
    mlp_ratio: float = 4.0
    qkv_bias: bool = True

    @property
    def dim(self) -> int:
        return len(self.img_size)

    @property
    def num_patches(self) -> int:
        return math.prod(s // self.patch_size for s in self.img_size)


CONFIGS = {
    # The paper's model (the registry default of the ViT example) at 1024^2; pass img_size to sweep sizes.
    "full": ViTConfig(),
    "full3d": ViTConfig(img_size=(128, 128, 128)),
    # CPU test sizes.
    "tiny": ViTConfig(img_size=(64, 64), num_classes=10, embed_dim=64, depth=2, num_heads=2),
    "tiny3d": ViTConfig(img_size=(32, 32, 32), in_channels=1, num_classes=10, embed_dim=64, depth=2, num_heads=2),
}


class PatchEmbedding(nn.Module):
    """Conv (kernel = stride = patch) -> tokens ``(b, prod(grid), c)`` in row-major order -> LayerNorm -> ReLU."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        conv = nn.Conv2d if cfg.dim == 2 else nn.Conv3d
        self.proj = conv(cfg.in_channels, cfg.embed_dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.norm = nn.LayerNorm(cfg.embed_dim)

    def forward(self, x):
        x = self.proj(x)                       # (b, c, h, w[, d])
        x = x.flatten(2).transpose(1, 2)       # "b c h w -> b (h w) c": the height shard becomes a sequence shard
        return F.relu(self.norm(x))


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        assert dim % num_heads == 0, "embed_dim must be divisible by num_heads"
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)                # each (b, heads, n, head_dim)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim)
        self.attn = Attention(cfg.embed_dim, cfg.num_heads, cfg.qkv_bias)
        self.norm2 = nn.LayerNorm(cfg.embed_dim)
        self.mlp = Mlp(cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HybridViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        for s in cfg.img_size:
            assert s % cfg.patch_size == 0, f"image size {cfg.img_size} not divisible by patch {cfg.patch_size}"
        self.cfg = cfg
        self.patch_embed = PatchEmbedding(cfg)
        # A plain parameter: added to sharded tokens, the library slices it to each rank's tokens and reduces
        # its gradient over the domain.
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_patches, cfg.embed_dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.head = nn.Linear(cfg.embed_dim, cfg.num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(x.mean(dim=1))


def build(config="tiny", **overrides) -> HybridViT:
    """``config``: a name from ``CONFIGS`` or a ``ViTConfig``; keyword overrides replace fields
    (e.g. ``img_size=(2048, 2048)``)."""
    cfg = CONFIGS[config] if isinstance(config, str) else config
    if "img_size" in overrides:
        overrides["img_size"] = tuple(overrides["img_size"])
    return HybridViT(replace(cfg, **overrides))
