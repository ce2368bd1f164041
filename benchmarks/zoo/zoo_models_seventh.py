"""The model zoo's seventh set: 54 Hugging Face transformers models (the seventeenth session's probe), each
built from a small random config (no weights downloaded) and registered like zoo_models.py's (zoo_models.py imports
this module at its end). transformers writes its models differently from timm and torchvision: ModelOutput
dictionaries, attention through its `sdpa` / eager interface, position embeddings interpolated in the forward, Swin's
window padding in the model, MobileViT's patch unfolding by reshapes, SegFormer's spatial-reduction attention, BEiT's
relative position bias tables, UperNet's pyramid pooling over a ConvNeXt backbone, video ViTs over (B, T, C, H, W)
frames, speech encoders over a split waveform, DETR-family detectors, Mask2Former, Depth Anything, PatchTST, and
image-to-image heads (Swin2SR, ViTMatte, ViTPose). Every one passed on 2, 3 and 4 ranks and a 2x2 mesh with no
library change."""
import torch  # noqa: F401

from benchmarks.zoo.zoo_models import model

_TINY_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=64,
                 patch_size=8, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _hf(model_class: str, config_class: str, **cfg):
    import transformers
    config = getattr(transformers, config_class)(**cfg)
    return getattr(transformers, model_class)(config)


def _hf_vision(name, shape, model_class, config_class, align=1, spatial_out=False, note="", **cfg):
    @model("transformers", f"transformers/{name}", shape, align=align, spatial_out=spatial_out, note=note)
    def _():
        return _hf(model_class, config_class, **cfg)


# Plain ViTs: class token, absolute position embeddings (interpolated to the input in DINOv2's forward).
_hf_vision("vit", (2, 3, 64, 64), "ViTForImageClassification", "ViTConfig", align=8, **_TINY_VIT)
_hf_vision("deit_distilled", (2, 3, 64, 64), "DeiTForImageClassificationWithTeacher", "DeiTConfig", align=8,
           note="class and distillation tokens", **_TINY_VIT)
_hf_vision("beit", (2, 3, 64, 64), "BeitForImageClassification", "BeitConfig", align=8,
           note="relative position bias table, mean pooling", use_relative_position_bias=True,
           use_mean_pooling=True, **_TINY_VIT)
_hf_vision("data2vec_vision", (2, 3, 64, 64), "Data2VecVisionForImageClassification", "Data2VecVisionConfig",
           align=8, use_relative_position_bias=True, **_TINY_VIT)
_hf_vision("dinov2", (2, 3, 64, 64), "Dinov2ForImageClassification", "Dinov2Config", align=8,
           note="position embeddings interpolated (bicubic) in the forward", **_TINY_VIT)
_hf_vision("vit_msn", (2, 3, 64, 64), "ViTMSNForImageClassification", "ViTMSNConfig", align=8, **_TINY_VIT)
_hf_vision("ijepa", (2, 3, 64, 64), "IJepaForImageClassification", "IJepaConfig", align=8,
           note="no class token: mean over the split tokens", **_TINY_VIT)
_hf_vision("yolos", (2, 3, 64, 64), "YolosModel", "YolosConfig", align=8, note="detection tokens appended",
           num_detection_tokens=4, **{**_TINY_VIT, "image_size": [64, 64]})
_hf_vision("clip_vision", (2, 3, 64, 64), "CLIPVisionModel", "CLIPVisionConfig", align=8,
           note="pre-LayerNorm, pooled class token", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
           intermediate_size=64, image_size=64, patch_size=8)
_hf_vision("siglip_vision", (2, 3, 64, 64), "SiglipVisionModel", "SiglipVisionConfig", align=8,
           note="attention-pooling head over the split tokens", hidden_size=32, num_hidden_layers=2,
           num_attention_heads=2, intermediate_size=64, image_size=64, patch_size=8)

# Hierarchical transformers: shifted / padded windows, spatial-reduction attention, pooling.
_hf_vision("swin", (2, 3, 64, 64), "SwinForImageClassification", "SwinConfig", align=16,
           note="window padding and cyclic shifts in the model", image_size=64, patch_size=4, embed_dim=16,
           depths=[2, 2], num_heads=[1, 2], window_size=4, num_labels=10)
_hf_vision("swinv2", (2, 3, 64, 64), "Swinv2ForImageClassification", "Swinv2Config", align=16,
           note="cosine attention, log-spaced continuous position bias", image_size=64, patch_size=4, embed_dim=16,
           depths=[2, 2], num_heads=[1, 2], window_size=4, num_labels=10)
_hf_vision("segformer", (2, 3, 64, 64), "SegformerForSemanticSegmentation", "SegformerConfig", align=32,
           spatial_out=True, note="overlapping patch embeddings, spatial-reduction attention, all-MLP decoder",
           num_encoder_blocks=4, depths=[1, 1, 1, 1], sr_ratios=[8, 4, 2, 1], hidden_sizes=[8, 16, 32, 64],
           num_attention_heads=[1, 1, 2, 2], decoder_hidden_size=32, num_labels=3)
_hf_vision("pvt_v2", (2, 3, 64, 64), "PvtV2ForImageClassification", "PvtV2Config", align=32,
           depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 64], num_attention_heads=[1, 1, 2, 2], num_labels=10)
_hf_vision("poolformer", (2, 3, 64, 64), "PoolFormerForImageClassification", "PoolFormerConfig", align=32,
           depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 64], num_labels=10)
_hf_vision("cvt", (2, 3, 64, 64), "CvtForImageClassification", "CvtConfig", align=16,
           note="convolutional token embeddings and projections, class token in the last stage",
           embed_dim=[8, 16, 32], num_heads=[1, 2, 2], depth=[1, 2, 3], num_labels=10)
_hf_vision("focalnet", (2, 3, 64, 64), "FocalNetForImageClassification", "FocalNetConfig", align=32,
           note="focal modulation: depthwise context levels and a global average gate", embed_dim=16,
           depths=[1, 1, 1, 1], image_size=64, num_labels=10)
_hf_vision("mobilevit", (2, 3, 64, 64), "MobileViTForImageClassification", "MobileViTConfig", align=32,
           note="patch unfolding by reshapes and transposes", image_size=64, hidden_sizes=[16, 24, 32],
           neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_labels=10)
_hf_vision("mobilevitv2", (2, 3, 64, 64), "MobileViTV2ForImageClassification", "MobileViTV2Config", align=32,
           note="separable linear attention over unfolded patches", image_size=64, width_multiplier=0.25,
           num_labels=10)
_hf_vision("hiera", (2, 3, 64, 64), "HieraForImageClassification", "HieraConfig", align=32,
           note="mask-unit attention with unrolled tokens", image_size=[64, 64], patch_size=[7, 7],
           patch_stride=[4, 4], patch_padding=[3, 3], embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2],
           num_labels=10)

# Convolutional backbones and dense heads.
_hf_vision("convnext", (2, 3, 64, 64), "ConvNextForImageClassification", "ConvNextConfig", align=32,
           hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10)
_hf_vision("convnextv2", (2, 3, 64, 64), "ConvNextV2ForImageClassification", "ConvNextV2Config", align=32,
           note="global response normalisation", hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10)
_hf_vision("resnet", (2, 3, 64, 64), "ResNetForImageClassification", "ResNetConfig", align=32, embedding_size=16,
           hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_labels=10)
_hf_vision("regnet", (2, 3, 64, 64), "RegNetForImageClassification", "RegNetConfig", align=32, embedding_size=16,
           hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1], groups_width=8, num_labels=10)
_hf_vision("bit", (2, 3, 64, 64), "BitForImageClassification", "BitConfig", align=32,
           note="weight-standardised convolutions, dynamic 'SAME' padding", embedding_size=16,
           hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_labels=10, global_padding="SAME", num_groups=8,
           layer_type="bottleneck")
_hf_vision("efficientnet", (2, 3, 64, 64), "EfficientNetForImageClassification", "EfficientNetConfig", align=32,
           image_size=64, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320, num_labels=10)
_hf_vision("mobilenet_v2_deeplab", (2, 3, 64, 64), "MobileNetV2ForSemanticSegmentation", "MobileNetV2Config",
           align=32, spatial_out=True, note="DeepLabV3 head (ASPP with image pooling), dilated to output stride 8",
           depth_multiplier=0.25, output_stride=8,
           image_size=64, num_labels=3)
_hf_vision("glpn", (2, 3, 64, 64), "GLPNForDepthEstimation", "GLPNConfig", align=32, spatial_out=True,
           note="SegFormer encoder, selective feature fusion decoder", num_encoder_blocks=4, depths=[1, 1, 1, 1],
           sr_ratios=[8, 4, 2, 1], hidden_sizes=[8, 16, 32, 64], num_attention_heads=[1, 1, 2, 2],
           decoder_hidden_size=16)


@model("transformers", "transformers/upernet_convnext", (2, 3, 64, 64), align=32, spatial_out=True,
       note="UperNet: pyramid pooling module (adaptive pooling to 1, 2, 3, 6) and FPN over ConvNeXt")
def _():
    import transformers
    backbone = transformers.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1],
                                           out_features=["stage1", "stage2", "stage3", "stage4"])
    return transformers.UperNetForSemanticSegmentation(transformers.UperNetConfig(
        backbone_config=backbone, hidden_size=16, auxiliary_in_channels=32, auxiliary_channels=16, num_labels=3))


@model("transformers", "transformers/dpt", (2, 3, 64, 64), align=8, spatial_out=True,
       note="DPT: ViT tokens reassembled into a feature pyramid, fusion and depth head")
def _():
    import transformers
    return transformers.DPTForDepthEstimation(transformers.DPTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=64, patch_size=8,
        backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16,
        reassemble_factors=[4, 2, 1, 0.5], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


# Video transformers: (B, T, C, H, W) frames, H split.
_TINY_VIDEO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                   patch_size=8, num_frames=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                   num_labels=10)


def _hf_video(name, model_class, config_class, note="", **cfg):
    @model("transformers", f"transformers/{name}", (2, 4, 3, 32, 32), shard_dims=(3,), spatial=(3, 4), align=8,
           spatial_out=False, note=note)
    def _():
        return _hf(model_class, config_class, **{**_TINY_VIDEO, **cfg})


_hf_video("videomae", "VideoMAEForVideoClassification", "VideoMAEConfig", note="tubelet embedding (3-D conv)",
          tubelet_size=2)
_hf_video("timesformer", "TimesformerForVideoClassification", "TimesformerConfig",
          note="divided space-time attention: tokens regrouped per frame and per position")
_hf_video("vivit", "VivitForVideoClassification", "VivitConfig", note="tubelet embedding, class token",
          tubelets=[2, 8, 8])


# Speech encoders: a waveform (B, L) split along time; strided 1-D convolutions, a grouped positional convolution
# with an even kernel (one output trimmed), group norm over time.
_TINY_SPEECH = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    conv_dim=[16, 16, 16], conv_stride=[5, 2, 2], conv_kernel=[10, 3, 3],
                    num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
                    attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
                    mask_time_prob=0.0, final_dropout=0.0)


def _hf_speech(name, model_class, config_class, note="", **cfg):
    @model("transformers", f"transformers/{name}", (2, 1600), shard_dims=(1,), spatial=(1,), align=20,
           note=note)
    def _():
        m = _hf(model_class, config_class, **{**_TINY_SPEECH, **cfg})
        # The feature encoder sets `requires_grad = True` on a view of the waveform in training (for gradient
        # checkpointing), which torch refuses when the waveform itself requires grad, as it does here (the input
        # gradient is compared): its flag off, nothing else changes.
        m.feature_extractor._requires_grad = False
        return m


_hf_speech("wav2vec2", "Wav2Vec2Model", "Wav2Vec2Config", note="group norm over time in the first convolution")
_hf_speech("wav2vec2_layernorm", "Wav2Vec2Model", "Wav2Vec2Config", feat_extract_norm="layer",
           do_stable_layer_norm=True, note="layer-norm feature extractor, pre-norm encoder")
_hf_speech("hubert", "HubertModel", "HubertConfig")
_hf_speech("wavlm", "WavLMModel", "WavLMConfig", note="gated relative position bias (bucketed)",
           num_buckets=32, max_bucket_distance=64)
_hf_speech("data2vec_audio", "Data2VecAudioModel", "Data2VecAudioConfig",
           note="a stack of positional convolutions with layer norm", num_conv_pos_embeddings=5,
           num_conv_pos_embedding_groups=4, conv_pos_kernel_size=5)
_hf_speech("sew", "SEWModel", "SEWConfig", note="squeezed context: pooled before the encoder, upsampled after",
           squeeze_factor=2)


# Detection and dense prediction over a backbone: DETR's mask-derived sine position embedding over the split feature
# map and object queries attending to its flattened tokens; Deformable DETR's multi-scale deformable attention
# (grid_sample at predicted offsets into every level); Mask2Former's masked attention; Depth Anything (DINOv2 + DPT).
def _tiny_resnet_backbone(stages=("stage2", "stage3", "stage4")):
    import transformers
    return transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1],
                                     out_features=list(stages))


def _tiny_detr(decoder_layers):
    """DETR's and Conditional DETR's small config: one encoder layer over the last stage of a tiny ResNet."""
    return dict(use_timm_backbone=False, backbone_config=_tiny_resnet_backbone(["stage4"]), d_model=32,
                encoder_layers=1, decoder_layers=decoder_layers, encoder_ffn_dim=64, decoder_ffn_dim=64,
                encoder_attention_heads=2, decoder_attention_heads=2, num_queries=8, dropout=0.0,
                attention_dropout=0.0, activation_dropout=0.0, num_labels=5)


@model("transformers", "transformers/detr", (2, 3, 64, 64), align=32, spatial_out=False,
       note="mask-derived sine position embedding, object queries over the flattened split feature map")
def _():
    import transformers
    return transformers.DetrForObjectDetection(transformers.DetrConfig(**_tiny_detr(decoder_layers=1)))


@model("transformers", "transformers/deformable_detr", (2, 3, 64, 64), align=32, spatial_out=False,
       note="multi-scale deformable attention: grid_sample of every level at learned offsets")
def _():
    import transformers
    return transformers.DeformableDetrForObjectDetection(transformers.DeformableDetrConfig(
        use_timm_backbone=False, backbone_config=_tiny_resnet_backbone(), d_model=32, encoder_layers=1,
        decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=2,
        decoder_attention_heads=2, num_queries=8, num_feature_levels=3, encoder_n_points=2, decoder_n_points=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, disable_custom_kernels=True, num_labels=5))


@model("transformers", "transformers/mask2former", (2, 3, 64, 64), align=32, spatial_out=False,
       note="deformable pixel decoder, masked attention of queries over the split mask features (its first output is "
            "the queries' class logits; the mask logits keep H's shard)")
def _():
    import transformers
    return transformers.Mask2FormerForUniversalSegmentation(transformers.Mask2FormerConfig(
        backbone_config=transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1],
                                                num_heads=[1, 1, 2, 2], window_size=4,
                                                out_features=["stage1", "stage2", "stage3", "stage4"]),
        feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=32, encoder_layers=1,
        decoder_layers=2, num_attention_heads=2, dim_feedforward=32, num_queries=8, dropout=0.0, num_labels=3))


@model("transformers", "transformers/depth_anything", (2, 3, 56, 56), align=14, spatial_out=True,
       note="DINOv2 backbone (patch 14, interpolated position embeddings) and a DPT head")
def _():
    import transformers
    backbone = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                         intermediate_size=64, image_size=56, patch_size=14,
                                         out_indices=[1, 2, 3, 4], reshape_hidden_states=False)
    return transformers.DepthAnythingForDepthEstimation(transformers.DepthAnythingConfig(
        backbone_config=backbone, patch_size=14, reassemble_hidden_size=32, neck_hidden_sizes=[8, 16, 32, 32],
        fusion_hidden_size=16, head_hidden_size=8))


# A time series (B, L, C) split along time: PatchTST's patching (Tensor.unfold along the split dim) and its
# scaler's statistics over time.
@model("transformers", "transformers/patchtst", (2, 96, 3), shard_dims=(1,), spatial=(1,), align=8,
       spatial_out=False, note="mean scaling over the split time, patches by Tensor.unfold, channel-independent "
                               "encoder, forecasting head")
def _():
    import transformers
    return transformers.PatchTSTForPrediction(transformers.PatchTSTConfig(
        num_input_channels=3, context_length=96, patch_length=8, patch_stride=8, num_hidden_layers=2, d_model=16,
        num_attention_heads=2, ffn_dim=32, prediction_length=12, attention_dropout=0.0, positional_dropout=0.0,
        path_dropout=0.0, ff_dropout=0.0, head_dropout=0.0, scaling="mean"))


# Image-to-image and dense heads (the output keeps H's shard): Swin2SR's pixel-shuffle upsampler behind padded
# Swin-V2 windows, ViTMatte's convolution stream beside a ViTDet backbone (windowed and global attention with
# decomposed relative positions), ViTPose's heatmaps, BEiT's segmentation pyramid, Dinov2 with register tokens.
@model("transformers", "transformers/swin2sr", (2, 3, 32, 32), align=8, spatial_out=True,
       note="super-resolution: reflect-padded to the window size, Swin-V2 windows, pixel shuffle x2")
def _():
    import transformers
    return transformers.Swin2SRForImageSuperResolution(transformers.Swin2SRConfig(
        image_size=32, patch_size=1, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4, upscale=2,
        upsampler="pixelshuffle"))


@model("transformers", "transformers/vitmatte", (2, 4, 64, 64), align=16, spatial_out=True,
       note="image matting: ViTDet backbone (window + global attention, decomposed relative positions), "
            "a convolution stream and fusion upsampling")
def _():
    import transformers
    backbone = transformers.VitDetConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                         image_size=64, patch_size=16, num_channels=4, window_size=2,
                                         window_block_indices=[0], use_relative_position_embeddings=True,
                                         out_features=["stage2"])
    return transformers.VitMatteForImageMatting(transformers.VitMatteConfig(
        backbone_config=backbone, hidden_size=32, convstream_hidden_sizes=[8, 16, 32],
        fusion_hidden_sizes=[32, 16, 8, 8]))


@model("transformers", "transformers/vitpose", (2, 3, 64, 48), align=16, spatial_out=True,
       note="pose heatmaps: a ViT backbone on a 4:3 crop, the classic deconvolution decoder")
def _():
    import transformers
    backbone = transformers.VitPoseBackboneConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                  mlp_ratio=2, image_size=[64, 48], patch_size=[16, 16],
                                                  out_indices=[2])
    return transformers.VitPoseForPoseEstimation(transformers.VitPoseConfig(backbone_config=backbone,
                                                                            use_simple_decoder=False))


_hf_vision("beit_segmentation", (2, 3, 64, 64), "BeitForSemanticSegmentation", "BeitConfig", align=16,
           spatial_out=True, note="ViT features rearranged into a 4-level pyramid, UperNet head, FCN auxiliary",
           **{**_TINY_VIT, "patch_size": 16, "num_hidden_layers": 4, "out_indices": [1, 2, 3, 4],
              "auxiliary_channels": 16, "pool_scales": [1, 2], "use_relative_position_bias": True})
_hf_vision("dinov2_registers", (2, 3, 64, 64), "Dinov2WithRegistersForImageClassification",
           "Dinov2WithRegistersConfig", align=8, note="register tokens after the class token",
           hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=64, patch_size=8,
           num_register_tokens=2, num_labels=10)
_hf_vision("levit", (2, 3, 64, 64), "LevitForImageClassification", "LevitConfig", align=16,
           note="attention biases indexed by offsets at a fixed resolution, subsampling attention",
           image_size=64, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
           key_dim=[8, 8, 8], num_labels=10)
_hf_vision("swiftformer", (2, 3, 64, 64), "SwiftFormerForImageClassification", "SwiftFormerConfig", align=32,
           note="efficient additive attention (a global query vector)", depths=[1, 1, 1, 1],
           embed_dims=[8, 16, 32, 48], num_labels=10)
_hf_vision("mobilenet_v1", (2, 3, 64, 64), "MobileNetV1ForImageClassification", "MobileNetV1Config", align=32,
           note="TensorFlow 'SAME' padding computed from the input size", depth_multiplier=0.25,
           tf_padding=True, image_size=64, num_labels=10)


@model("transformers", "transformers/rt_detr", (2, 3, 64, 64), align=32, spatial_out=False,
       note="hybrid encoder (attention over the last level's flattened tokens, CCFM fusion), deformable decoder, "
            "query selection by top-k over the split tokens")
def _():
    return tiny_rt_detr("RTDetrForObjectDetection", "RTDetrConfig")


def tiny_rt_detr(model_class: str, config_class: str):
    """A small RT-DETR-family detector (RT-DETR, RT-DETRv2) over a small ResNet backbone."""
    import transformers
    backbone = transformers.RTDetrResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64],
                                               depths=[1, 1, 1, 1], out_features=["stage2", "stage3", "stage4"])
    return getattr(transformers, model_class)(getattr(transformers, config_class)(
        backbone_config=backbone, encoder_hidden_dim=16, encoder_in_channels=[32, 32, 64], encoder_ffn_dim=32,
        encoder_attention_heads=2, d_model=16, num_queries=8, decoder_in_channels=[16, 16, 16],
        decoder_ffn_dim=32, decoder_layers=2, decoder_attention_heads=2, decoder_n_points=2, num_denoising=0,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, anchor_image_size=None, num_labels=5))


@model("transformers", "transformers/conditional_detr", (2, 3, 64, 64), align=32, spatial_out=False,
       note="conditional spatial queries over the split feature map")
def _():
    import transformers
    return transformers.ConditionalDetrForObjectDetection(transformers.ConditionalDetrConfig(
        **_tiny_detr(decoder_layers=2)))
