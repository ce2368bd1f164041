"""The halo planner seen from the ops: plans are built once per layout and window (the backward builds none, a
second training step none at all), and a pending-sum (Partial) input is completed once, in the forward, even
though the convolution's backward reads it again. The planner's partition rules themselves are swept without
ranks in tests/cpp/test_halo_plan.cpp."""
import math

import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn, uneven_extents
from shardtensor.ops import neighborhood_attention2d

TOL = dict(rtol=1e-4, atol=1e-5)


def _partial_input(x, m, seed):
    """A leaf Partial(sum) ShardTensor whose pending sum is ``x``: unequal terms on the coordinates of mesh dim 0;
    on a 2-D mesh also sharded along dim 2 by mesh dim 1 (uneven)."""
    n0 = m.size(0)
    weights = torch.arange(1, n0 + 1, dtype=torch.float64)
    weights = (weights / weights.sum()).tolist()
    c0 = m.get_coordinate()[0]
    term = x * weights[c0]
    if m.ndim == 1:
        return st.from_local(term, m, [st.Partial()]).detach().requires_grad_()
    ext = uneven_extents(x.shape[2], m.size(1), seed)
    c1 = m.get_coordinate()[1]
    local = term.narrow(2, sum(ext[:c1]), ext[c1])
    return st.from_local(local, m, [st.Partial(), st.Shard(2)], sharding_shapes={1: ext}).detach().requires_grad_()


def _counts(counter, kind):
    return counter.calls.get(kind, 0)


def case_conv_partial_input_resolved_once(mesh_shape, seed):
    m = mesh(mesh_shape)
    spatial = m.ndim == 2
    x = randn(2, 3, 9, 7, seed=seed)
    w = randn(4, 3, 3, 3, seed=seed + 1)
    b = randn(4, seed=seed + 2)
    xs = _partial_input(x, m, seed)
    ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
    with st.CommCounter() as fwd:
        y = F.conv2d(xs, ws, bs, padding=1)
    # The pending sum is completed by one all-reduce; a spatial shard adds the halo exchange.
    assert _counts(fwd, "all_reduce") == 1, fwd.calls
    assert _counts(fwd, "halo") == (1 if spatial else 0), fwd.calls
    g = torch.ones_like(y)
    with st.CommCounter() as bwd:
        torch.autograd.backward(y, g)
    # The backward reads the completed input again (the weight gradient) without a second all-reduce: what is left
    # is the fused weight/bias gradient sum over the spatial shards, and one exchange of the border outputs'
    # gradient rows (the neighbours add their terms: no input halo, no returned halo gradient).
    assert _counts(bwd, "all_reduce") == (1 if spatial else 0), bwd.calls
    assert _counts(bwd, "halo") == (1 if spatial else 0), bwd.calls
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    yr = F.conv2d(xr, wr, br, padding=1)
    torch.autograd.backward(yr, torch.ones_like(yr))
    close(full(y), yr, **TOL, what="output")
    close(full(xs.grad), xr.grad, **TOL, what="input gradient (of every term)")
    close(full(ws.grad), wr.grad, **TOL, what="weight gradient")
    close(full(bs.grad), br.grad, **TOL, what="bias gradient")

    # A pending sum used by two convolutions is completed once.
    xs2 = _partial_input(x, m, seed)
    with st.CommCounter() as two:
        z = F.conv2d(xs2, ws, padding=1) + F.conv2d(xs2, w.flip(0), padding=1)
    assert _counts(two, "all_reduce") == 1, two.calls
    zr = F.conv2d(x, w, padding=1) + F.conv2d(x, w.flip(0), padding=1)
    close(full(z), zr, **TOL, what="two convolutions of one pending sum")

    # Modified in place after a convolution: the kept value is stale and not used.
    p = xs2 * 1.0
    F.conv2d(p, ws, padding=1)
    with torch.no_grad():
        p.mul_(2.0)
    with st.CommCounter() as again:
        y2 = F.conv2d(p, w, padding=1)
    assert _counts(again, "all_reduce") == 1, again.calls
    close(full(y2), F.conv2d(2 * x, w, padding=1), **TOL, what="after an in-place change")
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_conv_partial_input_resolved_once(mesh_shape):
    world = math.prod(mesh_shape)
    harness.run(world, case_conv_partial_input_resolved_once, mesh_shape, world)


def _ops():
    """(name, function of the sharded input, input shape, sharded dim): every op family on the planner."""
    cw, tw = randn(3, 2, 3, 3, seed=1), randn(2, 3, 3, 3, seed=2)
    return [
        ("conv2d", lambda x: F.conv2d(x, cw, padding=1, stride=(2, 1)), (1, 2, 11, 6), 2),
        ("conv_transpose2d", lambda x: F.conv_transpose2d(x, tw, stride=2, padding=1), (1, 2, 7, 5), 2),
        ("max_pool2d", lambda x: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True), (1, 2, 11, 6), 2),
        ("avg_pool2d", lambda x: F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False), (1, 2, 11, 6), 2),
        ("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (4, 3)), (1, 2, 11, 6), 2),
        ("adaptive_max_pool2d", lambda x: F.adaptive_max_pool2d(x, (4, 3)), (1, 2, 11, 6), 2),
        ("pad reflect", lambda x: F.pad(x, (1, 2, 3, 1), mode="reflect"), (1, 2, 11, 6), 2),
        ("pad replicate", lambda x: F.pad(x, (1, 2, 3, 1), mode="replicate"), (1, 2, 11, 6), 2),
        ("pad circular", lambda x: F.pad(x, (1, 2, 3, 1), mode="circular"), (1, 2, 11, 6), 2),
        ("interpolate bilinear", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (1, 2, 11, 6), 2),
        ("interpolate nearest", lambda x: F.interpolate(x, size=(17, 4), mode="nearest"), (1, 2, 11, 6), 2),
        ("neighborhood attention", lambda x: neighborhood_attention2d(x, x * 0.5, x, (3, 3)), (1, 9, 6, 2, 4), 1),
    ]


def case_backward_builds_no_plan(seed):
    m = mesh()
    for name, fn, shape, dim in _ops():
        x = randn(*shape, seed=seed)
        ext = {0: uneven_extents(shape[dim], m.size(), seed)}
        xs = st.distribute_tensor(x, m, [st.Shard(dim)], sharding_shapes=ext).requires_grad_()
        for step in range(2):
            st._C._reset_halo_plan_stats()
            y = fn(xs)
            built = st._C._halo_plan_stats()["misses"]
            assert built >= (1 if step == 0 else 0), (name, built)
            torch.autograd.backward(y, torch.ones_like(y))
            after = st._C._halo_plan_stats()["misses"]
            assert after == built, f"{name}: the backward built {after - built} plan(s)"
            if step == 1:
                assert built == 0, f"{name}: the second step built {built} plan(s)"
        xr = x.clone().requires_grad_()
        yr = fn(xr)
        torch.autograd.backward(yr, torch.ones_like(yr))
        close(full(y), yr, **TOL, what=name)
        close(full(xs.grad), 2 * xr.grad, **TOL, what=f"{name} input gradient (two steps)")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_backward_builds_no_plan(world):
    harness.run(world, case_backward_builds_no_plan, world)


def _halo_step(world, rank):
    """One training step of a stack of halo ops as rank ``rank`` of ``world`` (simulated, fake tensors): what the
    rank's communication counter saw."""
    with st.simulate(rank, world, device="meta", warn=False) as sim:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.Conv2d(3, 2, 5, padding=2), torch.nn.AvgPool2d(3, stride=1, padding=1),
                                  # the window-free transposed convolution and the fused interpolation main call
                                  torch.nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1),
                                  torch.nn.Upsample(scale_factor=0.5, mode="bilinear"),
                                  torch.nn.Upsample(scale_factor=2.0, mode="bilinear"))
        x = sim.shard((1, 2, 4 * world, 6), [st.Shard(2)], requires_grad=True)
        with st.CommCounter() as c:
            y = F.pad(net(x), (1, 1, 1, 1), mode="replicate")
            y.square().mean().backward()
    return c


def test_halo_messages_per_rank_are_constant_in_the_rank_count():
    """Halo rows travel between neighbours only: the messages a rank sends per training step do not grow with the
    number of ranks (a group-wide all-to-all would send one to every other rank), for the first, a middle and the
    last rank, P = 2 ... 64 (simulated)."""
    seen = {}
    for world in (2, 3, 4, 8, 16, 32, 64):
        for where, rank in (("first", 0), ("middle", world // 2), ("last", world - 1)):
            c = _halo_step(world, rank)
            assert "all_to_all" not in c.calls, (world, rank, c.calls)
            calls, messages = c.calls.get("halo", 0), c.messages.get("halo", 0)
            assert calls > 0 and messages <= 2 * calls, (world, rank, c.calls, c.messages)
            if world >= 3:  # a middle rank has two neighbours from P = 3 on
                seen.setdefault(where, set()).add((calls, messages))
    for where, counts in seen.items():
        assert len(counts) == 1, f"{where} rank: halo (calls, messages) per step vary with P: {sorted(counts)}"
    (_, first), = seen["first"]
    (_, middle), = seen["middle"]
    assert middle == 2 * first, (first, middle)  # an edge rank talks to one neighbour, a middle one to two
