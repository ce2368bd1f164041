"""Transolver (Wu et al., ICML 2024) with physics attention on an irregular point set, as a plain ``torch.nn``
model, in the DrivAerML surface configuration of the ShardTensor paper.

Physics attention, per head: every point softly assigns itself to ``S`` slices (softmax over slices of a
linear projection); a slice token is the weighted mean of all points' features (weights summed over the
points, then divided by the summed weights); the ``S`` slice tokens attend to each other; each point reads its
result back as the weighted sum of the slice outputs with its own weights.

Sharding the points ``(B, N, C)`` along ``N`` needs no change to this code: every per-point op is local; the
two sums over points (the slice weights' total and the weighted feature sum) are contractions over the sharded
dim, so they come out as pending sums that the library reduces once (a few KB); the slice attention runs on
the small replicated slice tokens; de-slicing is local again.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TransolverConfig:
    in_dim: int = 8          # DrivAerML surface: 6 embedding channels (xyz, normal) + 2 fx (air density, velocity)
    out_dim: int = 4         # pressure, wall shear (3)
    n_layers: int = 8
    n_hidden: int = 256
    n_head: int = 8
    slice_num: int = 512
    mlp_ratio: int = 2
    eps: float = 1e-2        # added to the summed slice weights (after the sum over all points)


CONFIGS = {
    "drivaerml": TransolverConfig(),
    "tiny": TransolverConfig(n_layers=2, n_hidden=32, n_head=2, slice_num=8),
}


class PhysicsAttention(nn.Module):
    def __init__(self, cfg: TransolverConfig):
        super().__init__()
        assert cfg.n_hidden % cfg.n_head == 0, "n_hidden must be divisible by n_head"
        self.heads, self.dim_head, self.eps = cfg.n_head, cfg.n_hidden // cfg.n_head, cfg.eps
        inner = self.heads * self.dim_head
        self.in_project_x = nn.Linear(cfg.n_hidden, inner)
        self.in_project_fx = nn.Linear(cfg.n_hidden, inner)
        self.in_project_slice = nn.Linear(self.dim_head, cfg.slice_num)
        self.temperature = nn.Parameter(torch.full((1, 1, self.heads, 1), 0.5))
        self.to_q = nn.Linear(self.dim_head, self.dim_head, bias=False)
        self.to_k = nn.Linear(self.dim_head, self.dim_head, bias=False)
        self.to_v = nn.Linear(self.dim_head, self.dim_head, bias=False)
        self.to_out = nn.Linear(inner, cfg.n_hidden)

    def forward(self, x):
        b, n, _ = x.shape
        x_mid = self.in_project_x(x).reshape(b, n, self.heads, self.dim_head)     # (B, N, H, D)
        fx_mid = self.in_project_fx(x).reshape(b, n, self.heads, self.dim_head)   # (B, N, H, D)
        logits = self.in_project_slice(x_mid) / self.temperature.clamp(0.5, 5.0)
        w = logits.softmax(dim=-1)                                                 # (B, N, H, S)

        # Slice tokens: weighted mean over ALL points (both sums run over the point dim).
        total = w.sum(dim=1)                                                       # (B, H, S)
        z = torch.einsum("bnhs,bnhd->bhsd", w, fx_mid) / (total + self.eps).unsqueeze(-1)

        # Attention among the S slice tokens (small; identical on every rank).
        z = F.scaled_dot_product_attention(self.to_q(z), self.to_k(z), self.to_v(z))  # (B, H, S, D)

        # De-slice with each point's own (unnormalised) weights.
        out = torch.einsum("bnhs,bhsd->bnhd", w, z).reshape(b, n, self.heads * self.dim_head)
        return self.to_out(out)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, out: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TransolverBlock(nn.Module):
    def __init__(self, cfg: TransolverConfig, last: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_hidden)
        self.attn = PhysicsAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_hidden)
        self.mlp = Mlp(cfg.n_hidden, cfg.n_hidden * cfg.mlp_ratio, cfg.n_hidden)
        self.last = last
        if last:
            self.ln_3 = nn.LayerNorm(cfg.n_hidden)
            self.mlp2 = nn.Linear(cfg.n_hidden, cfg.out_dim)

    def forward(self, fx):
        fx = self.attn(self.ln_1(fx)) + fx
        fx = self.mlp(self.ln_2(fx)) + fx
        return self.mlp2(self.ln_3(fx)) if self.last else fx


class Transolver(nn.Module):
    """``forward(x)`` with point features ``(B, N, in_dim)``, or ``forward(embedding, fx)`` whose last dims are
    concatenated (DrivAerML: 6 geometry channels and 2 flow-condition channels)."""

    def __init__(self, cfg: TransolverConfig):
        super().__init__()
        self.cfg = cfg
        self.preprocess = Mlp(cfg.in_dim, 2 * cfg.n_hidden, cfg.n_hidden)
        self.blocks = nn.ModuleList(TransolverBlock(cfg, last=(i == cfg.n_layers - 1)) for i in range(cfg.n_layers))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for m in self.modules():  # after the Linear pass, which would overwrite it
            if isinstance(m, PhysicsAttention):
                nn.init.orthogonal_(m.in_project_slice.weight)

    def forward(self, x, fx=None):
        if fx is not None:
            x = torch.cat([x, fx], dim=-1)
        fx = self.preprocess(x)
        for blk in self.blocks:
            fx = blk(fx)
        return fx


def build(config="tiny", **overrides) -> Transolver:
    cfg = CONFIGS[config] if isinstance(config, str) else config
    return Transolver(replace(cfg, **overrides))
