"""Ops on a 2x2 mesh where one mesh dim gives half the ranks an empty block of the batch or channel dim (a batch of
one split over two ranks; an instance norm's view that moves such a split onto the channels) while the other mesh
dim splits a spatial dim: the ranks without elements still take part in every exchange and make their empty
results themselves — torch's kernels refuse some empty inputs (the interpolation kernels accept an empty batch
only; the CPU flash attention kernel divides by the head count), and a rank that raised left the others waiting in
their next collective. Strict mode (rules only), forward and gradients against one device."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, mesh, randn

LAYOUTS = {
    "channels": ([st.Shard(1), st.Shard(2)], {0: [0, 3], 1: [7, 4]}),
    "batch": ([st.Shard(0), st.Shard(2)], {0: [0, 2], 1: [7, 4]}),
}


def ops():
    w = randn(4, 3, 3, 3, seed=1, dtype=torch.float64)
    grid = randn(2, 5, 4, 2, seed=2, dtype=torch.float64).tanh()
    return {
        "pad reflect": lambda t: F.pad(t, (2, 2, 2, 2), mode="reflect"),
        "pad replicate": lambda t: F.pad(t, (2, 2, 2, 2), mode="replicate"),
        "pad circular": lambda t: F.pad(t, (2, 2, 2, 2), mode="circular"),
        "max_pool": lambda t: F.max_pool2d(t, 3, 2, 1),
        "avg_pool": lambda t: F.avg_pool2d(t, 3, 2, 1, count_include_pad=False),
        "adaptive_avg": lambda t: F.adaptive_avg_pool2d(t, (4, 3)),
        "adaptive_max": lambda t: F.adaptive_max_pool2d(t, (4, 3)),
        "nearest": lambda t: F.interpolate(t, scale_factor=2),
        "bilinear": lambda t: F.interpolate(t, scale_factor=1.5, mode="bilinear"),
        "bicubic": lambda t: F.interpolate(t, size=(7, 5), mode="bicubic", align_corners=True),
        "area": lambda t: F.interpolate(t, size=(5, 4), mode="area"),
        "antialias": lambda t: F.interpolate(t, size=(5, 4), mode="bilinear", antialias=True),
        "conv": lambda t: F.conv2d(t, w, padding=1),
        "conv_transpose": lambda t: F.conv_transpose2d(t, w.transpose(0, 1), stride=2, padding=1),
        "unfold": lambda t: F.unfold(t, 3, padding=1),
        "grid_sample": lambda t: F.grid_sample(t, grid, align_corners=False),
        "roll": lambda t: torch.roll(t, 3, 2),
        "cumsum": lambda t: torch.cumsum(t, 2),
        "softmax": lambda t: torch.softmax(t, 2),
        "sort": lambda t: torch.sort(t, 2)[0],
        "rfft2": lambda t: torch.fft.rfft2(t).abs(),
        "group_norm": lambda t: F.group_norm(t, 3),
        "batch_norm": lambda t: F.batch_norm(t, None, None, training=True),
        "instance_norm": lambda t: F.instance_norm(t),
        "layer_norm": lambda t: F.layer_norm(t, t.shape[2:]),
        "pixel_unshuffle": lambda t: F.pixel_unshuffle(t[..., :10, :10], 2),
        "mean": lambda t: t.mean((2, 3)),
        "amax": lambda t: t.amax(2),
        "topk": lambda t: t.topk(2, dim=2)[0],
        "median": lambda t: t.median(2)[0],
        "sdpa": lambda t: F.scaled_dot_product_attention(t, t, t),
    }


def case_empty_blocks(layout):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 3, 11, 10, seed=3, dtype=torch.float64)
    with st.use_strict():
        for name, fn in ops().items():
            check_op(fn, [x], [LAYOUTS[layout]], m, rtol=1e-7, atol=1e-9, what=f"{name} ({layout} block empty)")
    return True


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_empty_blocks(layout):
    harness.run(4, case_empty_blocks, layout)


def case_view_of_empty_tensor():
    """A view of a tensor with a zero-size dim whose split no local layout keeps (flatten(1, 3) of (5, 4, 0, 1, 3, 7)
    split along dim 1, one of OpInfo's reference inputs): raised an internal assert ("the re-aligned layout is not
    local"); there is nothing to align, so the view runs on the (empty) whole. Forward and gradient shapes."""
    m = mesh()
    x = torch.zeros(5, 4, 0, 1, 3, 7)
    xs = st.distribute_tensor(x, m, [st.Shard(1)]).requires_grad_()
    out = xs.flatten(1, 3)
    assert tuple(out.shape) == (5, 0, 3, 7)
    (g,) = torch.autograd.grad(out, [xs], torch.zeros(5, 0, 3, 7))
    assert tuple(g.shape) == tuple(x.shape)
    return True


def test_view_of_empty_tensor():
    harness.run(2, case_view_of_empty_tensor)
