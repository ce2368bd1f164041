"""Linear algebra of batches of matrices split along their batch dims (a covariance per point, a small system per
cell): every factorization, solve, inverse, determinant and decomposition runs locally on each rank's matrices, in
strict mode (no gather fallback), against one device — forward, gradients, uneven and empty shards, 1-4 ranks, a
2-D mesh; a singular matrix raises the same error on every rank; a split matrix dim declines to the fallback."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, shard_of, strict, tiny_extents, uneven_extents

D64 = dict(dtype=torch.float64)
TIGHT = dict(rtol=1e-8, atol=1e-9)


def _matrices(B, n, seed):
    a = randn(B, n, n, seed=seed, **D64) + 3 * torch.eye(n, **D64)
    spd = a @ a.mT + torch.eye(n, **D64)
    return a, spd


def case_batched(kind):
    m = mesh()
    w = m.size()
    B = 7
    a, spd = _matrices(B, 3, seed=1)
    ext = {0: uneven_extents(B, w, seed=2) if kind == "uneven" else tiny_extents(B, w)}
    lay = ([st.Shard(0)], ext)
    b = randn(B, 3, 2, seed=3, **D64)
    v = randn(B, 3, seed=4, **D64)
    ops = [
        ("inv", torch.linalg.inv, [a]),
        ("inv_ex", lambda t: torch.linalg.inv_ex(t).inverse, [a]),
        ("det", torch.linalg.det, [a]),
        ("slogdet", lambda t: torch.linalg.slogdet(t).logabsdet, [a]),
        ("logdet", torch.logdet, [spd]),
        ("cholesky", torch.linalg.cholesky, [spd]),
        ("cholesky upper", lambda t: torch.linalg.cholesky(t, upper=True), [spd]),
        ("legacy cholesky", torch.cholesky, [spd]),
        ("eigh", lambda t: torch.linalg.eigh(t).eigenvalues, [spd]),
        ("eigh vectors", lambda t: torch.linalg.eigh(t).eigenvectors.abs(), [spd]),
        ("eigvalsh", torch.linalg.eigvalsh, [spd]),
        ("svdvals", torch.linalg.svdvals, [a]),
        ("svd", lambda t: torch.linalg.svd(t).S, [a]),
        ("qr", lambda t: torch.linalg.qr(t).R, [a]),
        ("matrix_exp", lambda t: torch.linalg.matrix_exp(0.3 * t), [a]),
        ("pinv", torch.linalg.pinv, [a]),
        ("solve", torch.linalg.solve, [a, b]),
        ("solve vector", torch.linalg.solve, [a, v]),
        ("solve right", lambda x, y: torch.linalg.solve(x, y.mT, left=False), [a, b]),
        ("solve_triangular", lambda x, y: torch.linalg.solve_triangular(x.tril(), y, upper=False), [a, b]),
        ("cholesky_solve", lambda x, y: torch.cholesky_solve(y, torch.linalg.cholesky(x)), [spd, b]),
        ("cholesky_inverse", lambda x: torch.cholesky_inverse(torch.linalg.cholesky(x)), [spd]),
        ("lu_factor + lu_solve", lambda x, y: torch.linalg.lu_solve(*torch.linalg.lu_factor(x), y), [a, b]),
        ("lu", lambda x: torch.linalg.lu(x).U, [a]),
        ("lstsq", lambda x, y: torch.linalg.lstsq(x, y).solution, [a, b]),
    ]
    for name, fn, args in ops:
        check_op(fn, args, [lay] * len(args), m, **TIGHT, what=f"{name} {kind}")
    # geqrf has no derivative: forward only
    check_op(lambda x: torch.linalg.householder_product(*torch.geqrf(x)), [a], [lay], m, grad=False, **TIGHT,
             what="geqrf + householder_product")
    # one argument whole: it is cut to the batch shards (a size-1 batch broadcasts as it is)
    check_op(torch.linalg.solve, [a, b], [lay, None], m, **TIGHT, what="solve, whole B")
    check_op(torch.linalg.solve, [a, b[:1]], [lay, None], m, **TIGHT, what="solve, broadcast B")
    check_op(torch.linalg.solve, [a[:1].expand(B, 3, 3).contiguous(), b], [None, lay], m, **TIGHT,
             what="solve, whole A")
    # complex and float32, no gradient
    c = torch.complex(randn(B, 3, 3, seed=5, **D64), randn(B, 3, 3, seed=6, **D64))
    check_op(lambda t: torch.linalg.eigvals(t).abs().sort(-1).values, [c], [lay], m, grad=False, **TIGHT,
             what="eigvals complex")
    check_op(torch.linalg.inv, [a.float()], [lay], m, grad=False, what="inv float32")
    return True


@pytest.mark.parametrize("world,kind", [(1, "uneven"), (2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_batched(world, kind):
    harness.run(world, strict, case_batched, kind)


def case_batched_2d_mesh():
    """Two batch dims on two mesh dims, and the batch with a whole matrix dim on a replicated mesh dim."""
    m = mesh((2, 2))
    a = randn(3, 4, 3, 3, seed=7, **D64) + 3 * torch.eye(3, **D64)
    b = randn(3, 4, 3, 2, seed=8, **D64)
    lay = ([st.Shard(0), st.Shard(1)], {0: [1, 2], 1: [4, 0]})
    for name, fn, args in (("inv", torch.linalg.inv, [a]), ("det", torch.linalg.det, [a]),
                           ("solve", torch.linalg.solve, [a, b]), ("eigvalsh", torch.linalg.eigvalsh, [a @ a.mT]),
                           ("svd", lambda t: torch.linalg.svd(t).S, [a])):
        out = check_op(fn, args, [lay] * len(args), m, **TIGHT, what=f"{name} 2x2")
        assert st.placements(out) == (st.Shard(0), st.Shard(1)), st.placements(out)
    check_op(torch.linalg.inv, [a], [([st.Shard(1), st.Replicate()], None)], m, **TIGHT, what="inv batch + replicate")
    return True


def test_batched_2d_mesh():
    harness.run(4, strict, case_batched_2d_mesh)


def case_point_normals():
    """Normals of a point cloud split by points: each point's neighbourhood covariance, its smallest eigenvector."""
    m = mesh()
    pts = randn(40, 8, 3, seed=9, **D64) * torch.tensor([1.0, 1.0, 0.05], **D64)  # 8 neighbours, flat in z

    def normals(p):
        c = p - p.mean(1, keepdim=True)
        cov = c.mT @ c / p.shape[1]
        return torch.linalg.eigh(cov).eigenvectors[..., 0].abs()

    lay = ([st.Shard(0)], {0: uneven_extents(40, m.size(), seed=10)})
    out = check_op(normals, [pts], [lay], m, **TIGHT, what="point normals")
    assert st.placements(out) == (st.Shard(0),)
    xs = shard_of(pts, m, *lay).requires_grad_()
    with st.CommCounter() as counter:
        normals(xs).sum(-1).square().mean(0, keepdim=True).backward(torch.ones(1, **D64))
    assert dict(counter.calls) == {}, counter.calls   # local forward and backward: nothing travels
    return True


def test_point_normals():
    harness.run(3, strict, case_point_normals)


def case_singular_raises():
    """One singular matrix on the last rank: every rank raises linalg's error, with the global batch index."""
    m = mesh()
    a = randn(6, 3, 3, seed=11, **D64) + 3 * torch.eye(3, **D64)
    a[5] = 0.0
    w = m.size()
    torch.linalg.inv(shard_of(a, m, [st.Shard(0)], {0: [6 - (w - 1)] + [1] * (w - 1)}))


def test_singular_raises_on_every_rank():
    for world in (2, 3):
        harness.expect_error(world, case_singular_raises, match="(Batch element 5)", kinds=("_LinAlgError",
                                                                                           "LinAlgError"))


def case_diag_embed():
    """diag_embed (the backward of eigh, svd, det): other dims' shards stay; a sharded last dim splits the new rows."""
    m = mesh()
    w = m.size()
    x = randn(5, 4, 3, seed=13, **D64)
    lay = ([st.Shard(0)], {0: uneven_extents(5, w, seed=14)})
    for offset, d1, d2 in ((0, -2, -1), (1, 0, 2), (-1, 1, 3)):
        check_op(lambda t: torch.diag_embed(t, offset, d1, d2), [x], [lay], m, **TIGHT,
                 what=f"diag_embed {offset} {d1} {d2}")
    check_op(lambda t: torch.diag_embed(t), [x], [([st.Shard(1)], None)], m, **TIGHT, what="diag_embed dim 1")
    # The last dim (the entries) split: the new rows take the split, no communication; with an offset the empty
    # rows go to the first or the last rank; torch.diag / diagflat of a split vector go through it.
    ent = ([st.Shard(2)], {0: uneven_extents(3, w, seed=15)})
    for offset, d1, d2 in ((0, -2, -1), (2, 0, 2), (-1, 3, 1)):
        xs = shard_of(x, m, *ent)
        with st.CommCounter() as c:
            e = torch.diag_embed(xs, offset, d1, d2)
        assert not c.calls and st.placements(e) == (st.Shard(d1 % 4),), (c.calls, st.placements(e))
        check_op(lambda t: torch.diag_embed(t, offset, d1, d2), [x], [ent], m, **TIGHT,
                 what=f"diag_embed of split entries {offset} {d1} {d2}")
    v = randn(7, seed=16, **D64)
    vl = ([st.Shard(0)], {0: uneven_extents(7, w, seed=17)})
    for k in (0, 2, -3):
        check_op(lambda t: torch.diag(t, k), [v], [vl], m, **TIGHT, what=f"diag of a split vector {k}")
        check_op(lambda t: torch.diagflat(t, k), [v], [vl], m, **TIGHT, what=f"diagflat of a split vector {k}")
    # a pending sum stays pending (the op is linear)
    s = shard_of(x, m, [st.Shard(0)]).sum(0, keepdim=True)
    with st.CommCounter() as c:
        e = torch.diag_embed(s)
    assert not c.calls and type(st.placements(e)[0]).__name__ == "Partial", (c.calls, st.placements(e))
    close(full(e), torch.diag_embed(x.sum(0, keepdim=True)), what="diag_embed of Partial")
    return True


def test_diag_embed():
    harness.run(2, strict, case_diag_embed)


def case_declines():
    """A matrix dim split, or batch dims that do not line up: the fallback (right, gathered); strict mode refuses."""
    m = mesh()
    a = randn(4, 5, 5, seed=15, **D64) + 3 * torch.eye(5, **D64)
    check_op(torch.linalg.inv, [a], [([st.Shard(1)], None)], m, **TIGHT, what="inv, rows split")
    with st.use_strict():
        with pytest.raises(NotImplementedError, match="a matrix dim"):
            torch.linalg.inv(shard_of(a, m, [st.Shard(2)]))
    return True


def test_declines():
    harness.run(2, case_declines)


def case_out_on_replicas():
    """An out= op without a rule that writes a plain tensor from replicated ShardTensors runs on the replicas, as on one
    device (no communication): torch.linalg.matrix_rank's sum(S > tol, out=...) after the fallback's gathered svd
    (a matrix dim split) raised "no domain-parallel rule"; strict mode too for a direct out= call. From split inputs
    the functional overload runs on its rule and the plain output receives the whole result."""
    import warnings
    m = mesh()
    a = randn(3, 5, 5, seed=21, **D64)
    a[1, :, 4] = a[1, :, 0]  # rank 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning
        got = torch.linalg.matrix_rank(shard_of(a, m, [st.Shard(1)]))
    assert torch.equal(st.full_tensor(got) if st.is_shard_tensor(got) else got, torch.linalg.matrix_rank(a))
    r = shard_of(a, m, [st.Replicate()])
    with st.use_strict():
        out = torch.empty(3, 5, dtype=torch.float64)
        res = torch.sum(r, -1, out=out)
        assert res is out and not st.is_shard_tensor(out)
        assert torch.equal(out, a.sum(-1))
        # A split input: the functional overload (sum.dim_IntList for sum.IntList_out) runs on its rule and the
        # plain output receives the whole result on every rank.
        for pl in ([st.Shard(1)], [st.Shard(2)]):
            out = torch.full((7,), 9.0, dtype=torch.float64)  # resized as torch resizes it
            res = torch.sum(shard_of(a, m, pl), -1, out=out)
            assert res is out and not st.is_shard_tensor(out) and out.shape == (3, 5)
            close(out, a.sum(-1), rtol=1e-12, atol=1e-12, what=f"sum(out=) of {pl}")
    # matrix_rank of a batch of matrices split along the batch: the batched svd is local, its sum(out=) as above.
    got = torch.linalg.matrix_rank(shard_of(a, m, [st.Shard(0)]))
    assert torch.equal(st.full_tensor(got) if st.is_shard_tensor(got) else got, torch.linalg.matrix_rank(a))
    return True


def test_out_on_replicas():
    harness.run(2, case_out_on_replicas)
