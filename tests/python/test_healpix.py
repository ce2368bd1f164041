"""PhysicsNeMo's HEALPix layers (DLWP-HEALPix's building blocks), unmodified, on a sphere whose 12 faces are folded
into the batch and split along H: `HEALPixLayer` convolutions (each face padded with its neighbours' edge rows and
columns, rotated and flipped: `HEALPixPadding`) and `HEALPixMaxPool`. Forward, input and parameter gradients against
one device on 2-4 ranks. The padding's corner patches write `x[..., i, j] = v` with i along the split dim, which
refused on 2 ranks before a select of a scattered copy was taken from its base (test_write_through.py)."""
import copy

import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, uneven_extents

pytest.importorskip("physicsnemo", reason="PhysicsNeMo is an optional test dependency (the zoo's)")


def case_healpix_layers(uneven):
    from physicsnemo.nn.module.hpx.layers import HEALPixLayer
    from physicsnemo.nn.module.hpx.pool import HEALPixMaxPool
    m = mesh()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        HEALPixLayer(torch.nn.Conv2d, in_channels=3, out_channels=6, kernel_size=3), torch.nn.GELU(),
        HEALPixMaxPool(pooling=2),
        HEALPixLayer(torch.nn.Conv2d, in_channels=6, out_channels=4, kernel_size=3, dilation=2)).double()
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, 8, 8, generator=g, dtype=torch.float64)   # nside 8, 12 faces, one sample
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    w = torch.randn(y_ref.shape, generator=g, dtype=torch.float64)
    (y_ref * w).sum().backward()
    ext = {0: uneven_extents(8, m.size(), seed=2)}
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes=ext if uneven else None).requires_grad_()
    y = net(xs)
    assert st.placements(y) == (st.Shard(2),)
    close(full(y), y_ref, what="output")
    (y * st.distribute_tensor(w, m, [st.Shard(2)], sharding_shapes=st.sharding_shapes(y))).sum().backward()
    close(full(xs.grad), xr.grad, what="input gradient")
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        close(full(p.grad), pr.grad, what=n)
    return True


@pytest.mark.parametrize("world,uneven", [(2, False), (3, True)])
def test_healpix_layers(world, uneven):
    harness.run(world, case_healpix_layers, uneven)
