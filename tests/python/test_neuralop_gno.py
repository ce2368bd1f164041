"""neuraloperator's GNO block on split point sets (``shardtensor.integrations.neuralop_gno``), in strict mode, against
one device: queries split (the data made whole; GNO-out), data and features split with whole queries (a pending sum
over the ranks; GNO-in), the ``sum`` and ``mean`` reductions, linear / nonlinear / kernel-only transforms, batched
and unbatched features, a distance weighting; forward, input gradients and the block's parameter gradients; uneven,
one-point and empty shards, 1-4 ranks, a 2x2 mesh; whole GINO and FNOGNO models with their point sets split. The
split point sets are never gathered (collectives counted)."""
import copy

import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_integration_routing, close, full, mesh, randn, strict, tiny_extents, uneven_extents

pytest.importorskip("neuralop", reason="neuraloperator is an optional test dependency (tests/requirements-zoo.txt)")

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _f64(case, *args):
    """neuraloperator's own segment reduction accumulates into ``torch.zeros`` of the default dtype."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(D)
    try:
        return strict(case, *args)
    finally:
        torch.set_default_dtype(prev)


def _f64_tensor(t):
    """float64 for real tensors, complex128 for the spectral weights (``.to(float64)`` would drop their imaginary
    part)."""
    return t.to(torch.complex128) if t.is_complex() else t.to(D) if t.is_floating_point() else t


def _block(**kw):
    from neuralop.layers.gno_block import GNOBlock
    torch.manual_seed(0)
    args = dict(in_channels=3, out_channels=3, coord_dim=2, radius=0.35, channel_mlp_layers=[8, 8],
                pos_embedding_channels=4, use_torch_scatter_reduce=False, use_open3d_neighbor_search=False)
    args.update(kw)
    return GNOBlock(**args).to(D)


def _points(n, seed):
    return torch.rand(n, 2, generator=torch.Generator().manual_seed(seed), dtype=D)


def _layout(t, m, dim, ext):
    return st.distribute_tensor(t, m, [st.Shard(dim)], sharding_shapes={0: ext} if ext else None)


def _compare(block, args, sharded_args, what, expect=None):
    """The block on the full arguments against a copy of it on the sharded ones: output, the gradients of every
    argument that requires grad, and the block's parameter gradients."""
    block.zero_grad(set_to_none=True)
    ref_block, sh_block = block, copy.deepcopy(block)
    out_ref = ref_block(*args)
    out = sh_block(*sharded_args)
    assert st.is_shard_tensor(out), f"{what}: a plain output"
    if expect is not None:
        assert st.placements(out) == tuple(expect), f"{what}: placements {st.placements(out)}"
    close(full(out), out_ref, **TOL, what=f"{what} output")
    weight = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7), dtype=D)
    (out_ref * weight).sum().backward()
    if any(p.is_partial() for p in st.placements(out)):  # a pending sum times whole values stays pending
        (out * weight).sum().backward()
    else:
        (out * st.distribute_tensor(weight, st.device_mesh(out), st.placements(out),
                                    sharding_shapes=st.sharding_shapes(out))).sum().backward()
    for i, (a, b) in enumerate(zip(args, sharded_args)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert b.grad is not None, f"{what}: argument {i} got no gradient"
            if st.is_shard_tensor(b):
                assert st.placements(b.grad) == st.placements(b), f"{what}: argument {i}'s gradient layout"
            close(full(b.grad) if st.is_shard_tensor(b.grad) else b.grad, a.grad, **TOL, what=f"{what} grad {i}")
    for (name, p), q in zip(ref_block.named_parameters(), sh_block.parameters()):
        assert not st.is_shard_tensor(q.grad), f"{what}: {name}'s gradient is a ShardTensor"
        close(q.grad, p.grad, **TOL, what=f"{what} grad of {name}")
    return out


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def case_queries_split(kind):
    m = mesh()
    w = m.size()
    n_q, n_d = 23, 17
    ext = uneven_extents(n_q, w, seed=4) if kind == "uneven" else tiny_extents(n_q, w)
    y, x = _points(n_d, 1), _points(n_q, 2)
    f2 = randn(n_d, 3, seed=3, dtype=D)
    f3 = randn(2, n_d, 3, seed=4, dtype=D)
    for kw, f in ((dict(), f2), (dict(reduction="mean"), f3), (dict(transform_type="nonlinear"), f3),
                  (dict(transform_type="nonlinear_kernelonly", reduction="mean"), f2),
                  (dict(pos_embedding_type=None, in_channels=2, out_channels=3, transform_type="linear_kernelonly"),
                   None)):
        block = _block(**kw)
        what = f"queries split {kw}"
        args = [_leaf(y), _leaf(x), _leaf(f) if f is not None else None]
        sharded = [_leaf(y), _leaf(_layout(x, m, 0, ext)), _leaf(f) if f is not None else None]
        batched = f is not None and f.dim() == 3
        with st.CommCounter() as c:
            _compare(block, args, sharded, what, expect=[st.Shard(1 if batched else 0)])
        calls = dict(c.calls)
        assert "fallback_all_gather" not in calls, f"{what}: {calls}"
    # data and features split too (another layout of the same data): made whole, then as above
    block = _block(reduction="mean")
    _compare(block, [_leaf(y), _leaf(x), _leaf(f3)],
             [_leaf(_layout(y, m, 0, None)), _leaf(_layout(x, m, 0, ext)), _leaf(_layout(f3, m, 1, None))],
             "queries and data split", expect=[st.Shard(1)])
    return True


def case_data_split(kind):
    m = mesh()
    w = m.size()
    n_q, n_d = 19, 29
    ext = uneven_extents(n_d, w, seed=6) if kind == "uneven" else tiny_extents(n_d, w)
    y, x = _points(n_d, 5), _points(n_q, 6)
    f2 = randn(n_d, 3, seed=7, dtype=D)
    f3 = randn(2, n_d, 3, seed=8, dtype=D)
    for kw, f in ((dict(), f3), (dict(reduction="mean"), f3), (dict(reduction="mean"), f2),
                  (dict(transform_type="nonlinear", reduction="mean"), f3)):
        block = _block(**kw)
        what = f"data split {kw}"
        fd = 1 if f.dim() == 3 else 0
        args = [_leaf(y), _leaf(x), _leaf(f)]
        sharded = [_leaf(_layout(y, m, 0, ext)), _leaf(x), _leaf(_layout(f, m, fd, ext))]
        with st.CommCounter() as c:
            out = block(*sharded)
        calls = dict(c.calls)
        assert "all_gather" not in calls and "fallback_all_gather" not in calls, f"{what}: {calls}"
        _compare(block, args, sharded, what,
                 expect=[st.Partial()] if w > 1 else None)
        del out
    # whole queries given as a Replicate ShardTensor that requires grad: its gradient summed over the ranks
    block = _block(reduction="mean")
    _compare(block, [_leaf(y), _leaf(x), _leaf(f3)],
             [_leaf(_layout(y, m, 0, ext)), _leaf(st.distribute_tensor(x, m, [st.Replicate()])),
              _leaf(_layout(f3, m, 1, ext))], "data split, Replicate queries", expect=[st.Partial()] if w > 1 else None)
    return True


@pytest.mark.parametrize("kind", ["uneven", "tiny"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gno_queries_split(world, kind):
    harness.run(world, _f64, case_queries_split, kind)


@pytest.mark.parametrize("kind", ["uneven", "tiny"])
@pytest.mark.parametrize("world", [2, 3])
def test_gno_data_split(world, kind):
    harness.run(world, _f64, case_data_split, kind)


def _gino():
    from neuralop.models import GINO
    torch.manual_seed(1)
    return GINO(in_channels=1, out_channels=2, gno_coord_dim=2, fno_n_modes=(4, 4), fno_hidden_channels=8,
                fno_n_layers=2, in_gno_radius=0.3, out_gno_radius=0.3, gno_use_open3d=False,
                gno_use_torch_scatter=False, in_gno_channel_mlp_hidden_layers=[8],
                out_gno_channel_mlp_hidden_layers=[8], gno_embed_channels=4, fno_in_channels=3)._apply(_f64_tensor)


def _model_compare(model, args, sharded_args, what):
    ref, sh = model, copy.deepcopy(model)
    out_ref = ref(**args)
    out = sh(**sharded_args)
    close(full(out), out_ref, **TOL, what=f"{what} output")
    weight = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(9), dtype=D)
    (out_ref * weight).sum().backward()
    (out * st.distribute_tensor(weight, st.device_mesh(out), st.placements(out),
                                sharding_shapes=st.sharding_shapes(out))).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), sh.parameters()):
        if p.grad is None:
            assert q.grad is None, f"{what}: {name} got a gradient"
            continue
        close(full(q.grad) if st.is_shard_tensor(q.grad) else q.grad, p.grad, **TOL, what=f"{what} grad of {name}")
    return out


def case_gino(kind):
    """GINO with its input points and its output queries split (a car surface's points): GNO-in from each rank's
    points into the latent grid (a pending sum), the FNO on the latent grid, GNO-out onto each rank's queries."""
    m = mesh()
    w = m.size()
    n_in, n_out = 31, 26
    e_in = uneven_extents(n_in, w, seed=2) if kind == "uneven" else tiny_extents(n_in, w)
    e_out = uneven_extents(n_out, w, seed=3) if kind == "uneven" else tiny_extents(n_out, w)
    geom, queries = _points(n_in, 11).unsqueeze(0), _points(n_out, 12).unsqueeze(0)
    feats = randn(1, n_in, 1, seed=13, dtype=D)
    g = torch.linspace(0, 1, 8, dtype=D)
    latent = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).unsqueeze(0)
    args = dict(input_geom=geom, latent_queries=latent, output_queries=queries, x=feats)
    sharded = dict(input_geom=_layout(geom, m, 1, e_in), latent_queries=latent,
                   output_queries=_layout(queries, m, 1, e_out), x=_layout(feats, m, 1, e_in))
    with st.CommCounter() as c:
        out = _model_compare(_gino(), args, sharded, f"GINO {kind}")
    assert st.placements(out) == (st.Shard(1),) or w == 1, st.placements(out)
    assert "fallback_all_gather" not in dict(c.calls), dict(c.calls)
    return True


def case_fnogno():
    """FNOGNO: the FNO on a grid split along its rows, the GNO onto output queries split along their points."""
    from neuralop.models import FNOGNO
    m = mesh()
    w = m.size()
    torch.manual_seed(2)
    model = FNOGNO(1, 2, gno_coord_dim=2, fno_n_modes=(4, 4), fno_hidden_channels=8, fno_n_layers=2,
                   gno_radius=0.25, gno_use_open3d=False, gno_use_torch_scatter=False,
                   gno_channel_mlp_hidden_layers=[8], gno_embed_channels=4)._apply(_f64_tensor)
    g1, g2 = torch.linspace(0, 1, 12, dtype=D), torch.linspace(0, 1, 10, dtype=D)
    grid = torch.stack(torch.meshgrid(g1, g2, indexing="ij"), -1)
    f = torch.sin(3 * grid[..., :1]) + grid[..., 1:]
    out_p = _points(27, 14)
    args = dict(in_p=grid, out_p=out_p, f=f)
    sharded = dict(in_p=_layout(grid, m, 0, None), out_p=_layout(out_p, m, 0, uneven_extents(27, w, seed=4)),
                   f=_layout(f, m, 0, None))
    with st.CommCounter() as c:
        _model_compare(model, args, sharded, "FNOGNO")
    assert "fallback_all_gather" not in dict(c.calls), dict(c.calls)
    return True


@pytest.mark.parametrize("kind", ["uneven", "tiny"])
@pytest.mark.parametrize("world", [2, 3])
def test_gino(world, kind):
    harness.run(world, _f64, case_gino, kind)


def test_fnogno():
    harness.run(2, _f64, case_fnogno)


@pytest.mark.parametrize("first", ["neuralop", "shardtensor"])
def test_routing_installed_in_either_import_order(first):
    """GNOBlock.forward is routed whichever library is imported first; SHARDTENSOR_NO_INTEGRATIONS=1 leaves it."""
    second = "shardtensor" if first == "neuralop" else "neuralop"
    check_integration_routing(first, second, "neuralop.layers.gno_block", "GNOBlock.forward",
                              disabled_too=first == "shardtensor")


def case_2d_mesh():
    """A 2x2 mesh: the points split over one mesh dim, the other replicating (a data-parallel axis's copies)."""
    m = mesh((2, 2))
    y, x = _points(21, 31), _points(18, 32)
    f = randn(2, 21, 3, seed=33, dtype=D)
    block = _block(reduction="mean")
    _compare(block, [_leaf(y), _leaf(x), _leaf(f)],
             [_leaf(y), _leaf(st.distribute_tensor(x, m, [st.Replicate(), st.Shard(0)], sharding_shapes={1: [13, 5]})),
              _leaf(f)], "2x2 queries split", expect=[st.Replicate(), st.Shard(1)])
    _compare(block, [_leaf(y), _leaf(x), _leaf(f)],
             [_leaf(st.distribute_tensor(y, m, [st.Shard(0), st.Replicate()], sharding_shapes={0: [4, 17]})),
              _leaf(x), _leaf(st.distribute_tensor(f, m, [st.Shard(1), st.Replicate()], sharding_shapes={0: [4, 17]}))],
             "2x2 data split", expect=[st.Partial(), st.Replicate()])
    return True


def test_2d_mesh():
    harness.run(4, _f64, case_2d_mesh)
