"""The model zoo's fifth set: 71 more unmodified models (timm, torchvision, segmentation-models-pytorch, MONAI,
diffusers) found by a probe of models beyond the first sets, registered like zoo_models.py's (zoo_models.py imports
this module at its end): timm's test configurations and newer norms (EvoNorm, FRN, GRN, RmsNorm2d), GhostNet-v3,
FasterNet, LowFormer, iFormer, CSATv2, ViT variants (MAP head, mixed RoPE, PE-core, AIMv2, NaFlex, dynamic size),
Swin-V2-CR, Hiera-Det, ViTamin, Next-ViT, CoAtNet-rMLP, PNASNet; torchvision FPN backbones, DeepLabV3 with its aux
head, MViT-v1, Inception-v3; smp architectures x encoders (MiT, MobileOne, timm-universal, DPN, ...). Not here:
EfficientFormer-L1 at batch 1 (PyTorch's own CPU batch_norm backward mis-reads the gradient that reaches it; at
batch 2 it is here). torchvision's deform_conv2d came later, with its rule (src/ops/deform_conv.cpp): a small net
around `DeformConv2d` with offsets predicted by a convolution."""
import functools

import torch

from benchmarks.zoo.zoo_models import _timm, model  # noqa: F401


def _smp(arch, encoder="resnet18", **kw):
    import segmentation_models_pytorch as smp
    return getattr(smp, arch)(encoder_name=encoder, encoder_weights=None, in_channels=3, classes=2, **kw)


# ============================================================ timm: test_* tiny configs and new norms
@model("timm", "timm/test_efficientnet_evos", (2, 3, 64, 64), dtype="float32", spatial_out=False, note="EvoNorm-S0 (group var)")
def _():
    return _timm("test_efficientnet_evos")

@model("timm", "timm/test_efficientnet_gn", (2, 3, 64, 64), spatial_out=False, note="GroupNorm act")
def _():
    return _timm("test_efficientnet_gn")

@model("timm", "timm/test_efficientnet_ln", (2, 3, 64, 64), spatial_out=False, note="LayerNorm2d act")
def _():
    return _timm("test_efficientnet_ln")

@model("timm", "timm/test_byobnet", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("test_byobnet")

@model("timm", "timm/test_convnext3", (2, 3, 64, 64), align=4, spatial_out=False)
def _():
    return _timm("test_convnext3")

@model("timm", "timm/test_vit3", (2, 3, 32, 32), align=4, spatial_out=False)
def _():
    return _timm("test_vit3", img_size=32, patch_size=4)

@model("timm", "timm/test_vit4", (2, 3, 32, 32), align=4, spatial_out=False)
def _():
    return _timm("test_vit4", img_size=32, patch_size=4)

@model("timm", "timm/convnextv2_atto", (2, 3, 64, 64), align=4, spatial_out=False, note="GRN: spatial L2 norm")
def _():
    return _timm("convnextv2_atto")

@model("timm", "timm/convnext_zepto_rms", (2, 3, 64, 64), align=4, spatial_out=False, note="RmsNorm2d")
def _():
    return _timm("convnext_zepto_rms")

@model("timm", "timm/resnetv2_frn", (2, 3, 64, 64), dtype="float32", spatial_out=False, note="FilterResponseNorm (spatial nu2)")
def _():
    return _timm("resnetv2_50d_frn", layers=(1, 1, 1, 1))

@model("timm", "timm/resnetv2_evos", (2, 3, 64, 64), dtype="float32", spatial_out=False, note="EvoNorm-S0")
def _():
    return _timm("resnetv2_50d_evos", layers=(1, 1, 1, 1))

@model("timm", "timm/fasternet_t0", (2, 3, 64, 64), spatial_out=False, note="partial conv (split/cat)")
def _():
    return _timm("fasternet_t0")

@model("timm", "timm/repghostnet_050", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("repghostnet_050")

@model("timm", "timm/ghostnetv3_050", (2, 3, 128, 128), spatial_out=False)
def _():
    return _timm("ghostnetv3_050")

@model("timm", "timm/fbnetv3_b", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("fbnetv3_b")

@model("timm", "timm/mnasnet_small", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("mnasnet_small")

@model("timm", "timm/mobilenetv1_100", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("mobilenetv1_100")

@model("timm", "timm/regnety_002", (2, 3, 64, 64), spatial_out=False, note="SE")
def _():
    return _timm("regnety_002")

@model("timm", "timm/legacy_seresnet18", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("legacy_seresnet18")

@model("timm", "timm/cspnext_tiny", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("cspnext_tiny")

@model("timm", "timm/dla60x_c", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("dla60x_c")

@model("timm", "timm/lcnetv2_small", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("lcnetv2_small")

@model("timm", "timm/cpubone_nano", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("cpubone_nano")

@model("timm", "timm/efficientvim_m1", (2, 3, 128, 128), align=32, spatial_out=False, note="hidden-state mixer SSD")
def _():
    return _timm("efficientvim_m1")

@model("timm", "timm/lowformer_b0", (2, 3, 64, 64), align=32, spatial_out=False)
def _():
    return _timm("lowformer_b0")

@model("timm", "timm/iformer_t", (2, 3, 64, 64), align=32, spatial_out=False)
def _():
    return _timm("iformer_t")

@model("timm", "timm/csatv2", (2, 3, 64, 64), align=32, spatial_out=False)
def _():
    return _timm("csatv2")


# ---- ResNet with attention layers (timm create_attn)
def _resnet_attn(attn):
    from timm.models.resnet import BasicBlock, ResNet
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10, block_args=dict(attn_layer=attn))

@model("timm", "timm/resnet_cbam", (2, 3, 64, 64), spatial_out=False, note="CBAM: channel mean/max -> 7x7 conv")
def _():
    return _resnet_attn("cbam")

@model("timm", "timm/resnet_lcbam", (2, 3, 64, 64), spatial_out=False, note="light CBAM")
def _():
    return _resnet_attn("lcbam")

@model("timm", "timm/resnet_ge_pool", (2, 3, 64, 64), spatial_out=False, note="gather-excite (avg-pool gather)")
def _():
    from timm.layers import GatherExcite
    return _resnet_attn(functools.partial(GatherExcite, extent=2, extra_params=False, use_mlp=False))

@model("timm", "timm/resnet_ceca", (2, 3, 64, 64), spatial_out=False, note="circular ECA")
def _():
    return _resnet_attn("ceca")


# ---- transformers / hybrids
@model("timm", "timm/vit_map", (2, 3, 32, 32), align=4, spatial_out=False, note="attention-pool (MAP) head")
def _():
    return _timm("vit_base_patch16_siglip_224", img_size=32, patch_size=4, depth=2, embed_dim=64, num_heads=2)

@model("timm", "timm/vit_rope_mixed", (2, 3, 32, 32), align=4, spatial_out=False, note="mixed RoPE (learned freqs)")
def _():
    return _timm("vit_small_patch16_rope_mixed_224", img_size=32, patch_size=4, depth=2, embed_dim=64, num_heads=2)

@model("timm", "timm/vit_pe_core", (2, 3, 32, 32), align=4, spatial_out=False, note="PE core: rope + attn pool")
def _():
    return _timm("vit_pe_core_tiny_patch16_384", img_size=32, patch_size=4, depth=2)

@model("timm", "timm/aimv2", (2, 3, 28, 28), align=14, spatial_out=False, note="RMSNorm, SwiGLU")
def _():
    return _timm("aimv2_large_patch14_224", img_size=28, depth=2, embed_dim=64, num_heads=2)

@model("timm", "timm/naflexvit", (2, 3, 32, 32), align=4, spatial_out=False, note="NaFlex patch embed")
def _():
    return _timm("naflexvit_base_patch16_gap", img_size=32, patch_size=4, depth=2, embed_dim=64, num_heads=2)

@model("timm", "timm/swinv2_cr", (2, 3, 64, 64), align=32, spatial_out=False, note="swin v2 cr (timm)")
def _():
    return _timm("swinv2_cr_tiny_ns_224", img_size=(64, 64), window_size=4, embed_dim=16, depths=(2, 2),
                 num_heads=(1, 2))

@model("timm", "timm/swinv2", (2, 3, 64, 64), align=32, spatial_out=False, note="timm swin v2")
def _():
    return _timm("swinv2_tiny_window8_256", img_size=64, window_size=4, embed_dim=16, depths=(2, 2),
                 num_heads=(1, 2))

@model("timm", "timm/hieradet_small", (2, 3, 64, 64), align=32, spatial_out=False, note="SAM2 Hiera")
def _():
    return _timm("hieradet_small")

@model("timm", "timm/vitamin_small", (2, 3, 64, 64), align=16, spatial_out=False, note="MbConv stem + ViT")
def _():
    return _timm("vitamin_small_224", img_size=64, depth=2)

@model("timm", "timm/nextvit_small", (2, 3, 64, 64), align=32, spatial_out=False)
def _():
    return _timm("nextvit_small")

@model("timm", "timm/pnasnet5", (1, 3, 64, 64), spatial_out=False, note="PNASNet cells")
def _():
    return _timm("pnasnet5large")


@model("timm", "timm/nasnetalarge", (1, 3, 64, 64), spatial_out=False,
       note="NASNet cells: ZeroPad2d((1, 0, 1, 0)), pooling, then x[:, :, 1:, 1:] (a one-row shift)")
def _():
    return _timm("nasnetalarge")


@model("timm", "timm/convmixer", (2, 3, 64, 64), spatial_out=False, note="patch stem, k9 depthwise + 1x1 mixing")
def _():
    from timm.models.convmixer import ConvMixer
    return ConvMixer(dim=32, depth=2, kernel_size=9, patch_size=7, num_classes=10)


@model("timm", "timm/mobilenetv5_base", (1, 3, 64, 64), align=32, dtype="float32", spatial_out=False,
       note="Gemma 3n's MobileNet-V5: universal inverted residuals, multi-query attention, RmsNorm2d, MSFA")
def _():
    return _timm("mobilenetv5_base")


@model("timm", "timm/vit_base_mci", (1, 3, 64, 64), align=16, dtype="float32", spatial_out=False,
       note="MobileCLIP hybrid: FastViT-style stem, then ViT blocks")
def _():
    return _timm("vit_base_mci_224", img_size=64, depth=2)


@model("timm", "timm/vgg11_bn", (1, 3, 64, 64), align=32, dtype="float32", spatial_out=False,
       note="VGG with timm's ConvMlp head (a 7x7 convolution over the pooled map)")
def _():
    return _timm("vgg11_bn", mlp_ratio=0.25)


# ============================================================ torchvision
class _Feats(torch.nn.Module):
    """Returns a backbone's feature dict as a list (the harness flattens)."""
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return list(self.m(x).values())


@model("torchvision", "torchvision/resnet18_fpn", (2, 3, 64, 64), align=32, note="FrozenBN, FPN + maxpool P6")
def _():
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    return _Feats(resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5))

@model("torchvision", "torchvision/resnet18_fpn_p6p7", (2, 3, 64, 64), align=32, note="RetinaNet LastLevelP6P7")
def _():
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7
    return _Feats(resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5,
                                      returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256)))

@model("torchvision", "torchvision/mobilenet_v3_fpn", (2, 3, 64, 64), align=32, note="mobilenet FPN backbone")
def _():
    from torchvision.models.detection.backbone_utils import mobilenet_backbone
    return _Feats(mobilenet_backbone(backbone_name="mobilenet_v3_small", weights=None, fpn=True,
                                     trainable_layers=6))

@model("torchvision", "torchvision/mobilenet_v2", (2, 3, 64, 64), spatial_out=False)
def _():
    from torchvision.models import mobilenet_v2
    return mobilenet_v2(num_classes=10)

@model("torchvision", "torchvision/inception_v3", (2, 3, 96, 96), spatial_out=False, note="transform_input, no aux")
def _():
    from torchvision.models import inception_v3
    return inception_v3(weights=None, aux_logits=False, transform_input=True, init_weights=False, num_classes=10)

@model("torchvision", "torchvision/deeplabv3_r50_aux", (2, 3, 32, 32), align=8, note="ASPP + aux FCN head (dict out)")
def _():
    from torchvision.models.segmentation import deeplabv3_resnet50
    return _Feats(deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=3, aux_loss=True))

@model("torchvision", "torchvision/mvit_v1", (1, 3, 4, 32, 32), shard_dims=(3,), align=16, spatial_out=False,
       note="MViTv1: pooling attention, abs pos embed")
def _():
    from torchvision.models.video.mvit import MSBlockConfig, MViT
    bs = [MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 4, 4]),
          MSBlockConfig(2, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 2, 2]),
          MSBlockConfig(2, 32, 32, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 1, 1])]
    return MViT(spatial_size=(32, 32), temporal_size=4, block_setting=bs, residual_pool=False,
                residual_with_cls_embed=True, rel_pos_embed=False, proj_after_attn=False, dropout=0.0,
                num_classes=10)

@model("torchvision", "torchvision/deform_conv_net", (2, 3, 64, 64),
       note="DeformConv2d, offsets from a conv: data-dependent windows")
def _():
    return _Deform()


class _Deform(torch.nn.Module):
    """A small net with a deformable 3x3 conv (offsets predicted by a conv), torchvision.ops.DeformConv2d."""
    def __init__(self):
        super().__init__()
        from torchvision.ops import DeformConv2d
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.off = torch.nn.Conv2d(8, 18, 3, padding=1)
        self.dc = DeformConv2d(8, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 2, 1)

    def forward(self, x):
        h = torch.relu(self.c1(x))
        return self.c2(torch.relu(self.dc(h, self.off(h))))

@model("torchvision", "torchvision/regnet_x_400mf", (2, 3, 64, 64), spatial_out=False)
def _():
    from torchvision.models import regnet_x_400mf
    return regnet_x_400mf(num_classes=10)

@model("torchvision", "torchvision/squeezenet1_0", (2, 3, 64, 64), spatial_out=False, note="ceil_mode maxpool")
def _():
    from torchvision.models import squeezenet1_0
    return squeezenet1_0(num_classes=10)


# ============================================================ segmentation-models-pytorch
@model("smp", "smp/Unet-mit_b0", (2, 3, 64, 64), align=32)
def _():
    return _smp("Unet", "mit_b0", decoder_channels=(32, 16, 8, 8, 8))

@model("smp", "smp/UPerNet-mit_b0", (2, 3, 64, 64), align=32)
def _():
    return _smp("UPerNet", "mit_b0", decoder_channels=16)

@model("smp", "smp/FPN-mobileone_s0", (2, 3, 64, 64), align=32)
def _():
    return _smp("FPN", "mobileone_s0", decoder_pyramid_channels=32, decoder_segmentation_channels=32)

@model("smp", "smp/DeepLabV3Plus-effb0", (2, 3, 64, 64), align=32)
def _():
    net = _smp("DeepLabV3Plus", "efficientnet-b0", decoder_channels=32)
    net.encoder._drop_connect_rate = 0.0  # random drop-connect would differ between runs
    return net

@model("smp", "smp/DeepLabV3Plus-os8", (2, 3, 64, 64), align=32, note="output stride 8: dilated")
def _():
    return _smp("DeepLabV3Plus", encoder_output_stride=8, decoder_channels=32)

@model("smp", "smp/FPN-cat", (2, 3, 64, 64), align=32, note="cat merge policy")
def _():
    return _smp("FPN", decoder_merge_policy="cat", decoder_pyramid_channels=16, decoder_segmentation_channels=32)

@model("smp", "smp/Linknet-tu-convnext_atto", (2, 3, 64, 64), align=32)
def _():
    return _smp("Linknet", "tu-convnext_atto")

@model("smp", "smp/MAnet-tu-regnetx_002", (2, 3, 64, 64), align=32)
def _():
    return _smp("MAnet", "tu-regnetx_002", decoder_channels=(32, 16, 8, 8, 8), decoder_pab_channels=16)

@model("smp", "smp/UnetPlusPlus-vgg11_bn", (1, 3, 64, 64), align=32)
def _():
    return _smp("UnetPlusPlus", "vgg11_bn", encoder_depth=3, decoder_channels=(16, 8, 8))

@model("smp", "smp/Segformer-resnet18", (2, 3, 64, 64), align=32)
def _():
    return _smp("Segformer", "resnet18", decoder_segmentation_channels=16)

@model("smp", "smp/PAN-mobilenet_v2", (2, 3, 128, 128), align=32)
def _():
    return _smp("PAN", "mobilenet_v2", decoder_channels=16)

@model("smp", "smp/PSPNet-dpn68", (2, 3, 64, 64), align=32)
def _():
    return _smp("PSPNet", "dpn68", psp_out_channels=16)

@model("smp", "smp/Unet-aux", (2, 3, 64, 64), align=32, note="aux classification head (mask, label)")
def _():
    return _smp("Unet", decoder_channels=(32, 16, 8, 8, 8), aux_params=dict(classes=3))

@model("smp", "smp/Unet-tu-mobilevitv2", (2, 3, 64, 64), align=32)
def _():
    return _smp("Unet", "tu-mobilevitv2_050", decoder_channels=(32, 16, 8, 8, 8))


# ============================================================ MONAI / diffusers
@model("diffusers", "diffusers/T2IAdapter", (2, 3, 64, 64), align=32, note="pixel unshuffle, feature list")
def _():
    from diffusers import T2IAdapter
    return T2IAdapter(in_channels=3, channels=[16, 32, 32, 32], num_res_blocks=1, downscale_factor=8,
                      adapter_type="full_adapter")

def _wan_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([10, 500]), "encoder_hidden_states": torch.randn(2, 4, 16, generator=g)}

# ============================================================ second batch: batch-1 variants and a few more
@model("timm", "timm/efficientformer_l1_b2", (2, 3, 224, 224), align=32, spatial_out=False,
       note="control: batch 2")
def _():
    return _timm("efficientformer_l1", depths=(1, 1, 1, 1))

@model("timm", "timm/vit_dynamic_img", (2, 3, 32, 32), align=4, spatial_out=False,
       note="dynamic_img_size: pos-embed resampled to the input grid")
def _():
    return _timm("vit_tiny_patch16_224", img_size=48, patch_size=4, depth=2, dynamic_img_size=True)

@model("timm", "timm/coatnet_rmlp", (2, 3, 64, 64), align=32, spatial_out=False, note="rel-pos MLP bias")
def _():
    return _timm("coatnet_rmlp_nano_rw_224", img_size=64)

@model("smp", "smp/Unet-bicubic", (2, 3, 64, 64), align=32, note="decoder bicubic upsampling")
def _():
    return _smp("Unet", decoder_channels=(32, 16, 8, 8, 8), decoder_interpolation="bicubic")

@model("smp", "smp/Unet-b1", (1, 3, 64, 64), align=32, note="batch 1")
def _():
    return _smp("Unet", decoder_channels=(32, 16, 8, 8, 8))
