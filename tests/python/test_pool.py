"""Pooling over sharded spatial dims (halo exchange) against single-device results: max_pool 1-3d with global
indices (kernel, stride, padding, dilation, ceil_mode), avg_pool 1-3d (ceil_mode, count_include_pad,
divisor_override), adaptive avg/max pool 1-3d including global pooling; uneven shards, shards narrower than the
halo, zero-extent ranks, batch/channel sharding, 2-D meshes with two sharded spatial dims; input gradients; global
average pooling of channels-last maps (adaptive pool to 1, spatial means, a pooling head's parameter gradients)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, full, mesh, narrow_extents, randn, uneven_extents

TOL = dict(rtol=1e-5, atol=1e-6)


def _max_sweep(x, lay, m, nd, tag, params):
    fn1 = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
    done = 0
    for k, s, p, d, ceil in params:
        try:
            fn1(x, k, s, p, d, ceil_mode=ceil)
        except RuntimeError:
            continue  # invalid on one device too (output too small)
        check_op(lambda t: fn1(t, k, s, p, d, ceil_mode=ceil, return_indices=True), [x], [lay], m, **TOL,
                 what=f"{tag} max k={k} s={s} p={p} d={d} ceil={ceil}")
        done += 1
    assert done > 0, f"{tag}: every max configuration was skipped"
    return done


def _same_with_nan(fn, x, lay, m, what):
    """``fn`` (giving values and indices) of the sharded ``x`` against one device's: NaN compared equal, indices
    exactly."""
    vs, js = fn(st.distribute_tensor(x, m, lay[0], sharding_shapes=lay[1]))
    v, j = fn(x)
    torch.testing.assert_close(full(vs), v, equal_nan=True, msg=lambda e: f"{what}: {e}")
    assert torch.equal(full(js), j), f"{what} indices: {full(js)} vs {j}"


def case_max_pool1d_sweep(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 13, seed=seed)
    for ext in (uneven_extents(13, w, seed), narrow_extents(13, w)):
        lay = ([st.Shard(2)], {0: ext})
        params = [(k, s, p, d, c) for k in (1, 2, 3, 4) for s in (1, 2, 3) for p in range(0, k // 2 + 1)
                  for d in (1, 2) for c in (False, True)]
        assert _max_sweep(x, lay, m, 1, f"ext={ext}", params) >= 90
    return True


def _avg_sweep(x, lay, m, nd, tag, params):
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]
    done = 0
    for k, s, p, ceil, cip, div in params:
        kw = dict(ceil_mode=ceil, count_include_pad=cip)
        if div is not None:
            kw["divisor_override"] = div
        try:
            fn(x, k, s, p, **kw)
        except RuntimeError:
            continue
        check_op(lambda t: fn(t, k, s, p, **kw), [x], [lay], m, **TOL,
                 what=f"{tag} avg k={k} s={s} p={p} ceil={ceil} cip={cip} div={div}")
        done += 1
    assert done > 0, f"{tag}: every avg configuration was skipped"
    return done


def case_avg_pool1d_sweep(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 13, seed=seed)
    for ext in (uneven_extents(13, w, seed), narrow_extents(13, w)):
        lay = ([st.Shard(2)], {0: ext})
        params = [(k, s, p, c, cip, None) for k in (1, 2, 3, 4) for s in (1, 2, 3) for p in range(0, k // 2 + 1)
                  for c in (False, True) for cip in (True, False)]
        assert _avg_sweep(x, lay, m, 1, f"ext={ext}", params) >= 90
    return True


def case_pool2d(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 11, 9, seed=seed)
    for lay in (([st.Shard(2)], {0: uneven_extents(11, w, seed)}), ([st.Shard(3)], {0: narrow_extents(9, w)})):
        _max_sweep(x, lay, m, 2, "2d", [(3, 2, 1, 1, True), ((2, 3), (1, 2), (1, 0), (2, 1), False),
                                        (4, 3, 2, 1, True), (3, 1, 1, 2, False), (2, 2, 0, 1, True)])
        _avg_sweep(x, lay, m, 2, "2d", [(3, 2, 1, True, True, None), (3, 2, 1, True, False, None),
                                        ((2, 3), (1, 2), (1, 1), False, False, None), (4, 3, 2, True, True, None),
                                        (3, 2, 1, True, True, 5), (2, 2, 0, False, True, None)])
    # Batch- and channel-sharded inputs run locally.
    for pl in (st.Shard(0), st.Shard(1)):
        check_op(lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True), [x], [([pl], None)], m, **TOL,
                 what=f"max {pl}")
        check_op(lambda t: F.avg_pool2d(t, 3, 2, 1), [x], [([pl], None)], m, **TOL, what=f"avg {pl}")
    # Unbatched input.
    check_op(lambda t: F.max_pool2d(t, 3, 2, 1, ceil_mode=True, return_indices=True), [x[0]],
             [([st.Shard(1)], {0: uneven_extents(11, w, seed + 1)})], m, **TOL, what="unbatched max")
    return True


def case_integer_max_pool(seed):
    """Integer max pooling whose windows overhang (ceil_mode, padding): the padding rows are the dtype's lowest value
    (an infinity cannot fill an integer tensor, and only the ranks with padding rows fill: they raised alone, and the
    next collective paired different messages). Strict mode, values and indices against one device."""
    m = mesh()
    w = m.size()
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-50, 50, (1, 2, 3, 7), generator=g)
    with st.use_strict():
        for lay in (([st.Shard(3)], {0: uneven_extents(7, w, seed)}), ([st.Shard(2)], {0: uneven_extents(3, w, seed)})):
            for k, s_, p, ceil in [(3, 2, 0, True), (3, 2, 1, False), (2, 2, 1, True)]:
                check_op(lambda t: F.max_pool2d(t, k, s_, p, ceil_mode=ceil, return_indices=True), [x], [lay], m,
                         grad=False, what=f"int max_pool2d k{k} s{s_} p{p} ceil={ceil} {lay[0]}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_integer_max_pool(world):
    harness.run(world, case_integer_max_pool, world)


def case_pool3d(seed):
    m = mesh()
    w = m.size()
    x = randn(1, 2, 7, 6, 5, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(7, w, seed)})
    _max_sweep(x, lay, m, 3, "3d", [(3, 2, 1, 1, True), ((2, 3, 2), (1, 2, 2), (1, 1, 0), (2, 1, 1), False)])
    _avg_sweep(x, lay, m, 3, "3d", [(3, 2, 1, True, True, None), (3, 2, 1, True, False, None),
                                    ((2, 3, 2), (1, 2, 2), (1, 1, 0), False, True, 3)])
    lay = ([st.Shard(3)], {0: narrow_extents(6, w)})
    _max_sweep(x, lay, m, 3, "3d w", [(3, 2, 1, 1, True)])
    _avg_sweep(x, lay, m, 3, "3d w", [(3, 2, 1, True, False, None)])
    # ranks with fewer rows than the kernel (avg_pool3d refuses an unpadded input shorter than its kernel: such a
    # rank builds its window, which holds the padding rows), with ceil windows and a divisor override
    lay = ([st.Shard(3)], {0: {2: [4, 2], 3: [2, 1, 3], 4: [2, 1, 1, 2]}[w]})
    _avg_sweep(x, lay, m, 3, "3d short", [((2, 3, 4), (1, 2, 2), (0, 1, 2), True, True, 2),
                                          ((2, 3, 4), (1, 2, 2), (0, 1, 2), True, False, None)])
    _max_sweep(x, lay, m, 3, "3d short", [((2, 3, 4), (1, 2, 2), (0, 1, 2), 1, True)])
    return True


def case_pool_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 3, 9, 8, seed=seed)
    for ext in ({0: uneven_extents(9, 2, seed), 1: uneven_extents(8, 2, seed + 1)}, {0: [1, 8], 1: [0, 8]}):
        lay = ([st.Shard(2), st.Shard(3)], ext)
        _max_sweep(x, lay, m, 2, f"2-D mesh {ext}", [(3, 2, 1, 1, True), (3, 1, 1, 2, False), ((2, 4), (2, 3), (1, 2), 1, True)])
        # Average pooling with a halo along both split dims (the window over both): per-dim kernels, ceil mode's
        # overhanging windows, both divisor rules and an override.
        _avg_sweep(x, lay, m, 2, f"2-D mesh {ext}",
                   [(3, 2, 1, True, False, None), (3, 2, 1, True, True, None), (2, 1, 1, False, True, 3),
                    ((3, 5), (2, 3), (1, 2), True, False, None), ((4, 3), (3, 1), (2, 1), True, True, None),
                    ((4, 3), (3, 2), (2, 0), True, False, 5), (3, 1, 0, False, True, None)])
        # (3, 4) and (9, 2) divide the sizes: plain poolings with kernel = stride (ops/pool.cpp uniform_cells).
        for size in ((3, 2), (4, 5), (1, 3), (1, 1), (9, 8), (3, 4), (9, 2)):
            check_op(lambda t: F.adaptive_avg_pool2d(t, size), [x], [lay], m, **TOL, what=f"2-D mesh adaptive avg {size}")
            check_op(lambda t: F.adaptive_max_pool2d(t, size, return_indices=True), [x], [lay], m, **TOL,
                     what=f"2-D mesh adaptive max {size}")
    # PSPNet's pyramid (1, 2, 3, 6) over H and W split, and a volume split along D and W (H whole between them):
    # adaptive averages over two exchanged dims run as two passes of one exchanged dim each (no window), in strict
    # mode, forward and backward.
    xp = randn(1, 2, 13, 11, seed=seed + 7)
    xv = randn(1, 2, 7, 5, 9, seed=seed + 8)
    with st.use_strict():
        for ext in ({0: [7, 6], 1: [5, 6]}, {0: [0, 13], 1: [11, 0]}, {0: [12, 1], 1: [1, 10]}):
            for size in (1, 2, 3, 6, (4, 5)):
                check_op(lambda t: F.adaptive_avg_pool2d(t, size), [xp], [([st.Shard(2), st.Shard(3)], ext)], m,
                         **TOL, what=f"pyramid adaptive avg {size} {ext}")
        for size in ((3, 2, 4), (2, 5, 2), (1, 3, 9)):
            check_op(lambda t: F.adaptive_avg_pool3d(t, size), [xv], [([st.Shard(4), st.Shard(2)], {0: [4, 5], 1: [3, 4]})],
                     m, **TOL, what=f"volume adaptive avg {size}")
    # Average pooling of a volume split along D and W, and in bfloat16 (accumulated in float and rounded once, as one
    # device does), in strict mode.
    with st.use_strict():
        _avg_sweep(xv, ([st.Shard(4), st.Shard(2)], {0: [4, 5], 1: [3, 4]}), m, 3, "volume D x W",
                   [(3, 2, 1, True, False, None), ((2, 3, 3), (2, 1, 2), (1, 1, 1), False, True, None),
                    (3, (1, 2, 3), 1, True, True, 4)])
        xb = randn(1, 3, 11, 10, seed=seed + 9, dtype=torch.bfloat16)
        for fn in (lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False),
                   lambda t: F.avg_pool2d(t, (5, 3), 2, (2, 1), divisor_override=7)):
            check_op(fn, [xb], [([st.Shard(2), st.Shard(3)], {0: [6, 5], 1: [3, 7]})], m, rtol=1e-2, atol=1e-2,
                     what="2-D mesh bf16 avg")
    # Max pooling with a halo along both split dims runs without the window (comm::multi_border_forward: the call on
    # the own block, border slabs from region windows over the corners): ties (small integers: the first maximum in
    # row-major order wins) and NaN on both sides of both boundaries (the kernel keeps the last), indices compared
    # exactly; a volume split along D and W; strict mode.
    g = torch.Generator().manual_seed(seed + 10)
    xt = torch.randint(0, 3, (1, 2, 11, 10), generator=g).float()
    xn = xt.clone()
    xn[0, 0, 5, 3] = xn[0, 0, 6, 4] = xn[0, 1, 5, 4] = xn[0, 1, 6, 3] = float("nan")
    configs = [(3, 2, 1, 1, False), (3, 1, 1, 1, True), (2, 2, 1, 1, True), ((3, 5), (1, 2), (1, 2), 1, False)]
    with st.use_strict():
        for ext in ({0: [6, 5], 1: [4, 6]}, {0: [3, 8], 1: [7, 3]}):
            lay = ([st.Shard(2), st.Shard(3)], ext)
            _max_sweep(xt, lay, m, 2, f"2-D mesh ties {ext}", configs)
            for k, s, p, d, ceil in configs:
                _same_with_nan(lambda t: F.max_pool2d(t, k, s, p, d, ceil, return_indices=True), xn, lay, m,
                               f"NaN max {k} {s} {ext}")
        _max_sweep(xv, ([st.Shard(4), st.Shard(2)], {0: [4, 5], 1: [3, 4]}), m, 3, "volume D x W",
                   [(3, 2, 1, 1, True), ((2, 3, 3), (2, 1, 2), (1, 1, 1), 1, False), (3, 1, 1, 2, False)])
    # One mesh dim shards the batch, the other a spatial dim.
    lay = ([st.Shard(0), st.Shard(3)], {1: [5, 3]})
    check_op(lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True), [x], [lay], m, **TOL, what="batch x width max")
    check_op(lambda t: F.adaptive_avg_pool2d(t, (2, 3)), [x], [lay], m, **TOL, what="batch x width adaptive")
    return True


def case_adaptive(seed):
    m = mesh()
    w = m.size()
    x1 = randn(2, 3, 13, seed=seed)
    x2 = randn(2, 2, 10, 7, seed=seed)
    x3 = randn(1, 2, 7, 5, 4, seed=seed)
    for ext in (uneven_extents(13, w, seed), narrow_extents(13, w)):
        lay = ([st.Shard(2)], {0: ext})
        for n in (1, 2, 3, 5, 6, 13, 17):
            check_op(lambda t: F.adaptive_avg_pool1d(t, n), [x1], [lay], m, **TOL, what=f"adaptive avg1d {n} {ext}")
            check_op(lambda t: F.adaptive_max_pool1d(t, n, return_indices=True), [x1], [lay], m, **TOL,
                     what=f"adaptive max1d {n} {ext}")
    lay = ([st.Shard(2)], {0: uneven_extents(10, w, seed)})
    for size in ((3, 4), (1, 1), (1, 7), (4, 1), (10, 3), (7, None), (5, 7), (2, 1)):
        check_op(lambda t: F.adaptive_avg_pool2d(t, size), [x2], [lay], m, **TOL, what=f"adaptive avg2d {size}")
        check_op(lambda t: F.adaptive_max_pool2d(t, size, return_indices=True), [x2], [lay], m, **TOL,
                 what=f"adaptive max2d {size}")
    lay = ([st.Shard(3)], {0: narrow_extents(5, w)})
    for size in ((3, 2, 2), (1, 1, 1), (2, 1, 3)):
        check_op(lambda t: F.adaptive_avg_pool3d(t, size), [x3], [lay], m, **TOL, what=f"adaptive avg3d {size}")
        check_op(lambda t: F.adaptive_max_pool3d(t, size, return_indices=True), [x3], [lay], m, **TOL,
                 what=f"adaptive max3d {size}")
    return True


def case_adaptive_max_straddling(seed):
    """Adaptive max pooling whose cells straddle shards (ops/pool.cpp cell_partials): each rank's maxima over its own
    rows meet at the cell's owner. Ties (small integer values: the first element in row-major order wins, across
    ranks too) and NaN on each side of a shard boundary in the same cell and twice in one column of a rank's rows (the
    later one wins, as on one device),
    split along H or W (the row-major order interleaves W's shards), on 1-D and 2x2 meshes, uneven and empty shards."""
    m = mesh() if seed else mesh((2, 2), ("a", "b"))
    w = m.size()
    torch.manual_seed(seed)
    x = torch.randint(0, 3, (2, 2, 13, 11)).double()
    ties = x.clone()
    x[0, 1, 5, 2] = float("nan")   # cell (1, 0) of (3, 2) cells: rows [4, 9), cols [0, 6)
    x[0, 1, 8, 3] = float("nan")
    x[1, 0, 2, 4] = float("nan")   # cell (0, 0): rows [0, 5), cols [0, 6)
    x[1, 0, 2, 5] = float("nan")
    x[0, 0, 4, 2] = float("nan")   # two in one column of cell (1, 0), on one rank of the H splits: the later wins
    x[0, 0, 6, 2] = float("nan")
    if seed:
        layouts = [([st.Shard(2)], {0: e}) for e in ([13 - 6 * (w - 1)] + [6] * (w - 1) if w > 1 else [13],
                                                     narrow_extents(13, w))]
        layouts += [([st.Shard(3)], {0: narrow_extents(11, w)})]
    else:
        layouts = [([st.Shard(2), st.Shard(3)], {0: [7, 6], 1: [3, 8]}),
                   ([st.Shard(2), st.Shard(3)], {0: [0, 13], 1: [11, 0]})]
    for lay in layouts:
        for size in ((3, 2), (4, 3), (2, 5), (13, 3)):
            check_op(lambda t: F.adaptive_max_pool2d(t, size, return_indices=True), [ties], [lay], m,
                     what=f"ties {size} {lay}")
            with st.use_strict():
                _same_with_nan(lambda t: F.adaptive_max_pool2d(t, size, return_indices=True), x, lay, m,
                               f"NaN {size} {lay}")
    # More cells along H than the table reduces as views (ops/pool.cpp kCellsByView): the copied-rows first pass.
    tall = torch.randint(0, 3, (1, 2, 75, 11)).double()
    tall[0, 0, 30, 1] = tall[0, 0, 30, 2] = float("nan")
    tall[0, 1, 31, 5] = tall[0, 1, 32, 5] = float("nan")  # one column of cell 29 (rows [31, 33)): the later wins
    lay = (([st.Shard(2)], {0: narrow_extents(75, w)}) if seed
           else ([st.Shard(2), st.Shard(3)], {0: [40, 35], 1: [5, 6]}))
    for t in (tall, tall.nan_to_num()):
        _same_with_nan(lambda u: F.adaptive_max_pool2d(u, (70, 4), return_indices=True), t, lay, m, "many cells")
    check_op(lambda t: F.adaptive_max_pool2d(t, (70, 4), return_indices=True), [tall.nan_to_num()], [lay], m,
             what="many cells")
    return True


def case_no_grad_and_modules(seed):
    """Inference paths (no autograd: composite kernels may take other routes) and nn modules."""
    m = mesh()
    w = m.size()
    x = randn(2, 3, 12, 10, seed=seed)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(12, w, seed)})
    with torch.no_grad():
        for name, fn in [("max2d", lambda t: F.max_pool2d(t, 3, 2, 1)),
                         ("max1d", lambda t: F.max_pool1d(t[:, :, :, 0], 3, 2, 1)),
                         ("avg2d", lambda t: F.avg_pool2d(t, 2)),
                         ("adaptive avg", lambda t: F.adaptive_avg_pool2d(t, (5, 3))),
                         ("adaptive max", lambda t: F.adaptive_max_pool2d(t, (5, 3))),
                         ("global avg", lambda t: F.adaptive_avg_pool2d(t, 1))]:
            torch.testing.assert_close(full(fn(xs)), fn(x), rtol=1e-5, atol=1e-6, msg=name)
    with torch.inference_mode():
        xi = st.distribute_tensor(x, m, [st.Shard(2)])
        torch.testing.assert_close(full(F.max_pool2d(xi, 2)), F.max_pool2d(x, 2))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.MaxPool2d(2, ceil_mode=True),
                              torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.AvgPool2d(3, 2, 1),
                              torch.nn.AdaptiveAvgPool2d((2, 2)))
    check_op(lambda t: net(t), [x], [([st.Shard(2)], {0: uneven_extents(12, w, seed)})], m, rtol=1e-4, atol=1e-5,
             what="conv/pool stack")
    return True


def case_global_avg_partial(seed):
    """Adaptive avg pool to size 1 along a sharded dim is a pending sum (no halo)."""
    m = mesh()
    x = randn(2, 3, 11, 6, seed=seed)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(11, m.size(), seed)})
    y = torch.ops.aten._adaptive_avg_pool2d(xs, [1, 3])
    assert str(st.placements(y)[0]) == "Partial(sum)", st.placements(y)
    torch.testing.assert_close(full(y), torch.ops.aten._adaptive_avg_pool2d(x, [1, 3]), rtol=1e-5, atol=1e-6)
    # Adaptive max to size 1: local max, then one small combine; the output is replicated on that mesh dim.
    v, i = F.adaptive_max_pool2d(xs, (1, 3), return_indices=True)
    assert str(st.placements(v)[0]) == "Replicate()", st.placements(v)
    rv, ri = F.adaptive_max_pool2d(x, (1, 3), return_indices=True)
    torch.testing.assert_close(full(v), rv)
    torch.testing.assert_close(full(i), ri)
    # Ties go to the first position in row-major order, as on one device.
    z = torch.zeros(1, 1, 5, 3)
    zs = st.distribute_tensor(z, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(5, m.size(), seed + 3)})
    torch.testing.assert_close(full(F.adaptive_max_pool2d(zs, 1, return_indices=True)[1]),
                               F.adaptive_max_pool2d(z, 1, return_indices=True)[1])
    return True


def _channels_last(t):
    return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)


class _PoolHead(nn.Module):
    """ConvNeXt/PoolFormer-style head: global average pool of a channels-last map, flatten, Linear."""

    def __init__(self, c, nd):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1) if nd == 2 else nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(c, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(x), 1))


def case_global_pool_channels_last(seed):
    """Global average pooling of channels-last (and otherwise strided) sharded maps: adaptive_avg_pool to 1 (which
    restrides its mean output in place), mean over the spatial dims with and without keepdim, the pooling head of a
    classifier with its Linear's gradients; 2-D and 3-D, sharded along H, W or D, uneven and zero extents."""
    m = mesh()
    w = m.size()
    x2 = randn(2, 5, 7, 6, seed=seed)
    x3 = randn(2, 4, 5, 3, 4, seed=seed)
    cases2 = [
        ("adaptive_avg_pool2d 1", lambda t: F.adaptive_avg_pool2d(_channels_last(t), 1)),
        ("adaptive_avg_pool2d (1, 1) * 2", lambda t: F.adaptive_avg_pool2d(_channels_last(t) * 2.0, (1, 1))),
        ("mean (2, 3) keepdim", lambda t: _channels_last(t).mean((2, 3), keepdim=True)),
        ("mean (-2, -1)", lambda t: _channels_last(t).mean((-2, -1))),
        ("sum (2, 3) keepdim", lambda t: _channels_last(t).sum((2, 3), keepdim=True)),
        ("amax (2, 3) keepdim", lambda t: _channels_last(t).amax((2, 3), keepdim=True)),
        ("permuted mean", lambda t: t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2).mean((2, 3), True)),
        ("adaptive_avg_pool2d 1 then mul", lambda t: F.adaptive_avg_pool2d(_channels_last(t), 1) * t[:, :, :1, :1]),
    ]
    for d in (2, 3):
        for ext in (uneven_extents(x2.shape[d], w, seed + d), narrow_extents(x2.shape[d], w)):
            lay = ([st.Shard(d)], {0: ext})
            for name, fn in cases2:
                check_op(fn, [x2], [lay], m, **TOL, what=f"{name} S({d}) {ext}")
            # The input is channels-last already when it is distributed.
            check_op(lambda t: F.adaptive_avg_pool2d(t, 1), [_channels_last(x2)], [lay], m, **TOL,
                     what=f"channels-last leaf S({d}) {ext}")
    for d in (2, 4):
        lay = ([st.Shard(d)], {0: uneven_extents(x3.shape[d], w, seed + d)})
        check_op(lambda t: F.adaptive_avg_pool3d(_channels_last(t), 1), [x3], [lay], m, **TOL,
                 what=f"adaptive_avg_pool3d 1 S({d})")
        check_op(lambda t: _channels_last(t).mean((2, 3, 4), keepdim=True), [x3], [lay], m, **TOL,
                 what=f"mean 3-D keepdim S({d})")
    # The classifier head: every parameter gradient against one device.
    for nd, x in ((2, x2), (3, x3)):
        torch.manual_seed(seed)
        ref = _PoolHead(x.shape[1], nd)
        mod = _PoolHead(x.shape[1], nd)
        mod.load_state_dict(ref.state_dict())
        xr = _channels_last(x).requires_grad_()
        xs = st.distribute_tensor(_channels_last(x), m, [st.Shard(2)], {0: uneven_extents(x.shape[2], w, seed)})
        xs.requires_grad_()
        yr, ys = ref(xr), mod(xs)
        torch.testing.assert_close(full(ys), yr, **TOL)
        g = randn(*yr.shape, seed=3)
        (yr * g).sum().backward()
        (ys * g).sum().backward()
        torch.testing.assert_close(full(xs.grad), xr.grad, **TOL)
        for (n, pr), ps in zip(ref.named_parameters(), mod.parameters()):
            torch.testing.assert_close(full(ps.grad), pr.grad, **TOL, msg=lambda s, n=n: f"{nd}-D head {n}: {s}")
    return True


def case_global_pool_channels_last_2d_mesh():
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 4, 5, 6, seed=7)
    lay = ([st.Shard(2), st.Shard(3)], {0: [5, 0], 1: [2, 4]})
    check_op(lambda t: F.adaptive_avg_pool2d(_channels_last(t), 1), [x], [lay], m, **TOL, what="2-D mesh pool")
    check_op(lambda t: _channels_last(t).mean((2, 3), keepdim=True), [x], [lay], m, **TOL, what="2-D mesh mean")
    lay = ([st.Shard(0), st.Shard(2)], {0: [1, 1], 1: [3, 2]})
    check_op(lambda t: F.adaptive_avg_pool2d(_channels_last(t), 1), [x], [lay], m, **TOL, what="2-D mesh N, H")
    return True


def case_bad_padding(seed):
    m = mesh()
    xs = st.distribute_tensor(randn(1, 2, 9, seed=seed), m, [st.Shard(2)])
    F.max_pool1d(xs, 3, 1, padding=2)


def case_bad_avg_padding(seed):
    m = mesh()
    xs = st.distribute_tensor(randn(1, 2, 9, 9, seed=seed), m, [st.Shard(2)])
    F.avg_pool2d(xs, 2, 1, padding=2)


def case_bad_divisor(seed):
    m = mesh()
    xs = st.distribute_tensor(randn(1, 2, 9, 9, seed=seed), m, [st.Shard(2)])
    F.avg_pool2d(xs, 2, divisor_override=0)


def case_unpool_bad_index(mesh_shape):
    """An index outside the output on one rank's part only: every rank raises IndexError before anything moves (on a
    2x2 mesh too, where the ranks of other groups would otherwise wait in the second routing step)."""
    m = mesh(mesh_shape)
    x = randn(1, 2, 8, 8, seed=3)
    _, idx = F.max_pool2d(x, 2, return_indices=True)
    idx[0, 0, 0, 0] = 10 ** 6
    pl = [st.Shard(3)] if mesh_shape is None else [st.Shard(2), st.Shard(3)]
    xs = st.distribute_tensor(x, m, pl)
    out, _ = F.max_pool2d(xs, 2, return_indices=True)
    with st.use_strict():
        F.max_unpool2d(out, st.distribute_tensor(idx, m, pl), 2)


def case_max_unpool(seed):
    """max_unpool2d of a pooled tensor split along its height (SegNet's decoder): each value to the owner of its target
    row (nothing but the counts travels when the output height is a multiple of the pooled one), the gradient read
    back from the owners; overlapping windows and an output size that is not a multiple send values across ranks."""
    m = mesh()
    w = m.size()
    x = randn(2, 3, 12, 10, seed=seed)
    lay = ([st.Shard(2)], {0: [2 * e for e in uneven_extents(6, w, seed)]})
    with st.use_strict():
        def segnet(t):
            pooled, idx = F.max_pool2d(t, 2, return_indices=True)
            return F.max_unpool2d(torch.tanh(pooled), idx, 2)
        out = check_op(segnet, [x], [lay], m, what="pool then unpool")
        assert st.placements(out) == (st.Shard(2),), st.placements(out)

        def overlapping(t):
            pooled, idx = F.max_pool2d(t, 3, 2, padding=1, return_indices=True)
            return F.max_unpool2d(pooled * 2, idx, 3, 2, padding=1, output_size=(13, 10))
        check_op(lambda t: overlapping(F.pad(t, (0, 0, 0, 1))), [x], [lay], m, what="overlapping windows, odd size")
        # the width split, and 3-D (max_unpool3d) along each spatial dim
        wlay = ([st.Shard(3)], {0: [2 * e for e in uneven_extents(5, w, seed + 1)]})
        check_op(segnet, [x], [wlay], m, what="pool then unpool, width split")
        v = randn(1, 2, 6, 4, 6, seed=seed + 2)
        for d, n in ((2, 6), (3, 4), (4, 6)):
            vlay = ([st.Shard(d)], {0: [2 * e for e in uneven_extents(n // 2, w, seed + d)]})

            def unpool3d(t):
                pooled, idx = F.max_pool3d(t, 2, return_indices=True)
                return F.max_unpool3d(torch.tanh(pooled), idx, 2)
            check_op(unpool3d, [v], [vlay], m, what=f"max_unpool3d, dim {d} split")
            check_op(lambda t: F.max_unpool3d(*F.max_pool3d(t, 3, 2, padding=1, return_indices=True), 3, 2, padding=1,
                                              output_size=(6, 4, 6)), [v], [vlay], m, what=f"max_unpool3d overlapping, dim {d}")
        xs = st.distribute_tensor(x, m, *lay)
        pooled, idx = F.max_pool2d(xs, 2, return_indices=True)
        st.reset_comm_stats()
        F.max_unpool2d(pooled, idx, 2)
        calls = st.comm_stats()["calls"]
        assert calls == ({"all_gather": 1, "all_to_all": 2} if w > 1 else {}), calls
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_max_unpool(world):
    harness.run(world, case_max_unpool, world)


def case_max_unpool_2d_mesh():
    """Height and width split (QuickNAT on a 2x2 mesh): each value moves along the height's mesh dim, then along the
    width's; the gradient comes back the same way in reverse."""
    m = mesh((2, 2))
    x = randn(2, 3, 8, 8, seed=40)
    with st.use_strict():
        for ext in ({0: [4, 4], 1: [2, 6]}, {0: [6, 2], 1: [0, 8]}):
            lay = ([st.Shard(2), st.Shard(3)], ext)

            def segnet(t):
                pooled, idx = F.max_pool2d(t, 2, return_indices=True)
                return F.max_unpool2d(torch.tanh(pooled), idx, 2)
            out = check_op(segnet, [x], [lay], m, what=f"pool then unpool, 2x2 {ext}")
            assert st.placements(out) == (st.Shard(2), st.Shard(3)), st.placements(out)

            def overlapping(t):
                pooled, idx = F.max_pool2d(t, 3, 2, padding=1, return_indices=True)
                return F.max_unpool2d(pooled * 2, idx, 3, 2, padding=1, output_size=(8, 8))
            check_op(overlapping, [x], [lay], m, what=f"overlapping windows, odd size, 2x2 {ext}")
        # the batch on one mesh dim, the width on the other
        check_op(lambda t: F.max_unpool2d(*F.max_pool2d(t, 2, return_indices=True), 2), [x],
                 [([st.Shard(0), st.Shard(3)], {0: [1, 1], 1: [2, 6]})], m, what="batch + width")
    return True


def test_max_unpool_2d_mesh():
    harness.run(4, case_max_unpool_2d_mesh)


def case_low_precision(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 11, 7, seed=seed, dtype=torch.bfloat16)
    lay = ([st.Shard(2)], {0: uneven_extents(11, w, seed)})
    for fn in (lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False),
               lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True),
               lambda t: F.adaptive_avg_pool2d(t, (4, 3))):
        check_op(fn, [x], [lay], m, rtol=1e-2, atol=1e-2, what="bf16")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_max_pool1d_sweep(world):
    harness.run(world, case_max_pool1d_sweep, world, timeout=300)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_avg_pool1d_sweep(world):
    harness.run(world, case_avg_pool1d_sweep, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_pool2d(world):
    harness.run(world, case_pool2d, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pool3d(world):
    harness.run(world, case_pool3d, world)


def test_pool_2d_mesh():
    harness.run(4, case_pool_2d_mesh, 1)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_adaptive(world):
    harness.run(world, case_adaptive, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_adaptive_max_straddling(world):
    harness.run(world, case_adaptive_max_straddling, world)


def test_adaptive_max_straddling_2d_mesh():
    harness.run(4, case_adaptive_max_straddling, 0)


@pytest.mark.parametrize("world", [2, 3])
def test_no_grad_and_modules(world):
    harness.run(world, case_no_grad_and_modules, world)


@pytest.mark.parametrize("world", [2, 3])
def test_global_avg_partial(world):
    harness.run(world, case_global_avg_partial, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_global_pool_channels_last(world):
    harness.run(world, case_global_pool_channels_last, world)


def test_global_pool_channels_last_2d_mesh():
    harness.run(4, case_global_pool_channels_last_2d_mesh)


def test_low_precision():
    harness.run(3, case_low_precision, 3)


def test_errors():
    harness.expect_error(3, case_unpool_bad_index, None, match="invalid max index", kinds=("IndexError",))
    harness.expect_error(4, case_unpool_bad_index, (2, 2), match="invalid max index", kinds=("IndexError",))
    harness.expect_error(2, case_bad_padding, 0, match="at most half")
    harness.expect_error(2, case_bad_avg_padding, 0, match="at most half")
    harness.expect_error(2, case_bad_divisor, 0, match="divisor")
