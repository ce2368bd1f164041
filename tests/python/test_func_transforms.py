"""torch.func transforms and forward-mode AD over ShardTensors, against one device (float64, uneven extents, strict
mode: nothing falls back to a gather).

- `torch.func.grad` / `vjp` / `jacrev` / `jvp` / `jacfwd` / `hessian` run autograd on functorch's own wrappers of the
  ShardTensors; the library's autograd rules (recorded C++ autograd Functions, refused by functorch, and reading
  ShardTensors, not wrappers) give way to each op's own derivative formula or composite decomposition there, whose
  ops reach the rules below autograd (src/dispatch/registry.cpp, `needs_own_autograd`). Before, a transform over a
  BatchNorm, an upsampling or attention raised an internal assert.
- Forward-mode AD (`torch.autograd.forward_ad`, dual tensors at the default level) likewise, and the tangent's layout
  questions `_has_same_storage_numel` / `_new_zeros_with_same_feature_meta` have rules (before, every jvp raised).
- `native_batch_norm_backward` / `batch_norm_backward` have rules (the formulas' backward, evaluation and training).
- `vmap` over a batch dim or over the split points themselves (a PINN's per-point Jacobian, Hessian and Laplacian):
  the work stays divided and pointwise networks communicate nothing.
- Gradients with respect to plain parameters (`functional_call` under grad, per-sample, an ensemble's vmap, Hessians
  and Hessian-vector products with respect to parameters) are plain tensors: the promotion there is a dispatcher op
  functorch records (`shardtensor::promote_plain` / `full_plain`, with vmap batching rules).
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import forward_ad as fwAD

import harness
import shardtensor as st
from cases_util import full, mesh, randn, uneven_extents


class _Net(nn.Module):
    """Convolutions, batch norm (evaluation: its running statistics are the transforms' captured state), group norm,
    pooling with overlapping windows, bilinear upsampling, reflection padding."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.gn = nn.GroupNorm(2, 6)
        self.conv2 = nn.Conv2d(6, 3, 3)

    def forward(self, x):
        h = F.gelu(self.bn(self.conv1(x)))
        h = F.interpolate(F.max_pool2d(h, 3, 2, 1), scale_factor=2, mode="bilinear", align_corners=False)
        h = self.gn(h)
        return self.conv2(F.pad(h, (1, 1, 1, 1), mode="reflect"))


def _net(seed):
    torch.manual_seed(seed)
    net = _Net().double()
    with torch.no_grad():  # running statistics other than the defaults, so evaluation reads them
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    return net.eval()


def _layout(m, seed, mesh_shape):
    """Placements and extents of a (N, C, 12, 10) field: H split (uneven), or H and W on a 2-D mesh."""
    if len(mesh_shape) == 1:
        return [st.Shard(2)], {0: uneven_extents(12, m.size(), seed)}
    return [st.Shard(2), st.Shard(3)], {0: uneven_extents(12, mesh_shape[0], seed),
                                        1: uneven_extents(10, mesh_shape[1], seed + 1)}


def _transform(kind, net, x, t):
    """One transform of the network at `x` (tangent or cotangent direction `t`): what it returns, as a tuple."""
    loss = lambda v: (net(v) * 1.5).square().sum()  # noqa: E731
    if kind == "grad":
        return (torch.func.grad(loss)(x),)
    if kind == "vjp":
        out, pull = torch.func.vjp(net, x)
        return (out,) + pull(torch.ones_like(out) * 0.5)
    if kind == "jvp":
        return torch.func.jvp(net, (x,), (t,))
    if kind == "dual":
        with fwAD.dual_level():
            o = fwAD.unpack_dual(net(fwAD.make_dual(x, t)))
            return o.primal, o.tangent
    if kind == "hvp":  # forward over reverse: a Hessian-vector product
        return torch.func.jvp(torch.func.grad(loss), (x,), (t,))
    if kind == "vmap":  # per-sample outputs and gradients over the batch dim
        per = lambda v: net(v.unsqueeze(0)).squeeze(0)  # noqa: E731
        return torch.func.vmap(per)(x), torch.func.vmap(torch.func.grad(lambda v: per(v).square().sum()))(x)
    if kind in ("params", "params_live"):  # gradients with respect to the parameters (functional_call)
        # detached copies, or the module's own parameters (leaves that require grad outside the transform)
        params = {k: v.detach() if kind == "params" else v for k, v in net.named_parameters()}
        g = torch.func.grad(lambda p: torch.func.functional_call(net, p, (x,)).square().sum())(params)
        return tuple(g[k] for k in sorted(g))
    params = {k: v.detach() for k, v in net.named_parameters()}
    ploss = lambda p: torch.func.functional_call(net, p, (x,)).square().sum()  # noqa: E731
    if kind == "param_hvp":  # forward over reverse with respect to the parameters (second order through promotion)
        tangents = {k: torch.ones_like(v) * 0.25 for k, v in params.items()}
        g, hv = torch.func.jvp(torch.func.grad(ploss), (params,), (tangents,))
        return tuple(g[k] for k in sorted(g)) + tuple(hv[k] for k in sorted(hv))
    if kind == "param_vmap":  # per-sample parameter gradients (vmap over the batch of the input, parameters shared)
        per = lambda p, v: torch.func.functional_call(net, p, (v.unsqueeze(0),)).square().sum()  # noqa: E731
        g = torch.func.vmap(torch.func.grad(per), in_dims=(None, 0))(params, x)
        return tuple(g[k] for k in sorted(g))
    if kind == "param_hessian":  # reverse over reverse: jacrev's cotangents batched by vmap (group norm's bias)
        b_loss = lambda b: ploss({**params, "gn.bias": b})  # noqa: E731
        return (torch.func.hessian(b_loss)(params["gn.bias"]),)
    if kind == "param_ensemble":  # vmap over batched plain parameters (three weights at once)
        w = torch.stack([params["conv2.weight"] * s for s in (1.0, -0.5, 2.0)])
        w_loss = lambda w1: ploss({**params, "conv2.weight": w1})  # noqa: E731
        return (torch.func.vmap(torch.func.grad(w_loss))(w),)
    raise ValueError(kind)


def case_transform(seed, kind, mesh_shape):
    m = mesh(mesh_shape)
    net = _net(seed)
    x = randn(2, 2, 12, 10, seed=seed, dtype=torch.float64)
    t = randn(2, 2, 12, 10, seed=seed + 1, dtype=torch.float64)
    placements, ext = _layout(m, seed, mesh_shape)
    xs = st.distribute_tensor(x, m, placements, sharding_shapes=ext)
    ts = st.distribute_tensor(t, m, placements, sharding_shapes=ext)
    ref = _transform(kind, net, x, t)
    with st.use_strict(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _transform(kind, net, xs, ts)
    # vmap runs the promotion's ops by their batching rules, not functorch's per-sample fallback (which warns)
    assert not [w for w in caught if "batching rule" in str(w.message)], [str(w.message) for w in caught]
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        if kind.startswith("param"):
            # A plain parameter's gradient (and its Hessian-vector product) is plain, as from .backward(): the
            # promotion inside the transform (shardtensor::promote_plain) completes it.
            assert not st.is_shard_tensor(a), f"{kind}: parameter gradient {i} is {st.placements(a)}"
        else:
            assert st.is_shard_tensor(a), f"{kind}: result {i} is not a ShardTensor (the work was not divided)"
            assert any(p.is_shard() for p in st.placements(a)), f"{kind}: result {i} is {st.placements(a)}"
        torch.testing.assert_close(full(a), b, rtol=1e-9, atol=1e-9, msg=lambda e: f"{kind} result {i}: {e}")
    return True


def case_batch_norm_training(seed):
    """Batch norm with batch statistics: forward-mode AD (the dual API takes the running-statistics update, as on
    one device) and torch.func.grad with `track_running_stats=False` (functorch refuses the buffers' in-place update
    inside a transform on one device too); the output, the tangent or gradient and the running statistics."""
    m = mesh()
    x = randn(3, 4, 11, 5, seed=seed, dtype=torch.float64)
    t = randn(3, 4, 11, 5, seed=seed + 1, dtype=torch.float64)
    ext = {0: uneven_extents(11, m.size(), seed)}
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes=ext)
    ts = st.distribute_tensor(t, m, [st.Shard(2)], sharding_shapes=ext)
    torch.manual_seed(seed)
    bn = nn.BatchNorm2d(4).double()
    nn.init.uniform_(bn.weight, 0.5, 1.5), nn.init.uniform_(bn.bias, -0.5, 0.5)
    bn_ref = nn.BatchNorm2d(4).double()
    bn_ref.load_state_dict(bn.state_dict())
    ref = _transform("dual", bn_ref, x, t)
    with st.use_strict():
        got = _transform("dual", bn, xs, ts)
    for a, b in zip(got, ref):
        torch.testing.assert_close(full(a), b, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, bn_ref.running_var, rtol=1e-12, atol=1e-12)
    free = nn.BatchNorm2d(4, track_running_stats=False).double()
    free.load_state_dict({k: v for k, v in bn.state_dict().items() if k in ("weight", "bias")})
    for kind in ("grad", "jvp", "params"):
        ref = _transform(kind, free, x, t)
        with st.use_strict():
            got = _transform(kind, free, xs, ts)
        for a, b in zip(got, ref):
            torch.testing.assert_close(full(a), b, rtol=1e-9, atol=1e-9, msg=lambda e: f"{kind}: {e}")
    return True


def case_pinn(seed):
    """A physics-informed MLP over split collocation points: per-point Jacobians (reverse and forward), Hessians and
    their Laplacian through vmap over the split dim, and a jvp through the network: every result split like the
    points, and not one collective (the network is pointwise in the points)."""
    m = mesh()
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 1)).double()
    u = lambda p: mlp(p).squeeze(-1)  # noqa: E731
    x = randn(13, 2, seed=seed, dtype=torch.float64)
    xs = st.distribute_tensor(x, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(13, m.size(), seed)})
    ops = {
        "jacrev": lambda p: torch.func.vmap(torch.func.jacrev(u))(p),
        "jacfwd": lambda p: torch.func.vmap(torch.func.jacfwd(u))(p),
        "laplacian": lambda p: torch.func.vmap(torch.func.hessian(u))(p).diagonal(dim1=-2, dim2=-1).sum(-1),
        "jvp": lambda p: torch.func.jvp(u, (p,), (torch.ones_like(p),))[1],
    }
    for name, fn in ops.items():
        ref = fn(x)
        with st.use_strict(), st.CommCounter() as counter:
            got = fn(xs)
        assert st.is_shard_tensor(got) and st.placements(got) == (st.Shard(0),), f"{name}: {st.placements(got)}"
        assert counter.total_calls == 0, f"{name}: {counter.total_calls} collectives for a pointwise network"
        torch.testing.assert_close(full(got), ref, rtol=1e-10, atol=1e-10, msg=lambda e: f"{name}: {e}")
    return True


def case_tangent_layouts(seed):
    """A dual tensor's tangent given plain, in the primal's layout, or in another layout: forward-mode AD keeps the
    one laid out like the primal and copies the others into zeros laid out like it
    (`_new_zeros_with_same_feature_meta`), so the tangent always follows the primal's shards."""
    m = mesh()
    torch.manual_seed(seed)
    conv = nn.Conv2d(1, 2, 3, padding=1).double()
    x = randn(1, 1, 9, 6, seed=seed, dtype=torch.float64)
    t = randn(1, 1, 9, 6, seed=seed + 1, dtype=torch.float64)
    ext = {0: uneven_extents(9, m.size(), seed)}
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes=ext)
    ref = _transform("dual", conv, x, t)
    tangents = {"plain": t, "same layout": st.distribute_tensor(t, m, [st.Shard(2)], sharding_shapes=ext),
                "other split": st.distribute_tensor(t, m, [st.Shard(3)]),
                "replicate": st.distribute_tensor(t, m, [st.Replicate()])}
    for name, tangent in tangents.items():
        with fwAD.dual_level():
            d = fwAD.make_dual(xs, tangent)
            inner = fwAD.unpack_dual(d).tangent
            assert st.is_shard_tensor(inner) and st.placements(inner) == st.placements(xs), \
                f"{name}: the tangent is {st.placements(inner) if st.is_shard_tensor(inner) else 'plain'}"
            o = fwAD.unpack_dual(conv(d))
        torch.testing.assert_close(full(o.tangent), ref[1], rtol=1e-10, atol=1e-10, msg=lambda e: f"{name}: {e}")
    # The layout changes of the API on a dual tensor: primal and tangent mapped alike.
    local_ref = st.to_local(st.distribute_tensor(ref[1], m, [st.Shard(2)], sharding_shapes=ext))
    calls = {"full_tensor": (st.full_tensor, lambda r: r), "to_local": (st.to_local, lambda r: r),
             "redistribute": (lambda y: st.redistribute(y, [st.Shard(3)]), full)}
    for name, (fn, whole) in calls.items():
        with fwAD.dual_level():
            out = fwAD.unpack_dual(fn(conv(fwAD.make_dual(xs, tangents["same layout"]))))
        expect = local_ref if name == "to_local" else ref[1]
        torch.testing.assert_close(whole(out.tangent), expect, rtol=1e-10, atol=1e-10, msg=lambda e: f"{name}: {e}")
    # A tangent split along a dim that becomes a batch dim has no layout for the primal's zeros: refused everywhere.
    ts = st.distribute_tensor(randn(4, 9, 6, seed=seed, dtype=torch.float64), m, [st.Shard(0)])
    with pytest.raises(NotImplementedError, match="batch dim"):
        torch.ops.aten._new_zeros_with_same_feature_meta(ts, xs, self_num_batch_dims=1)
    return True


def _whole(u):
    """st.full_tensor of a (wrapped) ShardTensor; a plain tensor (the one-device reference) as it is."""
    return st.full_tensor(u) if st.is_shard_tensor(u) or st._wraps_shard_tensor(u) else u


def case_layout_calls_inside_transform(seed):
    """st.redistribute / to_local inside a torch.func transform get functorch's wrapper of the ShardTensor: a
    NotImplementedError naming the transform and the remedy on every rank (not "expected a ShardTensor, got a plain
    tensor"); outside, on the transform's result, they work. st.full_tensor works inside (shardtensor::full_plain):
    grad, jvp, vmap over the batch and hessian through a loss on the whole field, equal to one device."""
    m = mesh()
    torch.manual_seed(seed)
    conv = nn.Conv2d(1, 1, 3, padding=1).double()
    x = randn(2, 1, 7, 4, seed=seed, dtype=torch.float64)
    xs = st.distribute_tensor(x, m, [st.Shard(2)])
    calls = {"to_local": st.to_local, "redistribute": lambda y: st.redistribute(y, [st.Replicate()])}
    for name, fn in calls.items():
        with pytest.raises(NotImplementedError, match=f"{name} inside a torch.func transform"):
            torch.func.grad(lambda v: fn(conv(v)).sum())(xs)
    g = torch.func.grad(lambda v: conv(v).square().sum())(xs)
    torch.testing.assert_close(st.full_tensor(g), torch.func.grad(lambda v: conv(v).square().sum())(x))

    loss = lambda v: (_whole(conv(v)).sin() * _whole(conv(v))).sum()  # noqa: E731
    per = lambda v: _whole(conv(v.unsqueeze(0))).square().mean()  # noqa: E731
    t = randn(2, 1, 7, 4, seed=seed + 1, dtype=torch.float64)
    ts = st.distribute_tensor(t, m, [st.Shard(2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = (torch.func.grad(loss)(xs), *torch.func.jvp(loss, (xs,), (ts,)), torch.func.vmap(per)(xs),
               torch.func.vmap(torch.func.grad(per))(xs))
    assert not [w for w in caught if "batching rule" in str(w.message)], [str(w.message) for w in caught]
    ref = (torch.func.grad(loss)(x), *torch.func.jvp(loss, (x,), (t,)), torch.func.vmap(per)(x),
           torch.func.vmap(torch.func.grad(per))(x))
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(full(a), b, msg=lambda e: f"result {i}: {e}")
    # second order: the Hessian of the loss with respect to the convolution's bias, through st.full_tensor
    def bias_loss(v):
        def f(b):
            u = _whole(torch.func.functional_call(conv, {"weight": conv.weight.detach(), "bias": b}, (v,)))
            return (u.sin() * u).sum()
        return f
    torch.testing.assert_close(torch.func.hessian(bias_loss(xs))(conv.bias.detach()),
                               torch.func.hessian(bias_loss(x))(conv.bias.detach()))
    return True


@pytest.mark.parametrize("kind", ["grad", "vjp", "jvp", "dual", "hvp", "vmap", "params", "params_live", "param_hvp",
                                  "param_vmap", "param_hessian", "param_ensemble"])
def test_transform(kind):
    harness.run(2, case_transform, 0, kind, (2,))


@pytest.mark.parametrize("kind", ["grad", "jvp"])
def test_transform_3_ranks(kind):
    harness.run(3, case_transform, 1, kind, (3,))


@pytest.mark.parametrize("kind", ["grad", "dual", "params"])
def test_transform_2d_mesh(kind):
    harness.run(4, case_transform, 2, kind, (2, 2))


def test_batch_norm_training():
    harness.run(2, case_batch_norm_training, 0)


@pytest.mark.parametrize("world", [2, 3])
def test_pinn(world):
    harness.run(world, case_pinn, world)


def test_tangent_layouts():
    harness.run(2, case_tangent_layouts, 0)


def test_layout_calls_inside_transform():
    harness.run(2, case_layout_calls_inside_transform, 0)
