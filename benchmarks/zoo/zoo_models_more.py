"""The model zoo's second set: 118 more unmodified models (timm, torchvision, MONAI, diffusers, smp, neuraloperator,
PhysicsNeMo) registered like those of zoo_models.py, which imports this module at its end. Found by a probe of models
beyond the first set; the five it found failing (BatchNorm1d heads on a global pool: RepViT, EfficientViT-M, SHViT,
LeViT-conv; multi-query attention: MobileNetV4 hybrid) were fixed in the library, not here."""
import torch

from benchmarks.zoo.zoo_models import _cross, _smp, _timestep, _timm, cast, model  # noqa: F401



# ================================================================ probe candidates: timm
@model("timm", "timm/coatnet_nano", (2, 3, 64, 64), align=32, spatial_out=False, note="MBConv + rel-pos attention")
def _():
    return _timm("coatnet_nano_rw_224", img_size=64)


@model("timm", "timm/maxvit_nano", (2, 3, 64, 64), align=32, spatial_out=False, note="block + grid attention")
def _():
    return _timm("maxvit_nano_rw_256", img_size=64)


@model("timm", "timm/caformer", (2, 3, 64, 64), align=32, spatial_out=False, note="sepconv + attention MetaFormer")
def _():
    from timm.models.metaformer import MetaFormer, SepConv, Attention, LayerNorm2dNoBias, LayerNormNoBias
    return MetaFormer(depths=(1, 1, 1, 1), dims=(16, 32, 64, 64), token_mixers=[SepConv, SepConv, Attention, Attention],
                      norm_layers=[LayerNorm2dNoBias] * 2 + [LayerNormNoBias] * 2, num_classes=10)


@model("timm", "timm/convformer", (2, 3, 64, 64), align=32, spatial_out=False, note="sepconv MetaFormer, StarReLU")
def _():
    from timm.models.metaformer import MetaFormer, SepConv, LayerNorm2dNoBias
    return MetaFormer(depths=(1, 1, 1, 1), dims=(16, 32, 64, 64), token_mixers=SepConv, norm_layers=LayerNorm2dNoBias,
                      num_classes=10)


@model("timm", "timm/fastvit_t8", (2, 3, 64, 64), align=32, spatial_out=False, note="RepMixer")
def _():
    return _timm("fastvit_t8")


@model("timm", "timm/fastvit_sa12", (2, 3, 64, 64), align=32, spatial_out=False, note="RepMixer + attention")
def _():
    return _timm("fastvit_sa12", layers=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64))


@model("timm", "timm/repvit_m1", (2, 3, 64, 64), align=32, spatial_out=False)
def _():
    return _timm("repvit_m1")


@model("timm", "timm/efficientformerv2_s0", (2, 3, 64, 64), align=32, spatial_out=False,
       note="attention with bias for a fixed resolution")
def _():
    return _timm("efficientformerv2_s0", img_size=64)


@model("timm", "timm/tiny_vit_5m", (2, 3, 64, 64), align=32, spatial_out=False, note="window attention with pad")
def _():
    from timm.models.tiny_vit import TinyVit
    return TinyVit(num_classes=10, embed_dims=(16, 32, 64, 64), depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2),
                   window_sizes=(4, 4, 4, 2))


@model("timm", "timm/gcvit_xxtiny", (2, 3, 64, 64), align=32, spatial_out=False, note="global context attention")
def _():
    return _timm("gcvit_xxtiny", img_size=64)


@model("timm", "timm/focalnet_srf", (2, 3, 64, 64), align=32, spatial_out=False, note="focal modulation")
def _():
    from timm.models.focalnet import FocalNet
    return FocalNet(num_classes=10, embed_dim=16, depths=(1, 1, 1, 1))


@model("timm", "timm/nest_tiny", (2, 3, 64, 64), align=16, spatial_out=False, note="blockify/deblockify")
def _():
    from timm.models.nest import Nest
    return Nest(img_size=64, patch_size=4, embed_dims=(16, 32, 64), num_heads=(1, 2, 4), depths=(1, 1, 1),
                num_classes=10)


@model("timm", "timm/cait_xxs", (2, 3, 32, 32), align=4, spatial_out=False, note="talking heads, class attention")
def _():
    return _timm("cait_xxs24_224", img_size=32, patch_size=4, depth=2)


@model("timm", "timm/beit", (2, 3, 32, 32), align=4, spatial_out=False, note="relative position bias table")
def _():
    return _timm("beit_base_patch16_224", img_size=32, patch_size=4, depth=2, embed_dim=64, num_heads=2)


@model("timm", "timm/dla34", (2, 3, 64, 64), spatial_out=False, note="deep layer aggregation")
def _():
    return _timm("dla34")


@model("timm", "timm/hrnet_w18_small", (2, 3, 64, 64), align=32, spatial_out=False, note="multi-resolution fusion")
def _():
    return _timm("hrnet_w18_small")


@model("timm", "timm/res2net50", (2, 3, 64, 64), spatial_out=False, note="channel split hierarchy")
def _():
    return _timm("res2net50_26w_4s")


@model("timm", "timm/skresnet18", (2, 3, 64, 64), spatial_out=False, note="selective kernel")
def _():
    return _timm("skresnet18")


@model("timm", "timm/resnest14d", (2, 3, 64, 64), spatial_out=False, note="split attention (radix softmax)")
def _():
    return _timm("resnest14d")


@model("timm", "timm/rexnet_100", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("rexnet_100")


@model("timm", "timm/ese_vovnet19b_dw", (2, 3, 64, 64), spatial_out=False, note="OSA + effective SE")
def _():
    return _timm("ese_vovnet19b_dw")


@model("timm", "timm/dpn68", (2, 3, 64, 64), spatial_out=False, note="dual path (cat of dense paths)")
def _():
    return _timm("dpn68")


@model("timm", "timm/mobileone_s0", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("mobileone_s0")


@model("timm", "timm/ghostnetv2", (2, 3, 64, 64), spatial_out=False, note="DFC attention (avg-pool + interp)")
def _():
    return _timm("ghostnetv2_100")


@model("timm", "timm/lcnet_050", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("lcnet_050")


@model("timm", "timm/coat_lite", (2, 3, 64, 64), align=32, spatial_out=False, note="conv-attentional, factorized")
def _():
    return _timm("coat_lite_tiny", img_size=64)


@model("timm", "timm/sequencer2d", (2, 3, 64, 64), align=32, spatial_out=False, note="BiLSTM along H and W")
def _():
    return _timm("sequencer2d_s", img_size=64, layers=(1, 1, 1, 1), embed_dims=(32, 48, 48, 48),
                 hidden_sizes=(16, 16, 16, 16))


@model("timm", "timm/gmlp", (2, 3, 32, 32), align=4, spatial_out=False, note="spatial gating unit")
def _():
    from timm.models.mlp_mixer import MlpMixer, SpatialGatingBlock
    from timm.layers import GatedMlp
    return MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=2, embed_dim=32, mlp_ratio=6,
                    block_layer=SpatialGatingBlock, mlp_layer=GatedMlp)


@model("timm", "timm/resmlp", (2, 3, 32, 32), align=4, spatial_out=False, note="token-mixing linear, affine")
def _():
    from timm.models.mlp_mixer import MlpMixer, ResBlock, Affine
    return MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=2, embed_dim=64, mlp_ratio=4,
                    block_layer=ResBlock, norm_layer=Affine)


@model("timm", "timm/pit_ti", (2, 3, 64, 64), align=16, spatial_out=False, note="token pooling via depthwise conv")
def _():
    return _timm("pit_ti_224", img_size=64)


@model("timm", "timm/tnt", (2, 3, 32, 32), align=8, spatial_out=False, note="pixel-in-patch (unfold)")
def _():
    from timm.models.tnt import TNT
    return TNT(img_size=32, patch_size=8, depth=2, embed_dim=64, inner_dim=16, num_heads_inner=2, num_heads_outer=2,
               num_classes=10)


@model("timm", "timm/visformer", (2, 3, 64, 64), align=32, spatial_out=False)
def _():
    return _timm("visformer_tiny", img_size=64)


@model("timm", "timm/convit", (2, 3, 32, 32), align=4, spatial_out=False, note="gated positional self-attention")
def _():
    return _timm("convit_tiny", img_size=32, patch_size=4, depth=2)


@model("timm", "timm/inception_next", (2, 3, 64, 64), align=32, spatial_out=False, note="split depthwise bands")
def _():
    return _timm("inception_next_atto")


@model("timm", "timm/starnet_s1", (2, 3, 64, 64), spatial_out=False, note="star (x1 * x2)")
def _():
    return _timm("starnet_s1")


@model("timm", "timm/rdnet", (2, 3, 64, 64), align=32, spatial_out=False, note="revived densenet")
def _():
    return _timm("rdnet_tiny")


@model("timm", "timm/inception_v3", (2, 3, 128, 128), spatial_out=False, note="asymmetric kernels, aux off")
def _():
    return _timm("inception_v3", aux_logits=False)


# ================================================================ probe candidates: torchvision
@model("torchvision", "torchvision/maxvit", (2, 3, 64, 64), align=32, spatial_out=False, note="block + grid attention")
def _():
    from torchvision.models.maxvit import MaxVit
    return MaxVit(input_size=(64, 64), stem_channels=16, partition_size=2, block_channels=[16, 32], block_layers=[1, 1],
                  head_dim=8, stochastic_depth_prob=0.0, num_classes=10)


@model("torchvision", "torchvision/convnext", (2, 3, 64, 64), align=16, spatial_out=False, note="LayerNorm2d via permute")
def _():
    from torchvision.models.convnext import ConvNeXt, CNBlockConfig
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)],
                    stochastic_depth_prob=0.0, num_classes=10)


@model("torchvision", "torchvision/efficientnet_v2_s", (2, 3, 64, 64), spatial_out=False, note="fused MBConv")
def _():
    from torchvision.models import efficientnet_v2_s
    return efficientnet_v2_s(num_classes=10)


@model("torchvision", "torchvision/shufflenet_v2", (2, 3, 64, 64), spatial_out=False, note="channel shuffle, chunk")
def _():
    from torchvision.models import shufflenet_v2_x0_5
    return shufflenet_v2_x0_5(num_classes=10)


@model("torchvision", "torchvision/squeezenet1_1", (2, 3, 64, 64), spatial_out=False, note="max-pool ceil_mode")
def _():
    from torchvision.models import squeezenet1_1
    return squeezenet1_1(num_classes=10)


@model("torchvision", "torchvision/googlenet", (2, 3, 64, 64), spatial_out=False, note="inception, ceil_mode pools")
def _():
    from torchvision.models import googlenet
    return googlenet(num_classes=10, aux_logits=False, init_weights=True)


@model("torchvision", "torchvision/regnet_y_400mf", (2, 3, 64, 64), spatial_out=False, note="SE")
def _():
    from torchvision.models import regnet_y_400mf
    return regnet_y_400mf(num_classes=10)


@model("torchvision", "torchvision/mnasnet0_5", (2, 3, 64, 64), spatial_out=False)
def _():
    from torchvision.models import mnasnet0_5
    return mnasnet0_5(num_classes=10)


@model("torchvision", "torchvision/deeplabv3_mbv3", (2, 3, 64, 64), align=32, note="ASPP + global pool branch, dilation")
def _():
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large
    return deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3, aux_loss=False)


# ================================================================ probe candidates: MONAI
@model("monai", "monai/VNet", (2, 1, 64, 64), align=16, note="ELU, strided convs, 2-D")
def _():
    from monai.networks.nets import VNet
    return VNet(spatial_dims=2, in_channels=1, out_channels=2)


@model("monai", "monai/BasicUNetPlusPlus", (2, 1, 64, 64), align=16)
def _():
    from monai.networks.nets import BasicUNetPlusPlus
    return BasicUNetPlusPlus(spatial_dims=2, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4))


@model("monai", "monai/LocalNet", (2, 2, 32, 32), align=8, note="registration: DDF from concatenated pair")
def _():
    from monai.networks.nets import LocalNet
    return LocalNet(spatial_dims=2, in_channels=2, num_channel_initial=4, extract_levels=(0, 1, 2), out_channels=2)


@model("monai", "monai/GlobalNet", (2, 2, 32, 32), align=8, dtype="float32", spatial_out=False, note="affine DDF (flatten + Linear, affine grid)")
def _():
    from monai.networks.nets import GlobalNet
    return GlobalNet(image_size=(32, 32), spatial_dims=2, in_channels=2, num_channel_initial=4, depth=2)


@model("monai", "monai/AutoEncoder", (2, 1, 32, 32), align=8)
def _():
    from monai.networks.nets import AutoEncoder
    return AutoEncoder(spatial_dims=2, in_channels=1, out_channels=1, channels=(4, 8, 16), strides=(2, 2, 2))


@model("monai", "monai/EfficientNetBN", (2, 1, 64, 64), spatial_out=False, note="same padding, swish, SE")
def _():
    from monai.networks.nets import EfficientNetBN
    return EfficientNetBN("efficientnet-b0", pretrained=False, spatial_dims=2, in_channels=1, num_classes=3)


@model("monai", "monai/SENet", (2, 1, 64, 64), spatial_out=False, note="SE-ResNet bottleneck")
def _():
    from monai.networks.nets import SENet
    from monai.networks.blocks.squeeze_and_excitation import SEResNetBottleneck
    return SENet(spatial_dims=2, in_channels=1, block=SEResNetBottleneck, layers=(1, 1, 1, 1), groups=1, reduction=16,
                 dropout_prob=None, inplanes=16, downsample_kernel_size=1, input_3x3=False, num_classes=3)


@model("monai", "monai/DiNTS", (2, 1, 32, 32), align=16, note="searched topology")
def _():
    from monai.networks.nets import DiNTS, TopologyInstance
    space = TopologyInstance(channel_mul=0.25, num_blocks=3, num_depths=3, use_downsample=True, spatial_dims=2)
    return DiNTS(dints_space=space, in_channels=1, num_classes=2, use_downsample=True, spatial_dims=2)


@model("monai", "monai/ViTAutoEnc", (2, 1, 32, 32), align=4, note="tokens back to an image, transposed convs")
def _():
    from monai.networks.nets import ViTAutoEnc
    return ViTAutoEnc(in_channels=1, img_size=(32, 32), patch_size=(4, 4), spatial_dims=2, hidden_size=48, mlp_dim=96,
                      num_layers=2, num_heads=4)


@model("monai", "monai/Quicknat", (2, 1, 64, 64), align=16, note="max-pool indices + max-unpool, SE")
def _():
    from monai.networks.nets import Quicknat
    return Quicknat(num_classes=2, num_channels=1, num_filters=8)


@model("monai", "monai/DiffusionModelUNet", (2, 1, 32, 32), align=4,
       extra=lambda: {"timesteps": torch.tensor([3, 500])}, note="MONAI generative diffusion UNet with attention")
def _():
    from monai.networks.nets import DiffusionModelUNet
    return DiffusionModelUNet(spatial_dims=2, in_channels=1, out_channels=1, channels=(8, 16),
                              attention_levels=(False, True), num_res_blocks=1, num_head_channels=8, norm_num_groups=4)


@model("monai", "monai/PatchDiscriminator", (2, 1, 32, 32), align=8, note="intermediate features returned")
def _():
    from monai.networks.nets import PatchDiscriminator
    return PatchDiscriminator(spatial_dims=2, num_layers_d=2, channels=8, in_channels=1)


@model("monai", "monai/BasicUNet3d", (1, 1, 32, 32, 32), align=16, note="BasicUNet 3-D")
def _():
    from monai.networks.nets import BasicUNet
    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 8, 4))


# ================================================================ probe candidates: diffusers
@model("diffusers", "diffusers/UNet2D-skip", (2, 3, 32, 32), align=4, extra=_timestep,
       note="SkipDown/AttnSkipDown blocks: FIR up/down-sampling (upfirdn2d), fourier time")
def _():
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(32, 64),
                       down_block_types=("SkipDownBlock2D", "AttnSkipDownBlock2D"),
                       up_block_types=("AttnSkipUpBlock2D", "SkipUpBlock2D"), layers_per_block=1, norm_num_groups=8,
                       attention_head_dim=8, time_embedding_type="fourier")


@model("diffusers", "diffusers/UNet2D-resnetsample", (2, 3, 32, 32), align=4, extra=_timestep,
       note="ResnetDownsample/ResnetUpsample blocks, scale_shift time conditioning")
def _():
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(16, 32),
                       down_block_types=("ResnetDownsampleBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "ResnetUpsampleBlock2D"), layers_per_block=1,
                       norm_num_groups=8, attention_head_dim=8, resnet_time_scale_shift="scale_shift")


@model("diffusers", "diffusers/UNet2DCond-simplecross", (2, 4, 32, 32), align=4, extra=_cross,
       note="SimpleCrossAttn blocks (added KV), K-style")
def _():
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
                                up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
                                mid_block_type="UNetMidBlock2DSimpleCrossAttn", layers_per_block=1, norm_num_groups=8,
                                cross_attention_dim=16, attention_head_dim=8, resnet_time_scale_shift="scale_shift")


@model("diffusers", "diffusers/AsymmetricAutoencoderKL", (2, 3, 32, 32), align=4, note="mask-conditioned decoder")
def _():
    from diffusers import AsymmetricAutoencoderKL
    return AsymmetricAutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                   down_block_out_channels=(16, 32), up_block_types=("UpDecoderBlock2D",) * 2,
                                   up_block_out_channels=(16, 32), latent_channels=4, norm_num_groups=8)


def _pixart_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


@model("diffusers", "diffusers/PixArt", (2, 4, 16, 16), align=2, extra=_pixart_extra,
       note="patch tokens, adaLN-single, cross-attention")
def _():
    from diffusers import PixArtTransformer2DModel
    return PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                    num_layers=1, cross_attention_dim=16, sample_size=16, patch_size=2,
                                    caption_channels=16, norm_num_groups=4)


def _sd3_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "pooled_projections": torch.randn(2, 8, generator=g)}


@model("diffusers", "diffusers/SD3Transformer", (2, 4, 16, 16), align=2, extra=_sd3_extra,
       note="joint (MM-DiT) attention over image+text tokens, cropped pos-embed")
def _():
    from diffusers import SD3Transformer2DModel
    return SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                 pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16)


def _flux_extra():
    g = torch.Generator().manual_seed(5)
    h = w = 8
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return {"timestep": torch.tensor([0.003, 0.5]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "pooled_projections": torch.randn(2, 8, generator=g), "img_ids": ids.reshape(h * w, 3),
            "txt_ids": torch.zeros(5, 3)}


@model("diffusers", "diffusers/Flux", (2, 64, 16), shard_dims=(1,), spatial=(1,), extra=_flux_extra,
       note="packed image tokens sharded, 3-axis RoPE from plain img_ids, joint + single-stream blocks")
def _():
    from diffusers import FluxTransformer2DModel
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                  pooled_projection_dim=8, axes_dims_rope=(4, 6, 6))


@model("diffusers", "diffusers/AutoencoderDC", (2, 3, 32, 32), align=4, dtype="float32",
       note="pixel (un)shuffle shortcuts, EfficientViT linear attention, RMSNorm")
def _():
    from diffusers import AutoencoderDC
    return AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=8,
                         encoder_block_types=("ResBlock", "EfficientViTBlock"),
                         decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 16),
                         decoder_block_out_channels=(8, 16), encoder_layers_per_block=(1, 1),
                         decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), (5,)),
                         decoder_qkv_multiscales=((), (5,)))


def _sana_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g)}


@model("diffusers", "diffusers/Sana", (2, 4, 16, 16), extra=_sana_extra, dtype="float32", note="ReLU linear attention, Mix-FFN (conv)")
def _():
    from diffusers import SanaTransformer2DModel
    return SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                  num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                  cross_attention_dim=16, caption_channels=16, sample_size=16, patch_size=1)


@model("diffusers", "diffusers/CogVideoXVAE", (1, 3, 5, 32, 32), shard_dims=(3,), spatial=(3, 4), align=8,
       note="causal 3-D convs, frame batching, spatial norm; H sharded")
def _():
    from diffusers import AutoencoderKLCogVideoX
    return AutoencoderKLCogVideoX(in_channels=3, out_channels=3,
                                  down_block_types=("CogVideoXDownBlock3D",) * 2, up_block_types=("CogVideoXUpBlock3D",) * 2,
                                  block_out_channels=(8, 16), latent_channels=4, layers_per_block=1, norm_num_groups=4,
                                  temporal_compression_ratio=2, sample_height=32, sample_width=32)


# ================================================================ probe candidates: smp
@model("smp", "smp/PAN", (2, 3, 128, 128), align=32, note="feature pyramid attention")
def _():
    return _smp("PAN", decoder_channels=16)


@model("smp", "smp/DPT-vit_tiny", (2, 3, 64, 64), align=16, note="ViT encoder (tu-), reassemble + fusion")
def _():
    return _smp("DPT", "tu-vit_tiny_patch16_224", encoder_depth=4, decoder_intermediate_channels=(16, 32, 64, 64),
                decoder_fusion_channels=16, dynamic_img_size=True)


@model("smp", "smp/Unet-efficientnet-b0", (2, 3, 64, 64), align=32, note="smp's own EfficientNet (same padding)")
def _():
    net = _smp("Unet", "efficientnet-b0", decoder_channels=(32, 16, 8, 8, 8))
    net.encoder._drop_connect_rate = 0.0  # random drop-connect (0.2) would differ between runs
    return net


@model("smp", "smp/Unet-scse", (2, 3, 64, 64), align=32, note="scSE decoder attention")
def _():
    return _smp("Unet", decoder_channels=(64, 32, 32, 16, 16), decoder_attention_type="scse")


@model("smp", "smp/FPN-tu-regnety", (2, 3, 64, 64), align=32, note="timm universal encoder")
def _():
    return _smp("FPN", "tu-regnety_002", decoder_pyramid_channels=32, decoder_segmentation_channels=32)


# ================================================================ probe candidates: neuraloperator
@model("neuralop", "neuralop/FNO-domainpad", (2, 1, 32, 32), note="domain_padding=0.25 (F.pad + crop)")
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2, domain_padding=0.25)


@model("neuralop", "neuralop/FNO-3d", (1, 1, 16, 16, 16), note="3-D spectral conv")
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(4, 4, 4), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2)


@model("neuralop", "neuralop/TFNO-cp-sep", (2, 1, 32, 32), note="CP factorization, separable, instance norm")
def _():
    from neuralop.models import TFNO
    return TFNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2, factorization="cp",
                rank=0.5, norm="instance_norm", preactivation=True)


@model("neuralop", "neuralop/FNO-resscale", (2, 1, 32, 32), note="resolution_scaling_factor (spectral upsample)")
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2,
               resolution_scaling_factor=[0.5, 2.0])


@model("neuralop", "neuralop/CODANO", (2, 2, 32, 32), rtol=1e-5,
       note="codomain attention over variables; rtol 1e-5: its SpectralConv writes the spectrum into a complex64 "
            "buffer (torch.cfloat) whatever the input's dtype, so its FFT backward is float32 on one device too, "
            "and a split batch or grid reorders those float32 sums (1e-7 in the input gradient, a few 1e-6 in the "
            "factorized weights' gradients on a 2x2 mesh; in float32 a bias gradient that is zero in exact "
            "arithmetic is pure noise)")
def _():
    from neuralop.models import CODANO
    return CODANO(output_variable_codimension=1, lifting_channels=8, hidden_variable_codimension=4,
                  projection_channels=8, n_layers=2, n_modes=[[8, 8], [8, 8]], n_heads=[1, 1],
                  per_layer_scaling_factors=[[1, 1], [1, 1]], attention_scaling_factors=[1, 1], domain_padding=None)


# ================================================================ probe candidates: PhysicsNeMo
@model("physicsnemo", "physicsnemo/SongUNetPosEmbd", (2, 2, 16, 16), align=4,
       extra=lambda: {"noise_labels": torch.tensor([0.1, 0.7]), "class_labels": None},
       note="CorrDiff: sinusoidal positional grid concatenated to the input")
def _():
    from physicsnemo.models.diffusion_unets import SongUNetPosEmbd
    return SongUNetPosEmbd(img_resolution=16, in_channels=6, out_channels=2, model_channels=16, channel_mult=[1, 2],
                           num_blocks=1, attn_resolutions=[8], dropout=0.0, N_grid_channels=4)


@model("physicsnemo", "physicsnemo/StormCastUNet", (2, 2, 16, 16), align=4, dtype="float32", note="regression SongUNet wrapper")
def _():
    from physicsnemo.models.diffusion_unets import StormCastUNet
    return StormCastUNet(img_resolution=16, img_in_channels=2, img_out_channels=2, model_channels=16,
                         channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8], dropout=0.0)


@model("physicsnemo", "physicsnemo/SwinRNN", (1, 4, 2, 32, 32), shard_dims=(3,), spatial=(3, 4), align=8,
       note="Swin RNN (cube embedding over time, swin blocks); lat sharded")
def _():
    from physicsnemo.models.swinvrnn import SwinRNN
    return SwinRNN(img_size=(2, 32, 32), patch_size=(2, 1, 1), in_chans=4, out_chans=4, embed_dim=16, num_groups=4,
                   num_heads=2, window_size=4)


@model("physicsnemo", "physicsnemo/DPOT", (2, 8, 8, 1, 1), shard_dims=(1,), spatial=(1, 2), align=4, dtype="float32",
       note="AFNO transformer over time steps (channels last)")
def _():
    from physicsnemo.models.dpot import DPOTNet
    return DPOTNet(inp_shape=8, patch_size=4, in_channels=1, out_channels=1, in_timesteps=1, out_timesteps=1,
                   num_blocks=2, embed_dim=16, out_layer_dim=8, depth=1, modes=2, norm_groups=4)


@model("physicsnemo", "physicsnemo/One2ManyRNN", (2, 2, 1, 16, 16), shard_dims=(3,), spatial=(3, 4), align=4,
       note="conv encoder, GRU-like latent over time steps, decoder")
def _():
    from physicsnemo.models.rnn import One2ManyRNN
    return One2ManyRNN(input_channels=2, dimension=2, nr_latent_channels=8, nr_residual_blocks=1, nr_downsamples=2,
                       nr_tsteps=3)


@model("physicsnemo", "physicsnemo/Seq2SeqRNN", (2, 2, 2, 16, 16), shard_dims=(3,), spatial=(3, 4), align=4,
       note="conv encoder, ConvGRU over time steps")
def _():
    from physicsnemo.models.rnn import Seq2SeqRNN
    return Seq2SeqRNN(input_channels=2, dimension=2, nr_latent_channels=8, nr_residual_blocks=1, nr_downsamples=2,
                      nr_tsteps=2)


@model("physicsnemo", "physicsnemo/ModAFNO", (2, 2, 32, 32), align=8, dtype="float32",
       extra=lambda: {"mod": torch.tensor([[0.1], [0.7]])}, note="modulated AFNO (scale/shift of the spectral filter)")
def _():
    from physicsnemo.models.afno import ModAFNO
    def build():
        return ModAFNO(inp_shape=[32, 32], in_channels=2, out_channels=2, embed_model={"dim": 8, "depth": 1},
                       patch_size=[8, 8], embed_dim=16, mod_dim=8, depth=1, num_blocks=4)
    return _Rebuild(build)


class _Rebuild(torch.nn.Module):
    """deepcopy by rebuilding + load_state_dict: ModAFNO's blocks hold `lambda ...: self.filter(...)` closures,
    which copy.deepcopy does not copy (the copy would call the original's modules)."""

    def __init__(self, build):
        super().__init__()
        self._build = build
        self.net = build()

    def forward(self, *a, **k):
        return self.net(*a, **k)

    def __deepcopy__(self, memo):
        new = _Rebuild(self._build)
        p = next(self.parameters())
        new = cast(new, p.dtype)
        new.load_state_dict(self.state_dict())
        new.train(self.training)
        return new


class _TopoDiffWrap(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, timesteps):
        return self.net(x[:, :1], x[:, 1:], timesteps)


@model("physicsnemo", "physicsnemo/TopoDiff", (2, 3, 16, 16), align=4,
       extra=lambda: {"timesteps": torch.tensor([3, 500])}, note="topology + constraint channels stacked")
def _():
    from physicsnemo.models.topodiff import TopoDiff
    return _TopoDiffWrap(TopoDiff(img_resolution=16, in_channels=3, out_channels=1, model_channels=64,
                                  channel_mult=[1, 1], num_blocks=1, attn_resolutions=[8], dropout=0.0))


# ================================================================ probe batch 4: more exotic timm
@model("timm", "timm/tresnet_m", (2, 3, 64, 64), align=32, spatial_out=False, note="SpaceToDepth stem, anti-alias blur")
def _():
    return _timm("tresnet_m")


@model("timm", "timm/lambda_resnet26t", (2, 3, 64, 64), align=32, spatial_out=False,
       note="lambda layers (Conv3d positional lambdas)")
def _():
    return _timm("lambda_resnet26t")


@model("timm", "timm/botnet26t", (2, 3, 64, 64), align=32, spatial_out=False,
       note="bottleneck self-attention, relative position logits (fixed feat size)")
def _():
    return _timm("botnet26t_256", img_size=64)


@model("timm", "timm/mobilevitv2_050", (2, 3, 64, 64), align=32, spatial_out=False,
       note="separable linear attention over unfolded patches")
def _():
    return _timm("mobilevitv2_050")


@model("timm", "timm/efficientvit_m0", (4, 3, 64, 64), align=64, spatial_out=False,
       note="MSRA EfficientViT: cascaded group attention with bias idxs, windowed; a batch of 4: the BatchNorm1d head "
       "of a batch of 2 normalizes to +-1 whatever the input, so its input gradient is zero up to rounding")
def _():
    return _timm("efficientvit_m0", img_size=64)


@model("timm", "timm/mambaout_femto", (2, 3, 64, 64), align=32, spatial_out=False, note="gated CNN (channels last)")
def _():
    return _timm("mambaout_femto")


@model("timm", "timm/mobilenetv4_hybrid", (2, 3, 64, 64), align=32, spatial_out=False,
       note="mobile MQA with strided KV downsampling")
def _():
    return _timm("mobilenetv4_hybrid_medium")


@model("timm", "timm/selecsls42b", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("selecsls42b")


@model("timm", "timm/cs3darknet_focus_s", (2, 3, 64, 64), align=32, spatial_out=False,
       note="Focus stem: x[..., ::2, ::2] space-to-depth slicing")
def _():
    return _timm("cs3darknet_focus_s")


@model("timm", "timm/hgnetv2_b0", (2, 3, 64, 64), align=32, spatial_out=False, note="stem with F.pad + maxpool ceil")
def _():
    return _timm("hgnetv2_b0")


@model("timm", "timm/shvit_s1", (4, 3, 64, 64), align=64, spatial_out=False,
       note="single-head attention on partial channels; a batch of 4 (see efficientvit_m0)")
def _():
    return _timm("shvit_s1")


@model("timm", "timm/resnetblur18", (2, 3, 64, 64), spatial_out=False, note="BlurPool (reflect pad + depthwise)")
def _():
    return _timm("resnetblur18")


@model("timm", "timm/swiftformer_xs", (2, 3, 64, 64), align=32, spatial_out=False, note="efficient additive attention")
def _():
    return _timm("swiftformer_xs")


@model("timm", "timm/vit_relpos", (2, 3, 32, 32), align=4, spatial_out=False, note="relative position MLP/bias, no cls")
def _():
    return _timm("vit_relpos_small_patch16_224", img_size=32, patch_size=4, depth=2, embed_dim=64, num_heads=2)


@model("timm", "timm/vit_rope_dynamic", (2, 3, 32, 32), align=4, spatial_out=False,
       note="dynamic_img_size: pos-embed interpolation + 2-D rope")
def _():
    return _timm("vit_small_patch16_rope_224", img_size=32, patch_size=4, depth=2, embed_dim=64, num_heads=2,
                 dynamic_img_size=True)


@model("timm", "timm/gcresnet33ts", (2, 3, 64, 64), spatial_out=False, note="global context block (softmax over HW)")
def _():
    return _timm("gcresnet33ts")


@model("timm", "timm/fastvit_mci0", (2, 3, 64, 64), align=32, spatial_out=False, note="MobileCLIP, reparam attention")
def _():
    return _timm("fastvit_mci0")


# ================================================================ batch 4: torchvision / MONAI / diffusers / physicsnemo
@model("torchvision", "torchvision/vit_mha", (2, 3, 32, 32), align=4, spatial_out=False,
       note="nn.MultiheadAttention (native fast path in eval), class token")
def _():
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)


@model("torchvision", "torchvision/swin_t_v1", (2, 3, 64, 64), align=32, spatial_out=False, note="F.pad + roll, rel. bias")
def _():
    from torchvision.models.swin_transformer import SwinTransformer
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[1, 2], window_size=[4, 4],
                           stochastic_depth_prob=0.0, num_classes=10)


@model("monai", "monai/SwinUNETR3d", (1, 1, 64, 32, 32), align=32, shard_dims=(2,),
       note="3-D shifted windows (roll over 3 dims)")
def _():
    from monai.networks.nets import SwinUNETR
    return SwinUNETR(in_channels=1, out_channels=2, spatial_dims=3, feature_size=12, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 2, 2))


@model("monai", "monai/UNETR3d", (1, 1, 32, 32, 32), align=16)
def _():
    from monai.networks.nets import UNETR
    return UNETR(in_channels=1, out_channels=2, img_size=(32, 32, 32), spatial_dims=3, feature_size=4, hidden_size=48,
                 mlp_dim=96, num_heads=4)


@model("monai", "monai/Regressor", (2, 1, 32, 32), spatial_out=False, note="flatten of the sharded map -> Linear")
def _():
    from monai.networks.nets import Regressor
    return Regressor(in_shape=(1, 32, 32), out_shape=(3,), channels=(4, 8), strides=(2, 2))


@model("diffusers", "diffusers/Oobleck", (1, 2, 256), align=4, note="1-D audio VAE: weight norm, Snake activation")
def _():
    from diffusers import AutoencoderOobleck
    def build():
        return AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=[2, 2], channel_multiples=[1, 2],
                                  decoder_channels=8, decoder_input_channels=4, audio_channels=2)
    return _Rebuild(build)  # weight_norm's computed weights are non-leaves: copy.deepcopy refuses them


def _latte_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "enable_temporal_attentions": True}


@model("diffusers", "diffusers/Latte", (2, 4, 2, 16, 16), shard_dims=(3,), spatial=(3, 4), align=2,
       extra=_latte_extra, note="video DiT: spatial and temporal attention alternate (tokens <-> batch), H sharded")
def _():
    from diffusers import LatteTransformer3DModel
    return LatteTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                   num_layers=1, sample_size=16, patch_size=2, cross_attention_dim=16,
                                   caption_channels=16, video_length=2)


@model("physicsnemo", "physicsnemo/FNO3d", (1, 1, 16, 16, 16), note="3-D FNO (padding, FFT)")
def _():
    from physicsnemo.models.fno import FNO
    return FNO(in_channels=1, out_channels=1, dimension=3, latent_channels=8, num_fno_layers=2, num_fno_modes=4,
               padding=2, decoder_layer_size=8)


@model("neuralop", "neuralop/FNO-tt-recon", (2, 1, 32, 32),
       note="TT factorization, reconstructed weights, group norm, soft-gating skips")
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2, factorization="tt",
               rank=0.5, implementation="reconstructed", norm="group_norm", fno_skip="soft-gating")


# ================================================================ probe batch 5
@model("timm", "timm/coat_tiny", (2, 3, 64, 64), align=32, spatial_out=False,
       note="CoaT serial + parallel blocks (token maps interpolated across scales)")
def _():
    return _timm("coat_tiny", img_size=64, embed_dims=(16, 48, 48, 48), serial_depths=(1, 1, 1, 1), parallel_depth=1,
                 num_heads=8)


@model("timm", "timm/hiera_abswin", (2, 3, 64, 64), align=32, spatial_out=False,
       note="absolute window pos-embed (interpolated + tiled)")
def _():
    return _timm("hiera_small_abswin_256", img_size=(64, 64), embed_dim=16, stages=(1, 1, 1, 1))


@model("timm", "timm/levit_conv_128s", (2, 3, 128, 128), align=16, spatial_out=False, note="LeViT conv-mode (BN2d)")
def _():
    return _timm("levit_conv_128s", img_size=128)


@model("timm", "timm/regnetz_b16", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("regnetz_b16")


def _cogx_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3]), "encoder_hidden_states": torch.randn(1, 5, 16, generator=g)}


@model("diffusers", "diffusers/CogVideoXTransformer", (1, 2, 4, 16, 16), shard_dims=(3,), spatial=(3, 4), align=2,
       extra=_cogx_extra, note="frames x channels x H x W patchified, text + video tokens joint attention; H sharded")
def _():
    from diffusers import CogVideoXTransformer3DModel
    return CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                       num_layers=1, sample_width=16, sample_height=16, sample_frames=5, patch_size=2,
                                       text_embed_dim=16, time_embed_dim=16, max_text_seq_length=5)

