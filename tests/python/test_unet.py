"""A small 2-D U-Net (convolutions, group norm, max pooling, bilinear upsampling, skip connections by channel
concatenation) trained for a few steps on a height-sharded field, on 1-D and 2-D meshes: parameters after
training equal single-device training."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import mesh, randn, uneven_extents


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.GELU())
        self.enc2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.GELU())
        self.mid = nn.Conv2d(16, 16, 3, padding=2, dilation=2)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1, padding_mode="reflect"), nn.GELU())
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(e2) + F.interpolate(F.avg_pool2d(e2, 2), scale_factor=2, mode="bilinear", align_corners=False)
        d = self.dec(torch.cat([self.up(m), e1], dim=1))
        return self.out(d)


def case_unet_training(mesh_shape, seed):
    m = mesh(mesh_shape, ("a", "b") if len(mesh_shape) == 2 else None)
    torch.manual_seed(0)
    net, ref = TinyUNet(), TinyUNet()
    ref.load_state_dict(net.state_dict())
    # SGD is linear in the gradients, so rounding differences are not amplified (as Adam would for tiny grads).
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x = randn(2, 2, 16, 12, seed=seed + step)
        target = randn(2, 1, 16, 12, seed=seed + 10 + step)
        if len(mesh_shape) == 1:
            lay = dict(placements=[st.Shard(2)], sharding_shapes={0: [4 * e for e in uneven_extents(4, m.size(), seed + step)]})
        else:
            lay = dict(placements=[st.Shard(2), st.Shard(3)], sharding_shapes={0: [8, 8], 1: [4, 8]})
        xs = st.distribute_tensor(x, m, **lay)
        ts = st.distribute_tensor(target, m, **lay)
        for model, inp, tgt, o in ((net, xs, ts, opt), (ref, x, target, opt_ref)):
            o.zero_grad()
            F.mse_loss(model(inp), tgt).backward()
            o.step()
    for (n, p), (_, r) in zip(net.named_parameters(), ref.named_parameters()):
        assert not st.is_shard_tensor(p)
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5, msg=lambda s: f"{n}: {s}")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_unet_training_1d_mesh(world):
    harness.run(world, case_unet_training, (world,), world)


def test_unet_training_2d_mesh():
    harness.run(4, case_unet_training, (2, 2), 7)
