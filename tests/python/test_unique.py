"""torch.unique (sorted, no dim) and torch.unique_consecutive (no dim) of a split tensor, in strict mode (no gather
fallback), against one device: values, inverse, counts; uneven and empty shards, 1-4 ranks, a 2-D mesh, integer,
floating and bool tensors; NaN and layouts that decline."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, shard_of, strict, tiny_extents, uneven_extents


def _check_unique(xs, x, what):
    for kw in (dict(), dict(return_inverse=True), dict(return_counts=True),
               dict(return_inverse=True, return_counts=True)):
        got = torch.unique(xs, **kw)
        ref = torch.unique(x, **kw)
        got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
        for i, (a, b) in enumerate(zip(got, ref)):
            assert tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype, (what, kw, i, a.shape, b.shape)
            assert torch.equal(full(a), b), (what, kw, i)
        if kw.get("return_inverse"):
            assert st.placements(got[1]) == st.placements(xs), (what, st.placements(got[1]))


def case_unique(kind):
    m = mesh()
    w = m.size()
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 6, (9, 4), generator=g)
    ext = {0: uneven_extents(9, w, seed=4) if kind == "uneven" else tiny_extents(9, w)}
    _check_unique(shard_of(x, m, [st.Shard(0)], ext), x, "int rows")
    _check_unique(shard_of(x, m, [st.Shard(1)]), x, "int columns")
    f = torch.randint(-3, 3, (9, 4), generator=g).double() / 2
    f[2, 1] = -0.0
    _check_unique(shard_of(f, m, [st.Shard(0)], ext), f, "float (with -0.0)")
    b = x > 2
    _check_unique(shard_of(b, m, [st.Shard(0)], ext), b, "bool")
    # values and counts only: NaN entries are each their own value, as on one device
    n = f.clone()
    n[0, 0] = n[5, 2] = float("nan")
    ns = shard_of(n, m, [st.Shard(0)], ext)
    v, c = torch.unique(ns, return_counts=True)
    rv, rc = torch.unique(n, return_counts=True)
    close(full(v), rv, equal_nan=True, what="NaN values")
    assert torch.equal(full(c), rc)
    # unique_consecutive of a tensor split on its leading dim: groups cut by a boundary join again
    s = torch.tensor([1, 1, 1, 2, 2, 3, 3, 3, 3, 1, 1, 4])
    for e in (uneven_extents(12, w, seed=5), tiny_extents(12, w)):
        ss = shard_of(s, m, [st.Shard(0)], {0: e})
        for kw in (dict(), dict(return_inverse=True, return_counts=True), dict(return_counts=True)):
            got = torch.unique_consecutive(ss, **kw)
            ref = torch.unique_consecutive(s, **kw)
            got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
            for a, bb in zip(got, ref):
                assert torch.equal(full(a), bb), (e, kw)
    xc = x.sort(0).values
    got = torch.unique_consecutive(shard_of(xc, m, [st.Shard(0)], ext), return_inverse=True, return_counts=True)
    for a, bb in zip(got, torch.unique_consecutive(xc, return_inverse=True, return_counts=True)):
        assert torch.equal(full(a), bb), "2-D rows"
    return True


def case_unique_rows(kind):
    """torch.unique(dim=0) of points split by points (voxel coordinates deduplicated): the distinct rows merged, the
    inverse of each local row, the counts; along a dim other than the split one, the split moved onto it first."""
    m = mesh()
    w = m.size()
    g = torch.Generator().manual_seed(7)
    coords = torch.randint(0, 3, (13, 3), generator=g)
    ext = {0: uneven_extents(13, w, seed=8) if kind == "uneven" else tiny_extents(13, w)}
    cs = shard_of(coords, m, [st.Shard(0)], ext)
    for kw in (dict(), dict(return_inverse=True), dict(return_counts=True), dict(return_inverse=True, return_counts=True)):
        got = torch.unique(cs, dim=0, **kw)
        ref = torch.unique(coords, dim=0, **kw)
        got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
        for a, b in zip(got, ref):
            assert torch.equal(full(a), b), (kw, full(a), b)
        if kw.get("return_inverse"):
            assert st.placements(got[1]) == (st.Shard(0),) and st.sharding_shapes(got[1]) == st.sharding_shapes(cs)
    # Another dim split (points stored as columns, split along the points, unique over the coordinate rows; rows
    # split, unique over the columns): every slice is cut across ranks, so the split moves onto the unique's dim
    # first (one all-to-all; it refused and fell back), values and counts whole, the inverse split like the slices.
    for t, d in ((coords.t().contiguous(), 0), (coords, 1), (coords.t().contiguous(), 1)):
        split = 1 if t.size(0) == 3 else 0
        ts = shard_of(t, m, [st.Shard(split)], ext)
        for kw in (dict(), dict(return_inverse=True, return_counts=True)):
            got = torch.unique(ts, dim=d, **kw)
            ref = torch.unique(t, dim=d, **kw)
            got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
            for a, b in zip(got, ref):
                assert torch.equal(full(a), b), (d, kw, full(a), b)
    return True


@pytest.mark.parametrize("world,kind", [(1, "uneven"), (2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_unique_rows(world, kind):
    harness.run(world, strict, case_unique_rows, kind)


@pytest.mark.parametrize("world,kind", [(1, "uneven"), (2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_unique(world, kind):
    harness.run(world, strict, case_unique, kind)


def case_unique_2d_mesh():
    m = mesh((2, 2))
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, 9, (5, 6), generator=g)
    # unique along a dim of a tensor split by both mesh dims: the dim's own split kept, the other gathered
    for d in (0, 1):
        for kw in (dict(), dict(return_inverse=True, return_counts=True)):
            got = torch.unique(shard_of(x % 3, m, [st.Shard(0), st.Shard(1)], {0: [2, 3], 1: [6, 0]}), dim=d, **kw)
            ref = torch.unique(x % 3, dim=d, **kw)
            got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
            for a, b in zip(got, ref):
                assert torch.equal(full(a), b), (d, kw)
    _check_unique(shard_of(x, m, [st.Shard(0), st.Shard(1)], {0: [2, 3], 1: [6, 0]}), x, "2x2")
    _check_unique(shard_of(x, m, [st.Replicate(), st.Shard(0)], {1: [1, 4]}), x, "replicate x rows")
    # unique_consecutive follows the row-major order, which interleaves both splits: the rows' mesh dim keeps its
    # split and the other is gathered (it refused), the inverse laid out that way; the columns' split moves to the
    # rows when only the other mesh dim splits.
    for lay in (([st.Shard(0), st.Shard(1)], {0: [2, 3], 1: [6, 0]}),
                ([st.Shard(1), st.Shard(0)], {0: [4, 2], 1: [1, 4]})):
        xs = shard_of(x, m, *lay)
        got = torch.unique_consecutive(xs, return_inverse=True, return_counts=True)
        for a, b in zip(got, torch.unique_consecutive(x, return_inverse=True, return_counts=True)):
            assert torch.equal(full(a), b), lay
        assert st.placements(got[1])[[p.dim for p in lay[0]].index(0)] == st.Shard(0), st.placements(got[1])
    return True


def test_unique_2d_mesh():
    harness.run(4, strict, case_unique_2d_mesh)


def case_declines():
    m = mesh()
    f = torch.arange(8.0)
    f[3] = float("nan")
    fs = shard_of(f, m, [st.Shard(0)])
    x2 = shard_of(torch.arange(12).reshape(3, 4), m, [st.Shard(1)])
    with st.use_strict():
        with pytest.raises(NotImplementedError, match="NaN"):
            torch.unique(fs, return_inverse=True)
        # sorted=False: aten's kernels sort anyway, and so does the rule (strict mode: no fallback).
        g = torch.arange(9.0).flip(0) % 4
        for got, want in zip(torch.unique(shard_of(g, m, [st.Shard(0)]), sorted=False, return_inverse=True,
                                          return_counts=True),
                             torch.unique(g, sorted=False, return_inverse=True, return_counts=True)):
            assert torch.equal(full(got), want)
        # Split on its inner dim: re-laid out on the leading dim (one all-to-all), then the groups as above.
        got = torch.unique_consecutive(x2, return_inverse=True, return_counts=True)
        for a, b in zip(got, torch.unique_consecutive(torch.arange(12).reshape(3, 4), return_inverse=True,
                                                      return_counts=True)):
            assert torch.equal(full(a), b)
    # the fallback serves them, right
    inv = torch.unique(fs, return_inverse=True)[1]
    assert torch.equal(full(inv), torch.unique(f, return_inverse=True)[1])
    assert torch.equal(full(torch.unique_consecutive(x2)), torch.unique_consecutive(torch.arange(12).reshape(3, 4)))
    return True


def test_declines():
    harness.run(2, case_declines)
