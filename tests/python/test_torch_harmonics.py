"""torch-harmonics' DISCO convolutions on the sphere (src/ops/torch_harmonics_disco.cpp) on a field split along
latitude, unmodified: the contraction kernel and its transpose (torch.ops.disco_kernels.forward / backward and the
custom ops wrapping them), DiscreteContinuousConvS2 and DiscreteContinuousConvTransposeS2 layers (same grid,
downsampling and upsampling), 1-3 ranks with uneven, one-row and empty shards, a 2x2 mesh of batch x latitude;
and its spherical harmonic transforms (RealSHT / InverseRealSHT) over a split latitude.
Each rank computes its own latitude rows from the band of rows its filters reach (one neighbour exchange), nothing
gathered; the outputs, the input gradient and the weight gradient equal one device's. A split longitude declines
to the fallback (the kernel's shift wraps around it). Also: a torch.autograd.Function that takes a plain parameter
beside ShardTensors (torch-harmonics' DISCO layers take their weight that way) gives the parameter a plain
gradient."""
import copy

import pytest
import torch

import harness
import shardtensor as st
from cases_util import full, mesh, shard_of, tiny_extents, uneven_extents

pytest.importorskip("torch_harmonics", reason="torch-harmonics is an optional test dependency (the zoo's)")


def _layer(kind, in_shape, out_shape, cin=3, cout=4):
    import torch_harmonics as th
    torch.manual_seed(0)
    cls = th.DiscreteContinuousConvS2 if kind == "conv" else th.DiscreteContinuousConvTransposeS2
    return cls(cin, cout, in_shape=in_shape, out_shape=out_shape, kernel_shape=(3, 3), basis_type="morlet",
               bias=True).double()


def _check_layer(layer, x, xs, m):
    ref = copy.deepcopy(layer)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr)
    w = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)
    (out_ref * w).sum().backward()
    xs = xs.detach().requires_grad_()
    with st.CommCounter() as c:
        out = layer(xs)
        (out * st.distribute_tensor(w, m, st.placements(out), sharding_shapes=st.sharding_shapes(out))).sum().backward()
    assert not any(k.startswith("fallback") for k in c.calls), c.calls
    torch.testing.assert_close(full(out), out_ref)
    torch.testing.assert_close(full(xs.grad), xr.grad)
    for (n, p), (_, pr) in zip(layer.named_parameters(), ref.named_parameters()):
        assert not st.is_shard_tensor(p.grad), n
        torch.testing.assert_close(p.grad, pr.grad, msg=n)
    return out


def case_disco_layers(kind):
    m, w = mesh(), mesh().size()
    g = torch.Generator().manual_seed(1)
    ext = (lambda n, s: tiny_extents(n, w)) if kind == "tiny" else (lambda n, s: uneven_extents(n, w, seed=s))
    layouts = []
    for layer_kind, in_shape, out_shape in (("conv", (12, 24), (12, 24)), ("conv", (12, 24), (6, 12)),
                                            ("transpose", (6, 12), (12, 24)), ("transpose", (12, 24), (12, 24))):
        layer = _layer(layer_kind, in_shape, out_shape)
        x = torch.randn(2, 3, *in_shape, generator=g, dtype=torch.float64)
        xs = shard_of(x, m, [st.Shard(2)], {0: ext(in_shape[0], in_shape[1])})
        out = _check_layer(layer, x, xs, m)
        layouts.append(str(st.placements(out)))
    return layouts


@pytest.mark.parametrize("world,kind", [(1, "uneven"), (2, "uneven"), (3, "tiny")])
def test_disco_layers(world, kind):
    for layouts in harness.run(world, case_disco_layers, kind):
        # the output keeps the latitude split (a 1-rank mesh keeps its trivial one)
        assert all("Shard(2)" in p for p in layouts), layouts


def case_disco_kernels():
    """The kernels themselves on a 2x2 mesh (batch x latitude) against one device, and a split longitude through the
    fallback."""
    import torch_harmonics as th
    m = mesh((2, 2))
    conv = _layer("conv", (10, 16), (5, 8)).float()
    x = torch.randn(2, 3, 10, 16, generator=torch.Generator().manual_seed(2))
    psi = (conv.psi_roff_idx, conv.psi_ker_idx, conv.psi_row_idx, conv.psi_col_idx, conv.psi_vals)
    ref = torch.ops.disco_kernels.forward(x, *psi, conv.kernel_size, 5, 8)
    xs = shard_of(x, m, [st.Shard(0), st.Shard(2)], {1: [7, 3]})
    with st.CommCounter() as c:
        got = torch.ops.disco_kernels.forward(xs, *psi, conv.kernel_size, 5, 8)
    assert not any(k.startswith("fallback") for k in c.calls), c.calls
    assert st.placements(got) == (st.Shard(0), st.Shard(3)), st.placements(got)
    torch.testing.assert_close(full(got), ref)
    back_ref = torch.ops.disco_kernels.backward(ref, *psi, conv.kernel_size, 10, 16)
    back = torch.ops.disco_kernels.backward(got, *psi, conv.kernel_size, 10, 16)
    assert st.placements(back) == (st.Shard(0), st.Shard(2)), st.placements(back)
    torch.testing.assert_close(full(back), back_ref)
    # longitude split: declined (the shift wraps around longitude), correct through the fallback
    xw = shard_of(x, m, [st.Replicate(), st.Shard(3)], {})
    with st.CommCounter() as c:
        torch.testing.assert_close(full(torch.ops.disco_kernels.forward(xw, *psi, conv.kernel_size, 5, 8)), ref)
    assert c.calls.get("fallback_all_gather"), c.calls
    del th
    return True


def test_disco_kernels_2d_mesh():
    assert all(harness.run(4, case_disco_kernels))


class _ScaleBy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(dim=(0, 2), keepdim=True)


def case_function_plain_param():
    m = mesh()
    x = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(4))
    w = torch.randn(1, 3, 1, generator=torch.Generator().manual_seed(5)).requires_grad_()
    wr = w.detach().clone().requires_grad_()
    _ScaleBy.apply(x, wr).sum().backward()
    xs = shard_of(x, m, [st.Shard(2)], {0: uneven_extents(7, m.size(), seed=1)})
    _ScaleBy.apply(xs, w.view(1, 3, 1)).sum().backward()   # a view of the parameter, as torch-harmonics passes it
    assert not st.is_shard_tensor(w.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_function_plain_param_grad(world):
    assert all(harness.run(world, case_function_plain_param))


def case_spherical_harmonic_transform(kind):
    """torch-harmonics' RealSHT / InverseRealSHT of a latitude-split field: the forward Legendre contraction over
    the split latitude is a pending sum (no communication), the spectral ops keep it pending, and the inverse
    transform's FFT completes it onto latitude (one reduce-scatter): the field comes back split along latitude
    (no rank holds it whole), and it and its gradient equal one device's."""
    import torch_harmonics as th
    m, w = mesh(), mesh().size()
    sht, isht = th.RealSHT(12, 24, grid="equiangular"), th.InverseRealSHT(12, 24, grid="equiangular")
    x = torch.randn(2, 3, 12, 24, generator=torch.Generator().manual_seed(6))
    ext = tiny_extents(12, w) if kind == "tiny" else uneven_extents(12, w, seed=3)
    xr = x.clone().requires_grad_()
    ref = isht(sht(xr) * 0.5)
    ref.square().sum().backward()
    xs = shard_of(x, m, [st.Shard(2)], {0: ext}).requires_grad_()
    with st.CommCounter() as c:
        coeffs = sht(xs)
    assert not c.calls, c.calls
    out = isht(coeffs * 0.5)
    assert st.placements(out) == (st.Shard(2),), st.placements(out)
    torch.testing.assert_close(full(out), ref, rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    torch.testing.assert_close(full(xs.grad), xr.grad, rtol=1e-4, atol=1e-5)
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_spherical_harmonic_transform(world, kind):
    assert all(harness.run(world, case_spherical_harmonic_transform, kind))


def case_neighborhood_attention(kind):
    """torch-harmonics' NeighborhoodAttentionS2 (self-attention and downsampling cross-attention, 2 heads, q/k
    normalisation) on latitude-split inputs: each rank attends from its own query rows to the band of key/value
    rows their neighbourhoods reach (one exchange), torch-harmonics' own kernel and backward; outputs, input and
    parameter gradients equal one device's; nothing through the fallback."""
    import torch_harmonics as th
    m, w = mesh(), mesh().size()
    g = torch.Generator().manual_seed(7)
    tol = dict(rtol=1e-5, atol=1e-6)  # torch-harmonics attends in float32 whatever the input's dtype
    ext = (lambda n, s: tiny_extents(n, w)) if kind == "tiny" else (lambda n, s: uneven_extents(n, w, seed=s))
    for in_shape, out_shape, use_qknorm in (((10, 20), (10, 20), False), ((12, 24), (6, 12), True)):
        def build():  # twice from one seed: the layer holds a torch.ops namespace, which deepcopy refuses
            torch.manual_seed(0)
            return th.NeighborhoodAttentionS2(4, in_shape, out_shape, num_heads=2, use_qknorm=use_qknorm,
                                              optimized_kernel=False).double()
        att, ref = build(), build()
        q = torch.randn(2, 4, *out_shape, generator=g, dtype=torch.float64)
        kv = torch.randn(2, 4, *in_shape, generator=g, dtype=torch.float64)
        qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out_ref = ref(qr, kvr, kvr) if in_shape != out_shape else ref(qr)
        wgt = torch.randn(out_ref.shape, generator=g, dtype=torch.float64)
        (out_ref * wgt).sum().backward()
        qs = shard_of(q, m, [st.Shard(2)], {0: ext(out_shape[0], 1)}).requires_grad_()
        kvs = shard_of(kv, m, [st.Shard(2)], {0: ext(in_shape[0], 2)}).requires_grad_()
        with st.CommCounter() as c:
            out = att(qs, kvs, kvs) if in_shape != out_shape else att(qs)
            (out * st.distribute_tensor(wgt, m, st.placements(out), sharding_shapes=st.sharding_shapes(out))).sum() \
                .backward()
        assert not any(k.startswith("fallback") for k in c.calls), c.calls
        assert st.placements(out) == (st.Shard(2),), st.placements(out)
        torch.testing.assert_close(full(out), out_ref, **tol)
        torch.testing.assert_close(full(qs.grad), qr.grad, **tol)
        if in_shape != out_shape:
            torch.testing.assert_close(full(kvs.grad), kvr.grad, **tol)
        for (n, p), (_, pr) in zip(att.named_parameters(), ref.named_parameters()):
            assert not st.is_shard_tensor(p.grad), n
            torch.testing.assert_close(p.grad, pr.grad, msg=n, **tol)
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_neighborhood_attention(world, kind):
    assert all(harness.run(world, case_neighborhood_attention, kind))


@pytest.mark.parametrize("first", ["torch_harmonics", "shardtensor"])
def test_disco_layers_routed_in_either_import_order(first):
    """The DISCO layers' forward is routed to its own body (for torch.compile: shardtensor.integrations.
    torch_harmonics_disco) whichever library is imported first; SHARDTENSOR_NO_INTEGRATIONS=1 leaves it."""
    from cases_util import check_integration_routing
    second = "shardtensor" if first == "torch_harmonics" else "torch_harmonics"
    check_integration_routing(first, second, "torch_harmonics.disco.convolution", "DiscreteContinuousConvS2.forward",
                              disabled_too=first == "shardtensor")
