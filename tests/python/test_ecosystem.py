"""Habits users bring from DTensor and PhysicsNeMo: torch's placement types (equal both ways, one hash, accepted
everywhere), DTensor's redistribute signature and device_mesh= keywords, PhysicsNeMo's sharding_shapes format,
hasattr on plain tensors, isinstance(x, st.ShardTensor), and conversion to and from DTensor."""
import pickle

import pytest
import torch
import torch.distributed.tensor as tdt

import harness
import shardtensor as st
from cases_util import close, mesh, randn, rank, uneven_extents


def test_placements_are_torchs():
    """Both directions of ==, one hash (dict/set keys), isinstance of torch's types, our repr, pickling."""
    pairs = [(st.Shard(2), tdt.Shard(2)), (st.Replicate(), tdt.Replicate()), (st.Partial(), tdt.Partial()),
             (st.Partial("max"), tdt.Partial("max")), (st.Partial(reduce_op="avg"), tdt.Partial("avg")),
             (st.Partial(op="min"), tdt.Partial(reduce_op="min"))]
    for ours, theirs in pairs:
        assert ours == theirs and theirs == ours and not (ours != theirs), (ours, theirs)
        assert hash(ours) == hash(theirs)
        assert {theirs: 1}[ours] == 1 and {ours: 1}[theirs] == 1 and theirs in {ours} and ours in {theirs}
        assert isinstance(ours, type(theirs))
        again = pickle.loads(pickle.dumps(ours))
        assert again == ours and type(again) is type(ours)
    assert st.Shard(2) != tdt.Shard(1) and st.Partial("sum") != tdt.Partial("max") and st.Shard(0) != st.Replicate()
    assert [repr(p) for p in (st.Shard(2), st.Replicate(), st.Partial("avg"))] == ["Shard(2)", "Replicate()", "Partial(avg)"]
    assert str(st.Shard(1)) == "Shard(1)" and st.Partial("max").op == st.Partial("max").reduce_op == "max"
    assert st.Shard(1).is_shard(1) and st.Replicate().is_replicate() and st.Partial().is_partial()
    with pytest.raises(ValueError, match="unknown reduce op"):
        st.Partial("product")
    with pytest.raises(ValueError, match="disagree"):
        st.Partial("max", reduce_op="min")


def test_plain_tensors_hasattr_and_isinstance():
    """hasattr must not raise and is False on plain tensors (DTensor duck typing: `hasattr(t, "full_tensor")`); the
    attributes raise a TypeError that is also an AttributeError."""
    t = torch.randn(2)
    for name in ("placements", "device_mesh", "sharding_shapes", "full_tensor", "to_local", "redistribute"):
        assert not hasattr(t, name)
        assert getattr(t, name, "default") == "default"
        with pytest.raises(TypeError, match="expected a ShardTensor"):
            getattr(t, name)
    assert not isinstance(t, st.ShardTensor) and not isinstance(3, st.ShardTensor)
    with pytest.raises(TypeError, match="not a constructor"):
        st.ShardTensor()


def case_torch_placements_and_keywords():
    m = mesh()
    w, r = m.size(), rank()
    x = randn(9, 4, seed=2)
    ext = uneven_extents(9, w, 3)
    # torch's placements accepted by every entry point; x.placements equal to torch's
    a = st.distribute_tensor(x, device_mesh=m, placements=[tdt.Shard(0)], sharding_shapes={0: ext})
    assert isinstance(a, st.ShardTensor) and a.placements == (tdt.Shard(0),) and hasattr(a, "placements")
    assert {a.placements[0]: "sharded"}[tdt.Shard(0)] == "sharded"
    off = sum(ext[:r])
    b = st.from_local(x[off:off + ext[r]].clone(), device_mesh=m, placements=(tdt.Shard(0),), shape=x.shape)
    close(b.full_tensor(), x, what="from_local device_mesh=/shape=")
    c = st.scatter_tensor(x if r == 0 else None, global_src=0, device_mesh=m, placements=[tdt.Shard(1)])
    close(c.full_tensor(), x, what="scatter_tensor global_src=/device_mesh=")
    # PhysicsNeMo's ShardTensor.from_local and its sharding_shapes format (full local shapes per rank)
    shapes = {0: [(e, 4) for e in ext]}
    d = st.ShardTensor.from_local(x[off:off + ext[r]].clone(), m, [st.Shard(0)], sharding_shapes=shapes)
    assert st.sharding_shapes(d) == {0: ext}
    # redistribute: ours, DTensor's positional (mesh, placements) and keywords
    for y in (a.redistribute([tdt.Replicate()]), a.redistribute(m, [tdt.Replicate()]),
              a.redistribute(device_mesh=m, placements=[st.Replicate()]), st.redistribute(a, [st.Replicate()]),
              st.redistribute(a, m, (tdt.Replicate(),)), a.redistribute(placements=[tdt.Replicate()], async_op=True)):
        assert y.placements == (st.Replicate(),)
        close(y.to_local(), x, what="redistribute spellings")
    e = a.redistribute([st.Shard(0)], {0: list(reversed(ext))})
    assert st.sharding_shapes(e) == {0: list(reversed(ext))}
    # differentiable through the DTensor spelling
    leaf = a.detach().requires_grad_(True)
    (leaf.redistribute(m, [tdt.Replicate()]).to_local() * 3).sum().backward()
    close(leaf.grad.full_tensor(), torch.full_like(x, 3.0), what="redistribute(mesh, placements) grad")
    return True


def case_bad_redistribute_args():
    m = mesh()
    a = st.distribute_tensor(torch.zeros(4, 2), m, [st.Shard(0)])
    a.redistribute(m, [st.Replicate()], device_mesh=m)


def case_redistribute_needs_placements():
    st.distribute_tensor(torch.zeros(4, 2), mesh(), [st.Shard(0)]).redistribute(mesh())


def case_redistribute_other_mesh():
    a = st.distribute_tensor(torch.zeros(4, 4), mesh(), [st.Shard(0)])
    a.redistribute(mesh((2, 2), ("a", "b")), [st.Replicate(), st.Replicate()])


def case_unsupported_torch_placement():
    st.distribute_tensor(torch.zeros(4, 2), mesh(), [tdt.placement_types._StridedShard(0, split_factor=2)])


def case_dtensor_roundtrip():
    """to_dtensor redistributes uneven extents to torch.chunk's; from_dtensor wraps without communication; both
    differentiable; DTensor ops then run on the result."""
    m = mesh()
    w = m.size()
    x = randn(6, 5, seed=4)
    ext = uneven_extents(6, w, 1)
    a = st.distribute_tensor(x, m, [st.Shard(0)], sharding_shapes={0: ext}).requires_grad_(True)
    d = st.to_dtensor(a)
    assert isinstance(d, tdt.DTensor) and d.placements == (tdt.Shard(0),)
    close(d.full_tensor(), x, what="to_dtensor")
    b = st.from_dtensor(d * 2)
    assert st.sharding_shapes(b) == {0: [len(c) for c in torch.chunk(torch.arange(6), w)] + [0] * (w - len(torch.chunk(torch.arange(6), w)))}
    close(b.full_tensor(), x * 2, what="from_dtensor")
    (b * randn(6, 5, seed=5)).sum().backward()
    close(a.grad.full_tensor(), 2 * randn(6, 5, seed=5), what="to/from DTensor grad")
    p = st.from_dtensor(tdt.distribute_tensor(x, m, [tdt.Replicate()]))
    assert p.placements == (st.Replicate(),)
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_placements_and_keywords(world):
    harness.run(world, case_torch_placements_and_keywords)


@pytest.mark.parametrize("fn,match,world", [
    (case_bad_redistribute_args, "both positionally and as device_mesh", 2),
    (case_redistribute_needs_placements, "placements are required", 2),
    (case_redistribute_other_mesh, "another mesh", 4),
    (case_unsupported_torch_placement, "not a supported placement", 2),
])
def test_bad_spellings_raise_on_every_rank(fn, match, world):
    harness.expect_error(world, fn, match=match)


@pytest.mark.parametrize("world", [1, 4])
def test_dtensor_roundtrip(world):
    harness.run(world, case_dtensor_roundtrip)


# ---- data x domain: the recipe of docs/python-api.md ----

class SmallNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.nn.functional.gelu(self.conv(x)).movedim(1, -1))


def case_data_x_domain(wrapper):
    """2 x 2 mesh: each data group trains on its own sample, sharded over its domain ranks; DDP (or FSDP2) on the
    data axis averages the groups' gradients. Parameter gradients equal the single-device average over the two
    samples, and one optimizer step leaves identical weights on all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "domain"))
    samples = [randn(1, 2, 7, 5, seed=20 + i) for i in range(2)]
    dp = m.get_local_rank("data")
    torch.manual_seed(dist.get_rank())          # different initial weights: the recipe must synchronise them
    net = SmallNet()
    st.sync_module(net, m)                      # the whole 2-D mesh (FSDP2 does not broadcast)
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net, process_group=m.get_group("data"))
    else:
        from torch.distributed.fsdp import fully_shard
        model = fully_shard(net, mesh=m["data"])
    ref = SmallNet()
    ref.load_state_dict({k: (v.full_tensor() if isinstance(v, tdt.DTensor) else v)
                         for k, v in net.state_dict().items()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = st.distribute_tensor(samples[dp], m["domain"], [st.Shard(2)], {0: [2, 5]})
    loss = model(x).square().mean()
    loss.backward()
    for s in samples:
        (ref(s).square().mean() / 2).backward()
    for (name, p), pr in zip(net.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, tdt.DTensor) else p.grad
        close(g, pr.grad, rtol=1e-5, atol=1e-6, what=f"{wrapper} grad {name}")
    opt.step()
    weights = torch.cat([(p.full_tensor() if isinstance(p, tdt.DTensor) else p).detach().reshape(-1)
                         for p in net.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    for w in gathered[1:]:
        close(w, gathered[0], what="weights after the step")
    return True


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_x_domain(wrapper):
    harness.run(4, case_data_x_domain, wrapper)
