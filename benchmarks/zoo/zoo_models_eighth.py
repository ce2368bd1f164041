"""The model zoo's eighth set: spherical neural operators for global weather and climate fields on a
latitude-longitude grid (the seventeenth session's probe), split along latitude: torch-harmonics' Spherical Fourier
Neural Operator (the forward and inverse spherical harmonic transforms: an FFT along longitude and a Legendre
contraction over latitude, a sum over the split dim), its local variant (DISCO convolutions on the sphere), its
U-Net, Segformer and Transformer (neighbourhood attention on the sphere), and neuraloperator's SFNO. Registered like
zoo_models.py's (zoo_models.py imports this module at its end). DISCO convolutions and neighbourhood attention
need longitude whole (their kernels shift along it, wrapping around): those models declare latitude their only
spatial dim, so a 2-D mesh splits batch and latitude. torch-harmonics' models run in float32: their
precomputed filter bases and transform matrices stay float32 whatever the module's dtype."""
import torch  # noqa: F401

from benchmarks.zoo.zoo_models import model

_GRID = (16, 32)  # (latitude, longitude)


def _th(cls_name, **kw):
    import torch_harmonics.examples.models as models
    return getattr(models, cls_name)(img_size=_GRID, in_chans=3, out_chans=3, **kw)


@model("torch_harmonics", "torch_harmonics/SFNO", (2, 3) + _GRID, dtype="float32", note="spherical harmonic transforms over a split "
       "latitude: FFT along longitude, Legendre contraction over latitude")
def _():
    return _th("SphericalFourierNeuralOperator", embed_dim=16, num_layers=2, scale_factor=2, pos_embed="none")


@model("torch_harmonics", "torch_harmonics/LSNO", (2, 3) + _GRID, spatial=(2,), dtype="float32", note="local DISCO convolutions on the sphere "
       "beside SFNO blocks")
def _():
    return _th("LocalSphericalNeuralOperator", embed_dim=16, num_layers=2, scale_factor=2)


@model("torch_harmonics", "torch_harmonics/SphericalUNet", (2, 3) + _GRID, spatial=(2,), note="DISCO convolutions, bilinear "
       "resampling on the sphere")
def _():
    return _th("SphericalUNet", embed_dims=[8, 16], depths=[1, 1], scale_factor=2, drop_conv_rate=0.0,
               drop_path_rate=0.0, drop_dense_rate=0.0)


@model("torch_harmonics", "torch_harmonics/SphericalSegformer", (2, 3) + _GRID, spatial=(2,), dtype="float32", note="neighbourhood attention on "
       "the sphere")
def _():
    return _th("SphericalSegformer", embed_dims=[8, 16], heads=[1, 2], depths=[1, 1], scale_factor=2,
               drop_path_rate=0.0)


@model("torch_harmonics", "torch_harmonics/SphericalTransformer", (2, 3) + _GRID, spatial=(2,), dtype="float32", note="spectral position "
       "embedding, neighbourhood attention on the sphere")
def _():
    return _th("SphericalTransformer", embed_dim=16, num_layers=2, scale_factor=2, num_heads=2)


@model("neuralop", "neuralop/SFNO", (2, 3) + _GRID, note="neuraloperator's SFNO (torch-harmonics transforms)")
def _():
    from neuralop.models import SFNO
    return SFNO(n_modes=(8, 16), in_channels=3, out_channels=3, hidden_channels=16, n_layers=2)
