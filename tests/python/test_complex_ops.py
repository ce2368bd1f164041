"""Complex inputs through rules written for real ones, against one device: forward values and dtypes, and the
gradients of a real loss (complex cotangents), on uneven and zero-extent shards, 1-D meshes and a 2x2 mesh.
Found by the OpInfo probe's complex64 samples (benchmarks/results/op_sweep_samples/README.md)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, uneven_extents


def crandn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.complex128).to(torch.complex64)


def check_complex(fn, x, lay, m, what, params=()):
    """fn(x, *params) sharded (x laid out as `lay`; params plain) against one device: outputs (values and dtypes),
    the input's and the parameters' gradients of sum(Re(out * w)) with a fixed random complex (or real) w."""
    pl, ext = lay
    xr = x.clone().requires_grad_()
    xs = st.distribute_tensor(x.clone(), m, pl, sharding_shapes=ext).requires_grad_()
    pr = [p.clone().requires_grad_() for p in params]
    ps = [p.clone().requires_grad_() for p in params]
    outs_ref, outs = fn(xr, *pr), fn(xs, *ps)
    if isinstance(outs_ref, torch.Tensor):
        outs_ref, outs = (outs_ref,), (outs,)
    loss_ref, loss = 0, 0
    for i, (a, b) in enumerate(zip(outs, outs_ref)):
        assert a.dtype == b.dtype, f"{what}: output {i} dtype {a.dtype}, one device {b.dtype}"
        close(full(a), b, rtol=1e-4, atol=1e-5, what=f"{what} output {i}")
        g = torch.Generator().manual_seed(70 + i)
        w = torch.randn(b.shape, generator=g, dtype=torch.complex128 if b.is_complex() else torch.float64)
        w = w.to(b.dtype)
        loss_ref = loss_ref + (b * w).real.sum()
        loss = loss + (a * w).real.sum()
    loss_ref.backward()
    loss.backward()
    close(full(xs.grad), xr.grad, rtol=1e-4, atol=1e-4, what=f"{what} input grad")
    for j, (a, b) in enumerate(zip(ps, pr)):
        close(full(a.grad), b.grad, rtol=1e-4, atol=1e-4, what=f"{what} param {j} grad")


def case_complex_ops(seed, mesh_shape):
    m = mesh(mesh_shape)
    x = crandn(6, 5, 4, seed=seed)
    if len(mesh_shape) == 1:
        w_ = m.size()
        lays = [([st.Shard(d)], {0: uneven_extents(x.size(d), w_, seed + d)}) for d in (0, 1)]
        # One rank without rows (var_mean's M2 was complex there and real elsewhere: the ranks' messages differed).
        lays.append(([st.Shard(1)], {0: [5] + [0] * (w_ - 1)}))
    else:
        lays = [([st.Shard(0), st.Shard(2)], {0: uneven_extents(6, 2, seed), 1: uneven_extents(4, 2, seed + 1)})]
    wt = crandn(3, 4, seed=seed + 10)
    b = crandn(3, seed=seed + 11)
    v = crandn(4, seed=seed + 12)
    for lay in lays:
        with st.use_strict():
            for what, fn, params in [
                ("linear", lambda t, w, bb: torch.nn.functional.linear(t, w, bb), (wt, b)),
                ("matmul vector", lambda t, vv: t @ vv, (v,)),
                ("var", lambda t: t.var(1), ()),
                ("var_mean split dim", lambda t: torch.var_mean(t, dim=(0, 1)), ()),
                ("std_mean", lambda t: torch.std_mean(t, dim=2, keepdim=True), ()),
                ("std all", lambda t: t.std(), ()),
                ("norm p=0", lambda t: torch.linalg.vector_norm(t, 0, dim=(0, 1)), ()),
                ("norm p=2", lambda t: t.norm(dim=1), ()),
                ("norm p=inf", lambda t: torch.linalg.vector_norm(t, float("inf")), ()),
                ("normalize p=0", lambda t: torch.nn.functional.normalize(t, p=0.0, dim=-1), ()),
            ]:
                check_complex(fn, x, lay, m, f"{what} {lay[0]}", params)
        # logcumsumexp along the split dim, with large real parts: the single-device scan keeps each step's dominant
        # term's imaginary part; the shards' totals fold the same way (a log of their sum would wrap it by 2*pi).
        big = x * 40
        for d in (0, 1):
            check_complex(lambda t: torch.logcumsumexp(t, d), big, lay, m, f"logcumsumexp {d} {lay[0]}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_complex_ops(world):
    harness.run(world, case_complex_ops, world, (world,))


def test_complex_ops_2d_mesh():
    harness.run(4, case_complex_ops, 5, (2, 2))
