"""The model zoo's seventeenth set: lucidrains' vit-pytorch (the thirty-fourth session) -- some thirty vision
transformers written in einops, each a different way of cutting an image into tokens and mixing them: patch
rearranges, cls and register tokens concatenated to the sequence, convolutional token embeddings (CvT, CCT, LeViT,
local / ScalableViT / SepViT / MaxViT / RegionViT / CrossFormer / Twins windows), pooling-based pyramids (PiT's
unfold, NesT's blocks), cross-attention between two patch sizes (CrossViT, LookViT), cross-covariance attention
(XCiT), video and volume ViTs (ViViT, ViT-3D) and a 1-D ViT over a sequence. Built small with random init and no
dropout, on an image split along its rows (the ViTs' patch rows, so ``align`` is the patch size). Registered like
zoo_models.py's (zoo_models.py imports this module at its end)."""
from benchmarks.zoo.zoo_models import model

_IMG = (2, 3, 32, 32)
_SMALL = dict(num_classes=10, dim=32, depth=2, heads=2, mlp_dim=64, dim_head=16)


def _register(name, shape, build, **kw):
    model("vit_pytorch", f"vit_pytorch/{name}", shape, spatial_out=kw.pop("spatial_out", False), **kw)(build)


def _patch_vit(module, cls, **kw):
    """A builder of vit-pytorch's ``module.cls`` for the 32 x 32 image in patches of 8, small."""
    def build():
        import importlib
        return getattr(importlib.import_module(f"vit_pytorch.{module}"), cls)(image_size=32, patch_size=8, **_SMALL,
                                                                              **kw)
    return build


def _cross_vit():
    from vit_pytorch.cross_vit import CrossViT
    return CrossViT(image_size=32, num_classes=10, sm_dim=32, lg_dim=48, sm_patch_size=8, sm_enc_heads=2,
                    sm_enc_mlp_dim=64, sm_enc_dim_head=16, lg_patch_size=16, lg_enc_depth=1, lg_enc_heads=2,
                    lg_enc_mlp_dim=64, lg_enc_dim_head=16, cross_attn_depth=1, cross_attn_heads=2,
                    cross_attn_dim_head=16, depth=1, dropout=0., emb_dropout=0.)


def _cct():
    from vit_pytorch.cct import CCT
    return CCT(img_size=32, embedding_dim=32, n_conv_layers=2, kernel_size=3, stride=1, padding=1,
               pooling_kernel_size=3, pooling_stride=2, pooling_padding=1, num_layers=2, num_heads=2, mlp_ratio=2.,
               num_classes=10, positional_embedding="learnable", attention_dropout=0., stochastic_depth_rate=0.)


def _cct_sine():
    from vit_pytorch.cct import CCT
    return CCT(img_size=32, embedding_dim=32, n_conv_layers=1, kernel_size=3, stride=1, padding=1,
               pooling_kernel_size=3, pooling_stride=2, pooling_padding=1, num_layers=1, num_heads=2, mlp_ratio=2.,
               num_classes=10, positional_embedding="sine", attention_dropout=0., stochastic_depth_rate=0.)


def _cvt():
    from vit_pytorch.cvt import CvT
    return CvT(num_classes=10, s1_emb_dim=16, s1_heads=1, s1_depth=1, s2_emb_dim=32, s2_heads=2, s2_depth=1,
               s3_emb_dim=48, s3_heads=2, s3_depth=1, dropout=0.)


def _levit():
    from vit_pytorch.levit import LeViT
    return LeViT(image_size=64, num_classes=10, stages=3, dim=(32, 48, 64), depth=1, heads=(2, 2, 2), mlp_mult=2,
                 dim_key=8, dim_value=16, dropout=0.)


def _pit():
    from vit_pytorch.pit import PiT
    return PiT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=(1, 1), heads=2, mlp_dim=64, dim_head=16)


def _regionvit():
    from vit_pytorch.regionvit import RegionViT
    return RegionViT(dim=(16, 32, 48, 64), depth=(1, 1, 1, 1), window_size=2, num_classes=10, local_patch_size=4)


def _crossformer():
    from vit_pytorch.crossformer import CrossFormer
    return CrossFormer(dim=(32, 64, 96, 128), depth=(1, 1, 1, 1), global_window_size=(2, 2, 2, 1),
                       local_window_size=2, num_classes=10)


def _scalable_vit():
    from vit_pytorch.scalable_vit import ScalableViT
    return ScalableViT(num_classes=10, dim=16, heads=(1, 2, 2, 2), depth=(1, 1, 1, 1), reduction_factor=(4, 2, 1, 1),
                       window_size=(2, 2, None, None), iwsa_dim_key=8, iwsa_dim_value=8, ssa_dim_key=8,
                       ssa_dim_value=8)


def _sep_vit():
    from vit_pytorch.sep_vit import SepViT
    return SepViT(num_classes=10, dim=16, dim_head=8, heads=(1, 2, 2), depth=(1, 1, 1))   # (its windows are 7 wide)


def _max_vit():
    from vit_pytorch.max_vit import MaxViT
    return MaxViT(num_classes=10, dim_conv_stem=16, dim=16, dim_head=8, depth=(1, 1), window_size=2, dropout=0.)


def _nest():
    from vit_pytorch.nest import NesT
    return NesT(image_size=32, patch_size=4, dim=16, heads=2, num_hierarchies=3, block_repeats=(1, 1, 1),
                num_classes=10, dim_head=8)


def _mobile_vit():
    from vit_pytorch.mobile_vit import MobileViT
    return MobileViT(image_size=(64, 64), dims=[24, 32, 40], channels=[8, 8, 16, 16, 24, 24, 32, 32, 40, 40, 96],
                     num_classes=10)


def _twins_svt():
    from vit_pytorch.twins_svt import TwinsSVT
    return TwinsSVT(num_classes=10, s1_emb_dim=16, s1_local_patch_size=2, s1_global_k=2, s2_emb_dim=32,
                    s2_local_patch_size=2, s2_global_k=2, s3_emb_dim=32, s3_local_patch_size=2, s3_global_k=2,
                    s3_depth=1, s4_emb_dim=48, s4_local_patch_size=1, s4_global_k=1, s4_depth=1)


def _t2t():
    from vit_pytorch.t2t import T2TViT
    return T2TViT(image_size=32, num_classes=10, dim=32, depth=1, heads=2, mlp_dim=64, dim_head=16,
                  t2t_layers=((7, 4), (3, 2)))


def _normalized_vit():
    from vit_pytorch.normalized_vit import nViT
    return nViT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, heads=2, mlp_dim=64, dim_head=16)


def _vit_3d():
    from vit_pytorch.vit_3d import ViT
    return ViT(image_size=32, image_patch_size=8, frames=8, frame_patch_size=2, channels=3, **_SMALL)


def _simple_vit_3d():
    from vit_pytorch.simple_vit_3d import SimpleViT
    return SimpleViT(image_size=32, image_patch_size=8, frames=8, frame_patch_size=2, channels=3, **_SMALL)


def _vivit():
    from vit_pytorch.vivit import ViViT
    return ViViT(image_size=32, image_patch_size=8, frames=8, frame_patch_size=2, num_classes=10, dim=32,
                 spatial_depth=1, temporal_depth=1, heads=2, mlp_dim=64, dim_head=16, use_flash_attn=False)


def _vit_1d():
    from vit_pytorch.vit_1d import ViT
    return ViT(seq_len=64, patch_size=8, channels=3, **_SMALL)


def _simple_vit_1d():
    from vit_pytorch.simple_vit_1d import SimpleViT
    return SimpleViT(seq_len=64, patch_size=8, channels=3, **_SMALL)


_register("ViT", _IMG, _patch_vit("vit", "ViT"), align=8,
          note="cls token concatenated, pos_embedding sliced to the sequence")
_register("ViT_mean_pool", _IMG, _patch_vit("vit", "ViT", pool="mean"), align=8,
          note="mean over the split token sequence")
_register("SimpleViT", _IMG, _patch_vit("simple_vit", "SimpleViT"), align=8,
          note="2-D sin-cos position embedding computed from the grid")
_register("CaiT", _IMG, _patch_vit("cait", "CaiT", cls_depth=1), align=8,
          note="class-attention layers: the cls token attends to the patch tokens")
_register("DeepViT", _IMG, _patch_vit("deepvit", "DeepViT"), align=8,
          note="re-attention: a head-mixing matrix on the attention map")
_register("CrossViT", _IMG, _cross_vit, align=16, note="two patch sizes, cross attention between their cls tokens")
_register("CCT", _IMG, _cct, note="convolutional tokenizer, sequence pooling (attention-weighted token mean)")
_register("CCT_sine", _IMG, _cct_sine, note="sine position embedding")
_register("CvT", _IMG, _cvt, align=16, note="convolutional token embedding and convolutional q/k/v projections")
_register("LeViT", (2, 3, 64, 64), _levit, align=16, note="convolutional stem, attention with downsampling")
_register("PiT", _IMG, _pit, align=8, note="nn.Unfold patches with overlap, depth-wise conv pooling of tokens")
_register("RegionViT", (2, 3, 64, 64), _regionvit, align=32,
          note="regional tokens and local windows, the two attended jointly")
_register("CrossFormer", (2, 3, 64, 64), _crossformer, align=32, dtype="float32",
          note="cross-scale embedding (several kernel sizes), long and short distance attention windows; its "
               "dynamic position bias is float32 (built in forward): run in float32")
_register("ScalableViT", (2, 3, 64, 64), _scalable_vit, align=32,
          note="scalable self-attention (reduced keys) and interactive windowed attention")
_register("SepViT", (2, 3, 112, 112), _sep_vit, align=16,
          note="depth-wise separable window attention, window tokens (7 x 7 windows: 112 x 112 image)")
_register("MaxViT", _IMG, _max_vit, align=8, note="MBConv, block and grid attention (einops window partitions)")
_register("NesT", _IMG, _nest, align=16, note="nested block attention, conv + max-pool aggregation between levels")
_register("MobileViT", (2, 3, 64, 64), _mobile_vit, align=32, note="MobileNet-v2 blocks, unfold into patches")
_register("TwinsSVT", (2, 3, 64, 64), _twins_svt, align=32,
          note="locally-grouped and global sub-sampled attention, positional encoding generator (conv)")
_register("T2TViT", _IMG, _t2t, align=8, note="tokens-to-token: nn.Unfold soft splits between transformer layers")
_register("XCiT", _IMG, _patch_vit("xcit", "XCiT", cls_depth=1), align=8,
          note="cross-covariance attention (over channels), local patch interaction")
_register("RvT", _IMG, _patch_vit("rvt", "RvT"), align=8,
          note="rotary embedding over the patch grid, depth-wise conv projections")
_register("ParallelViT", _IMG, _patch_vit("parallel_vit", "ViT", num_parallel_branches=2), align=8,
          note="parallel attention and feed-forward branches")
_register("ViT_small_dataset", _IMG, _patch_vit("vit_for_small_dataset", "ViT"), align=8,
          note="shifted patch tokenization (F.pad shifts), locality self-attention (diagonal mask)")
_register("ViT_patch_merger", _IMG,
          _patch_vit("vit_with_patch_merger", "ViT", patch_merge_layer=1, patch_merge_num_tokens=4), align=8,
          note="a learned query pooling tokens to 4")
_register("SimpleViT_registers", _IMG,
          _patch_vit("simple_vit_with_register_tokens", "SimpleViT", num_register_tokens=2), align=8,
          note="register tokens packed and unpacked")
_register("SimpleViT_qk_norm", _IMG, _patch_vit("simple_vit_with_qk_norm", "SimpleViT"), align=8,
          note="normalized queries and keys")
_register("SimpleViT_fft", _IMG, _patch_vit("simple_vit_with_fft", "SimpleViT", freq_patch_size=8), align=8,
          note="a second token stream from the image's 2-D FFT")
_register("nViT", _IMG, _normalized_vit, align=8, note="normalized transformer: hypersphere L2 norms throughout")
_register("ViT_3d", (2, 3, 8, 32, 32), _vit_3d, align=8, shard_dims=(3,), spatial=(2, 3, 4),
          note="a volume (frames, H, W) in 2 x 8 x 8 patches (a 4 x 4 x 4 grid), split along H")
_register("SimpleViT_3d", (2, 3, 8, 32, 32), _simple_vit_3d, align=8, shard_dims=(3,), spatial=(2, 3, 4),
          note="3-D sin-cos embedding")
_register("ViViT", (2, 3, 8, 32, 32), _vivit, align=8, shard_dims=(3,), spatial=(2, 3, 4),
          note="factorized encoder: spatial transformer per frame, then temporal")
_register("ViT_1d", (2, 3, 64), _vit_1d, align=8, spatial=(2,), note="a 1-D signal in patches of 8, split along time")
_register("SimpleViT_1d", (2, 3, 64), _simple_vit_1d, align=8, spatial=(2,), note="1-D sin-cos embedding")
