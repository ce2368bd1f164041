"""The model zoo's twenty-second set: the baseline surrogates of PolymathicAI's The Well (`the_well`, the thirty-fifth
session), physics-simulation models for 2-D and 3-D fields -- the axial ViT (AViT: a hMLP patch stem, attention
along one spatial axis at a time with the others folded into the batch), the adaptive Fourier neural operator (AFNO:
block-diagonal complex MLPs in Fourier space of the patch grid), the dilated ResNet (dilations 1, 2, 4, 8 in every
block), ReFNO (spectral-normalised linear layers, `torch.nn.utils.parametrizations.spectral_norm`, and a learned
position embedding the size of the field), the classic U-Net (batch norm, max pooling, transposed convolutions) and
the ConvNeXt U-Net (7x7 depthwise convolutions, channels-first layer norm). AViT, AFNO and ReFNO take channels-last
fields (B, H, W[, D], C), the others channels-first. The Well's FNO and TFNO wrap neuraloperator 0.3's classes,
whose signature the pinned neuraloperator 2.0 does not take; neuraloperator's own are in the zoo. Installed without
its dependencies (`tests/requirements-zoo-nodeps.txt`: it pins fsspec exactly; the models need only einops and
timm). Registered like zoo_models.py's (zoo_models.py imports this module at its end)."""
from benchmarks.zoo.zoo_models import model


def _well(name, shape, build, note, channels_last=False, **kw):
    sp = tuple(range(1, len(shape) - 1)) if channels_last else tuple(range(2, len(shape)))
    model("the_well", f"the_well/{name}", shape, shard_dims=(sp[0],), spatial=sp, note=note, **kw)(build)


def _m():
    from the_well.benchmark import models
    return models


_well("AViT2d", (2, 64, 64, 4), lambda: _m().AViT(4, 3, 2, (64, 64), hidden_dim=48, num_heads=4, processor_blocks=2),
      "axial attention along H, then W (the other axis in the batch); hMLP stem of patch 16", channels_last=True,
      align=16)
_well("AViT3d", (1, 32, 32, 32, 4),
      lambda: _m().AViT(4, 3, 3, (32, 32, 32), hidden_dim=48, num_heads=4, processor_blocks=1),
      "axial attention along each of three axes", channels_last=True, align=16)
_well("AFNO2d", (2, 32, 32, 4),
      lambda: _m().AFNO(4, 3, 2, (32, 32), hidden_dim=32, n_blocks=2, cmlp_diagonal_blocks=4, patch_size=4),
      "block-diagonal complex MLP on the rfft2 of the patch grid, soft-shrink (float32: the filter casts to it)",
      channels_last=True, align=4, dtype="float32")
_well("AFNO3d", (1, 16, 16, 16, 4),
      lambda: _m().AFNO(4, 3, 3, (16, 16, 16), hidden_dim=32, n_blocks=1, cmlp_diagonal_blocks=4, patch_size=4),
      "rfftn over three axes of the patch grid (float32)", channels_last=True, align=4, dtype="float32")
_well("DilatedResNet2d", (2, 4, 32, 32),
      lambda: _m().DilatedResNet(4, 3, 2, (32, 32), blocks=2, levels_per_block=4, hidden_dim=16),
      "dilations 1, 2, 4, 8: halos of 8 rows")
_well("DilatedResNet3d", (1, 4, 16, 16, 16),
      lambda: _m().DilatedResNet(4, 3, 3, (16, 16, 16), blocks=1, levels_per_block=4, hidden_dim=8),
      "3-D dilated convolutions")
_well("ReFNO2d", (2, 32, 32, 4), lambda: _m().ReFNO(4, 3, 2, (32, 32), hidden_dim=16, blocks=2),
      "spectral-normalised linears (power iteration), a field-sized position embedding", channels_last=True)
_well("UNetClassic2d", (2, 4, 32, 32), lambda: _m().UNetClassic(4, 3, 2, (32, 32), init_features=8),
      "batch norm, max pooling, transposed convolutions", align=16)
_well("UNetClassic3d", (2, 4, 32, 16, 16), lambda: _m().UNetClassic(4, 3, 3, (32, 16, 16), init_features=4),
      "3-D: four poolings to a 2x1x1 bottleneck", align=16)
_well("UNetConvNext2d", (2, 4, 32, 32), lambda: _m().UNetConvNext(4, 3, 2, (32, 32), stages=3, init_features=8),
      "7x7 depthwise convolutions, channels-first layer norm", align=8)
_well("UNetConvNext3d", (1, 4, 16, 16, 16), lambda: _m().UNetConvNext(4, 3, 3, (16, 16, 16), stages=2,
                                                                         init_features=4),
      "3-D ConvNeXt blocks", align=4)
