"""PhysicsNeMo's periodic finite differences (`physicsnemo.nn.functional.uniform_grid_gradient`, Warp kernels;
src/ops/physicsnemo_grid_derivatives.cpp) on a split grid field, unmodified: first and second derivatives, orders 2
and 4, mixed terms, 1-D / 2-D / 3-D fields split along any dim (uneven, one-row and empty shards, shards narrower
than the halo), 1-3 ranks and a 2x2 mesh. Each rank runs PhysicsNeMo's kernel on its rows plus order / 2 wrapped
halo rows: the derivatives keep the field's layout (nothing gathered) and equal one device's, and so does the
field's gradient through them (a physics-informed loss on a grid)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import full, mesh, shard_of, tiny_extents, uneven_extents

pytest.importorskip("physicsnemo", reason="PhysicsNeMo is an optional test dependency (the zoo's)")


def _check(field, fs, m, **kw):
    from physicsnemo.nn.functional import uniform_grid_gradient
    fr = field.clone().requires_grad_()
    ref = uniform_grid_gradient(fr, **kw)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    (ref * w).sum().backward()
    fs = fs.detach().requires_grad_()
    with st.CommCounter() as c:
        got = uniform_grid_gradient(fs, **kw)
    assert not any(k.startswith("fallback") for k in c.calls), (kw, c.calls)
    assert [p.dim for p in st.placements(got) if p.is_shard()] == [p.dim + 1 for p in st.placements(fs)
                                                                    if p.is_shard()], st.placements(got)
    torch.testing.assert_close(full(got), ref, rtol=1e-5, atol=1e-4, msg=str(kw))
    (got * st.distribute_tensor(w, m, st.placements(got), sharding_shapes=st.sharding_shapes(got))).sum().backward()
    assert st.placements(fs.grad) == st.placements(fs)
    torch.testing.assert_close(full(fs.grad), fr.grad, rtol=1e-5, atol=1e-4, msg=str(kw))


def case_grid_derivatives(kind):
    m, w = mesh(), mesh().size()
    g = torch.Generator().manual_seed(1)
    ext = (lambda n, s: tiny_extents(n, w)) if kind == "tiny" else (lambda n, s: uneven_extents(n, w, seed=s))
    f2 = torch.randn(11, 9, generator=g)
    for dim in (0, 1):
        fs = shard_of(f2, m, [st.Shard(dim)], {0: ext(f2.shape[dim], dim)})
        for kw in (dict(spacing=(0.5, 0.25), order=2, derivative_orders=1),
                   dict(spacing=0.3, order=4, derivative_orders=(1, 2), include_mixed=True),
                   dict(spacing=(0.5, 0.25), order=2, derivative_orders=2)):
            _check(f2, fs, m, **kw)
    f1 = torch.randn(13, generator=g)
    _check(f1, shard_of(f1, m, [st.Shard(0)], {0: ext(13, 5)}), m, spacing=0.1, order=4, derivative_orders=(1, 2))
    # PhysicsNeMo's own argument checks raise on every rank, also on a rank without rows (tiny: rank 1)
    spacing = torch.tensor([0.5, 0.25])
    with pytest.raises(ValueError, match="include_mixed"):
        torch.ops.physicsnemo.uniform_grid_gradient_warp_impl(shard_of(f2, m, [st.Shard(0)], {0: ext(11, 0)}),
                                                             spacing, 2, 1, True)
    f3 = torch.randn(6, 7, 5, generator=g)
    _check(f3, shard_of(f3, m, [st.Shard(1)], {0: ext(7, 6)}), m, spacing=(1.0, 0.5, 0.25), order=2,
           derivative_orders=(1, 2), include_mixed=True)
    return True


@pytest.mark.parametrize("world,kind", [(1, "uneven"), (2, "uneven"), (3, "tiny")])
def test_grid_derivatives(world, kind):
    harness.run(world, case_grid_derivatives, kind)


def case_grid_derivatives_2d_mesh():
    m = mesh((2, 2))
    f = torch.randn(10, 8, generator=torch.Generator().manual_seed(2))
    fs = shard_of(f, m, [st.Shard(0), st.Shard(1)], {0: [7, 3], 1: [1, 7]})
    _check(f, fs, m, spacing=(0.5, 0.25), order=4, derivative_orders=(1, 2), include_mixed=True)
    return True


def test_grid_derivatives_2d_mesh():
    harness.run(4, case_grid_derivatives_2d_mesh)
