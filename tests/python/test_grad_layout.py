"""Gradients accumulated into ShardTensor leaves have exactly the leaf's layout (placements, extents, local shape):
a Partial gradient is reduce-scattered into the shards, a replicated one is sliced locally, and the expansion of
a replicated loss gradient (sum/mean backward) never materialises the global size. Values against one device."""
import math

import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_grad_layout, close, full, mesh, randn, tiny_extents, uneven_extents

# Backward paths whose leaf gradient used to come back Replicate at the global size.
PATHS = {
    "sum": lambda x: x.sum(),
    "mean": lambda x: x.mean(),
    "mean_sharded_dim": lambda x: x.mean(dim=2).square().sum(),
    "sum_keepdim": lambda x: (x.sum(dim=(1, 2), keepdim=True) * 3).sum(),
    "sum_dtype": lambda x: x.sum(dtype=torch.float64),
    "pointwise": lambda x: (x * 2 + 1).mean(),
    "reshape": lambda x: x.reshape(2, 3, -1).sum(),
    "select": lambda x: x[1].sum(),
    "select_sharded_dim": lambda x: x[:, :, 3].sum(),
    "slice": lambda x: x[:, :, 1:6:2].mean(),
    "unbind": lambda x: x.unbind(0)[0].sum(),
    "constant_pad": lambda x: F.pad(x, (1, 2, 2, 1), value=0.5).sum(),
    "scalar_times": lambda x: (x * x.sum().detach()).sum(),
    "softmax": lambda x: (x.softmax(dim=2) * torch.arange(8.0)).sum(),
}


def case_paths(name, kind):
    m = mesh()
    w = m.size()
    ext = {"even": None, "uneven": {0: uneven_extents(8, w, 3)}, "tiny": {0: tiny_extents(8, w)}}[kind]
    full_x = randn(2, 3, 8, 8, seed=1)
    ref = full_x.clone().requires_grad_()
    PATHS[name](ref).backward()
    x = st.distribute_tensor(full_x, m, [st.Shard(2)], sharding_shapes=ext).requires_grad_()
    PATHS[name](x).backward()
    check_grad_layout(x, what=name)
    close(full(x.grad), ref.grad, what=name)
    return True


@pytest.mark.parametrize("world,kind", [(1, "even"), (2, "even"), (2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_leaf_grad_layout(world, kind):
    for name in PATHS:
        harness.run(world, case_paths, name, kind)


def case_issue_example():
    # The reported case: x.sum().backward() on a height-sharded image gave a Replicate (2,3,8,8) gradient.
    m = mesh()
    x = st.distribute_tensor(randn(2, 3, 8, 8), m, [st.Shard(2)]).requires_grad_()
    x.sum().backward()
    assert st.placements(x.grad) == (st.Shard(2),), st.placements(x.grad)
    assert tuple(x.grad.to_local().shape) == (2, 3, 4, 8), x.grad.to_local().shape
    return True


def test_issue_example():
    harness.run(2, case_issue_example)


def case_mean_memory():
    # The backward of a mean must not allocate anything of the global size, nor any shard-sized buffer the single
    # device's backward would not: the loss gradient is divided while it is a scalar, then expanded into the shard as a
    # stride-0 view (no copy). On 4 ranks the backward holds one shard-sized buffer, the input gradient (a quarter of
    # the global size); before, the sliced gradient was copied and divided (two shards), and earlier still the
    # quotient had the global size.
    m = mesh()
    full_x = randn(64, 64, 32, seed=2)
    x = st.distribute_tensor(full_x, m, [st.Shard(0)]).requires_grad_()
    loss = (x * 1.5).mean()
    global_bytes = full_x.numel() * full_x.element_size()
    peak = st.peak_memory(lambda: loss.backward())
    assert peak <= global_bytes * 0.3, f"backward peak {peak} bytes vs global tensor {global_bytes}"
    check_grad_layout(x, "mean memory")
    return peak


def test_mean_backward_memory():
    harness.run(4, case_mean_memory)


def case_partial_grad_reduce_scattered():
    # A pending-sum gradient reaching a sharded leaf is reduce-scattered (an all-to-all, nothing gathered).
    m = mesh()
    w = m.size()
    ext = {0: uneven_extents(7, w, 5)}
    full_w = randn(7, 3, seed=4)
    leaf = st.distribute_tensor(full_w, m, [st.Shard(0)], sharding_shapes=ext).requires_grad_()
    terms = [randn(7, 3, seed=10 + r) for r in range(w)]
    g = st.from_local(terms[st_rank()].clone(), m, [st.Partial()])
    y = leaf * 1.0
    with st.CommCounter() as c:
        y.backward(g)
    check_grad_layout(leaf, "partial grad")
    close(full(leaf.grad), sum(terms), what="partial grad value")
    assert c.calls.get("all_gather", 0) == 0 and c.calls.get("all_reduce", 0) == 0, c.calls
    return True


def st_rank():
    import torch.distributed as dist
    return dist.get_rank()


@pytest.mark.parametrize("world", [2, 3])
def test_partial_grad_reduce_scattered(world):
    harness.run(world, case_partial_grad_reduce_scattered)


def case_accumulate_twice():
    m = mesh()
    full_x = randn(6, 5, seed=6)
    ref = full_x.clone().requires_grad_()
    x = st.distribute_tensor(full_x, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(6, m.size(), 1)})
    x.requires_grad_()
    for fn in (lambda t: t.mean(), lambda t: (t * t).sum(), lambda t: t[2:5].sum()):
        fn(ref).backward()
        fn(x).backward()
        check_grad_layout(x, "accumulated")
    close(full(x.grad), ref.grad, what="accumulated grad")
    return True


def test_accumulate_twice():
    harness.run(3, case_accumulate_twice)


class _PosEmbed(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.pos = torch.nn.Parameter(table)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x + self.pos).relu()


def case_sharded_parameter(mesh_shape):
    # A sharded nn.Parameter (a positional embedding sliced like the tokens) gets a sharded gradient, and an
    # optimizer step matches one device.
    m = mesh(mesh_shape)
    tokens = randn(2, 10, 4, seed=7)
    table = randn(10, 4, seed=8)
    torch.manual_seed(0)
    ref = _PosEmbed(table.clone())
    torch.manual_seed(0)
    mod = _PosEmbed(table.clone())
    placements = [st.Shard(1)] + [st.Replicate()] * (len(mesh_shape) - 1)
    p_place = [st.Shard(0)] + [st.Replicate()] * (len(mesh_shape) - 1)
    ext = {0: uneven_extents(10, mesh_shape[0], 2)}
    mod.pos = torch.nn.Parameter(st.distribute_tensor(table.clone(), m, p_place, sharding_shapes=ext))
    x = st.distribute_tensor(tokens, m, placements, sharding_shapes=ext)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    for _ in range(2):
        opt_ref.zero_grad()
        opt.zero_grad()
        ref(tokens).square().mean().backward()
        mod(x).square().mean().backward()
        check_grad_layout(mod.pos, "pos grad")
        close(full(mod.pos.grad), ref.pos.grad, what="pos grad")
        close(mod.lin.weight.grad, ref.lin.weight.grad, what="weight grad")
        opt_ref.step()
        opt.step()
    close(full(mod.pos), ref.pos.detach(), what="pos after steps")
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_sharded_parameter(mesh_shape):
    world = math.prod(mesh_shape)
    harness.run(world, case_sharded_parameter, mesh_shape)


def case_user_hook_after_forward():
    # A Python hook registered between forward and backward replaces the tensor's hook list; the layout hook
    # lives on the gradient accumulator and still applies (after the user's hook).
    m = mesh()
    x = st.distribute_tensor(randn(4, 6, seed=9), m, [st.Shard(1)]).requires_grad_()
    loss = x.mean()
    seen = []
    x.register_hook(lambda g: seen.append(st.placements(g)) or g * 2)
    loss.backward()
    assert seen, "user hook did not run"
    check_grad_layout(x, "after user hook")
    close(full(x.grad), torch.full((4, 6), 2.0 / 24), what="hooked grad")
    return True


def test_user_hook_after_forward():
    harness.run(2, case_user_hook_after_forward)


def case_two_d_mesh():
    m = mesh((2, 2))
    full_x = randn(5, 3, 6, seed=11)
    ref = full_x.clone().requires_grad_()
    ext = {0: [4, 1], 1: [2, 4]}
    x = st.distribute_tensor(full_x, m, [st.Shard(0), st.Shard(2)], sharding_shapes=ext).requires_grad_()
    for fn in (lambda t: t.mean(), lambda t: t.sum(dim=2).square().sum(), lambda t: t[:, 1].sum()):
        fn(ref).backward()
        fn(x).backward()
        check_grad_layout(x, "2-d mesh")
    close(full(x.grad), ref.grad, what="2-d mesh grad")
    return True


def test_two_d_mesh():
    harness.run(4, case_two_d_mesh)


def case_create_graph():
    # A double backward through sum/mean: d/dx of (d mean(x^3)/dx)^2 summed.
    m = mesh()
    full_x = randn(6, 4, seed=12)
    ref = full_x.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(ref.pow(3).mean(), ref, create_graph=True)
    g_ref.square().sum().backward()
    x = st.distribute_tensor(full_x, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(6, m.size(), 4)})
    x.requires_grad_()
    (g,) = torch.autograd.grad(x.pow(3).mean(), x, create_graph=True)
    close(full(g), g_ref.detach(), what="first grad")
    g.square().sum().backward()
    check_grad_layout(x, "double backward")
    close(full(x.grad), ref.grad, what="double backward grad")
    return True


def test_create_graph():
    harness.run(2, case_create_graph)
