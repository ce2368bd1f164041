"""The model zoo's twenty-sixth set: five more diffusers autoencoders (the thirty-seventh session's probe), registered
like zoo_models.py's (zoo_models.py imports this module at its end): HunyuanImage's 2-D VAE, the KVAE, EasyAnimate's
MagViT video VAE (spatial group norm, causal 3-D convolutions), HunyuanVideo 1.5's VAE and VidTok (causal temporal
down- and upsampling with blended mixing factors, a mid-block self-attention over every frame's tokens, a posterior
sampled from the global generator, reseeded alike by `Seeded`).

VidTok found a library fault: the per-shard random guard advanced the global generator for the self-attention (an op
tagged random for its dropout), so the posterior noise drawn after it differed from one device's; such ops leave the
generator alone now when they draw nothing (src/dispatch/shard_random.cpp)."""
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
