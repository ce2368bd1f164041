"""The model zoo's eighteenth set: lucidrains' denoising-diffusion-pytorch (the thirty-fourth session) -- the
diffusion U-Nets many scientific generative models start from: the DDPM U-Net (ResNet blocks with time
conditioning, linear attention at every level and full attention at the bottom, over the split image), its 1-D
version, the classifier-free-guidance U-Net, EDM2's magnitude-preserving Karras U-Nets (1-D, 2-D and 3-D: pixel
norms, forced weight normalization, magnitude-preserving concatenation), simple diffusion's U-ViT, and the DDPM
training objective itself (GaussianDiffusion's noised image and loss, its timesteps and noise passed in: a
ShardTensor's noise is drawn per shard, so ElucidatedDiffusion, which draws its noise inside, is not compared with
one device). Built small with random init and no dropout, on an image split along its rows. Registered like
zoo_models.py's (zoo_models.py imports this module at its end)."""
import torch

from benchmarks.zoo.zoo_models import model

_IMG = (2, 3, 32, 32)


def _time():
    return {"time": torch.tensor([3.0, 500.0])}


def _register(name, shape, build, **kw):
    model("denoising_diffusion_pytorch", f"ddpm/{name}", shape, **kw)(build)


def _unet(**kw):
    from denoising_diffusion_pytorch import Unet
    return Unet(dim=16, dim_mults=(1, 2), channels=3, attn_dim_head=8, attn_heads=2, **kw)


def _unet_1d():
    from denoising_diffusion_pytorch import Unet1D
    return Unet1D(dim=16, dim_mults=(1, 2), channels=2, attn_dim_head=8, attn_heads=2)


def _unet_cfg():
    from denoising_diffusion_pytorch.classifier_free_guidance import Unet
    return Unet(dim=16, num_classes=4, dim_mults=(1, 2), channels=3, attn_dim_head=8, attn_heads=2)


def _karras(**kw):
    from denoising_diffusion_pytorch import KarrasUnet
    return KarrasUnet(image_size=32, dim=16, dim_max=32, channels=3, num_downsamples=2, num_blocks_per_stage=1,
                      attn_res=(16, 8), attn_dim_head=8, dropout=0., **kw)


def _karras_3d():
    from denoising_diffusion_pytorch import KarrasUnet3D
    return KarrasUnet3D(image_size=16, frames=8, dim=16, dim_max=32, channels=3, num_downsamples=2,
                        num_blocks_per_stage=1, attn_res=(8,), attn_dim_head=8, dropout=0.)


def _karras_1d():
    from denoising_diffusion_pytorch import KarrasUnet1D
    return KarrasUnet1D(seq_len=64, dim=16, dim_max=32, channels=2, num_downsamples=2, num_blocks_per_stage=1,
                        attn_res=(32, 16), attn_dim_head=8, dropout=0.)


def _uvit():
    from denoising_diffusion_pytorch.simple_diffusion import UViT
    return UViT(dim=16, dim_mults=(1, 2), channels=3, vit_depth=1, vit_dropout=0., attn_dim_head=8, attn_heads=2)


def _gaussian_diffusion(objective="pred_v"):
    from denoising_diffusion_pytorch import GaussianDiffusion
    return GaussianDiffusion(_unet(), image_size=32, timesteps=100, objective=objective)


_register("Unet", _IMG, _unet, align=4, extra=_time,
          note="ResNet blocks scaled and shifted by the time embedding, linear attention, full attention at 8 x 8")
_register("Unet_flash", _IMG, lambda: _unet(flash_attn=True), align=4, extra=_time,
          note="the full attention through F.scaled_dot_product_attention")
_register("Unet_full_attn", _IMG, lambda: _unet(full_attn=(True, True)), align=4, extra=_time,
          note="full attention at every level (32 x 32 tokens split)")
_register("Unet_self_condition", _IMG, lambda: _unet(self_condition=True), align=4, extra=_time,
          note="self-conditioning: a zeros_like input concatenated along channels")
_register("Unet_learned_sinusoidal", _IMG, lambda: _unet(learned_sinusoidal_cond=True), align=4, extra=_time,
          note="learned sinusoidal time embedding")
_register("Unet1D", (2, 2, 64), _unet_1d, align=2, spatial=(2,), extra=_time, note="a 1-D signal split along time")
_register("Unet_cfg", _IMG, _unet_cfg, align=4,
          extra=lambda: {"time": torch.tensor([3.0, 500.0]), "classes": torch.tensor([1, 3]), "cond_drop_prob": 0.},
          note="classifier-free guidance: class embeddings in the time conditioning")
_register("KarrasUnet", _IMG, _karras, align=4, extra=_time,
          note="EDM2: magnitude-preserving convolutions, pixel norm over channels, mp concatenation, attention at 16 "
               "and 8")
_register("KarrasUnet_classes", _IMG, lambda: _karras(num_classes=4), align=4, dtype="float32",
          extra=lambda: {"time": torch.tensor([3.0, 500.0]), "class_labels": torch.tensor([1, 3])},
          note="class-conditional (its one-hot labels are float32: run in float32)")
_register("KarrasUnet3D", (2, 3, 8, 16, 16), _karras_3d, align=4, shard_dims=(3,), spatial=(2, 3, 4), extra=_time,
          note="video: 3-D magnitude-preserving convolutions, H split")
_register("KarrasUnet1D", (2, 2, 64), _karras_1d, align=4, spatial=(2,), extra=_time, note="1-D, split along time")
_register("UViT", _IMG, _uvit, align=4, extra=_time,
          note="simple diffusion's U-ViT: a convolutional U-Net with a transformer at the bottom")
def _noise():
    """The training objective's draws passed in (as a data loader would fix them): a timestep per sample and the
    noise, one device's values. Drawn inside on a ShardTensor, each shard's noise comes from a stream of its own
    (docs/supported-ops.md, random fills), so the loss would not equal one device's draw."""
    g = torch.Generator().manual_seed(7)
    return {"times": torch.tensor([3, 70]), "noise": torch.randn(_IMG, generator=g)}


_register("GaussianDiffusion", _IMG, _gaussian_diffusion, align=4, spatial_out=False, dtype="float32", extra=_noise,
          note="the DDPM training loss (noised image, v-prediction MSE), its timesteps and noise passed in; its "
               "schedules are float32 buffers: run in float32")
_register("GaussianDiffusion_pred_noise", _IMG, lambda: _gaussian_diffusion("pred_noise"), align=4,
          spatial_out=False, dtype="float32", extra=_noise, note="epsilon prediction")
