"""The communication accounting of comm/comm_timing.h (issue 28 items 3 and 6): per kind of collective, the time a
step's threads are blocked on it (exposed) and the same collectives replayed alone.

A conv + group norm + linear training step on an input sharded over H (2 and 3 ranks, uneven extents; a 2 x 2 mesh)
with the accounting on: every collective the library counts (st.CommCounter) is recorded once under its kind (the
forward's halo, the backward's halo-gradient return, the gradient bucket, the blocking all-reduces), waits are
counted and timed, the replay reissues every recorded collective on every rank without hanging and reports a time
for each kind, and the step's gradients still equal one device's. Off, nothing is recorded. Times are not asserted
(benchmarks measure them; benchmarks/overlap/).
"""
import torch
import torch.distributed as dist

import harness
import shardtensor as st
from cases_util import close, mesh, randn, uneven_extents

N, C, H, W = 1, 3, 11, 6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.c1 = torch.nn.Conv2d(C, 4, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 4)
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = self.c2(torch.relu(self.gn(self.c1(x))))
        return self.head(y.permute(0, 2, 3, 1))


def _step(net, x):
    net.zero_grad(set_to_none=True)
    net(x).square().mean().backward()


def case_accounting(two_d):
    x_full = randn(N, C, H, W, seed=1)
    if two_d:
        x = st.distribute_tensor(x_full, mesh((2, 2)), [st.Shard(2), st.Shard(3)], {0: [6, 5], 1: [4, 2]})
    else:
        x = st.distribute_tensor(x_full, mesh(), [st.Shard(2)], {0: uneven_extents(H, dist.get_world_size(), 1)})
    net, ref = Net(), Net()
    st.sync_module(net, x.device_mesh)
    _step(ref, x_full)
    _step(net, x)  # warm-up: plans cached outside the accounting
    st._C.set_comm_timing(False)
    _step(net, x)
    assert st._C.comm_timing_stats() == {}, "accounting off: nothing recorded"
    try:
        st._C.set_comm_timing(True)
        with st.CommCounter() as counted:
            _step(net, x)
        stats = st._C.comm_timing_stats()
        alone = st._C.replay_recorded_collectives(2)
        assert st._C.comm_timing_stats() == stats, "the replay leaves the accounting as it was"
    finally:
        st._C.set_comm_timing(False)
    for (name, p), (_, r) in zip(net.named_parameters(), ref.named_parameters()):
        close(p.grad, r.grad, rtol=1e-5, atol=1e-6, what=name)
    # Every counted collective is recorded once (a ring pass records one per tensor; none here).
    issued = sum(v["issued"] for v in stats.values())
    assert issued == counted.total_calls, (stats, counted.calls)
    kinds = set(stats)
    assert "halo" in kinds and "halo [backward]" in kinds, kinds
    assert "all_reduce (gradient bucket) [backward]" in kinds, kinds
    for kind, v in stats.items():
        assert v["exposed_s"] >= 0 and v["waits"] >= 0
        if v["issued"]:
            assert kind in alone and alone[kind] > 0, (kind, alone)
    # Each exchange and all-reduce is waited at least once; exposed time accrues where waits happen.
    assert stats["halo"]["waits"] >= stats["halo"]["issued"] > 0
    assert stats["all_reduce (gradient bucket) [backward]"]["waits"] >= 1
    # Per collective, in issue order: kind, posting time, the waits (none before the posting).
    return True


def case_records():
    """Every recorded collective carries its posting time and each wait tied to it, every wait after the posting."""
    x = st.distribute_tensor(randn(N, C, H, W, seed=1), mesh(), [st.Shard(2)],
                             {0: uneven_extents(H, dist.get_world_size(), 1)})
    net = Net()
    st.sync_module(net, x.device_mesh)
    _step(net, x)
    try:
        st._C.set_comm_timing(True)
        _step(net, x)
        stats = st._C.comm_timing_stats()
        records = st._C.comm_timing_records()
    finally:
        st._C.set_comm_timing(False)
    assert len(records) == sum(v["issued"] for v in stats.values())
    for kind in stats:
        assert sum(1 for r in records if r[0] == kind) == stats[kind]["issued"]
    assert sum(len(r[2]) for r in records) == sum(v["waits"] for v in stats.values())
    for kind, posted, waits in records:
        assert waits, f"{kind}: never waited"
        for start, end in waits:
            assert posted <= start <= end, (kind, posted, start, end)
    assert st._C.comm_timing_records() == [], "off: cleared"
    return True


def test_accounting_one_d():
    harness.run(2, case_accounting, False)
    harness.run(3, case_accounting, False)


def test_accounting_two_d():
    harness.run(4, case_accounting, True)


def test_records():
    harness.run(2, case_records)
