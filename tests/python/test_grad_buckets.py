"""Parameter-gradient reductions in buckets, overlapped with the backward (dispatch/grad_buckets.h; issue 28 item 3).

A small conv + group norm + layer norm + linear model (plus a parameter reached only through generic ops) runs on an
input sharded over H (1-D mesh, uneven extents, 1-3 ranks) or over H and W (2 x 2 mesh); every parameter gradient
is compared with the same model's on one device, with bucketing off (0), one bucket per parameter (1 byte: every
all-reduce in flight while the backward goes on) and the default. Also: gradient accumulation over two backward
calls, retain_graph, torch.autograd.grad (nothing deferred, no .grad), a parameter shared by two layers, parameters
without a gradient on a step, activation checkpointing (reentrant: a backward inside the backward; non-reentrant), tensor and post-accumulate hooks (which see the complete gradient), create_graph, and
a backward that raises on every rank (its deferred reductions are dropped, the next step is exact).
"""
import pytest
import torch
import torch.distributed as dist

import harness
import shardtensor as st
from cases_util import close, mesh, randn, uneven_extents

N, C_IN, H, W = 2, 3, 9, 5


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)   # the same weights on every rank and in the reference
        self.c1 = torch.nn.Conv2d(C_IN, 6, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 6)
        self.c2 = torch.nn.Conv2d(6, 6, 3, padding=1)
        self.ln = torch.nn.LayerNorm(6)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6))   # generic ops only (mul, then the sum)
        self.head = torch.nn.Linear(6, 4)
        self.other = torch.nn.Linear(6, 4)   # used only when asked: no gradient otherwise

    def forward(self, x, twice=False, other=False, checkpoint=None):
        if checkpoint is None:
            y = torch.relu(self.gn(self.c1(x)))
        else:   # the first block recomputed in the backward (reentrant: a backward of its own inside ours)
            from torch.utils.checkpoint import checkpoint as ckpt
            y = ckpt(lambda t: torch.relu(self.gn(self.c1(t))), x, use_reentrant=checkpoint == "reentrant")
        y = self.c2(y)
        if twice:
            y = self.c2(torch.relu(y))
        t = self.ln(y.permute(0, 2, 3, 1)) * self.scale
        return (self.other if other else self.head)(t)


def _input(seed):
    return randn(N, C_IN, H, W, seed=seed)


def _shard(x, two_d):
    w = dist.get_world_size()
    if two_d:
        m = mesh((2, 2))
        return st.distribute_tensor(x, m, [st.Shard(2), st.Shard(3)], {0: [5, 4], 1: [3, 2]})
    return st.distribute_tensor(x, mesh(), [st.Shard(2)], {0: uneven_extents(H, w, 2)})


def _compare(net, ref, what):
    for (name, p), (_, r) in zip(net.named_parameters(), ref.named_parameters()):
        if r.grad is None:
            assert p.grad is None, f"{what}: {name} got a gradient the reference has not"
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient"
        assert not st.is_shard_tensor(p.grad)
        close(p.grad, r.grad, rtol=1e-5, atol=1e-6, what=f"{what} {name}")


def case_step(two_d, bucket_bytes, variant):
    previous = st.set_grad_bucket_bytes(bucket_bytes)
    try:
        _run_variant(two_d, bucket_bytes, variant)
    finally:
        st.set_grad_bucket_bytes(previous)
        st.wait_grad_reductions()
    return True


def _run_variant(two_d, bucket_bytes, variant):
    net, ref = Net(), Net()
    x0, x1 = _input(1), _input(2)
    st._C.reset_grad_reduction_stats()
    sharded = lambda x: _shard(x, two_d)   # noqa: E731
    loss = lambda model, x, **kw: model(x, **kw).square().mean()   # noqa: E731
    if variant == "plain":
        loss(net, sharded(x0)).backward()
        loss(ref, x0).backward()
    elif variant == "accumulate":
        for x in (x0, x1):
            loss(net, sharded(x)).backward()
            loss(ref, x).backward()
    elif variant == "retain":
        lo = loss(net, sharded(x0))
        lo.backward(retain_graph=True)
        lo.backward()
        lr = loss(ref, x0)
        lr.backward(retain_graph=True)
        lr.backward()
    elif variant == "shared":
        loss(net, sharded(x0), twice=True).backward()
        loss(ref, x0, twice=True).backward()
    elif variant == "unused":
        # Step 1: `other` gets nothing; step 2: `head` gets nothing and keeps step 1's gradient.
        loss(net, sharded(x0)).backward()
        loss(ref, x0).backward()
        _compare(net, ref, "unused, step 1")
        assert net.other.weight.grad is None
        loss(net, sharded(x1), other=True).backward()
        loss(ref, x1, other=True).backward()
    elif variant in ("reentrant", "non_reentrant"):
        x = sharded(x0).requires_grad_()   # the reentrant checkpoint needs an input that requires grad
        loss(net, x, checkpoint=variant).backward()
        loss(ref, x0.clone().requires_grad_()).backward()
    elif variant == "autograd_grad":
        params = list(net.parameters())[:-2]   # `other` is not part of the graph
        grads = torch.autograd.grad(loss(net, sharded(x0)), params)
        rgrads = torch.autograd.grad(loss(ref, x0), list(ref.parameters())[:-2])
        for g, r in zip(grads, rgrads):
            close(g, r, rtol=1e-5, atol=1e-6, what="autograd.grad")
        assert all(p.grad is None for p in net.parameters())
        assert st._C.grad_reduction_stats()["deferred"] == 0
        return
    elif variant == "hooks":
        # A tensor hook doubles c2's gradient; a post-accumulate hook on c1's weight sees its complete .grad.
        seen = {}
        net.c2.weight.register_hook(lambda g: 2 * g)
        ref.c2.weight.register_hook(lambda g: 2 * g)
        net.c1.weight.register_post_accumulate_grad_hook(lambda p: seen.update(c1=p.grad.clone()))
        loss(net, sharded(x0)).backward()
        loss(ref, x0).backward()
        close(seen["c1"], ref.c1.weight.grad, rtol=1e-5, atol=1e-6, what="post-accumulate hook")
    elif variant == "create_graph":
        loss(net, sharded(x0)).backward(create_graph=True)
        loss(ref, x0).backward(create_graph=True)
        assert st._C.grad_reduction_stats()["deferred"] == 0
        for p in list(net.parameters()) + list(ref.parameters()):
            p.grad = None if p.grad is None else p.grad.detach()
    elif variant == "error":
        # Raises at the input, after every parameter term was deferred: nothing pending may leak into the next step.
        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):
                raise RuntimeError("boom in backward")
        x = sharded(x0).requires_grad_()
        with pytest.raises(RuntimeError, match="boom"):
            loss(net, Boom.apply(x)).backward()
        net.zero_grad(set_to_none=True)
        loss(net, sharded(x1)).backward()
        loss(ref, x1).backward()
    else:
        raise AssertionError(variant)
    _compare(net, ref, f"{variant} (bucket bytes {bucket_bytes})")
    stats = st._C.grad_reduction_stats()
    if bucket_bytes > 0 and dist.get_world_size() > 1 and variant not in ("create_graph",):
        assert stats["deferred"] > 0 and stats["buckets"] > 0, stats
        if bucket_bytes == 1:
            assert stats["buckets"] == stats["deferred"], stats   # one bucket per term
    if bucket_bytes == 0:
        assert stats["deferred"] == 0, stats


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("bucket_bytes", [0, 1, 1 << 20])
def test_training_step(world, bucket_bytes):
    harness.run(world, case_step, False, bucket_bytes, "plain")


@pytest.mark.parametrize("variant", ["accumulate", "retain", "shared", "unused", "autograd_grad", "hooks",
                                     "create_graph", "error", "reentrant", "non_reentrant"])
def test_variants(variant):
    harness.run(3, case_step, False, 1, variant)


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 20])
def test_two_d_mesh(bucket_bytes):
    """H and W sharded over a 2 x 2 mesh: each bucket is summed over both mesh dims in turn."""
    harness.run(4, case_step, True, bucket_bytes, "plain")


def case_settings():
    previous = st.grad_bucket_bytes()
    assert st.set_grad_bucket_bytes(4096) == previous and st.grad_bucket_bytes() == 4096
    st.set_grad_bucket_bytes(previous)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="set_grad_bucket_bytes"):
            st.set_grad_bucket_bytes(bad)
    return True


def test_settings():
    harness.run(1, case_settings)


def case_data_parallel(wrapper):
    """DDP / FSDP2 over the data axis of a 2 x 2 (data x domain) mesh, the input sharded over the domain axis: the
    gradients equal the single-device average over the two data groups' samples. FSDP2's parameters carry no
    accumulator hooks, so their domain sums are deferred (its post-backward waits for them); DDP's carry its hooks,
    so they are summed at once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    previous = st.set_grad_bucket_bytes(1)
    try:
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "domain"))
        dp = m.get_local_rank("data")
        samples = [_input(30 + s) for s in range(2)]
        net, ref = Net(), Net()
        if wrapper == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(net, process_group=m.get_group("data"),
                                                              find_unused_parameters=True)
        else:
            from torch.distributed.fsdp import fully_shard
            fully_shard(net.c2, mesh=m["data"])
            model = fully_shard(net, mesh=m["data"])
        st._C.reset_grad_reduction_stats()
        x = st.distribute_tensor(samples[dp], m["domain"], [st.Shard(2)], {0: [5, 4]})
        model(x).square().mean().backward()
        deferred = st._C.grad_reduction_stats()["deferred"]
        assert (deferred > 0) == (wrapper == "fsdp2"), deferred
        for s in samples:
            (ref(s).square().mean() / 2).backward()
        for (name, p), (_, r) in zip(net.named_parameters(), ref.named_parameters()):
            if r.grad is None:
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            close(g, r.grad, rtol=1e-5, atol=1e-6, what=f"{wrapper} {name}")
    finally:
        st.set_grad_bucket_bytes(previous)
    return True


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel(wrapper):
    harness.run(4, case_data_parallel, wrapper)
