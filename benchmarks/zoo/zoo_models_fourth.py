"""The model zoo's fourth set: 53 more unmodified models (diffusers, MONAI, neuraloperator, PhysicsNeMo) found by a
probe of models beyond the first three sets, registered like zoo_models.py's (zoo_models.py imports this module at
its end): the Wan, Qwen-Image, HunyuanVideo, LTX, Cosmos, Mochi and Flux2 video/image VAEs, MoVQ, T2I adapters, SDXL's
and Stable Cascade's U-Nets, SD3 ControlNet, the Wan / Mochi / HunyuanVideo / Allegro / LTX / CogView / Qwen-Image /
Chroma transformers; MONAI's VAE, GAN critics, SPADE and ControlNet diffusion U-Nets, FlexibleUNet, anisotropic
DynUNet; FNO variants, TFNO-CP, UNO, UQNO; PhysicsNeMo FNO-1d, Pix2Pix, CorrDiff, EDM, Transolver on points, DiT.
Models that compute parts in float32 whatever the input (FP32 norms, float32 autocast or casts) run in float32.
Not here: MONAI's AutoencoderKL sampling (a random draw per rank; its mean decoder is), VQVAE's ddp_sync all-reduce
(refused with a clear error; with ddp_sync off it is). Two patterns once not divided run divided now and are
here: Lumina2's joint sequence written into a new_zeros buffer per sample (new_* keeps the split) and MONAI's masked
autoencoder's random token choice (`x[arange(B)[:, None], ids]`: a routed read; `reseed` gives the single-process
and the sharded runs the same draw)."""
import torch

from benchmarks.zoo.zoo_models import Seeded, model  # noqa: F401


def _g():
    return torch.Generator().manual_seed(5)


class _Call(torch.nn.Module):
    """Call net through fn(net, x, **kw)."""

    def __init__(self, net, fn):
        super().__init__()
        self.net, self.fn = net, fn

    def forward(self, x, **kw):
        return self.fn(self.net, x, **kw)


# ================================================================ diffusers: video VAEs (H sharded)

@model("diffusers", "diffusers/AutoencoderKLWan", (1, 3, 5, 16, 16), shard_dims=(3,), spatial=(3, 4), align=4, dtype="float32",
       note="Wan VAE: causal 3-D convs with frame cache, RMS norm, temporal downsample")
def _():
    from diffusers import AutoencoderKLWan
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                            temperal_downsample=[True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)


@model("diffusers", "diffusers/AutoencoderKLQwenImage", (1, 3, 1, 16, 16), shard_dims=(3,), spatial=(3, 4), align=4, dtype="float32",
       note="Qwen-Image VAE (Wan-style) on a single frame")
def _():
    from diffusers import AutoencoderKLQwenImage
    return AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                  temperal_downsample=[False], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)


@model("diffusers", "diffusers/AutoencoderKLHunyuanVideo", (1, 3, 5, 16, 16), shard_dims=(3,), spatial=(3, 4),
       align=4, note="HunyuanVideo VAE: causal 3-D conv, mid attention with causal mask")
def _():
    from diffusers import AutoencoderKLHunyuanVideo
    return AutoencoderKLHunyuanVideo(in_channels=3, out_channels=3, latent_channels=4,
                                     down_block_types=("HunyuanVideoDownBlock3D",) * 3,
                                     up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 16),
                                     layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=4,
                                     temporal_compression_ratio=4)


@model("diffusers", "diffusers/AutoencoderKLLTXVideo", (1, 3, 9, 32, 32), shard_dims=(3,), spatial=(3, 4), dtype="float32",
       align=8, note="LTX VAE: 4x4 patchify (pixel unshuffle), causal convs, RMS norm")
def _():
    from diffusers import AutoencoderKLLTXVideo
    return AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 16),
                                 down_block_types=("LTXVideoDownBlock3D",) * 2, decoder_block_out_channels=(8, 16),
                                 layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
                                 spatio_temporal_scaling=(True, False), decoder_spatio_temporal_scaling=(True, False),
                                 decoder_inject_noise=(False, False, False), downsample_type=("conv", "conv"),
                                 upsample_residual=(False, False), upsample_factor=(1, 1))


@model("diffusers", "diffusers/AutoencoderKLCosmos", (1, 3, 9, 32, 32), shard_dims=(3,), spatial=(3, 4), align=8,
       note="Cosmos VAE: Haar wavelet patching, factorized 3-D convs")
def _():
    from diffusers import AutoencoderKLCosmos
    return AutoencoderKLCosmos(in_channels=3, out_channels=3, latent_channels=4, encoder_block_out_channels=(8, 16),
                               decode_block_out_channels=(8, 16), attention_resolutions=(), resolution=32,
                               num_layers=1, patch_size=2, spatial_compression_ratio=4, temporal_compression_ratio=4,
                               latents_mean=None, latents_std=None)


@model("diffusers", "diffusers/AutoencoderKLMochi", (1, 3, 7, 16, 16), shard_dims=(3,), spatial=(3, 4), align=8,
       note="Mochi VAE: Fourier features, chunked GroupNorm, depth-to-space")
def _():
    from diffusers import AutoencoderKLMochi
    return AutoencoderKLMochi(encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
                              latent_channels=4, layers_per_block=(1, 1, 1, 1, 1),
                              add_attention_block=(False, False, False, False, False),
                              latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)


@model("diffusers", "diffusers/AutoencoderKLFlux2", (2, 3, 32, 32), align=8,
       note="Flux2 VAE: latent 2x2 patchify + BatchNorm")
def _():
    from diffusers import AutoencoderKLFlux2
    return AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                              up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                              norm_num_groups=4, sample_size=32)


@model("diffusers", "diffusers/VQModel-MoVQ", (2, 3, 32, 32), align=4, note="MoVQ: spatial norm (interpolated zq)")
def _():
    from diffusers import VQModel
    return VQModel(in_channels=3, out_channels=3, block_out_channels=(32, 32),
                   down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                   latent_channels=4, num_vq_embeddings=16, norm_num_groups=8, vq_embed_dim=4, norm_type="spatial")


# ================================================================ diffusers: U-Nets, adapters, controlnets

@model("diffusers", "diffusers/T2IAdapter-full", (2, 3, 64, 64), align=8, spatial_out=True,
       note="pixel unshuffle x8, res blocks, feature list")
def _():
    from diffusers import T2IAdapter
    return T2IAdapter(in_channels=3, channels=[16, 32, 32], num_res_blocks=1, downscale_factor=8,
                      adapter_type="full_adapter")


@model("diffusers", "diffusers/T2IAdapter-light", (2, 3, 64, 64), align=8, note="light adapter")
def _():
    from diffusers import T2IAdapter
    return T2IAdapter(in_channels=3, channels=[16, 32, 32], num_res_blocks=1, downscale_factor=8,
                      adapter_type="light_adapter")


@model("diffusers", "diffusers/T2IAdapter-xl", (2, 3, 64, 64), align=16, note="SDXL adapter (avg-pool down)")
def _():
    from diffusers import T2IAdapter
    return T2IAdapter(in_channels=3, channels=[16, 32, 32, 32], num_res_blocks=1, downscale_factor=8,
                      adapter_type="full_adapter_xl")


def _cross():
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=_g())}


def _sdxl_extra():
    g = _g()
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "added_cond_kwargs": {"text_embeds": torch.randn(2, 16, generator=g),
                                  "time_ids": torch.tensor([[32., 32., 0., 0., 32., 32.]] * 2)}}


@model("diffusers", "diffusers/UNet2DCond-SDXL", (2, 4, 32, 32), align=4, extra=_sdxl_extra,
       note="SDXL text_time additional embedding, 2 transformer layers, linear projection")
def _():
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1,
                                norm_num_groups=8, cross_attention_dim=16, attention_head_dim=(4, 8),
                                transformer_layers_per_block=(1, 2), use_linear_projection=True,
                                addition_embed_type="text_time", addition_time_embed_dim=8,
                                projection_class_embeddings_input_dim=64)


def _cascade_extra():
    g = _g()
    return {"timestep_ratio": torch.tensor([0.3, 0.7]), "clip_text_pooled": torch.randn(2, 1, 8, generator=g)}


@model("diffusers", "diffusers/StableCascadeUNet", (2, 4, 16, 16), align=4, extra=_cascade_extra,
       note="Wuerstchen: LayerNorm2d, depthwise ResBlocks, GlobalResponseNorm, attention with cond tokens")
def _():
    from diffusers import StableCascadeUNet
    return StableCascadeUNet(in_channels=4, out_channels=4, timestep_ratio_embedding_dim=8, patch_size=1,
                             conditioning_dim=16, block_out_channels=(16, 32), num_attention_heads=(2, 2),
                             down_num_layers_per_block=(1, 1), up_num_layers_per_block=(1, 1),
                             down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(1, 1),
                             clip_text_pooled_in_channels=8, clip_seq=2, timestep_conditioning_type=("sca",),
                             self_attn=True, switch_level=(False,))


class _SD3CN(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, **kw):
        return self.net(x[:, :4], controlnet_cond=x[:, 4:], return_dict=False, **kw)


def _sd3_extra():
    g = _g()
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "pooled_projections": torch.randn(2, 8, generator=g)}


@model("diffusers", "diffusers/SD3ControlNet", (2, 8, 16, 16), align=2, extra=_sd3_extra,
       note="latent + control latent on channels; per-block residual tokens")
def _():
    from diffusers import SD3ControlNetModel
    return _SD3CN(SD3ControlNetModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                     num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                     pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16))


# ================================================================ diffusers: transformers

def _wan_extra():
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=_g())}


@model("diffusers", "diffusers/WanTransformer3D", (2, 4, 2, 16, 16), shard_dims=(3,), spatial=(3, 4), align=2, dtype="float32",
       extra=_wan_extra, note="Wan DiT: 3-D RoPE built from the input's shape, patch (1,2,2)")
def _():
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                                 rope_max_seq_len=32)


def _mochi_extra():
    g = _g()
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "encoder_attention_mask": torch.ones(2, 5, dtype=torch.bool)}


@model("diffusers", "diffusers/MochiTransformer3D", (2, 4, 2, 16, 16), shard_dims=(3,), spatial=(3, 4), align=2, dtype="float32",
       extra=_mochi_extra, note="Mochi asymmetric DiT: RoPE from the input's shape, joint attention")
def _():
    from diffusers import MochiTransformer3DModel
    return MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                                   pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=16,
                                   max_sequence_length=5)


def _hyv_extra():
    g = _g()
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "encoder_attention_mask": torch.ones(2, 5), "pooled_projections": torch.randn(2, 8, generator=g)}


@model("diffusers", "diffusers/HunyuanVideoTransformer3D", (2, 4, 2, 16, 16), shard_dims=(3,), spatial=(3, 4),
       align=2, extra=_hyv_extra, note="double + single stream blocks, token refiner, 3-axis RoPE from shape")
def _():
    from diffusers import HunyuanVideoTransformer3DModel
    return HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                          num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
                                          guidance_embeds=False, text_embed_dim=16, pooled_projection_dim=8,
                                          rope_axes_dim=(2, 2, 4))


def _cogview_extra():
    g = _g()
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "original_size": torch.tensor([[16., 16.]] * 2), "target_size": torch.tensor([[16., 16.]] * 2),
            "crop_coords": torch.tensor([[0., 0.]] * 2)}


@model("diffusers", "diffusers/CogView3Plus", (2, 4, 16, 16), align=2, extra=_cogview_extra,
       note="CogView3+: cropped 2-D sincos pos-embed, joint text/image attention")
def _():
    from diffusers import CogView3PlusTransformer2DModel
    return CogView3PlusTransformer2DModel(patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                          num_attention_heads=2, out_channels=4, text_embed_dim=16, time_embed_dim=16,
                                          condition_dim=4, pos_embed_max_size=16, sample_size=16)


@model("diffusers", "diffusers/CogView4", (2, 4, 16, 16), align=2, extra=_cogview_extra,
       note="CogView4: 2-D RoPE computed from the input's shape")
def _():
    from diffusers import CogView4Transformer2DModel
    return CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
                                      num_attention_heads=2, text_embed_dim=16, time_embed_dim=16, condition_dim=4,
                                      pos_embed_max_size=16, sample_size=16, rope_axes_dim=(32, 32))


def _lumina2_extra():
    g = _g()
    return {"timestep": torch.tensor([0.3, 0.7]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "encoder_attention_mask": torch.ones(2, 5, dtype=torch.bool)}


@model("diffusers", "diffusers/Lumina2Transformer", (2, 4, 16, 16), align=2, extra=_lumina2_extra, dtype="float32",
       note="Lumina-Image 2.0: text and image tokens joined per sample into a new_zeros buffer (kept split)")
def _():
    from diffusers import Lumina2Transformer2DModel
    return Lumina2Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, hidden_size=32,
                                     num_layers=1, num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1,
                                     multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(16, 16, 16),
                                     cap_feat_dim=16)


@model("monai", "monai/MaskedAutoEncoderViT", (2, 1, 32, 32), align=8, reseed=True,
       note="MAE: a random choice of kept patches (x[arange(B)[:, None], ids]: a routed read), decoder tokens "
            "written back into a mask-token buffer")
def _():
    from monai.networks.nets import MaskedAutoEncoderViT
    return MaskedAutoEncoderViT(in_channels=1, img_size=(32, 32), patch_size=(8, 8), hidden_size=32, mlp_dim=64,
                                num_layers=1, num_heads=2, decoder_hidden_size=16, decoder_mlp_dim=32,
                                decoder_num_layers=1, decoder_num_heads=2, masking_ratio=0.5, spatial_dims=2)


def _allegro_extra():
    g = _g()
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g)}


@model("diffusers", "diffusers/AllegroTransformer3D", (2, 4, 2, 16, 16), shard_dims=(3,), spatial=(3, 4), align=2,
       extra=_allegro_extra, note="Allegro: 3-D patch embed, adaLN-single")
def _():
    from diffusers import AllegroTransformer3DModel
    return AllegroTransformer3DModel(patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
                                     in_channels=4, out_channels=4, num_layers=1, cross_attention_dim=16,
                                     sample_height=16, sample_width=16, sample_frames=2, caption_channels=16)


def _ltx_extra():
    g = _g()
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "encoder_attention_mask": torch.ones(2, 5), "num_frames": 2, "height": 8, "width": 8}


@model("diffusers", "diffusers/LTXVideoTransformer3D", (2, 128, 8), shard_dims=(1,), spatial=(1,),
       extra=_ltx_extra, note="packed tokens sharded; RoPE from global num_frames/height/width")
def _():
    from diffusers import LTXVideoTransformer3DModel
    return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
                                      cross_attention_dim=16, num_layers=1, caption_channels=16)


def _qwen_extra():
    g = _g()
    return {"timestep": torch.tensor([0.3, 0.7]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "encoder_hidden_states_mask": torch.ones(2, 5), "img_shapes": [[(1, 8, 8)]] * 2}


@model("diffusers", "diffusers/QwenImageTransformer", (2, 64, 16), shard_dims=(1,), spatial=(1,),
       extra=_qwen_extra, dtype="float32", note="packed tokens sharded; MSRoPE from img_shapes (complex, float32)")
def _():
    from diffusers import QwenImageTransformer2DModel
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                       axes_dims_rope=(4, 6, 6))


def _chroma_extra():
    h = w = 8
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return {"timestep": torch.tensor([0.003, 0.5]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=_g()),
            "img_ids": ids.reshape(h * w, 3), "txt_ids": torch.zeros(5, 3)}


@model("diffusers", "diffusers/Chroma", (2, 64, 16), shard_dims=(1,), spatial=(1,), extra=_chroma_extra,
       note="Chroma (Flux variant with approximator modulation)")
def _():
    from diffusers import ChromaTransformer2DModel
    return ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                    axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=16,
                                    approximator_layers=1)


# ================================================================ MONAI

def _vae_call(net, x):
    return net(x)


@model("monai", "monai/VarAutoEncoder", (2, 1, 32, 32), align=8, spatial_out=False,
       note="flatten -> Linear mu/logvar, reparameterise (reseeded), Linear -> decoder")
def _():
    from monai.networks.nets import VarAutoEncoder
    return Seeded(VarAutoEncoder(spatial_dims=2, in_shape=(1, 32, 32), out_channels=1, latent_size=8,
                                  channels=(4, 8), strides=(2, 2)))


@model("monai", "monai/Classifier", (2, 1, 32, 32), spatial_out=False, note="residual units, flatten + Linear")
def _():
    from monai.networks.nets import Classifier
    return Classifier(in_shape=(1, 32, 32), classes=3, channels=(4, 8, 8), strides=(2, 2, 2))


@model("monai", "monai/Discriminator", (2, 1, 32, 32), spatial_out=False, note="sigmoid head")
def _():
    from monai.networks.nets import Discriminator
    return Discriminator(in_shape=(1, 32, 32), channels=(4, 8, 8), strides=(2, 2, 2), dropout=None)


@model("monai", "monai/Critic", (2, 1, 32, 32), spatial_out=False, note="WGAN critic: mean over last dim")
def _():
    from monai.networks.nets import Critic
    return Critic(in_shape=(1, 32, 32), channels=(4, 8, 8), strides=(2, 2, 2), dropout=None)


class _SegPair(torch.nn.Module):
    """x (channels) and seg stacked along the channels; both sharded alike."""

    def __init__(self, net, cx, seeded=False):
        super().__init__()
        self.net, self.cx, self.seeded = net, cx, seeded

    def forward(self, x, **kw):
        if self.seeded:
            torch.manual_seed(123)
        return self.net(x[:, :self.cx], seg=x[:, self.cx:], **kw)


@model("monai", "monai/SPADEDiffusionModelUNet", (2, 3, 16, 16), align=4,
       extra=lambda: {"timesteps": torch.tensor([3, 500])}, note="SPADE diffusion UNet with attention")
def _():
    from monai.networks.nets import SPADEDiffusionModelUNet
    return _SegPair(SPADEDiffusionModelUNet(spatial_dims=2, in_channels=1, out_channels=1, label_nc=2,
                                            num_res_blocks=1, channels=(8, 16), attention_levels=(False, True),
                                            norm_num_groups=4, num_head_channels=8, spade_intermediate_channels=8), 1)


class _CNPair(torch.nn.Module):
    def __init__(self, net, cx):
        super().__init__()
        self.net, self.cx = net, cx

    def forward(self, x, **kw):
        return self.net(x[:, :self.cx], controlnet_cond=x[:, self.cx:], **kw)


@model("monai", "monai/ControlNet", (2, 2, 32, 32), align=8,
       extra=lambda: {"timesteps": torch.tensor([3, 500])}, note="MONAI generative ControlNet")
def _():
    from monai.networks.nets import ControlNet
    return _CNPair(ControlNet(spatial_dims=2, in_channels=1, num_res_blocks=1, channels=(8, 16),
                              attention_levels=(False, True), norm_num_groups=4, num_head_channels=8,
                              conditioning_embedding_in_channels=1, conditioning_embedding_num_channels=(8,)), 1)


@model("monai", "monai/DiffusionModelUNet-cross", (2, 1, 16, 16), align=4,
       extra=lambda: {"timesteps": torch.tensor([3, 500]), "context": torch.randn(2, 3, 8, generator=_g())},
       note="with_conditioning: spatial transformer cross-attention")
def _():
    from monai.networks.nets import DiffusionModelUNet
    return DiffusionModelUNet(spatial_dims=2, in_channels=1, out_channels=1, num_res_blocks=1, channels=(8, 16),
                              attention_levels=(False, True), norm_num_groups=4, num_head_channels=8,
                              with_conditioning=True, cross_attention_dim=8, resblock_updown=True)


@model("monai", "monai/MultiScalePatchDiscriminator", (2, 1, 32, 32), align=4,
       note="two discriminators, avg-pool between scales")
def _():
    from monai.networks.nets import MultiScalePatchDiscriminator
    return MultiScalePatchDiscriminator(num_d=2, num_layers_d=2, spatial_dims=2, channels=8, in_channels=1,
                                        minimum_size_im=32)


@model("monai", "monai/VoxelMorphUNet", (2, 2, 32, 32), align=8, note="VoxelMorph backbone UNet 2-D")
def _():
    from monai.networks.nets import VoxelMorphUNet
    return VoxelMorphUNet(spatial_dims=2, in_channels=2, unet_out_channels=8, channels=(8, 8, 16, 16),
                          final_conv_channels=(8, 8))


@model("monai", "monai/BasicUNet-pixelshuffle", (2, 1, 32, 32), align=16, note="pixel-shuffle upsampling")
def _():
    from monai.networks.nets import BasicUNet
    return BasicUNet(spatial_dims=2, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4),
                     upsample="pixelshuffle")


@model("monai", "monai/SegResNet-pixelshuffle", (2, 1, 32, 32), align=8, note="pixel-shuffle upsampling")
def _():
    from monai.networks.nets import SegResNet
    return SegResNet(spatial_dims=2, init_filters=8, in_channels=1, out_channels=2, blocks_down=(1, 1, 1),
                     blocks_up=(1, 1), upsample_mode="pixelshuffle")


@model("monai", "monai/FlexibleUNet-resnet", (2, 1, 64, 64), align=32, note="ResNet-10 encoder")
def _():
    from monai.networks.nets import FlexibleUNet
    return FlexibleUNet(in_channels=1, out_channels=2, backbone="resnet10", pretrained=False,
                        decoder_channels=(16, 16, 8, 8, 8), spatial_dims=2)


@model("monai", "monai/DynUNet3d-aniso", (1, 1, 8, 32, 32), shard_dims=(3,), align=8,
       note="anisotropic kernels/strides 3-D")
def _():
    from monai.networks.nets import DynUNet
    return DynUNet(spatial_dims=3, in_channels=1, out_channels=2, kernel_size=[(1, 3, 3), (3, 3, 3), (3, 3, 3)],
                   strides=[1, (1, 2, 2), (2, 2, 2)], upsample_kernel_size=[(1, 2, 2), (2, 2, 2)],
                   filters=[4, 8, 16], norm_name="instance")


# ================================================================ neuraloperator

@model("neuralop", "neuralop/FNO-softgate-gn", (2, 1, 32, 32),
       note="soft-gating skips, group norm, preactivation")
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2, norm="group_norm",
               preactivation=True, fno_skip="soft-gating", channel_mlp_skip="soft-gating")


@model("neuralop", "neuralop/FNO-maxmodes", (2, 1, 32, 32), note="n_modes = full resolution (all frequencies)")
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(32, 32), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2)


@model("neuralop", "neuralop/TFNO-3d-cp", (1, 1, 16, 16, 16), note="3-D CP-factorised spectral conv")
def _():
    from neuralop.models import TFNO
    return TFNO(n_modes=(4, 4, 4), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2,
                factorization="cp", rank=0.5)


@model("neuralop", "neuralop/UNO-1d", (2, 1, 64), note="1-D U-shaped neural operator with scalings")
def _():
    from neuralop.models import UNO
    return UNO(in_channels=1, out_channels=1, hidden_channels=8, n_layers=3, uno_out_channels=[8, 8, 8],
               uno_n_modes=[[8], [4], [8]], uno_scalings=[[1], [0.5], [2]], positional_embedding=None,
               channel_mlp_skip="linear")


@model("neuralop", "neuralop/UQNO", (2, 1, 32, 32), note="uncertainty NO: base FNO + residual FNO")
def _():
    from neuralop.models import FNO, UQNO
    base = FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2)
    res = FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2)
    return UQNO(base, res)


@model("neuralop", "neuralop/FNO-dense-sep-tanh", (2, 2, 32, 32), note="separable dense, tanh stabiliser, 2 in")
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(8, 8), in_channels=2, out_channels=1, hidden_channels=8, n_layers=2, separable=True,
               stabilizer="tanh", positional_embedding=None)


# ================================================================ PhysicsNeMo

@model("physicsnemo", "physicsnemo/FNO1d", (2, 1, 64), note="1-D FNO")
def _():
    from physicsnemo.models.fno import FNO
    return FNO(in_channels=1, out_channels=1, dimension=1, latent_channels=8, num_fno_layers=2, num_fno_modes=8,
               padding=4, decoder_layer_size=8)


@model("physicsnemo", "physicsnemo/Pix2PixUnet", (2, 1, 32, 32), align=8, note="pix2pix U-Net generator")
def _():
    from physicsnemo.models.pix2pix import Pix2PixUnet
    return Pix2PixUnet(in_channels=1, out_channels=1, n_downsampling=3, filter_size=8)


@model("physicsnemo", "physicsnemo/Pix2Pix3d", (1, 1, 16, 16, 16), align=8, note="3-D pix2pix (reflect pad)")
def _():
    from physicsnemo.models.pix2pix import Pix2Pix
    return Pix2Pix(in_channels=1, out_channels=1, dimension=3, conv_layer_size=4, n_downsampling=2,
                   n_upsampling=2, n_blocks=1)


@model("physicsnemo", "physicsnemo/CorrDiffUNet", (2, 4, 16, 16), align=4, dtype="float32",
       note="CorrDiff regression UNet wrapper (SongUNetPosEmbd), zero noise labels")
def _():
    from physicsnemo.models.diffusion_unets import UNet
    return _Call(UNet(img_resolution=16, img_in_channels=2, img_out_channels=2, model_type="SongUNet",
                      model_channels=16, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8], dropout=0.0),
                 lambda n, x: n(x[:, :2], img_lr=x[:, 2:]))


@model("physicsnemo", "physicsnemo/EDMPrecond", (2, 2, 16, 16), align=4, dtype="float32",
       extra=lambda: {"sigma": torch.tensor([0.3, 2.0])}, note="EDM preconditioning around a SongUNet")
def _():
    from physicsnemo.diffusion.preconditioners.legacy import EDMPrecond
    return EDMPrecond(img_resolution=16, img_channels=2, model_type="SongUNet", model_channels=16,
                      channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8], dropout=0.0)


@model("physicsnemo", "physicsnemo/FullyConnected", (2, 64, 3), shard_dims=(1,), spatial=(1,),
       note="pointwise MLP over sharded points, skip connections")
def _():
    from physicsnemo.models.mlp import FullyConnected
    return FullyConnected(in_features=3, layer_size=16, out_features=2, num_layers=3, skip_connections=True)


@model("physicsnemo", "physicsnemo/Transolver-unstructured", (2, 256, 5), shard_dims=(1,), spatial=(1,),
       note="Transolver physics attention over an unstructured point set (slices = softmax over points)")
def _():
    from physicsnemo.models.transolver import Transolver
    return _Call(Transolver(functional_dim=3, out_dim=1, n_layers=2, n_hidden=32, n_head=2, slice_num=8,
                            structured_shape=None, unified_pos=False, embedding_dim=2, use_te=False),
                 lambda n, x: n(x[..., :3], embedding=x[..., 3:]))


@model("physicsnemo", "physicsnemo/DiT-edm", (2, 2, 32, 32), align=4,
       extra=lambda: {"t": torch.tensor([0.1, 0.7])}, note="DiT with EDM conditioning embedder, conv detokenizer")
def _():
    from physicsnemo.models.dit import DiT
    return DiT(input_size=(32, 32), in_channels=2, patch_size=(4, 4), hidden_size=32, depth=1, num_heads=2,
               conditioning_embedder="edm", conditioning_embedder_kwargs=dict(emb_channels=32, noise_channels=16),
               detokenizer="proj_reshape_2d_conv")


# ================================================================ variants isolating the failures above

@model("monai", "monai/AutoencoderKL-mu", (2, 1, 32, 32), align=4,
       note="MONAI AE-KL without the latent sampling: decode(encode(x) mean)")
def _():
    from monai.networks.nets import AutoencoderKL
    net = AutoencoderKL(spatial_dims=2, in_channels=1, out_channels=1, num_res_blocks=(1, 1), channels=(8, 16),
                        attention_levels=(False, True), latent_channels=2, norm_num_groups=4)
    return _Call(net, lambda n, x: n.decode(n.encode(x)[0]))


@model("monai", "monai/SPADEAutoencoderKL-mu", (2, 3, 32, 32), align=4,
       note="SPADE AE-KL without the latent sampling")
def _():
    from monai.networks.nets import SPADEAutoencoderKL
    net = SPADEAutoencoderKL(spatial_dims=2, label_nc=2, in_channels=1, out_channels=1, num_res_blocks=(1, 1),
                             channels=(8, 16), attention_levels=(False, False), latent_channels=2, norm_num_groups=4,
                             with_encoder_nonlocal_attn=False, with_decoder_nonlocal_attn=False,
                             spade_intermediate_channels=8)
    return _Call(net, lambda n, x: n.decode(n.encode(x[:, :1])[0], x[:, 1:]))


@model("monai", "monai/VQVAE-nosync", (2, 1, 32, 32), align=4, dtype="float32",
       note="VQVAE with ddp_sync=False (no torch.distributed.all_reduce of the EMA statistics)")
def _():
    from monai.networks.nets import VQVAE
    return VQVAE(spatial_dims=2, in_channels=1, out_channels=1, channels=(8, 16), num_res_layers=1,
                 num_res_channels=(8, 16), downsample_parameters=((2, 4, 1, 1), (2, 4, 1, 1)),
                 upsample_parameters=((2, 4, 1, 1, 0), (2, 4, 1, 1, 0)), num_embeddings=16, embedding_dim=4,
                 ddp_sync=False)
