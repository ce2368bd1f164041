"""shardtensor.ops.knn / radius_search: single-device kernels against a brute-force Python reference (tie rule:
ascending distance, then ascending index), distance gradients against autograd through gather + norm, and sharded
point clouds (uneven shards, a 1-point shard, empty shards, 1-D and 2-D meshes, replicated/plain queries, batched
inputs) against the single-device op, plus refusals that must raise on every rank."""
import math

import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, full, mesh, tiny_extents, uneven_extents
from cases_util import randn as _randn
from shardtensor.ops import knn, radius_search

TOL = dict(rtol=1e-6, atol=1e-9)


def randn(*shape, seed=0, dtype=torch.float64, requires_grad=False):
    """Seeded data, float64 by default (exact comparisons of neighbour orders)."""
    return _randn(*shape, seed=seed, dtype=dtype, requires_grad=requires_grad)


# ---- references ----

def ref_search(points, queries, k, radius=math.inf):
    """Brute force: (indices, distances) ordered by distance then index; -1/+inf padding."""
    batched = points.dim() == 3
    p = points if batched else points.unsqueeze(0)
    q = queries if batched else queries.unsqueeze(0)
    d = torch.cdist(q.double(), p.double(), compute_mode="donot_use_mm_for_euclid_dist").to(points.dtype)
    n = p.shape[1]
    idx = torch.arange(n).expand(d.shape).clone()
    d = torch.where(d <= radius, d, torch.full_like(d, math.inf))
    idx = torch.where(torch.isinf(d), torch.full_like(idx, -1), idx)
    # Stable sort by distance over ascending indices = the tie rule.
    order = torch.sort(d, dim=-1, stable=True).indices
    d, idx = d.gather(-1, order), idx.gather(-1, order)
    if k > n:
        pad = list(d.shape[:-1]) + [k - n]
        d = torch.cat([d, torch.full(pad, math.inf, dtype=d.dtype)], -1)
        idx = torch.cat([idx, torch.full(pad, -1, dtype=idx.dtype)], -1)
    d, idx = d[..., :k], idx[..., :k]
    return (idx, d) if batched else (idx[0], d[0])


def ref_distances(points, queries, idx):
    """Differentiable distances of the given neighbours (0 at padding): gather + norm."""
    batched = points.dim() == 3
    p = points if batched else points.unsqueeze(0)
    q = queries if batched else queries.unsqueeze(0)
    i = idx if batched else idx.unsqueeze(0)
    safe = i.clamp(min=0)
    nb = torch.stack([p[b][safe[b]] for b in range(p.shape[0])])
    d = torch.linalg.vector_norm(q.unsqueeze(2) - nb, dim=-1)
    d = torch.where(i >= 0, d, torch.zeros_like(d))
    return d if batched else d[0]


def grid_points(n, c=3, seed=0, dtype=torch.float64):
    """Integer coordinates in a small box: many exactly equal distances (ties) and duplicate points."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (n, c), generator=g).to(dtype)


def check_single(points, queries, k, radius=math.inf):
    if math.isinf(radius):
        idx, d = knn(points, queries, k)
    else:
        idx, d = radius_search(points, queries, radius, k)
    ridx, rd = ref_search(points, queries, k, radius)
    assert idx.dtype == torch.int64 and d.dtype == points.dtype
    assert torch.equal(idx, ridx), f"indices\n{idx}\n!=\n{ridx}"
    torch.testing.assert_close(d, rd, rtol=1e-5, atol=1e-6)
    return idx, d


# ---- single device ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_knn_random(dtype):
    p, q = randn(20, 3, seed=1, dtype=dtype), randn(7, 3, seed=2, dtype=dtype)
    for k in (1, 4, 20):
        check_single(p, q, k)
    check_single(randn(9, 5, seed=3, dtype=dtype), randn(4, 5, seed=4, dtype=dtype), 9)  # k == N, C = 5


def test_knn_ties_and_duplicates():
    p = grid_points(30, seed=5)
    p[7] = p[3]
    p[21] = p[3]  # exact duplicates: their order must be by index
    q = torch.cat([grid_points(6, seed=6), p[3:4]])
    for k in (1, 5, 30):
        idx, d = check_single(p, q, k)
    same = (p == p[3]).all(-1).nonzero().flatten().tolist()  # includes 3, 7, 21 (and chance duplicates)
    assert len(same) >= 3 and idx[-1, :len(same)].tolist() == same and (d[-1, :len(same)] == 0).all()


def test_knn_batched():
    p, q = randn(3, 12, 3, seed=7), randn(3, 5, 3, seed=8)
    check_single(p, q, 4)
    check_single(grid_points(36, seed=9).view(3, 12, 3), grid_points(15, seed=10).view(3, 5, 3), 6)


def test_radius_search():
    p, q = grid_points(25, seed=11), grid_points(6, seed=12)
    # Fewer neighbours than slots (padding), more than slots (nearest kept), exact boundary (integer distances).
    for radius, max_nb in ((0.5, 8), (1.0, 3), (1.0, 30), (2.0, 4), (0.0, 5), (10.0, 40)):
        idx, d = check_single(p, q, max_nb, radius)
        assert ((idx >= 0) == torch.isfinite(d)).all()
    check_single(randn(3, 10, 2, seed=13), randn(3, 4, 2, seed=14), 5, 0.8)  # batched, random
    idx, d = radius_search(p, q, 0.5, 8)
    assert (idx[d == math.inf] == -1).all()


def test_empty():
    idx, d = knn(randn(5, 3, seed=1), torch.zeros(0, 3, dtype=torch.float64), 2)
    assert idx.shape == (0, 2) and d.shape == (0, 2)
    idx, d = radius_search(torch.zeros(0, 3, dtype=torch.float64), randn(2, 3, seed=1), 1.0, 3)
    assert (idx == -1).all() and torch.isinf(d).all()


@pytest.mark.parametrize("batched", [False, True])
def test_gradients(batched):
    shape_p, shape_q = ((2, 10, 3), (2, 6, 3)) if batched else ((10, 3), (6, 3))
    p = randn(*shape_p, seed=20, requires_grad=True)
    q = randn(*shape_q, seed=21, requires_grad=True)
    with torch.no_grad():
        q[..., 0, :] = p[..., 2, :]  # a query on a point: distance 0 has gradient 0
    for name, fn in (("knn", lambda p, q: knn(p, q, 4)), ("radius", lambda p, q: radius_search(p, q, 1.2, 5))):
        idx, d = fn(p, q)
        assert not idx.requires_grad and d.requires_grad
        w = randn(*d.shape, seed=22)
        loss = (torch.where(idx >= 0, d, torch.zeros_like(d)) * w).sum()
        gp, gq = torch.autograd.grad(loss, (p, q))
        p2, q2 = p.detach().clone().requires_grad_(), q.detach().clone().requires_grad_()
        loss_ref = (ref_distances(p2, q2, idx) * w).sum()
        rp, rq = torch.autograd.grad(loss_ref, (p2, q2))
        torch.testing.assert_close(gp, rp, msg=f"{name} points grad")
        torch.testing.assert_close(gq, rq, msg=f"{name} queries grad")
    # Finite differences (no near-ties in random data at this step size).
    pc, qc = randn(*shape_p, seed=23, requires_grad=True), randn(*shape_q, seed=24, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, q: knn(p, q, 3)[1], (pc, qc))


def test_no_grad_and_inference_mode():
    p, q = randn(8, 3, seed=30, requires_grad=True), randn(4, 3, seed=31)
    with torch.no_grad():
        assert not knn(p, q, 2)[1].requires_grad
    with torch.inference_mode():
        idx, _ = knn(p, q, 2)
    assert torch.equal(idx, ref_search(p.detach(), q, 2)[0])


def test_meta():
    p, q = torch.empty(2, 10, 3, device="meta"), torch.empty(2, 4, 3, device="meta")
    idx, d = knn(p, q, 3)
    assert idx.shape == (2, 4, 3) and idx.dtype == torch.int64 and d.device.type == "meta"
    idx, d = radius_search(p[0], q[0], 0.5, 12)
    assert idx.shape == (4, 12) and d.dtype == torch.float32


def test_argument_errors():
    p, q = randn(5, 3, seed=1), randn(2, 3, seed=2)
    with pytest.raises(ValueError, match="exceeds the number of points"):
        knn(p, q, 6)
    with pytest.raises(ValueError, match="k must be >= 1"):
        knn(p, q, 0)
    with pytest.raises(ValueError, match="coordinates"):
        knn(p, randn(2, 4, seed=2), 1)
    with pytest.raises(ValueError, match="dtype"):
        knn(p, q.float(), 1)
    with pytest.raises(ValueError, match="radius must be >= 0"):
        radius_search(p, q, -1.0, 2)
    with pytest.raises(ValueError, match="max_neighbors"):
        radius_search(p, q, 1.0, 0)
    with pytest.raises(ValueError, match="batch sizes differ"):
        knn(randn(2, 5, 3, seed=1), randn(3, 2, 3, seed=2), 1)


# ---- sharded (cases run on every rank) ----

def lay(dim, ext, mesh_dim=0, ndim=1):
    pl = [st.Replicate()] * ndim
    pl[mesh_dim] = st.Shard(dim)
    return (pl, {mesh_dim: ext} if ext else None)


def knn_fn(k):
    return lambda p, q: knn(p, q, k)


def radius_fn(r, max_nb):
    def fn(p, q):
        idx, d = radius_search(p, q, r, max_nb)
        return idx, torch.where(idx >= 0, d, torch.zeros_like(d))  # a finite loss for the gradient check
    return fn


def case_sharded_1d(kind):
    m = mesh()
    w = m.size()
    n, nq = 13, 9
    pe = tiny_extents(n, w) if kind == "tiny" else uneven_extents(n, w, seed=3)
    qe = uneven_extents(nq, w, seed=4)
    rep = ([st.Replicate()], None)
    for data in ("random", "grid"):  # grid: exact ties across shards (order by global index)
        if data == "random":
            p, q = randn(n, 3, seed=1), randn(nq, 3, seed=2)
        else:
            p, q = grid_points(n, seed=1), grid_points(nq, seed=2)
        for k in (1, 5, n):
            check_op(knn_fn(k), [p, q], [lay(0, pe), lay(0, qe)], m, **TOL, what=f"{data} k={k} both sharded",
                     expect_placements=[st.Shard(0)])
        check_op(knn_fn(4), [p, q], [lay(0, pe), lay(0, tiny_extents(nq, w)[::-1])], m, **TOL, what=f"{data} other q extents")
        check_op(knn_fn(4), [p, q], [lay(0, pe), rep], m, **TOL, what=f"{data} q replicated",
                 expect_placements=[st.Replicate()])
        check_op(knn_fn(4), [p, q], [lay(0, pe), None], m, **TOL, what=f"{data} q plain")
        check_op(knn_fn(4), [p, q], [rep, lay(0, qe)], m, **TOL, what=f"{data} points replicated",
                 expect_placements=[st.Shard(0)])
        check_op(knn_fn(4), [p, q], [None, lay(0, qe)], m, **TOL, what=f"{data} points plain")
        # Self-search (queries are the points).
        check_op(lambda p: knn(p, p, 3), [p], [lay(0, pe)], m, **TOL, what=f"{data} self")
        for r, max_nb in ((0.9, 3), (1.5, 20)):
            check_op(radius_fn(r, max_nb), [p, q], [lay(0, pe), lay(0, qe)], m, **TOL, what=f"{data} radius {r}")
            check_op(radius_fn(r, max_nb), [p, q], [lay(0, pe), rep], m, **TOL, what=f"{data} radius {r} q rep")
    return True


def case_batched():
    m = mesh()
    w = m.size()
    p, q = randn(2, 11, 3, seed=5), randn(2, 6, 3, seed=6)
    pe, qe = tiny_extents(11, w), uneven_extents(6, w, seed=7)
    check_op(knn_fn(4), [p, q], [lay(1, pe), lay(1, qe)], m, **TOL, what="point dim sharded")
    check_op(radius_fn(1.0, 4), [p, q], [lay(1, pe), None], m, **TOL, what="radius, q plain")
    be = [2] + [0] * (w - 1)
    check_op(knn_fn(4), [p, q], [lay(0, be), lay(0, be)], m, **TOL, what="batch sharded",
             expect_placements=[st.Shard(0)])
    # Points sharded along points, queries along the batch: the points follow the batch split.
    check_op(knn_fn(4), [p, q], [lay(1, pe), lay(0, None)], m, **TOL, what="batch-sharded queries",
             expect_placements=[st.Shard(0)])
    # Points batch-sharded, queries point-sharded on the same mesh dim: the queries follow the batch split and the
    # outputs go back to the queries' layout.
    check_op(knn_fn(4), [p, q], [lay(0, be), lay(1, qe)], m, **TOL, what="batch-sharded points",
             expect_placements=[st.Shard(1)])
    check_op(radius_fn(1.0, 3), [p, q], [lay(0, be), lay(1, qe)], m, **TOL, what="radius, batch-sharded points")
    return True


def case_2d_mesh():
    m = mesh((2, 2))
    n, nq = 10, 7
    p, q = grid_points(n, seed=8), randn(nq, 3, seed=9)
    for pm in (0, 1):
        other = 1 - pm
        pl = lay(0, [1, n - 1], pm, 2)
        check_op(knn_fn(4), [p, q], [pl, lay(0, [nq, 0], pm, 2)], m, **TOL, what=f"points+queries on {pm}")
        check_op(knn_fn(4), [p, q], [pl, lay(0, [2, nq - 2], other, 2)], m, **TOL,
                 what=f"points on {pm}, queries on {other}")
        check_op(knn_fn(4), [p, q], [pl, None], m, **TOL, what=f"points on {pm}, queries plain")
        check_op(radius_fn(1.2, 6), [p, q], [lay(0, None, other, 2), lay(0, [3, nq - 3], pm, 2)], m, **TOL,
                 what=f"radius points on {other}")
    # Batched: batch on one mesh dim, points on the other.
    pb, qb = randn(2, 9, 3, seed=10), randn(2, 5, 3, seed=11)
    both = ([st.Shard(0), st.Shard(1)], {0: [1, 1], 1: [0, 9]})
    check_op(knn_fn(3), [pb, qb], [both, ([st.Shard(0), st.Shard(1)], {0: [1, 1], 1: [4, 1]})], m, **TOL,
             what="batch x points")
    return True


def case_inference():
    m = mesh()
    p, q = randn(10, 3, seed=12), randn(5, 3, seed=13)
    ps = st.distribute_tensor(p, m, [st.Shard(0)], {0: tiny_extents(10, m.size())})
    with torch.inference_mode():
        idx, d = knn(ps, q, 3)
    ridx, rd = ref_search(p, q, 3)
    assert torch.equal(full(idx), ridx)
    torch.testing.assert_close(full(d), rd)
    return True


def case_err_coordinate_dim():
    m = mesh()
    p = st.distribute_tensor(randn(6, 4, seed=1), m, [st.Shard(1)])
    knn(p, randn(3, 4, seed=2), 2)


def case_err_k():
    m = mesh()
    p = st.distribute_tensor(randn(6, 3, seed=1), m, [st.Shard(0)], {0: tiny_extents(6, m.size())})
    knn(p, randn(3, 3, seed=2), 7)


def case_err_batch_mesh_dims():
    m = mesh((2, 2))
    p = st.distribute_tensor(randn(2, 6, 3, seed=1), m, [st.Shard(0), st.Replicate()])
    q = st.distribute_tensor(randn(2, 3, 3, seed=2), m, [st.Replicate(), st.Shard(0)])
    knn(p, q, 2)


def case_err_meshes():
    p = st.distribute_tensor(randn(6, 3, seed=1), mesh(), [st.Shard(0)])
    q = st.distribute_tensor(randn(3, 3, seed=2), mesh((2, 2)), [st.Replicate(), st.Shard(0)])
    radius_search(p, q, 1.0, 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_1d(world):
    harness.run(world, case_sharded_1d, "tiny")
    if world > 1:
        harness.run(world, case_sharded_1d, "uneven")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_batched(world):
    harness.run(world, case_batched)


def test_sharded_2d_mesh():
    harness.run(4, case_2d_mesh)


def test_sharded_inference_mode():
    harness.run(3, case_inference)


def test_sharded_refusals():
    harness.expect_error(2, case_err_coordinate_dim, match="coordinate dim -1 is sharded",
                         kinds=("NotImplementedError",))
    harness.expect_error(3, case_err_k, match="exceeds the number of points", kinds=("ValueError",))
    harness.expect_error(4, case_err_batch_mesh_dims, match="batch dim 0 on different mesh dims",
                         kinds=("NotImplementedError",))
    harness.expect_error(4, case_err_meshes, match="different meshes", kinds=("NotImplementedError",))


# ---- CUDA (run on a GPU machine by benchmarks/gpu_check.sh; skipped elsewhere) ----

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (csrc_cuda/point_search.cu)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 7, 32, 40])
def test_cuda_kernel_matches_cpu(dtype, k):
    """The CUDA kernel (register top-k up to k = 32, the general path beyond) against the CPU kernel, ties
    included (duplicated points), knn and radius search, with distance gradients."""
    pts = randn(300, 3, seed=5, dtype=dtype)
    pts = torch.cat([pts, pts[:40]])  # exact ties
    qs = randn(57, 3, seed=6, dtype=dtype)
    for fn, args in ((knn, (k,)), (radius_search, (0.8, k))):
        i_cpu, d_cpu = fn(pts, qs, *args)
        i_gpu, d_gpu = fn(pts.cuda(), qs.cuda(), *args)
        assert torch.equal(i_gpu.cpu(), i_cpu), fn.__name__
        torch.testing.assert_close(d_gpu.cpu(), d_cpu)
    p1, q1 = pts.clone().requires_grad_(), qs.clone().requires_grad_()
    p2, q2 = pts.cuda().requires_grad_(), qs.cuda().requires_grad_()
    knn(p1, q1, k)[1].sum().backward()
    knn(p2, q2, k)[1].sum().backward()
    torch.testing.assert_close(p2.grad.cpu(), p1.grad)
    torch.testing.assert_close(q2.grad.cpu(), q1.grad)
