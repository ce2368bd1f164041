"""A stand-in for 2-D neighbourhood attention built only from ops the library shards today (used while
``shardtensor.ops.neighborhood_attention2d`` is not in the build).

Each query attends to the ``K x K`` window *centred* on it; window positions outside the grid are masked out
(NATTEN instead shifts border windows inward so every query sees ``K^2`` keys: same cost and communication,
different values at the borders). The window of every position is gathered by a depthwise convolution with
one-hot ``K x K`` kernels (channel ``c * K^2 + o`` picks offset ``o`` of channel ``c``), so over a sharded grid
the library's convolution brings the ``K // 2`` halo rows of ``q``, ``k``, ``v`` and the validity mask (the
output comes out in the padded convolution's layout; the model's residual add moves it back by an all-to-all of
the shifted rows). It materialises ``K^2`` copies of ``k`` and ``v``: fine for the CPU sizes and small kernels,
not for the full model's ``K = 31``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _one_hot_kernels(kernel: int, channels: int, like: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(kernel * kernel, dtype=like.dtype, device=like.device).reshape(kernel * kernel, 1, kernel, kernel)
    return eye.repeat(channels, 1, 1, 1)  # (channels * K^2, 1, K, K), groups = channels


def neighborhood_attention2d_conv(q, k, v, kernel_size: int):
    """``q, k, v``: ``(B, X, Y, heads, head_dim)``; returns the same shape."""
    b, x, y, h, d = q.shape
    kk, pad = kernel_size * kernel_size, kernel_size // 2

    def windows(t):  # (B, X, Y, h, d) -> (B, h, d, K^2, X, Y)
        t = t.permute(0, 3, 4, 1, 2).reshape(b, h * d, x, y)
        t = F.conv2d(t, _one_hot_kernels(kernel_size, h * d, q), padding=pad, groups=h * d)
        return t.reshape(b, h, d, kk, x, y)

    # The queries go through the same padded convolution with only the centre tap: over a sharded grid a padded
    # convolution's output is partitioned by window start (the first rank gets the padding rows too), so q must
    # take the windows' layout by a halo exchange of q; mixing default-split q with the windows would move a
    # K^2-times larger tensor by all-to-all instead.
    centre = torch.zeros(kernel_size * kernel_size, dtype=q.dtype, device=q.device)
    centre[kk // 2] = 1.0
    centre = centre.reshape(1, 1, kernel_size, kernel_size).repeat(h * d, 1, 1, 1)
    qh = F.conv2d(q.permute(0, 3, 4, 1, 2).reshape(b, h * d, x, y), centre, padding=pad, groups=h * d)
    qh = qh.reshape(b, h, d, 1, x, y)                                                   # (B, h, d, 1, X, Y)
    ones = torch.ones_like(q[..., :1, :1]).permute(0, 3, 4, 1, 2).reshape(b, 1, x, y)
    valid = F.conv2d(ones, _one_hot_kernels(kernel_size, 1, q), padding=pad)          # (B, K^2, X, Y): 1 inside
    scores = (qh * windows(k)).sum(2) * (1.0 / math.sqrt(d))                            # (B, h, K^2, X, Y)
    scores = scores + torch.log(valid).unsqueeze(1)                                     # -inf outside the grid
    attn = scores.softmax(dim=2)
    out = (attn.unsqueeze(2) * windows(v)).sum(3)                                       # (B, h, d, X, Y)
    return out.permute(0, 3, 4, 1, 2)
