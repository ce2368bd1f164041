"""The model zoo's sixteenth set: PhysicsNeMo's DLWP-HEALPix models (the twenty-first session) -- a weather model on
the HEALPix sphere, its 12 faces folded into the batch and every face split along its rows. Each padded convolution
surrounds a face with its neighbours' edges (``HEALPixPadding``, routed by ``shardtensor.integrations.
physicsnemo_healpix``: one peer exchange per padding instead of some 300 small collectives). The models are built
from the Hydra-style configurations PhysicsNeMo instantiates (small channel counts); a wrapper turns the one zoo
input ``(B, 12, T, C, H, W)`` into the model's list of prognostics, decoder inputs (insolation) and constants, all
split along H. Registered like zoo_models.py's (zoo_models.py imports this module at its end)."""
import torch

from benchmarks.zoo.zoo_models import model

_ACT = {"_target_": "physicsnemo.nn.CappedGELU", "cap_value": 10}
_BLOCKS = "physicsnemo.models.dlwp_healpix.layers"
_SHAPE = (1, 12, 2, 3, 16, 16)   # one sample, 12 faces, 2 time steps, 2 prognostic + 1 insolation channel, nside 16


def _conv_block(kind="ConvNeXtBlock", **kw):
    block = {"_target_": f"{_BLOCKS}.{kind}", "in_channels": 3, "out_channels": 1, "kernel_size": 3, "dilation": 1,
             "activation": _ACT, "_recursive_": True}
    if kind != "BasicConvBlock":
        block["upscale_factor"] = 2
    block.update(kw)
    return block


def _configs(conv, up, pool="HEALPixAvgPool", channels=(8, 8, 8), recurrent=None):
    import omegaconf
    encoder = {"_target_": f"{_BLOCKS}.UNetEncoder", "conv_block": conv,
               "down_sampling_block": {"_target_": f"physicsnemo.nn.{pool}", "pooling": 2},
               "_recursive_": False, "n_channels": list(channels), "dilations": [1, 2, 4]}
    decoder = {"_target_": f"{_BLOCKS}.UNetDecoder", "conv_block": conv, "up_sampling_block": up,
               "output_layer": {"_target_": f"{_BLOCKS}.BasicConvBlock", "in_channels": 3, "out_channels": 2,
                                "kernel_size": 1, "dilation": 1, "n_layers": 1},
               "_recursive_": False, "n_channels": list(reversed(channels)), "dilations": [4, 2, 1]}
    if recurrent is not None:
        encoder["recurrent_block"] = recurrent
        decoder["recurrent_block"] = recurrent
    return omegaconf.DictConfig(encoder), omegaconf.DictConfig(decoder)


_TRANSPOSED = {"_target_": f"{_BLOCKS}.TransposedConvUpsample", "in_channels": 3, "out_channels": 1,
               "activation": _ACT, "upsampling": 2}


class _Inputs(torch.nn.Module):
    """The zoo's one input as the model's list: prognostics (channels 0-1), the decoder input (channel 2) and the
    constants (the first sample's first time step of the prognostics, ``(12, 2, H, W)``)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net([x[:, :, :, :2], x[:, :, :, 2:], x[0, :, 0, :2]])


def _unet(conv, up=_TRANSPOSED, **kw):  # (the decoder passes channel counts, which Interpolate does not take)
    from physicsnemo.models.dlwp_healpix import HEALPixUNet
    encoder, decoder = _configs(conv, up, **{k: kw.pop(k) for k in ("pool", "channels") if k in kw})
    return _Inputs(HEALPixUNet(encoder=encoder, decoder=decoder, input_channels=2, output_channels=2, n_constants=2,
                               decoder_input_channels=1, input_time_dim=2, output_time_dim=2, **kw))


def _register(name, build, note, shape=_SHAPE):
    model("physicsnemo", f"physicsnemo_healpix/{name}", shape, shard_dims=(4,), spatial=(4, 5), note=note)(build)


_register("HEALPixUNet", lambda: _unet(_conv_block()),
          "ConvNeXt blocks, average pooling, transposed-convolution upsampling; faces split along H")
_register("HEALPixUNet_double_convnext", lambda: _unet(_conv_block("DoubleConvNeXtBlock", latent_channels=2),
                                                       pool="HEALPixMaxPool"),
          "two ConvNeXt stages per block, max pooling")
_register("HEALPixUNet_symmetric", lambda: _unet(_conv_block("SymmetricConvNeXtBlock", latent_channels=2)),
          "symmetric ConvNeXt blocks")
_register("HEALPixUNet_basic", lambda: _unet(_conv_block("BasicConvBlock", n_layers=2)),
          "plain convolution blocks (two layers each)")
_register("HEALPixUNet_nhwc", lambda: _unet(_conv_block(), enable_nhwc=True),
          "channels-last (enable_nhwc): the padding keeps the memory format")


def _rec_unet():
    from physicsnemo.models.dlwp_healpix import HEALPixRecUNet
    gru = {"_target_": f"{_BLOCKS}.ConvGRUBlock", "in_channels": 3, "kernel_size": 1, "_recursive_": False}
    encoder, decoder = _configs(_conv_block(), _TRANSPOSED, recurrent=gru)
    return _Inputs(HEALPixRecUNet(encoder=encoder, decoder=decoder, input_channels=2, output_channels=2,
                                  n_constants=2, decoder_input_channels=1, input_time_dim=1, output_time_dim=2,
                                  presteps=1))


_register("HEALPixRecUNet", _rec_unet, "ConvGRU recurrent blocks, one prestep and two integration steps",
          shape=(1, 12, 3, 3, 16, 16))


class _Layers(torch.nn.Module):
    """HEALPix convolutions and pooling on folded faces ``(B * 12, C, H, W)`` (the building blocks)."""

    def __init__(self):
        super().__init__()
        from physicsnemo.nn import HEALPixAvgPool, HEALPixLayer
        self.net = torch.nn.Sequential(
            HEALPixLayer(torch.nn.Conv2d, in_channels=3, out_channels=6, kernel_size=3), torch.nn.GELU(),
            HEALPixAvgPool(pooling=2),
            HEALPixLayer(torch.nn.Conv2d, in_channels=6, out_channels=6, kernel_size=5),
            HEALPixLayer(torch.nn.Conv2d, in_channels=6, out_channels=3, kernel_size=3, dilation=3))

    def forward(self, x):
        return self.net(x)


model("physicsnemo", "physicsnemo_healpix/layers_folded", (24, 3, 24, 24), shard_dims=(2,), spatial=(2, 3),
      note="two samples' faces folded into the batch; padding 1, 2 and 3 (kernel 5, dilation 3)")(_Layers)
