"""The model zoo's twenty-sixth set: seven more diffusers models (the thirty-seventh session's probe), registered like
zoo_models.py's (zoo_models.py imports this module at its end): Flux.2's transformer on packed image tokens (4-axis
RoPE from plain ids, guidance embedding), Sana Video's transformer (float32: its linear attention casts to float32
itself), and five autoencoders: HunyuanImage's 2-D VAE, the KVAE, EasyAnimate's
MagViT video VAE (spatial group norm, causal 3-D convolutions), HunyuanVideo 1.5's VAE and VidTok (causal temporal
down- and upsampling with blended mixing factors, a mid-block self-attention over every frame's tokens, a posterior
sampled from the global generator, reseeded alike by `Seeded`).

VidTok found a library fault: the per-shard random guard advanced the global generator for the self-attention (an op
tagged random for its dropout), so the posterior noise drawn after it differed from one device's; such ops leave the
generator alone now when they draw nothing (src/dispatch/shard_random.cpp)."""
import torch

from benchmarks.zoo.zoo_models import Seeded, model

_VIDEO = dict(shard_dims=(3,), spatial=(3, 4), align=8)


@model("diffusers", "diffusers/AutoencoderKLHunyuanImage", (2, 3, 32, 32), align=8,
       note="HunyuanImage 2-D VAE: channel-matching down/upsampling by pixel (un)shuffle")
def _():
    from diffusers import AutoencoderKLHunyuanImage
    return AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 64),
                                     layers_per_block=1, spatial_compression_ratio=4, sample_size=32)


@model("diffusers", "diffusers/AutoencoderKLKVAE", (2, 3, 32, 32), align=8, note="KVAE: ResNet encoder/decoder")
def _():
    from diffusers import AutoencoderKLKVAE
    return AutoencoderKLKVAE(channels=32, num_enc_blocks=1, num_dec_blocks=1, z_channels=4, ch_mult=(1, 2, 2),
                             sample_size=32)


@model("diffusers", "diffusers/AutoencoderKLMagvit", (1, 3, 5, 32, 32), note="EasyAnimate's MagViT video VAE: "
       "causal 3-D convolutions, spatial group norm per frame", **_VIDEO)
def _():
    from diffusers import AutoencoderKLMagvit
    return AutoencoderKLMagvit(latent_channels=4, block_out_channels=[8, 8, 16, 16], layers_per_block=1,
                               norm_num_groups=4)


@model("diffusers", "diffusers/AutoencoderKLHunyuanVideo15", (1, 3, 5, 32, 32), note="HunyuanVideo 1.5's VAE: "
       "causal convolutions, channel-matching spatio-temporal down/upsampling", **_VIDEO)
def _():
    from diffusers import AutoencoderKLHunyuanVideo15
    return AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
                                       spatial_compression_ratio=4, temporal_compression_ratio=4)


@model("diffusers", "diffusers/AutoencoderVidTok", (1, 3, 5, 32, 32), note="VidTok: causal temporal down/upsampling "
       "with learned mixing, mid-block self-attention, a sampled posterior (reseeded)", **_VIDEO)
def _():
    from diffusers import AutoencoderVidTok
    return Seeded(AutoencoderVidTok(ch=8, ch_mult=[1, 2, 2], z_channels=4, num_res_blocks=1))


def _flux2_extra():
    g = torch.Generator().manual_seed(5)
    h = w = 8
    ids = torch.zeros(h, w, 4)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return {"timestep": torch.tensor([0.003, 0.5]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
            "img_ids": ids.reshape(1, h * w, 4).expand(2, -1, -1), "txt_ids": torch.zeros(2, 5, 4),
            "guidance": torch.tensor([3.5, 3.5])}


@model("diffusers", "diffusers/Flux2Transformer", (2, 64, 16), shard_dims=(1,), spatial=(1,), extra=_flux2_extra,
       note="packed image tokens split, 4-axis RoPE from plain ids, double- and single-stream blocks, guidance")
def _():
    from diffusers import Flux2Transformer2DModel
    return Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                   timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4))


def _sana_video_extra():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g)}


@model("diffusers", "diffusers/SanaVideo", (2, 4, 3, 16, 16), shard_dims=(3,), spatial=(3, 4), align=2,
       dtype="float32", extra=_sana_video_extra,
       note="linear attention with 3-D RoPE over frames x H x W, Mix-FFN; float32 (its attention casts to float32)")
def _():
    from diffusers import SanaVideoTransformer3DModel
    return SanaVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                       num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                       cross_attention_dim=16, caption_channels=16, sample_size=16)
