"""ShardTensors under torch.inference_mode, as inference scripts run a trained model on a large sharded input.

Inside inference mode a view of a normal tensor stays a normal tensor (autograd's ADInplaceOrView gives it its base's
version counter), while computed results are inference tensors (no version counter). A ShardTensor wrapper follows
its local tensor; caches keyed by a tensor's version (grid_sample's data windows, torch-harmonics' plans) do not
cache inference tensors. Found by the zoo with SHARDTENSOR_ZOO_EVAL=inference_mode (every model's eval forward raised
"Cannot set version_counter for inference tensor" at `xs.detach()`)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import full, mesh, randn, uneven_extents


def case_views_of_normal_tensors(seed):
    m = mesh()
    x = randn(2, 3, 11, 6, seed=seed)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(11, m.size(), seed)})
    for requires_grad in (False, True):
        xs.requires_grad_(requires_grad)
        with torch.inference_mode():
            for view in (xs.detach(), xs.detach().view(2, 3, 11, 6), xs.detach()[:, 1:], xs.detach().transpose(1, 3)):
                # A view of a normal tensor is a normal tensor sharing its base's version counter.
                assert not view.is_inference(), "a view of a normal ShardTensor became an inference tensor"
            d = xs.detach()
            before = d._version
            d.mul_(1.0)  # an in-place write through the view bumps the shared counter, as on plain tensors
            assert xs._version == before + 1 and d._version == before + 1
            y = xs * 2 + 1
            assert y.is_inference(), "a computed ShardTensor under inference mode should be an inference tensor"
            y.add_(1)  # inference tensors take in-place writes inside inference mode
            assert st.is_shard_tensor(y)
        torch.testing.assert_close(full(y), x * 2 + 2)
        xs.requires_grad_(False)
    # Views whose rule computes its local result (a row of the split dim, a merge that gathers the split dim, windows
    # across shards): still normal views of a normal base, with the single-device values (neuralop's finite
    # differences `u[..., 0]`, smp's `reshape(bs, 1, -1)` of a W-split map, kornia's `unfold` patches).
    xw = st.distribute_tensor(x, m, [st.Shard(3)], sharding_shapes={0: uneven_extents(6, m.size(), seed + 1)})
    with torch.inference_mode():
        base = xw.detach()
        views = {"select": base[..., 0], "last row": base[..., -1], "reshape": base.reshape(2, 1, -1),
                 "unfold": base.unfold(3, 3, 2), "unbind": base.unbind(3)[1]}
        for name, v in views.items():
            assert not v.is_inference(), f"{name}: a view of a normal ShardTensor became an inference tensor"
        dx = base * 2.0  # computed: an inference tensor, written through a row as finite differences do
        dx[..., 0] = base[..., 1] - base[..., 0]
    expect = {"select": x[..., 0], "last row": x[..., -1], "reshape": x.reshape(2, 1, -1), "unfold": x.unfold(3, 3, 2),
              "unbind": x.unbind(3)[1]}
    for name, v in views.items():
        torch.testing.assert_close(full(v), expect[name], msg=lambda e: f"{name}: {e}")
    dx_ref = x * 2.0
    dx_ref[..., 0] = x[..., 1] - x[..., 0]
    torch.testing.assert_close(full(dx), dx_ref)
    return True


class _Net(nn.Module):
    """Convolutions, a normalization, pooling, upsampling, a grid_sample warp by its own field, attention over the
    tokens of the sharded rows: the eval forward of a trained model, its input detached inside inference mode."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 2, 3, padding=1)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = F.relu(self.norm(self.conv1(x)))
        h = F.interpolate(F.max_pool2d(h, 2), scale_factor=2, mode="bilinear", align_corners=False)
        flow = torch.tanh(self.conv2(h)).permute(0, 2, 3, 1) * 0.2
        base = F.affine_grid(torch.eye(2, 3, dtype=x.dtype).unsqueeze(0).expand(x.shape[0], 2, 3), list(x.shape),
                             align_corners=False)
        warped = F.grid_sample(h, base + flow, align_corners=False)
        tokens = warped.flatten(2).transpose(1, 2)
        return self.attn(tokens, tokens, tokens, need_weights=False)[0]


def case_model_eval(seed):
    m = mesh()
    x = randn(2, 3, 12, 10, seed=seed)
    torch.manual_seed(seed)
    net = _Net().eval()
    with torch.no_grad():
        ref = net(x)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(12, m.size(), seed)})
    xs.requires_grad_()  # a training step's input: the script detaches it for evaluation
    for _ in range(2):   # the second call meets what the first one cached
        with torch.inference_mode():
            out = net(xs.detach())
        assert out.is_inference()
        torch.testing.assert_close(full(out), ref, rtol=1e-5, atol=1e-5)
    return True


def case_grid_sample_field_changed_in_place(seed):
    """grid_sample's windows are cached per (grid, input) by version for the backward; an inference tensor has no
    version and may change in place inside inference mode, so its windows are computed every call."""
    m = mesh()
    x = randn(1, 2, 9, 8, seed=seed)
    g = torch.rand(1, 9, 8, 2, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    lay = {0: uneven_extents(9, m.size(), seed)}
    with torch.inference_mode():
        xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes=lay)
        gs = st.distribute_tensor(g, m, [st.Shard(1)], sharding_shapes=lay)
        first = F.grid_sample(xs, gs, align_corners=True)
        gs.mul_(-0.5)  # the same tensor, other values
        second = F.grid_sample(xs, gs, align_corners=True)
    torch.testing.assert_close(full(first), F.grid_sample(x, g, align_corners=True))
    torch.testing.assert_close(full(second), F.grid_sample(x, g * -0.5, align_corners=True))
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_views_of_normal_tensors(world):
    harness.run(world, case_views_of_normal_tensors, world)


@pytest.mark.parametrize("world", [2, 3])
def test_model_eval(world):
    harness.run(world, case_model_eval, world)


@pytest.mark.parametrize("world", [2, 3])
def test_grid_sample_field_changed_in_place(world):
    harness.run(world, case_grid_sample_field_changed_in_place, world)
