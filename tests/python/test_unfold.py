"""Tensor.unfold(dim, size, step) along a sharded dim (a halo exchange plus the local unfold, the windows sharded
like the output rows) and along unsharded dims (a local view), against one device: forward, input gradient,
parameter gradients (a HaloNet-style blocked attention), uneven and zero extents, shards narrower than a window,
1-4 ranks, a 2-D mesh with both unfolded dims sharded; the sharded case is a copy and refuses in-place writes."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, mesh, narrow_extents, randn, strict, tiny_extents, uneven_extents

WINDOWS = [(3, 2), (4, 4), (2, 5), (1, 1), (11, 1), (5, 3)]  # (size, step): overlapping, tiling, gaps, whole dim


def _ext(kind, n, w):
    return {"even": None, "uneven": {0: uneven_extents(n, w, seed=2)}, "tiny": {0: tiny_extents(n, w)},
            "narrow": {0: narrow_extents(n, w)}}[kind]


def case_unfold_sharded_dim(kind):
    m = mesh()
    w = m.size()
    x = randn(2, 11, 3, seed=1)
    lay = ([st.Shard(1)], _ext(kind, 11, w))
    for size, step in WINDOWS:
        out = check_op(lambda t: t.unfold(1, size, step), [x], [lay], m, what=f"unfold(1, {size}, {step}) {kind}")
        assert st.placements(out) == (st.Shard(1),), st.placements(out)
        if w > 1:
            ext = st.sharding_shapes(out)[0]
            assert sum(ext) == (11 - size) // step + 1, ext
    # followed by ops on the windows (a reduction over the window dim, a product with a plain weight)
    wt = randn(4, seed=3)
    check_op(lambda t, a: (t.unfold(1, 4, 2) * a).sum(-1), [x, wt], [lay, None], m, what=f"unfold weighted {kind}")
    check_op(lambda t: t.unfold(-2, 3, 1).amax(-1), [x], [lay], m, what=f"unfold negative dim {kind}")
    return True


@pytest.mark.parametrize("world,kind", [(1, "even"), (2, "even"), (2, "uneven"), (3, "tiny"), (3, "uneven"),
                                        (4, "narrow")])
def test_unfold_sharded_dim(world, kind):
    harness.run(world, strict, case_unfold_sharded_dim, kind)


def case_unfold_local_dim():
    """Unfolding an unsharded dim of a sharded tensor is a view of the local tensor: writes reach the input."""
    m = mesh()
    x = randn(3, 7, 8, seed=4)
    lay = ([st.Shard(1)], {0: uneven_extents(7, m.size(), seed=5)})
    out = check_op(lambda t: t.unfold(2, 3, 2), [x], [lay], m, what="unfold local dim")
    assert st.placements(out) == (st.Shard(1),)
    xs = st.distribute_tensor(x.clone(), m, [st.Shard(1)], sharding_shapes=lay[1])
    xs.unfold(2, 2, 2).mul_(0)  # non-overlapping windows of an unsharded dim: a real view
    ref = x.clone()
    ref.unfold(2, 2, 2).mul_(0)
    torch.testing.assert_close(xs.full_tensor(), ref)
    return True


def test_unfold_local_dim():
    harness.run(3, strict, case_unfold_local_dim)


def case_unfold_partial():
    m = mesh()
    x = randn(9, 4, seed=6)
    a = randn(9, 3, seed=7)
    lay = ([st.Shard(1)], None)  # a @ b with the contracted dim sharded: Partial(sum)
    check_op(lambda t, b: (t.t() @ b).unfold(1, 2, 1), [x, a], [lay, ([st.Shard(0)], None)], m, what="Partial input")
    return True


def test_unfold_partial():
    harness.run(2, strict, case_unfold_partial)


def case_halonet_blocks(mesh_shape):
    """HaloNet's blocked local attention: pad by the halo, unfold both spatial dims into blocks with their halos
    (size = block + 2 * halo, step = block), attend within each block; H and W sharded (a 2-D mesh: one each)."""
    m = mesh(mesh_shape)
    x = randn(2, 4, 8, 12, seed=8)
    q_w = randn(4, 4, seed=9)
    block, halo = 4, 1

    def blocks(t, wq):
        win = block + 2 * halo
        kv = F.pad(t, (halo, halo, halo, halo)).unfold(2, win, block).unfold(3, win, block)  # B C h w win win
        B, C, nh, nw = kv.shape[:4]
        kv = kv.reshape(B, C, nh, nw, win * win)
        q = t.unfold(2, block, block).unfold(3, block, block).reshape(B, C, nh, nw, block * block)
        q = torch.einsum("bchwn,cd->bdhwn", q, wq)
        att = torch.softmax(torch.einsum("bchwq,bchwk->bhwqk", q, kv), -1)
        return torch.einsum("bhwqk,bchwk->bchwq", att, kv)

    if len(mesh_shape) == 2:
        lay = ([st.Shard(2), st.Shard(3)], {0: [4, 4], 1: uneven_extents(12, 2, seed=3)})
    else:
        lay = ([st.Shard(3)], {0: uneven_extents(12, mesh_shape[0], seed=4)})
    check_op(blocks, [x, q_w], [lay, None], m, rtol=1e-4, atol=1e-5, what=f"halonet blocks {mesh_shape}")
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_halonet_blocks(mesh_shape):
    harness.run(int(torch.tensor(mesh_shape).prod()), strict, case_halonet_blocks, mesh_shape)


def case_write_refused(grad):
    m = mesh()
    xs = st.distribute_tensor(randn(2, 9, seed=10), m, [st.Shard(1)]).requires_grad_(grad)
    u = xs.unfold(1, 3, 2)
    if grad:
        u = u * 1  # a fresh tensor: writing it is fine
        u.add_(1)
        u = xs.detach().unfold(1, 3, 2)
    u.add_(1)  # the windows are a copy of the input's rows


@pytest.mark.parametrize("grad", [False, True])
def test_write_refused(grad):
    harness.expect_error(2, case_write_refused, grad, match="aten::unfold along sharded dim 1",
                         kinds=("NotImplementedError",))


def case_bad_args():
    m = mesh()
    xs = st.distribute_tensor(randn(2, 5, seed=11), m, [st.Shard(1)])
    xs.unfold(1, 6, 1)


def test_bad_args():
    with pytest.raises(RuntimeError):
        torch.randn(2, 5).unfold(1, 6, 1)
    harness.expect_error(2, case_bad_args, match="maximum size")


def case_unfold_backward_op(kind):
    """aten::unfold_backward called on a gradient sharded along the windows dim (torch.compile and double backward
    reach it): the windows' rows go home, whether the windows' extents came from an unfold or not."""
    m = mesh()
    w = m.size()
    x = randn(2, 11, 3, seed=12)
    xs = st.distribute_tensor(x, m, [st.Shard(1)], sharding_shapes=_ext(kind, 11, w))
    for size, step in WINDOWS:
        u = xs.unfold(1, size, step)
        g = randn(*u.shape, seed=13)
        want = torch.ops.aten.unfold_backward(g, list(x.shape), 1, size, step)
        for ext in (st.sharding_shapes(u), {0: uneven_extents(u.shape[1], w, seed=size)}):
            gs = st.distribute_tensor(g, m, [st.Shard(1)], sharding_shapes=ext)
            got = torch.ops.aten.unfold_backward(gs, list(x.shape), 1, size, step)
            assert st.placements(got) == (st.Shard(1),)
            torch.testing.assert_close(got.full_tensor(), want, msg=lambda s: f"unfold_backward {size} {step}: {s}")
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny"), (4, "narrow")])
def test_unfold_backward_op(world, kind):
    harness.run(world, strict, case_unfold_backward_op, kind)


def case_unfold_backward_window_dim_split():
    """A gradient reaching unfold_backward split along the window dim (fuzz_nets.py views seed 2163: a select along
    the split dim after the unfold, whose gradient takes its own default split): the split moves to another dim
    first (the windows dim here, the largest free one) instead of a refusal."""
    m = mesh()
    x = randn(2, 11, 3, seed=14)
    for size, step in WINDOWS:
        n = (11 - size) // step + 1
        g = randn(2, n, 3, size, seed=15)
        want = torch.ops.aten.unfold_backward(g, list(x.shape), 1, size, step)
        gs = st.distribute_tensor(g, m, [st.Shard(3)], sharding_shapes={0: uneven_extents(size, m.size(), seed=1)})
        got = torch.ops.aten.unfold_backward(gs, list(x.shape), 1, size, step)
        torch.testing.assert_close(got.full_tensor(), want, msg=lambda s: f"unfold_backward {size} {step}: {s}")
    return True


def test_unfold_backward_window_dim_split():
    harness.run(2, strict, case_unfold_backward_window_dim_split)
