"""torchvision's deformable convolution on split inputs (src/ops/deform_conv.cpp): the input split along H and/or W
(and the batch), the offsets and mask whole or split like the output. Each rank reads the rows its taps reach (a
data-dependent window, all-gathered ranges and a halo exchange) and runs torchvision's kernel on a frame of them.
Against one device: forward, the gradients of input, offsets, mask, weight and bias; small offsets, offsets reaching
several rows past the undeformed window, offsets pointing outside the image, strides, padding, dilation, groups and
offset groups; uneven, one-row and empty shards, 1-3 ranks and a 2x2 mesh; DCNv2 as a module (offsets and mask
from a convolution of the split input); strict mode throughout (no fallback)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, tiny_extents, uneven_extents

tv_ops = pytest.importorskip("torchvision.ops", reason="torchvision is an optional test dependency")

TOL = dict(rtol=1e-9, atol=1e-9)


def _out_size(n, k, stride, pad, dil):
    return (n + 2 * pad - dil * (k - 1) - 1) // stride + 1


def _inputs(shape, cout, k, stride, pad, dil, groups, ogroups, reach, seed):
    n, c, h, w = shape
    ho, wo = _out_size(h, k, stride, pad, dil), _out_size(w, k, stride, pad, dil)
    x = randn(n, c, h, w, seed=seed, dtype=torch.float64)
    off = randn(n, 2 * ogroups * k * k, ho, wo, seed=seed + 1, dtype=torch.float64) * reach
    mask = torch.sigmoid(randn(n, ogroups * k * k, ho, wo, seed=seed + 2, dtype=torch.float64))
    weight = randn(cout, c // groups, k, k, seed=seed + 3, dtype=torch.float64) * 0.3
    bias = randn(cout, seed=seed + 4, dtype=torch.float64)
    return x, off, mask, weight, bias


def _fn(stride, pad, dil, use_mask):
    def f(x, off, mask, weight, bias):
        return tv_ops.deform_conv2d(x, off, weight, bias, stride=stride, padding=pad, dilation=dil,
                                    mask=mask if use_mask else None)
    return f


# (kernel, stride, padding, dilation, groups, offset groups, offset scale)
CONFIGS = [
    (3, 1, 1, 1, 1, 1, 0.7),    # DCNv2's usual 3x3, small offsets
    (3, 1, 1, 1, 2, 2, 3.0),    # offsets reaching a few rows past the undeformed window, groups
    (3, 2, 1, 1, 1, 1, 1.5),    # stride 2
    (3, 1, 2, 2, 1, 2, 1.0),    # dilation 2
    (1, 1, 0, 1, 1, 1, 9.0),    # a 1x1 kernel whose taps land anywhere (and outside)
    (2, 1, 0, 1, 1, 1, 0.0),    # an even kernel, zero offsets (a plain convolution)
]


def case_deform(kind):
    m = mesh()
    wsz = m.size()
    ext = {"uneven": uneven_extents, "tiny": lambda n, k, seed=0: tiny_extents(n, k)}[kind]
    with st.use_strict():
        for ci, (k, stride, pad, dil, groups, og, reach) in enumerate(CONFIGS):
            shape = (2, 4, 13, 11)
            x, off, mask, weight, bias = _inputs(shape, 6, k, stride, pad, dil, groups, og, reach, seed=10 * ci)
            for dim in (2, 3):
                for use_mask in (True, False):
                    lay_x = ([st.Shard(dim)], {0: ext(shape[dim], wsz, seed=dim + ci)})
                    # Offsets and mask whole (the convolution cuts the output) ...
                    check_op(_fn(stride, pad, dil, use_mask), [x, off, mask, weight, bias],
                             [lay_x, None, None, None, None], m, **TOL,
                             what=f"deform_conv2d {ci} dim {dim} mask {use_mask} whole offsets")
                    # ... or split like the output, with extents of their own.
                    lay_o = ([st.Shard(dim)], {0: ext(off.shape[dim], wsz, seed=7 + dim + ci)})
                    out = check_op(_fn(stride, pad, dil, use_mask), [x, off, mask, weight, bias],
                                   [lay_x, lay_o, lay_o, None, None], m, **TOL,
                                   what=f"deform_conv2d {ci} dim {dim} mask {use_mask} split offsets")
                    assert st.placements(out) == (st.Shard(dim),)
    return True


def case_messages():
    """Small offsets move the convolution's halo (plus a row of margin) between neighbours: one all-gather of the
    ranges and one exchange in the forward; the backward reuses the forward's ranges."""
    m = mesh()
    x, off, mask, weight, bias = _inputs((1, 3, 24, 8), 4, 3, 1, 1, 1, 1, 1, 0.4, seed=3)
    xs = st.distribute_tensor(x, m, [st.Shard(2)]).requires_grad_()
    w = weight.clone().requires_grad_()
    with st.use_strict(), st.CommCounter() as c:
        out = tv_ops.deform_conv2d(xs, off, w, bias, padding=1, mask=mask)
    assert dict(c.calls) == {"all_gather": 1, "halo": 1}, dict(c.calls)
    with st.use_strict(), st.CommCounter() as cb:
        out.sum().backward()
    ref_x = x.clone().requires_grad_()
    ref_w = weight.clone().requires_grad_()
    tv_ops.deform_conv2d(ref_x, off, ref_w, bias, padding=1, mask=mask).sum().backward()
    close(full(xs.grad), ref_x.grad, **TOL, what="input grad")
    close(w.grad, ref_w.grad, **TOL, what="weight grad")
    # The window again (the offsets' and weight's gradients read it) and its gradient home, the weight's sum: the
    # ranges are the forward's (no all-gather).
    assert "all_gather" not in cb.calls and cb.calls.get("halo") == 2, dict(cb.calls)
    return True


def case_2d_mesh():
    m = mesh((2, 2))
    x, off, mask, weight, bias = _inputs((2, 4, 10, 9), 4, 3, 1, 1, 1, 2, 2, 2.5, seed=5)
    with st.use_strict():
        check_op(_fn(1, 1, 1, True), [x, off, mask, weight, bias],
                 [([st.Shard(2), st.Shard(3)], {0: [6, 4], 1: [0, 9]}), None, None, None, None], m, **TOL,
                 what="H and W split")
        lay_o = ([st.Shard(2), st.Shard(3)], {0: [3, 7], 1: [5, 4]})
        check_op(_fn(1, 1, 1, True), [x, off, mask, weight, bias],
                 [([st.Shard(2), st.Shard(3)], {0: [6, 4], 1: [2, 7]}), lay_o, lay_o, None, None], m, **TOL,
                 what="H and W split, offsets split")
        check_op(_fn(2, 1, 1, False), [x, off[..., ::2, ::2].contiguous(), mask, weight, bias],
                 [([st.Shard(0), st.Shard(2)], {0: [1, 1], 1: [7, 3]}), None, None, None, None], m, **TOL,
                 what="batch and H split, stride 2")
    return True


def case_module():
    """DCNv2 as models write it: offsets and mask from a convolution of the split input, a deformable convolution
    module, every parameter's gradient against one device."""
    from torchvision.ops import DeformConv2d

    torch.manual_seed(0)
    net = torch.nn.ModuleDict(dict(
        offsets=torch.nn.Conv2d(4, 3 * 9, 3, padding=1),
        dcn=DeformConv2d(4, 5, 3, padding=1),
    )).double()
    with torch.no_grad():
        net["offsets"].weight.mul_(3.0)

    def forward(x):
        om = net["offsets"](x)
        off, mask = om[:, :18], torch.sigmoid(om[:, 18:])
        return torch.relu(net["dcn"](x, off, mask))

    m = mesh()
    x = randn(2, 4, 15, 12, seed=9, dtype=torch.float64)
    ref = forward(x)
    wt = randn(*ref.shape, seed=10, dtype=torch.float64)
    (ref * wt).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(15, m.size(), seed=2)})
    with st.use_strict():
        out = forward(xs)
        close(full(out), ref, **TOL, what="module output")
        (out * wt).sum().backward()
    for n, p in net.named_parameters():
        assert not st.is_shard_tensor(p.grad), n
        close(p.grad, ref_grads[n], **TOL, what=f"grad {n}")
    return True


def refuse_channels():
    m = mesh()
    x, off, mask, weight, bias = _inputs((1, 4, 8, 8), 4, 3, 1, 1, 1, 1, 1, 0.5, seed=1)
    xs = st.distribute_tensor(x, m, [st.Shard(1)])
    with st.use_strict():
        tv_ops.deform_conv2d(xs, off, weight, bias, padding=1)


@pytest.mark.parametrize("kind", ["uneven", "tiny"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_deform_conv(world, kind):
    harness.run(world, case_deform, kind)


@pytest.mark.parametrize("world", [2, 3])
def test_messages(world):
    harness.run(world, case_messages)


def test_2d_mesh():
    harness.run(4, case_2d_mesh)


@pytest.mark.parametrize("world", [2, 3])
def test_module(world):
    harness.run(world, case_module)


def test_channels_refused():
    harness.expect_error(2, refuse_channels, match="channels are split", kinds=("NotImplementedError",))


def test_simulation_refuses_spatial_split():
    """The windows are data: a simulated rank cannot know its peers' ranges, so the rule refuses with the remedy
    (in this process: st.simulate needs no pool)."""
    with st.simulate(1, 4, warn=False) as sim:
        xs = st.distribute_tensor(torch.randn(1, 4, 32, 32), sim.mesh, [st.Shard(2)])
        with pytest.raises(NotImplementedError, match="needs the values of other ranks"):
            tv_ops.deform_conv2d(xs, torch.randn(1, 18, 32, 32), torch.randn(4, 4, 3, 3), padding=1)
