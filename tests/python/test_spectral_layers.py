"""Fourier layers on a split field with their own spectrum buffers laid out like the transformed field
(``shardtensor.integrations.spectral_buffers``), against one device: neuraloperator's ``SpectralConv``
(``neuralop_spectral``) and PhysicsNeMo's ``SpectralConv1d``-``3d`` and AFNO layers and DPOT's AFNO mixers (``physicsnemo_spectral``). Each
layer's output stays a ShardTensor split along some dim (with a plain global-size buffer written by slices it was a
plain tensor on every rank: the inverse transform and the rest of the layer ran whole). Forward, input gradient and
every parameter gradient (complex weights); 1-D, 2-D and 3-D layers, truncated and full mode counts, separable and
factorised weights, complex data, more output than input channels, AFNO's block-diagonal mixing with a modulation;
uneven and one-row shards, 2-3 ranks, a 2x2 mesh; a whole FNO eager and compiled; the routing in either import
order."""
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

import harness
import shardtensor as st
from cases_util import check_integration_routing, close, full, mesh, needs_library, tiny_extents, uneven_extents

needs_neuralop = needs_library("neuralop", "neuraloperator")
needs_physicsnemo = needs_library("physicsnemo", "PhysicsNeMo")

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _f64(module):
    """float64 for real parameters, complex128 for the spectral weights (``.double()`` leaves complex ones alone)."""
    for p in module.parameters():
        p.data = p.data.to(torch.complex128 if p.is_complex() else D)
    return module


_FFTS = {getattr(torch.fft, n) for n in dir(torch.fft) if "fft" in n}


class _PlainTransforms(TorchFunctionMode):
    """The torch.fft functions whose result was a plain tensor (the transform ran on the whole field on every rank)."""

    def __init__(self):
        super().__init__()
        self.plain = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FFTS and isinstance(out, torch.Tensor) \
                and not st.is_shard_tensor(out):
            self.plain.append(func.__name__)
        return out


def _compare(make, shape, placements, extents=None, compiled=False, complex_data=False, extra=(), tol=TOL,
             layer_type=None, dtype=D):
    """``make()`` on the full input against a copy on the input split by ``placements``: output (a ShardTensor, split
    along some dim), input gradient and every parameter gradient. ``extra``: further (plain) arguments;
    ``layer_type``: the class whose every instance's output must be split (default: neuraloperator's SpectralConv);
    ``dtype``: the input's and the real parameters' (float64; the spectral weights then complex128)."""
    m = mesh() if len(placements) == 1 else mesh((2, 2))
    torch.manual_seed(0)
    ref = _f64(make()) if dtype == D else make()
    net = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, dtype=dtype, generator=g)
    if complex_data:
        x = torch.complex(x, torch.randn(*shape, dtype=dtype, generator=g))
    xr = x.clone().requires_grad_()
    xs = st.distribute_tensor(x, m, placements, sharding_shapes=extents).requires_grad_()
    y_ref = ref(xr, *extra)
    if layer_type is None:
        from neuralop.layers.spectral_convolution import SpectralConv as layer_type
    split = []
    if not compiled:     # every spectral layer's own output split (an FNO's output is split through its skips anyway)
        for mod in net.modules():
            if isinstance(mod, layer_type):
                mod.register_forward_hook(lambda _m, _a, out: split.append(
                    st.is_shard_tensor(out) and any(p.is_shard() for p in st.placements(out))))
    if compiled:
        y = torch.compile(net, backend="aot_eager")(xs, *extra)
    else:
        with _PlainTransforms() as transforms:
            y = net(xs, *extra)
        assert not transforms.plain, f"transforms ran whole on every rank (plain results): {transforms.plain}"
    assert all(split), f"a spectral layer's output is not split: {split}"
    assert st.is_shard_tensor(y) and any(p.is_shard() for p in st.placements(y)), \
        "the layer's output is not split (the spectrum was made whole)"
    close(full(y), y_ref, what="output", **tol)
    w = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(2))
    (y_ref * w).real.sum().backward()
    (y * st.distribute_tensor(w, m, st.placements(y), sharding_shapes=st.sharding_shapes(y))).real.sum().backward()
    close(full(xs.grad), xr.grad, what="input gradient", **tol)
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        close(full(p.grad), pr.grad, what=n, **tol)
    return True


def _conv(in_ch=3, out_ch=5, modes=(4, 3), **kw):
    from neuralop.layers.spectral_convolution import SpectralConv
    return lambda: SpectralConv(in_ch, out_ch, n_modes=modes, **kw)


def _extents(kind):
    w = mesh().size()
    return (lambda n: {0: tiny_extents(n, w)}) if kind == "tiny" else (lambda n: {0: uneven_extents(n, w, seed=n)})


def case_neuralop_layers(kind):
    ext = _extents(kind)
    _compare(_conv(), (2, 3, 12, 10), [st.Shard(2)], ext(12))                          # 2-D, split H
    _compare(_conv(), (2, 3, 12, 10), [st.Shard(3)], ext(10))                          # 2-D, split W
    _compare(_conv(modes=(12, 10)), (2, 3, 12, 10), [st.Shard(2)], ext(12))            # every mode kept
    _compare(_conv(modes=(5,)), (2, 3, 14), [st.Shard(2)], ext(14))                    # 1-D
    _compare(_conv(modes=(4, 4, 3)), (1, 3, 8, 6, 6), [st.Shard(2)], ext(8))           # 3-D
    _compare(_conv(in_ch=4, out_ch=4, separable=True), (2, 4, 12, 10), [st.Shard(2)], ext(12))
    _compare(_conv(factorization="tucker", rank=0.5, implementation="reconstructed"), (2, 3, 12, 10),
             [st.Shard(2)], ext(12))
    _compare(_conv(complex_data=True), (2, 3, 12, 10), [st.Shard(2)], ext(12), complex_data=True)
    return True


F32 = dict(tol=dict(rtol=1e-4, atol=1e-5), dtype=torch.float32)     # PhysicsNeMo's layers compute in complex64


def case_physicsnemo_layers(kind):
    from physicsnemo.nn.module import afno_layers, spectral_layers
    ext = _extents(kind)
    for make, shape, dim in ((lambda: spectral_layers.SpectralConv1d(3, 4, 5), (2, 3, 14), 2),
                             (lambda: spectral_layers.SpectralConv2d(3, 4, 4, 3), (2, 3, 12, 10), 2),
                             (lambda: spectral_layers.SpectralConv3d(2, 3, 3, 3, 2), (1, 2, 8, 6, 6), 2)):
        _compare(make, shape, [st.Shard(dim)], ext(shape[dim]), **F32, layer_type=torch.nn.Module)
    # AFNO (B, H, W, C): split H; channels in 4 blocks, all modes and a hard threshold.
    for fraction in (1.0, 0.5):
        _compare(lambda: afno_layers.AFNO2DLayer(8, num_blocks=4, hard_thresholding_fraction=fraction),
                 (2, 12, 10, 8), [st.Shard(1)], ext(12), **F32, layer_type=afno_layers.AFNO2DLayer)
    # DPOT's AFNO mixers (channels last): 2-D split H, 3-D split X.
    from physicsnemo.models.dpot import dpot, dpot3d
    _compare(lambda: dpot.DPOT2DLayer(width=8, num_blocks=4, modes=4), (2, 12, 10, 8), [st.Shard(1)], ext(12),
             **F32, layer_type=dpot.DPOT2DLayer)
    _compare(lambda: dpot3d.AFNO3DLayer(width=8, num_blocks=4, modes=3, temporal_modes=3, channel_first=False), (1, 8, 6, 6, 8), [st.Shard(1)], ext(8),
             **F32, layer_type=dpot3d.AFNO3DLayer)
    mod = torch.randn(2, 5, generator=torch.Generator().manual_seed(3))
    _compare(lambda: afno_layers.ModAFNO2DLayer(8, 5, num_blocks=4), (2, 12, 10, 8), [st.Shard(1)], ext(12),
             extra=(mod,), **F32, layer_type=afno_layers.AFNO2DLayer)
    return True


def case_mesh_2d():
    _compare(_conv(), (2, 3, 12, 10), [st.Shard(0), st.Shard(2)])       # batch x H
    return True


def case_fno(compiled):
    from neuralop.models import FNO
    _compare(lambda: FNO(n_modes=(6, 5), in_channels=1, out_channels=2, hidden_channels=6, n_layers=2),
             (2, 1, 16, 12), [st.Shard(2)], {0: [10, 6]}, compiled=compiled)
    return True


@needs_neuralop
@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_neuralop_layers(world, kind):
    harness.run(world, case_neuralop_layers, kind)


@needs_physicsnemo
@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_physicsnemo_layers(world, kind):
    harness.run(world, case_physicsnemo_layers, kind)


@needs_neuralop
def test_spectral_conv_2d_mesh():
    harness.run(4, case_mesh_2d)


@needs_neuralop
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fno(compiled):
    harness.run(2, case_fno, compiled)


@needs_neuralop
@pytest.mark.parametrize("first", ["neuralop", "shardtensor"])
def test_routing_installed_in_either_import_order(first):
    """SpectralConv.forward is routed whichever library is imported first; SHARDTENSOR_NO_INTEGRATIONS=1 leaves it."""
    second = "shardtensor" if first == "neuralop" else "neuralop"
    check_integration_routing(first, second, "neuralop.layers.spectral_convolution", "SpectralConv.forward",
                              disabled_too=first == "shardtensor")


@needs_physicsnemo
def test_physicsnemo_routing_installed():
    """AFNO2DLayer.forward is routed when PhysicsNeMo's AFNO layers are imported after shardtensor."""
    check_integration_routing("shardtensor", "physicsnemo.nn.module.afno_layers", "physicsnemo.nn.module.afno_layers",
                              "AFNO2DLayer.forward", disabled_too=False)
