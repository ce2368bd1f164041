"""Second derivatives through sharded ops: a physics-informed loss on du/dx (autograd.grad with create_graph=True,
then backward), a gradient penalty on a weight's gradient, and a second input derivative (d2u/dx2, a third-order
graph), against one device: float64, uneven extents, 2 and 3 ranks and a 2x2 mesh, strict mode; the output, the first
derivative, the input's and every parameter's gradient.

- Convolutions and batch/instance norms: aten's own double backward of a convolution convolves the sharded input
  gradient with the sharded output gradient as if one were a weight (refused: "sharded weights are not supported");
  the library's autograd rule for convolution_backward (src/ops/conv.cpp, ConvBackwardFn) writes the three terms with
  the forward and backward rules instead.
- An MLP over split points (a PINN: nn.Linear's rule above autograd records its gradients under create_graph).
- Ops linear in their input (interpolation, circular padding, Tensor.unfold, F.unfold / F.fold, max_unpool, sorted
  values, x[idx], gather, index_select, top-k, max and median along the split dim) and batch norm in evaluation record
  their backward (the adjoint, whose own backward is the op again): `test_double_backward_linear_ops*`, first to
  third derivatives.
- Attention over split tokens (the ring, the all-to-all; causal, masked, grouped heads) takes its gradients under
  create_graph from the attention written as ops with rules (`test_double_backward_attention*`).
- Ops whose backward is still computed on local tensors (cummax along a split dim, ...): a second derivative through
  them raises on every rank instead of silently dropping their terms (it was wrong before: 0.5-2 relative error).
- Third derivatives through means and sums over a split dim (the placement transitions' own backwards recorded under
  create_graph): `test_third_derivative_reductions`."""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import harness
import shardtensor as st
from cases_util import mesh, randn, uneven_extents, world


def make_net(kind):
    torch.manual_seed(3)
    if kind == "conv":
        net = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.Tanh(), nn.GroupNorm(2, 6),
                            nn.Conv2d(6, 6, 3, padding=2, dilation=2), nn.SiLU(), nn.Conv2d(6, 1, 1), nn.Softplus())
    elif kind == "strided":   # a stride-2 encoder and a transposed-convolution decoder (a U-Net level)
        net = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Tanh(),
                            nn.ConvTranspose2d(4, 3, 4, stride=2, padding=1), nn.Tanh(), nn.Conv2d(3, 1, 3, padding=1))
    elif kind == "norms":     # batch statistics (training mode) and an instance norm
        # (no bias before a norm: its gradient is zero up to rounding, a relative comparison of noise)
        net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Tanh(),
                            nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.InstanceNorm2d(4, affine=True), nn.SiLU(),
                            nn.Conv2d(4, 1, 1))
    elif kind == "upsample":  # a U-Net decoder: bilinear, bicubic and nearest upsampling
        net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Upsample(scale_factor=2, mode="bilinear"),
                            nn.Conv2d(3, 3, 3, padding=1), nn.SiLU(), nn.Upsample(size=(13, 9), mode="bicubic"),
                            nn.Conv2d(3, 1, 1), nn.Softplus(), nn.Upsample(scale_factor=2, mode="nearest"))
    elif kind == "periodic":  # a periodic domain: circular padding
        net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                            nn.Conv2d(4, 1, 3, padding=2, dilation=2, padding_mode="circular"))
    elif kind == "eval_norm":  # batch norm with running statistics (evaluation mode: an affine map per channel)
        net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(), nn.Conv2d(4, 1, 1))
        with torch.no_grad():
            net[1].running_mean.uniform_(-0.5, 0.5)
            net[1].running_var.uniform_(0.5, 2.0)
            net[1].weight.uniform_(0.5, 1.5)
            net[1].bias.uniform_(-0.5, 0.5)
        net.eval()
    elif kind == "unpool":
        net = PoolUnpool()
    elif kind == "im2col":
        net = Im2colNet()
    elif kind == "unfold":
        net = WindowNet()
    elif kind == "reads":
        net = ReadsNet()
    elif kind == "selections":
        net = SelectionsNet()
    elif kind.startswith("attention"):
        net = AttentionNet(kind)
    else:                     # 1-D: a PINN over a split line, reflect padding
        net = nn.Sequential(nn.Conv1d(1, 5, 5, padding=2, padding_mode="reflect"), nn.Tanh(),
                            nn.Conv1d(5, 5, 3, padding=1, groups=5), nn.Tanh(), nn.Conv1d(5, 1, 1))
    return net.double()


class PoolUnpool(nn.Module):
    """max pooling with its indices, then max_unpool: linear in the pooled values, the indices fixed."""
    def __init__(self):
        super().__init__()
        self.conv, self.out = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, x):
        y, idx = F.max_pool2d(torch.tanh(self.conv(x)), 2, return_indices=True)
        return self.out(F.max_unpool2d(y.sin(), idx, 2, output_size=x.shape[-2:]))


class Im2colNet(nn.Module):
    """A convolution written as F.unfold (im2col) and a matrix product, then F.fold (col2im) of the columns."""
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 2 * 9) * 0.3)

    def forward(self, x):
        n, _, h, w = x.shape
        y = torch.tanh(self.weight @ F.unfold(x, 3, padding=1)).reshape(n, 3, h, w)
        return F.fold(F.unfold(y, 3, padding=1).sin(), (h, w), 3, padding=1)


class WindowNet(nn.Module):
    """Tensor.unfold along the split dim: sliding windows of rows, weighted and summed."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.taps = nn.Parameter(torch.tensor([0.5, -1.0, 0.7]))

    def forward(self, x):
        return (torch.tanh(self.conv(x)).unfold(2, 3, 1) * self.taps).sum(-1).pow(2)


class ReadsNet(nn.Module):
    """Reads along the split dim, each linear in the tensor read: sorted values, x[idx], gather, index_select."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        y = torch.tanh(self.conv(x))
        idx = torch.tensor([9, 0, 3, 3, 7, 1])
        rows = torch.arange(10).flip(0).view(1, 1, 10, 1).expand(1, 3, 10, 4)
        return (torch.sort(y, dim=2).values.sin() + torch.gather(y, 2, rows).cos() * y
                + (y[:, :, idx] ** 2).mean(2, keepdim=True) + y.index_select(2, idx).exp().mean(2, keepdim=True))


class SelectionsNet(nn.Module):
    """Selections along the split dim (values linear in the input, the indices fixed): top-k, max, median."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        y = torch.tanh(self.conv(x))
        top = torch.topk(y, 3, dim=2).values.sum(2, keepdim=True)
        return (top * y.max(dim=2, keepdim=True).values + y.median(dim=2).values.unsqueeze(2).sin()) * y


class AttentionNet(nn.Module):
    """Self-attention over split tokens (the ring; the all-to-all to head shards): plain, causal, with a boolean mask,
    with grouped key heads."""
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(4, 8 * 3 if kind != "attention_gqa" else 8 * 2)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.qkv(x)
        if self.kind == "attention_gqa":   # 2 query heads share 1 key/value head
            q, k, v = h[..., :8].view(b, n, 2, 4), h[..., 8:12].view(b, n, 1, 4), h[..., 12:].view(b, n, 1, 4)
        else:
            q, k, v = (t.view(b, n, 2, 4) for t in h.chunk(3, -1))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        kw = {}
        if self.kind == "attention_causal":
            kw["is_causal"] = True
        elif self.kind == "attention_mask":
            kw["attn_mask"] = (torch.arange(n).view(n, 1) - torch.arange(n).view(1, n)).abs() <= 3   # a band
        elif self.kind == "attention_gqa":
            kw["enable_gqa"] = True
        # The math kernel, as one device needs for a double backward (torch's fused kernels have none); sharded: the
        # ring (or the all-to-all to head shards), whose backward under create_graph is the math form on rules.
        # ("attention_fused": the ring with the fused kernels allowed, which one device cannot differentiate twice)
        strategy = "all_to_all" if self.kind == "attention_a2a" else "ring"
        sharded = st.is_shard_tensor(x)
        fused_allowed = sharded and self.kind == "attention_fused"
        with (contextlib.nullcontext() if fused_allowed else sdpa_kernel(SDPBackend.MATH)), \
                (st.use_attention_strategy(strategy) if sharded else contextlib.nullcontext()):
            o = F.scaled_dot_product_attention(q, k, v, **kw)
        return self.out(torch.tanh(o.transpose(1, 2).reshape(b, n, 8)))


SHAPES = {"conv": (2, 2, 12, 10), "strided": (1, 2, 12, 8), "line": (2, 1, 24), "norms": (2, 2, 10, 8),
          "upsample": (1, 2, 7, 5), "periodic": (2, 2, 10, 6), "eval_norm": (2, 2, 8, 6), "unpool": (1, 2, 8, 6),
          "im2col": (1, 2, 8, 5), "unfold": (1, 2, 9, 4), "reads": (1, 2, 10, 4), "selections": (1, 2, 10, 4),
          **{k: (2, 10, 4) for k in ("attention", "attention_a2a", "attention_fused", "attention_causal",
                                    "attention_mask", "attention_gqa")}}


def _losses(net, x, which):
    u = net(x)
    if which == "du":        # || du/dx ||^2 + || u ||^2
        (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return u, g, (g ** 2).mean() + (u ** 2).mean()
    if which == "d2u":       # the second derivative (a Laplacian's diagonal, summed)
        (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad(g.sum(), x, create_graph=True)
        return u, g2, (g2 ** 2).mean() + (u ** 2).mean()
    # a gradient penalty on the first layer's weight gradient
    (gw,) = torch.autograd.grad((u ** 2).sum(), next(net.parameters()), create_graph=True)
    return u, gw, (gw ** 2).sum() + u.mean()


def case_double_backward(kind, which, mesh_shape):
    m = mesh(mesh_shape)
    net = make_net(kind)
    shape = SHAPES[kind]
    x = randn(*shape, seed=7, dtype=torch.float64)
    dims = [2] if len(mesh_shape) == 1 else ([2, 3] if len(shape) == 4 else [0, 2])
    if kind.startswith("attention"):   # tokens split (batch x tokens on a 2-D mesh)
        dims = [1] if len(mesh_shape) == 1 else [0, 1]
    ext = {i: uneven_extents(shape[d], mesh_shape[i], 11 + i) for i, d in enumerate(dims)}
    xs = st.distribute_tensor(x, m, [st.Shard(d) for d in dims], sharding_shapes=ext).requires_grad_()
    _compare_with_one_device(lambda n, t: _losses(n, t, which), net, x, xs, (kind, which))
    return True


def _compare_with_one_device(losses, net, x, xs, label):
    """`losses(net, input)` -> (u, derivative, loss): run on the sharded input (strict mode) and on one device from a
    copy of `net`, backward from each loss; the four quantities and every parameter's gradient must agree."""
    ref = copy.deepcopy(net)
    xr = x.clone().requires_grad_()
    with st.use_strict():
        u, g, loss = losses(net, xs)
        loss.backward()
    ur, gr, lr = losses(ref, xr)
    lr.backward()
    full = lambda t: t.full_tensor() if st.is_shard_tensor(t) else t  # noqa: E731
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()  # noqa: E731
    for what, a, b in [("u", full(u), ur), ("the derivative", full(g), gr), ("loss", full(loss), lr),
                       ("the input's gradient", full(xs.grad), xr.grad)]:
        assert rel(a, b) < 1e-10, (label, what, rel(a, b))
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert rel(full(p.grad), q.grad) < 1e-10, (label, name, rel(full(p.grad), q.grad))


@pytest.mark.parametrize("which", ["du", "d2u", "weight"])
@pytest.mark.parametrize("kind", ["conv", "strided", "line", "norms"])
def test_double_backward(kind, which):
    if kind == "norms" and which == "d2u":
        pytest.skip("no single-device reference: torch's own batch-norm double backward is not exactly differentiable "
                    "once more (its third derivative differs from the formula's on one device)")
    harness.run(2, case_double_backward, kind, which, (2,))


@pytest.mark.parametrize("which", ["du", "d2u", "weight"])
@pytest.mark.parametrize("kind", ["upsample", "periodic", "eval_norm", "unpool", "im2col", "unfold", "reads",
                                  "selections"])
def test_double_backward_linear_ops(kind, which):
    """Ops linear in their input (the backward their adjoint, recorded with the op as its own backward): first,
    second and third derivatives through them."""
    harness.run(2, case_double_backward, kind, which, (2,))


@pytest.mark.parametrize("kind", ["upsample", "periodic", "unpool", "reads"])
def test_double_backward_linear_ops_2d_mesh(kind):
    harness.run(4, case_double_backward, kind, "d2u", (2, 2))


@pytest.mark.parametrize("which", ["du", "d2u", "weight"])
@pytest.mark.parametrize("kind", ["attention", "attention_a2a", "attention_fused", "attention_causal",
                                  "attention_mask", "attention_gqa"])
def test_double_backward_attention(kind, which):
    """Attention over split tokens (the ring): under create_graph its gradients come from the attention written as
    ops with rules, differentiated with a graph."""
    harness.run(2, case_double_backward, kind, which, (2,))


def test_double_backward_attention_2d_mesh():
    harness.run(4, case_double_backward, "attention_causal", "du", (2, 2))


@pytest.mark.parametrize("kind", ["conv", "line"])
def test_double_backward_3_ranks(kind):
    harness.run(3, case_double_backward, kind, "du", (3,))


@pytest.mark.parametrize("kind", ["conv", "strided", "norms"])
def test_double_backward_2d_mesh(kind):
    harness.run(4, case_double_backward, kind, "du", (2, 2))


class PointMLP(nn.Module):
    """u(x, y) of a PINN: an MLP over the coordinates of split points, with a LayerNorm."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.SiLU(),
                                 nn.Linear(16, 1, bias=False))

    def forward(self, x):
        return self.net(x)


def case_pinn_mlp(shape, which):
    m = mesh((world(),))
    net = PointMLP().double()
    x = randn(*shape, seed=9, dtype=torch.float64)
    d = len(shape) - 2
    xs = st.distribute_tensor(x, m, [st.Shard(d)], sharding_shapes={0: uneven_extents(shape[d], world(), 3)})
    xs.requires_grad_()
    _compare_with_one_device(lambda n, t: _losses_mlp(n, t, which), net, x, xs, ("pinn mlp", shape, which))
    return True


def _losses_mlp(net, x, which):
    u = net(x)
    (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    if which == "d2u":
        (g,) = torch.autograd.grad(g[..., 0].sum(), x, create_graph=True)
    return u, g, (g ** 2).mean() + (u ** 2).mean()


@pytest.mark.parametrize("shape,which", [((40, 2), "du"), ((2, 30, 2), "du"), ((40, 2), "d2u")])
def test_pinn_mlp(shape, which):
    harness.run(2, case_pinn_mlp, shape, which)


def case_once_differentiable_raises():
    m = mesh((2,))
    xs = st.distribute_tensor(randn(2, 10, 4).double(), m, [st.Shard(1)]).requires_grad_()
    u = torch.cummax(torch.tanh(xs), dim=1).values   # a running maximum along the split dim
    (g,) = torch.autograd.grad(u.square().sum(), xs, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        (g ** 2).sum().backward()
    return True


def test_once_differentiable_raises():
    harness.run(2, case_once_differentiable_raises)


def case_third_derivative_reductions(name):
    """g = dh/dx, g2 = d(g.g)/dx, g3 = d(g2.g2)/dx through means and sums over a split dim: the third was wrong
    (0.07-0.6 relative) while the first two were right, as the placement transitions' backwards cut the graph."""
    m = mesh((2,))
    dims = [0, 2, 3]
    f = {"x*mean": lambda x: (x * x.mean(dims, keepdim=True)).pow(2).sum(),
         "var": lambda x: (x - x.mean(dims, keepdim=True)).pow(2).mean(dims).pow(2).sum(),
         "sum_keep": lambda x: (x * x.sum(dims, keepdim=True)).tanh().sum()}[name]
    x = randn(2, 3, 6, 4, seed=1, dtype=torch.float64)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: [2, 4]}).requires_grad_()
    xr = x.clone().requires_grad_()
    res = []
    with st.use_strict():
        for inp in (xs, xr):
            (g,) = torch.autograd.grad(f(inp), inp, create_graph=True)
            (g2,) = torch.autograd.grad((g * g).sum(), inp, create_graph=True)
            (g3,) = torch.autograd.grad((g2 ** 2).sum(), inp)
            res.append((g, g2, g3))
    for order, (a, b) in enumerate(zip(res[0], res[1]), 1):
        a = a.full_tensor() if st.is_shard_tensor(a) else a
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-10, (name, order, err)
    return True


@pytest.mark.parametrize("name", ["x*mean", "var", "sum_keep"])
def test_third_derivative_reductions(name):
    harness.run(2, case_third_derivative_reductions, name)
