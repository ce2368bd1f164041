"""The public API: from_local (infer/even/explicit), scatter/distribute/full_tensor/to_local, every
redistribute transition on 1-D and 2-D meshes with uneven and zero-extent shards, their gradients, metadata
accessors, repr without communication, pickling, and errors raised on every rank."""
import pickle

import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn, rank, uneven_extents


def case_from_local_modes():
    m = mesh()
    w, r = m.size(), rank()
    ext = uneven_extents(11, w, 5)
    x = randn(11, 3, seed=1)
    off = sum(ext[:r])
    local = x[off:off + ext[r]].clone()
    a = st.from_local(local, m, [st.Shard(0)])                        # infer
    b = st.from_local(local, m, [st.Shard(0)], sharding_shapes={0: ext})
    assert a.shape == b.shape == x.shape and st.sharding_shapes(a) == {0: ext}
    close(a.full_tensor(), x, what="infer")
    close(b.full_tensor(), x, what="explicit")
    even = torch.tensor_split(x, w)[r].clone()
    c = st.from_local(even, m, [st.Shard(0)], sharding_shapes="even", global_shape=x.shape)
    close(c.full_tensor(), x, what="even")
    assert st.local_offsets(a)[0] == off
    # Differentiable: gradient of from_local is this rank's slice.
    leaf = local.clone().requires_grad_(True)
    y = st.from_local(leaf, m, [st.Shard(0)], sharding_shapes={0: ext})
    (y * 2).sum().backward()
    close(leaf.grad, torch.full_like(local, 2.0), what="from_local grad")
    return True


def case_scatter_distribute(src):
    m = mesh()
    x = randn(9, 4, seed=3)
    ext = uneven_extents(9, m.size(), 2)
    s = st.scatter_tensor(x if rank() == src else None, src, m, [st.Shard(0)], sharding_shapes={0: ext})
    assert st.sharding_shapes(s) == {0: ext}
    close(s.full_tensor(), x, what="scatter")
    r = st.scatter_tensor(x if rank() == src else None, src, m, [st.Replicate()])
    close(st.to_local(r), x, what="scatter replicate")
    d = st.distribute_tensor(x, m, [st.Shard(1)])
    close(d.full_tensor(), x, what="distribute")
    return True


TRANSITIONS_1D = [
    ([st.Shard(0)], [st.Replicate()]),
    ([st.Shard(0)], [st.Shard(1)]),
    ([st.Shard(1)], [st.Shard(0)]),
    ([st.Replicate()], [st.Shard(1)]),
    ([st.Shard(0)], [st.Shard(0)]),   # new extents
]


def case_redistribute_1d():
    m = mesh()
    w = m.size()
    x = randn(7, 5, seed=4)
    for i, (src, dst) in enumerate(TRANSITIONS_1D):
        src_ext = {0: uneven_extents(x.shape[src[0].dim], w, i)} if isinstance(src[0], st.Shard) else None
        dst_ext = {0: uneven_extents(x.shape[dst[0].dim], w, i + 10)} if isinstance(dst[0], st.Shard) else None
        leaf = st.distribute_tensor(x, m, src, src_ext).requires_grad_(True)
        y = st.redistribute(leaf, dst, dst_ext)
        assert st.placements(y) == tuple(dst)
        if dst_ext:
            assert st.sharding_shapes(y) == dst_ext
        close(y.full_tensor(), x, what=f"{src}->{dst}")
        wgt = randn(7, 5, seed=8)
        (y * wgt).sum().backward()
        assert st.placements(leaf.grad) == tuple(src), f"grad placements {st.placements(leaf.grad)}"
        close(leaf.grad.full_tensor(), wgt, what=f"grad {src}->{dst}")
    return True


def case_partial():
    m = mesh()
    w = m.size()
    x = randn(6, 4, seed=6)
    s = st.distribute_tensor(x, m, [st.Shard(0)], {0: uneven_extents(6, w, 1)})
    total = s.sum(0)                                   # Partial(sum)
    assert st.placements(total) == (st.Partial("sum"),)
    close(total.full_tensor(), x.sum(0), what="partial->replicate")
    rs = total.redistribute([st.Shard(0)])             # reduce-scatter
    assert st.placements(rs) == (st.Shard(0),)
    close(rs.full_tensor(), x.sum(0), what="partial->shard")
    mx = s.amax(0)
    assert st.placements(mx) == (st.Partial("max"),)
    close(mx.full_tensor(), x.amax(0), what="partial max")
    assert abs(s.sum().item() - x.sum().item()) < 1e-4
    # Complete operands of a pending sum (scalars included) must be added once, not once per rank.
    close((total + 0.5).full_tensor(), x.sum(0) + 0.5, what="partial + scalar")
    close((1.5 - total).full_tensor(), 1.5 - x.sum(0), what="scalar - partial")
    close((total + torch.ones(4)).full_tensor(), x.sum(0) + 1, what="partial + plain")
    t2 = s.sum(0)
    t2.add_(2.0)
    close(t2.full_tensor(), x.sum(0) + 2, what="partial += scalar")
    close((total * 2.0).full_tensor(), x.sum(0) * 2, what="partial * scalar")
    return True


def case_redistribute_2d():
    m = mesh((2, 2), ("a", "b"))
    x = randn(5, 6, 3, seed=7)
    combos = [
        ([st.Shard(0), st.Shard(1)], [st.Replicate(), st.Replicate()]),
        ([st.Shard(0), st.Shard(1)], [st.Shard(1), st.Shard(0)]),
        ([st.Shard(0), st.Replicate()], [st.Replicate(), st.Shard(2)]),
        ([st.Replicate(), st.Shard(1)], [st.Shard(2), st.Shard(0)]),
    ]
    for i, (src, dst) in enumerate(combos):
        ext = {k: uneven_extents(x.shape[p.dim], 2, i + k) for k, p in enumerate(src) if isinstance(p, st.Shard)}
        leaf = st.distribute_tensor(x, m, src, ext).requires_grad_(True)
        y = leaf.redistribute(dst)
        assert y.placements == tuple(dst)
        close(y.full_tensor(), x, what=f"{src}->{dst}")
        wgt = randn(*x.shape, seed=11)
        (y * wgt).sum().backward()
        assert leaf.grad.placements == tuple(src)
        close(leaf.grad.full_tensor(), wgt, what=f"2-D grad {src}->{dst}")
    # A lone Replicate() stands for every mesh dim (PhysicsNeMo's Transolver writes the 1-D-mesh idiom); a lone
    # Shard is ambiguous and still refused.
    s = st.distribute_tensor(x, m, [st.Shard(0), st.Shard(1)])
    r = s.redistribute(placements=[st.Replicate()])
    assert r.placements == (st.Replicate(), st.Replicate())
    close(r.full_tensor(), x, what="lone Replicate")
    from torch.distributed.tensor import Replicate as TorchReplicate
    assert s.redistribute(placements=[TorchReplicate()]).placements == (st.Replicate(), st.Replicate())
    with pytest.raises(ValueError, match="one per mesh dim"):
        s.redistribute(placements=[st.Shard(0)])
    # Partial on one mesh dim, Shard on the other.
    p = s.sum(0)
    assert p.placements == (st.Partial("sum"), st.Shard(0))
    close(p.full_tensor(), x.sum(0), what="2-D partial")
    return True


def case_full_tensor_grad():
    m = mesh()
    x = randn(8, 2, seed=9)
    leaf = st.distribute_tensor(x, m, [st.Shard(0)], {0: uneven_extents(8, m.size(), 3)}).requires_grad_(True)
    f = leaf.full_tensor()
    assert not st.is_shard_tensor(f)
    (f * 3).sum().backward()
    close(leaf.grad.full_tensor(), torch.full_like(x, 3.0), what="full_tensor grad")
    leaf.grad = None
    loc = leaf.to_local()
    (loc * 4).sum().backward()
    close(leaf.grad.full_tensor(), torch.full_like(x, 4.0), what="to_local grad")
    return True


def case_metadata_repr_pickle():
    m = mesh()
    x = st.distribute_tensor(randn(5, 3, seed=1), m, [st.Shard(0)])
    assert st.is_shard_tensor(x) and not st.is_shard_tensor(torch.zeros(1))
    assert x.placements == (st.Shard(0),) and x.device_mesh is m
    text = repr(x)  # must not communicate: each rank calls it a different number of times
    for _ in range(rank()):
        repr(x)
    assert "Shard(0)" in text and "global_shape=[5, 3]" in text
    try:
        pickle.dumps(x)
        raise AssertionError("pickling a ShardTensor must raise")
    except TypeError as e:
        assert "full_tensor" in str(e)
    for fn in (lambda: torch.zeros(2).full_tensor(), lambda: torch.zeros(2).placements, lambda: st.to_local(torch.zeros(2))):
        try:
            fn()
            raise AssertionError("plain tensors must raise TypeError")
        except TypeError:
            pass
    return True


def bad_placement_count():
    st.distribute_tensor(torch.zeros(4), mesh(), [st.Shard(0), st.Shard(0)])


def bad_extents():
    st.distribute_tensor(torch.zeros(4, 2), mesh(), [st.Shard(0)], sharding_shapes={0: [1] * mesh().size()})


def bad_from_local_shapes():
    # Unsharded dims disagree across ranks: every rank sees every shape, so every rank raises.
    st.from_local(torch.zeros(2, 3 + rank()), mesh(), [st.Shard(0)])


def bad_shard_dim():
    st.distribute_tensor(torch.zeros(4), mesh(), [st.Shard(3)])


def bad_mixed_meshes():
    a = st.distribute_tensor(torch.zeros(4, 4), mesh(), [st.Shard(0)])
    b = st.distribute_tensor(torch.zeros(4, 4), mesh((2, 2), ("a", "b")), [st.Shard(0), st.Replicate()])
    a + b


def unsupported_op():
    x = st.distribute_tensor(torch.randn(7, 4), mesh(), [st.Shard(0)])
    with st.use_strict():   # else the mode rule's refusal runs the gather-compute fallback (test_fallback.py)
        torch.mode(x[:, 0])   # the mode of a 1-D input along its split dim: no dim to take the split


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_from_local_modes(world):
    harness.run(world, case_from_local_modes)


@pytest.mark.parametrize("world,src", [(2, 1), (3, 0), (4, 2)])
def test_scatter_distribute(world, src):
    harness.run(world, case_scatter_distribute, src)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_redistribute_1d(world):
    harness.run(world, case_redistribute_1d)


@pytest.mark.parametrize("world", [2, 3])
def test_partial(world):
    harness.run(world, case_partial)


def test_redistribute_2d():
    harness.run(4, case_redistribute_2d)


@pytest.mark.parametrize("world", [2, 3])
def test_full_tensor_grad(world):
    harness.run(world, case_full_tensor_grad)


def test_metadata_repr_pickle():
    harness.run(2, case_metadata_repr_pickle)


@pytest.mark.parametrize("fn,match", [
    (bad_placement_count, "placements"),
    (bad_extents, "add up"),
    (bad_from_local_shapes, "unsharded dim"),
    (bad_shard_dim, "out of range"),
    (unsupported_op, "was refused by its domain-parallel rule"),
])
def test_errors_raise_on_every_rank(fn, match):
    harness.expect_error(2, fn, match=match)


def test_mixed_meshes_raise():
    harness.expect_error(4, bad_mixed_meshes, match="different meshes")


def test_peak_memory_cpu():
    """st.peak_memory on the CPU (the C++ allocator tracker): exact for known allocations, relative to the start,
    frees counted, and nothing left installed afterwards."""
    def f():
        a = torch.empty(1024, 1024)   # 4 MiB
        b = torch.empty(512, 1024)    # 2 MiB  (6 MiB peak)
        del a
        c = torch.empty(256, 1024)    # 1 MiB  (3 MiB live)
        return b, c
    assert st.peak_memory(f) == 6 * 2**20
    x = torch.ones(256, 1024)
    assert 2**20 <= st.peak_memory(lambda: x.add(1)) < 2**20 + 1024  # the result (+ the wrapped scalar)
    with st._C.CpuMemoryTracker() as t:
        y = torch.empty(128, 1024)
        del y
    assert t.peak_bytes == 2**19 and t.current_bytes == 0
    with st._C.CpuMemoryTracker() as t:
        del x  # allocated before tracking: c10 reports frees only of what it saw allocated while tracking
    assert t.peak_bytes == 0 and t.current_bytes == 0


def test_one_registration_path():
    """Every rule is in the registry, including those that run above autograd (issue 12); a registered handler
    (below autograd) cannot replace one of those, since it would run without their backward."""
    names = set(st._C.registered_handlers())
    above = {"aten::linear", "aten::matmul", "aten::scaled_dot_product_attention", "aten::batch_norm",
             "aten::_pad_circular", "aten::max_pool1d", "aten::index_select_backward",
             "aten::value_selecting_reduction_backward", "shardtensor::knn", "shardtensor::radius_search",
             "shardtensor::neighborhood_attention"}
    above |= {f"aten::upsample_{m}.vec" for m in ("nearest1d", "nearest2d", "bilinear2d", "bicubic2d", "trilinear3d")}
    assert above <= names, f"not listed: {sorted(above - names)}"
    assert {"aten::add.Tensor", "aten::convolution", "aten::sum.dim_IntList"} <= names
    with pytest.raises(NotImplementedError, match="above autograd"):
        st.register_handler("aten::linear", lambda x, w, b=None: x)


def case_c10d_collectives_refuse_shard_tensors():
    """A ShardTensor handed to a torch.distributed collective (a model's own data-parallel all_reduce) raises a
    ValueError naming the remedy on every rank, before any communication; plain tensors pass through unchanged."""
    import torch.distributed as dist
    m = mesh()
    w = m.size()
    xs = st.distribute_tensor(randn(5, 3, seed=1), m, [st.Shard(0)], {0: uneven_extents(5, w, 2)})
    calls = {
        "all_reduce of a pending sum": lambda: dist.all_reduce(xs.sum(0)),
        "broadcast": lambda: dist.broadcast(xs, 0),
        "all_gather into a list": lambda: dist.all_gather([torch.empty(5, 3) for _ in range(w)], xs),
        "all_gather into a list of ShardTensors": lambda: dist.all_gather([xs] * w, torch.zeros(5, 3)),
        "all_reduce by keyword": lambda: dist.all_reduce(tensor=xs),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match="full_tensor"):
            call()
    t = torch.full((2,), float(rank() + 1))
    dist.all_reduce(t)
    assert t.tolist() == [w * (w + 1) / 2] * 2
    return True


def test_c10d_collectives_refuse_shard_tensors():
    harness.run(2, case_c10d_collectives_refuse_shard_tensors)
