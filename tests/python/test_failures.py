"""When a peer never joins a collective (it died or raised first), the waiting ranks fail within the process
group's timeout with an error naming the collective, the op and its placements; st.init_distributed sets a short
default timeout. Each case uses its own process group with a short timeout, so the shared pools stay usable."""
import datetime
import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import harness
import shardtensor as st
from cases_util import close, mesh, randn, rank

SHORT = datetime.timedelta(seconds=3)


def _short_timeout_mesh():
    group = dist.new_group(list(range(dist.get_world_size())), timeout=SHORT, backend="gloo")
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=("domain",))


def case_peer_skips_collective(kind):
    m = _short_timeout_mesh()
    x = st.distribute_tensor(torch.arange(12.0).view(6, 2), m, [st.Shard(0)])   # local slicing, no collective
    if rank() == 0:
        return None                       # as if rank 0 had raised before reaching the collective
    try:
        if kind == "op":
            # Select along the sharded dim: an all-gather rank 0 never joins. Row 1 is rank 0's, so the others wait
            # for it (over the shared-memory rings a rank waits only for the pieces it receives: selecting a row of
            # its own, it would send its piece and go on).
            x[1]
        elif kind == "item":
            x.sum().item()                # .item() on some ranks only: the sum's all-reduce rank 0 never joins
        else:
            x.full_tensor()
    except Exception as e:                # noqa: BLE001  (the error itself is what is checked)
        return type(e).__name__, str(e)
    return "no error"


def case_pool_still_works():
    x = randn(5, 3, seed=1)
    xs = st.distribute_tensor(x, mesh(), [st.Shard(0)])
    close(xs[2], x[2], what="select after a failed group")
    return True


def test_peer_failure_names_op_and_placements():
    for world in (2, 3):
        results = harness.run(world, case_peer_skips_collective, "op")
        for kind, msg in results[1:]:
            assert kind == "DistBackendError", (kind, msg)
            assert "all_gather collective" in msg and "failed" in msg, msg
            assert "while running aten::" in msg and "Shard(0)" in msg, msg
            assert "init_distributed(timeout=" in msg, msg
        harness.run(world, case_pool_still_works)


def test_item_on_some_ranks_names_item_and_the_line():
    """Issue 30 item 4: `.item()` on one rank only was reported as aten::_local_scalar_dense; the message names
    `.item()`, the Python line that called it, and why the rank waited."""
    results = harness.run(2, case_peer_skips_collective, "item")
    kind, msg = results[1]
    assert kind == "DistBackendError", (kind, msg)
    assert "while running .item()" in msg, msg
    assert "called from " in msg and "test_failures.py" in msg and "in case_peer_skips_collective" in msg, msg
    assert "must make the same call" in msg, msg
    harness.run(2, case_pool_still_works)


def test_peer_failure_in_full_tensor_names_the_call():
    results = harness.run(2, case_peer_skips_collective, "api")
    kind, msg = results[1]
    assert kind == "DistBackendError", (kind, msg)
    assert "while running shardtensor.full_tensor on placements=(Shard(0))" in msg, msg
    harness.run(2, case_pool_still_works)


def test_init_distributed_timeout():
    """A fresh single-rank process (the pools already have a process group): the default is 5 minutes, an explicit
    timeout (seconds or timedelta) is passed to init_process_group."""
    code = textwrap.dedent("""
        import datetime, os, sys, torch, torch.distributed as dist
        import shardtensor as st
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
        arg = None if sys.argv[2] == "none" else float(sys.argv[2])
        assert st.init_distributed(timeout=arg) == (0, 1)
        print(dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    """)
    for arg, expected in (("none", 300.0), ("7", 7.0)):
        out = subprocess.run([sys.executable, "-c", code, str(harness._free_port()), arg], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr
        assert float(out.stdout.strip().splitlines()[-1]) == expected, out.stdout
    assert st.DEFAULT_TIMEOUT == datetime.timedelta(minutes=5)


def test_init_distributed_without_launcher():
    """`python train.py` (no torchrun environment) is a one-process world: the script is its own single-device
    reference, and sharded ops run on a 1-rank mesh."""
    code = textwrap.dedent("""
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        import shardtensor as st
        assert st.init_distributed() == (0, 1)
        assert st.init_distributed() == (0, 1)  # a second call keeps the group
        x = st.distribute_tensor(torch.arange(6.0).reshape(2, 3), init_device_mesh("cpu", (1,)), [st.Shard(0)])
        print((x * 2).sum().item())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                              "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) == 30.0, out.stdout
