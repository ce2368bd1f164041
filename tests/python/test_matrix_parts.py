"""diagonal, tril/triu, the in-place views of torch's decompositions (squeeze_/unsqueeze_/transpose_/t_ on Partial,
sharded and replicated tensors: matmul of a sharded 1-D vector, __rmatmul__, quantile), the position-addressed
writes (masked_scatter, put, index_fill) and, through them, the backward of ops that run forward through the
gather fallback (linalg.det, qr, eigh, svd, take, trace, diag_embed) or their own rule (masked_select, whose
backward is a masked_scatter) — against one device: forward, input gradient, uneven and zero extents, 2-4 ranks, a
2-D mesh."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, close, mesh, randn, strict, tiny_extents, uneven_extents


def _lay(d, n, w, seed=0, kind="uneven"):
    ext = uneven_extents(n, w, seed=seed) if kind == "uneven" else tiny_extents(n, w)
    return ([st.Shard(d)], {0: ext})


def case_diagonal(kind):
    m = mesh()
    w = m.size()
    x = randn(5, 4, 3, seed=1)
    for d in (0, 1, 2):
        lay = _lay(d, x.shape[d], w, seed=d, kind=kind)
        for off, d1, d2 in ((0, 0, 1), (1, 0, 1), (-2, 0, 1), (2, 1, 0), (0, 2, 0), (-1, 1, 2), (9, 0, 1)):
            out = check_op(lambda t: t.diagonal(off, d1, d2), [x], [lay], m,
                           what=f"diagonal({off}, {d1}, {d2}) sharded {d} {kind}")
            if w > 1 and d in (d1, d2):
                assert st.placements(out) == (st.Shard(1),), st.placements(out)  # the diagonal dim (last)
    rep = ([st.Replicate()], None)
    check_op(lambda t: t.diagonal() * 2, [x], [rep], m, what="diagonal Replicate")
    check_op(lambda t, b: (t @ b).diagonal(), [randn(4, 6, seed=2), randn(6, 4, seed=3)],
             [_lay(1, 6, w), _lay(0, 6, w)], m, what="diagonal of a Partial product")
    check_op(lambda t: torch.diag(t), [randn(6, 6, seed=4)], [_lay(0, 6, w, kind=kind)], m, what="diag")
    check_op(lambda t: torch.trace(t), [randn(6, 5, seed=5)], [_lay(1, 5, w, kind=kind)], m, what="trace")
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_diagonal(world, kind):
    harness.run(world, strict, case_diagonal, kind)


def case_diagonal_views():
    """A diagonal of a shard-aligned layout is a view: writes reach the input; with both dims sharded it is a
    copy and writes raise."""
    m = mesh()
    x = randn(6, 6, seed=6)
    xs = st.distribute_tensor(x.clone(), m, [st.Shard(0)], sharding_shapes={0: uneven_extents(6, m.size())})
    xs.diagonal(1).fill_(7.0)
    ref = x.clone()
    ref.diagonal(1).fill_(7.0)
    close(xs.full_tensor(), ref, what="write through a diagonal view")
    return True


def test_diagonal_views():
    harness.run(3, strict, case_diagonal_views)


def case_diagonal_2d_mesh():
    m = mesh((2, 2))
    x = randn(3, 5, 6, seed=7)
    lay = ([st.Shard(1), st.Shard(2)], {0: [2, 3], 1: [6, 0]})
    for off in (0, 1, -2):
        check_op(lambda t: t.diagonal(off, 1, 2), [x], [lay], m, what=f"diagonal 2x2 {off}")
    lay = ([st.Shard(0), st.Shard(2)], {0: [1, 2], 1: [4, 2]})
    check_op(lambda t: t.diagonal(0, 1, 2), [x], [lay], m, what="diagonal 2x2 batch and columns")
    xs = st.distribute_tensor(x, m, [st.Shard(1), st.Shard(2)])
    xs.diagonal(0, 1, 2).add_(1)  # both rotated dims sharded: a copy


def test_diagonal_2d_mesh():
    harness.expect_error(4, strict, case_diagonal_2d_mesh, match="aten::diagonal with both dims sharded",
                         kinds=("NotImplementedError",))


def case_triangles(kind):
    m = mesh()
    w = m.size()
    x = randn(2, 6, 5, seed=8)
    for d in (1, 2):
        lay = _lay(d, x.shape[d], w, seed=d, kind=kind)
        for k in (0, 1, -2, 7):
            check_op(lambda t: torch.tril(t, k), [x], [lay], m, what=f"tril {k} sharded {d}")
            check_op(lambda t: torch.triu(t, k), [x], [lay], m, what=f"triu {k} sharded {d}")
            check_op(lambda t: (t * 1).tril_(k) + (t * 2).triu_(-k), [x], [lay], m, what=f"tril_/triu_ {k}")
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_triangles(world, kind):
    harness.run(world, strict, case_triangles, kind)


def case_inplace_views(kind):
    m = mesh()
    w = m.size()
    x = randn(4, 1, 6, seed=9)
    lay = _lay(2, 6, w, kind=kind)

    def chain(t):
        y = t * 1
        y.squeeze_(1)          # (4, 6)
        y.unsqueeze_(0)        # (1, 4, 6)
        y.transpose_(1, 2)     # (1, 6, 4)
        y.squeeze_()           # (6, 4)
        y.t_()                 # (4, 6)
        return y * 2

    check_op(chain, [x], [lay], m, what=f"in-place views {kind}")
    check_op(chain, [x], [([st.Replicate()], None)], m, what="in-place views Replicate")
    # Partial: a 1-D vector sharded along the contraction, times a matrix (matmul squeezes the product in place)
    v, a = randn(7, seed=10), randn(7, 3, seed=11)
    out = check_op(lambda s, b: s @ b, [v, a], [_lay(0, 7, w, kind=kind), None], m, what="matmul 1-D @ 2-D")
    check_op(lambda b, s: b @ s, [a.t().contiguous(), v], [None, _lay(0, 7, w, kind=kind)], m,
             what="__rmatmul__ 2-D @ 1-D")
    check_op(lambda s, b: s @ b, [v, randn(2, 7, 3, seed=12)], [_lay(0, 7, w), _lay(1, 7, w)], m,
             what="matmul 1-D @ batched")
    check_op(lambda t: torch.quantile(t, torch.tensor([0.2, 0.7]), dim=1), [randn(3, 9, seed=13)],
             [_lay(1, 9, w, kind=kind)], m, what="quantile")
    check_op(lambda t: torch.nanquantile(t, 0.4, dim=0, keepdim=True), [randn(9, 3, seed=14)],
             [_lay(0, 9, w, kind=kind)], m, what="nanquantile")
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_inplace_views(world, kind):
    harness.run(world, case_inplace_views, kind)  # quantile's sort runs through the fallback: not strict


def case_inplace_view_of_sharded_size1_dim():
    """Squeezing a sharded size-1 dim in place would re-lay the tensor out: refused on every rank."""
    m = mesh()
    xs = st.distribute_tensor(randn(1, 4, seed=15), m, [st.Shard(0)], sharding_shapes={0: [1] + [0] * (m.size() - 1)})
    xs.squeeze_(0)


def test_inplace_view_refused():
    harness.expect_error(2, strict, case_inplace_view_of_sharded_size1_dim, match="aten::squeeze_.dim",
                         kinds=("NotImplementedError",))


def case_position_writes(kind):
    m = mesh()
    w = m.size()
    x = randn(5, 6, seed=16)
    mask = randn(5, 6, seed=17) > 0
    src = randn(40, seed=18)
    for d in (0, 1):
        lay = _lay(d, x.shape[d], w, seed=d, kind=kind)
        check_op(lambda t, s: t.masked_scatter(mask, s), [x, src], [lay, None], m, what=f"masked_scatter {d}")
        check_op(lambda t, s: t.masked_scatter(mask[0], s), [x, src], [lay, None], m,
                 what=f"masked_scatter broadcast mask {d}")
        check_op(lambda t, s: (t * 1).masked_scatter_(mask, s), [x, src], [lay, _lay(0, 40, w)], m,
                 what=f"masked_scatter_ sharded source {d}")
        idx = torch.tensor([3, -1, 17, 29, 0, 17])
        check_op(lambda t, s: t.put(idx, s), [x, randn(6, seed=19)], [lay, None], m, what=f"put {d}")
        check_op(lambda t, s: (t * 1).put_(idx, s, accumulate=True), [x, randn(6, seed=19)], [lay, None], m,
                 what=f"put_ accumulate {d}")
        check_op(lambda t: torch.take(t, idx), [x], [lay], m, what=f"take {d}")
        check_op(lambda t: t.masked_select(mask), [x], [lay], m, what=f"masked_select {d}")
        for dim in (0, 1):
            ix = torch.tensor([4, 0, -2]) if dim == 0 else torch.tensor([5, 1, -6])
            check_op(lambda t: t.index_fill(dim, ix, -3.0), [x], [lay], m, what=f"index_fill {dim} sharded {d}")
            ixp = ix.remainder(x.shape[dim])  # torch's own backward of a tensor value refuses negative indices
            check_op(lambda t, v: t.index_fill(dim, ixp, v), [x, torch.tensor(2.5)],
                     [lay, ([st.Replicate()], None)], m, what=f"index_fill tensor value {dim} sharded {d}")
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_position_writes(world, kind):
    harness.run(world, case_position_writes, kind)  # take runs forward through the fallback, masked_select by its rule


def case_fallback_backward(kind):
    """Ops that run forward through the gather fallback also run backward (their derivative formulas reach
    diagonal, tril_, masked_scatter_, put_, index_fill_ on ShardTensors)."""
    m = mesh()
    w = m.size()
    a = randn(5, 5, seed=20)
    sym = a @ a.t() + torch.eye(5)
    tol = dict(rtol=1e-4, atol=1e-5)
    for d in (0, 1):
        lay = _lay(d, 5, w, seed=d, kind=kind)
        check_op(lambda t: torch.linalg.det(t), [a], [lay], m, **tol, what=f"det {d}")
        check_op(lambda t: torch.linalg.slogdet(t).logabsdet, [a], [lay], m, **tol, what=f"slogdet {d}")
        check_op(lambda t: torch.linalg.qr(t).R.abs(), [a], [lay], m, **tol, what=f"qr {d}")
        check_op(lambda t: torch.linalg.eigh(t).eigenvalues, [sym], [lay], m, **tol, what=f"eigh {d}")
        check_op(lambda t: torch.linalg.svdvals(t), [a], [lay], m, **tol, what=f"svdvals {d}")
        check_op(lambda t: torch.linalg.svd(t).S, [a], [lay], m, **tol, what=f"svd {d}")
        check_op(lambda t: torch.linalg.inv(t), [sym], [lay], m, **tol, what=f"inv {d}")
        check_op(lambda t: torch.linalg.cholesky(t), [sym], [lay], m, **tol, what=f"cholesky {d}")
        check_op(lambda t: torch.diag_embed(t), [a], [lay], m, what=f"diag_embed {d}")
        check_op(lambda t: torch.trace(t), [a], [lay], m, what=f"trace {d}")
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_fallback_backward(world, kind):
    harness.run(world, case_fallback_backward, kind)


def case_fallback_backward_2d_mesh():
    m = mesh((2, 2))
    a = randn(6, 6, seed=21)
    lay = ([st.Shard(0), st.Shard(1)], {0: [2, 4], 1: [5, 1]})
    check_op(lambda t: torch.linalg.det(t), [a], [lay], m, rtol=1e-4, atol=1e-5, what="det 2x2")
    check_op(lambda t: torch.trace(t) + t.diagonal(1).sum(), [a], [lay], m, what="trace 2x2")
    check_op(lambda t: t.masked_select(a > 0), [a], [lay], m, what="masked_select 2x2")
    return True


def test_fallback_backward_2d_mesh():
    harness.run(4, case_fallback_backward_2d_mesh)


def case_inplace_views_and_writes_2d_mesh():
    m = mesh((2, 2))
    x = randn(4, 1, 6, seed=22)
    lay = ([st.Shard(0), st.Shard(2)], {0: [1, 3], 1: [6, 0]})

    def chain(t):
        y = t * 1
        y.squeeze_(1)
        y.transpose_(0, 1)
        y.unsqueeze_(-1)
        return y.squeeze_(-1).t_() * 2

    check_op(chain, [x], [lay], m, what="in-place views 2x2")
    a = randn(5, 6, seed=23)
    lay = ([st.Shard(0), st.Shard(1)], {0: [2, 3], 1: [1, 5]})
    mask = randn(5, 6, seed=24) > 0
    check_op(lambda t, s: t.masked_scatter(mask, s), [a, randn(30, seed=25)], [lay, None], m,
             what="masked_scatter 2x2")
    check_op(lambda t, s: t.put(torch.tensor([0, 29, 7, 13]), s), [a, randn(4, seed=26)], [lay, None], m,
             what="put 2x2")
    check_op(lambda t: t.index_fill(1, torch.tensor([0, 4]), 1.5).tril(1), [a], [lay], m, what="index_fill tril 2x2")
    return True


def test_inplace_views_and_writes_2d_mesh():
    harness.run(4, strict, case_inplace_views_and_writes_2d_mesh)
