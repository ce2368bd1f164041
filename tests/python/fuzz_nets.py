"""Randomized networks of unmodified PyTorch layers on a sharded input against one process: what the hand-written
tests do not combine. Five families:

- ``window``: [B, C, *spatial] (1-D, 2-D, 3-D) through convolutions (strides, dilations, groups, padding modes,
  'same'/'valid'), transposed convolutions, max/avg/LP/adaptive pooling (ceil mode, count_include_pad, divisor),
  interpolation (every mode, align_corners, antialias, scale factors and sizes), padding (every mode, negative pads),
  batch/group/instance/layer norms, in-place activations, residual blocks, channels_last, concatenated skips,
  squeeze-excitation, roll, flip, cumsum, pixel (un)shuffle, attention over the flattened tokens; a spatial dim
  split (1-D mesh) or two spatial dims, or the batch and a spatial dim (2x2 mesh);
- ``tokens``: [B, N, C] with N split (and B on a 2x2 mesh) through Linear, LayerNorm/RMSNorm, SDPA (causal, heads),
  nn.MultiheadAttention, MLPs, cumsum/roll/flip over the tokens, conv1d over them, a class token, token pooling,
  window attention, token gathers, einsum token mixing, top-k masks, rotary embeddings, padding, GLU, in-place writes;
- ``views``: [B, C, H, W] (one dim split, or two on a 2x2 mesh) through chains of views (transpose, permute, narrow,
  select, stepped slices, expand, flatten/unflatten, movedim, unfold, chunk, reshape) and in-place writes through
  them (a write through a view reaching its base, a base written after a view was taken, masked/index fills,
  item assignment, copy_ between halves), with pointwise ops, scans, rolls and concatenations between;
- ``stats``: [B, C, *spatial] (any dim split, or two on a 2x2 mesh) through reductions, normalizations, scans,
  sorts and selections along random dims (softmax, standardization, norms, logsumexp, cummax, logcumsumexp, sort,
  argsort + gather, topk, kthvalue, median, quantile, var_mean, cosine similarity, prod, diff, trapezoid, vector
  norms, nanmean, renorm, einsum), ending in a tensor or a loss (mse, l1, smooth-l1, huber, cross-entropy with class
  weights and label smoothing, nll, kl-div, bce-with-logits, poisson, soft-margin, gaussian nll);
- ``points``: [B, N, C] point clouds and graphs with N split (and B on a 2x2 mesh): k-nearest neighbours (cdist +
  topk, neighbour gathers, max over the neighbourhood), message passing over a fixed edge list (routed reads,
  index_add_ / scatter_reduce into the targets, degrees), PointNet's global max feature, subsampling and
  inverse-distance interpolation back, sorting by a coordinate, distance-biased attention, cluster means.

Each case: float64, uneven extents (zero extents included), strict mode (a gather fallback anywhere raises), one
forward and backward; compared: the output, the input gradient and every parameter gradient (relative max error
1e-9). A layer whose single-device call raises for the shape reached is skipped while building, so every case is
valid on one device. Outcomes: ok, wrong, notimpl (a rule declined: a clear refusal), error, hang, and illcond (a
chain whose result moves by more than 1e-11 when the input's last bits do, on one device already: skipped).

  PYTHONPATH=python .venv/bin/python tests/python/fuzz_nets.py --family window --seeds 0:300
  PYTHONPATH=python .venv/bin/python tests/python/fuzz_nets.py --family tokens --seeds 0:300
  PYTHONPATH=python .venv/bin/python tests/python/fuzz_nets.py --family views --seeds 0:300
  PYTHONPATH=python .venv/bin/python tests/python/fuzz_nets.py --family stats --seeds 0:300
  PYTHONPATH=python .venv/bin/python tests/python/fuzz_nets.py --family points --seeds 0:300

Seeds cycle through 2 ranks, 3 ranks and a 2x2 mesh. tests/python/test_fuzz_nets.py runs a few seeds of each in
`make test`; docs/testing.md records the last long runs.
"""
from __future__ import annotations

import argparse
import random
import sys
import traceback

CONFIGS = [(2, (2,)), (3, (3,)), (4, (2, 2))]


def _chain_module(steps, mods=None):
    """The network of every family: the steps' functions applied in turn; `mods` (the layers' modules) registered
    so that their parameters are the network's, compared gradient by gradient."""
    import torch.nn as nn

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.mods = mods if mods is not None else nn.ModuleList()

        def forward(self, x):
            for _, fn in steps:
                x = fn(x)
            return x

    return Chain()


def build_window_net(seed, nd, allow_attn=True):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B = rng.choice([1, 2])
    C = rng.choice([2, 3, 4])
    spatial = [rng.randint(9, 20) for _ in range(nd)]
    shape = [B, C] + spatial
    layers = []   # (desc, fn) ; modules kept in a ModuleList
    mods = nn.ModuleList()
    Conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
    ConvT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[nd]
    probe = torch.zeros(shape, dtype=torch.float64)

    def add(desc, fn, mod=None):
        nonlocal probe
        try:
            with torch.no_grad():
                out = fn(probe)
        except Exception:
            return False
        if out.dim() != probe.dim() or any(s < 1 for s in out.shape[2:]) or out.numel() > 200000:
            return False
        if any(s < 3 for s in out.shape[2:]):
            return False
        if mod is not None:
            mods.append(mod)
        layers.append((desc, fn))
        probe = out
        return True

    n_layers = rng.randint(2, 6)
    tries = 0
    while len(layers) < n_layers and tries < 60:
        tries += 1
        c = probe.shape[1]
        kind = rng.choice(["conv", "conv", "convT", "maxpool", "avgpool", "adaptive", "interp", "pad", "norm",
                           "act", "res", "cl", "cat", "se", "roll", "shuffle", "cumsum", "flip", "lppool",
                           "upsample_mod"] + (["attn"] if allow_attn else []))
        if kind == "conv":
            k = rng.randint(1, 5); s = rng.choice([1, 1, 2, 3]); d = rng.choice([1, 1, 2])
            pm = rng.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
            pad = rng.choice(["same", "valid", 0, 1, k // 2, k - 1]) if s == 1 else rng.choice([0, 1, k // 2])
            if pad == "same" and pm != "zeros" and rng.random() < 0.5:
                pm = "zeros"
            g = rng.choice([1, 1, c])
            out_c = rng.choice([c, 2 * c]) if g > 1 else rng.randint(2, 5)
            if g > 1 and out_c % g:
                out_c = c
            mod = Conv(c, out_c, k, stride=s, padding=pad, dilation=d, groups=g, bias=rng.random() < 0.7,
                       padding_mode=pm).double()
            add(f"conv k{k} s{s} d{d} p{pad} {pm} g{g}", mod, mod)
        elif kind == "convT":
            k = rng.randint(1, 4); s = rng.choice([1, 2, 3]); d = rng.choice([1, 1, 2])
            p = rng.randint(0, max(0, (k - 1) * d // 2)); op = rng.randint(0, max(0, min(s, d) - 1))
            mod = ConvT(c, rng.randint(2, 4), k, stride=s, padding=p, output_padding=op, dilation=d,
                        groups=1, bias=rng.random() < 0.7).double()
            add(f"convT k{k} s{s} d{d} p{p} op{op}", mod, mod)
        elif kind == "maxpool":
            k = rng.randint(2, 4); s = rng.choice([None, 1, 2, 3]); p = rng.randint(0, k // 2)
            d = rng.choice([1, 1, 2]); cm = rng.random() < 0.3
            fn = getattr(F, f"max_pool{nd}d")
            add(f"maxpool k{k} s{s} p{p} d{d} ceil{cm}",
                lambda x, k=k, s=s, p=p, d=d, cm=cm, fn=fn: fn(x, k, s, p, dilation=d, ceil_mode=cm))
        elif kind == "avgpool":
            k = rng.randint(2, 4); s = rng.choice([None, 1, 2]); p = rng.randint(0, k // 2)
            cm = rng.random() < 0.3; cip = rng.random() < 0.5
            dv = rng.choice([None, None, 3])
            fn = getattr(F, f"avg_pool{nd}d")
            if nd == 1:
                add(f"avgpool k{k} s{s} p{p} ceil{cm} cip{cip}",
                    lambda x, k=k, s=s, p=p, cm=cm, cip=cip, fn=fn: fn(x, k, s, p, cm, cip))
            else:
                add(f"avgpool k{k} s{s} p{p} ceil{cm} cip{cip} dv{dv}",
                    lambda x, k=k, s=s, p=p, cm=cm, cip=cip, dv=dv, fn=fn: fn(x, k, s, p, cm, cip, dv))
        elif kind == "lppool" and nd in (1, 2, 3):
            k = rng.randint(2, 3); s = rng.choice([None, 1, 2]); pw = rng.choice([1.0, 2.0, 3.0])
            fn = getattr(F, f"lp_pool{nd}d")
            add(f"lppool k{k} s{s} p{pw}", lambda x, k=k, s=s, pw=pw, fn=fn: fn(x.abs() + 0.1, pw, k, s))
        elif kind == "adaptive":
            size = [rng.randint(2, 9) for _ in range(nd)]
            mx = rng.random() < 0.4
            fn = getattr(F, f"adaptive_{'max' if mx else 'avg'}_pool{nd}d")
            add(f"adaptive {'max' if mx else 'avg'} {size}", lambda x, size=size, fn=fn: fn(x, size))
        elif kind == "interp":
            modes = ["nearest", "nearest-exact", "area", {1: "linear", 2: "bilinear", 3: "trilinear"}[nd]]
            if nd == 2:
                modes.append("bicubic")
            mode = rng.choice(modes)
            ac = rng.choice([None, True, False]) if mode in ("linear", "bilinear", "trilinear", "bicubic") else None
            aa = nd == 2 and mode in ("bilinear", "bicubic") and rng.random() < 0.3
            if rng.random() < 0.5:
                sf = rng.choice([0.5, 0.7, 1.5, 2.0, 3.0])
                add(f"interp {mode} sf{sf} ac{ac} aa{aa}",
                    lambda x, sf=sf, mode=mode, ac=ac, aa=aa: F.interpolate(x, scale_factor=sf, mode=mode,
                                                                          align_corners=ac, antialias=aa))
            else:
                size = [rng.randint(4, 24) for _ in range(nd)]
                add(f"interp {mode} size{size} ac{ac} aa{aa}",
                    lambda x, size=size, mode=mode, ac=ac, aa=aa: F.interpolate(x, size=size, mode=mode,
                                                                              align_corners=ac, antialias=aa))
        elif kind == "pad":
            mode = rng.choice(["constant", "reflect", "replicate", "circular"])
            pads = [rng.randint(-1 if mode in ("constant", "replicate", "circular") else 0, 3) for _ in range(2 * nd)]
            add(f"pad {mode} {pads}", lambda x, pads=pads, mode=mode: F.pad(x, pads, mode=mode))
        elif kind == "norm":
            which = rng.choice(["bn", "gn", "in", "ln_c", "ln_last"])
            if which == "bn":
                mod = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[nd](c).double()
                add("bn", mod, mod)
            elif which == "gn":
                g = rng.choice([x for x in (1, 2, c) if c % x == 0])
                mod = nn.GroupNorm(g, c).double()
                add(f"gn {g}", mod, mod)
            elif which == "in":
                mod = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[nd](
                    c, affine=True).double()
                add("in", mod, mod)
            elif which == "ln_c":
                mod = nn.LayerNorm(c).double()
                add("ln over C (movedim)", lambda x, mod=mod: mod(x.movedim(1, -1)).movedim(-1, 1), mod)
            else:
                mod = nn.LayerNorm(list(probe.shape[2:])).double()
                add("ln over spatial", mod, mod)
        elif kind == "act":
            a = rng.choice(["relu_", "gelu", "silu", "hardswish", "leaky_relu_", "elu"])
            if a == "relu_":
                add("relu_", lambda x: F.relu(x * 1.0, inplace=True))
            elif a == "leaky_relu_":
                add("leaky_relu_", lambda x: F.leaky_relu_(x + 0.0, 0.1))
            else:
                add(a, getattr(F, a))
        elif kind == "res":
            mod = Conv(c, c, 3, padding=1).double()
            add("res conv3", lambda x, mod=mod: x + mod(x), mod)
        elif kind == "cl" and nd in (2, 3):
            mf = torch.channels_last if nd == 2 else torch.channels_last_3d
            add("channels_last", lambda x, mf=mf: x.contiguous(memory_format=mf))
        elif kind == "cat":
            add("cat skip", lambda x: torch.cat([x, torch.tanh(x)], dim=1))
        elif kind == "se":
            mod = nn.Linear(c, c).double()
            dims = tuple(range(2, 2 + nd))
            add("se", lambda x, mod=mod, dims=dims: x * torch.sigmoid(
                mod(x.mean(dims))).reshape(*x.shape[:2], *([1] * nd)), mod)
        elif kind == "roll":
            sh = rng.randint(-5, 5); dd = rng.randint(2, 1 + nd)
            add(f"roll {sh} dim{dd}", lambda x, sh=sh, dd=dd: torch.roll(x, sh, dd))
        elif kind == "flip":
            dd = rng.randint(2, 1 + nd)
            add(f"flip {dd}", lambda x, dd=dd: torch.flip(x, (dd,)))
        elif kind == "cumsum":
            dd = rng.randint(2, 1 + nd)
            add(f"cumsum {dd}", lambda x, dd=dd: torch.cumsum(x, dd) / 10)
        elif kind == "shuffle" and nd == 2:
            r = 2
            if all(s % r == 0 for s in probe.shape[2:]) and rng.random() < 0.5:
                add("pixel_unshuffle", lambda x: F.pixel_unshuffle(x, r))
            elif c % 4 == 0:
                add("pixel_shuffle", lambda x: F.pixel_shuffle(x, r))
        elif kind == "upsample_mod":
            mod = nn.Upsample(scale_factor=2, mode="nearest")
            add("upsample x2", mod)
        elif kind == "attn":
            heads = 1
            mod = nn.MultiheadAttention(c, heads, batch_first=True).double()
            def f(x, mod=mod):
                sh = x.shape
                t = x.flatten(2).transpose(1, 2)
                y, _ = mod(t, t, t, need_weights=False)
                return (t + y).transpose(1, 2).reshape(sh)
            add("mha over tokens", f, mod)
    return _chain_module(layers, mods), shape, [d for d, _ in layers]


def build_token_net(seed):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B = rng.choice([1, 2, 3])
    N = rng.randint(6, 40)
    C = rng.choice([4, 6, 8])
    shape = [B, N, C]
    layers, mods = [], nn.ModuleList()
    probe = torch.zeros(shape, dtype=torch.float64)

    def add(desc, fn, mod=None):
        nonlocal probe
        try:
            with torch.no_grad():
                out = fn(probe)
        except Exception:
            return False
        if out.dim() != 3 or out.shape[1] < 2 or out.numel() > 100000:
            return False
        if mod is not None:
            mods.append(mod)
        layers.append((desc, fn))
        probe = out
        return True

    n_layers = rng.randint(2, 7)
    tries = 0
    while len(layers) < n_layers and tries < 80:
        tries += 1
        b, n, c = probe.shape
        kind = rng.choice(["linear", "ln", "rms", "sdpa", "mha", "mlp", "cumsum", "roll", "conv1d", "softmax_n",
                           "cls", "pool_tokens", "window", "gather", "normalize", "einsum", "topk_mask", "rope",
                           "pad", "flip", "max_n", "chunk_cat", "glu", "masked_fill", "std_norm", "index_put"])
        if kind == "linear":
            mod = nn.Linear(c, rng.choice([c, 2 * c, 4]), bias=rng.random() < 0.7).double()
            add(f"linear {c}->{mod.out_features}", mod, mod)
        elif kind == "ln":
            mod = nn.LayerNorm(c, elementwise_affine=rng.random() < 0.8).double()
            add("layernorm", mod, mod)
        elif kind == "rms":
            mod = nn.RMSNorm(c).double()
            add("rmsnorm", mod, mod)
        elif kind == "sdpa":
            causal = rng.random() < 0.4
            heads = rng.choice([h for h in (1, 2) if c % h == 0])
            qkv = nn.Linear(c, 3 * c).double()
            def f(x, qkv=qkv, causal=causal, heads=heads):
                b, n, c = x.shape
                q, k, v = qkv(x).view(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                return x + y.transpose(1, 2).reshape(b, n, c)
            add(f"sdpa causal={causal} heads={heads}", f, qkv)
        elif kind == "mha":
            mod = nn.MultiheadAttention(c, rng.choice([h for h in (1, 2) if c % h == 0]), batch_first=True).double()
            add("mha", lambda x, mod=mod: mod(x, x, x, need_weights=False)[0] + x, mod)
        elif kind == "mlp":
            mod = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c)).double()
            add("mlp residual", lambda x, mod=mod: x + mod(x), mod)
        elif kind == "cumsum":
            add("cumsum N", lambda x: torch.cumsum(x, 1) / 5)
        elif kind == "roll":
            s = rng.randint(-4, 4)
            add(f"roll N {s}", lambda x, s=s: torch.roll(x, s, 1))
        elif kind == "conv1d":
            k = rng.choice([1, 3, 5]); dw = rng.random() < 0.5
            mod = nn.Conv1d(c, c, k, padding=k // 2, groups=c if dw else 1).double()
            add(f"conv1d over N k{k} dw{dw}", lambda x, mod=mod: x + mod(x.transpose(1, 2)).transpose(1, 2), mod)
        elif kind == "softmax_n":
            add("softmax over N * x", lambda x: torch.softmax(x, 1) * x)
        elif kind == "cls":
            tok = nn.Parameter(torch.randn(1, 1, c, dtype=torch.float64))
            holder = nn.Module(); holder.tok = tok
            add("cat cls token", lambda x, h=holder: torch.cat([h.tok.expand(x.shape[0], -1, -1), x], 1), holder)
        elif kind == "pool_tokens":
            k = rng.choice([2, 3])
            if n % k == 0:
                add(f"view pool tokens {k}", lambda x, k=k: x.view(x.shape[0], x.shape[1] // k, k, x.shape[2]).mean(2))
            else:
                add(f"avg_pool1d tokens {k}", lambda x, k=k: F.avg_pool1d(x.transpose(1, 2), k, k, ceil_mode=True).transpose(1, 2))
        elif kind == "window":
            wsz = rng.choice([2, 4])
            if n % wsz == 0:
                def f(x, wsz=wsz):
                    b, n, c = x.shape
                    wdw = x.view(b, n // wsz, wsz, c).reshape(b * (n // wsz), wsz, c)
                    y = F.scaled_dot_product_attention(wdw, wdw, wdw)
                    return y.view(b, n // wsz, wsz, c).reshape(b, n, c)
                add(f"window attention {wsz}", f)
        elif kind == "gather":
            idx = torch.tensor(sorted(rng.sample(range(n), max(2, n // 2))))
            add(f"x[:, idx] {len(idx)}", lambda x, idx=idx: x[:, idx])
        elif kind == "normalize":
            d = rng.choice([1, 2])
            add(f"normalize dim{d}", lambda x, d=d: F.normalize(x, dim=d))
        elif kind == "einsum":
            add("einsum token mixing (b n c, b m c -> b n m) @ x", lambda x: torch.einsum(
                "bnm,bmc->bnc", torch.softmax(torch.einsum("bnc,bmc->bnm", x, x) / 4, -1), x))
        elif kind == "topk_mask":
            k = rng.randint(1, max(1, n // 2))
            def f(x, k=k):
                s = x[..., 0]
                thr = s.topk(k, dim=1).values[:, -1:]
                return x * (s >= thr).unsqueeze(-1)
            add(f"topk mask {k}", f)
        elif kind == "rope":
            def f(x):
                b, n, c = x.shape
                pos = torch.arange(n, dtype=x.dtype)[:, None] * torch.arange(1, c // 2 + 1, dtype=x.dtype)[None] / 10
                cos, sin = pos.cos(), pos.sin()
                x1, x2 = x[..., : c // 2], x[..., c // 2: 2 * (c // 2)]
                return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
            if c % 2 == 0:
                add("rope", f)
        elif kind == "pad":
            l, r = rng.randint(0, 3), rng.randint(0, 3)
            add(f"pad N {l},{r}", lambda x, l=l, r=r: F.pad(x, (0, 0, l, r)))
        elif kind == "flip":
            add("flip N", lambda x: x.flip(1))
        elif kind == "max_n":
            add("x - max over N", lambda x: x - x.amax(1, keepdim=True))
        elif kind == "chunk_cat":
            add("chunk C, swap", lambda x: torch.cat(x.chunk(2, -1)[::-1], -1) if x.shape[-1] % 2 == 0 else x)
        elif kind == "glu":
            if c % 2 == 0:
                mod = nn.Linear(c // 2, c).double()
                add("glu", lambda x, mod=mod: mod(F.glu(x, -1)), mod)
        elif kind == "masked_fill":
            add("masked_fill", lambda x: x.masked_fill(x > 1.0, 1.0))
        elif kind == "std_norm":
            add("(x - mean_N) / std_N", lambda x: (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1))
        elif kind == "index_put":
            def f(x):
                y = x.clone()
                y[:, 0] = 0.5 * y[:, -1]
                return y
            add("y[:, 0] = y[:, -1]", f)
    return _chain_module(layers, mods), shape, [d for d, _ in layers]


def build_view_chain(seed):
    """A chain of views, strided slices and in-place writes through views on a [B, C, H, W] tensor: the aliasing
    mechanisms (a write through a view reaches its base; a base written in place changes its views' values; strides
    and storage offsets of narrowed, stepped, transposed, expanded and unfolded views). Returns (fn, shape, desc)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    rng = random.Random(seed)
    shape = [rng.choice([1, 2, 3]), rng.choice([2, 3, 4]), rng.randint(6, 16), rng.randint(6, 16)]
    steps = []
    probe = torch.zeros(shape, dtype=torch.float64)

    def add(desc, fn):
        nonlocal probe
        try:
            with torch.no_grad():
                out = fn(probe.clone())
        except Exception:
            return False
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.numel() == 0 or out.numel() > 50000:
            return False
        steps.append((desc, fn))
        probe = out
        return True

    n_steps = rng.randint(3, 9)
    tries = 0
    while len(steps) < n_steps and tries < 100:
        tries += 1
        nd = probe.dim()
        d = rng.randrange(nd)
        d2 = rng.randrange(nd)
        size = probe.shape[d]
        kind = rng.choice(["transpose", "permute", "narrow", "select", "step", "unsqueeze_expand", "flatten",
                           "unflatten", "movedim", "unfold", "chunk", "contiguous", "reshape",
                           "write_view", "write_base", "masked_fill_", "index_fill_", "setitem", "copy_view",
                           "pointwise", "mul_broadcast", "where", "clamp_", "cumsum", "reduce_keepdim", "flip",
                           "roll", "cat_self"])
        if kind == "transpose":
            add(f"transpose({d}, {d2})", lambda t, d=d, d2=d2: t.transpose(d, d2))
        elif kind == "permute":
            perm = list(range(nd)); rng.shuffle(perm)
            add(f"permute{perm}", lambda t, perm=perm: t.permute(perm))
        elif kind == "narrow" and size > 2:
            st_ = rng.randint(0, size // 2); ln = rng.randint(1, size - st_)
            add(f"narrow({d}, {st_}, {ln})", lambda t, d=d, s_=st_, ln=ln: t.narrow(d, s_, ln))
        elif kind == "select" and nd > 2:
            i = rng.randrange(size)
            add(f"select({d}, {i})", lambda t, d=d, i=i: t.select(d, i))
        elif kind == "step" and size > 3:
            stp = rng.choice([2, 3]); off = rng.randint(0, 1)
            idx = [slice(None)] * nd
            idx[d] = slice(off, None, stp)
            add(f"[{d}: {off}::{stp}]", lambda t, idx=tuple(idx): t[idx])
        elif kind == "unsqueeze_expand":
            k = rng.choice([2, 3])
            add(f"unsqueeze({d}).expand {k}", lambda t, d=d, k=k: t.unsqueeze(d).expand(
                *t.shape[:d], k, *t.shape[d:]))
        elif kind == "flatten" and nd > 2 and d < nd - 1:
            add(f"flatten({d}, {d + 1})", lambda t, d=d: t.flatten(d, d + 1))
        elif kind == "unflatten" and size % 2 == 0 and size >= 4:
            add(f"unflatten({d}, 2 x)", lambda t, d=d: t.unflatten(d, (2, t.shape[d] // 2)))
        elif kind == "movedim":
            add(f"movedim({d}, {d2})", lambda t, d=d, d2=d2: t.movedim(d, d2))
        elif kind == "unfold" and size >= 3:
            k = rng.choice([2, 3]); stp = rng.choice([1, 2])
            add(f"unfold({d}, {k}, {stp})", lambda t, d=d, k=k, stp=stp: t.unfold(d, k, stp))
        elif kind == "chunk" and size >= 2:
            n = rng.choice([2, 3]); i = rng.randrange(min(n, size))
            add(f"chunk({n}, {d})[{i}]", lambda t, n=n, d=d, i=i: t.chunk(n, d)[min(i, len(t.chunk(n, d)) - 1)])
        elif kind == "contiguous":
            add("contiguous", lambda t: t.contiguous())
        elif kind == "reshape":
            add("reshape(-1, last)", lambda t: t.reshape(-1, t.shape[-1]))
        elif kind == "write_view" and size > 2:
            # A write through a view of a clone reaches the clone (its base): continue with the base.
            st_ = rng.randint(0, size - 2)
            def f(t, d=d, s_=st_):
                y = t.clone()
                y.narrow(d, s_, 2).mul_(0.5).add_(1.0)
                return y
            add(f"narrow({d}, {st_}, 2) *= 0.5, += 1 on a clone", f)
        elif kind == "write_base" and size > 2:
            # A view taken before its base is written in place reads the new values.
            def f(t, d=d):
                y = t.clone()
                v = y.transpose(0, d) if d != 0 else y.transpose(0, -1)
                y.mul_(2.0)
                return v.sin()
            add(f"view, then its base *= 2, read the view (dim {d})", f)
        elif kind == "masked_fill_":
            add("clone.masked_fill_(t > 0.5, 0.25)", lambda t: t.clone().masked_fill_(t > 0.5, 0.25))
        elif kind == "index_fill_" and size > 2:
            idx = torch.tensor(sorted(rng.sample(range(size), 2)))
            add(f"clone.index_fill_({d}, {idx.tolist()}, -1)", lambda t, d=d, idx=idx: t.clone().index_fill_(d, idx, -1.0))
        elif kind == "setitem" and size > 2:
            i = rng.randrange(size)
            def f(t, d=d, i=i):
                y = t.clone()
                idx = [slice(None)] * t.dim()
                idx[d] = i
                y[tuple(idx)] = y.select(d, 0) * 3.0
                return y
            add(f"y[..{d}={i}..] = 3 * y.select({d}, 0)", f)
        elif kind == "copy_view" and size > 3:
            def f(t, d=d):
                y = t.clone()
                n = y.shape[d] // 2
                y.narrow(d, 0, n).copy_(y.narrow(d, y.shape[d] - n, n).flip(d))
                return y
            add(f"first half of dim {d} = reversed second half (copy_)", f)
        elif kind == "pointwise":
            op = rng.choice(["sin", "tanh", "exp", "abs", "sigmoid"])
            add(op, lambda t, op=op: getattr(torch, op)(t * 0.5))
        elif kind == "mul_broadcast":
            bshape = [1] * nd
            bshape[d] = size
            wgt = torch.linspace(0.5, 1.5, size, dtype=torch.float64).reshape(bshape)
            add(f"* weights along {d}", lambda t, w=wgt: t * w)
        elif kind == "where":
            add("where(t > 0, t, 0.1 t)", lambda t: torch.where(t > 0, t, 0.1 * t))
        elif kind == "clamp_":
            add("clone.clamp_(-1, 1)", lambda t: t.clone().clamp_(-1, 1))
        elif kind == "cumsum":
            add(f"cumsum({d}) / size", lambda t, d=d: t.cumsum(d) / t.shape[d])
        elif kind == "reduce_keepdim":
            add(f"t - mean({d}, keepdim)", lambda t, d=d: t - t.mean(d, keepdim=True))
        elif kind == "flip":
            add(f"flip({d})", lambda t, d=d: t.flip(d))
        elif kind == "roll":
            k = rng.randint(-3, 3)
            add(f"roll({k}, {d})", lambda t, k=k, d=d: t.roll(k, d))
        elif kind == "cat_self":
            add(f"cat([t, t.sin()], {d})", lambda t, d=d: torch.cat([t, t.sin()], d))
    return _chain_module(steps), shape, [d for d, _ in steps]


def build_stats_chain(seed):
    """A chain of reductions, normalizations, scans, sorts and selections along random dims of a [B, C, *spatial]
    tensor (any of them split), ending in a tensor or a loss: the statistics rules (Partial results, keepdim
    broadcasts, scans and sorts across ranks, losses with a split class dim). Every tie-making step adds a small
    multiple of its input, so sorts and arg-reductions downstream have one answer, and every step subtracting a
    selected element subtracts 0.9 of it: an exact zero there, normalized later (F.normalize's clamp at a zero vector,
    a gradient of 1e12 cancelling itself), leaves rounding noise the size of the tolerance that no perturbation of the
    input reveals. Returns (module, shape, desc)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    rng = random.Random(seed)
    torch.manual_seed(seed)
    nd = rng.choice([1, 2, 2])
    shape = [rng.choice([1, 2, 3]), rng.choice([2, 3, 5])] + [rng.randint(5, 14) for _ in range(nd)]
    steps, mods = [], nn.ModuleList()
    probe = torch.zeros(shape, dtype=torch.float64)

    def add(desc, fn, mod=None):
        nonlocal probe
        try:
            x = torch.randn(probe.shape, dtype=torch.float64, requires_grad=True)
            out = fn(x)
            out.sum().backward()   # every step must have a derivative on one device
            out = out.detach()
        except Exception:
            return False
        if out.dim() != len(shape) or any(s < 1 for s in out.shape) or out.numel() > 50000:
            return False
        if mod is not None:
            mods.append(mod)
        steps.append((desc, fn))
        probe = out
        return True

    n_steps = rng.randint(2, 7)
    tries = 0
    while len(steps) < n_steps and tries < 100:
        tries += 1
        nd_ = probe.dim()
        d = rng.randrange(nd_)
        d2 = rng.choice([e for e in range(nd_) if e != d])
        k = rng.choice([1, 2, 3])
        kind = rng.choice(["softmax", "log_softmax", "standardize", "norm", "logsumexp", "cummax", "cummin",
                           "logcumsumexp", "cumprod", "sort", "argsort_gather", "topk", "kthvalue", "max_keep",
                           "aminmax", "median", "quantile", "var_mean", "normalize", "layer_norm", "cosine",
                           "prod", "diff", "sum_two", "mean_all", "count", "argmax_gather", "masked_mean",
                           "trapezoid", "cumtrapz", "vector_norm", "nanmean", "softmin", "std_two", "msort",
                           "min_max_scale", "renorm", "einsum"])
        if kind == "softmax":
            add(f"softmax({d}) * t", lambda t, d=d: torch.softmax(t, d) * t)
        elif kind == "log_softmax":
            add(f"log_softmax({d})", lambda t, d=d: F.log_softmax(t, d))
        elif kind == "standardize":
            c = rng.choice([0, 1])
            add(f"(t - mean({d})) / std({d}, correction={c})",
                lambda t, d=d, c=c: (t - t.mean(d, keepdim=True)) / (t.std(d, keepdim=True, correction=c) + 0.5))
        elif kind == "norm":
            p = rng.choice([1, 2, 3])
            add(f"t / norm(p={p}, dim={d})", lambda t, d=d, p=p: t / (t.norm(p, d, keepdim=True) + 0.5))
        elif kind == "logsumexp":
            add(f"t - logsumexp({d})", lambda t, d=d: t - torch.logsumexp(t, d, keepdim=True))
        elif kind == "cummax":
            add(f"cummax({d}) + 0.1 t", lambda t, d=d: torch.cummax(t, d).values + 0.1 * t)
        elif kind == "cummin":
            add(f"cummin({d}) + 0.1 t", lambda t, d=d: torch.cummin(t, d).values + 0.1 * t)
        elif kind == "logcumsumexp":
            add(f"logcumsumexp({d}) * 0.5", lambda t, d=d: torch.logcumsumexp(t, d) * 0.5)
        elif kind == "cumprod":
            add(f"cumprod(1 + 0.1 tanh t, {d})", lambda t, d=d: torch.cumprod(1 + 0.1 * torch.tanh(t), d))
        elif kind == "sort":
            desc_ = rng.random() < 0.5
            add(f"sort({d}, descending={desc_})", lambda t, d=d, s=desc_: torch.sort(t, d, descending=s).values)
        elif kind == "argsort_gather":
            add(f"t.gather({d2}, t.sin().argsort({d2}))", lambda t, d=d2: t.gather(d, t.sin().argsort(d)))
        elif kind == "topk":
            add(f"topk({k}, {d})", lambda t, d=d, k=k: torch.topk(t, min(k, t.shape[d]), d).values)
        elif kind == "kthvalue":
            add(f"t * (t >= kthvalue({k}, {d}))", lambda t, d=d, k=k: t * (t >= torch.kthvalue(
                t, min(k, t.shape[d]), d, keepdim=True).values) + 0.1 * t)
        elif kind == "max_keep":
            add(f"t - 0.9 max({d}).values", lambda t, d=d: t - 0.9 * t.max(d, keepdim=True).values)
        elif kind == "aminmax":
            def f(t, d=d):
                lo, hi = torch.amin(t, d, keepdim=True), torch.amax(t, d, keepdim=True)
                return (t - 0.9 * lo) / (hi - lo + 1.0)  # not an exact zero at the minimum (see above)
            add(f"amin/amax scale ({d})", f)
        elif kind == "median":
            add(f"t - median({d})", lambda t, d=d: t - t.median(d, keepdim=True).values)
        elif kind == "quantile":
            q = rng.choice([0.25, 0.5, 0.9])
            add(f"t - quantile({q}, {d})", lambda t, d=d, q=q: t - torch.quantile(t, q, d, keepdim=True))
        elif kind == "var_mean":
            def f(t, d=d):
                v, m = torch.var_mean(t, d, keepdim=True)
                return (t - m) * torch.rsqrt(v + 1.0)
            add(f"var_mean({d})", f)
        elif kind == "normalize":
            add(f"F.normalize(dim={d})", lambda t, d=d: F.normalize(t, dim=d))
        elif kind == "layer_norm":
            n = rng.choice([1, 2])
            mod = nn.LayerNorm(list(probe.shape[-n:]), elementwise_affine=rng.random() < 0.7).double()
            add(f"layer_norm(last {n})", mod, mod)
        elif kind == "cosine":
            add(f"t * cosine_similarity(t, roll(t, 1, {d2}), dim={d})", lambda t, d=d, d2=d2: t * F.cosine_similarity(
                t, t.roll(1, d2), dim=d).unsqueeze(d))
        elif kind == "prod":
            add(f"t * prod(1 + 0.05 t, {d})", lambda t, d=d: t * torch.prod(1 + 0.05 * torch.tanh(t), d, keepdim=True))
        elif kind == "diff":
            add(f"diff({d})", lambda t, d=d: torch.diff(t, dim=d))
        elif kind == "sum_two":
            add(f"t - sum(({d}, {d2})) / n", lambda t, d=d, d2=d2: t - t.sum((d, d2), keepdim=True) / (
                t.shape[d] * t.shape[d2]))
        elif kind == "mean_all":
            add("t - mean() + t.var()", lambda t: t - t.mean() + t.var())
        elif kind == "count":
            add(f"t * count_nonzero(t > 0, {d})", lambda t, d=d: t * (t > 0).sum(d, keepdim=True).to(t.dtype) / 4)
        elif kind == "argmax_gather":
            add(f"t - 0.9 t.gather({d}, argmax({d}))", lambda t, d=d: t - 0.9 * t.gather(d, t.argmax(d, keepdim=True)))
        elif kind == "masked_mean":
            def f(t, d=d):
                m = (t.cos() > 0.3).to(t.dtype)
                return t - (t * m).sum(d, keepdim=True) / (m.sum(d, keepdim=True) + 1)
            add(f"masked mean ({d})", f)
        elif kind == "trapezoid":
            add(f"t * trapezoid({d})", lambda t, d=d: t * torch.trapezoid(t, dim=d).unsqueeze(d) / t.shape[d])
        elif kind == "cumtrapz":
            add(f"cumulative_trapezoid({d})", lambda t, d=d: torch.cumulative_trapezoid(t, dim=d) / 4)
        elif kind == "vector_norm":
            o = rng.choice([2, float("inf"), 1])
            add(f"t / vector_norm(ord={o}, ({d}, {d2}))", lambda t, d=d, d2=d2, o=o: t / (
                torch.linalg.vector_norm(t, o, (d, d2), keepdim=True) + 0.5))
        elif kind == "nanmean":
            add(f"t - nanmean(where(t > 1, nan, t), {d})", lambda t, d=d: t - torch.where(
                t > 1, float("nan"), t).nanmean(d, keepdim=True).nan_to_num(0.0))
        elif kind == "softmin":
            add(f"softmin({d}) + t", lambda t, d=d: F.softmin(t, d) + t)
        elif kind == "std_two":
            add(f"t / std(({d}, {d2}))", lambda t, d=d, d2=d2: t / (t.std((d, d2), keepdim=True) + 0.5))
        elif kind == "msort":
            add("msort (dim 0)", lambda t: torch.msort(t))
        elif kind == "min_max_scale":
            add("(t - 0.9 t.min()) / (t.max() - t.min())", lambda t: (t - 0.9 * t.min()) / (t.max() - t.min() + 1))
        elif kind == "renorm":
            add(f"renorm(2, {d}, 1.0)", lambda t, d=d: torch.renorm(t, 2, d, 1.0))
        elif kind == "einsum" and probe.dim() == 4:
            add("einsum bchw,bcHw->bchH (mix H)", lambda t: torch.einsum("bchw,bcHw->bchH", t, t) / t.shape[-1])
    final = rng.choice(["none", "none", "mse", "l1", "smooth_l1", "huber", "cross_entropy", "nll", "kl_div",
                        "bce_logits", "poisson", "soft_margin", "cross_entropy_soft", "gaussian_nll"])
    torch.manual_seed(seed + 11)
    tgt = torch.randn(probe.shape, dtype=torch.float64)
    red = rng.choice(["mean", "sum"])
    if final == "mse":
        steps.append((f"mse_loss({red})", lambda t, r=red: F.mse_loss(t, tgt, reduction=r)))
    elif final == "l1":
        steps.append((f"l1_loss({red})", lambda t, r=red: F.l1_loss(t, tgt, reduction=r)))
    elif final == "smooth_l1":
        steps.append((f"smooth_l1({red})", lambda t, r=red: F.smooth_l1_loss(t, tgt, reduction=r, beta=0.5)))
    elif final == "huber":
        steps.append((f"huber({red})", lambda t, r=red: F.huber_loss(t, tgt, reduction=r, delta=0.7)))
    elif final in ("cross_entropy", "nll"):
        cls = tgt.argmax(1)
        ls = rng.choice([0.0, 0.1]) if final == "cross_entropy" else 0.0
        wts = torch.linspace(0.5, 1.5, probe.shape[1], dtype=torch.float64) if rng.random() < 0.4 else None
        if final == "cross_entropy":
            steps.append((f"cross_entropy({red}, smoothing={ls}, weights={wts is not None})",
                          lambda t, r=red, ls=ls, w=wts: F.cross_entropy(t, cls, w, reduction=r, label_smoothing=ls)))
        else:
            steps.append((f"nll(log_softmax)({red}, weights={wts is not None})",
                          lambda t, r=red, w=wts: F.nll_loss(F.log_softmax(t, 1), cls, w, reduction=r)))
    elif final == "cross_entropy_soft":
        p = torch.softmax(tgt, 1)
        steps.append(("cross_entropy(probabilities)", lambda t: F.cross_entropy(t, p)))
    elif final == "kl_div":
        p = torch.softmax(tgt, 1)
        steps.append(("kl_div(log_softmax, softmax, batchmean)",
                      lambda t: F.kl_div(F.log_softmax(t, 1), p, reduction="batchmean")))
    elif final == "bce_logits":
        p = torch.sigmoid(tgt)
        steps.append((f"bce_with_logits({red})", lambda t, r=red: F.binary_cross_entropy_with_logits(t, p, reduction=r)))
    elif final == "poisson":
        steps.append(("poisson_nll", lambda t: F.poisson_nll_loss(t, tgt.abs())))
    elif final == "soft_margin":
        s = tgt.sign()
        steps.append(("soft_margin", lambda t: F.soft_margin_loss(t, s)))
    elif final == "gaussian_nll":
        steps.append(("gaussian_nll", lambda t: F.gaussian_nll_loss(t, tgt, torch.ones_like(t) * 0.5 + t.abs())))
    return _chain_module(steps, mods), shape, [d for d, _ in steps]


def build_point_net(seed):
    """Point-cloud and graph layers on [B, N, C] (the first three channels are coordinates), N split: k-nearest
    neighbours (cdist + topk, neighbour gathers, max over the neighbourhood), message passing over a fixed random edge
    list (routed reads of the sources, index_add_ / scatter_reduce into the targets, degree normalization), shared
    MLPs with a max-pooled global feature broadcast back, subsampling by a fixed index and inverse-distance
    interpolation back to every point, sorting the points by a coordinate, distance-biased attention. Returns
    (module, shape, desc)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B = rng.choice([1, 2])
    N = rng.randint(8, 36)
    C = rng.choice([3, 4, 6])
    shape = [B, N, C]
    layers, mods = [], nn.ModuleList()
    probe = torch.zeros(shape, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 17)

    def cdist(a, b):
        # Direct differences, not the matmul expansion torch picks above 25 rows: that one leaves each point's
        # distance to itself at sqrt(rounding noise), whose gradient is noise, different for every block size.
        return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")

    def add(desc, fn, mod=None):
        nonlocal probe
        try:
            x = torch.randn(probe.shape, dtype=torch.float64, requires_grad=True)
            out = fn(x)
            out.sum().backward()
            out = out.detach()
        except Exception:
            return False
        if out.dim() != 3 or out.shape[1] < 2 or out.shape[2] < 3 or out.numel() > 60000:
            return False
        if mod is not None:
            mods.append(mod)
        layers.append((desc, fn))
        probe = out
        return True

    n_layers = rng.randint(2, 6)
    tries = 0
    while len(layers) < n_layers and tries < 80:
        tries += 1
        b, n, c = probe.shape
        kind = rng.choice(["knn_max", "edges_index_add", "edges_scatter_reduce", "pointnet", "subsample_interp",
                           "sort_by_coord", "dist_attention", "linear", "index_select", "radius_mean",
                           "scatter_mean_clusters", "edge_conv"])
        if kind == "knn_max":
            k = rng.choice([2, 3, 4])
            mod = nn.Linear(2 * c, c).double()
            def f(x, k=k, mod=mod):
                d = cdist(x[..., :3], x[..., :3])
                idx = d.topk(min(k, x.shape[1]), dim=-1, largest=False).indices          # [B, N, k]
                bidx = torch.arange(x.shape[0]).view(-1, 1, 1)
                nb = x[bidx, idx]                                                      # [B, N, k, C]
                ctr = x.unsqueeze(2).expand_as(nb)
                return mod(torch.cat([ctr, nb - ctr], -1)).amax(2)
            add(f"knn({k}) edge features, max", f, mod)
        elif kind == "edge_conv":
            k = rng.choice([2, 3])
            mod = nn.Sequential(nn.Linear(c, c), nn.ReLU()).double()
            def f(x, k=k, mod=mod):
                d = cdist(x, x)
                w, idx = d.topk(min(k, x.shape[1]), dim=-1, largest=False)
                nb = torch.gather(x.unsqueeze(1).expand(-1, x.shape[1], -1, -1), 2,
                                  idx.unsqueeze(-1).expand(-1, -1, -1, x.shape[2]))
                return x + (mod(nb) * torch.softmax(-w, -1).unsqueeze(-1)).sum(2)
            add(f"knn({k}) gather, softmax(-dist)-weighted MLP", f, mod)
        elif kind in ("edges_index_add", "edges_scatter_reduce"):
            E = rng.randint(n, 3 * n)
            src = torch.randint(0, n, (E,), generator=g)
            dst = torch.randint(0, n, (E,), generator=g)
            mod = nn.Linear(c, c).double()
            if kind == "edges_index_add":
                def f(x, src=src, dst=dst, mod=mod):
                    msg = mod(x[:, src])                                               # [B, E, C]
                    agg = torch.zeros_like(x).index_add_(1, dst, msg)
                    deg = torch.zeros(x.shape[1], dtype=x.dtype).index_add_(0, dst, torch.ones(dst.shape, dtype=x.dtype))
                    return x + agg / deg.clamp(min=1).view(1, -1, 1)
                add(f"message passing, {E} edges, index_add_ + degree", f, mod)
            else:
                red = rng.choice(["sum", "mean", "amax", "amin"])
                def f(x, src=src, dst=dst, mod=mod, red=red):
                    msg = torch.tanh(mod(x.index_select(1, src)))
                    out = x.new_zeros(x.shape).scatter_reduce(1, dst.view(1, -1, 1).expand(x.shape[0], -1, x.shape[2]),
                                                              msg, red, include_self=False)
                    return x + out
                add(f"message passing, {E} edges, scatter_reduce {red}", f, mod)
        elif kind == "pointnet":
            mod = nn.Sequential(nn.Linear(c, 2 * c), nn.ReLU(), nn.Linear(2 * c, c)).double()
            head = nn.Linear(2 * c, c).double()
            def f(x, mod=mod, head=head):
                h = mod(x)
                glob = h.max(1, keepdim=True).values.expand_as(h)
                return head(torch.cat([h, glob], -1))
            add("pointnet: shared MLP, global max broadcast", f, nn.ModuleList([mod, head]))
        elif kind == "subsample_interp" and n >= 6:
            m = rng.randint(3, n // 2)
            sub = torch.randperm(n, generator=g)[:m]
            mod = nn.Linear(c, c).double()
            def f(x, sub=sub, mod=mod):
                s = mod(x[:, sub])                                                     # [B, M, C]
                d = cdist(x[..., :3], s[..., :3].detach())                       # [B, N, M]
                dk, ik = d.topk(min(3, sub.numel()), -1, largest=False)
                w = 1.0 / (dk + 0.1)
                w = w / w.sum(-1, keepdim=True)
                bidx = torch.arange(x.shape[0]).view(-1, 1, 1)
                return x + (s[bidx, ik] * w.unsqueeze(-1)).sum(2)
            add(f"subsample {m}, 3-nn inverse-distance interpolation back", f, mod)
        elif kind == "sort_by_coord":
            j = rng.randrange(3)
            def f(x, j=j):
                order = x[..., j].argsort(1)
                return torch.gather(x, 1, order.unsqueeze(-1).expand_as(x)).cumsum(1) / x.shape[1]
            add(f"sort points by coordinate {j}, cumsum", f)
        elif kind == "dist_attention":
            mod = nn.Linear(c, 3 * c).double()
            def f(x, mod=mod):
                q, k, v = mod(x).chunk(3, -1)
                bias = -cdist(x[..., :3], x[..., :3])
                return x + F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            add("attention with a -distance bias", f, mod)
        elif kind == "linear":
            mod = nn.Linear(c, rng.choice([c, c + 2, 3])).double()
            add(f"linear {c}->{mod.out_features}", mod, mod)
        elif kind == "index_select":
            m = rng.randint(2, 2 * n)
            idx = torch.randint(0, n, (m,), generator=g)
            add(f"index_select 1 ({m} points)", lambda x, idx=idx: x.index_select(1, idx) * 1.5)
        elif kind == "radius_mean":
            r = rng.choice([0.8, 1.5, 2.5])
            def f(x, r=r):
                d = cdist(x[..., :3], x[..., :3])
                m = (d < r).to(x.dtype)
                return torch.bmm(m, x) / m.sum(-1, keepdim=True)
            add(f"radius {r} neighbourhood mean (bmm)", f)
        elif kind == "scatter_mean_clusters":
            K = rng.randint(2, 5)
            cl = torch.randint(0, K, (n,), generator=g)
            def f(x, cl=cl, K=K):
                s = x.new_zeros(x.shape[0], K, x.shape[2]).index_add(1, cl, x)
                cnt = torch.bincount(cl, minlength=K).clamp(min=1).to(x.dtype).view(1, -1, 1)
                # Half the mean: a cluster of one point would otherwise collapse to the origin, and points that
                # coincide exactly tie in every later k-nearest search (torch's tie-break is no contract).
                return x - 0.5 * (s / cnt)[:, cl]
            add(f"subtract half the mean of {K} fixed clusters", f)
    return _chain_module(layers, mods), shape, [d for d, _ in layers]


def _compare(net, ref, y, yr, xs, xr, tol=1e-9):
    """Relative max errors above `tol`: [(quantity, error)]."""
    import shardtensor as st
    full = lambda t: t.full_tensor() if st.is_shard_tensor(t) else t  # noqa: E731
    scale = lambda t: max(t.abs().max().item(), 1e-12)  # noqa: E731
    yf = full(y)
    if yf.shape != yr.shape:
        return [("output shape", f"{tuple(yf.shape)} vs {tuple(yr.shape)}")]
    problems = []
    for what, a, b in [("output", yf, yr), ("input grad", full(xs.grad), xr.grad)] + [
            (n, full(p.grad), pr.grad) for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters())
            if pr.grad is not None]:
        e = (a - b).abs().max().item() / scale(b)
        if not e <= tol:   # nan too
            problems.append((what, e))
    return problems


def case(family, seed, mesh_shape):
    """One network on every rank of the default group: (outcome, layers, layout, detail)."""
    import copy
    import warnings

    import torch
    import shardtensor as st
    from torch.distributed.device_mesh import init_device_mesh
    from cases_util import uneven_extents

    warnings.filterwarnings("ignore", category=UserWarning)  # torch's notes on the shapes the builders try

    rng = random.Random(seed * 7 + 1)
    if family == "window":
        nd = rng.choice([1, 2, 2, 3])
        if len(mesh_shape) == 2 and nd == 1:
            nd = 2
        # Two split dims merged into one (attention over flattened tokens) are gathered on a 2-D mesh by design.
        net, shape, desc = build_window_net(seed, nd, allow_attn=len(mesh_shape) == 1)
        if len(mesh_shape) == 1:
            dims = [rng.randint(2, 1 + nd)]
        else:
            dims = rng.sample(list(range(2, 2 + nd)), 2) if rng.random() < 0.8 else [0, 2]
    elif family == "tokens":
        net, shape, desc = build_token_net(seed)
        dims = [1] if len(mesh_shape) == 1 else [0, 1]
    elif family == "points":
        net, shape, desc = build_point_net(seed)
        dims = [1] if len(mesh_shape) == 1 else [0, 1]
    elif family == "stats":
        net, shape, desc = build_stats_chain(seed)
        dims = [rng.randrange(len(shape))] if len(mesh_shape) == 1 else rng.sample(range(len(shape)), 2)
    else:
        net, shape, desc = build_view_chain(seed)
        dims = [rng.randint(1, 3)] if len(mesh_shape) == 1 else rng.sample([0, 1, 2, 3], 2)
    ext = {i: uneven_extents(shape[d], mesh_shape[i], seed + i) for i, d in enumerate(dims)}
    layout = ([f"Shard({d})" for d in dims], ext)
    m = init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(seed + 5)
    x = torch.randn(shape, dtype=torch.float64)
    ref = copy.deepcopy(net)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    w = torch.randn(yr.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (yr * w).sum().backward()
    # An ill-conditioned chain (a difference of nearly equal quantities) changes by more than the tolerance under a
    # perturbation of the input's last bits on one device already: no layout could match it; such seeds are skipped.
    ref2 = copy.deepcopy(net)
    xr2 = (x * (1 + 1e-15 * torch.randn(shape, dtype=torch.float64))).requires_grad_()
    yr2 = ref2(xr2)
    (yr2 * w).sum().backward()
    if _compare(ref2, ref, yr2, yr, xr2, xr, tol=1e-11):
        return ("illcond", desc, None, None)
    stage = "forward"
    try:
        xs = st.distribute_tensor(x, m, [st.Shard(d) for d in dims], sharding_shapes=ext).requires_grad_()
        with st.use_strict(True):
            y = net(xs)
            stage = "backward"
            ws = st.distribute_tensor(w, m, [st.Replicate() if p.is_partial() else p for p in st.placements(y)],
                                      st.sharding_shapes(y)) if st.is_shard_tensor(y) else w
            (y * ws).sum().backward()
        problems = _compare(net, ref, y, yr, xs, xr)
        return ("wrong", desc, layout, problems[:4]) if problems else ("ok", desc, layout, None)
    except NotImplementedError as e:
        return ("notimpl", desc, layout, f"{stage}: {str(e)[:300]}")
    except Exception as e:  # noqa: BLE001  (any error is an outcome)
        return ("error", desc, layout, f"{stage}: {type(e).__name__}: {str(e)[:400]}\n{traceback.format_exc()[-1500:]}")


def run_seed(family, seed, timeout=120, config=None):
    """The outcome of one seed (its world and mesh from CONFIGS unless `config` = (world, mesh shape) is given),
    agreed by the ranks or marked diverged/hang."""
    import harness
    world, mesh_shape = config or CONFIGS[seed % len(CONFIGS)]
    try:
        results = harness.run(world, case, family, seed, mesh_shape, timeout=timeout)
    except harness.CaseTimeout as e:
        return ("hang", None, None, str(e)[:300])
    except harness.RankError as e:
        return ("error", None, None, str(e)[:1500])
    first = results[0]
    if any(r[0] != first[0] for r in results):
        return ("diverged", first[1], first[2], [r[0] for r in results])
    return first


def main():
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["window", "tokens", "views", "stats", "points"], required=True)
    ap.add_argument("--seeds", default="0:100", help="start:stop")
    ap.add_argument("--mesh", default=None, help="one mesh for every seed: 4 (a 1-D mesh of 4 ranks), 2x2, ...")
    args = ap.parse_args()
    start, stop = (int(v) for v in args.seeds.split(":"))
    config = None
    if args.mesh:
        shape = tuple(int(v) for v in args.mesh.split("x"))
        config = (shape[0] * (shape[1] if len(shape) > 1 else 1), shape)
    counts = {}
    for seed in range(start, stop):
        r = run_seed(args.family, seed, config=config)
        counts[r[0]] = counts.get(r[0], 0) + 1
        if r[0] not in ("ok", "illcond"):
            world, mesh_shape = config or CONFIGS[seed % len(CONFIGS)]
            print(f"seed {seed} ({world} ranks, mesh {mesh_shape}): {r[0]}", r[1], r[2], r[3], flush=True)
    print(args.family, f"seeds {start}:{stop}", counts)
    return 0 if set(counts) <= {"ok", "notimpl", "illcond"} else 1


if __name__ == "__main__":
    sys.exit(main())
