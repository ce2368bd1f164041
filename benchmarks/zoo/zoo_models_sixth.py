"""The model zoo's sixth set: 9 more unmodified models found by a probe of every timm model module, MONAI network
and torchvision model that no earlier set builds (the thirteenth session), registered like zoo_models.py's
(zoo_models.py imports this module at its end): timm's Inception-v4 and Inception-ResNet-v2 (branch concatenation of
valid-padded stems) and the hybrid ResNet-26 + ViT; MONAI's DAF3D (3-D attention refinement with ASPP),
FlexUNet (an EfficientNet encoder in a U-Net), HoVerNet (nuclear pixel / horizontal-vertical / type branches with
valid-padded dense decoders) and RegUNet (registration U-Net with deep DDF extraction); torchvision's S3D (separable
3-D video convolutions) and AlexNet (adaptive average pooling to 6x6 over a split H). Every one passed on 2 ranks
when the probe ran it (no library change was needed).

Not here: timm's MobileNet-V5 (Gemma 3n's vision encoder; it passed on 2 ranks, but its 300M parameters in float64,
with the reference copy and gradients, on the 4 ranks of a 2x2 mesh exceed the host's 24 GiB and a rank was killed),
MONAI's NaViT (a list of variable-size images per sample, not one tensor to shard) and HyenaNDUNETR (it
needs the optional `nvsubquadratic` package)."""
import torch  # noqa: F401

from benchmarks.zoo.zoo_models import _timm, model


# ============================================================ timm
@model("timm", "timm/inception_v4", (2, 3, 160, 160), spatial_out=False,
       note="160x160: at 96x96 its last BatchNorms normalise a handful of values (their gradients are rounding noise)")
def _():
    return _timm("inception_v4")


@model("timm", "timm/inception_resnet_v2", (2, 3, 96, 96), spatial_out=False, note="scaled residual branches")
def _():
    return _timm("inception_resnet_v2")


@model("timm", "timm/vit_small_r26_s32", (2, 3, 64, 64), spatial_out=False, align=32, note="ResNet-26 stem + ViT")
def _():
    return _timm("vit_small_r26_s32_224", img_size=64, depth=2)


# ============================================================ MONAI
@model("monai", "monai/DAF3D", (1, 1, 32, 32, 32), align=8, note="ASPP + attention refinement, deep supervision")
def _():
    from monai.networks.nets import DAF3D
    return DAF3D(1, 2)


@model("monai", "monai/FlexUNet", (2, 3, 64, 64), align=32, note="EfficientNet-b0 encoder")
def _():
    from monai.networks.nets import FlexUNet
    return FlexUNet(3, 2, backbone="efficientnet-b0", decoder_channels=(32, 16, 16, 8, 8))


@model("monai", "monai/HoVerNet", (1, 3, 256, 256), align=8, spatial_out=False,
       note="the fast mode needs 256x256; valid-padded decoders crop the output. On a 2x2 mesh the 4 ranks, each also "
            "running the single-process reference in float64, exceed a 24 GiB host (a rank is killed: a hang row); "
            "float32 is no way out: its batch-1 BatchNorms leave ~3e-2 relative noise on one device as sharded")
def _():
    from monai.networks.nets import HoVerNet
    return HoVerNet(mode="fast", in_channels=3, out_classes=3)


@model("monai", "monai/RegUNet", (1, 2, 32, 32, 32), align=8)
def _():
    from monai.networks.nets import RegUNet
    return RegUNet(spatial_dims=3, in_channels=2, num_channel_initial=4, depth=3)


# ============================================================ torchvision
@model("torchvision", "torchvision/s3d", (1, 3, 16, 224, 224), shard_dims=(3,), spatial=(3, 4), spatial_out=False,
       note="its final (2, 7, 7) average pool needs 224x224")
def _():
    import torchvision
    return torchvision.models.video.s3d(num_classes=10)


@model("torchvision", "torchvision/alexnet", (1, 3, 128, 128), spatial_out=False, note="adaptive avg pool to 6x6")
def _():
    import torchvision
    return torchvision.models.alexnet(num_classes=10)
