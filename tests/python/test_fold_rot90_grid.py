"""F.unfold / F.fold (im2col / col2im: VOLO's outlook attention), torch.rot90 (DLWP's cubed-sphere faces) and
grid_sample with batch-sharded input and grid (RAFT's warping) run by their own rules, in strict mode (no gather
fallback), against one device: forward, input gradient, parameter gradients where there are parameters, uneven
and zero extents, 1-4 ranks, 2-D meshes."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, mesh, narrow_extents, randn, strict, tiny_extents, uneven_extents

TOL = dict(rtol=1e-5, atol=1e-6)
# (kernel, dilation, padding, stride)
BLOCKS = [(3, 1, 1, 1), (2, 1, 0, 2), ((3, 2), (2, 1), (2, 1), (2, 1)), (1, 1, 0, 3), (4, 1, 1, 3)]


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
    # W's mesh dim moves onto the batch (H is split already): the columns stay divided over both mesh dims.
    check_op(lambda t: F.unfold(t, 3, padding=1), [x], [lay], m, **TOL, what="unfold 2x2 H and W",
             expect_placements=(st.Shard(2), st.Shard(0)))
    check_op(lambda t: F.fold(F.unfold(t, 2, stride=2), (9, 8), 2, stride=2), [x], [lay], m, **TOL,
             what="fold after unfold 2x2 H and W")
    # A batch of one has no row for each rank of W's mesh dim: W is gathered.
    check_op(lambda t: F.unfold(t, 3, padding=1), [x[:1]], [lay], m, **TOL, what="unfold 2x2 H and W, one image",
             expect_placements=(st.Shard(2), st.Replicate()))
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


D64 = dict(dtype=torch.float64)
TIGHT = dict(rtol=1e-9, atol=1e-10)
# (mode, padding_mode, align_corners): every kernel and both windowed paddings, both normalizations
SPATIAL_MODES = [("bilinear", "zeros", False), ("nearest", "border", True), ("bicubic", "zeros", True),
                 ("bicubic", "border", False), ("bilinear", "border", True), ("bilinear", "reflection", True),
                 ("bilinear", "reflection", False), ("nearest", "reflection", False)]


def _identity_grid(*sizes, align_corners):
    """The grid that samples every output point at itself (a warp's base), for output sizes (D,) H, W."""
    axes = []
    for n in sizes:
        step = 2 / n
        axes.append(torch.linspace(-1, 1, n, **D64) if align_corners else
                    torch.arange(n, **D64) * step - 1 + step / 2)
    mesh_ = torch.meshgrid(*axes, indexing="ij")
    return torch.stack(mesh_[::-1], -1).unsqueeze(0)


def case_grid_sample_spatial(kind):
    """A spatially split input: each rank's points read a window of input rows that travels as a halo."""
    m = mesh()
    w = m.size()
    x = randn(2, 3, 9, 7, seed=20, **D64)
    ext = _ext(kind, 9, w, seed=20)
    lay = ([st.Shard(2)], ext)
    anywhere = randn(2, 9, 7, 2, seed=21, **D64) * 0.8          # points anywhere: large windows
    outside = randn(2, 9, 7, 2, seed=22, **D64) * 1.6           # many points outside (zeros) or clamped (border)
    for mode, pad, ac in SPATIAL_MODES:
        fn = lambda a, g: F.grid_sample(a, g, mode=mode, padding_mode=pad, align_corners=ac)  # noqa: E731
        what = f"grid_sample {mode} {pad} {ac} {kind}"
        warp = _identity_grid(9, 7, align_corners=ac) + 0.15 * randn(2, 9, 7, 2, seed=23, **D64)
        for name, g in (("warp", warp), ("anywhere", anywhere), ("outside", outside)):
            out = check_op(fn, [x, g], [lay, None], m, **TIGHT, what=f"{what} {name}, plain grid")
            # the output is cut like the input (the same size): the work stays divided
            assert st.placements(out) == (st.Shard(2),) and (ext is None or st.sharding_shapes(out) == ext)
            check_op(fn, [x, g], [lay, lay_g(ext)], m, **TIGHT, what=f"{what} {name}, grid split alike")
        other = ([st.Shard(1)], {0: uneven_extents(9, w, seed=24)})
        check_op(fn, [x, warp], [lay, other], m, **TIGHT, what=f"{what}, grid split otherwise")
        small = randn(2, 4, 5, 2, seed=25, **D64) * 0.9
        out = check_op(fn, [x, small], [lay, None], m, **TIGHT, what=f"{what}, another output size")
        assert st.placements(out) == (st.Shard(2),)
        # the input whole, the grid split: the output follows the grid, the input's gradient is summed
        check_op(fn, [x, warp], [None, lay_g(ext)], m, **TIGHT, what=f"{what}, plain input")
    # channel shards with a whole grid: local
    check_op(lambda a, g: F.grid_sample(a, g, align_corners=False), [x, anywhere],
             [([st.Shard(1)], {0: uneven_extents(3, w, seed=26)}), None], m, **TIGHT, what="grid_sample channels")
    # 3-D (VoxelMorph's warp of a volume): D or H split
    v = randn(1, 2, 6, 5, 4, seed=27, **D64)
    for ac in (False, True):
        base = _identity_grid(6, 5, 4, align_corners=ac) + 0.2 * randn(1, 6, 5, 4, 3, seed=28, **D64)
        for dim, n in ((2, 6), (3, 5)):
            vl = ([st.Shard(dim)], {0: uneven_extents(n, w, seed=29)})
            gl = ([st.Shard(dim - 1)], {0: uneven_extents(n, w, seed=29)})
            check_op(lambda a, g: F.grid_sample(a, g, align_corners=ac), [v, base], [vl, gl], m, **TIGHT,
                     what=f"grid_sample 3-D dim {dim} ac={ac}")
            check_op(lambda a, g: F.grid_sample(a, g, mode="nearest", padding_mode="border", align_corners=ac),
                     [v, base], [vl, None], m, **TIGHT, what=f"grid_sample 3-D nearest dim {dim} ac={ac}")
    return True


def lay_g(ext):
    """The grid split along its output rows as the input along its rows."""
    return ([st.Shard(1)], ext)


@pytest.mark.parametrize("world,kind", [(1, "even"), (2, "uneven"), (3, "tiny"), (4, "narrow")])
def test_grid_sample_spatial(world, kind):
    harness.run(world, strict, case_grid_sample_spatial, kind)


def case_grid_sample_spatial_collectives():
    """A small warp moves the rows next to each rank's block: the range agreement and the halo, nothing gathered."""
    m = mesh()
    x = randn(1, 2, 16, 6, seed=30, **D64)
    g = _identity_grid(16, 6, align_corners=False) + 0.05 * randn(1, 16, 6, 2, seed=31, **D64)
    xs = st.distribute_tensor(x, m, [st.Shard(2)])
    gs = st.distribute_tensor(g, m, [st.Shard(1)])
    with st.CommCounter() as c:
        out = F.grid_sample(xs, gs, align_corners=False)
    # one small all-gather (every rank's row range) and one halo exchange
    assert dict(c.calls) == {"all_gather": 1, "halo": 1}, c.calls
    # the backward reuses the forward's windows (the same grid, unmodified): no second range all-gather
    xs = st.distribute_tensor(x, m, [st.Shard(2)]).requires_grad_()
    gs = st.distribute_tensor(g, m, [st.Shard(1)]).requires_grad_()
    with st.CommCounter() as c:
        F.grid_sample(xs, gs, align_corners=False).square().sum().backward()
    assert dict(c.calls) == {"all_gather": 1, "halo": 3}, c.calls   # halo: forward, backward's window, grad home
    assert st.to_local(out).shape[2] == st.to_local(xs).shape[2]
    return dict(c.calls)


def test_grid_sample_spatial_collectives():
    calls = harness.run(2, strict, case_grid_sample_spatial_collectives)
    print(calls)


def case_grid_sample_spatial_2d_mesh():
    m = mesh((2, 2))
    x = randn(2, 3, 7, 6, seed=32, **D64)
    grid = randn(2, 7, 6, 2, seed=33, **D64) * 0.7
    warp = _identity_grid(7, 6, align_corners=True) + 0.2 * randn(2, 7, 6, 2, seed=34, **D64)
    lay = ([st.Shard(2), st.Shard(3)], {0: [3, 4], 1: [6, 0]})
    glay = ([st.Shard(1), st.Shard(2)], {0: [3, 4], 1: [6, 0]})
    for g in (grid, warp):
        for mode, pad, ac in SPATIAL_MODES:
            fn = lambda a, gg: F.grid_sample(a, gg, mode=mode, padding_mode=pad, align_corners=ac)  # noqa: E731
            out = check_op(fn, [x, g], [lay, None], m, **TIGHT, what=f"grid_sample 2x2 {mode} {pad} {ac}")
            assert st.placements(out) == (st.Shard(2), st.Shard(3)) and st.sharding_shapes(out) == lay[1]
            check_op(fn, [x, g], [lay, glay], m, **TIGHT, what=f"grid_sample 2x2 {mode} {pad} {ac} grid split")
    # the batch on one mesh dim, the rows on the other
    lay_b = ([st.Shard(0), st.Shard(2)], {0: [1, 1], 1: [2, 5]})
    check_op(lambda a, gg: F.grid_sample(a, gg, align_corners=False), [x, warp],
             [lay_b, ([st.Shard(0), st.Replicate()], {0: [1, 1]})], m, **TIGHT, what="grid_sample 2x2 batch + rows")
    return True


def test_grid_sample_spatial_2d_mesh():
    harness.run(4, strict, case_grid_sample_spatial_2d_mesh)


def case_grid_sample_reflection_strict():
    m = mesh()
    xs = st.distribute_tensor(randn(2, 2, 6, 5, seed=18), m, [st.Shard(2)])
    F.grid_sample(xs, randn(2, 3, 3, 2, seed=19), mode="bicubic", padding_mode="reflection", align_corners=False)


def test_grid_sample_reflection_strict():
    """Bicubic sampling with reflection padding of a spatially split input mirrors each tap about edges a window does
    not have: strict mode refuses it on every rank, naming the remedy (the default runs it gathered,
    tests/python/test_fallback.py)."""
    harness.expect_error(2, strict, case_grid_sample_reflection_strict,
                         match="bicubic sampling with reflection padding", kinds=("NotImplementedError",))
