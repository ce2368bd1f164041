"""Elementwise ops against the single-device computation: broadcasting with plain tensors and scalars,
uneven and zero-extent shards, mismatched shards, in-place and out= forms, gradients of inputs and plain
parameters, 1-D and 2-D meshes."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, uneven_extents


def case_binary_broadcast(seed):
    m = mesh()
    w = m.size()
    x = randn(6, 5, 4, seed=seed)
    b = randn(4, seed=seed + 1)      # plain, broadcast over the sharded dims
    c = randn(5, 1, seed=seed + 2)   # plain, broadcast along the last dim
    ext = {0: uneven_extents(6, w, seed)}
    lay = ([st.Shard(0)], ext)
    check_op(lambda x, b: x * b + 2.5, [x, b], [lay, None], m, what="x*b+2")
    check_op(lambda x, c: x - c, [x, c], [([st.Shard(1)], {0: uneven_extents(5, w, seed)}), None], m, what="x-c")
    check_op(lambda x, y: torch.maximum(x, y), [x, randn(6, 5, 4, seed=9)], [lay, lay], m, what="maximum")
    check_op(lambda x: torch.where(x > 0, x, 0.1 * x), [x], [lay], m, what="where")
    check_op(lambda x: x.masked_fill(x < -0.5, 3.0), [x], [lay], m, what="masked_fill")
    check_op(lambda x: x.clamp(-0.3, 0.4), [x], [lay], m, what="clamp")
    check_op(lambda x: (x > 0.1) & (x < 0.9), [x], [lay], m, grad=False, what="comparisons")
    check_op(lambda x: x.pow(2).sqrt().exp().log1p(), [x], [lay], m, what="unary chain")
    check_op(lambda x, y: torch.addcmul(x, x, y, value=0.5), [x, randn(6, 5, 4, seed=3)], [lay, None], m, what="addcmul")
    return True


def case_mismatched_shards(seed):
    m = mesh()
    w = m.size()
    x, y = randn(7, 3, seed=seed), randn(7, 3, seed=seed + 1)
    # Same dim, different extents: the second operand is re-split to match.
    check_op(torch.add, [x, y], [([st.Shard(0)], {0: uneven_extents(7, w, 1)}),
                                 ([st.Shard(0)], {0: uneven_extents(7, w, 2)})], m, what="re-split")
    # Different dims sharded: all-to-all.
    check_op(torch.mul, [x, y], [[st.Shard(0)], [st.Shard(1)]], m, what="shard(0)*shard(1)")
    # Sharded with replicated.
    check_op(torch.sub, [x, y], [[st.Replicate()], [st.Shard(0)]], m, what="replicate-shard")
    return True


def case_activations(seed):
    m = mesh()
    x = randn(5, 8, seed=seed)
    lay = ([st.Shard(0)], {0: uneven_extents(5, m.size(), seed)})
    for name, fn in [("relu", F.relu), ("gelu", F.gelu), ("silu", F.silu), ("tanh", torch.tanh),
                     ("sigmoid", torch.sigmoid), ("leaky_relu", lambda t: F.leaky_relu(t, 0.2)),
                     ("elu", F.elu), ("softplus", F.softplus), ("hardtanh", F.hardtanh), ("mish", F.mish),
                     ("hardswish", F.hardswish)]:
        check_op(fn, [x], [lay], m, what=name)
    return True


def case_inplace_and_out(seed):
    m = mesh()
    x = randn(6, 4, seed=seed)
    y = randn(6, 4, seed=seed + 1)
    ext = {0: uneven_extents(6, m.size(), seed)}
    xs = st.distribute_tensor(x, m, [st.Shard(0)], ext)
    ys = st.distribute_tensor(y, m, [st.Shard(0)])  # default split: re-split to xs's extents in place
    xs.add_(ys, alpha=2).mul_(0.5)
    xs.relu_()
    close(xs.full_tensor(), ((x + 2 * y) * 0.5).relu(), what="in-place chain")
    assert st.sharding_shapes(xs) == ext, "in-place ops must keep the layout"
    out = st.distribute_tensor(torch.empty(6, 4), m, [st.Shard(0)], ext)
    torch.add(xs, 1.0, out=out)
    close(out.full_tensor(), ((x + 2 * y) * 0.5).relu() + 1, what="out=")
    # A plain tensor updated from a ShardTensor receives the full value.
    p = torch.zeros(6, 4)
    p.add_(ys)
    close(p, y, what="plain.add_(shard)")
    xs.zero_()
    assert full(xs).abs().sum() == 0
    return True


def case_param_grad_once(seed):
    """A plain parameter used with a sharded input gets exactly the single-device gradient."""
    m = mesh()
    x = randn(9, 4, seed=seed)
    wt = randn(4, seed=seed + 1, requires_grad=True)
    wt_ref = wt.detach().clone().requires_grad_(True)
    xs = st.distribute_tensor(x, m, [st.Shard(0)], {0: uneven_extents(9, m.size(), seed)})
    ((xs * wt).square().sum() + (xs + wt).mean()).backward()
    ((x * wt_ref).square().sum() + (x + wt_ref).mean()).backward()
    assert not st.is_shard_tensor(wt.grad)
    close(wt.grad, wt_ref.grad, what="plain param grad")
    return True


def case_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(5, 6, 3, seed=seed)
    y = randn(6, 3, seed=seed + 1)
    lay = ([st.Shard(0), st.Shard(1)], {0: uneven_extents(5, 2, seed), 1: uneven_extents(6, 2, seed + 1)})
    check_op(lambda x, y: (x * y).tanh() + x, [x, y], [lay, None], m, what="2-D mesh")
    check_op(lambda x, y: x / (y.abs() + 1), [x, y], [lay, ([st.Replicate(), st.Shard(0)], None)], m, what="2-D mixed")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_binary_broadcast(world):
    harness.run(world, case_binary_broadcast, world)


@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_shards(world):
    harness.run(world, case_mismatched_shards, world)


@pytest.mark.parametrize("world", [2, 4])
def test_activations(world):
    harness.run(world, case_activations, world)


@pytest.mark.parametrize("world", [1, 3])
def test_inplace_and_out(world):
    harness.run(world, case_inplace_and_out, world)


@pytest.mark.parametrize("world", [2, 4])
def test_param_grad_once(world):
    harness.run(world, case_param_grad_once, world)


def test_2d_mesh():
    harness.run(4, case_2d_mesh, 3)
