"""Neighbour exchanges through shared-memory rings between the ranks of one host (comm/shm_transport.h).

Halo exchanges and ring passes of CPU tensors use the rings once a group has them (a conv training step equal to one
device, with messages counted through the rings); a send the ring cannot take at once is written later by the ring's
helper (tests/cpp/test_shm_transport.cpp, where ranks are threads and the order is forced); a message larger than a ring goes through the process group, interleaved
with ring messages on the same pair; a rank that turns the transport off turns it off for the whole group (and the
results stay right); a receive whose sender never sends raises within the group's timeout. Each case that changes
the setting makes a process group of its own (a group's transport is fixed when its first exchange sets it up)."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import harness
import shardtensor as st
from cases_util import close, mesh, randn, rank, uneven_extents


def _own_mesh(timeout=None):
    kwargs = {"timeout": timeout} if timeout is not None else {}
    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo", **kwargs)
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=("domain",))


def case_conv_step_through_rings():
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3, padding=1))
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3, padding=1))
    ref.load_state_dict(conv.state_dict())
    x_full = randn(1, 3, 13, 7, seed=1, requires_grad=True)
    m = mesh()
    x = st.distribute_tensor(x_full.detach(), m, [st.Shard(2)], {0: uneven_extents(13, dist.get_world_size(), 2)})
    x.requires_grad_(True)
    st.sync_module(conv, m)
    before = st._C.shm_stats()
    y = conv(x)
    y.square().sum().backward()
    after = st._C.shm_stats()
    ref(x_full).square().sum().backward()
    close(y.full_tensor(), ref(x_full), what="forward")
    close(x.grad.full_tensor(), x_full.grad, what="input gradient")
    for (name, p), (_, q) in zip(conv.named_parameters(), ref.named_parameters()):
        close(p.grad, q.grad, what=f"{name}.grad")
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("world", [2, 3])
def test_conv_step_through_rings(world):
    for r, d in enumerate(harness.run(world, case_conv_step_through_rings)):
        # Forward: 2 exchanges, backward: 2 halo-gradient returns; a rank with two neighbours sends to both.
        neighbours = 1 if r in (0, world - 1) else 2
        assert d["sent"] >= 4 * neighbours and d["received"] >= 4 * neighbours, (r, d)


def case_all_reduce_through_rings():
    n, r = dist.get_world_size(), rank()
    m = mesh()
    out = {}
    for op, dtype, numel in [("sum", torch.float32, 1000), ("max", torch.float32, 77), ("min", torch.float64, 5),
                             ("sum", torch.int64, 9)]:
        terms = [(torch.randn(numel, generator=torch.Generator().manual_seed(10 + c)) * 100).to(dtype)
                 for c in range(n)]
        # Coordinate order, left to right: what every rank computes, bit for bit.
        expected = terms[0].clone()
        for t in terms[1:]:
            expected = expected + t if op == "sum" else torch.maximum(expected, t) if op == "max" else torch.minimum(expected, t)
        partial = st.from_local(terms[r], m, [st.Partial(op)])  # its agreement check is an all-reduce of its own
        before = st._C.shm_stats()
        got = partial.redistribute(m, [st.Replicate()]).to_local()
        after = st._C.shm_stats()
        assert torch.equal(got, expected), (op, dtype, (got - expected).abs().max())
        out[f"{op}-{dtype}"] = after["sent"] - before["sent"]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_through_rings(world):
    for d in harness.run(world, case_all_reduce_through_rings):
        assert set(d.values()) == {world - 1}, d  # this rank's term to each other rank


def _sent_through_rings(cap, seed, cases, collective):
    """For each (dtype, shape, sharding_shapes) of `cases`, a seeded tensor of that dtype distributed on a group of its
    own with rings of `cap` bytes; `collective(x, mesh)` must give back the full tensor. Returns, per case, the
    messages this rank sent through rings during the collective."""
    previous = st.set_shm_capacity(cap)  # read when the group's first exchange sets up its rings
    try:
        m = _own_mesh()
        out = {}
        for dtype, shape, extents in cases:
            full = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 50).to(dtype)
            x = st.distribute_tensor(full, m, [st.Shard(0)], extents)
            before = st._C.shm_stats()
            y = collective(x, m)
            after = st._C.shm_stats()
            assert torch.equal(y, full), (dtype, shape)
            out[f"{dtype}-{tuple(shape)}"] = after["sent"] - before["sent"]
    finally:
        st.set_shm_capacity(previous)
    return out


def case_all_to_all_through_rings(cap):
    """Re-layouts (a flat all-to-all) of several dtypes, uneven; with 64 KiB rings the large one's pieces (200 x 100
    floats, 80 KB, an even split) are larger than a ring and go through the process group's send/recv."""
    n = dist.get_world_size()
    cases = [(dtype, shape, {0: uneven_extents(shape[0], n, 3)})
             for dtype, shape in [(torch.float32, (13, 6)), (torch.complex64, (7, 5)), (torch.int16, (9, 4))]]
    cases.append((torch.float32, (600, 300), None))
    return _sent_through_rings(cap, 5, cases, lambda x, m: x.redistribute(m, [st.Shard(1)]).full_tensor())


def case_all_gather_through_rings(cap):
    """full_tensor (an all-gather of exact, uneven pieces, no padding over the rings) of several dtypes; with 64 KiB
    rings the large one's pieces (30 x 400 float64, 96 KB, an even split) go through the process group's send/recv."""
    n = dist.get_world_size()
    cases = [(dtype, shape, {0: uneven_extents(shape[0], n, 4)})
             for dtype, shape in [(torch.float32, (11, 3)), (torch.complex128, (5, 2)), (torch.int16, (8, 5))]]
    cases.append((torch.float64, (90, 400), None))
    return _sent_through_rings(cap, 6, cases, lambda x, m: x.full_tensor())


def _check_ring_messages(results, too_large):
    """Summed over ranks, the `too_large` case sent nothing through rings (every piece went through the process
    group's send/recv) and every other case sent something (a rank without rows sends nothing, hence the sum)."""
    for key in results[0]:
        total = sum(d[key] for d in results)
        assert total == 0 if key == too_large else total > 0, (key, results)


def test_all_gather_through_rings():
    _check_ring_messages(harness.run(3, case_all_gather_through_rings, 64 * 1024), "torch.float64-(90, 400)")


def test_all_to_all_through_rings():
    _check_ring_messages(harness.run(3, case_all_to_all_through_rings, 64 * 1024), "torch.float32-(600, 300)")


def case_oversized_between_ring_messages(cap):
    r, n = rank(), dist.get_world_size()
    # Messages of 16 KiB and one of 100 KiB, larger than a 64 KiB ring: that one goes through the process group.
    sizes = [4096] * 3 + [25600] + [4096] * 4
    mine = [torch.full((k,), float(100 * r + i)) for i, k in enumerate(sizes)]
    previous = st.set_shm_capacity(cap)  # read when the group's first exchange sets up its rings
    try:
        m = _own_mesh()
        before = st._C.shm_stats()
        got = st.ring_pass(mine, m, 0)
        after = st._C.shm_stats()
    finally:
        st.set_shm_capacity(previous)
    src = (r - 1) % n
    for i, (t, k) in enumerate(zip(got, sizes)):
        assert t.shape == (k,) and bool((t == 100 * src + i).all()), (i, t[:3])
    back = st.ring_pass([t * 2 for t in got], m, 0, direction="backward")
    for i, t in enumerate(back):
        assert bool((t == 2 * (100 * r + i)).all()), i
    return {k: after[k] - before[k] for k in after}


def test_oversized_message_between_ring_messages():
    for d in harness.run(2, case_oversized_between_ring_messages, 64 * 1024):
        assert d["groups"] == 1, d
        # 8 messages each way, the 100 KiB one not in a ring. (Sends the ring could not take at once are written by
        # its helper, maybe after this rank's pass returned: `sent` may still lag; `received` may not.)
        assert d["received"] == 7 and d["sent"] <= 7 <= d["sent"] + d["deferred"], d


def case_off_on_one_rank():
    previous = st.set_shm_capacity(0 if rank() == 1 else 1 << 20)
    try:
        m = _own_mesh()
        before = st._C.shm_stats()
        got = st.ring_pass(torch.full((8,), float(rank())), m, 0)
        after = st._C.shm_stats()
    finally:
        st.set_shm_capacity(previous)
    assert bool((got == (rank() - 1) % dist.get_world_size()).all()), got
    return {k: after[k] - before[k] for k in after}


def test_off_on_one_rank_turns_it_off_for_the_group():
    for d in harness.run(3, case_off_on_one_rank):
        assert d["sent"] == d["deferred"] == d["received"] == d["groups"] == 0, d


def case_sender_never_sends():
    m = _own_mesh(timeout=datetime.timedelta(seconds=2))
    conv = torch.nn.Conv1d(2, 2, 3, padding=1)
    st.sync_module(conv, m)
    x = st.distribute_tensor(randn(1, 2, 8, seed=2), m, [st.Shard(2)])
    conv(x)  # sets up the group's rings (both ranks)
    if rank() == 0:
        return None  # as if rank 0 had raised before its next exchange
    start = time.monotonic()
    try:
        conv(x)
    except Exception as e:  # noqa: BLE001  (the error itself is what is checked)
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error"


def test_receive_without_sender_times_out():
    kind, msg, waited = harness.run(2, case_sender_never_sends)[1]
    assert kind == "DistBackendError", (kind, msg)
    assert "halo collective" in msg and "shared-memory receive from rank 0" in msg and "timed out" in msg, msg
    assert waited < 30, waited
