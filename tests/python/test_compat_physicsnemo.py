"""shardtensor.compat.physicsnemo (PhysicsNeMo's API by import), Python-function interception (st.register_function)
and the public ring pass (st.ring_pass): every piece against the single-device computation, uneven extents, 1-D and
2-D meshes, and errors raised on every rank. The pools are discarded afterwards: cases register handlers for aten
ops (torch.dot) that must not reach other tests."""
import inspect

import pytest
import torch
import torch.distributed as dist

import harness
import shardtensor as st
from cases_util import close, mesh, randn, rank, shard_of, uneven_extents


@pytest.fixture(scope="module", autouse=True)
def _fresh_pools_afterwards():
    yield
    for world in (1, 2, 3, 4):
        harness.discard(world)


def pn():
    import shardtensor.compat.physicsnemo as pn
    return pn


# ---- DistributedManager ----

def case_manager():
    p = pn()
    p.DistributedManager.initialize()
    dm = p.DistributedManager()
    assert (dm.rank, dm.world_size) == (dist.get_rank(), dist.get_world_size())
    assert dm.local_rank == 0 and dm.device == torch.device("cpu") and dm.distributed and not dm.cuda
    assert p.DistributedManager().rank == dm.rank  # shared state
    w = dm.world_size
    m = dm.initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
    assert tuple(m.mesh.shape) == (w,) and m.mesh_dim_names == ("domain",) and dm.mesh_dims == {"domain": w}
    if w % 2 == 0:
        m2 = dm.initialize_mesh(mesh_shape=(-1, 2), mesh_dim_names=("ddp", "domain"))
        assert tuple(m2.mesh.shape) == (w // 2, 2) and dm.mesh("domain").size() == 2 and dm.global_mesh is m2
        assert dm.group_size("ddp") == w // 2
    errors = []
    for shape, names in (([-1, -1], ["a", "b"]), ([w + 1], ["a"]), ([-1], ["a", "b"]), ([1, -1], ["a", "a"]),
                         ([0], ["a"])):
        try:
            dm.initialize_mesh(mesh_shape=shape, mesh_dim_names=names)
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == 5, errors
    try:
        dm.create_process_subgroup
    except AttributeError as e:
        assert "torch.distributed.new_group" in str(e), e
    else:
        raise AssertionError("no AttributeError")
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_manager(world):
    harness.run(world, case_manager)


# ---- scatter_tensor keywords ----

def case_scatter_keywords(wrong_on):
    p = pn()
    m = mesh()
    x = randn(9, 4, seed=5)
    a = p.scatter_tensor(x if rank() == 0 else None, 0, m, (st.Shard(0),), global_shape=x.shape, dtype=x.dtype)
    close(a.full_tensor(), x, what="scatter with keywords")
    b = p.scatter_tensor(tensor=x, global_src=0, mesh=m, placements=(st.Shard(1),), requires_grad=True)
    assert b.requires_grad and b.is_leaf
    c = p.scatter_tensor(x, 0, m, [st.Shard(0)], sharding_shapes={0: p.compute_split_shapes(9, m.size())})
    assert st.sharding_shapes(c) == {0: p.compute_split_shapes(9, m.size())}
    # A wrong global_shape/dtype on one rank only: every rank raises.
    shape = (9, 5) if rank() == wrong_on else x.shape
    dtype = torch.float64 if rank() == wrong_on else None
    p.scatter_tensor(x, 0, m, (st.Shard(0),), global_shape=shape, dtype=dtype)


def test_scatter_keywords_checked():
    for world, wrong_on in ((2, 1), (3, 0)):
        harness.expect_error(world, case_scatter_keywords, wrong_on, match="do not match the tensor on rank 0",
                             kinds=("ValueError",))


def test_compute_split_shapes():
    p = pn()
    assert p.compute_split_shapes(7, 4) == [2, 2, 2, 1]     # div-up, shorter last
    assert p.compute_split_shapes(6, 4) == [1, 1, 1, 3]     # div-up would leave the last empty: floor
    assert p.compute_split_shapes(8, 4) == [2, 2, 2, 2]
    assert p.compute_split_shapes(5, 1) == [5]
    assert p.compute_split_shapes(0, 3) == [0, 0, 0]
    # Issue 30 item 5: no chunks divided by zero; a negative size gave negative extents.
    with pytest.raises(ValueError, match="num_chunks"):
        p.compute_split_shapes(5, 0)
    with pytest.raises(ValueError, match="num_chunks"):
        p.compute_split_shapes(5, -2)
    with pytest.raises(ValueError, match="size"):
        p.compute_split_shapes(-3, 2)


def test_handlers_must_be_callable():
    """Issue 30 item 5: a non-callable handler is refused when it is registered (it used to fail at the first call,
    inside an op, on whichever rank reached it)."""
    p = pn()

    def knn(x):
        return x

    for register in (lambda h: p.ShardTensor.register_function_handler(knn, h),
                     lambda h: p.ShardTensor.register_function_handler(torch.block_diag, h),
                     lambda h: p.ShardTensor.register_dispatch_handler(torch.ops.aten.block_diag.default, h),
                     lambda h: st.register_function(knn, h),
                     lambda h: st.register_handler(torch.ops.aten.block_diag.default, h)):
        for bad in (None, 3, "handler"):
            with pytest.raises(TypeError, match="callable"):
                register(bad)
    assert knn.__code__.co_name == "knn" and not st._C.has_handler("aten::block_diag")


def case_src_data_rank(value):
    p = pn()
    p.distribute_tensor(torch.zeros(4, 2), mesh(), [st.Shard(0)], src_data_rank=value)


def test_src_data_rank_checked():
    """Issue 30 item 5: src_data_rank=-1 indexed the mesh from its end; out of range or not an int is refused."""
    for value, kind in ((-1, "ValueError"), (2, "ValueError"), (1.0, "TypeError"), (True, "TypeError")):
        harness.expect_error(2, case_src_data_rank, value, match="src_data_rank", kinds=(kind,))


# ---- x._spec, x.offsets() and the PhysicsNeMo names ----

def case_spec_view():
    m = mesh((2, 2), ("a", "b"))
    x = randn(7, 6, 3, seed=7)
    ea, eb = [5, 2], [0, 6]
    xs = shard_of(x, m, [st.Shard(0), st.Shard(1)], {0: ea, 1: eb})
    spec = xs._spec
    ca, cb = m.get_coordinate()
    assert spec.placements == (st.Shard(0), st.Shard(1)) and spec.mesh is m and spec.shape == x.shape
    local = (ea[ca], eb[cb], 3)
    assert spec.local_shape == local and xs.to_local().shape == local
    shapes = spec.sharding_shapes()
    assert shapes == {0: ((5, eb[cb], 3), (2, eb[cb], 3)), 1: ((ea[ca], 0, 3), (ea[ca], 6, 3))}, shapes
    assert spec.sharding_shapes(1) == shapes[1] and spec._sharding_shapes == shapes
    assert spec.offsets() == (sum(ea[:ca]), sum(eb[:cb])) == xs.offsets() and xs.offsets(1) == sum(eb[:cb])
    assert spec == xs.redistribute([st.Shard(0), st.Shard(1)])._spec
    for bad in ("placements", "mesh"):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(spec, bad, None)
    with pytest.raises(AttributeError, match="to_local"):
        xs._local_tensor
    # A Partial/Replicate spec: no sharded dims.
    r = xs.sum(dim=(0, 1))
    assert r._spec.sharding_shapes() == {} and r._spec.offsets() == (0, 0)
    return True


def test_spec_view():
    harness.run(4, case_spec_view)


def test_physicsnemo_names_on_plain_tensors_and_the_package():
    t = torch.zeros(2)
    for name in ("_spec", "offsets", "_local_tensor", "full_tensor", "redistribute", "placements"):
        assert not hasattr(t, name), name
    t._spec = "own"                      # torch's DTensor decompositions set _spec on plain meta tensors
    assert t._spec == "own"
    del t._spec
    assert not hasattr(t, "_spec")
    with pytest.raises(AttributeError, match="compat.physicsnemo.DistributedManager"):
        st.DistributedManager
    with pytest.raises(AttributeError, match="st.register_function"):
        st.ShardTensor.register_function_handler
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        st.nonsense
    assert pn().ShardTensor.patches_enabled() and isinstance(t, pn().ShardTensor) is False


# ---- register_function_handler: torch functions (aten) and Python functions ----

def _dot_handler(func, types, args, kwargs):
    x, y = args
    assert func is torch.dot and not kwargs and pn().ShardTensor in types
    local = func(x.to_local(), y.to_local())
    dist.all_reduce(local, group=x._spec.mesh.get_group())
    return pn().ShardTensor.from_local(local, x._spec.mesh, (st.Replicate(),))


def case_function_handler_aten():
    p = pn()
    p.ShardTensor.register_function_handler(torch.dot, _dot_handler)
    m = mesh()
    a, b = randn(11, seed=1, requires_grad=True), randn(11, seed=2, requires_grad=True)
    ext = {0: uneven_extents(11, m.size(), 3)}
    xa = shard_of(a.detach(), m, [st.Shard(0)], ext).requires_grad_()
    xb = shard_of(b.detach(), m, [st.Shard(0)], ext).requires_grad_()
    d = torch.dot(xa, xb)
    assert st.placements(d) == (st.Replicate(),)
    close(d.full_tensor(), torch.dot(a, b), what="dot")
    # The op's own derivative records the graph (the handler ran below autograd).
    d.backward()
    torch.dot(a, b).backward()
    close(xa.grad.full_tensor(), a.grad, what="grad a")
    close(xb.grad.full_tensor(), b.grad, what="grad b")
    return True


def knn(points, queries, k):
    """Brute-force knn written for PhysicsNeMo (the __torch_function__ guard is a no-op for ShardTensors)."""
    from torch.overrides import handle_torch_function, has_torch_function
    if has_torch_function((points, queries)):
        return handle_torch_function(knn, (points, queries), points, queries, k)
    d = torch.cdist(queries, points)
    return torch.topk(d, k, dim=1, largest=False)


def _knn_gathering_handler(func, types, args, kwargs):
    points, queries, k = args
    assert func is knn and isinstance(points, pn().ShardTensor) and isinstance(queries, pn().ShardTensor)
    vals, idx = func(points.full_tensor(), queries.to_local(), k)   # the body, on plain tensors
    spec = queries._spec
    return (pn().ShardTensor.from_local(vals, spec.mesh, spec.placements, sharding_shapes=spec.sharding_shapes()),
            pn().ShardTensor.from_local(idx, spec.mesh, spec.placements, sharding_shapes=spec.sharding_shapes()))


def case_function_handler_python():
    p = pn()
    calls = []

    def counting(func, types, args, kwargs):
        calls.append(1)
        return _knn_gathering_handler(func, types, args, kwargs)

    p.ShardTensor.register_function_handler(knn, counting)
    m = mesh()
    pts, qs = randn(13, 3, seed=3), randn(6, 3, seed=4)
    ps = shard_of(pts, m, [st.Shard(0)], {0: uneven_extents(13, m.size(), 4)})
    qss = shard_of(qs, m, [st.Shard(0)], {0: uneven_extents(6, m.size(), 5)})
    vals, idx = knn(ps, qss, 3)
    ref_vals, ref_idx = knn(pts, qs, 3)                                  # plain: the body, no handler
    assert len(calls) == 1
    close(vals.full_tensor(), ref_vals, what="knn values")
    assert torch.equal(idx.full_tensor(), ref_idx)
    # A plain tensor next to a ShardTensor arrives promoted to Replicate, as in PhysicsNeMo.
    seen = []
    p.ShardTensor.register_function_handler(knn, lambda f, t, a, k: seen.append(st.placements(a[0])) or
                                            _knn_gathering_handler(f, t, a, k))
    knn(pts, qss, 2)
    assert seen == [(st.Replicate(),)]
    st.unregister_function(knn)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_function_handler_aten(world):
    harness.run(world, case_function_handler_aten)


@pytest.mark.parametrize("world", [2, 3])
def test_function_handler_python(world):
    harness.run(world, case_function_handler_python)


def case_dispatch_handler():
    p = pn()
    m = mesh()

    def double_neg(x):  # aten::neg on a ShardTensor: -2x, built without communication
        local = torch.neg(x.to_local()) * 2
        return st.from_local(local, x._spec.mesh, x._spec.placements, sharding_shapes=st.sharding_shapes(x),
                             check=False)

    p.ShardTensor.register_dispatch_handler(torch.ops.aten.neg.default, double_neg)
    x = randn(5, 2, seed=6)
    xs = shard_of(x, m, [st.Shard(0)], {0: uneven_extents(5, m.size(), 6)})
    close((-xs).full_tensor(), -2 * x, what="registered neg")
    return True


def test_dispatch_handler():
    harness.run(2, case_dispatch_handler)


# ---- distribute_module / distribute_tensor ----

def case_distribute_module():
    p = pn()
    m = mesh()
    torch.manual_seed(100 + rank())                    # different weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    model.register_parameter("pos", torch.nn.Parameter(torch.randn(1, 5, 2)))

    def partition(name, sub, device_mesh):
        if "pos" in sub._parameters:
            sub.register_parameter("pos", torch.nn.Parameter(p.distribute_tensor(sub.pos, device_mesh=device_mesh,
                                                                                  placements=[st.Shard(1)])))

    out = p.distribute_module(model, m, partition_fn=partition)
    assert out is model and st.is_shard_tensor(model.pos) and model.pos.requires_grad
    w = [model[0].weight.detach().clone() for _ in range(dist.get_world_size())]
    dist.all_gather(w, model[0].weight.detach())
    assert all(torch.equal(w[0], t) for t in w), "weights not synced"
    pos = model.pos.full_tensor()
    allp = [torch.empty_like(pos) for _ in range(dist.get_world_size())]
    dist.all_gather(allp, pos)
    assert all(torch.equal(allp[0], t) for t in allp)
    return True


def test_distribute_module():
    harness.run(3, case_distribute_module)


# ---- st.register_function ----

def scale(x, factor=2.0, *, bias=0.0):
    return x * factor + bias


def test_register_function_local():
    """Routing without ranks: plain calls run the body, the signature is kept, unregister restores the code."""
    calls = []
    original = scale.__code__
    st.register_function(scale, lambda *a, **k: calls.append((a, k)))
    try:
        assert str(inspect.signature(scale)) == "(x, factor=2.0, *, bias=0.0)"
        assert torch.equal(scale(torch.ones(2), bias=1.0), torch.full((2,), 3.0)) and not calls

        def outer():
            offset = 5

            def inner(x):
                return x + offset
            return inner

        f = outer()

        @st.function_handler(f)
        def f_sharded(x):
            return "sharded"

        assert torch.equal(f(torch.zeros(1)), torch.full((1,), 5.0))  # a closure keeps working
    finally:
        st.unregister_function(scale)
    assert scale.__code__ is original
    with pytest.raises(TypeError, match="st.register_handler"):
        st.register_function(torch.dot, lambda *a: None)
    with pytest.raises(ValueError, match="no registered handler"):
        st.unregister_function(scale)


def case_register_function():
    m = mesh()
    x = randn(7, 3, seed=8)
    xs = shard_of(x, m, [st.Shard(0)], {0: uneven_extents(7, m.size(), 8)})
    seen = []

    def handler(x, factor=2.0, *, bias=0.0):
        seen.append(factor)
        # Inside the handler scale runs its own body, even on ShardTensors (here: the op-by-op path).
        return scale(x, factor, bias=bias)

    st.register_function(scale, handler)
    try:
        y = scale(xs, 3.0, bias=1.0)
        z = scale([xs][0], factor=4.0)
    finally:
        st.unregister_function(scale)
    assert seen == [3.0, 4.0]
    close(y.full_tensor(), x * 3 + 1, what="routed")
    close(z.full_tensor(), x * 4, what="routed kw")
    return True


def test_register_function():
    harness.run(2, case_register_function)


# ---- ring passes ----

def case_ring_pass(direction):
    p = pn()
    m = mesh()
    w, r = m.size(), rank()
    ext = uneven_extents(10, w, 9)
    full = randn(10, 3, seed=9)
    offs = [sum(ext[:i]) for i in range(w)]
    mine = full[offs[r]:offs[r] + ext[r]].clone().requires_grad_()
    src = (r - 1) % w if direction == "forward" else (r + 1) % w
    got, tag = st.ring_pass([mine, torch.full((2,), float(r))], m, "domain",
                            recv_shapes=[(ext[src], 3), (2,)], direction=direction)
    close(got, full[offs[src]:offs[src] + ext[src]], what="ring block")
    assert torch.equal(tag, torch.full((2,), float(src)))
    # Differentiable: the gradient of what this rank received goes back to its sender.
    (got * (r + 1)).sum().backward()
    dst = (r + 1) % w if direction == "forward" else (r - 1) % w
    close(mine.grad, torch.full_like(mine, float(dst + 1)), what="ring grad")
    # PhysicsNeMo's spelling, a single tensor.
    cfg = p.RingPassingConfig(mesh_dim=0, mesh_size=w, ring_direction=direction, communication_method="p2p")
    one = p.perform_ring_iteration(mine.detach(), m, cfg, recv_shape=torch.Size([ext[src], 3]))
    close(one, full[offs[src]:offs[src] + ext[src]], what="perform_ring_iteration")
    recv, works = p.perform_ring_iteration_async(mine.detach(), m, cfg, recv_shape=(ext[src], 3))
    assert all(wk.wait() for wk in works)
    close(recv, one, what="async")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_ring_pass(world, direction):
    harness.run(world, case_ring_pass, direction)


def case_ring_pass_errors(which):
    p = pn()
    m = mesh()
    x = torch.ones(2)
    if which == "shard":
        st.ring_pass(shard_of(x, m, [st.Replicate()]), m)
    elif which == "shapes":
        st.ring_pass([x, x], m, recv_shapes=[(2,)])
    elif which == "config":
        p.perform_ring_iteration(x, m, p.RingPassingConfig(0, m.size() + 1))
    else:
        p.RingPassingConfig(0, m.size(), ring_direction="sideways")


@pytest.mark.parametrize("which,match", [("shard", "pass its to_local"), ("shapes", "one per tensor"),
                                         ("config", "mesh_size"), ("direction", "Invalid ring direction")])
def test_ring_pass_errors(which, match):
    harness.expect_error(2, case_ring_pass_errors, which, match=match, kinds=("ValueError",))


def case_ring_pass_shapes_disagree(which):
    """Issue 30 item 1: receive shapes a sender does not send (one rank aborted in Gloo), uneven shards with the
    default receive shapes (a partly filled tensor), per-rank argument problems: all raise on every rank, before any
    data moves."""
    p = pn()
    m = mesh()
    w, r = m.size(), rank()
    if which == "recv_shape":           # rank 0 expects 3 rows, its sender sends 2
        st.ring_pass(torch.ones(2, 4), m, recv_shapes=[(3, 4) if r == 0 else (2, 4)])
    elif which == "recv_shape_compat":  # the PhysicsNeMo helper, a recv_shape too small on rank 1
        cfg = p.RingPassingConfig(mesh_dim=0, mesh_size=w)
        p.perform_ring_iteration(torch.ones(3, 2), m, cfg, recv_shape=(2, 2) if r == 1 else (3, 2))
    elif which == "count":              # rank 1 gives a receive shape for one tensor of two
        x = torch.ones(2)
        st.ring_pass([x, x], m, recv_shapes=[(2,)] if r == 1 else [(2,), (2,)])
    elif which == "tensors":            # rank 0 passes two tensors, the others one
        st.ring_pass([torch.ones(2)] * (2 if r == 0 else 1), m)
    elif which == "dtype":
        st.ring_pass(torch.ones(2, dtype=torch.float64 if r == 0 else torch.float32), m)
    elif which == "direction":
        st.ring_pass(torch.ones(2), m, direction="backward" if r == 0 else "forward")


@pytest.mark.parametrize("which,match", [("recv_shape", "sends"), ("recv_shape_compat", "sends"),
                                         ("count", "receive shapes"), ("tensors", "number of tensors"),
                                         ("dtype", "dtypes"), ("direction", "direction")])
def test_ring_pass_disagreement_raises_everywhere(which, match):
    for world in (2, 3):
        errors = harness.expect_error(world, case_ring_pass_shapes_disagree, which, match=match, kinds=("ValueError",))
        assert len({msg for _, msg, _ in errors.values()}) == 1, errors   # the same message on every rank
    harness.run(3, case_ring_pass, "forward")                         # the pool still communicates


def case_ring_pass_default_shapes_uneven(direction):
    """Uneven shards and no recv_shapes: each rank receives its sender's whole block (the shapes come from the
    sender), forward and backward, and the PhysicsNeMo helper does the same."""
    p = pn()
    m = mesh()
    w, r = m.size(), rank()
    ext = [1 + 2 * i for i in range(w)]
    full = randn(sum(ext), 3, seed=5)
    offs = [sum(ext[:i]) for i in range(w)]
    mine = full[offs[r]:offs[r] + ext[r]].clone().requires_grad_()
    src = (r - 1) % w if direction == "forward" else (r + 1) % w
    got = st.ring_pass(mine, m, direction=direction)
    close(got, full[offs[src]:offs[src] + ext[src]], what="default receive shape")
    (got * (r + 1)).sum().backward()
    dst = (r + 1) % w if direction == "forward" else (r - 1) % w
    close(mine.grad, torch.full_like(mine, float(dst + 1)), what="ring grad")
    cfg = p.RingPassingConfig(mesh_dim=0, mesh_size=w, ring_direction=direction)
    close(p.perform_ring_iteration(mine.detach(), m, cfg), full[offs[src]:offs[src] + ext[src]],
          what="perform_ring_iteration default shape")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_ring_pass_default_shapes_uneven(world, direction):
    harness.run(world, case_ring_pass_default_shapes_uneven, direction)


# ---- the Extending examples of docs/python-api.md ----

@torch.library.custom_op("st_doc::sum_of_squares", mutates_args=())
def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum()


@sum_of_squares.register_fake
def _(x):
    return x.new_empty(())


def sum_of_squares_sharded(x):
    pl = st.placements(x)
    if any(p.is_partial() for p in pl):
        raise NotImplementedError(f"st_doc::sum_of_squares: refused for {pl}: redistribute to Replicate first")
    local = sum_of_squares(st.to_local(x))
    out = [st.Partial("sum") if p.is_shard() else st.Replicate() for p in pl]
    return st.from_local(local, st.device_mesh(x), out, sharding_shapes={}, check=False)


@torch.library.custom_op("st_doc::weighted_diff", mutates_args=())
def weighted_diff(a: torch.Tensor, b: torch.Tensor, w: float) -> torch.Tensor:
    return a - w * b


@weighted_diff.register_fake
def _(a, b, w):
    return torch.empty_like(a)


def weighted_diff_sharded(a, b, w):
    if not (st.is_shard_tensor(a) and st.is_shard_tensor(b)) or a.shape != b.shape:
        raise NotImplementedError("st_doc::weighted_diff: both inputs must be ShardTensors of one shape")
    if st.placements(a) != st.placements(b):
        raise NotImplementedError(f"st_doc::weighted_diff: placements differ ({st.placements(a)} vs "
                                  f"{st.placements(b)}); redistribute one input first")
    if st.sharding_shapes(a) != st.sharding_shapes(b):
        b = st.redistribute(b, st.placements(a), st.sharding_shapes(a))
    local = weighted_diff(st.to_local(a), st.to_local(b), w)
    return st.from_local(local, st.device_mesh(a), st.placements(a), sharding_shapes=st.sharding_shapes(a),
                         check=False)


def case_extending_examples():
    st.register_handler("st_doc::sum_of_squares", sum_of_squares_sharded)
    st.register_handler("st_doc::weighted_diff", weighted_diff_sharded)
    m = mesh((2, 2), ("a", "b"))
    x = randn(6, 5, seed=11)
    xs = shard_of(x, m, [st.Shard(0), st.Replicate()], {0: [4, 2]})
    with st.CommCounter() as c:
        s = sum_of_squares(xs)
    assert c.total_calls == 0 and st.placements(s) == (st.Partial("sum"), st.Replicate())
    close(s.full_tensor(), (x * x).sum(), what="sum of squares")
    y = randn(6, 5, seed=12)
    ys = shard_of(y, m, [st.Shard(0), st.Replicate()], {0: [1, 5]})     # other extents: redistributed
    d = weighted_diff(xs, ys, 0.5)
    assert st.sharding_shapes(d) == st.sharding_shapes(xs)
    close(d.full_tensor(), x - 0.5 * y, what="weighted diff")
    other = shard_of(y, m, [st.Shard(1), st.Replicate()])
    try:
        weighted_diff(xs, other, 0.5)
    except NotImplementedError as e:
        assert "placements differ" in str(e)
    else:
        raise AssertionError("no refusal")
    return True


def test_extending_examples():
    harness.run(4, case_extending_examples)
