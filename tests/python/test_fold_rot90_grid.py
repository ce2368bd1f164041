"""F.unfold / F.fold (im2col / col2im: VOLO's outlook attention), torch.rot90 (DLWP's cubed-sphere faces) and
grid_sample with batch-sharded input and grid (RAFT's warping) run by their own rules, in strict mode (no gather
fallback), against one device: forward, input gradient, parameter gradients where there are parameters, uneven
and zero extents, 1-4 ranks, 2-D meshes."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, mesh, narrow_extents, randn, tiny_extents, uneven_extents

TOL = dict(rtol=1e-5, atol=1e-6)
# (kernel, dilation, padding, stride)
BLOCKS = [(3, 1, 1, 1), (2, 1, 0, 2), ((3, 2), (2, 1), (2, 1), (2, 1)), (1, 1, 0, 3), (4, 1, 1, 3)]


def strict(case, *args):
    with st.use_strict():
        return case(*args)


def _ext(kind, n, w, seed=0):
    return {"even": None, "uneven": {0: uneven_extents(n, w, seed=seed)}, "tiny": {0: tiny_extents(n, w)},
            "narrow": {0: narrow_extents(n, w)}}[kind]


def case_unfold_h(kind):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 9, 7, seed=1)
    lay = ([st.Shard(2)], _ext(kind, 9, w, seed=1))
    for k, d, p, s in BLOCKS:
        fn = lambda t: F.unfold(t, k, dilation=d, padding=p, stride=s)  # noqa: E731
        out = check_op(fn, [x], [lay], m, **TOL, what=f"unfold k={k} d={d} p={p} s={s} {kind}")
        if w > 1:
            assert st.placements(out) == (st.Shard(2),), st.placements(out)
    return True


@pytest.mark.parametrize("world,kind", [(1, "even"), (2, "uneven"), (3, "tiny"), (3, "uneven"), (4, "narrow")])
def test_unfold_h(world, kind):
    harness.run(world, strict, case_unfold_h, kind)


def case_unfold_other_layouts():
    """W sharded (its shard moves onto H), batch and channel sharded (local), an unbatched input, a 2-D mesh."""
    m = mesh()
    w = m.size()
    x = randn(3, 4, 8, 7, seed=2)
    fn = lambda t: F.unfold(t, 3, padding=1, stride=(2, 1))  # noqa: E731
    for d, n in ((3, 7), (0, 3), (1, 4)):
        check_op(fn, [x], [([st.Shard(d)], {0: uneven_extents(n, w, seed=d)})], m, **TOL, what=f"unfold dim {d}")
    check_op(lambda t: F.unfold(t, 2, stride=2), [x[0]], [([st.Shard(1)], {0: uneven_extents(8, w)})], m, **TOL,
             what="unfold unbatched")
    return True


def test_unfold_other_layouts():
    harness.run(3, strict, case_unfold_other_layouts)


def case_unfold_2d_mesh():
    m = mesh((2, 2))
    x = randn(2, 3, 9, 8, seed=3)
    lay = ([st.Shard(2), st.Shard(3)], {0: [4, 5], 1: [6, 2]})
    check_op(lambda t: F.unfold(t, 3, padding=1), [x], [lay], m, **TOL, what="unfold 2x2 H and W")
    lay = ([st.Shard(0), st.Shard(2)], {0: [1, 1], 1: [0, 9]})
    check_op(lambda t: F.unfold(t, 2, stride=2), [x], [lay], m, **TOL, what="unfold 2x2 batch and H")
    return True


def test_unfold_2d_mesh():
    harness.run(4, strict, case_unfold_2d_mesh)


def case_fold(kind):
    m = mesh()
    w = m.size()
    cols = randn(2, 3 * 4, 4 * 3, seed=4)  # 2x2 blocks, stride (2, 2): a 4 x 3 grid of blocks of an 8 x 6 image
    for ext in (_ext(kind, 12, w, seed=4), {0: [3 * e for e in uneven_extents(4, w, seed=5)]}):
        check_op(lambda c: F.fold(c, (8, 6), 2, stride=2), [cols], [([st.Shard(2)], ext)], m, **TOL,
                 what=f"fold non-overlapping {ext}")
    cols = randn(2, 2 * 9, 7 * 5, seed=6)  # 3x3 blocks, padding 1, stride 1 of a 7 x 5 image: overlapping
    check_op(lambda c: F.fold(c, (7, 5), 3, padding=1), [cols], [([st.Shard(2)], _ext(kind, 35, w, seed=6))], m,
             **TOL, what="fold overlapping")
    check_op(lambda c: F.fold(c, (7, 5), 3, padding=1), [cols[0]], [([st.Shard(1)], None)], m, **TOL,
             what="fold unbatched")
    check_op(lambda c: F.fold(c, (7, 5), 3, padding=1), [cols], [([st.Shard(1)], {0: [9 * e for e in
                                                                                  uneven_extents(2, w)]})],
             m, **TOL, what="fold channel-sharded")
    return True


@pytest.mark.parametrize("world,kind", [(1, "even"), (2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_fold(world, kind):
    harness.run(world, strict, case_fold, kind)


def case_outlook_attention(mesh_shape):
    """VOLO's outlook attention: unfold the values to k x k neighbourhoods, weight them by attention computed from
    a linear map of each token, fold the weighted neighbourhoods back; H sharded (and W on a second mesh dim).
    The fold's output keeps the input's layout, so the residual adds locally."""
    m = mesh(mesh_shape)
    torch.manual_seed(0)
    C, k, heads = 4, 3, 2
    v_proj, attn_proj = torch.nn.Linear(C, C), torch.nn.Linear(C, k ** 4 * heads)
    x = randn(2, 7, 6, C, seed=7)  # tokens-last (B, H, W, C), as VOLO

    def outlook(t, wv, bv, wa, ba):
        B, H, W, _ = t.shape
        v = F.linear(t, wv, bv).permute(0, 3, 1, 2)  # B C H W
        v = F.unfold(v, k, padding=1).reshape(B, heads, C // heads, k * k, H * W).permute(0, 1, 4, 3, 2)
        a = F.linear(t, wa, ba).reshape(B, H * W, heads, k * k, k * k).permute(0, 2, 1, 3, 4).softmax(-1)
        o = (a @ v).permute(0, 1, 4, 3, 2).reshape(B, C * k * k, H * W)
        return t + F.fold(o, (H, W), k, padding=1).permute(0, 2, 3, 1)

    if len(mesh_shape) == 2:
        lay = ([st.Shard(1), st.Shard(2)], {0: [3, 4], 1: [2, 4]})
    else:
        lay = ([st.Shard(1)], {0: uneven_extents(7, mesh_shape[0], seed=8)})
    params = [v_proj.weight, v_proj.bias, attn_proj.weight, attn_proj.bias]
    out = check_op(outlook, [x] + [p.detach() for p in params], [lay] + [None] * 4, m, rtol=1e-4, atol=1e-5,
                   what=f"outlook attention {mesh_shape}")
    if len(mesh_shape) == 1:
        assert st.placements(out) == (st.Shard(1),) and st.sharding_shapes(out) == lay[1], st.sharding_shapes(out)
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_outlook_attention(mesh_shape):
    harness.run(int(torch.tensor(mesh_shape).prod()), strict, case_outlook_attention, mesh_shape)


def case_rot90(kind):
    m = mesh()
    w = m.size()
    x = randn(2, 6, 5, seed=9)
    for d, n in ((1, 6), (2, 5)):
        lay = ([st.Shard(d)], _ext(kind, n, w, seed=d))
        for k in (-1, 0, 1, 2, 3, 5):
            for dims in ((1, 2), (2, 1), (0, 1)):
                out = check_op(lambda t: torch.rot90(t, k, dims), [x], [lay], m, what=f"rot90 k={k} {dims} dim {d}")
    # k = 1 over (H, W) with H sharded: the shard moves to the rotated W, no data moves
    xs = st.distribute_tensor(x, m, [st.Shard(1)], sharding_shapes=_ext(kind, 6, w, seed=1))
    with st.CommCounter() as c:
        out = torch.rot90(xs, 1, (1, 2))
    assert c.total_calls == 0, c
    assert st.placements(out) == (st.Shard(2),)
    return True


@pytest.mark.parametrize("world,kind", [(1, "even"), (2, "uneven"), (3, "tiny"), (4, "narrow")])
def test_rot90(world, kind):
    harness.run(world, strict, case_rot90, kind)


def case_rot90_2d_mesh():
    m = mesh((2, 2))
    x = randn(3, 5, 6, seed=10)
    lay = ([st.Shard(1), st.Shard(2)], {0: [2, 3], 1: [6, 0]})
    for k in (1, 2, 3):
        check_op(lambda t: torch.rot90(t, k, (1, 2)), [x], [lay], m, what=f"rot90 2x2 k={k}")
    return True


def test_rot90_2d_mesh():
    harness.run(4, strict, case_rot90_2d_mesh)


def case_grid_sample_batch(kind):
    m = mesh()
    w = m.size()
    x = randn(5, 2, 6, 7, seed=11)
    grid = randn(5, 4, 3, 2, seed=12) * 0.8
    lay = ([st.Shard(0)], _ext(kind, 5, w, seed=11))
    for mode, pad, ac in (("bilinear", "zeros", False), ("nearest", "border", True), ("bicubic", "reflection", False)):
        fn = lambda a, g: F.grid_sample(a, g, mode=mode, padding_mode=pad, align_corners=ac)  # noqa: E731
        what = f"grid_sample {mode} {pad} {ac} {kind}"
        out = check_op(fn, [x, grid], [lay, lay], m, **TOL, what=what + " both batch-sharded")
        assert st.placements(out) == (st.Shard(0),)
        check_op(fn, [x, grid], [lay, None], m, **TOL, what=what + " plain grid")
        check_op(fn, [x, grid], [None, lay], m, **TOL, what=what + " plain input")
    x3, g3 = randn(4, 2, 3, 4, 5, seed=13), randn(4, 2, 3, 2, 3, seed=14) * 0.8
    check_op(lambda a, g: F.grid_sample(a, g, align_corners=False), [x3, g3],
             [([st.Shard(0)], _ext(kind, 4, w, seed=2))] * 2, m, **TOL, what="grid_sample 3-D")
    # RAFT's warp: a flow field turned into a grid
    flow = randn(5, 2, 6, 7, seed=15)

    def warp(img, fl):
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, 6), torch.linspace(-1, 1, 7), indexing="ij")
        base = torch.stack((xs, ys), -1)
        return F.grid_sample(img, base + 0.1 * fl.permute(0, 2, 3, 1), align_corners=True)

    check_op(warp, [x, flow], [lay, lay], m, **TOL, what="raft warp")
    return True


@pytest.mark.parametrize("world,kind", [(1, "even"), (2, "uneven"), (3, "tiny")])
def test_grid_sample_batch(world, kind):
    harness.run(world, strict, case_grid_sample_batch, kind)


def case_grid_sample_batch_2d_mesh():
    """Batch on one mesh dim, replicated on the other: still local."""
    m = mesh((2, 2))
    x, grid = randn(3, 2, 5, 5, seed=16), randn(3, 4, 4, 2, seed=17)
    lay = ([st.Shard(0), st.Replicate()], {0: [1, 2]})
    check_op(lambda a, g: F.grid_sample(a, g, align_corners=False), [x, grid], [lay, lay], m, **TOL,
             what="grid_sample 2x2 batch")
    return True


def test_grid_sample_batch_2d_mesh():
    harness.run(4, strict, case_grid_sample_batch_2d_mesh)


def case_grid_sample_spatial_strict():
    m = mesh()
    xs = st.distribute_tensor(randn(2, 2, 6, 5, seed=18), m, [st.Shard(2)])
    F.grid_sample(xs, randn(2, 3, 3, 2, seed=19), align_corners=False)


def test_grid_sample_spatial_strict():
    """A spatially sharded input has no rule: strict mode refuses it on every rank (the default runs it gathered,
    tests/python/test_fallback.py::test_grid_sample)."""
    harness.expect_error(2, strict, case_grid_sample_spatial_strict,
                         match="aten::grid_sampler_2d was refused by its domain-parallel rule",
                         kinds=("NotImplementedError",))
