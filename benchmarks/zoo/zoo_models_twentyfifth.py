"""The model zoo's twenty-fifth set: seventeen more Hugging Face transformers vision models (the thirty-seventh
session's probe), each from a small random config, registered like zoo_models.py's (zoo_models.py imports this module
at its end): PVT v1 (spatial-reduction attention, position embeddings resized in the forward), ViTDet (windowed and
global blocks with decomposed relative positions), DINOv3's ViT (2-D RoPE from the patch grid; in training it draws a
random rescale of the patch coordinates from the global generator, reseeded alike) and ConvNeXt, HGNet-V2, TextNet,
SAM's ViT image encoder (windows, global blocks, relative positions, the neck), AIMv2 and MLCD vision encoders,
EoMT (queries joined to the patch tokens in its last blocks, masked attention from its own mask predictions),
SuperPoint (dense keypoint scores and descriptors from a grayscale image), ViT-MAE (random token masking from the
global generator, reseeded alike), MaskFormer over a Swin backbone, DAB-DETR, RT-DETRv2 (deformable attention with
per-level sampling points), V-JEPA 2's video encoder (tubelets, 3-D RoPE) and ZoeDepth (a BEiT backbone, DPT neck and
metric bins with attractors).

Three judgement notes. EoMT runs in float32: its attention mask is made float32 (`attention_mask.float()`) whatever
the model's dtype, and torch 2.11's CPU flash kernel for `scaled_dot_product_attention` gives wrong results for a
float64 query with a float32 additive mask (adding a float32 zero mask changes a 16 x 8 attention by 1.8; the math
backend is right), so a float64 reference cannot be trusted -- in float32 query and mask agree. AIMv2 and MLCD
round through float32 inside (AIMv2's RMSNorm normalizes in float32, MLCD's rotary table is float32), so a float64
run is judged at rtol 1e-6: a last-bit difference of a float64 sum split across ranks becomes one float32 ulp there.
DAB-DETR builds float32 tensors itself (float32)."""
import torch

from benchmarks.zoo.zoo_models import Seeded, model
from benchmarks.zoo.zoo_models_seventh import _TINY_VIT, _hf, _hf_vision, tiny_rt_detr

_V = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=64,
          patch_size=8)
_V_NO_MLP = {k: v for k, v in _V.items() if k != "intermediate_size"}
_FLOAT32_ROUNDING = ("rtol 1e-6: it rounds through float32 inside, so a last-bit difference of a float64 sum split "
                     "across ranks becomes one float32 ulp")

_hf_vision("pvt", (2, 3, 64, 64), "PvtForImageClassification", "PvtConfig", align=32,
           note="spatial-reduction attention; position embeddings resized to the input in the forward",
           image_size=64, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 2, 2],
           mlp_ratios=[2, 2, 2, 2], sequence_reduction_ratios=[4, 2, 2, 1], num_labels=10)
_hf_vision("vitdet", (2, 3, 64, 64), "VitDetModel", "VitDetConfig", align=8,
           note="a windowed block and a global block, decomposed relative positions", window_size=4,
           window_block_indices=[0], use_relative_position_embeddings=True, pretrain_image_size=64, **_V_NO_MLP)


@model("transformers", "transformers/dinov3_vit", (2, 3, 64, 64), align=8, spatial_out=False, reseed=True,
       note="2-D RoPE from the patch grid, register tokens; training draws a random coordinate rescale (reseeded)")
def _():
    return _hf("DINOv3ViTModel", "DINOv3ViTConfig", num_register_tokens=2, **_V)


_hf_vision("dinov3_convnext", (2, 3, 64, 64), "DINOv3ConvNextModel", "DINOv3ConvNextConfig", align=32,
           note="ConvNeXt stages, pooled and patch outputs", hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1])
_hf_vision("hgnet_v2", (2, 3, 64, 64), "HGNetV2ForImageClassification", "HGNetV2Config", align=32,
           note="HG blocks with light convolutions and aggregation", num_labels=10)
_hf_vision("textnet", (2, 3, 64, 64), "TextNetModel", "TextNetConfig", align=32,
           note="asymmetric (1x3, 3x1) re-parameterizable convolutions")
_hf_vision("sam_vision", (2, 3, 64, 64), "SamVisionModel", "SamVisionConfig", align=8,
           note="SAM's image encoder: windowed and global blocks, relative positions, the convolutional neck",
           hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64, image_size=64, patch_size=8,
           window_size=2, global_attn_indexes=[1], output_channels=16)


@model("transformers", "transformers/aimv2_vision", (2, 3, 64, 64), align=8, spatial_out=False, rtol=1e-6,
       note="RMSNorm, SwiGLU, 2-D sin-cos positions; " + _FLOAT32_ROUNDING)
def _():
    return _hf("Aimv2VisionModel", "Aimv2VisionConfig", **_V)


@model("transformers", "transformers/mlcd_vision", (2, 3, 64, 64), align=8, spatial_out=False, rtol=1e-6,
       note="2-D rotary positions with a learned class position; " + _FLOAT32_ROUNDING)
def _():
    return _hf("MLCDVisionModel", "MLCDVisionConfig", **_V)


@model("transformers", "transformers/eomt", (2, 3, 64, 64), align=8, spatial_out=False, dtype="float32",
       note="queries joined to the split patch tokens in the last block, attention masked by its own mask "
            "predictions (interpolated, written into a plain mask); float32 (see the module's note)")
def _():
    return _hf("EomtForUniversalSegmentation", "EomtConfig", num_blocks=1, num_queries=4, num_labels=3, **_V_NO_MLP)


_hf_vision("superpoint", (2, 1, 64, 64), "SuperPointForKeypointDetection", "SuperPointConfig", align=8,
           note="dense keypoint scores (softmax over 65 cells, pixel shuffle) and descriptors; top keypoints",
           encoder_hidden_sizes=[8, 8, 16, 16], decoder_hidden_size=32, descriptor_decoder_dim=32, max_keypoints=16)


@model("transformers", "transformers/vit_mae", (2, 3, 64, 64), align=8, spatial_out=False,
       note="random masking of half the tokens (noise from the global generator, reseeded), encoder on the kept ones")
def _():
    return Seeded(_hf("ViTMAEModel", "ViTMAEConfig", mask_ratio=0.5, **_TINY_VIT))


@model("transformers", "transformers/maskformer", (2, 3, 64, 64), align=32, spatial_out=False,
       note="Swin backbone, pixel decoder (FPN), DETR decoder over the split memory, mask embeddings")
def _():
    import transformers
    swin = transformers.SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=2,
                                   image_size=64, out_features=["stage1", "stage2", "stage3", "stage4"])
    detr = dict(model_type="detr", d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=4, dropout=0.0,
                attention_dropout=0.0, activation_dropout=0.0)
    return transformers.MaskFormerForInstanceSegmentation(transformers.MaskFormerConfig(
        backbone_config=swin, num_queries=4, num_labels=3, mask_feature_size=32, fpn_feature_size=32,
        decoder_config=detr))


@model("transformers", "transformers/dab_detr", (2, 3, 64, 64), align=32, spatial_out=False, dtype="float32",
       note="dynamic anchor boxes as queries, sine position embeddings of the split feature map; float32 (it "
            "builds float32 tensors itself)")
def _():
    import transformers
    backbone = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1],
                                         out_features=["stage4"])
    return transformers.DabDetrForObjectDetection(transformers.DabDetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, hidden_size=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_queries=4, num_labels=3, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0))


@model("transformers", "transformers/rt_detr_v2", (2, 3, 64, 64), align=32, spatial_out=False,
       note="RT-DETRv2: hybrid encoder, deformable decoder with per-level sampling points, top-k query selection")
def _():
    return tiny_rt_detr("RTDetrV2ForObjectDetection", "RTDetrV2Config")


class _VJEPA2Encoder(torch.nn.Module):
    """V-JEPA 2's encoder alone (the predictor is for its self-supervised objective)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x, skip_predictor=True).last_hidden_state


@model("transformers", "transformers/vjepa2", (2, 4, 3, 32, 32), shard_dims=(3,), spatial=(3, 4), align=8,
       spatial_out=False, note="V-JEPA 2's video encoder: 3-D tubelet embedding, 3-D RoPE over frames x H x W")
def _():
    import transformers
    cfg = transformers.VJEPA2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0,
                                    crop_size=32, patch_size=8, frames_per_clip=4, tubelet_size=2,
                                    pred_hidden_size=16, pred_num_hidden_layers=1, pred_num_attention_heads=2,
                                    pred_num_mask_tokens=2)
    return _VJEPA2Encoder(transformers.VJEPA2Model(cfg))


@model("transformers", "transformers/zoedepth", (2, 3, 64, 64), align=8, spatial_out=False,
       note="ZoeDepth: BEiT backbone with relative position bias, DPT neck, metric bins with attractors")
def _():
    import transformers
    backbone = transformers.BeitConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                       intermediate_size=64, image_size=64, patch_size=8, out_indices=[1, 2, 3, 4],
                                       use_relative_position_bias=True, reshape_hidden_states=False)
    return transformers.ZoeDepthForDepthEstimation(transformers.ZoeDepthConfig(
        backbone_config=backbone, neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16,
        reassemble_hidden_size=32, num_relative_features=8, bottleneck_features=16, bin_embedding_dim=16,
        num_attractors=[4, 2, 2, 2],
        bin_configurations=[{"n_bins": 8, "min_depth": 0.001, "max_depth": 10.0, "name": "nyu"}]))
