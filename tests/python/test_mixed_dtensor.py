"""DTensors mixed with ShardTensors in one op raise our NotImplementedError naming the way out (st.from_dtensor /
st.to_dtensor) on every rank, before DTensor's dispatch sees the ShardTensor as a plain tensor (its "mixed
torch.Tensor and DTensor" error, or a 0-d Partial ShardTensor silently taken as replicated). Under
torch.inference_mode the autograd keys are skipped and DTensor's own error remains."""
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import harness
import shardtensor as st
from cases_util import mesh, randn


def case_mixed(which):
    m = mesh()
    x = randn(4, 3, seed=1)
    xs = st.distribute_tensor(x, m, [st.Shard(0)])
    dt = distribute_tensor(x, m, [Shard(0)])
    dr = distribute_tensor(x, m, [Replicate()])
    if which == "dtensor + shardtensor":
        dt + xs
    elif which == "shardtensor + dtensor":
        xs + dt
    elif which == "torch.add":
        torch.add(xs, dt)
    elif which == "partial scalar":
        dr * xs.sum()                     # DTensor would take the pending sum's local term as replicated
    elif which == "cat":
        torch.cat([xs, dt])
    elif which == "no_grad":
        with torch.no_grad():
            xs * dt
    elif which == "dtensor parameter":
        lin = torch.nn.Linear(3, 2)
        lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), m, [Replicate()]))
        lin(xs)


@pytest.mark.parametrize("which", ["dtensor + shardtensor", "shardtensor + dtensor", "torch.add", "partial scalar",
                                   "cat", "no_grad", "dtensor parameter"])
def test_mixed_dtensor_raises(which):
    errors = harness.expect_error(2, case_mixed, which, match="shardtensor.from_dtensor(dt)",
                                  kinds=("NotImplementedError",))
    for _, msg, _ in errors.values():
        assert "got a DTensor" in msg and "mixed torch.Tensor" not in msg, msg


def case_converted_works():
    m = mesh()
    x = randn(4, 3, seed=2)
    xs = st.distribute_tensor(x, m, [st.Shard(0)])
    dt = distribute_tensor(x, m, [Shard(0)])
    y = xs + st.from_dtensor(dt)
    z = st.to_dtensor(xs) + dt
    assert torch.allclose(y.full_tensor(), 2 * x) and torch.allclose(z.full_tensor(), 2 * x)
    return True


def test_converted_works():
    harness.run(2, case_converted_works)
