"""Vector products (dot, vdot, mv, addmv, addr, 1-D matmul, linalg.vecdot, inner), cross products, distances
(dist, pairwise_distance, cdist) and the legacy torch.norm, the `_copy` variants of view ops and the `_scatter` ops, on sharded inputs (uneven, a zero-extent rank, 2-D
meshes): rules in strict mode (no fallback), forward and gradients equal to one device, the layouts and collectives
they promise, and the refusals that must decline."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, uneven_extents


def calls(kind=None):
    stats = st.comm_stats()["calls"]
    return stats.get(kind, 0) if kind else sum(stats.values())


def case_vector_products(seed):
    m = mesh()
    w = m.size()
    n, k = 7, 9
    lay_k = ([st.Shard(0)], {0: uneven_extents(k, w, seed)})
    lay_n = ([st.Shard(0)], {0: uneven_extents(n, w, seed + 1)})
    a, b = randn(k, seed=seed), randn(k, seed=seed + 1)
    A = randn(n, k, seed=seed + 2)
    bias, u = randn(n, seed=seed + 3), randn(n, seed=seed + 4)
    rows = ([st.Shard(0)], {0: uneven_extents(n, w, seed + 5)})
    cols = ([st.Shard(1)], {0: uneven_extents(k, w, seed + 6)})
    with st.use_strict():
        # A sharded vector leaves a pending sum: no collective until it is read.
        sa, sb = st.distribute_tensor(a, m, *lay_k), st.distribute_tensor(b, m, *lay_k)
        before = calls()
        d = torch.dot(sa, sb)
        assert calls() == before, "dot communicated before its result was read"
        if w > 1:
            assert st.placements(d) == (st.Partial(),), st.placements(d)
        close(full(d), torch.dot(a, b), what="dot")
        check_op(torch.dot, [a, b], [lay_k, lay_k], m, what="dot")
        check_op(torch.dot, [a, b], [lay_k, None], m, what="dot, one operand plain")
        check_op(torch.vdot, [a, b], [lay_k, lay_k], m, what="vdot")
        check_op(torch.matmul, [a, b], [lay_k, lay_k], m, what="1-D matmul")
        check_op(torch.inner, [a, b], [lay_k, lay_k], m, what="inner")
        check_op(lambda x, y: torch.linalg.vecdot(x, y), [a, b], [lay_k, lay_k], m, what="vecdot")
        # mv: row shards stay shards (no collective), column shards leave a pending sum.
        out = check_op(torch.mv, [A, b], [rows, None], m, what="mv rows", expect_placements=[st.Shard(0)])
        check_op(torch.mv, [A, b], [cols, ([st.Shard(0)], cols[1])], m, what="mv cols, vector sharded alike")
        check_op(torch.mv, [A, b], [cols, None], m, what="mv cols, plain vector")
        check_op(torch.matmul, [A, b], [rows, None], m, what="2-D @ 1-D matmul")
        check_op(lambda s, x, y: torch.addmv(s, x, y, beta=0.5, alpha=2.0), [bias, A, b], [lay_n, rows, None], m,
                 what="addmv rows")
        check_op(lambda s, x, y: torch.addmv(s, x, y, beta=0.5, alpha=2.0), [bias, A, b], [None, cols, None], m,
                 what="addmv cols (bias added once)")
        check_op(lambda s, x, y: torch.addr(s, x, y, beta=2.0, alpha=0.5), [A, u, b], [rows, None, None], m,
                 what="addr")
        check_op(lambda s, x, y: torch.addr(s, x, y), [A, u, b], [None, lay_n, lay_k], m, what="addr sharded vectors")
        del out
    # torch's own argument errors, from the global shapes, on every rank.
    with pytest.raises(ValueError, match="inconsistent tensor size"):
        torch.dot(st.distribute_tensor(a, m, *lay_k), randn(k + 1, seed=1))
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_vector_products(world):
    harness.run(world, case_vector_products, world)


def case_vector_products_mesh2d(seed):
    m = mesh((2, 2), ("a", "b"))
    n, k = 5, 7
    A, b = randn(n, k, seed=seed), randn(k, seed=seed + 1)
    both = ([st.Shard(0), st.Shard(1)], {0: [3, 2], 1: [7, 0]})
    with st.use_strict():
        check_op(torch.mv, [A, b], [both, None], m, what="mv rows x cols")
        check_op(torch.dot, [b, b], [([st.Shard(0), st.Replicate()], {0: [2, 5]}),
                                     ([st.Replicate(), st.Shard(0)], {1: [4, 3]})], m, what="dot, two layouts")
        check_op(lambda s, x, y: torch.addr(s, x, y), [A, randn(n, seed=3), b], [both, None, None], m, what="addr 2x2")
    return True


def test_vector_products_mesh2d():
    harness.run(4, case_vector_products_mesh2d, 4)


def case_cross_dist_norm(seed):
    m = mesh()
    w = m.size()
    x, y = randn(6, 3, 4, seed=seed), randn(6, 3, 4, seed=seed + 1)
    batch = ([st.Shard(0)], {0: uneven_extents(6, w, seed)})
    last = ([st.Shard(2)], {0: uneven_extents(4, w, seed + 1)})
    with st.use_strict():
        for lay in (batch, last):
            sx, sy = st.distribute_tensor(x, m, *lay), st.distribute_tensor(y, m, *lay)
            before = calls()
            out = torch.linalg.cross(sx, sy, dim=1)
            assert calls() == before, "cross along an unsharded vector dim communicated"
            assert st.placements(out) == tuple(lay[0]), (st.placements(out), lay)
            check_op(lambda s, o: torch.cross(s, o, dim=1), [x, y], [lay, lay], m, what="cross")
        # Broadcast: one vector against a batch of them.
        check_op(lambda s, o: torch.linalg.cross(s, o, dim=1), [x, randn(1, 3, 1, seed=4)], [batch, None], m,
                 what="cross broadcast")
        for p in (2, 1, 3.5, float("inf"), 0):
            check_op(lambda s, o: torch.dist(s, o, p), [x, y], [last, last], m, what=f"dist p={p}",
                     grad=p != 0)
        check_op(lambda s: torch.norm(s), [x], [batch], m, what="norm")
        check_op(lambda s: torch.norm(s, p=3, dim=(0, 2), keepdim=True), [x], [batch], m, what="norm p=3 dims")
        check_op(lambda s: torch.norm(s, dim=2, dtype=torch.float64), [x], [last], m, what="norm dtype")
        check_op(lambda s: torch.norm(s, p="fro"), [x], [last], m, what="norm fro")
        for lay in (batch, last):
            for d in (0, 2):  # along the sharded dim (local norms) and across it (norms reduced over ranks)
                check_op(lambda s: torch.renorm(s, 2, d, 1.5), [x], [lay], m, what=f"renorm dim {d}")
            check_op(lambda s: torch.renorm(s, 1, 1, 2.0), [x], [lay], m, what="renorm p=1")
        check_op(lambda s, o: F.pairwise_distance(s, o), [x[:, :, 0], y[:, :, 0]],
                 [batch, batch], m, what="pairwise_distance rows")
        check_op(lambda s, o: F.pairwise_distance(s, o), [x[0, 0], y[0, 0]], [([st.Shard(0)], last[1])] * 2, m,
                 what="pairwise_distance along a sharded vector")
    if w > 1:
        # The vector dim split: the split moves to the largest batch dim (dim 0: one all-to-all per operand).
        vec = ([st.Shard(1)], {0: uneven_extents(3, w, seed)})
        with st.use_strict():
            sx, sy = st.distribute_tensor(x, m, *vec), st.distribute_tensor(y, m, *vec)
            st.reset_comm_stats()
            out = torch.linalg.cross(sx, sy, dim=1)
            assert st.comm_stats()["calls"] == {"all_to_all": 2}, st.comm_stats()["calls"]
            assert st.placements(out) == (st.Shard(0),), st.placements(out)
            check_op(lambda s, o: torch.linalg.cross(s, o, dim=1), [x, y], [vec, vec], m, what="cross, vector dim split")
            # No batch dim as large as the mesh dim: declined.
            with pytest.raises(NotImplementedError, match="vector dim"):
                torch.linalg.cross(st.distribute_tensor(x[:1, :, :1], m, *vec), st.distribute_tensor(y[:1, :, :1], m, *vec),
                                   dim=1)
        check_op(lambda s, o: torch.linalg.cross(s, o, dim=1), [x[:1, :, :1], y[:1, :, :1]], [vec, vec], m,
                 what="cross through fallback")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cross_dist_norm(world):
    harness.run(world, case_cross_dist_norm, world)


def case_view_copies(seed):
    m = mesh()
    w = m.size()
    x = randn(5, 6, 4, seed=seed)
    lay = ([st.Shard(1)], {0: uneven_extents(6, w, seed)})
    ops = {
        "transpose_copy": lambda t: torch.transpose_copy(t, 0, 2),
        "permute_copy": lambda t: torch.permute_copy(t, (2, 0, 1)),
        "t_copy": lambda t: torch.t_copy(t[0]),
        "view_copy": lambda t: torch.view_copy(t, (5, 24)),
        "view_copy dims kept": lambda t: torch.view_copy(t, (5, 6, 2, 2)),
        "unsqueeze_copy": lambda t: torch.unsqueeze_copy(t, 1),
        "squeeze_copy": lambda t: torch.squeeze_copy(t[:, :, :1], 2),
        "expand_copy": lambda t: torch.expand_copy(t[:1], (3, 6, 4)),
        "alias_copy": torch.alias_copy,
        "detach_copy": torch.detach_copy,
        "select_copy": lambda t: torch.select_copy(t, 0, 2),
        "slice_copy": lambda t: torch.slice_copy(t, 1, 1, 5),
        "narrow_copy": lambda t: torch.narrow_copy(t, 1, 2, 3),
        "unfold_copy": lambda t: torch.unfold_copy(t, 1, 3, 2),
        "unbind_copy": lambda t: torch.unbind_copy(t, 2),
        "split_copy": lambda t: torch.split_copy(t, 2, 0),
        "split_with_sizes_copy": lambda t: torch.split_with_sizes_copy(t, [1, 3], 2),
        "unsafe_split": lambda t: torch.unsafe_split(t, 2, 2),
        "unsafe_chunk": lambda t: torch.unsafe_chunk(t, 3, 0),
    }
    with st.use_strict():
        no_derivative = {"narrow_copy", "detach_copy"}  # torch defines no derivative for these two
        for name, fn in ops.items():
            check_op(fn, [x], [lay], m, what=name, grad=name not in no_derivative)
        # A copy, not a view: writing into it leaves the input alone.
        xs = st.distribute_tensor(x, m, *lay)
        c = torch.transpose_copy(xs, 0, 2)
        c.zero_()
        close(full(xs), x, what="input after writing into transpose_copy's result")
        for part in torch.unbind_copy(xs, 0):
            part.fill_(1.0)
        close(full(xs), x, what="input after writing into unbind_copy's results")
    if w > 1:
        # The view rule refuses (float32 -> float64 halves the last dim, whose extents are odd): the copy variant, a
        # functional op, declines to the fallback instead of failing; strict mode raises on every rank.
        odd = ([st.Shard(2)], {0: [1] * (w - 1) + [4 - (w - 1)]})
        fn = lambda t: torch.view_copy(t, torch.float64)  # noqa: E731
        with st.use_strict(), pytest.raises(NotImplementedError, match="view_copy"):
            fn(st.distribute_tensor(x, m, *odd))
        check_op(fn, [x], [odd], m, grad=False, what="view_copy.dtype through the fallback")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_view_copies(world):
    harness.run(world, case_view_copies, world)


def case_view_scatters(seed):
    """slice_scatter / select_scatter / diagonal_scatter (functionalization's and torch.compile's form of a write into
    a view): each rank writes the part of the view it holds; with the source laid out like the view nothing travels."""
    m = mesh()
    w = m.size()
    x = randn(5, 9, 4, seed=seed)
    lay = ([st.Shard(1)], {0: uneven_extents(9, w, seed)})
    other = ([st.Shard(0)], {0: uneven_extents(5, w, seed + 1)})
    src_slice = randn(5, 3, 4, seed=seed + 2)  # x[:, 1:8:3]
    src_row = randn(5, 4, seed=seed + 3)
    src_col = randn(9, 4, seed=seed + 4)
    src_diag = randn(4, 5, seed=seed + 5)  # diagonal of dims (0, 1): [4, 5]
    with st.use_strict():
        for lay_x in (lay, other):
            tag = "sharded dim" if lay_x is lay else "other dim sharded"
            check_op(lambda t, s: torch.slice_scatter(t, s, 1, 1, 8, 3), [x, src_slice], [lay_x, None], m,
                     what=f"slice_scatter step 3, {tag}")
            src_lay = lay_x if lay_x is other else ([st.Shard(1)], None)
            check_op(lambda t, s: torch.slice_scatter(t, s, 1, 1, 8, 3), [x, src_slice], [lay_x, src_lay], m,
                     what=f"slice_scatter, source sharded on the same dim, {tag}")
            check_op(lambda t, s: torch.select_scatter(t, s, 1, -2), [x, src_row], [lay_x, None], m,
                     what=f"select_scatter, {tag}")
            check_op(lambda t, s: torch.select_scatter(t, s, 0, 3), [x, src_col], [lay_x, None], m,
                     what=f"select_scatter dim 0, {tag}")
            check_op(lambda t, s: torch.diagonal_scatter(t, s, 0, 0, 1), [x, src_diag], [lay_x, None], m,
                     what=f"diagonal_scatter, {tag}")
        xs = st.distribute_tensor(x, m, *lay)
        # The written row is on one rank: the others keep theirs, and nothing travels for a plain source.
        before = calls()
        out = torch.select_scatter(xs, src_row, 1, 4)
        assert calls() == before, "select_scatter with a plain source communicated"
        assert st.placements(out) == (st.Shard(1),), st.placements(out)
        assert out.to_local().shape == xs.to_local().shape
        close(full(out), torch.select_scatter(x, src_row, 1, 4), what="select_scatter, no collective")
        close(full(xs), x, what="input after select_scatter")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_view_scatters(world):
    harness.run(world, case_view_scatters, world)


def case_cdist(seed):
    """torch.cdist with point rows sharded: each rank its own block of the distance matrix, no communication; a split
    feature dim moved to the rows first."""
    m = mesh()
    w = m.size()
    B, P, R, M = 2, 30, 9, 3  # P > 25: p = 2 takes the matrix-product form (_euclidean_dist)
    x1, x2 = randn(B, P, M, seed=seed), randn(B, R, M, seed=seed + 1)
    rows1 = ([st.Shard(1)], {0: uneven_extents(P, w, seed)})
    rows2 = ([st.Shard(1)], {0: uneven_extents(R, w, seed + 1)})
    batch = ([st.Shard(0)], {0: uneven_extents(B, w, seed)})
    with st.use_strict():
        s1 = st.distribute_tensor(x1, m, *rows1)
        before = calls()
        d = torch.cdist(s1, x2)
        assert calls() == before, "cdist with x1's rows sharded communicated"
        assert st.placements(d) == (st.Shard(1),), st.placements(d)
        for p in (2.0, 1.0, 3.0, float("inf")):
            check_op(lambda a, b: torch.cdist(a, b, p=p), [x1, x2], [rows1, None], m, rtol=1e-4, atol=1e-5,
                     what=f"cdist x1 rows p={p}")
        check_op(lambda a, b: torch.cdist(a, b, p=0), [x1, x2], [rows1, None], m, grad=False, what="cdist p=0")
        # Few rows (the direct kernel for p = 2), x2's rows sharded: the output's columns.
        check_op(lambda a, b: torch.cdist(a, b), [x1[:, :7], x2], [None, rows2], m, rtol=1e-4, atol=1e-5,
                 what="cdist x2 rows", expect_placements=[st.Shard(2)])
        check_op(lambda a, b: torch.cdist(a, b), [x1, x2], [batch, batch], m, rtol=1e-4, atol=1e-5,
                 what="cdist batch", expect_placements=[st.Shard(0)])
        check_op(lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist"), [x1, x2], [rows1, rows2], m,
                 rtol=1e-4, atol=1e-5, what="cdist both sharded (x2 gathered)", expect_placements=[st.Shard(1)])
        # A Chamfer distance (point-cloud losses): the nearest neighbour both ways.
        def chamfer(a, b):
            dd = torch.cdist(a, b)
            return dd.min(dim=2).values.mean() + dd.min(dim=1).values.mean()
        check_op(chamfer, [x1, x2], [rows1, None], m, rtol=1e-4, atol=1e-5, what="chamfer")
    if w > 1:
        # A split feature dim moves to that operand's rows (one all-to-all; a distance is not a sum of per-rank
        # terms for every p): the output is split along them, forward and backward.
        feat = ([st.Shard(2)], {0: uneven_extents(M, w, seed)})
        with st.use_strict():
            for p in (2.0, 1.0, float("inf")):
                check_op(lambda a, b: torch.cdist(a, b, p=p), [x1, x2], [feat, None], m, rtol=1e-4, atol=1e-5,
                         what=f"cdist x1 features p={p}", expect_placements=[st.Shard(1)])
            check_op(lambda a, b: torch.cdist(a, b), [x1[:, :7], x2], [None, feat], m, rtol=1e-4, atol=1e-5,
                     what="cdist x2 features", expect_placements=[st.Shard(2)])
            check_op(lambda a, b: torch.cdist(a, b, p=1.0), [x1, x2], [feat, feat], m, rtol=1e-4, atol=1e-5,
                     what="cdist both features (x2 gathered)", expect_placements=[st.Shard(1)])
            s1 = st.distribute_tensor(x1, m, *feat)
            with st.CommCounter() as c:
                torch.cdist(s1, x2, p=1.0)
            assert c.calls == {"all_to_all": 1}, c.calls
    with pytest.raises((ValueError, RuntimeError), match="same number of columns"):  # cdist checks first
        torch.cdist(st.distribute_tensor(x1, m, *rows1), randn(B, R, M + 1, seed=2))
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cdist(world):
    harness.run(world, case_cdist, world)


def case_cdist_broadcast(world):
    """Batch dims that broadcast (x1 [1, P, M] or [P, M] against x2 [B, 1, R, M]; OpInfo's samples): x1's gradient
    comes from the kernel at the broadcast shape and is summed to x1's by autograd, as on one device. It was wrapped
    at x1's shape: an internal assert on the ranks whose block did not match, and a hang (found by the OpInfo probe
    beyond the first sample)."""
    m = mesh()
    cases = [((1, 3, 2), (2, 1, 4, 2)), ((3, 2), (2, 4, 2)), ((2, 1, 3, 2), (1, 4, 2))]
    with st.use_strict():
        for i, (s1, s2) in enumerate(cases):
            x1, x2 = randn(*s1, seed=i), randn(*s2, seed=10 + i)
            for d in (len(s1) - 2, len(s1) - 1):   # x1's rows, x1's features (moved to its rows)
                lay = ([st.Shard(d)], {0: uneven_extents(s1[d], world, i + d)})
                check_op(lambda a, b: torch.cdist(a, b), [x1, x2], [lay, None], m, rtol=1e-4, atol=1e-5,
                         what=f"cdist broadcast {s1} x {s2} split {d}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_cdist_broadcast(world):
    harness.run(world, case_cdist_broadcast, world)


def case_cdist_mesh2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x1, x2 = randn(3, 28, 4, seed=seed), randn(3, 6, 4, seed=seed + 1)
    lay = ([st.Shard(1), st.Shard(0)], {0: [20, 8], 1: [1, 2]})
    with st.use_strict():
        check_op(lambda a, b: torch.cdist(a, b), [x1, x2], [lay, None], m, rtol=1e-4, atol=1e-5, what="cdist 2x2",
                 expect_placements=[st.Shard(1), st.Shard(0)])
        check_op(lambda a, b: torch.cdist(a, b, p=1.0), [x1, x2], [lay, ([st.Replicate(), st.Shard(0)], {1: [1, 2]})],
                 m, rtol=1e-4, atol=1e-5, what="cdist 2x2, x2 batch-sharded")
        # Rows on one mesh dim, features on the other (both operands; the OpInfo 2x2 probe): the feature split
        # cannot move to the rows the first mesh dim splits, so it moves to the other operand's rows (it raised
        # "tensor dim 0 is sharded on mesh dims 0 and 1", with the fallback too).
        y1, y2 = randn(7, 5, seed=seed + 2), randn(6, 5, seed=seed + 3)
        rows_feat = ([st.Shard(0), st.Shard(1)], {0: [5, 2], 1: [3, 2]})
        for p in (2.0, 1.0):
            check_op(lambda a, b: torch.cdist(a, b, p=p), [y1, y2], [rows_feat, ([st.Shard(0), st.Shard(1)],
                     {0: [1, 5], 1: [0, 5]})], m, rtol=1e-4, atol=1e-5, what=f"cdist 2x2 rows x features p={p}",
                     expect_placements=[st.Shard(0), st.Shard(1)])
            check_op(lambda a, b: torch.cdist(a, b, p=p), [y1, y2], [rows_feat, None], m, rtol=1e-4, atol=1e-5,
                     what=f"cdist 2x2 rows x features, x2 whole p={p}", expect_placements=[st.Shard(0), st.Shard(1)])
    return True


def test_cdist_mesh2d():
    harness.run(4, case_cdist_mesh2d, 4)
