"""Histograms of a sharded field (histc, histogram with a bin count or edges, weights and density, bincount): each
rank counts its own elements, the result is Partial(sum) until read; the range (or bincount's length) is agreed from
every rank's data. Against one device, uneven and zero extents, 1-3 ranks and a 2-D mesh."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn, tiny_extents, uneven_extents


def _check(fn, x, m, lay, what, extra=()):
    ref = fn(x, *extra)
    out = fn(st.distribute_tensor(x, m, *lay), *extra)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    for i, (a, b) in enumerate(zip(outs, refs)):
        assert a.shape == b.shape, f"{what} output {i}: {tuple(a.shape)} vs {tuple(b.shape)}"
        close(full(a), b, rtol=1e-6, atol=1e-6, what=f"{what} output {i}")
    return out


def case_histograms(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(6, 10, seed=seed) * 3
    weights = randn(6, 10, seed=seed + 1).abs()
    ext = tiny_extents(10, w) if tiny else uneven_extents(10, w, seed)
    lay = ([st.Shard(1)], {0: ext})
    with st.use_strict():
        xs = st.distribute_tensor(x, m, *lay)
        st.reset_comm_stats()
        h = torch.histc(xs, bins=7, min=-2, max=2)
        assert sum(st.comm_stats()["calls"].values()) == 0, "histc with a given range communicated"
        if w > 1:
            assert st.placements(h) == (st.Partial(),), st.placements(h)
        close(full(h), torch.histc(x, bins=7, min=-2, max=2), what="histc")
        _check(lambda t: torch.histc(t, bins=5), x, m, lay, "histc, data range")
        _check(lambda t: torch.histc(t, bins=3), torch.full((6, 10), 2.5), m, lay, "histc, constant field")
        _check(lambda t: torch.histogram(t, bins=6), x, m, lay, "histogram")
        _check(lambda t: torch.histogram(t, bins=4, range=(-1.0, 3.0), density=True), x, m, lay, "histogram density")
        _check(lambda t, wt: torch.histogram(t, bins=4, weight=wt), x, m, lay, "histogram weights",
               extra=(weights,))
        edges = torch.tensor([-5.0, -1.0, 0.0, 0.5, 4.0])
        _check(lambda t: torch.histogram(t, edges), x, m, lay, "histogram edges")
        _check(lambda t: torch.histogram(t, edges, density=True), x, m, lay, "histogram edges density")
        # plain values, split edges or weights (only they are ShardTensors): the values count as replicated
        elay = ([st.Shard(0)], {0: tiny_extents(5, w) if tiny else uneven_extents(5, w, seed)})
        _check(lambda e: torch.histogram(x, e), edges, m, elay, "histogram split edges")
        _check(lambda wt: torch.histogram(x, bins=4, weight=wt), weights, m, lay, "histogram split weights only")
        v = torch.randint(0, 9, (13,), generator=torch.Generator().manual_seed(seed))
        vlay = ([st.Shard(0)], {0: tiny_extents(13, w) if tiny else uneven_extents(13, w, seed)})
        _check(torch.bincount, v, m, vlay, "bincount")
        _check(lambda t: torch.bincount(t, minlength=20), v, m, vlay, "bincount minlength")
        _check(lambda t, wt: torch.bincount(t, wt), v, m, vlay, "bincount weights",
               extra=(torch.linspace(0, 1, 13),))
    with pytest.raises(ValueError, match="non-negative"):
        torch.bincount(st.distribute_tensor(v - 3, m, *vlay))
    return True


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, True)])
def test_histograms(world, tiny):
    harness.run(world, case_histograms, world, tiny)


def case_histograms_mesh2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(5, 7, seed=seed)
    lay = ([st.Shard(0), st.Shard(1)], {0: [2, 3], 1: [7, 0]})
    with st.use_strict():
        _check(lambda t: torch.histc(t, bins=4), x, m, lay, "histc 2x2")
        _check(lambda t: torch.histogram(t, bins=3, density=True), x, m, lay, "histogram 2x2")
        half = ([st.Shard(0), st.Replicate()], {0: [4, 1]})
        _check(lambda t: torch.histc(t, bins=4), x, m, half, "histc, replicated on one mesh dim (counted once)")
    return True


def test_histograms_mesh2d():
    harness.run(4, case_histograms_mesh2d, 4)


def case_histogramdd(world):
    """torch.histogramdd of a point set split by points: per-coordinate ranges agreed in one collective, each rank's
    counts a partial sum; bin counts or edges, a range, weights, density; one-point and empty shards; a split
    coordinate dim moved to the points."""
    m = mesh()
    g = torch.Generator().manual_seed(40)
    pts = torch.randn(23, 3, generator=g, dtype=torch.float64)
    pts[:, 2] = pts[:, 2].round()
    w = torch.rand(23, generator=g, dtype=torch.float64)
    lay = ([st.Shard(0)], {0: uneven_extents(23, world, seed=41)})
    with st.use_strict():
        ps, ws = st.distribute_tensor(pts, m, *lay), st.distribute_tensor(w, m, *lay)
        cases = [dict(bins=[4, 3, 5]), dict(bins=4, density=True), dict(bins=[2, 3, 4], weight=True),
                 dict(bins=[3, 3, 3], range=[-1.0, 1.0, -2.0, 2.0, 0.0, 0.0])]
        for kw in cases:
            weight = kw.pop("weight", False)
            got = torch.histogramdd(ps, weight=ws if weight else None, **kw)
            ref = torch.histogramdd(pts, weight=w if weight else None, **kw)
            close(full(got.hist), ref.hist, what=f"histogramdd {kw}")
            for a, b in zip(got.bin_edges, ref.bin_edges):
                close(full(a), b, what=f"histogramdd edges {kw}")
        edges = [torch.linspace(-2, 2, 5, dtype=torch.float64)] * 3
        close(full(torch.histogramdd(ps, bins=edges).hist), torch.histogramdd(pts, bins=edges).hist,
              what="histogramdd with edges")
        # points as (B, N, D): the leading dims are the points
        p3 = pts[:22].reshape(2, 11, 3)
        p3s = st.distribute_tensor(p3, m, [st.Shard(1)], {0: uneven_extents(11, world, seed=42)})
        close(full(torch.histogramdd(p3s, bins=3).hist), torch.histogramdd(p3, bins=3).hist, what="histogramdd 3-D")
        # The coordinate dim split (a point's coordinates on different ranks): moved to the points first (an
        # all-to-all), then as above; weights laid out like the points follow.
        pc = st.distribute_tensor(pts, m, [st.Shard(1)], {0: uneven_extents(3, world, seed=43)})
        st.reset_comm_stats()
        got = torch.histogramdd(pc, bins=[4, 3, 5], weight=ws)
        if world > 1:  # the points re-laid out by the edges op and by the counting op, the weights to match
            assert st.comm_stats()["calls"].get("all_to_all", 0) >= 1, st.comm_stats()["calls"]
        close(full(got.hist), torch.histogramdd(pts, bins=[4, 3, 5], weight=w).hist, what="histogramdd, coordinates split")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_histogramdd(world):
    harness.run(world, case_histogramdd, world)
