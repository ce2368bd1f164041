"""Window partitions and merges of sharded dims against one device: Swin's window_partition / window_reverse and a
window-attention block written as in the reference code (relative position bias and shifts left out), MaxViT's grid
partition, and LeViT's flatten(0, 1) of (B, N, C) with N sharded and its reverse split. Views that keep every shard a
contiguous block are local (asserted: zero collectives); the others re-lay the input out once (counted) to the
layout the view rule documents (asserted: placements and extents), never refuse."""
import copy

import pytest
import torch
import torch.nn as nn

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn
from shardtensor import Replicate, Shard


# ------------------------------------------------------------------------------ the models, in plain torch

def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    windows = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)
    return windows


def window_reverse(windows, ws, H, W):
    B = int(windows.shape[0] / (H * W / ws / ws))
    x = windows.view(B, H // ws, W // ws, ws, ws, -1)
    x = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)
    return x


def grid_partition(x, g):
    """MaxViT: the grid dims are the outer factors of H and W (the window count is inner)."""
    B, H, W, C = x.shape
    x = x.view(B, g, H // g, g, W // g, C)
    return x.permute(0, 2, 4, 1, 3, 5).contiguous().view(-1, g, g, C)


def grid_reverse(windows, g, H, W):
    C = windows.shape[-1]
    x = windows.view(-1, H // g, W // g, g, g, C)
    return x.permute(0, 3, 1, 4, 2, 5).contiguous().view(-1, H, W, C)


class WindowAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        attn = self.softmax(q @ k.transpose(-2, -1))
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj(x)


class SwinBlock(nn.Module):
    """Swin's block without the shift: tokens (B, H*W, C)."""

    def __init__(self, dim, H, W, ws, num_heads=2):
        super().__init__()
        self.H, self.W, self.ws = H, W, ws
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        H, W, ws = self.H, self.W, self.ws
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        x_windows = window_partition(x, ws).view(-1, ws * ws, C)
        attn_windows = self.attn(x_windows).view(-1, ws, ws, C)
        x = window_reverse(attn_windows, ws, H, W).view(B, H * W, C)
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class LinearNorm(nn.Module):
    """LeViT's Linear + BatchNorm1d over the flattened tokens."""

    def __init__(self, a, b):
        super().__init__()
        self.linear = nn.Linear(a, b)
        self.bn = nn.BatchNorm1d(b)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


# ------------------------------------------------------------------------------ helpers

def _default_split(n, k):
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _nearest_aligned(ext, q):
    """The documented re-alignment: every shard boundary rounds to the nearest multiple of q (ties down)."""
    out, bound, prev = [], 0, 0
    n = sum(ext)
    for i, e in enumerate(ext):
        bound += e
        b = bound - bound % q + (q if 2 * (bound % q) > q else 0)
        b = n if i == len(ext) - 1 else b
        out.append(b - prev)
        prev = b
    return out


def _layout(x):
    return st.placements(x), st.sharding_shapes(x)


def _grads_match(model, ref, what):
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and r.grad is not None, f"{what}: missing grad for {name}"
        assert not st.is_shard_tensor(p.grad), f"{what}: grad of plain parameter {name} is a ShardTensor"
        assert r.grad.abs().max() > 0, f"{what}: trivial grad for {name}"
        close(p.grad, r.grad, rtol=1e-4, atol=1e-5, what=f"{what} grad {name}")


def _backward_both(out, out_ref, xs, x_ref, what):
    w = randn(*out_ref.shape, seed=91)
    (out * w).sum().backward()
    (out_ref * w).sum().backward()
    assert st.placements(xs.grad) == st.placements(xs) and st.sharding_shapes(xs.grad) == st.sharding_shapes(xs), \
        f"{what}: input grad layout {_layout(xs.grad)} != {_layout(xs)}"
    close(full(xs.grad), x_ref.grad, rtol=1e-4, atol=1e-5, what=f"{what} input grad")


# ------------------------------------------------------------------------------ Swin window partition

def case_window_roundtrip(B, H, W, C, ws, h_ext):
    """window_partition -> Linear -> window_reverse, H sharded with extents `h_ext`. Extents that are multiples of
    the window move nothing; others are re-aligned once (nearest window-aligned boundaries)."""
    m = mesh()
    torch.manual_seed(0)
    lin = nn.Linear(C, C)
    ref = copy.deepcopy(lin)
    x = randn(B, H, W, C, seed=3)
    xs = st.distribute_tensor(x, m, [Shard(1)], sharding_shapes={0: h_ext}).requires_grad_()
    xr = x.clone().requires_grad_()
    aligned = all(e % ws == 0 for e in h_ext)
    with st.CommCounter() as c:
        win = window_partition(xs, ws)
    win_ref = window_partition(xr, ws)
    close(full(win), win_ref, what="window_partition")
    k = m.size()
    nh, nw = H // ws, W // ws
    if B == 1:
        want_h = h_ext if aligned else _nearest_aligned(h_ext, ws)
        assert _layout(win) == ((Shard(0),), {0: [e // ws * nw for e in want_h]}), _layout(win)
    else:  # the windows merge under the batch dim: the shard moves to the batch (all-to-all)
        assert _layout(win) == ((Shard(0),), {0: [b * nh * nw for b in _default_split(B, k)]}), _layout(win)
    # One all-to-all to re-align the window rows, one more to move the shard to the batch.
    moves = 0 if k == 1 else (0 if aligned else 1) + (1 if B > 1 else 0)
    assert c.calls == ({"all_to_all": moves} if moves else {}), f"window_partition: {c.calls}"
    with st.CommCounter() as c:
        out = window_reverse(lin(win.view(-1, ws * ws, C)).view(-1, ws, ws, C), ws, H, W)
    out_ref = window_reverse(ref(win_ref.view(-1, ws * ws, C)).view(-1, ws, ws, C), ws, H, W)
    assert c.calls == {}, f"window_reverse communicated: {c.calls}"
    close(full(out), out_ref, rtol=1e-5, atol=1e-5, what="window_reverse")
    if B == 1:
        assert _layout(out) == ((Shard(1),), {0: want_h}), _layout(out)
    else:
        assert _layout(out) == ((Shard(0),), {0: _default_split(B, k)}), _layout(out)
    _backward_both(out, out_ref, xs, xr, "window round trip")
    _grads_match(lin, ref, "window round trip")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_window_roundtrip_aligned(world):
    """Extents that are multiples of the window (zero extents included): no collective."""
    ext = {1: [12], 2: [8, 4], 3: [4, 0, 8], 4: [0, 4, 4, 4]}[world]
    harness.run(world, case_window_roundtrip, 1, 12, 8, 3, 4, ext)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_window_roundtrip_realigned(world):
    """Extents that are not multiples of the window: one all-to-all to the nearest window-aligned extents."""
    ext = {2: [5, 7], 3: [3, 0, 9], 4: [1, 6, 3, 2]}[world]
    harness.run(world, case_window_roundtrip, 1, 12, 8, 3, 4, ext)


@pytest.mark.parametrize("world", [2, 3])
def test_window_roundtrip_batch(world):
    """B > 1: the merge of (B, H/ws, W/ws) moves the shard from the window rows to the batch."""
    ext = {2: [4, 8], 3: [5, 3, 4]}[world]
    harness.run(world, case_window_roundtrip, 3, 12, 8, 3, 4, ext)


def case_window_2d_mesh(h_ext, w_ext):
    """H on mesh dim 0, W on mesh dim 1: the split is local (or re-aligned); the merge of the windows keeps the
    window-row shard and gathers the window-column one (one all-gather on mesh dim 1)."""
    m = mesh((2, 2))
    B, H, W, C, ws = 1, 8, 12, 3, 4
    torch.manual_seed(0)
    lin = nn.Linear(C, C)
    ref = copy.deepcopy(lin)
    x = randn(B, H, W, C, seed=5)
    xs = st.distribute_tensor(x, m, [Shard(1), Shard(2)], sharding_shapes={0: h_ext, 1: w_ext}).requires_grad_()
    xr = x.clone().requires_grad_()
    with st.CommCounter() as c:
        win = window_partition(xs, ws)
    want_calls = {"all_gather": 1}
    if any(e % ws for e in h_ext + w_ext):
        want_calls["all_to_all"] = 1
    assert c.calls == want_calls, c.calls
    want_h = _nearest_aligned(h_ext, ws)
    assert _layout(win) == ((Shard(0), Replicate()), {0: [e // ws * (W // ws) for e in want_h]}), _layout(win)
    out = window_reverse(lin(win.view(-1, ws * ws, C)).view(-1, ws, ws, C), ws, H, W)
    out_ref = window_reverse(ref(window_partition(xr, ws).view(-1, ws * ws, C)).view(-1, ws, ws, C), ws, H, W)
    close(full(out), out_ref, rtol=1e-5, atol=1e-5, what="2-D window round trip")
    assert _layout(out) == ((Shard(1), Replicate()), {0: want_h}), _layout(out)
    _backward_both(out, out_ref, xs, xr, "2-D window round trip")
    _grads_match(lin, ref, "2-D window round trip")
    return True


@pytest.mark.parametrize("h_ext,w_ext", [([4, 4], [8, 4]), ([3, 5], [12, 0])])
def test_window_2d_mesh(h_ext, w_ext):
    harness.run(4, case_window_2d_mesh, h_ext, w_ext)


# ------------------------------------------------------------------------------ the Swin block

def case_swin_block(B, l_ext, mesh_shape):
    """The whole block on tokens (B, H*W, C) sharded on the token dim: view(B, H, W, C) splits the tokens into
    rows (re-aligned to whole rows, then to whole windows, when needed), window attention runs on local windows,
    and forward, input gradient and every parameter gradient equal one device."""
    m = mesh(mesh_shape)
    H, W, C, ws = 8, 8, 8, 4
    torch.manual_seed(0)
    blk = SwinBlock(C, H, W, ws)
    ref = copy.deepcopy(blk)
    x = randn(B, H * W, C, seed=7)
    pl = [Shard(1)] + [Replicate()] * (len(mesh_shape) - 1)
    xs = st.distribute_tensor(x, m, pl, sharding_shapes={0: l_ext}).requires_grad_()
    xr = x.clone().requires_grad_()
    aligned = all(e % (W * ws) == 0 for e in l_ext)
    with st.CommCounter() as c:
        out = blk(xs)
    out_ref = ref(xr)
    close(full(out), out_ref, rtol=1e-4, atol=1e-5, what="swin block")
    if aligned and B == 1:
        assert c.calls == {}, f"window-aligned Swin block communicated in forward: {c.calls}"
        assert _layout(out) == _layout(xs), _layout(out)
    _backward_both(out, out_ref, xs, xr, "swin block")
    _grads_match(blk, ref, "swin block")
    return True


@pytest.mark.parametrize("world,l_ext", [(2, [32, 32]), (3, [0, 32, 32]), (2, [20, 44]), (3, [7, 30, 27])])
def test_swin_block(world, l_ext):
    harness.run(world, case_swin_block, 1, l_ext, (world,))


def test_swin_block_batch():
    harness.run(2, case_swin_block, 2, [24, 40], (2,))


def test_swin_block_2d_mesh():
    harness.run(4, case_swin_block, 1, [32, 32], (2, 2))


# ------------------------------------------------------------------------------ MaxViT grid partition

def case_grid_roundtrip(h_ext):
    """The grid dim g is a small outer factor of H (g * g < H / g): the split puts the shard on the window count H/g
    (one all-to-all after the local view; one more first when the extents are not multiples of H/g), so each rank
    holds whole grid windows and the attention over a window's g * g tokens is local. The reverse merges (g, H/g) with
    the shard on the inner factor: one all-to-all moves it to the outer g (view's merge rule)."""
    m = mesh()
    B, H, W, C, g = 1, 12, 8, 3, 2
    torch.manual_seed(0)
    lin = nn.Linear(C, C)
    ref = copy.deepcopy(lin)
    x = randn(B, H, W, C, seed=9)
    xs = st.distribute_tensor(x, m, [Shard(1)], sharding_shapes={0: h_ext}).requires_grad_()
    xr = x.clone().requires_grad_()
    q = H // g
    with st.CommCounter() as c:
        win = grid_partition(xs, g)
    aligned = all(e % q == 0 for e in h_ext)
    assert c.calls == ({} if m.size() == 1 else {"all_to_all": 1 if aligned else 2}), c.calls
    rows = _default_split(q, m.size())
    assert _layout(win) == ((Shard(0),), {0: [r * (W // g) for r in rows]}), _layout(win)
    with st.CommCounter() as c:
        out = grid_reverse(lin(win), g, H, W)
    assert c.calls == ({} if m.size() == 1 else {"all_to_all": 1}), c.calls
    out_ref = grid_reverse(ref(grid_partition(xr, g)), g, H, W)
    close(full(out), out_ref, rtol=1e-5, atol=1e-5, what="grid round trip")
    assert _layout(out) == ((Shard(1),), {0: [r * q for r in _default_split(g, m.size())]}), _layout(out)
    _backward_both(out, out_ref, xs, xr, "grid round trip")
    _grads_match(lin, ref, "grid round trip")
    return True


@pytest.mark.parametrize("world,h_ext", [(2, [6, 6]), (2, [5, 7]), (3, [0, 6, 6]), (3, [4, 4, 4])])
def test_grid_roundtrip(world, h_ext):
    harness.run(world, case_grid_roundtrip, h_ext)


# ------------------------------------------------------------------------------ LeViT flatten(0, 1)

def case_levit_flatten(B, n_ext):
    """(B, N, C) with N sharded: flatten(0, 1) moves the shard to the batch (one all-to-all; the default split of
    B, in whole rows of N), BatchNorm1d runs on the merged rows, and reshape_as splits back locally."""
    m = mesh()
    k = m.size()
    N, C = sum(n_ext), 4
    torch.manual_seed(0)
    mod = LinearNorm(C, 6)
    ref = copy.deepcopy(mod)
    x = randn(B, N, C, seed=11)
    xs = st.distribute_tensor(x, m, [Shard(1)], sharding_shapes={0: n_ext}).requires_grad_()
    xr = x.clone().requires_grad_()
    with st.CommCounter() as c:
        flat = xs.flatten(0, 1)
    assert c.calls == ({} if k == 1 else {"all_to_all": 1}), c.calls
    assert _layout(flat) == ((Shard(0),), {0: [b * N for b in _default_split(B, k)]}), _layout(flat)
    close(full(flat), x.flatten(0, 1), what="flatten(0, 1)")
    out = mod(xs)
    out_ref = ref(xr)
    close(full(out), out_ref, rtol=1e-4, atol=1e-5, what="LeViT LinearNorm")
    assert _layout(out) == ((Shard(0),), {0: _default_split(B, k)}), _layout(out)
    _backward_both(out, out_ref, xs, xr, "LeViT LinearNorm")
    _grads_match(mod, ref, "LeViT LinearNorm")
    return True


@pytest.mark.parametrize("world,B,n_ext", [(1, 3, [5]), (2, 3, [2, 3]), (3, 4, [0, 3, 2]), (4, 2, [1, 2, 0, 2])])
def test_levit_flatten(world, B, n_ext):
    harness.run(world, case_levit_flatten, B, n_ext)


def case_unflatten_rows(ext, B, N):
    """(B*N, C) sharded with boundaries inside rows of N, viewed as (B, N, C): re-aligned once to the nearest
    whole rows (local when they already are)."""
    m = mesh()
    C = 3
    x = randn(B * N, C, seed=13)
    xs = st.distribute_tensor(x, m, [Shard(0)], sharding_shapes={0: ext}).requires_grad_()
    xr = x.clone().requires_grad_()
    with st.CommCounter() as c:
        y = xs.view(B, N, C)
    aligned = all(e % N == 0 for e in ext)
    assert c.calls == ({} if aligned or m.size() == 1 else {"all_to_all": 1}), c.calls
    want = _nearest_aligned(ext, N)
    assert _layout(y) == ((Shard(0),), {0: [e // N for e in want]}), _layout(y)
    y_ref = xr.view(B, N, C)
    close(full(y), y_ref, what="unflatten rows")
    _backward_both(y * 2, y_ref * 2, xs, xr, "unflatten rows")
    return True


@pytest.mark.parametrize("world,ext", [(2, [7, 8]), (3, [5, 0, 10]), (4, [3, 3, 4, 5]), (2, [10, 5])])
def test_unflatten_rows(world, ext):
    harness.run(world, case_unflatten_rows, ext, 3, 5)


def case_merge_two_sharded():
    """(B, N, C) with B on mesh dim 0 and N on mesh dim 1, flattened: the outer (batch) shard stays, the token
    shard is gathered (a merged dim is sharded by one mesh dim)."""
    m = mesh((2, 2))
    x = randn(3, 5, 2, seed=15)
    xs = st.distribute_tensor(x, m, [Shard(0), Shard(1)], sharding_shapes={0: [1, 2], 1: [4, 1]}).requires_grad_()
    xr = x.clone().requires_grad_()
    with st.CommCounter() as c:
        y = xs.flatten(0, 1)
    assert c.calls == {"all_gather": 1}, c.calls
    assert _layout(y) == ((Shard(0), Replicate()), {0: [5, 10]}), _layout(y)
    close(full(y), xr.flatten(0, 1), what="merge of two sharded dims")
    _backward_both(y.sin(), xr.flatten(0, 1).sin(), xs, xr, "merge of two sharded dims")
    return True


def test_merge_two_sharded():
    harness.run(4, case_merge_two_sharded)
