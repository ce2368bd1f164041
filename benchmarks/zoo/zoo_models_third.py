"""The model zoo's third set: 58 more unmodified models (timm, torchvision, MONAI, diffusers, PhysicsNeMo) registered
like those of zoo_models.py, which imports this module at its end: EfficientNetV2, NFNets, EVA-02 with RoPE, DeiT-3,
PVT-v2 linear SRA, Twins-PCPVT, CSP/Darknet, RepVGG, BiT, ConvMixer, Xception, SAM's ViT, register tokens, FlexiViT;
MViTv2 and Swin3D video, R3D; AHNet, DynUNet and MedNeXt with deep supervision, SegResNetDS2, 3-D AttentionUnet /
HighResNet / EfficientNet / DenseNet, SegResNetVAE (reseeded before its sampling); SVD's spatio-temporal U-Net,
AnimateDiff's motion U-Net, the temporal-decoder VAE, Kandinsky 3, HunyuanDiT, Lumina-Next, AuraFlow, Stable Audio's
1-D DiT; PhysicsNeMo FLARE and GeoTransolver. HunyuanDiT and Lumina-Next run in float32 (diffusers casts the rotary
embeddings to float32)."""
import torch

from benchmarks.zoo.zoo_models import Seeded, _timm, model  # noqa: F401


# ================================================================ additions: timm

@model("timm", "timm/efficientnetv2_rw_t", (2, 3, 64, 64), spatial_out=False, note="FusedMBConv + MBConv")
def _():
    return _timm("efficientnetv2_rw_t")

@model("timm", "timm/tf_efficientnetv2_b0", (2, 3, 64, 64), spatial_out=False, note="TF same padding, FusedMBConv")
def _():
    return _timm("tf_efficientnetv2_b0")

@model("timm", "timm/nfnet_f", (2, 3, 64, 64), spatial_out=False,
       note="NFNet-F blocks (narrow): scaled WS conv, GELU, grouped, SE, skipinit gain")
def _():
    from timm.models.nfnet import NormFreeNet, _nfnet_cfg
    return NormFreeNet(_nfnet_cfg(depths=(1, 1, 1, 1), channels=(32, 64, 96, 96), group_size=16), num_classes=10)

@model("timm", "timm/nfnet_l0", (2, 3, 64, 64), spatial_out=False, note="NFNet-L0 blocks (narrow): grouped, SiLU")
def _():
    from timm.models.nfnet import NormFreeNet, _nfnet_cfg
    return NormFreeNet(_nfnet_cfg(depths=(1, 1, 1, 1), channels=(32, 64, 96, 96), group_size=16, feat_mult=1.5,
                                  act_layer="silu", attn_layer="se", attn_kwargs=dict(rd_ratio=0.25, rd_divisor=8)),
                       num_classes=10)

@model("timm", "timm/eva02_small", (2, 3, 32, 32), align=4, spatial_out=False, note="rope, SwiGLU, small")
def _():
    return _timm("eva02_small_patch14_224", img_size=32, patch_size=4, depth=2)

@model("timm", "timm/deit3_small", (2, 3, 32, 32), align=4, spatial_out=False, note="layer scale, no pos on cls")
def _():
    return _timm("deit3_small_patch16_224", img_size=32, patch_size=4, depth=2)

@model("timm", "timm/pvt_v2_b2_li", (2, 3, 64, 64), align=32, spatial_out=False,
       note="linear SRA: adaptive avg-pool to 7x7 of keys/values")
def _():
    return _timm("pvt_v2_b2_li", depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 2, 4))

@model("timm", "timm/twins_pcpvt", (2, 3, 64, 64), align=32, spatial_out=False, note="PVT-style SRA + PEG")
def _():
    return _timm("twins_pcpvt_small", img_size=64, embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 2, 4),
                 depths=(1, 1, 1, 1))

@model("timm", "timm/cspdarknet53", (2, 3, 64, 64), spatial_out=False, note="CSP stages, Mish")
def _():
    return _timm("cspdarknet53")

@model("timm", "timm/darknet53", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("darknet53")

@model("timm", "timm/mixnet_s", (2, 3, 64, 64), spatial_out=False, note="mixed kernels (split channels)")
def _():
    return _timm("mixnet_s")

@model("timm", "timm/tinynet_a", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("tinynet_a")

@model("timm", "timm/hardcorenas_a", (2, 3, 64, 64), spatial_out=False, note="hard-sigmoid SE")
def _():
    return _timm("hardcorenas_a")

@model("timm", "timm/gernet_s", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("gernet_s")

@model("timm", "timm/repvgg_a0", (2, 3, 64, 64), spatial_out=False, note="3x3 + 1x1 + identity branches")
def _():
    return _timm("repvgg_a0")

@model("timm", "timm/resnetv2_bit", (2, 3, 64, 64), spatial_out=False, note="StdConv2d, GroupNorm, pre-act")
def _():
    from timm.models.resnetv2 import ResNetV2
    return ResNetV2(layers=(1, 1, 1, 1), channels=(32, 64, 128, 256), stem_chs=16, num_classes=10,
                    conv_layer=__import__("timm").layers.StdConv2d,
                    norm_layer=__import__("functools").partial(__import__("timm").layers.GroupNormAct, num_groups=8))

@model("timm", "timm/vgg-small", (2, 3, 64, 64), spatial_out=False,
       note="VGG with its 7x7 ConvMlp head (adaptive pool up to 7 for small maps)")
def _():
    from timm.models.vgg import VGG
    return VGG([16, "M", 32, "M", 32, 32, "M", 32, 32, "M", 32, 32, "M"], num_classes=10, mlp_ratio=0.125)

@model("timm", "timm/mobilenetv3_large_100", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("mobilenetv3_large_100")

@model("timm", "timm/convmixer", (2, 3, 32, 32), align=4, spatial_out=False, note="patch conv + 9x9 depthwise")
def _():
    from timm.models.convmixer import ConvMixer
    return ConvMixer(dim=32, depth=2, kernel_size=9, patch_size=4, num_classes=10)

@model("timm", "timm/xception41", (2, 3, 64, 64), spatial_out=False, note="aligned Xception, separable convs")
def _():
    return _timm("xception41")

@model("timm", "timm/legacy_xception", (2, 3, 64, 64), spatial_out=False, note="original Xception (valid convs)")
def _():
    return _timm("legacy_xception")

@model("timm", "timm/dla46_c", (2, 3, 64, 64), spatial_out=False, note="DLA bottleneck blocks, tree aggregation")
def _():
    return _timm("dla46_c")

@model("timm", "timm/edgenext_small", (2, 3, 64, 64), align=32, spatial_out=False, note="pos enc (Fourier)")
def _():
    return _timm("edgenext_small")

@model("timm", "timm/hgnet_tiny", (2, 3, 64, 64), align=32, spatial_out=False, note="HGNet v1 (ESE)")
def _():
    return _timm("hgnet_tiny")

@model("timm", "timm/vit_reg4_gap", (2, 3, 32, 32), align=4, spatial_out=False,
       note="4 register tokens, no cls, global avg pool of patch tokens")
def _():
    return _timm("vit_medium_patch16_reg4_gap_256", img_size=32, patch_size=4, depth=2, embed_dim=64, num_heads=2)

@model("timm", "timm/flexivit", (2, 3, 32, 32), align=4, spatial_out=False)
def _():
    return _timm("flexivit_small", img_size=32, patch_size=4, depth=2)

@model("timm", "timm/samvit", (2, 3, 64, 64), align=8, spatial_out=False,
       note="SAM ViT: padded windows, decomposed rel-pos, global attention block, conv neck")
def _():
    return _timm("samvit_base_patch16", img_size=64, patch_size=8, embed_dim=32, depth=2, num_heads=2, window_size=3,
                 global_attn_indexes=(1,), neck_chans=16)

@model("timm", "timm/pit_xs", (2, 3, 64, 64), align=32, spatial_out=False, note="pooling ViT (depthwise stride)")
def _():
    return _timm("pit_xs_224", img_size=64)

# ================================================================ additions: torchvision

@model("torchvision", "torchvision/mvit_v2_s", (1, 3, 4, 32, 32), shard_dims=(3,), align=16, spatial_out=False,
       note="MViTv2 video: pooling attention, decomposed rel-pos, cls token")
def _():
    from torchvision.models.video.mvit import MSBlockConfig, MViT
    bs = [MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 4, 4]),
          MSBlockConfig(2, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 2, 2]),
          MSBlockConfig(2, 32, 32, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 1, 1])]
    return MViT(spatial_size=(32, 32), temporal_size=4, block_setting=bs, residual_pool=True,
                residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True, dropout=0.0, num_classes=10)

@model("torchvision", "torchvision/swin3d-T", (1, 3, 8, 32, 32), shard_dims=(2,), align=4, spatial_out=False,
       note="3-D shifted windows, time sharded")
def _():
    from torchvision.models.video.swin_transformer import SwinTransformer3d
    return SwinTransformer3d(patch_size=[2, 4, 4], embed_dim=16, depths=[2, 2], num_heads=[1, 2],
                             window_size=[2, 4, 4], stochastic_depth_prob=0.0, num_classes=10)

@model("torchvision", "torchvision/r3d_18", (1, 3, 8, 32, 32), shard_dims=(3,), spatial_out=False, note="3-D ResNet, H sharded")
def _():
    from torchvision.models.video import resnet as vr
    return vr.VideoResNet(vr.BasicBlock, [vr.Conv3DSimple] * 4, [1, 1, 1, 1], vr.BasicStem, num_classes=10)

@model("torchvision", "torchvision/mobilenet_v3_large", (2, 3, 64, 64), spatial_out=False)
def _():
    from torchvision.models import mobilenet_v3_large
    return mobilenet_v3_large(num_classes=10)

@model("torchvision", "torchvision/efficientnet_b0", (2, 3, 64, 64), spatial_out=False)
def _():
    from torchvision.models import efficientnet_b0
    return efficientnet_b0(num_classes=10)

@model("torchvision", "torchvision/wide_resnet", (2, 3, 64, 64), spatial_out=False, note="wide bottleneck, narrow depth")
def _():
    from torchvision.models.resnet import Bottleneck, ResNet
    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=128)

@model("torchvision", "torchvision/resnext", (2, 3, 64, 64), spatial_out=False, note="grouped 3x3 (32x4d)")
def _():
    from torchvision.models.resnet import Bottleneck, ResNet
    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, groups=32, width_per_group=4)

@model("torchvision", "torchvision/densenet121", (2, 3, 64, 64), spatial_out=False)
def _():
    from torchvision.models import densenet121
    return densenet121(num_classes=10)

@model("torchvision", "torchvision/shufflenet_v2_x0_5", (2, 3, 64, 64), spatial_out=False, note="channel shuffle")
def _():
    from torchvision.models import shufflenet_v2_x0_5
    return shufflenet_v2_x0_5(num_classes=10)

# ================================================================ additions: MONAI

@model("monai", "monai/AHNet", (2, 1, 64, 64), align=32,
       note="anisotropic hybrid net: 2-D-pretrainable encoder, PSP pooling, transposed-conv decoder")
def _():
    from monai.networks.nets import AHNet
    return AHNet(layers=(1, 1, 1, 1), spatial_dims=2, in_channels=1, out_channels=2, psp_block_num=2)

@model("monai", "monai/DynUNet-ds", (2, 1, 64, 64), note="deep supervision: interpolated heads stacked (train)")
def _():
    from monai.networks.nets import DynUNet
    return DynUNet(spatial_dims=2, in_channels=1, out_channels=2, kernel_size=[3, 3, 3, 3], strides=[1, 2, 2, 2],
                   upsample_kernel_size=[2, 2, 2], filters=[4, 8, 16, 16], deep_supervision=True, deep_supr_num=2,
                   res_block=True)

@model("monai", "monai/SwinUNETR-v2-3d", (1, 1, 64, 32, 32), shard_dims=(2,), align=32,
       note="v2 3-D: residual conv block per stage")
def _():
    from monai.networks.nets import SwinUNETR
    return SwinUNETR(in_channels=1, out_channels=2, spatial_dims=3, feature_size=12, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 2, 2), use_v2=True)

@model("monai", "monai/MedNeXt-k5-ds", (2, 1, 32, 32), align=16,
       note="MedNeXt kernel 5, deep supervision, expansion ratios per stage")
def _():
    from monai.networks.nets import MedNeXt
    return MedNeXt(spatial_dims=2, init_filters=8, in_channels=1, out_channels=2, encoder_expansion_ratio=(2, 3, 4, 4),
                   decoder_expansion_ratio=(4, 4, 3, 2), bottleneck_expansion_ratio=4, kernel_size=5,
                   deep_supervision=True, blocks_down=(1, 1, 1, 1), blocks_bottleneck=1, blocks_up=(1, 1, 1, 1))

@model("monai", "monai/MedNeXt3d", (1, 1, 32, 32, 32), align=16, note="MedNeXt 3-D, grn? no; GroupNorm, depthwise 3^3")
def _():
    from monai.networks.nets import MedNeXt
    return MedNeXt(spatial_dims=3, init_filters=4, in_channels=1, out_channels=2, blocks_down=(1, 1, 1, 1),
                   blocks_bottleneck=1, blocks_up=(1, 1, 1, 1))

@model("monai", "monai/SegResNetDS2", (2, 1, 64, 64), align=4, note="two decoders (point / label heads)")
def _():
    from monai.networks.nets import SegResNetDS2
    return SegResNetDS2(spatial_dims=2, init_filters=8, in_channels=1, out_channels=2, blocks_down=(1, 2, 2), dsdepth=2)

@model("monai", "monai/AttentionUnet3d", (1, 1, 16, 16, 16), align=4)
def _():
    from monai.networks.nets import AttentionUnet
    return AttentionUnet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2))

@model("monai", "monai/HighResNet3d", (1, 1, 16, 16, 16), note="dilated 3-D convolutions")
def _():
    from monai.networks.nets import HighResNet
    return HighResNet(spatial_dims=3, in_channels=1, out_channels=2,
                      layer_params=({"name": "conv_0", "n_features": 4, "kernel_size": 3},
                                    {"name": "res_1", "n_features": 4, "kernels": (3, 3), "repeat": 1},
                                    {"name": "res_2", "n_features": 8, "kernels": (3, 3), "repeat": 1},
                                    {"name": "res_3", "n_features": 8, "kernels": (3, 3), "repeat": 1},
                                    {"name": "conv_1", "n_features": 16, "kernel_size": 1},
                                    {"name": "conv_2", "kernel_size": 1}))

@model("monai", "monai/EfficientNetBN3d", (1, 1, 64, 64, 32), spatial_out=False, note="3-D same padding, SE")
def _():
    from monai.networks.nets import EfficientNetBN
    return EfficientNetBN("efficientnet-b0", pretrained=False, spatial_dims=3, in_channels=1, num_classes=3)

@model("monai", "monai/DenseNet121-3d", (1, 1, 64, 64, 32), spatial_out=False)
def _():
    from monai.networks.nets import DenseNet121
    return DenseNet121(spatial_dims=3, in_channels=1, out_channels=3, init_features=8, growth_rate=4)

# ================================================================ additions: diffusers

def _svd_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 1, 32, generator=g),
            "added_time_ids": torch.tensor([[6.0, 127.0, 0.02], [6.0, 127.0, 0.02]])}

@model("diffusers", "diffusers/UNetSpatioTemporal", (2, 2, 4, 16, 16), shard_dims=(3,), spatial=(3, 4), align=4,
       extra=_svd_extra, note="SVD: (B, F, C, H, W), spatio-temporal res blocks + temporal attention, H sharded")
def _():
    from diffusers import UNetSpatioTemporalConditionModel
    return UNetSpatioTemporalConditionModel(sample_size=16, in_channels=4, out_channels=4,
                                            down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
                                            up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
                                            block_out_channels=(32, 64), addition_time_embed_dim=32,
                                            projection_class_embeddings_input_dim=96, layers_per_block=1,
                                            cross_attention_dim=32, num_attention_heads=(8, 16), num_frames=2)

def _motion_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(4, 5, 16, generator=g)}

@model("diffusers", "diffusers/UNetMotionModel", (2, 4, 2, 16, 16), shard_dims=(3,), spatial=(3, 4), align=4,
       extra=_motion_extra, note="AnimateDiff: 2-D UNet + motion modules (temporal attention), H sharded")
def _():
    from diffusers import UNetMotionModel
    return UNetMotionModel(block_out_channels=(32, 64), layers_per_block=1, in_channels=4, out_channels=4,
                           down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
                           up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"), cross_attention_dim=16,
                           num_attention_heads=2, norm_num_groups=16, motion_num_attention_heads=2, motion_max_seq_length=8)

class _TemporalVAE(torch.nn.Module):
    """AutoencoderKLTemporalDecoder on frames stacked along the batch (its decoder mixes them in time)."""

    def __init__(self, vae, frames):
        super().__init__()
        self.vae, self.frames = vae, frames

    def forward(self, x):
        z = self.vae.encode(x).latent_dist.mode()
        return self.vae.decode(z, num_frames=self.frames).sample

@model("diffusers", "diffusers/AutoencoderKLTemporalDecoder", (2, 3, 32, 32), align=4,
       note="SVD VAE: 2-D encoder, temporal (3-D conv + attention) decoder over 2 frames")
def _():
    from diffusers import AutoencoderKLTemporalDecoder
    return _TemporalVAE(AutoencoderKLTemporalDecoder(in_channels=3, out_channels=3, block_out_channels=(32, 64),
                                                     down_block_types=("DownEncoderBlock2D",) * 2, latent_channels=4,
                                                     layers_per_block=1), 2)

def _k3_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
            "encoder_attention_mask": torch.ones(2, 5)}

@model("diffusers", "diffusers/Kandinsky3UNet", (2, 4, 16, 16), align=4, extra=_k3_extra,
       note="conditional GroupNorm, attention pooling of the context")
def _():
    from diffusers import Kandinsky3UNet
    return Kandinsky3UNet(in_channels=4, time_embedding_dim=4, groups=2, attention_head_dim=4, layers_per_block=3,
                          block_out_channels=(32, 64), cross_attention_dim=4, encoder_hid_dim=32)

def _hunyuan_extra():
    g = torch.Generator().manual_seed(5)
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    rope = get_2d_rotary_pos_embed(8, ((0, 0), (8, 8)), (8, 8))
    return {"timestep": torch.tensor([3.0, 500.0]), "encoder_hidden_states": torch.randn(2, 4, 8, generator=g),
            "text_embedding_mask": torch.ones(2, 4), "encoder_hidden_states_t5": torch.randn(2, 4, 16, generator=g),
            "text_embedding_mask_t5": torch.ones(2, 4), "image_meta_size": torch.ones(2, 6),
            "style": torch.zeros(2, dtype=torch.long), "image_rotary_emb": rope}

@model("diffusers", "diffusers/HunyuanDiT", (2, 4, 16, 16), align=2, extra=_hunyuan_extra,
       dtype="float32", note="float32: diffusers' rotary embedding casts to float32; skip connections between blocks, 2-D rope given, two text encoders")
def _():
    from diffusers import HunyuanDiT2DModel
    return HunyuanDiT2DModel(sample_size=16, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=2,
                             in_channels=4, cross_attention_dim=8, cross_attention_dim_t5=16, hidden_size=16,
                             pooled_projection_dim=8, text_len=4, text_len_t5=4, activation_fn="gelu-approximate")

def _lumina_extra():
    g = torch.Generator().manual_seed(5)
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina
    return {"timestep": torch.tensor([0.3, 0.7]), "encoder_hidden_states": torch.randn(2, 4, 8, generator=g),
            "encoder_mask": torch.ones(2, 4), "image_rotary_emb": get_2d_rotary_pos_embed_lumina(8, 32, 32),
            "cross_attention_kwargs": {}}

@model("diffusers", "diffusers/LuminaNextDiT", (2, 4, 16, 16), align=2, extra=_lumina_extra,
       dtype="float32", note="float32: diffusers' rotary embedding casts to float32; complex rope (given), sandwich norms, pad tokens")
def _():
    from diffusers import LuminaNextDiT2DModel
    return LuminaNextDiT2DModel(sample_size=16, patch_size=2, in_channels=4, hidden_size=16, num_layers=2,
                                num_attention_heads=2, num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None,
                                norm_eps=1e-5, learn_sigma=False, qk_norm=True, cross_attention_dim=8, scaling_factor=1.0)

def _aura_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 4, 16, generator=g)}

@model("diffusers", "diffusers/AuraFlow", (2, 4, 16, 16), align=2, extra=_aura_extra,
       note="MMDiT + single DiT blocks, register tokens, learned pos-embed cropped")
def _():
    from diffusers import AuraFlowTransformer2DModel
    return AuraFlowTransformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                      num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2,
                                      joint_attention_dim=16, caption_projection_dim=16, out_channels=4, pos_embed_max_size=64)

def _sa_extra():
    g = torch.Generator().manual_seed(5)
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    rope = get_1d_rotary_pos_embed(4, 64 + 1, use_real=True, repeat_interleave_real=False)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 4, 16, generator=g),
            "global_hidden_states": torch.randn(2, 1, 16, generator=g), "rotary_embedding": rope}

@model("diffusers", "diffusers/StableAudioDiT", (2, 4, 64), extra=_sa_extra,
       note="1-D audio DiT: global token prepended, partial rope (given)")
def _():
    from diffusers import StableAudioDiTModel
    return StableAudioDiTModel(sample_size=64, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                               num_key_value_attention_heads=1, out_channels=4, cross_attention_dim=16, time_proj_dim=8,
                               global_states_input_dim=16, cross_attention_input_dim=16)

# ================================================================ additions: PhysicsNeMo

@model("physicsnemo", "physicsnemo/FLARE", (2, 32, 32, 2), shard_dims=(1,), spatial=(1, 2),
       note="Transolver with FLARE low-rank global-query attention, structured 32x32")
def _():
    from physicsnemo.models.flare import FLARE
    return FLARE(functional_dim=2, out_dim=1, n_layers=2, n_hidden=32, n_head=2, slice_num=8,
                 structured_shape=(32, 32), unified_pos=True, ref=4, use_te=False)

@model("physicsnemo", "physicsnemo/GeoTransolver", (2, 256, 4), shard_dims=(1,), spatial=(1,),
       note="GALE attention over a point cloud (tokens split), no geometry/global context")
def _():
    from physicsnemo.models.geotransolver import GeoTransolver
    return GeoTransolver(functional_dim=4, out_dim=2, n_layers=2, n_hidden=32, n_head=2, slice_num=8, use_te=False)

@model("monai", "monai/SegResNetVAE-seeded", (2, 1, 32, 32), align=8,
       note="SegResNetVAE with the generator reseeded per forward (the VAE samples its latent with randn_like)")
def _():
    from monai.networks.nets import SegResNetVAE
    return Seeded(SegResNetVAE(input_image_size=(32, 32), spatial_dims=2, init_filters=8, in_channels=1,
                                out_channels=2, blocks_down=(1, 1, 1, 1), blocks_up=(1, 1, 1), vae_nz=8))
