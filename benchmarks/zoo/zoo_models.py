"""Unmodified models from timm, torchvision, MONAI, segmentation-models-pytorch, diffusers, neuraloperator and
PhysicsNeMo, run domain-parallel by sharding only their input, and compared with one process.

``run_model(name, ...)`` runs on every rank of an initialised process group (the tests' harness pools, or
``benchmarks/zoo/bench.py``'s). It builds the model from a seed (random init: no weights are downloaded), runs
one training step (forward, a fixed random weighting of every output as the loss, backward) and one eval forward
on the full input and on the input sharded along a spatial dim (uneven extents where the model allows), and
returns a picklable verdict:

- ``pass``: forward, input gradient, every parameter gradient, every buffer (BatchNorm running statistics) and
  the eval forward equal the single-process run, and the work stayed divided;
- ``raise``: the sharded run raised (the stage and the error's first line);
- ``wrong``: it ran but some value differs (the first differing quantity and its relative max error) -- the
  worst outcome, a silent wrong result;
- ``not-parallel``: values right, but the output lost its shard of a spatial dim the model keeps, or the
  activations were not divided (``share``: local over global elements of every module output; 1/world is
  perfectly divided, 1.0 is every rank doing the whole work).

The models run in float64 so that a real error (1e-3) is never confused with the rounding of a different
summation order (1e-13 here); ``dtype="float32"`` is accepted too.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import os
import time
import traceback
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------- registry


@dataclasses.dataclass
class ModelSpec:
    name: str
    library: str                       # the import name of the library: timm, monai, ...
    build: Callable[[], torch.nn.Module]
    shape: Tuple[int, ...]             # global input shape
    shard_dims: Tuple[int, ...] = (2,)  # the tensor dim a 1-D mesh shards
    spatial: Tuple[int, ...] = ()      # the spatial dims (default: 2 and after, channels first)
    align: int = 1                     # every extent a multiple of this (patch embeddings with stride = patch)
    extra: Optional[Callable[[], dict]] = None   # more forward keyword arguments (plain tensors, identical)
    spatial_out: bool = True           # the output keeps the sharded dim (so it must stay sharded)
    dtype: Optional[str] = None        # run in this dtype whatever was asked (libraries hard-coding float32)
    forward_only: bool = False         # its output carries no gradient (a metric): values compared, no backward
    reseed: bool = False               # its forward draws from the global generator (a masked autoencoder's token
                                       # choice): every run starts from the same seed (on every rank alike)
    tied_detections: bool = False      # its eval output is a detector's list of dicts whose scores tie at random
                                       # init: which of the tied boxes top-k and NMS keep is tie-breaking (see
                                       # _compare_detections), so tied detections are compared by score only
    rtol: Optional[float] = None       # judge at this relative tolerance instead of the dtype's: a float64 run of a
                                       # model whose own arithmetic is float32 in parts (a hard-coded complex64
                                       # buffer), where splitting the work reorders float32 sums
    note: str = ""


MODELS: Dict[str, ModelSpec] = {}

LIBRARY_PACKAGES = {"timm": "timm", "monai": "monai", "smp": "segmentation_models_pytorch",
                    "diffusers": "diffusers", "neuralop": "neuralop", "physicsnemo": "physicsnemo",
                    "torchvision": "torchvision", "transformers": "transformers", "torch_harmonics": "torch_harmonics", "kornia": "kornia",
                    "torchaudio": "torchaudio", "vit_pytorch": "vit_pytorch",
                    "denoising_diffusion_pytorch": "denoising_diffusion_pytorch",
                    "dynamic_network_architectures": "dynamic_network_architectures", "torchdiffeq": "torchdiffeq",
                    "aurora": "aurora", "the_well": "the_well",
                    "torch_geometric": "torch_geometric",
                    "torch": "torch"}


def model(library: str, name: str, shape, **kw):
    """Register ``fn`` (which returns a freshly built module) as ``name``."""
    def wrap(fn):
        MODELS[name] = ModelSpec(name=name, library=library, build=fn, shape=tuple(shape), **kw)
        return fn
    return wrap


def available(name: str) -> Optional[str]:
    """None when the model's library is importable, else the reason it is not."""
    lib = MODELS[name].library
    if importlib.util.find_spec(LIBRARY_PACKAGES[lib]) is None:
        return (f"{LIBRARY_PACKAGES[lib]} is not installed (an optional test dependency: the Makefile's venv step "
                "installs tests/requirements-zoo.txt; `make zoo-deps` retries)")
    return None


# -------- timm: classifiers, 64x64 unless a stride or a patch size needs more; no drop rates (deterministic)

def _timm(arch, **kw):
    import timm
    return timm.create_model(arch, pretrained=False, num_classes=10, **kw)


@model("timm", "timm/resnet18", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("resnet18")


@model("timm", "timm/resnet26d", (2, 3, 64, 64), spatial_out=False, note="deep stem, avg-pool shortcut")
def _():
    return _timm("resnet26d")


@model("timm", "timm/efficientnet_b0", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("efficientnet_b0")


@model("timm", "timm/tf_efficientnet_b0", (2, 3, 64, 64), spatial_out=False, note="TF 'same' padding (F.pad)")
def _():
    return _timm("tf_efficientnet_b0")


@model("timm", "timm/mobilenetv3_small_050", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("mobilenetv3_small_050")


@model("timm", "timm/regnetx_002", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("regnetx_002")


@model("timm", "timm/ghostnet_050", (2, 3, 64, 64), spatial_out=False)
def _():
    return _timm("ghostnet_050")


@model("timm", "timm/densenet121", (2, 3, 64, 64), spatial_out=False,
       note="64x64: at 32x32 its last BatchNorm normalises 2 values, whose gradient is pure cancellation noise")
def _():
    return _timm("densenet121")


@model("timm", "timm/convnext_atto", (2, 3, 64, 64), align=4, spatial_out=False)
def _():
    return _timm("convnext_atto")


@model("timm", "timm/poolformer_s12", (2, 3, 64, 64), align=4, spatial_out=False, note="GroupNorm(1)")
def _():
    return _timm("poolformer_s12")


@model("timm", "timm/vit_tiny", (2, 3, 32, 32), align=4, spatial_out=False, note="cls token (cat)")
def _():
    return _timm("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2)


@model("timm", "timm/deit_tiny_distilled", (2, 3, 32, 32), align=4, spatial_out=False)
def _():
    return _timm("deit_tiny_distilled_patch16_224", img_size=32, patch_size=4, depth=2)


@model("timm", "timm/mixer_s16", (2, 3, 32, 32), align=4, spatial_out=False, note="token-mixing MLP")
def _():
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=2, embed_dim=64)


@model("timm", "timm/swin_tiny", (2, 3, 56, 56), align=28, spatial_out=False, note="windows, shifted (roll)")
def _():
    return _timm("swin_tiny_patch4_window7_224", img_size=56, window_size=7, depths=(2, 2), num_heads=(2, 4),
                 embed_dim=32)


@model("timm", "timm/pvt_v2_b0", (2, 3, 64, 64), align=32, spatial_out=False, note="spatial-reduction attention")
def _():
    return _timm("pvt_v2_b0")


@model("timm", "timm/levit_128s", (2, 3, 128, 128), align=16, spatial_out=False)
def _():
    return _timm("levit_128s", img_size=128)  # at 64 its last BatchNorm1d normalises 2 values (cancellation noise)


@model("timm", "timm/mobilevit_xxs", (2, 3, 64, 64), align=32, spatial_out=False, note="unfolds 2x2 patches")
def _():
    return _timm("mobilevit_xxs")


@model("timm", "timm/edgenext_xx_small", (2, 3, 64, 64), align=32, spatial_out=False, note="channel attention")
def _():
    return _timm("edgenext_xx_small")


@model("timm", "timm/xcit_nano", (2, 3, 32, 32), align=8, spatial_out=False,
       note="convolutional stem (BatchNorm) before tokens, cross-covariance attention, class attention")
def _():
    return _timm("xcit_nano_12_p8_224", img_size=32, depth=2)


def _halonet_cfg():
    from timm.models.byobnet import ByoBlockCfg, ByoModelCfg, interleave_blocks
    # halonet26t's layout, narrow and shallow: halo attention (block 4, halo 1) at stride 8
    return ByoModelCfg(blocks=(ByoBlockCfg(type="bottle", d=1, c=32, s=1, gs=0, br=0.25),
                               interleave_blocks(types=("bottle", "self_attn"), d=2, c=64, s=2, gs=0, br=0.25)),
                       stem_chs=16, stem_type="tiered", stem_pool="maxpool", self_attn_layer="halo",
                       self_attn_kwargs=dict(block_size=4, halo_size=1))


@model("timm", "timm/halonet", (2, 3, 64, 64), align=32, spatial_out=False,
       note="blocked local attention with halos (Tensor.unfold)")
def _():
    from timm.models.byobnet import ByobNet
    return ByobNet(_halonet_cfg(), num_classes=10)


@model("timm", "timm/volo_d1", (2, 3, 64, 64), align=16, spatial_out=False,
       note="outlook attention (F.unfold/F.fold), class attention")
def _():
    from timm.models.volo import VOLO
    return VOLO(layers=[1, 1, 1, 1], img_size=64, embed_dims=[32, 64, 64, 64], num_heads=[1, 2, 2, 2],
                stem_hidden_dim=16, num_classes=10)


@model("timm", "timm/nf_resnet", (2, 3, 64, 64), spatial_out=False,
       note="normalizer-free (nf_resnet26's blocks, narrow), scaled weight standardisation")
def _():
    from timm.models.nfnet import NormFreeNet, _nfres_cfg
    return NormFreeNet(_nfres_cfg(depths=(1, 1, 1, 1), channels=(32, 64, 128, 256)), num_classes=10)


@model("timm", "timm/crossvit", (2, 3, 32, 32), align=8, spatial_out=False,
       note="two patch sizes, cross-attention of the class tokens")
def _():
    from timm.models.crossvit import CrossVit
    return CrossVit(img_size=32, img_scale=(1.0, 1.0), patch_size=(4, 8), embed_dim=(32, 64), depth=((1, 1, 0),),
                    num_heads=(2, 2), mlp_ratio=(2.0, 2.0, 1.0), num_classes=10)


@model("timm", "timm/twins_svt", (2, 3, 64, 64), align=32, spatial_out=False,
       note="locally grouped + sub-sampled global attention, conv position encoding")
def _():
    return _timm("twins_svt_small", img_size=64, embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8),
                 depths=(2, 2, 2, 2), wss=(4, 4, 2, 1))


@model("timm", "timm/eva02_tiny", (2, 3, 32, 32), align=4, spatial_out=False, note="2-D rotary embedding, SwiGLU")
def _():
    return _timm("eva02_tiny_patch14_224", img_size=32, patch_size=4, depth=2)


@model("timm", "timm/davit", (2, 3, 128, 128), align=64, spatial_out=False,
       note="spatial window attention + channel attention")
def _():
    from timm.models.davit import DaVit
    return DaVit(depths=(1, 1, 1), embed_dims=(16, 32, 64), num_heads=(1, 2, 4), window_size=4, num_classes=10)


@model("timm", "timm/mvitv2", (2, 3, 64, 64), align=32, spatial_out=False,
       note="pooling attention (strided conv pooling of q/k/v), relative positions")
def _():
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg
    return MultiScaleVit(MultiScaleVitCfg(depths=(1, 1, 1, 1), embed_dim=16, num_heads=1), img_size=(64, 64),
                         num_classes=10)


@model("timm", "timm/hiera", (2, 3, 64, 64), align=32, spatial_out=False,
       note="mask units, unrolled token order, max-pooled queries")
def _():
    return _timm("hiera_tiny_224", img_size=(64, 64), embed_dim=16, stages=(1, 1, 1, 1))


@model("timm", "timm/efficientvit_b0", (2, 3, 64, 64), align=32, spatial_out=False, dtype="float32",
       note="ReLU linear attention (multi-scale); float32: the attention casts q, k, v to float32")
def _():
    return _timm("efficientvit_b0")


# ------------------------------------------------- torchvision: video, optical flow, segmentation, Swin-V2

def _video_resnet(stem, conv_makers):
    from torchvision.models.video import resnet as vr
    return vr.VideoResNet(vr.BasicBlock, conv_makers, [1, 1, 1, 1], getattr(vr, stem), num_classes=10)


@model("torchvision", "torchvision/r2plus1d", (1, 3, 8, 32, 32), shard_dims=(3,), spatial_out=False,
       note="(2+1)-D convolutions, H sharded")
def _():
    from torchvision.models.video.resnet import Conv2Plus1D
    return _video_resnet("R2Plus1dStem", [Conv2Plus1D] * 4)


@model("torchvision", "torchvision/mc3", (1, 3, 8, 32, 32), shard_dims=(2,), spatial_out=False,
       note="3-D then (1, 3, 3) convolutions, time sharded")
def _():
    from torchvision.models.video.resnet import Conv3DNoTemporal, Conv3DSimple
    return _video_resnet("BasicStem", [Conv3DSimple] + [Conv3DNoTemporal] * 3)


@model("torchvision", "torchvision/swin3d", (1, 3, 4, 64, 64), shard_dims=(3,), align=32, spatial_out=False,
       note="3-D shifted windows, H sharded")
def _():
    from torchvision.models.video.swin_transformer import SwinTransformer3d
    return SwinTransformer3d(patch_size=[2, 4, 4], embed_dim=16, depths=[2, 2], num_heads=[1, 2],
                             window_size=[2, 4, 4], stochastic_depth_prob=0.0, num_classes=10)


class _OneDeviceNoise(torch.overrides.TorchFunctionMode):
    """Hands `torch.randn_like` / `rand_like` of a split ShardTensor one process's draw, distributed like it. A
    ShardTensor's own random draws are per shard by design (each rank its own stream, see architecture.md), so a
    latent sampled from a split tensor (a VAE's `randn_like(z_mean)` once a 2-D mesh splits its batch) can never
    equal the reference's; this is the data pipeline's noise, not a change to the model, so that everything
    downstream of the draw can be compared. Replicated and plain tensors draw as they do anyway."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import shardtensor as st
        kwargs = kwargs or {}
        t = args[0] if args else None
        if (func in (torch.randn_like, torch.rand_like) and st.is_shard_tensor(t)
                and any(isinstance(p, st.Shard) for p in st.placements(t))):
            draw = torch.randn if func is torch.randn_like else torch.rand
            whole = draw(tuple(t.shape), dtype=kwargs.get("dtype") or t.dtype, device=st.to_local(t).device)
            # A pending sum's mesh dims hold the draw whole (noise is a value, not a term of a sum).
            placements = [p if isinstance(p, st.Shard) else st.Replicate() for p in st.placements(t)]
            return st.distribute_tensor(whole, st.device_mesh(t), placements, sharding_shapes=st.sharding_shapes(t))
        return func(*args, **kwargs)


class Seeded(torch.nn.Module):
    """Reseeds the global generator before the model's forward, so that its sampled noise is the same draw in one
    process and on every rank, and hands draws on split tensors one process's numbers (_OneDeviceNoise). `fn`:
    call the model as `fn(net, x, **kw)`."""

    def __init__(self, net, fn=None):
        super().__init__()
        self.net, self.fn = net, fn

    def forward(self, x, **kw):
        torch.manual_seed(123)
        with _OneDeviceNoise():
            return self.fn(self.net, x, **kw) if self.fn else self.net(x, **kw)


class _FlowPair(torch.nn.Module):
    """RAFT on the two frames stacked along the channels (so that both are sharded alike), 2 refinement steps."""

    def __init__(self, raft):
        super().__init__()
        self.raft = raft

    def forward(self, x):
        return self.raft(x[:, :3], x[:, 3:], num_flow_updates=2)


@model("torchvision", "torchvision/raft_small", (1, 6, 128, 128), align=8, dtype="float32",
       note="all-pairs correlation volume, grid_sample lookups; the two frames stacked on the channels; float32: "
       "its coordinate grid is float32")
def _():
    from torchvision.models.optical_flow import raft_small
    return _FlowPair(raft_small(weights=None))


@model("torchvision", "torchvision/lraspp", (2, 3, 64, 64), align=32, note="MobileNetV3 + global-pool gate")
def _():
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large
    return lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)


@model("torchvision", "torchvision/fcn_resnet50", (1, 3, 32, 32), align=8, note="dilated ResNet-50")
def _():
    from torchvision.models.segmentation import fcn_resnet50
    return fcn_resnet50(weights=None, weights_backbone=None, num_classes=3, aux_loss=False)


@model("torchvision", "torchvision/swin_v2", (2, 3, 64, 64), align=32, spatial_out=False,
       note="cosine attention, continuous position bias, shifted windows")
def _():
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[1, 2], window_size=[4, 4],
                           stochastic_depth_prob=0.0, num_classes=10, block=SwinTransformerBlockV2,
                           downsample_layer=PatchMergingV2)


# -------------------------------------------------------------------------- MONAI: 2-D unless named 3d

@model("monai", "monai/UNet", (2, 1, 64, 64), note="PReLU, InstanceNorm")
def _():
    from monai.networks.nets import UNet
    return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1)


@model("monai", "monai/UNet3d", (1, 1, 16, 16, 16), note="PReLU, InstanceNorm")
def _():
    from monai.networks.nets import UNet
    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8), strides=(2,), num_res_units=1)


class _Registration(torch.nn.Module):
    """A registration network on the moving and the fixed image stacked along the channels (so that both are
    sharded alike); returns the moved image and the displacement field."""

    def __init__(self, net, channels):
        super().__init__()
        self.net, self.channels = net, channels

    def forward(self, x):
        return self.net(x[:, :self.channels], x[:, self.channels:])


@model("monai", "monai/VoxelMorph", (1, 2, 16, 16, 16), align=8,
       note="3-D registration: U-Net to a velocity field, scaling and squaring (the field warps itself, "
       "grid_sample with zeros padding) and the moving image warped (border padding) by the split field")
def _():
    from monai.networks.nets import VoxelMorph, VoxelMorphUNet
    backbone = VoxelMorphUNet(spatial_dims=3, in_channels=2, unet_out_channels=4, channels=(4, 8, 8, 8),
                              final_conv_channels=(4,))
    return _Registration(VoxelMorph(backbone=backbone, integration_steps=3, spatial_dims=3), 1)


@model("monai", "monai/VoxelMorph2d", (2, 2, 32, 32), align=8, note="2-D VoxelMorph (MONAI's half_res needs 3-D)")
def _():
    from monai.networks.nets import VoxelMorph, VoxelMorphUNet
    backbone = VoxelMorphUNet(spatial_dims=2, in_channels=2, unet_out_channels=4, channels=(4, 8, 8, 8),
                              final_conv_channels=(4,))
    return _Registration(VoxelMorph(backbone=backbone, integration_steps=3, spatial_dims=2), 1)


@model("monai", "monai/BasicUNet", (2, 1, 64, 64))
def _():
    from monai.networks.nets import BasicUNet
    return BasicUNet(spatial_dims=2, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4))


@model("monai", "monai/AttentionUnet", (2, 1, 64, 64))
def _():
    from monai.networks.nets import AttentionUnet
    return AttentionUnet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2))


@model("monai", "monai/SegResNet", (2, 1, 64, 64), note="GroupNorm")
def _():
    from monai.networks.nets import SegResNet
    return SegResNet(spatial_dims=2, init_filters=8, in_channels=1, out_channels=2, blocks_down=(1, 2, 2),
                     blocks_up=(1, 1))


@model("monai", "monai/DynUNet", (2, 1, 64, 64))
def _():
    from monai.networks.nets import DynUNet
    return DynUNet(spatial_dims=2, in_channels=1, out_channels=2, kernel_size=[3, 3, 3], strides=[1, 2, 2],
                   upsample_kernel_size=[2, 2], filters=[4, 8, 16])


@model("monai", "monai/HighResNet", (2, 1, 32, 32), note="dilated convolutions")
def _():
    from monai.networks.nets import HighResNet
    return HighResNet(spatial_dims=2, in_channels=1, out_channels=2)


@model("monai", "monai/resnet10", (2, 1, 64, 64), spatial_out=False)
def _():
    from monai.networks.nets import resnet10
    return resnet10(spatial_dims=2, n_input_channels=1, num_classes=3)


@model("monai", "monai/DenseNet", (2, 1, 64, 64), spatial_out=False)
def _():
    from monai.networks.nets import DenseNet
    return DenseNet(spatial_dims=2, in_channels=1, out_channels=3, init_features=8, growth_rate=4,
                    block_config=(2, 2))


@model("monai", "monai/ViT", (2, 1, 32, 32), align=8, spatial_out=False, note="cls token")
def _():
    from monai.networks.nets import ViT
    return ViT(in_channels=1, img_size=(32, 32), patch_size=(8, 8), spatial_dims=2, hidden_size=48, mlp_dim=96,
               num_layers=2, num_heads=4, classification=True, num_classes=3)


@model("monai", "monai/UNETR", (2, 1, 32, 32), align=16)
def _():
    from monai.networks.nets import UNETR
    return UNETR(in_channels=1, out_channels=2, img_size=(32, 32), spatial_dims=2, feature_size=4, hidden_size=48,
                 mlp_dim=96, num_heads=4)


@model("monai", "monai/SwinUNETR", (2, 1, 64, 64), align=32, note="windows, shifted (roll)")
def _():
    from monai.networks.nets import SwinUNETR
    return SwinUNETR(in_channels=1, out_channels=2, spatial_dims=2, feature_size=12, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 2, 2))


@model("monai", "monai/SwinUNETR-v2", (2, 1, 64, 64), align=32, note="v2: a residual conv block per stage")
def _():
    from monai.networks.nets import SwinUNETR
    return SwinUNETR(in_channels=1, out_channels=2, spatial_dims=2, feature_size=12, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 2, 2), use_v2=True)


@model("monai", "monai/FlexibleUNet", (2, 1, 64, 64), align=32, note="EfficientNet-B0 encoder")
def _():
    from monai.networks.nets import FlexibleUNet
    return FlexibleUNet(in_channels=1, out_channels=2, backbone="efficientnet-b0", spatial_dims=2,
                        decoder_channels=(32, 16, 8, 8, 8))


@model("monai", "monai/MedNeXt", (2, 1, 32, 32), align=16, note="depthwise 7x7, GroupNorm, inverted bottlenecks")
def _():
    from monai.networks.nets import MedNeXt
    return MedNeXt(spatial_dims=2, init_filters=8, in_channels=1, out_channels=2, blocks_down=(1, 1, 1, 1),
                   blocks_bottleneck=1, blocks_up=(1, 1, 1, 1))


@model("monai", "monai/SegResNetDS", (2, 1, 64, 64), align=4, note="deep supervision (several outputs)")
def _():
    from monai.networks.nets import SegResNetDS
    return SegResNetDS(spatial_dims=2, init_filters=8, in_channels=1, out_channels=2, blocks_down=(1, 2, 2),
                       dsdepth=2)


@model("monai", "monai/Restormer", (2, 3, 32, 32), align=8,
       note="transposed (channel) attention, pixel (un)shuffle")
def _():
    from monai.networks.nets.restormer import Restormer
    return Restormer(spatial_dims=2, in_channels=3, out_channels=3, dim=8, num_blocks=(1, 1, 1, 1),
                     heads=(1, 1, 2, 2), num_refinement_blocks=1)


# ------------------------------------------------------- segmentation-models-pytorch: 64x64, random encoders

def _smp(arch, encoder="resnet18", **kw):
    import segmentation_models_pytorch as smp
    return getattr(smp, arch)(encoder_name=encoder, encoder_weights=None, in_channels=3, classes=2, **kw)


@model("smp", "smp/Unet-resnet18", (2, 3, 64, 64), align=32)
def _():
    return _smp("Unet", decoder_channels=(32, 16, 8, 8, 8))


@model("smp", "smp/Unet-mobilenet_v2", (2, 3, 64, 64), align=32)
def _():
    return _smp("Unet", "mobilenet_v2", decoder_channels=(32, 16, 8, 8, 8))


@model("smp", "smp/UnetPlusPlus", (2, 3, 64, 64), align=32)
def _():
    return _smp("UnetPlusPlus", encoder_depth=3, decoder_channels=(16, 8, 8))


@model("smp", "smp/FPN", (2, 3, 64, 64), align=32)
def _():
    return _smp("FPN", decoder_pyramid_channels=32, decoder_segmentation_channels=32)


@model("smp", "smp/Linknet", (2, 3, 64, 64), align=32)
def _():
    return _smp("Linknet")


@model("smp", "smp/PSPNet", (2, 3, 64, 64), align=32, note="pyramid pooling")
def _():
    return _smp("PSPNet", psp_out_channels=32)


@model("smp", "smp/DeepLabV3", (2, 3, 64, 64), align=32, note="ASPP, global pooling branch")
def _():
    return _smp("DeepLabV3", decoder_channels=32)


@model("smp", "smp/DeepLabV3Plus", (2, 3, 64, 64), align=32)
def _():
    return _smp("DeepLabV3Plus", decoder_channels=32)


@model("smp", "smp/MAnet", (2, 3, 64, 64), align=32, note="position attention (HW x HW)")
def _():
    return _smp("MAnet", decoder_channels=(32, 16, 8, 8, 8), decoder_pab_channels=16)


@model("smp", "smp/UPerNet", (2, 3, 64, 64), align=32)
def _():
    return _smp("UPerNet", decoder_channels=16)


@model("smp", "smp/Segformer-mit_b0", (2, 3, 64, 64), align=32)
def _():
    return _smp("Segformer", "mit_b0", decoder_segmentation_channels=16)


# --------------------------------------------------------------------------- diffusers: from config dicts

def _timestep():
    return {"timestep": torch.tensor([3, 500])}


@model("diffusers", "diffusers/UNet2DModel", (2, 3, 32, 32), align=4, extra=_timestep, note="GroupNorm, attention")
def _():
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(16, 32),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                       layers_per_block=1, norm_num_groups=8, attention_head_dim=8)


def _cross():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g)}


@model("diffusers", "diffusers/UNet2DConditionModel", (2, 4, 32, 32), align=4, extra=_cross, note="cross-attention")
def _():
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                                norm_num_groups=8, cross_attention_dim=16, attention_head_dim=8)


@model("diffusers", "diffusers/AutoencoderKL", (2, 3, 32, 32), align=4)
def _():
    from diffusers import AutoencoderKL
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         latent_channels=4, norm_num_groups=8)


@model("diffusers", "diffusers/VQModel", (2, 3, 32, 32), align=4, note="codebook argmin")
def _():
    from diffusers import VQModel
    return VQModel(in_channels=3, out_channels=3, block_out_channels=(16, 32),
                   down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                   latent_channels=4, num_vq_embeddings=16, norm_num_groups=8, vq_embed_dim=4)


@model("diffusers", "diffusers/AutoencoderTiny", (2, 3, 32, 32), align=8, dtype="float32")
def _():
    from diffusers import AutoencoderTiny
    return AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                           num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1), latent_channels=4)


@model("diffusers", "diffusers/UNet1DModel", (2, 2, 64), extra=lambda: {"timestep": torch.tensor([3, 500])},
       align=8)
def _():
    from diffusers import UNet1DModel
    return UNet1DModel(sample_size=64, in_channels=2, out_channels=2, block_out_channels=(32, 32, 64),
                       extra_in_channels=64, down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
                       up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"),
                       mid_block_type="UNetMidBlock1D", use_timestep_embedding=False, time_embedding_type="fourier",
                       flip_sin_to_cos=True, layers_per_block=1)


@model("diffusers", "diffusers/Transformer2DModel", (2, 8, 16, 16), note="continuous input, GroupNorm + proj")
def _():
    from diffusers import Transformer2DModel
    return Transformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=8, num_layers=1,
                              norm_num_groups=4)


@model("diffusers", "diffusers/DiTTransformer2DModel", (2, 4, 16, 16), align=2,
       extra=lambda: {"timestep": torch.tensor([3, 500]), "class_labels": torch.tensor([1, 2])})
def _():
    from diffusers import DiTTransformer2DModel
    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                 num_layers=1, sample_size=16, patch_size=2, num_embeds_ada_norm=10,
                                 norm_num_groups=4)


def _video_cross():
    g = torch.Generator().manual_seed(5)
    return {"timestep": torch.tensor([3, 500]), "encoder_hidden_states": torch.randn(2, 5, 16, generator=g)}


@model("diffusers", "diffusers/UNet3DConditionModel", (2, 4, 4, 16, 16), shard_dims=(3,), spatial=(3, 4), align=2,
       extra=_video_cross, note="frames x H x W, temporal attention and convolutions, H sharded")
def _():
    from diffusers import UNet3DConditionModel
    return UNet3DConditionModel(sample_size=16, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                                up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), layers_per_block=1,
                                norm_num_groups=8, cross_attention_dim=16, attention_head_dim=8)


class _ControlNetPair(torch.nn.Module):
    """ControlNet on the latent and the conditioning image stacked along the channels (both sharded alike; the
    conditioning embedding keeps the latent's resolution)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, timestep, encoder_hidden_states):
        return self.net(x[:, :4], timestep, encoder_hidden_states, controlnet_cond=x[:, 4:], return_dict=False)


@model("diffusers", "diffusers/ControlNetModel", (2, 7, 32, 32), align=4, extra=_cross,
       note="latent + conditioning image on the channels; outputs the residuals of every down block")
def _():
    from diffusers import ControlNetModel
    return _ControlNetPair(ControlNetModel(in_channels=4, conditioning_channels=3, block_out_channels=(16, 32),
                                           down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                           layers_per_block=1, norm_num_groups=8, cross_attention_dim=16,
                                           attention_head_dim=8, conditioning_embedding_out_channels=(8,)))


# --------------------------------------------------------------- neuraloperator: spectral (FFT) operators

@model("neuralop", "neuralop/FNO", (2, 1, 32, 32))
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2)


@model("neuralop", "neuralop/TFNO", (2, 1, 32, 32))
def _():
    from neuralop.models import TFNO
    return TFNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2,
                factorization="tucker", rank=0.5)


@model("neuralop", "neuralop/UNO", (2, 1, 32, 32))
def _():
    from neuralop.models import UNO
    return UNO(in_channels=1, out_channels=1, hidden_channels=8, n_layers=3, uno_out_channels=[8, 8, 8],
               uno_n_modes=[[8, 8], [4, 4], [8, 8]], uno_scalings=[[1, 1], [0.5, 0.5], [2, 2]], channel_mlp_skip="linear")


@model("neuralop", "neuralop/FNO-1d", (2, 1, 64))
def _():
    from neuralop.models import FNO
    return FNO(n_modes=(8,), in_channels=1, out_channels=1, hidden_channels=8, n_layers=2)


# ------------------------------------------------------------------------------------------- PhysicsNeMo

@model("physicsnemo", "physicsnemo/FNO", (2, 1, 32, 32))
def _():
    from physicsnemo.models.fno import FNO
    return FNO(in_channels=1, out_channels=1, dimension=2, latent_channels=8, num_fno_layers=2, num_fno_modes=8,
               padding=4, decoder_layer_size=8)


@model("physicsnemo", "physicsnemo/AFNO", (2, 2, 32, 32), align=8, dtype="float32")
def _():
    from physicsnemo.models.afno import AFNO
    return AFNO(inp_shape=[32, 32], in_channels=2, out_channels=2, patch_size=[8, 8], embed_dim=16, depth=2,
                num_blocks=4)


@model("physicsnemo", "physicsnemo/UNet3d", (1, 1, 16, 16, 16), align=4, note="3-D, GroupNorm")
def _():
    from physicsnemo.models.unet import UNet
    return UNet(in_channels=1, out_channels=1, model_depth=2, feature_map_channels=(4, 4, 8, 8),
                num_conv_blocks=2, normalization="groupnorm", normalization_args={"num_groups": 2},
                gradient_checkpointing=False)


@model("physicsnemo", "physicsnemo/SRResNet3d", (1, 1, 8, 16, 16), note="3-D, PReLU, pixel shuffle")
def _():
    from physicsnemo.models.srrn import SRResNet
    return SRResNet(in_channels=1, out_channels=1, conv_layer_size=8, n_resid_blocks=2, scaling_factor=2)


@model("physicsnemo", "physicsnemo/Pix2Pix", (2, 1, 32, 32), align=8, note="reflect padding")
def _():
    from physicsnemo.models.pix2pix import Pix2Pix
    return Pix2Pix(in_channels=1, out_channels=1, dimension=2, conv_layer_size=8, n_downsampling=2,
                   n_upsampling=2, n_blocks=2)


@model("physicsnemo", "physicsnemo/DiT", (2, 2, 32, 32), align=4,
       extra=lambda: {"t": torch.tensor([0.1, 0.7])})
def _():
    from physicsnemo.models.dit import DiT
    return DiT(input_size=(32, 32), in_channels=2, patch_size=(4, 4), hidden_size=32, depth=2, num_heads=2)


@model("physicsnemo", "physicsnemo/Transolver", (2, 32, 32, 2), shard_dims=(1,), spatial=(1, 2),
       note="structured 32x32, channels last")
def _():
    from physicsnemo.models.transolver import Transolver
    return Transolver(functional_dim=2, out_dim=1, n_layers=2, n_hidden=32, n_head=2, slice_num=8,
                      structured_shape=(32, 32), unified_pos=True, ref=4, use_te=False)


@model("physicsnemo", "physicsnemo/SongUNet", (2, 2, 16, 16), align=4,
       extra=lambda: {"noise_labels": torch.tensor([0.1, 0.7]), "class_labels": None})
def _():
    from physicsnemo.models.diffusion_unets import SongUNet
    return SongUNet(img_resolution=16, in_channels=2, out_channels=2, model_channels=16, channel_mult=[1, 2],
                    num_blocks=1, attn_resolutions=[8], dropout=0.0)


@model("physicsnemo", "physicsnemo/DhariwalUNet", (2, 2, 16, 16), align=4,
       extra=lambda: {"noise_labels": torch.tensor([0.1, 0.7]), "class_labels": None})
def _():
    from physicsnemo.models.diffusion_unets import DhariwalUNet
    return DhariwalUNet(img_resolution=16, in_channels=2, out_channels=2, model_channels=64, channel_mult=[1, 2],
                        num_blocks=1, attn_resolutions=[8], dropout=0.0)


@model("physicsnemo", "physicsnemo/Pangu", (1, 72, 32, 32), align=16,
       note="3-D Earth windows with latitude-dependent bias, surface + 13 levels")
def _():
    from physicsnemo.models.pangu import Pangu
    return Pangu(img_size=(32, 32), patch_size=(2, 4, 4), embed_dim=16, num_heads=(1, 2, 2, 1),
                 window_size=(2, 2, 4))


@model("physicsnemo", "physicsnemo/FengWu", (1, 14, 32, 32), align=16,
       note="one encoder per variable, variables folded into the tokens")
def _():
    from physicsnemo.models.fengwu import Fengwu
    return Fengwu(img_size=(32, 32), pressure_level=2, embed_dim=16, patch_size=(4, 4), num_heads=(1, 2, 2, 1),
                  window_size=(2, 2, 4))


@model("physicsnemo", "physicsnemo/DLWP", (2, 2, 6, 16, 16), shard_dims=(3,), spatial=(3, 4), align=4,
       note="cubed sphere: 6 faces, halo padding across faces (rot90), H sharded")
def _():
    from physicsnemo.models.dlwp import DLWP
    return DLWP(nr_input_channels=2, nr_output_channels=2, nr_initial_channels=8, depth=2)


# ------------------------------------------------------------------------------------ running and judging

RTOL = {torch.float64: 1e-9, torch.float32: 2e-4}
# SHARDTENSOR_ZOO_AUTOCAST=bfloat16 (or float16): every forward, the reference's and the sharded one, under
# torch.autocast on the input's device type, as mixed-precision training runs; run with --dtype float32. Two
# bfloat16 computations that sum in another order differ by units of bfloat16's last place, which a deep model
# amplifies: each quantity's tolerance is its own noise scale -- how far the reference under autocast lies from the
# same reference without it (a third copy of the model, run in the model's dtype) -- times AUTOCAST_NOISE_FACTOR,
# and at least AUTOCAST_MIN_RTOL (about one bfloat16 rounding). A sharded run is as far from the reference as two
# low-precision computations are from each other; an error well beyond that is the library's.
AUTOCAST = os.environ.get("SHARDTENSOR_ZOO_AUTOCAST", "")
AUTOCAST_NOISE_FACTOR = 4.0
AUTOCAST_MIN_RTOL = 1e-2
# A parameter gradient that is zero in exact arithmetic (a convolution's bias before a norm) is, on one device, one
# rounding of a small float sum; sharded, the sum of the ranks' partial sums, each rounded to the low precision: their
# rounding is that of the partials (as in data-parallel training), far beyond the reference's own noise relative to
# the tiny value. Gradients are compared relative to at least this fraction of the model's largest gradient (about
# one bfloat16 rounding of it, at the tolerance).
AUTOCAST_GRAD_FLOOR = 0.25


def _autocast(fn):
    """``fn`` run under torch.autocast (SHARDTENSOR_ZOO_AUTOCAST), or ``fn`` itself."""
    if not AUTOCAST:
        return fn
    dtype = getattr(torch, AUTOCAST)

    def run(x, **kwargs):
        with torch.autocast(x.device.type, dtype=dtype):
            return fn(x, **kwargs)
    return run
# SHARDTENSOR_ZOO_ANOMALY=1: a backward error also prints the forward stack of the op whose backward failed.
# SHARDTENSOR_ZOO_COMPILE=<backend> (aot_eager, inductor): the sharded model and the one-process reference run as
# torch.compile(model, backend=...) in the training step and the eval forward; activations are not measured then
# (forward hooks inside compiled code), the outputs' layout still is.
ANOMALY = os.environ.get("SHARDTENSOR_ZOO_ANOMALY", "") not in ("", "0")
# A parameter gradient is compared relative to at least this fraction of the largest one: a gradient that is zero in
# exact arithmetic (a conv bias before InstanceNorm, a key bias under softmax) holds only rounding noise, and in
# float32 the floor must keep the tolerance (RTOL x floor x largest) above one unit in the last place of the largest.
GRAD_FLOOR = {torch.float64: 1e-4, torch.float32: 1e-2}


def _flat_tensors(out) -> list:
    """Every tensor of a model's output (tensor, tuple/list, dict, or a dataclass such as diffusers' outputs)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _flat_tensors(v)]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in _flat_tensors(getattr(out, f.name))]
    return []


def cast(module: torch.nn.Module, dt: torch.dtype) -> torch.nn.Module:
    """``module.to(dt)`` for real parameters and buffers, the matching complex dtype for complex ones (a plain
    ``.to(torch.float64)`` would drop the imaginary part of neuraloperator's spectral weights)."""
    complex_dt = {torch.float64: torch.complex128, torch.float32: torch.complex64}[dt]
    return module._apply(lambda t: t.to(dt) if t.is_floating_point() else t.to(complex_dt) if t.is_complex() else t)


def _no_dropout(module: torch.nn.Module):
    """Dropout, stochastic-depth and label-dropout probabilities set to 0 (smp's FPN/PSPNet/DeepLab heads default
    to 0.2-0.5, its MiT encoder to drop-path 0.1, diffusers' DiT drops class labels with 0.1, timm's GhostNet head calls F.dropout with drop_rate 0.2, torchvision's StochasticDepth, MONAI's EfficientNet drop-connect 0.2): random masks differ between one process and the ranks' generators, so no
    comparison could pass; the modules still run."""
    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "drop_prob", None), float):  # timm-style DropPath
            m.drop_prob = 0.0
        if isinstance(getattr(m, "dropout_prob", None), float):  # diffusers' class-label dropout (DiT)
            m.dropout_prob = 0.0
        if isinstance(getattr(m, "drop_rate", None), float):  # timm heads calling F.dropout (GhostNet: 0.2)
            m.drop_rate = 0.0
        if type(m).__name__ == "StochasticDepth" and isinstance(getattr(m, "p", None), float):  # torchvision
            m.p = 0.0
        if isinstance(getattr(m, "drop_connect_rate", None), float):  # MONAI's EfficientNet blocks (0.2 scaled)
            m.drop_connect_rate = 0.0


def _build(spec: "ModelSpec") -> torch.nn.Module:
    """The model, with every parameter and buffer that its library leaves uninitialised (``torch.empty`` never
    written: diffusers' LuminaNextDiT ``pad_token``) filled with NaN, as torch does in deterministic mode. Left
    as it was, such memory differs between the ranks and between runs: `_randomize_zeros` then drew different values
    on different ranks (an all-zero block took a draw, garbage did not), the ranks held different models, and the
    comparison failed now and then (the zoo's intermittent LuminaNextDiT rows)."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        return spec.build()
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _randomize_zeros(module: torch.nn.Module, seed: int):
    """Seeded small values for parameters a library initialises to zero (output convolutions of diffusion
    models, layer scales, adaLN-Zero) or leaves uninitialised (NaN, see `_build`), so that no upstream gradient is
    trivially zero and every rank holds the same model (an uninitialised parameter takes the draw an all-zero one
    would: the values of the runs where its memory happened to be zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.numel() and (p.isnan().any() or p.abs().max() == 0):
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def _full(t):
    import shardtensor as st
    return st.full_tensor(t) if st.is_shard_tensor(t) else t


def _compare_detections(out, ref, cmp, tie_rtol: float = 1e-9):
    """A detector's eval output (a list of dicts per image: boxes, labels, scores, masks, keypoints) against one
    device's, where random weights make many scores tie (ReLU zeros pooled into identical features): a rounding
    difference of one ulp in a tied score decides which of the tied boxes top-k and NMS keep, and in which order.
    The scores are compared sorted (the same values, whatever the order); a detection whose score no other one
    shares (within ``tie_rtol``, in both outputs) is compared field by field with its counterpart."""
    for i, (o, r) in enumerate(zip(out, ref)):
        o = {k: _full(v) for k, v in o.items()}
        rs, os_ = r["scores"], o["scores"]
        if rs.shape != os_.shape:
            cmp(f"eval image {i} scores", os_, rs)
            continue
        cmp(f"eval image {i} sorted scores", os_.sort(descending=True).values, rs.sort(descending=True).values)

        def alone(s):  # scores no other one ties
            close = (s[:, None] - s[None, :]).abs() <= tie_rtol * s.abs().clamp_min(1.0)[:, None]
            return close.sum(1) == 1
        ri = torch.nonzero(alone(rs)).flatten()
        if ri.numel() == 0:
            continue
        # Each untied reference score's counterpart: the output detection with the nearest score, itself untied.
        oi = (os_[None, :] - rs[ri][:, None]).abs().argmin(1)
        keep = alone(os_)[oi]
        ri, oi = ri[keep], oi[keep]
        for key, rv in r.items():
            if key != "scores" and isinstance(rv, torch.Tensor) and key in o:
                cmp(f"eval image {i} {key} (untied)", o[key][oi].to(rv.dtype), rv[ri])


def _weighted_loss(outs, weights) -> torch.Tensor:
    """The training step's loss: every floating output against its fixed random weights."""
    return sum((o * w).sum() for o, w in zip(outs, weights) if o.is_floating_point())


def _func_grad_step(model: torch.nn.Module, xs: torch.Tensor, extra: dict, weights, input_grad: bool) -> list:
    """SHARDTENSOR_ZOO_FUNC=grad: the training step's gradients by torch.func.grad over functional_call (the input's
    and the trainable parameters'), stored in ``.grad`` as .backward() would; returns the outputs (grad's aux)."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss(p, x):
        outs = _flat_tensors(torch.func.functional_call(model, p, (x,), extra))
        return _weighted_loss(outs, weights), [o.detach() for o in outs]
    (g_params, g_input), out = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(params, xs.detach())
    for n, p in model.named_parameters():
        if n in g_params:
            p.grad = g_params[n]
    if input_grad:
        xs.grad = g_input
    return out


def _grad_scale(ref: torch.nn.Module) -> float:
    """The reference's largest parameter gradient (the scale of the gradient comparisons' floor)."""
    return max([p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None and p.grad.numel()]
               or [0.0])


def _rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor): ``floor`` (a fraction of the model's gradient scale) keeps a gradient
    that is zero in exact arithmetic (a key bias under softmax) from comparing rounding noise with itself."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    if not b.numel():
        return 0.0
    # Equal values count as equal also where they are not finite: NaN on both sides, the same infinity on both
    # (a clamp bound buffer left at +-inf); neither may make the scale NaN or infinite.
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = (a - b).abs().masked_fill(same, 0)
    if not torch.isfinite(diff).all():
        return float("inf")
    finite = b.abs()[torch.isfinite(b)]
    scale = max(finite.max().item() if finite.numel() else 0.0, floor)
    return diff.max().item() / max(scale, 1e-30)


def aligned_extents(n: int, k: int, align: int = 1, seed: int = 0) -> list:
    """A deterministic uneven split of ``n`` over ``k`` in multiples of ``align`` (zero allowed; the
    remainder of ``n / align`` on the last coordinate), the same on every rank."""
    blocks = n // align
    g = torch.Generator().manual_seed(1000 + seed)
    cuts = sorted(torch.randint(0, blocks + 1, (k - 1,), generator=g).tolist())
    bounds = [0] + cuts + [blocks]
    ext = [align * (bounds[i + 1] - bounds[i]) for i in range(k)]
    ext[-1] += n - align * blocks
    return ext


def even_extents(n: int, k: int, align: int = 1) -> list:
    blocks = n // align
    ext = [align * (blocks // k + (1 if i < blocks % k else 0)) for i in range(k)]
    ext[-1] += n - align * blocks
    return ext


class _ActivationShare:
    """Forward hooks on every leaf module: local and global element counts of their ShardTensor outputs. A plain
    output is computed from parameters and constants only (every op on a ShardTensor returns one): the single
    device computes it too and no spatial split could divide it (Swin-V2's continuous position-bias MLP over its
    relative-coordinate table), so it is counted apart (``plain``), not as undivided activation."""

    def __init__(self, module):
        import shardtensor as st
        self.local = self.total = 0
        self.largest_whole = 0      # the largest module output every rank holds entirely (global elements)
        self.largest = 0
        self.plain = 0              # elements of plain (input-independent) outputs

        def hook(_m, _inp, out):
            for t in _flat_tensors(out):
                n = t.numel()
                if not st.is_shard_tensor(t):
                    self.plain += n
                    continue
                loc = st.to_local(t).numel()
                self.local += loc
                self.total += n
                self.largest = max(self.largest, n)
                # Whole on every rank: no mesh dim splits it (a split whose extents give one rank everything, as the
                # zoo's uneven extents do deep in a network, is not "whole": the other ranks hold none of it).
                if not any(p.is_shard() for p in st.placements(t)):
                    self.largest_whole = max(self.largest_whole, n)

        self.handles = [m.register_forward_hook(hook) for m in module.modules() if not list(m.children())]
        # Every module (leaf or not) that returns a plain tensor of at least half its largest ShardTensor input's size
        # from ShardTensor inputs: every op on a ShardTensor returns one, so such an output came from a write into a
        # plain buffer (``out = torch.zeros(global shape); out[...] = f(x)``) or an explicit gather -- whole on every
        # rank. The largest (its size over that input's, and the module's class) is reported, not judged: a
        # position table computed from the input's shape alone would be one too.
        self.plain_from_sharded = (0.0, "")

        def audit(m, inp, out):
            flat_in = _flat_tensors(inp)
            sharded = [t.numel() for t in flat_in if st.is_shard_tensor(t)]
            if not sharded or max(sharded) == 0:
                return
            passed_through = {id(t) for t in flat_in}  # plain inputs handed on (a detector's targets), not made here
            for t in _flat_tensors(out):
                if id(t) in passed_through:
                    continue
                ratio = t.numel() / max(sharded)
                if not st.is_shard_tensor(t) and ratio >= 0.5 and ratio > self.plain_from_sharded[0]:
                    self.plain_from_sharded = (ratio, type(m).__name__)

        self.handles += [m.register_forward_hook(audit) for m in module.modules()]
        # A module whose children its forward never calls (kornia's DenseSIFTDescriptor holds its pooling
        # convolutions as modules but convolves with their weights functionally) reports no leaf output: its own
        # output, which its hook sees after every leaf's, is then what is counted.
        def root_hook(_m, _inp, out):
            if self.total == 0 and self.mode is None:
                hook(None, None, out)

        if list(module.children()):
            self.handles.append(module.register_forward_hook(root_hook))
        # A module wrapping library functions (the kornia set's ``Call``) has no leaf modules inside the call: its
        # one output (often a scalar loss) says nothing of the work. Count every torch function's output instead.
        self.mode = None
        if getattr(module, "share_by_ops", False):
            from torch.overrides import TorchFunctionMode

            class _EveryOp(TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    out = func(*args, **(kwargs or {}))
                    hook(None, None, out)
                    return out

            self.mode = _EveryOp()
            self.mode.__enter__()

    def remove(self):
        for h in self.handles:
            h.remove()
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None

    def reduce(self):
        """Every rank's local counts summed (outside any CommCounter), so all ranks judge the same numbers."""
        t = torch.tensor([float(self.local)], dtype=torch.float64)
        dist.all_reduce(t)
        self.local = t.item() / dist.get_world_size()

    @property
    def share(self) -> float:
        """Mean over ranks of the local fraction of every module output's elements."""
        return self.local / self.total if self.total else 1.0


def _calls(counter) -> dict:
    return dict(sorted(counter.calls.items()))


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def _placements_for(spec: ModelSpec, mesh_shape, shard_dims):
    import shardtensor as st
    return [st.Shard(d) for d in shard_dims]


def _twin(spec: "ModelSpec", model: torch.nn.Module, dt: torch.dtype, seed: int) -> torch.nn.Module:
    """The single-process reference: a deep copy, or, for a module that cannot be copied (torch-harmonics'
    attention layers hold a torch.ops namespace), the same build with the model's state loaded."""
    try:
        return copy.deepcopy(model)
    except TypeError:
        torch.manual_seed(seed)
        twin = cast(_build(spec), dt)
        twin.load_state_dict(model.state_dict())
        _no_dropout(twin)
        return twin


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}  # by tensor rank


def _memory_format(ndim: int):
    """The memory format SHARDTENSOR_ZOO_MEMORY_FORMAT asks for an input of ``ndim`` dims (None: as built)."""
    if os.environ.get("SHARDTENSOR_ZOO_MEMORY_FORMAT", "") != "channels_last":
        return None
    return _CHANNELS_LAST.get(ndim)


def _to_channels_last(model: torch.nn.Module):
    """Every 4-D parameter and buffer in channels_last order, every 5-D one in channels_last_3d (Module.to's
    memory_format takes one format for both ranks, which a model with 2-D and 3-D convolutions refuses)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.dim() in _CHANNELS_LAST:
                t.data = t.data.contiguous(memory_format=_CHANNELS_LAST[t.dim()])


def _enable_checkpointing(model: torch.nn.Module) -> bool:
    """Switch on the library's activation checkpointing in ``model`` or the outermost submodule that has a switch;
    False when none has."""
    for mod in model.modules():
        for switch, args in (("set_grad_checkpointing", (True,)), ("enable_gradient_checkpointing", ()),
                             ("gradient_checkpointing_enable", ()),
                             ("configure_activation_checkpointing", ())):  # Aurora's (torch's checkpoint_wrapper)
            fn = getattr(mod, switch, None)
            if callable(fn):
                try:
                    fn(*args)
                except (ValueError, NotImplementedError, AssertionError, TypeError):
                    continue  # a model class that declares the switch but does not support it
                return True
    return False


def run_model(name: str, mesh_shape: Optional[Sequence[int]] = None, shard_dims: Optional[Sequence[int]] = None,
              even: bool = False, dtype: str = "float64", seed: int = 0) -> dict:
    """Run model ``name`` on every rank of the default process group (see the module docstring).

    ``mesh_shape``: the CPU mesh (default 1-D over all ranks); ``shard_dims``: the tensor dim sharded by each
    mesh dim (default the model's); ``even``: the default split instead of uneven extents."""
    import shardtensor as st
    from torch.distributed.device_mesh import init_device_mesh

    spec = MODELS[name]
    world = dist.get_world_size()
    mesh_shape = tuple(mesh_shape or (world,))
    if shard_dims is None:
        # A 2-D mesh shards the first two spatial dims (H and W), or the batch and the only one.
        sp = spec.spatial or tuple(range(2, len(spec.shape)))
        shard_dims = spec.shard_dims if len(mesh_shape) == 1 else sp[:2] if len(sp) >= 2 else (0, sp[0])
    shard_dims = tuple(shard_dims)
    if len(shard_dims) != len(mesh_shape):
        raise ValueError(f"{len(shard_dims)} shard dims for a {len(mesh_shape)}-D mesh")
    dtype = spec.dtype or dtype
    dt = getattr(torch, dtype)
    rtol = spec.rtol or RTOL[dt]
    t0 = time.perf_counter()
    res = {"model": name, "library": spec.library, "world": world, "mesh": list(mesh_shape),
           "shard_dims": list(shard_dims), "dtype": dtype}
    if len(set(shard_dims)) < len(shard_dims):
        # One shardable dim (a point cloud's points): a 2-D mesh would split it twice, which no layout allows.
        res.update(result="n/a", detail=f"one shardable dim: a {len(mesh_shape)}-D mesh would split dim "
                   f"{shard_dims[0]} over several mesh dims", seconds=0.0)
        return res
    stage = "build"
    try:
        m = _mesh(mesh_shape)
        torch.manual_seed(seed)
        model = cast(_build(spec), dt)
        _randomize_zeros(model, seed + 1)
        _no_dropout(model)
        ref = _twin(spec, model, dt, seed)
        g = torch.Generator().manual_seed(seed + 2)
        x = torch.randn(spec.shape, generator=g, dtype=torch.float64).to(dt)
        # SHARDTENSOR_ZOO_MEMORY_FORMAT=channels_last: the model's parameters and the input (the reference's and
        # every rank's shard) in channels-last order, as mixed-precision CNN training sets them up; 4-D / 5-D inputs.
        fmt = _memory_format(len(spec.shape))
        if fmt is not None:
            _to_channels_last(model), _to_channels_last(ref)
            x = x.contiguous(memory_format=fmt)
        # SHARDTENSOR_ZOO_INPUT_GRAD=0: the input takes no gradient, as in training (only the parameters do), so each
        # first layer's backward computes no input gradient. A model without parameters is an `n/a` row then.
        input_grad = os.environ.get("SHARDTENSOR_ZOO_INPUT_GRAD", "1") != "0"
        if not input_grad and not any(p.requires_grad for p in model.parameters()):
            res.update(result="n/a", detail="no parameters: nothing to train without an input gradient", seconds=0.0)
            return res
        # SHARDTENSOR_ZOO_ACTIVATION_CHECKPOINTING=1: the library's own activation checkpointing switched on in both
        # (timm's set_grad_checkpointing, diffusers' enable_gradient_checkpointing, transformers'
        # gradient_checkpointing_enable, Aurora's configure_activation_checkpointing): the training step recomputes the
        # blocks in the backward. A model without such a switch is an `n/a` row.
        if os.environ.get("SHARDTENSOR_ZOO_ACTIVATION_CHECKPOINTING") == "1":
            if not (_enable_checkpointing(model) and _enable_checkpointing(ref)):
                res.update(result="n/a", detail="no activation checkpointing switch", seconds=0.0)
                return res
        extra = {k: (v.to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                 for k, v in (spec.extra() if spec.extra else {}).items()}
        extents = {}
        for i, (d, k) in enumerate(zip(shard_dims, mesh_shape)):
            if d > 0:  # spatial dims follow the model's alignment (channels are never sharded here)
                ext = even_extents(spec.shape[d], k, spec.align) if even else \
                    aligned_extents(spec.shape[d], k, spec.align, seed + i)
            else:
                ext = even_extents(spec.shape[d], k)
            extents[i] = ext
        res["extents"] = extents

        stage = "single-process"
        backend = os.environ.get("SHARDTENSOR_ZOO_COMPILE")
        # Compiled, the reference is compiled too: a library may take another path under torch.compile
        # (kornia's crops gather where eagerly they slice), which need not agree with its eager one.
        run_ref = _autocast(torch.compile(ref, backend=backend) if backend else ref)
        # SHARDTENSOR_ZOO_FUNC=grad: the sharded model's gradients come from torch.func.grad over
        # torch.func.functional_call (input and parameters), as functional training code (a PINN's loss) takes them;
        # the reference's from .backward(). Both in evaluation mode: functorch refuses, on one device too, the
        # running-statistics update of a batch norm in training inside grad.
        func = os.environ.get("SHARDTENSOR_ZOO_FUNC") == "grad"
        model.train(not func), ref.train(not func)
        xr = x.clone().requires_grad_(not spec.forward_only and input_grad)
        reseed = (lambda: torch.manual_seed(seed + 3)) if spec.reseed else (lambda: None)
        reseed()
        out_ref = _flat_tensors(run_ref(xr, **extra))
        weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in out_ref]
        if not spec.forward_only:
            _weighted_loss(out_ref, weights).backward()
            if func:  # torch.func.grad gives a parameter the loss does not reach zeros, .backward() no gradient
                for p in [*ref.parameters(), xr]:
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
        noise, ref_exact = {}, None   # autocast: each quantity's noise scale (see AUTOCAST)
        if AUTOCAST:
            stage = "single-process without autocast"
            ref_exact = _twin(spec, model, dt, seed)
            ref_exact.train(not func)
            x_exact = x.clone().requires_grad_(xr.requires_grad)
            reseed()
            out_exact = _flat_tensors(ref_exact(x_exact, **extra))
            if not spec.forward_only:
                _weighted_loss(out_exact, [w.to(o.dtype) for w, o in zip(weights, out_exact)]).backward()
            scale = _grad_scale(ref_exact)
            for i, (o, r) in enumerate(zip(out_ref, out_exact)):
                noise[f"output {i}"] = _rel_err(o.to(r.dtype), r)
            if xr.grad is not None and x_exact.grad is not None:
                noise["input grad"] = _rel_err(xr.grad, x_exact.grad)
            for (pn, pr), (_, pe) in zip(ref.named_parameters(), ref_exact.named_parameters()):
                if pr.grad is not None and pe.grad is not None:
                    noise[f"grad {pn}"] = _rel_err(pr.grad, pe.grad, AUTOCAST_GRAD_FLOOR * scale)
            for (bn, br), (_, be) in zip(ref.named_buffers(), ref_exact.named_buffers()):
                if br.is_floating_point():
                    noise[f"buffer {bn}"] = _rel_err(br, be)

        stage = "forward"
        xs = st.distribute_tensor(x, m, _placements_for(spec, mesh_shape, shard_dims), sharding_shapes=extents)
        if fmt is not None:
            xs = xs.contiguous(memory_format=fmt)
        xs = xs.requires_grad_(not spec.forward_only and input_grad)
        # (forward hooks inside compiled code or a torch.func transform see no ShardTensors: not measured there)
        share = _ActivationShare(model if not backend and not func else torch.nn.Identity())
        run = _autocast(torch.compile(model, backend=backend) if backend else model)
        reseed()
        if func and not spec.forward_only:
            stage = "torch.func.grad"
            with st.CommCounter() as fwd:
                out = _func_grad_step(model, xs, extra, weights, input_grad)  # (its collectives all count here)
        else:
            with st.CommCounter() as fwd, torch.autograd.set_detect_anomaly(ANOMALY, check_nan=False):
                out = _flat_tensors(run(xs, **extra))
        share.remove()
        share.reduce()
        stage = "backward"
        with st.CommCounter() as bwd, torch.autograd.set_detect_anomaly(ANOMALY, check_nan=False):
            loss = _weighted_loss(out, weights)
            if not spec.forward_only and not func:
                loss.backward()
        res["calls_forward"], res["calls_backward"] = _calls(fwd), _calls(bwd)
        res["calls_step"] = fwd.total_calls + bwd.total_calls
        res["share"] = round(share.share, 3)
        res["largest_whole"] = round(share.largest_whole / max(share.largest, 1), 3)
        res["plain_share"] = round(share.plain / max(share.plain + share.total, 1), 3)
        if share.plain_from_sharded[1]:
            res["plain_from_sharded"] = f"{share.plain_from_sharded[1]} {share.plain_from_sharded[0]:.2f}"
        res["out_placements"] = [str(st.placements(o)) if st.is_shard_tensor(o) else "plain" for o in out]

        stage = "compare"
        problems = []   # (quantity, relative error)

        def cmp(what, a, b, floor=0.0):
            if a is None or b is None:
                if (a is None) != (b is None):
                    problems.append((f"{what}: {'missing' if a is None else 'unexpected'} gradient", float("inf")))
                return
            e = _rel_err(_full(a), b, floor)
            tol = max(AUTOCAST_NOISE_FACTOR * noise.get(what, 0.0), AUTOCAST_MIN_RTOL) if AUTOCAST else rtol
            if not e <= tol:
                problems.append((f"{what} (noise {noise[what]:.2g})" if what in noise else what, e))

        def compare_step(prefix):
            """A training step's outputs, input gradient, parameter gradients and buffers against the reference's
            (quantities named after `prefix`)."""
            grad_scale = _grad_scale(ref)
            for i, (o, r) in enumerate(zip(out, out_ref)):
                cmp(f"{prefix}output {i}", o, r)
            if len(out) != len(out_ref):
                problems.append((f"{prefix}{len(out)} outputs, expected {len(out_ref)}", float("inf")))
            if xs.grad is not None and not st.is_shard_tensor(xs.grad):
                problems.append((f"{prefix}input gradient is plain", float("inf")))
            cmp(f"{prefix}input grad", xs.grad, xr.grad)
            for (pn, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
                if p.grad is not None and st.is_shard_tensor(p.grad):
                    problems.append((f"{prefix}grad {pn} is a ShardTensor", float("inf")))
                floor = (AUTOCAST_GRAD_FLOOR if AUTOCAST else GRAD_FLOOR[dt]) * grad_scale
                cmp(f"{prefix}grad {pn}", p.grad, pr.grad, floor)
            for (bn, b), (_, br) in zip(model.named_buffers(), ref.named_buffers()):
                if st.is_shard_tensor(b):
                    problems.append((f"{prefix}buffer {bn} became a ShardTensor", float("inf")))
                if b.is_floating_point() or b.dtype in (torch.int64, torch.int32):
                    cmp(f"{prefix}buffer {bn}", b.to(torch.float64) if not b.is_floating_point() else b,
                        br.to(torch.float64) if not br.is_floating_point() else br)

        compare_step("")

        # SHARDTENSOR_ZOO_STEPS=2: a second training step after an optimizer step (SGD with momentum on both, one
        # learning rate from the reference's gradients, so no parameter moves by more than 1e-2), as a training loop
        # runs: what a layer caches across calls (local weights, plans, version-keyed windows) must follow the
        # parameters the optimizer changed in place. The sharded model then takes the reference's parameters and
        # buffers (in place again), so the second step starts from the same values: the first step's rounding
        # differences, which some models amplify (FRN, BN over few elements), do not count against the second.
        trainable = [p for p in model.parameters() if p.requires_grad]
        if int(os.environ.get("SHARDTENSOR_ZOO_STEPS", "1")) > 1 and not spec.forward_only and trainable:
            stage = "second step"
            grad_scale = _grad_scale(ref)
            lr = 1e-2 / grad_scale if grad_scale > 0 else 1e-2
            opts = [torch.optim.SGD([p for p in mm.parameters() if p.requires_grad], lr=lr, momentum=0.9)
                    for mm in (model, ref)]
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            with torch.no_grad():
                for t, tr in zip(list(model.parameters()) + list(model.buffers()),
                                 list(ref.parameters()) + list(ref.buffers())):
                    t.copy_(tr)
            xr.grad, xs.grad = None, None
            reseed()
            out_ref = _flat_tensors(run_ref(xr, **extra))
            _weighted_loss(out_ref, weights).backward()
            reseed()
            out = _flat_tensors(run(xs, **extra))
            _weighted_loss(out, weights).backward()
            compare_step("step 2 ")

        stage = "eval"
        model.eval(), ref.eval()
        # SHARDTENSOR_ZOO_EVAL=inference_mode: the eval forward under torch.inference_mode (inference tensors, no
        # version counters, no views tracked), as inference scripts run; the default is no_grad.
        inference = os.environ.get("SHARDTENSOR_ZOO_EVAL") == "inference_mode"
        eval_mode = torch.inference_mode if inference else torch.no_grad
        with eval_mode():
            reseed()
            raw_eval_ref = run_ref(x, **extra)
            reseed()
            with st.CommCounter() as ev:
                raw_eval = run(xs.detach(), **extra)
            if ref_exact is not None:
                ref_exact.eval()
                reseed()
                for i, (o, r) in enumerate(zip(_flat_tensors(raw_eval_ref), _flat_tensors(ref_exact(x, **extra)))):
                    noise[f"eval output {i}"] = _rel_err(o.to(r.dtype), r)
        out_eval_ref, out_eval = _flat_tensors(raw_eval_ref), _flat_tensors(raw_eval)
        res["calls_eval"] = _calls(ev)
        stage = "compare eval"
        if spec.tied_detections:
            _compare_detections(raw_eval, raw_eval_ref, cmp)
        else:
            for i, (o, r) in enumerate(zip(out_eval, out_eval_ref)):
                cmp(f"eval output {i}", o, r)

        if problems:
            worst = max(problems, key=lambda p: p[1])
            res.update(result="wrong", detail=f"{problems[0][0]} (rel. max err {problems[0][1]:.2g}); "
                       f"{len(problems)} quantities differ, worst {worst[0]} ({worst[1]:.2g})",
                       max_err=worst[1], wrong=[p[0] for p in problems[:20]])
        else:
            res.update(result="pass", detail="", max_err=0.0)
            # Compiled or under torch.func: activations are not measured, the outputs' layout still is.
            why = _not_parallel(spec, out, res["share"] if not backend and not func else 0.0,
                                int(torch.tensor(mesh_shape).prod()))
            if why:
                res.update(result="not-parallel", detail=why)
    except Exception as e:  # noqa: BLE001 -- the verdict of a model that does not run
        res.update(result="raise", detail=f"[{stage}] {_first_line(e)}", error=_first_line(e), stage=stage,
                   traceback=traceback.format_exc()[-4000:])
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _not_parallel(spec: ModelSpec, out, share: float, world: int) -> str:
    import shardtensor as st
    if world == 1:
        return ""
    if spec.spatial_out and out:
        o = out[0]
        if not st.is_shard_tensor(o) or not any(p.is_shard() for p in st.placements(o)):
            return f"the output is {'plain' if not st.is_shard_tensor(o) else st.placements(o)} (not sharded)"
    # Perfectly divided work holds 1/world of every activation; halos, heads and replicated small tensors add
    # to that. Half-way to every rank holding everything means the work was not divided.
    limit = 0.5 * (1.0 + 1.0 / world)
    if share > limit:
        return f"activations {share:.2f} of the global size per rank (divided work: {1 / world:.2f})"
    return ""


_meshes: dict = {}


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh
    key = tuple(shape)
    if key not in _meshes:
        names = ("domain",) if len(key) == 1 else tuple(f"d{i}" for i in range(len(key)))
        _meshes[key] = init_device_mesh("cpu", key, mesh_dim_names=names)
    return _meshes[key]


# The second to twenty-fourth sets of models (registered on import; they import this module's registry).
from benchmarks.zoo import zoo_models_more  # noqa: E402,F401
from benchmarks.zoo import zoo_models_third  # noqa: E402,F401
from benchmarks.zoo import zoo_models_fourth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_fifth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_sixth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_seventh  # noqa: E402,F401
from benchmarks.zoo import zoo_models_eighth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_ninth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_tenth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_eleventh  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twelfth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_thirteenth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_fourteenth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_fifteenth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_sixteenth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_seventeenth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_eighteenth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_nineteenth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twentieth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twentyfirst  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twentysecond  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twentythird  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twentyfourth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twentyfifth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twentysixth  # noqa: E402,F401
from benchmarks.zoo import zoo_models_twentyseventh  # noqa: E402,F401

# More sets named by the environment (comma-separated module names, e.g. a probe of models outside the zoo):
# imported here so that the rank processes, which import this module, register them too.
for _extra in filter(None, os.environ.get("SHARDTENSOR_ZOO_EXTRA", "").split(",")):
    importlib.import_module(_extra.strip())
