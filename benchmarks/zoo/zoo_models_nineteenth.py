"""The model zoo's nineteenth set: nnU-Net's networks (dynamic-network-architectures, the thirty-fourth session) --
the plain-convolution and residual-encoder U-Nets nnU-Net configures for every medical dataset (2-D and 3-D,
instance norm, leaky ReLU in place, transposed-convolution upsampling, deep supervision's list of outputs at every
decoder scale), anisotropic first strides as nnU-Net plans them for thick-slice volumes, and the ResNet-D and VGG
classifiers (not Primus, nnU-Net's 3-D ViT: its rotary tables need timm < 1.0.23, the zoo pins 1.0.31). Built
small with random init; a volume split along its depth or rows. Registered like zoo_models.py's (zoo_models.py
imports this module at its end)."""
import torch.nn as nn

from benchmarks.zoo.zoo_models import model

_IN = dict(norm_op_kwargs={"eps": 1e-5, "affine": True}, nonlin=nn.LeakyReLU,
           nonlin_kwargs={"inplace": True, "negative_slope": 1e-2})


def _register(name, shape, build, **kw):
    model("dynamic_network_architectures", f"nnunet/{name}", shape, **kw)(build)


def _plain(dims=3, deep_supervision=False, strides=None, features=(8, 16, 32, 64)):
    from dynamic_network_architectures.architectures.unet import PlainConvUNet
    conv, norm = (nn.Conv3d, nn.InstanceNorm3d) if dims == 3 else (nn.Conv2d, nn.InstanceNorm2d)
    return PlainConvUNet(input_channels=1, n_stages=len(features), features_per_stage=features, conv_op=conv,
                         kernel_sizes=3, strides=strides or (1, 2, 2, 2), n_conv_per_stage=2, num_classes=3,
                         n_conv_per_stage_decoder=2, conv_bias=True, norm_op=norm, deep_supervision=deep_supervision,
                         **_IN)


def _residual(dims=3, deep_supervision=False):
    from dynamic_network_architectures.architectures.unet import ResidualEncoderUNet
    conv, norm = (nn.Conv3d, nn.InstanceNorm3d) if dims == 3 else (nn.Conv2d, nn.InstanceNorm2d)
    return ResidualEncoderUNet(input_channels=1, n_stages=4, features_per_stage=(8, 16, 32, 64), conv_op=conv,
                               kernel_sizes=3, strides=(1, 2, 2, 2), n_blocks_per_stage=(1, 2, 2, 2), num_classes=3,
                               n_conv_per_stage_decoder=1, conv_bias=True, norm_op=norm,
                               deep_supervision=deep_supervision, **_IN)


def _resnet():
    from dynamic_network_architectures.architectures.resnet import ResNet18_CIFAR
    return ResNet18_CIFAR(n_classes=10, n_input_channels=3, input_dimension=2)


def _vgg():
    from dynamic_network_architectures.architectures.vgg import VGG16_cifar
    return VGG16_cifar(n_classes=10, n_input_channel=3, input_dimension=2)


_register("PlainConvUNet3d", (1, 1, 16, 32, 32), _plain, shard_dims=(3,), spatial=(2, 3, 4), align=8,
          note="nnU-Net 3d_fullres: instance norm, in-place leaky ReLU, transposed-convolution upsampling; H split")
_register("PlainConvUNet3d_depth", (1, 1, 32, 32, 32), _plain, shard_dims=(2,), spatial=(2, 3, 4), align=8,
          note="the same split along the depth")
_register("PlainConvUNet3d_deep_supervision", (1, 1, 16, 32, 32), lambda: _plain(deep_supervision=True),
          shard_dims=(3,), spatial=(2, 3, 4), align=8, note="deep supervision: one output per decoder scale")
_register("PlainConvUNet3d_anisotropic", (1, 1, 8, 32, 32),
          lambda: _plain(strides=((1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2))), shard_dims=(3,),
          spatial=(2, 3, 4), align=8, note="thick slices: the first downsampling in-plane only, as nnU-Net plans it")
_register("PlainConvUNet2d", (2, 1, 32, 32), lambda: _plain(dims=2), align=8, note="nnU-Net 2d")
_register("ResidualEncoderUNet3d", (1, 1, 16, 32, 32), _residual, shard_dims=(3,), spatial=(2, 3, 4), align=8,
          note="nnU-Net ResEnc: ResNet-D encoder blocks (average-pooled shortcuts)")
_register("ResidualEncoderUNet2d_deep_supervision", (2, 1, 32, 32),
          lambda: _residual(dims=2, deep_supervision=True), align=8, note="2-D, deep supervision")
_register("ResNet18", (2, 3, 32, 32), _resnet, spatial_out=False, note="ResNet-D classifier (CIFAR-like stem)")
_register("VGG16", (2, 3, 32, 32), _vgg, spatial_out=False, note="VGG classifier")
