"""PhysicsNeMo's HEALPix layers (DLWP-HEALPix's building blocks), unmodified, on a sphere whose 12 faces are folded
into the batch and split along H: `HEALPixLayer` convolutions (each face padded with its neighbours' edge rows and
columns, rotated and flipped: `HEALPixPadding`) and `HEALPixMaxPool`. Forward, input and parameter gradients against
one device on 2-4 ranks, with the padding routed (`shardtensor.integrations.physicsnemo_healpix`: one peer exchange
per split mesh dim) and op by op (the module's own code on ShardTensors: its corner patches write `x[..., i, j] = v`
with i along the split dim, which refused on 2 ranks before a select of a scattered copy was taken from its base,
test_write_through.py). The routed padding alone: every layout (H, W, the folded faces, channels; uneven, empty and
one-row shards; 1-4 ranks; 2-D meshes with a 2-D decomposition of every face), values exact, at most one exchange per
split mesh dim, and the routing installed in either import order."""
import copy

import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, uneven_extents

pytest.importorskip("physicsnemo", reason="PhysicsNeMo is an optional test dependency (the zoo's)")


def case_healpix_layers(uneven, routed=True):
    from physicsnemo.nn.module.hpx import padding as hpx
    from shardtensor.integrations.physicsnemo_healpix import padding_forward_sharded
    if not routed:  # the module's own code on ShardTensors (what a dim split by two mesh dims runs)
        st.unregister_function(hpx.HEALPixPadding.forward)
    try:
        return _healpix_layers(uneven)
    finally:
        st.register_function(hpx.HEALPixPadding.forward, padding_forward_sharded)


def _healpix_layers(uneven):
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


@pytest.mark.parametrize("world,uneven,routed", [(2, False, True), (3, True, True), (2, False, False)])
def test_healpix_layers(world, uneven, routed):
    harness.run(world, case_healpix_layers, uneven, routed)


def _padding_case(pad_p, mesh_shape, pl, ext, world_dims, nhwc=False, batch=1, nside=6, channels=3, exchanges=1):
    """HEALPixPadding of a (batch * 12, C, nside, nside) field laid out by ``pl`` against one device: values exact,
    the input gradient, and at most ``exchanges`` exchanges forward (the routing: no other collective)."""
    from physicsnemo.nn.module.hpx.padding import HEALPixPadding
    m = mesh(mesh_shape)
    pad = HEALPixPadding(padding=pad_p, enable_nhwc=nhwc)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch * 12, channels, nside, nside, generator=g, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    y_ref = pad(xr)
    w = torch.randn(y_ref.shape, generator=g, dtype=torch.float64)
    (y_ref * w).sum().backward()
    xs = st.distribute_tensor(x, m, pl, sharding_shapes=ext).requires_grad_()
    with st.use_strict(), st.CommCounter() as c:
        y = pad(xs)
    assert st.placements(y) == tuple(pl), st.placements(y)
    assert set(c.calls) <= {"halo"} and c.calls.get("halo", 0) <= exchanges, c.calls
    assert torch.equal(full(y), y_ref.detach()), "padded values differ from one device"
    if nhwc:
        assert st.to_local(y).is_contiguous(memory_format=torch.channels_last)
    with st.use_strict():
        (y * st.distribute_tensor(w, m, pl, sharding_shapes=st.sharding_shapes(y))).sum().backward()
    close(full(xs.grad), xr.grad, what="input gradient")
    return c.calls.get("halo", 0)


def case_padding_layouts():
    n = st_world = torch.distributed.get_world_size()
    seen = []
    for pad_p in (1, 2):
        # H split: even, uneven with an empty coordinate, and one-row shards narrower than the padding.
        for ext in (None, {0: uneven_extents(6, n, seed=4)}, {0: [0] + [1] * (n - 2) + [8 - n]} if n > 1 else None):
            seen.append(_padding_case(pad_p, None, [st.Shard(2)], ext, 1))
        seen.append(_padding_case(pad_p, None, [st.Shard(3)], {0: uneven_extents(6, n, seed=5)}, 1))   # W split
        seen.append(_padding_case(pad_p, None, [st.Shard(0)], {0: uneven_extents(24, n, seed=6)}, 1, batch=2))  # faces
    _padding_case(1, None, [st.Shard(1)], None, 1, channels=st_world)      # channels only: local
    _padding_case(1, None, [st.Shard(2)], None, 1, nhwc=True)              # channels-last
    assert n == 1 or max(seen) == 1
    return True


def case_padding_2d():
    # A 2x2 mesh: H split on one mesh dim and the channels on the other (one exchange); a 2-D decomposition of every
    # face (H and W, uneven; the faces and W): one exchange per split mesh dim.
    _padding_case(1, (2, 2), [st.Shard(2), st.Shard(1)], {0: [2, 4]}, 2, channels=4)
    _padding_case(2, (2, 2), [st.Shard(1), st.Shard(3)], {1: [5, 1]}, 2, channels=2)
    assert _padding_case(1, (2, 2), [st.Shard(2), st.Shard(3)], None, 2, exchanges=2) == 2
    assert _padding_case(2, (2, 2), [st.Shard(3), st.Shard(2)], {0: [1, 5], 1: [6, 0]}, 2, exchanges=2) == 2
    assert _padding_case(1, (2, 2), [st.Shard(0), st.Shard(3)], {0: [10, 14], 1: [3, 3]}, 2, batch=2,
                         exchanges=2) == 2
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_padding_one_exchange(world):
    harness.run(world, case_padding_layouts)


def test_padding_2d_mesh():
    harness.run(4, case_padding_2d)


def test_padding_routing_import_orders():
    from cases_util import check_integration_routing
    check_integration_routing("shardtensor", "physicsnemo.nn.module.hpx.padding", "physicsnemo.nn.module.hpx.padding",
                              "HEALPixPadding.forward")
    check_integration_routing("physicsnemo.nn.module.hpx.padding", "shardtensor", "physicsnemo.nn.module.hpx.padding",
                              "HEALPixPadding.forward", disabled_too=False)


def case_compiled_layers():
    """torch.compile of HEALPix layers on the split sphere: the routed padding runs eagerly at a graph break (its
    peer exchange and layout reads cannot live in a graph), the convolutions compiled around it; forward and
    gradients equal one device. (Traced op by op, the padding's corner writes through select copies were silently
    lost.) A plain tensor through the same compiled module runs the module's own padding inside the graph."""
    from physicsnemo.nn.module.hpx.layers import HEALPixLayer
    m = mesh()
    torch.manual_seed(0)
    net = torch.nn.Sequential(HEALPixLayer(torch.nn.Conv2d, in_channels=3, out_channels=4, kernel_size=3),
                              torch.nn.GELU(),
                              HEALPixLayer(torch.nn.Conv2d, in_channels=4, out_channels=2, kernel_size=3,
                                           dilation=2)).double()
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, 8, 8, generator=g, dtype=torch.float64)
    xs = st.distribute_tensor(x, m, [st.Shard(2)]).requires_grad_()
    compiled = torch.compile(net, backend="aot_eager")
    y = compiled(xs)
    assert st.placements(y) == (st.Shard(2),)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * st.distribute_tensor(w, m, [st.Shard(2)], sharding_shapes=st.sharding_shapes(y))).sum().backward()
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    (y_ref * w).sum().backward()
    close(full(y), y_ref, what="compiled output")
    close(full(xs.grad), xr.grad, what="compiled input gradient")
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        close(p.grad, pr.grad, what=n)
    close(compiled(x), ref(x), what="compiled, plain input")
    return True


def test_compiled_layers():
    harness.run(2, case_compiled_layers)
