"""bfloat16 / float16 inputs through rules whose local kernels or results differ from float32's, against one device,
found by the OpInfo probe's bfloat16 samples (benchmarks/results/op_sweep_samples/README.md): torch kernels that fail
on a rank's block shape but not on the whole tensor, and result dtypes that follow the device."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import close, full, mesh


def _close_lp(a, b, what):
    """Within a few units of bfloat16's rounding of the largest value."""
    tol = 3e-2 * float(b.abs().max())
    close(a.float(), b.float(), rtol=0, atol=tol, what=what)


def case_transposed_conv_bf16():
    """A transposed 3-D convolution split along depth and width on a 2x2 mesh, a rank's block one column wide: torch's
    CPU bfloat16 backward (oneDNN) returned input gradients ~1e14 for that block's shape (right for the whole
    tensor's); the rule computes those local gradients in float and rounds once."""
    m = mesh((2, 2))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 4, 4, generator=g)
    w = torch.randn(3, 3, 3, 3, 3, generator=g)
    kw = dict(stride=2, padding=2, output_padding=1)
    xr = x.bfloat16().requires_grad_()
    xs = st.distribute_tensor(x.bfloat16(), m, [st.Shard(1), st.Shard(3)], {0: [3, 1], 1: [3, 1]}).requires_grad_()
    ref = F.conv_transpose3d(xr, w.bfloat16(), **kw)
    out = F.conv_transpose3d(xs, w.bfloat16(), **kw)
    _close_lp(full(out), ref, "forward")
    cot = torch.randn(ref.shape, generator=g).bfloat16()
    gr, = torch.autograd.grad(ref, [xr], cot)
    gs, = torch.autograd.grad(out, [xs], st.distribute_tensor(cot, m, st.placements(out), st.sharding_shapes(out)))
    assert gs.dtype == torch.bfloat16
    _close_lp(full(gs), gr, "input gradient")
    return True


def test_transposed_conv_bf16():
    harness.run(4, case_transposed_conv_bf16)


def case_conv3d_short_blocks_bf16(world):
    """A 3-D convolution (kernel 3, padding 1) split along depth into blocks of two rows: torch's CPU bfloat16 weight
    gradient (oneDNN) of a (N, C, 2, H, W) input is off by up to 1e30 or NaN (right for the whole tensor's depth),
    and the window-free backward's border slabs are that short whatever the shards; the rule computes such local
    gradients in float and rounds once. MONAI's UNETR and MedNeXt, diffusers' temporal blocks under autocast."""
    m = mesh((world,))
    g = torch.Generator().manual_seed(world)
    x = torch.randn(1, 32, 2 * world, 4, 4, generator=g)
    w = (torch.randn(16, 32, 3, 3, 3, generator=g) * 0.1).bfloat16()
    b = torch.randn(16, generator=g).bfloat16()
    wr, ws = w.clone().requires_grad_(), w.clone().requires_grad_()
    xr = x.bfloat16().requires_grad_()
    xs = st.distribute_tensor(x.bfloat16(), m, [st.Shard(2)]).requires_grad_()
    ref = F.conv3d(xr, wr, b, padding=1)
    out = F.conv3d(xs, ws, b, padding=1)
    _close_lp(full(out), ref, "forward")
    cot = torch.randn(ref.shape, generator=g).bfloat16()
    ref.backward(cot)
    out.backward(st.distribute_tensor(cot, m, st.placements(out), st.sharding_shapes(out)))
    exact = torch.ops.aten.convolution_backward(cot.float(), x, w.float(), None, [1] * 3, [1] * 3, [1] * 3, False,
                                                [0] * 3, 1, [False, True, False])[1]
    _close_lp(ws.grad, exact, "weight gradient")
    _close_lp(full(xs.grad), xr.grad, "input gradient")
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_conv3d_short_blocks_bf16(world):
    harness.run(world, case_conv3d_short_blocks_bf16, world)


def case_layer_norm_stats_dtype(mesh_shape):
    """native_layer_norm over normalized dims split across ranks: the saved mean / rstd in the dtype the device's kernel
    returns (the input's on CPU), as on one device; values within rounding."""
    m = mesh(mesh_shape)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 5, generator=g).bfloat16()
    lay = ([st.Shard(1)], None) if len(mesh_shape) == 1 else ([st.Shard(1), st.Shard(2)], None)
    xs = st.distribute_tensor(x, m, *lay)
    got = torch.native_layer_norm(xs, (6, 5), None, None, 1e-5)
    want = torch.native_layer_norm(x, (6, 5), None, None, 1e-5)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, f"output {i}: {a.dtype} vs one device's {b.dtype}"
        _close_lp(full(a), b, f"output {i}")
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_layer_norm_stats_dtype(mesh_shape):
    harness.run(2 if len(mesh_shape) == 1 else 4, case_layer_norm_stats_dtype, mesh_shape)


def case_index_reduce_prod_half():
    """index_reduce(prod) of a row-split bfloat16 / float16 tensor along its other dim: torch's half-precision prod
    kernel fails an internal assert on a one-row block ((1, 5): the whole (5, 5) runs), so that rank raised alone and
    the next collective paired different messages; the rule multiplies in float."""
    m = mesh()
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 5, (10,), generator=g)
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(5, 5, generator=g).to(dt)
        src = torch.randn(5, 10, generator=g).to(dt)
        xs = st.distribute_tensor(x, m, [st.Shard(0)], {0: [4, 1]})
        got = xs.index_reduce(1, idx, src, "prod", include_self=True)
        _close_lp(full(got), x.index_reduce(1, idx, src, "prod", include_self=True), f"{dt} index_reduce prod")
    return True


def test_index_reduce_prod_half():
    harness.run(2, case_index_reduce_prod_half)
