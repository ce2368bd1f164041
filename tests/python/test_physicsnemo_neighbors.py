"""PhysicsNeMo's neighbour searches on split queries (src/ops/physicsnemo_neighbors.cpp), unmodified: the ball query
of `physicsnemo.nn.BQWarp`, DoMINO's `LocalGeometryEncoding` and the whole DoMINO model (volume and surface points
split, strict mode, forward and every parameter gradient equal to one device), `physicsnemo.nn.functional.radius_search` (every
output, the gradient of the returned points) and `knn`. Queries split along their rows (uneven, one-row and empty
shards, 1-3 ranks), the searched points whole: equal to one device bit for bit, nothing communicated forward.
Split points and radius search without max_points decline (the gather fallback; strict mode raises on every rank).

Also the mechanism under it (src/dispatch/registry.cpp): a `torch.library.custom_op` of another library has a
CompositeExplicitAutograd kernel, which used to run on the ShardTensor itself (PhysicsNeMo's ball query raised
"ShardTensor.data_ptr(): a ShardTensor has no single buffer"); such ops now reach the fallback, whether defined
after `import shardtensor` or before it."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import harness
import shardtensor as st
from cases_util import full, mesh, shard_of, tiny_extents, uneven_extents

physicsnemo = pytest.importorskip("physicsnemo", reason="PhysicsNeMo is an optional test dependency (the zoo's)")


def _points(batched, dtype, n=160, q=41, seed=0):
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(1, n, 3, generator=g, dtype=torch.float64).to(dtype)
    qs = torch.rand(1, q, 3, generator=g, dtype=torch.float64).to(dtype)
    return (pts, qs) if batched else (pts[0], qs[0])


def _extents(n, w, kind):
    return uneven_extents(n, w, seed=3) if kind == "uneven" else tiny_extents(n, w)


def case_ball_query(kind):
    from physicsnemo.nn import BQWarp
    from physicsnemo.nn.functional import radius_search
    m, w = mesh(), mesh().size()
    pts, qs = _points(True, torch.float64)
    ext = {0: _extents(qs.shape[1], w, kind)}
    qss = shard_of(qs, m, [st.Shard(1)], ext)
    layer = BQWarp(radius=0.2, neighbors_in_radius=6)
    ref = layer(qs, pts, reverse_mapping=False)
    with st.CommCounter() as c:
        got = layer(qss, pts, reverse_mapping=False)
    assert c.total_calls == 0, c.calls
    for a, b in zip(got, ref):
        assert st.placements(a) == (st.Shard(1),) and st.sharding_shapes(a) == st.sharding_shapes(qss)
        assert a.dtype == b.dtype and torch.equal(full(a), b)
    # every output of the functional, the points replicated rather than plain
    pr = st.distribute_tensor(pts, m, [st.Replicate()])
    for kw in (dict(return_dists=True, return_points=True), dict(return_dists=True), dict()):
        ref = radius_search(pts, qs, 0.2, 5, **kw)
        with st.CommCounter() as c:
            got = radius_search(pr, qss, 0.2, 5, **kw)
        assert c.total_calls == 0, (kw, c.calls)
        ref, got = (ref, got) if isinstance(ref, tuple) else ((ref,), (got,))
        for a, b in zip(got, ref):
            assert torch.equal(full(a), b), kw
    return True


@pytest.mark.parametrize("world,kind", [(1, "uneven"), (2, "uneven"), (3, "tiny")])
def test_ball_query_split_queries(world, kind):
    harness.run(world, harness_strict, case_ball_query, kind)


def harness_strict(case, *args):
    with st.use_strict():  # no gather anywhere
        return case(*args)


def case_radius_search_grad():
    """Unbatched, float32 (the Warp kernels' type): the neighbour points' gradient reaches the whole points."""
    from physicsnemo.nn.functional import radius_search
    m, w = mesh(), mesh().size()
    pts, qs = _points(False, torch.float32, seed=1)
    qss = shard_of(qs, m, [st.Shard(0)], {0: _extents(qs.shape[0], w, "uneven")})
    pr = pts.clone().requires_grad_()
    idx, out, d = radius_search(pr, qs, 0.25, 7, return_dists=True, return_points=True)
    wgt = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * wgt).sum().backward()
    ps = pts.clone().requires_grad_()
    gi, go, gd = radius_search(ps, qss, 0.25, 7, return_dists=True, return_points=True)
    for a, b in ((gi, idx), (go, out), (gd, d)):
        assert st.placements(a) == (st.Shard(0),) and torch.equal(full(a), b.detach())
    (go * st.distribute_tensor(wgt, m, st.placements(go), sharding_shapes=st.sharding_shapes(go))).sum().backward()
    assert not st.is_shard_tensor(ps.grad)
    torch.testing.assert_close(ps.grad, pr.grad, rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_radius_search_gradient(world):
    harness.run(world, harness_strict, case_radius_search_grad)


def case_domino_local_geometry_encoding():
    """DoMINO's local geometry encoding, unmodified: volume points split, the geometry grid and its encoding whole;
    the ball query, the gathers of grid features and the point MLP run on each rank's own points; parameter
    gradients against one device."""
    from physicsnemo.models.domino.encodings import LocalGeometryEncoding
    m, w = mesh(), mesh().size()
    torch.manual_seed(0)
    enc = LocalGeometryEncoding(radius=0.3, neighbors_in_radius=4, total_neighbors_in_radius=8, base_layer=16,
                                activation=torch.nn.GELU(), grid_resolution=(4, 4, 4)).double()
    ref = __import__("copy").deepcopy(enc)
    g = torch.Generator().manual_seed(5)
    encoding_g = torch.randn(1, 2, 4, 4, 4, generator=g, dtype=torch.float64)
    axes = torch.linspace(0, 1, 4, dtype=torch.float64)
    p_grid = torch.stack(torch.meshgrid(axes, axes, axes, indexing="ij"), -1)[None]
    centers = torch.rand(1, 23, 3, generator=g, dtype=torch.float64)
    out_ref = ref(encoding_g, centers, p_grid)
    wgt = torch.randn(out_ref.shape, generator=g, dtype=torch.float64)
    (out_ref * wgt).sum().backward()
    cs = shard_of(centers, m, [st.Shard(1)], {0: uneven_extents(23, w, seed=6)})
    out = enc(encoding_g, cs, p_grid)
    assert st.placements(out) == (st.Shard(1),), st.placements(out)
    torch.testing.assert_close(full(out), out_ref, rtol=1e-12, atol=1e-12)
    (out * st.distribute_tensor(wgt, m, [st.Shard(1)], sharding_shapes=st.sharding_shapes(out))).sum().backward()
    for (n, p), (_, pr) in zip(enc.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(full(p.grad), pr.grad, rtol=1e-10, atol=1e-12, msg=n)
    return True


def test_domino_local_geometry_encoding():
    harness.run(2, case_domino_local_geometry_encoding)


def case_knn():
    from physicsnemo.nn.functional import knn
    m, w = mesh(), mesh().size()
    pts, qs = _points(False, torch.float64, seed=4)
    qss = shard_of(qs, m, [st.Shard(0)], {0: _extents(qs.shape[0], w, "tiny")})
    ref = knn(pts, qs, 5)
    with st.CommCounter() as c:
        got = knn(pts, qss, 5)
    assert c.total_calls == 0, c.calls
    for a, b in zip(got, ref):
        assert st.placements(a) == (st.Shard(0),) and torch.equal(full(a), b)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_knn_split_queries(world):
    harness.run(world, harness_strict, case_knn)


def case_declines():
    """Split points and max_points=None: the fallback gathers (equal to one device); strict mode raises on every
    rank, naming the remedy."""
    from physicsnemo.nn.functional import radius_search
    m = mesh()
    pts, qs = _points(True, torch.float64, seed=7)
    ps, qss = shard_of(pts, m, [st.Shard(1)]), shard_of(qs, m, [st.Shard(1)])
    for args, kw, match in (((ps, qss), dict(max_points=5), "searched points are split"),
                            ((ps, qs), dict(max_points=5), "queries are whole and the points split"),
                            ((pts, qss), dict(max_points=None), "max_points=None")):
        ref = radius_search(full(args[0]), full(args[1]), 0.2, **kw)
        with st.CommCounter() as c:
            got = radius_search(*args, 0.2, **kw)
        assert any(k.startswith("fallback") for k in c.calls), c.calls
        assert torch.equal(full(got), ref) if kw["max_points"] else torch.equal(full(got).sum(1), ref.sum(1))
        with st.use_strict(), pytest.raises(NotImplementedError, match=match):
            radius_search(*args, 0.2, **kw)
    return True


def test_declines():
    harness.run(2, case_declines)


# ------------------------------------------------------------------ torch.library custom ops of other libraries

_defined_ops = {}


def _custom_op(name, body):
    """torch.library.custom_op(name) over `body` (an annotated function), defined once per rank process: after
    shardtensor was imported."""
    if name not in _defined_ops:
        _defined_ops[name] = torch.library.custom_op(name, mutates_args=())(body)
    return _defined_ops[name]


def _numpy_sin(x: torch.Tensor) -> torch.Tensor:
    # only works on a plain CPU tensor, like a Warp or SciPy kernel
    return torch.from_numpy(x.detach().numpy().copy()).sin()


def _scaled_sin_body(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2.0


def _split_input(rows, cols, seed):
    m = mesh()
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x, shard_of(x, m, [st.Shard(0)], {0: uneven_extents(rows, m.size(), seed=seed)})


def case_custom_op_fallback():
    op = _custom_op("shardtensor_test::numpy_sin", _numpy_sin)
    x, xs = _split_input(7, 3, 9)
    with st.CommCounter() as c:
        y = op(xs)
    assert any(k.startswith("fallback") for k in c.calls), c.calls
    assert st.placements(y) == (st.Shard(0),) and torch.equal(full(y), x.sin())
    with st.use_strict(), pytest.raises(NotImplementedError, match="shardtensor_test::numpy_sin"):
        op(xs)
    return True


def case_custom_op_torch_body():
    """A custom op whose body is torch ops: gathered by default (its body may read buffers); registering the body
    as its handler keeps it divided."""
    _custom_op("shardtensor_test::scaled_sin", _scaled_sin_body)
    op = torch.ops.shardtensor_test.scaled_sin.default
    x, xs = _split_input(6, 4, 8)
    with st.CommCounter() as c:
        y = op(xs)
    assert any(k.startswith("fallback") for k in c.calls), c.calls
    st.register_handler(op, _scaled_sin_body)
    with st.CommCounter() as c:
        y2 = op(xs)
    assert c.total_calls == 0, c.calls
    for got in (y, y2):
        assert torch.equal(full(got), x.sin() * 2.0)
    assert st.placements(y2) == (st.Shard(0),)
    return True


def test_custom_op_torch_body_handler():
    harness.run(2, case_custom_op_torch_body)


def test_custom_op_defined_after_import():
    harness.run(2, case_custom_op_fallback)


def test_custom_op_defined_before_import(tmp_path):
    """The op exists before `import shardtensor` (PhysicsNeMo imported first): bound as well."""
    script = textwrap.dedent("""
        import os, torch
        @torch.library.custom_op("early_lib::numpy_cos", mutates_args=())
        def numpy_cos(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(x.detach().numpy().copy()).cos()
        import torch.distributed as dist
        import shardtensor as st
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
        m = init_device_mesh("cpu", (1,))
        x = torch.randn(5, 2, dtype=torch.float64)
        y = numpy_cos(st.distribute_tensor(x, m, [st.Shard(0)]))
        assert st.is_shard_tensor(y) and torch.equal(y.full_tensor(), x.cos())
        dist.destroy_process_group()
        print("ok")
    """)
    env = dict(os.environ, PORT=str(harness._free_port()))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# ------------------------------------------------------------------ the whole DoMINO model

_DOMINO_SPLIT = ("sdf_nodes", "pos_volume_closest", "pos_volume_center_of_mass", "volume_mesh_centers",
                 "pos_surface_center_of_mass", "surface_mesh_centers", "surface_mesh_neighbors", "surface_normals",
                 "surface_neighbors_normals", "surface_areas", "surface_neighbors_areas")


def _domino_small():
    """PhysicsNeMo's DoMINO (volume and surface) with its default configuration shrunk for a CPU test: a 16x8x8
    grid, narrow layers, few neighbours."""
    import copy
    import json
    from physicsnemo.models.domino.config import DEFAULT_MODEL_PARAMS, Config
    from physicsnemo.models.domino.model import DoMINO
    cfg = Config.from_hydra(json.loads(json.dumps(copy.deepcopy(dict(DEFAULT_MODEL_PARAMS)))))
    cfg.interp_res = [16, 8, 8]
    cfg.geometry_rep.geo_conv.volume_neighbors_in_radius = [4, 8, 8, 8]
    cfg.geometry_rep.geo_conv.surface_neighbors_in_radius = [4, 8, 8]
    cfg.geometry_local.volume_neighbors_in_radius = [4, 8]
    cfg.geometry_local.surface_neighbors_in_radius = [4, 8]
    for part in (cfg.geometry_local, cfg.nn_basis_functions, cfg.aggregation_model):
        part.base_layer = 32
    cfg.position_encoder.base_neurons = 32
    torch.manual_seed(0)
    model = DoMINO(input_features=3, output_features_vol=5, output_features_surf=4, model_parameters=cfg).double()
    # Its volume head samples neighbours of every point at random (each shard from its own stream, so not one
    # device's draws): at radius 1e-12 the samples sit on the points, and the comparison is exact.
    model.solution_calculator_vol.noise_intensity = 1e12
    return model, cfg


def _domino_inputs(cfg, n=37):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)   # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)    # noqa: E731
    nx, ny, nz = cfg.interp_res
    k = cfg.num_neighbors_surface
    axes = [torch.linspace(-1, 1, s, dtype=torch.float64) for s in (nx, ny, nz)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1)[None]
    box = torch.tensor([[[-1.0, -1, -1], [1, 1, 1]]], dtype=torch.float64)
    return {"pos_volume_closest": r(1, n, 3), "pos_volume_center_of_mass": r(1, n, 3),
            "pos_surface_center_of_mass": r(1, n, 3), "geometry_coordinates": u(1, 50, 3) * 2 - 1, "grid": grid,
            "surf_grid": grid.clone(), "sdf_grid": r(1, nx, ny, nz), "sdf_surf_grid": r(1, nx, ny, nz),
            "sdf_nodes": r(1, n, 1), "surface_mesh_centers": u(1, n, 3) * 2 - 1, "surface_mesh_neighbors": r(1, n, k, 3),
            "surface_normals": r(1, n, 3), "surface_neighbors_normals": r(1, n, k, 3),
            "surface_areas": u(1, n) + 1e-3, "surface_neighbors_areas": u(1, n, k) + 1e-3,
            "volume_mesh_centers": u(1, n, 3) * 2 - 1, "volume_min_max": box, "surface_min_max": box.clone(),
            "global_params_values": r(1, 2, 1), "global_params_reference": r(1, 2, 1)}


def case_domino():
    """The whole DoMINO, unmodified: the volume and surface points (and everything per point) split along the
    points, the geometry, grids and global parameters whole. Every op runs on rules (strict mode), the ball queries
    on each rank's own points; outputs and every parameter gradient equal one device's, and the only collectives are
    the parameter-gradient reductions."""
    import copy
    m, w = mesh(), mesh().size()
    model, cfg = _domino_small()
    ref = copy.deepcopy(model)
    d = _domino_inputs(cfg)
    out_ref = ref(d)
    g = torch.Generator().manual_seed(2)
    wgts = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in out_ref]
    sum((o * wt).sum() for o, wt in zip(out_ref, wgts)).backward()
    ext = {0: uneven_extents(37, w, seed=4)}
    ds = {k: shard_of(v, m, [st.Shard(1)], ext) if k in _DOMINO_SPLIT else v for k, v in d.items()}
    with st.CommCounter() as fwd:
        out = model(ds)
    assert fwd.total_calls == 0, fwd.calls
    for o, r in zip(out, out_ref):
        assert st.placements(o) == (st.Shard(1),) and st.sharding_shapes(o) == st.sharding_shapes(ds["sdf_nodes"])
        torch.testing.assert_close(full(o), r, rtol=1e-11, atol=1e-12)
    with st.CommCounter() as bwd:
        sum((o * st.distribute_tensor(wt, m, [st.Shard(1)], sharding_shapes=ext)).sum()
            for o, wt in zip(out, wgts)).backward()
    assert set(bwd.calls) <= {"all_reduce"}, bwd.calls
    for (n, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        if pr.grad is not None:
            scale = pr.grad.abs().max().item() + 1e-300
            assert (full(p.grad) - pr.grad).abs().max().item() <= 1e-9 * scale, n
    return True


def test_domino():
    harness.run(3, harness_strict, case_domino)
