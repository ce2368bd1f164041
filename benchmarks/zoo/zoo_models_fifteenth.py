"""The model zoo's fifteenth set: neuraloperator beyond its networks (the twentieth session's probe) -- what an
operator-learning training step computes around the FNO on one field too large for a device, split along its first
spatial dim: the relative Lp and Sobolev (H1) losses, the physics losses (Burgers' residual by finite differences,
the initial-condition loss), the finite-difference and spectral derivatives of ``neuralop.losses.differentiation``
(gradient, divergence, curl, Laplacian; periodic and one-sided boundaries; 1-D, 2-D and 3-D), the divergence-free
spectral projection, spectral resampling, the grid embeddings, the finite-difference convolution layer, the attention
kernel integral over a split point set and the data normalizer fitted on the split field; GINO on a split point cloud
(its GNO blocks routed by ``shardtensor.integrations.neuralop_gno``); six FNO configurations the earlier sets did not
build; and three of PhysicsNeMo's experimental xDeepONet models. Calls are wrapped in a module each
(``zoo_models_ninth.register_call``); targets are derived from the input, so they are split alike. Registered like
zoo_models.py's (zoo_models.py imports this module at its end).

Left out:
- Fourier continuation (``FCLegendre``, ``FourierDiff(use_fc=...)``): neuraloperator builds a dense (N + k) x N
  extension matrix from the global length (``torch.zeros`` + ``torch.eye``, N^2 elements on one device too) and
  applies it along the split dim with a mode product -- each rank contracts its own rows into a pending sum, but every
  rank holds the whole matrix, which outweighs the field it extends; its structure (identity plus two boundary blocks)
  is not visible to an op rule.
- neuraloperator's LocalNO / DISCO layers import a private torch-harmonics function that the pinned torch-harmonics
  no longer has (an import error on one device too)."""
import torch

from benchmarks.zoo.zoo_models import model
from benchmarks.zoo.zoo_models_ninth import register_call

_FIELD = (2, 2, 24, 20)       # (B, C, H, W): H split
_FIELD3 = (1, 3, 12, 10, 8)   # (B, C, D, H, W): D split; 3 components for the 3-D curl / divergence
_LINE = (2, 1, 64)            # (B, C, X): X split
_H = (0.1, 0.05)
_H3 = (0.1, 0.05, 0.2)


def _diff():
    from neuralop.losses import differentiation
    return differentiation


def _losses():
    import neuralop.losses as losses
    return losses


def _call(name, make, shape=_FIELD, **kw):
    register_call("neuralop", f"neuralop_ops/{name}", shape, make, **kw)


def _loss(name, make, shape=_FIELD, **kw):
    register_call("neuralop", f"neuralop_losses/{name}", shape, make, spatial_out=False, **kw)


def _target(x):
    return torch.tanh(x.flip(1)) * 0.5 + 0.1


# ---- finite differences (torch.roll for periodic boundaries; one-sided differences written into zeros_like rows)
_call("FiniteDiff_dx_periodic", lambda: _diff().FiniteDiff(dim=2, h=_H).dx)
_call("FiniteDiff_dx2_nonperiodic", lambda: (lambda fd: lambda u: fd.dx(u, order=2))(
    _diff().FiniteDiff(dim=2, h=_H, periodic_in_x=False, periodic_in_y=False)),
    note="second derivative along the split dim with one-sided boundary rows")
_call("FiniteDiff_dy_nonperiodic", lambda: _diff().FiniteDiff(dim=2, h=_H, periodic_in_x=False,
                                                              periodic_in_y=False).dy)
_call("FiniteDiff_laplacian_mixed", lambda: _diff().FiniteDiff(dim=2, h=_H, periodic_in_x=False).laplacian)
_call("FiniteDiff_gradient", lambda: (lambda fd: lambda u: fd.gradient(u).flatten(1, 2))(
    _diff().FiniteDiff(dim=2, h=_H, periodic_in_y=False)))
_call("FiniteDiff_divergence_curl", lambda: (lambda fd: lambda u: torch.stack(
    [fd.divergence(u), fd.curl(u)], 1))(_diff().FiniteDiff(dim=2, h=_H, periodic_in_x=False, periodic_in_y=False)),
    shape=(2, 2, 24, 20), note="a 2-component field: divergence and scalar curl")
_call("FiniteDiff_1d_nonperiodic", lambda: (lambda fd: lambda u: fd.dx(u) + fd.dx(u, order=2))(
    _diff().FiniteDiff(dim=1, h=0.01, periodic_in_x=False)), shape=_LINE)
_call("FiniteDiff_3d_laplacian", lambda: _diff().FiniteDiff(dim=3, h=_H3, periodic_in_x=False).laplacian,
      shape=_FIELD3)
_call("FiniteDiff_3d_divergence_curl", lambda: (lambda fd: lambda u: torch.cat(
    [fd.divergence(u).unsqueeze(1), fd.curl(u)], 1))(_diff().FiniteDiff(dim=3, h=_H3, periodic_in_x=False, periodic_in_z=False)),
    shape=_FIELD3)

# ---- spectral derivatives (FFTs over the split dim; Fourier continuation for non-periodic fields)
_call("FourierDiff_laplacian_2d", lambda: _diff().FourierDiff(dim=2, L=(1.0, 2.0)).laplacian)
_call("FourierDiff_gradient_2d", lambda: (lambda f: lambda u: f.gradient(u[:, :1]).flatten(1, 2))(
    _diff().FourierDiff(dim=2, L=(1.0, 2.0))))
_call("FourierDiff_1d_lowpass", lambda: (lambda f: lambda u: f.dx(u, order=2))(
    _diff().FourierDiff(dim=1, L=2.0, low_pass_filter_ratio=0.5)), shape=_LINE)

# ---- projections, resampling, embeddings
_call("spectral_projection_divergence_free", lambda: (lambda sp: lambda u: sp(u, 1.0, constraint_modes=(6, 6)))(
    __import__("neuralop.layers.spectral_projection",
               fromlist=["spectral_projection_divergence_free"]).spectral_projection_divergence_free))
_call("resample_up", lambda: (lambda r: lambda u: r(u, 2, [2, 3]))(
    __import__("neuralop.layers.resample", fromlist=["resample"]).resample), note="spectral resampling x2")
_call("resample_down", lambda: (lambda r: lambda u: r(u, 0.5, [2, 3]))(
    __import__("neuralop.layers.resample", fromlist=["resample"]).resample))


@model("neuralop", "neuralop_ops/GridEmbeddingND", _FIELD3, note="coordinate channels appended to a 3-D field")
def _():
    from neuralop.layers.embeddings import GridEmbeddingND
    return GridEmbeddingND(in_channels=3, dim=3, grid_boundaries=[[0, 1], [0, 2], [-1, 1]])


@model("neuralop", "neuralop_ops/GridEmbedding2D", _FIELD)
def _():
    from neuralop.layers.embeddings import GridEmbedding2D
    return GridEmbedding2D(in_channels=2, grid_boundaries=[[0, 1], [0, 2]])


@model("neuralop", "neuralop_ops/FiniteDifferenceConvolution", _FIELD, note="learned stencil, periodic padding")
def _():
    from neuralop.layers.differential_conv import FiniteDifferenceConvolution
    return _GridWidth(FiniteDifferenceConvolution(2, 4, n_dim=2, kernel_size=3), 0.05)


class _GridWidth(torch.nn.Module):
    """forward(x) = layer(x, grid_width): a layer that takes the grid spacing as its second argument."""

    def __init__(self, layer, width):
        super().__init__()
        self.layer, self.width = layer, width

    def forward(self, x):
        return self.layer(x, self.width)


class _PointAttention(torch.nn.Module):
    """AttentionKernelIntegral over a point set (B, N, 2 + C): the first two channels are the positions."""

    def __init__(self):
        super().__init__()
        from neuralop.layers.attention_kernel_integral import AttentionKernelIntegral
        self.attn = AttentionKernelIntegral(4, 6, n_heads=2, head_n_channels=4)

    def forward(self, x):
        return self.attn(x[..., 2:], x[..., :2])


@model("neuralop", "neuralop_ops/AttentionKernelIntegral", (2, 40, 6), shard_dims=(1,), spatial=(1,),
       note="linear (associative) attention over the split points")
def _():
    return _PointAttention()


class _Normalized(torch.nn.Module):
    """UnitGaussianNormalizer fitted on the batch (per-channel mean and std over the split field), then applied."""

    def forward(self, x):
        from neuralop.data.transforms.normalizers import UnitGaussianNormalizer
        norm = UnitGaussianNormalizer(dim=[0, 2, 3])
        norm.fit(x)
        return norm.transform(x) + norm.inverse_transform(x * 0.5)


@model("neuralop", "neuralop_ops/UnitGaussianNormalizer", _FIELD, note="fit on the split field, transform")
def _():
    return _Normalized()


# ---- losses
_loss("LpLoss_rel_2d", lambda: (lambda l: lambda u: l(u, _target(u)))(_losses().LpLoss(d=2, p=2)))
_loss("LpLoss_abs_p1_mean", lambda: (lambda l: lambda u: l.abs(u, _target(u)))(
    _losses().LpLoss(d=2, p=1, reduction="mean", measure=[1.0, 2.0])))
_loss("H1Loss_periodic", lambda: (lambda l: lambda u: l(u, _target(u)))(_losses().H1Loss(d=2)))
_loss("H1Loss_nonperiodic_abs", lambda: (lambda l: lambda u: l.abs(u, _target(u)))(
    _losses().H1Loss(d=2, periodic_in_x=False, periodic_in_y=False, reduction="mean")))
_loss("H1Loss_3d", lambda: (lambda l: lambda u: l(u, _target(u)))(_losses().H1Loss(d=3, periodic_in_z=False)),
      shape=_FIELD3)
_loss("BurgersEqnLoss", lambda: _losses().BurgersEqnLoss(visc=0.02), shape=(2, 1, 24, 20),
      note="(B, 1, T, X), T split: the residual by one-sided finite differences in time")
_loss("ICLoss", lambda: (lambda l: lambda u: l(u, _target(u)))(_losses().ICLoss()), shape=(2, 2, 24, 20),
      note="the first time row of the split dim: one rank's rows")
_loss("WeightedSum_Lp_H1", lambda: (lambda l: lambda u: l(u, _target(u)))(
    _losses().WeightedSumLoss([_losses().LpLoss(d=2), _losses().H1Loss(d=2)], [1.0, 0.3])))


# ---- graph neural operators on a split point set (GNOBlock routed: shardtensor.integrations.neuralop_gno)
class _GINOPoints(torch.nn.Module):
    """GINO on a point cloud (N, 2 + 1): the first two channels (squashed into the unit square) are the points'
    positions, the last their input feature; the output is predicted at the same points. The latent grid is the
    model's own 8 x 8 buffer."""

    def __init__(self):
        super().__init__()
        from neuralop.models import GINO
        g = torch.linspace(0, 1, 8)
        self.register_buffer("latent", torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).unsqueeze(0))
        self.net = GINO(in_channels=1, out_channels=2, gno_coord_dim=2, fno_n_modes=(4, 4), fno_hidden_channels=8,
                        fno_n_layers=2, in_gno_radius=0.25, out_gno_radius=0.25, gno_use_open3d=False,
                        gno_use_torch_scatter=False, in_gno_channel_mlp_hidden_layers=[16],
                        out_gno_channel_mlp_hidden_layers=[16], gno_embed_channels=8, fno_in_channels=3)

    def forward(self, x):
        p = torch.sigmoid(x[:, :2]).unsqueeze(0)
        return self.net(input_geom=p, latent_queries=self.latent, output_queries=p, x=x[:, 2:].unsqueeze(0))


@model("neuralop", "neuralop/GINO_points", (600, 3), shard_dims=(0,), spatial=(0,), dtype="float32",
       note="input points and output queries split: GNO-in a pending sum into the latent grid, GNO-out per rank's "
            "queries (float32: the library's segment reduction accumulates in the default dtype)")
def _():
    return _GINOPoints()


# ---- FNO configurations the earlier sets did not build (complex data, group norm with pre-activation, Tucker
# reconstructed weights without a positional grid, per-dim domain padding with a tanh stabiliser, a coarser output, a
# CP-factorised 3-D TFNO with instance norm)
def _fno_variant(**kw):
    from neuralop.models import FNO
    base = dict(n_modes=(8, 8), in_channels=2, out_channels=1, hidden_channels=8, n_layers=2)
    base.update(kw)
    return FNO(**base)


class _Complex(torch.nn.Module):
    """A complex field (the two input channels as real and imaginary parts) through a complex-data FNO."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return torch.view_as_real(self.net(torch.complex(x[:, :1], x[:, 1:])))


@model("neuralop", "neuralop/FNO_complex", (2, 2, 32, 32), dtype="float32",
       note="complex_data=True: complex lifting, spectral convolutions and projection (float32: complex64 weights)")
def _():
    return _Complex(_fno_variant(in_channels=1, complex_data=True))


@model("neuralop", "neuralop/FNO_groupnorm_preact", (2, 2, 32, 32))
def _():
    return _fno_variant(norm="group_norm", preactivation=True, fno_skip="identity", channel_mlp_skip="linear")


@model("neuralop", "neuralop/FNO_tucker_nopos", (2, 2, 32, 32))
def _():
    return _fno_variant(factorization="tucker", rank=0.5, positional_embedding=None, implementation="reconstructed")


@model("neuralop", "neuralop/FNO_domainpad_list", (2, 2, 32, 32))
def _():
    return _fno_variant(domain_padding=[0.125, 0.25], stabilizer="tanh", use_channel_mlp=False)


@model("neuralop", "neuralop/FNO_resscale_half", (2, 2, 32, 32))
def _():
    return _fno_variant(resolution_scaling_factor=0.5)


@model("neuralop", "neuralop/TFNO_cp_3d_instnorm", (1, 2, 16, 16, 16))
def _():
    from neuralop.models import TFNO
    return TFNO(n_modes=(4, 4, 4), in_channels=2, out_channels=1, hidden_channels=8, n_layers=2,
                factorization="cp", rank=0.3, norm="instance_norm")


# ---- PhysicsNeMo's experimental xDeepONet (DeepONet / U-FNO families), channels-last fields split along H
def _materialized(m, shape):
    """``m`` after one forward on zeros: xDeepONet builds lazy layers, which a copy or a parameter count cannot
    touch before."""
    with torch.no_grad():
        m(torch.zeros(shape))
    return m


class _WithTime(torch.nn.Module):
    """forward(x) = net(x, t): a DeepONet with a time trunk evaluated at fixed times."""

    def __init__(self, net, n_t=3):
        super().__init__()
        self.net = net
        self.register_buffer("t", torch.linspace(0, 1, n_t).unsqueeze(-1))

    def forward(self, x):
        return self.net(x, self.t)


@model("physicsnemo", "physicsnemo/xDeepONet_DeepONet_unet_trunk", (2, 16, 16, 5), shard_dims=(1,), spatial=(1, 2),
       note="channels-last (B, H, W, C), H split: a U-Net branch (the 3-D library U-Net on a tiled time axis) and an MLP trunk")
def _():
    from physicsnemo.experimental.models.xdeeponet import DeepONet, SpatialBranch
    from physicsnemo.models.mlp import FullyConnected
    b = SpatialBranch(dimension=2, in_channels=5, width=16, num_unet_layers=1, kernel_size=3, activation_fn="tanh")
    t = FullyConnected(in_features=1, layer_size=16, out_features=16, num_layers=2, activation_fn="sin")
    return _materialized(_WithTime(DeepONet(branch1=b, trunk=t, dimension=2, width=16, out_channels=1,
                                            decoder_type="mlp", decoder_width=16, decoder_layers=2)), (2, 16, 16, 5))


@model("physicsnemo", "physicsnemo/xDeepONet_UFNO3d_trunkless", (1, 16, 16, 4, 2), shard_dims=(1,), spatial=(1, 2, 3),
       note="U-FNO branch with coordinate features, auto-padding and a time-axis extension, no trunk")
def _():
    from physicsnemo.experimental.models.xdeeponet import DeepONet, SpatialBranch
    b = SpatialBranch(dimension=3, in_channels=2, width=8, num_fourier_layers=2, num_unet_layers=0, modes1=4,
                      modes2=4, modes3=2, coord_features=True)
    return _materialized(DeepONet(branch1=b, trunk=None, dimension=3, width=8, out_channels=1, decoder_type="mlp",
                                  decoder_width=8, decoder_layers=2, auto_pad=True, padding=4, time_modes=2),
                         (1, 16, 16, 4, 2))


@model("physicsnemo", "physicsnemo/xDeepONet_FNO_UNet_branch", (2, 16, 16, 3), shard_dims=(1,), spatial=(1, 2),
       note="a 2-D branch of Fourier layers and a U-Net layer (`spectral(x) + conv(x) + unet(x)`): the spectral output's "
            "channel split wins the sum, and the next 1x1 convolution moves it back to space")
def _():
    from physicsnemo.experimental.models.xdeeponet import DeepONet, SpatialBranch
    from physicsnemo.models.mlp import FullyConnected
    b = SpatialBranch(dimension=2, in_channels=3, width=16, num_fourier_layers=2, num_unet_layers=1, modes1=4,
                      modes2=4, kernel_size=3)
    t = FullyConnected(in_features=1, layer_size=16, out_features=16, num_layers=2)
    return _materialized(_WithTime(DeepONet(branch1=b, trunk=t, dimension=2, width=16, out_channels=2,
                                            decoder_type="mlp", decoder_width=16, decoder_layers=1)), (2, 16, 16, 3))
