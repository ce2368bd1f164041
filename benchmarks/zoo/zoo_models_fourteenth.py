"""The model zoo's fourteenth set: timm families the earlier sets did not cover (the nineteenth session's probe) --
the vision encoders of recent vision-language models (DeepSeek's, Gemma 4's and Qwen 3's ViTs with 2-D rotary
embeddings, SAM 2's Hiera), BEiT-3 and BEiT-v2, CoAtNeXt, MaxxViT / MaxxViT-v2, gMLP-style mixers, NFNets, bottleneck
transformers, PoolFormer-v2, and convolutional families (ResNeSt, SK-ResNet, SelecSLS, DLA, DPN, VoVNet, Xception-p,
ReXNet-r, RegNet-V, ResNet-Q, CS3-EdgeNet, Darknet-AA, Res2NeXt, FBNet, blur-pool DenseNet, MobileNet-v4 AA).
Classifiers with random init on a 64 x 64 image split along its rows (56 x 56 for DeepSeek's patch 14); the ViTs
built small (2 blocks, width 64). Registered like zoo_models.py's (zoo_models.py imports this module at its end)."""
from benchmarks.zoo.zoo_models import model

_SMALL = dict(depth=2, embed_dim=64, num_heads=2)
_IMG = (2, 3, 64, 64)

# (timm architecture, input shape, create_model keywords, registry keywords)
_ENTRIES = [
    ("beit3_base_patch16_224", _IMG, dict(img_size=64, **_SMALL), dict(align=16)),
    ("beitv2_base_patch16_224", _IMG, dict(img_size=64, **_SMALL), dict(align=16)),
    ("deepseek_vit_412m", (2, 3, 56, 56), dict(img_size=56, **_SMALL),
     dict(align=14, dtype="float32", note="RMSNorm computed in float32 (RmsNormFp32): run in float32")),
    ("gemma4_vit_167m", _IMG, dict(img_size=64, **_SMALL), dict(align=16, note="clamp bounds buffers at +-inf")),
    ("qwen3_vit_88m", _IMG, dict(img_size=64, **_SMALL), dict(align=16)),
    ("sam2_hiera_small", _IMG, {}, dict(note="Hiera: mask-unit windows, query pooling")),
    ("coatnext_nano_rw_224", _IMG, dict(img_size=64), {}),
    ("maxxvit_rmlp_nano_rw_256", _IMG, dict(img_size=64), {}),
    ("maxxvitv2_nano_rw_256", _IMG, dict(img_size=64), {}),
    ("gmixer_12_224", _IMG, dict(img_size=64), dict(align=16)),
    ("dm_nfnet_f0", _IMG, {}, {}),
    ("eca_nfnet_l0", _IMG, {}, {}),
    ("eca_botnext26ts_256", _IMG, dict(img_size=64), {}),
    ("sebotnet33ts_256", _IMG, dict(img_size=64), {}),
    ("gc_efficientnetv2_rw_t", _IMG, {}, {}),
    ("poolformerv2_s12", _IMG, {}, {}),
    ("resnest26d", _IMG, {}, {}),
    ("skresnet34", _IMG, {}, {}),
    ("selecsls42", _IMG, {}, {}),
    ("dla46x_c", _IMG, {}, {}),
    ("dpn48b", _IMG, {}, {}),
    ("vovnet39a", _IMG, {}, {}),
    ("xception41p", _IMG, {}, {}),
    ("rexnetr_100", _IMG, {}, {}),
    ("regnetv_040", _IMG, {}, {}),
    ("resnet51q", _IMG, {}, {}),
    ("cs3edgenet_x", _IMG, {}, {}),
    ("darknetaa53", _IMG, {}, {}),
    ("res2next50", _IMG, {}, {}),
    ("fbnetc_100", _IMG, {}, {}),
    ("densenetblur121d", _IMG, {}, {}),
    ("mobilenetv4_conv_aa_large", _IMG, {}, {}),
]


def _register(arch, shape, create, spec):
    @model("timm", f"timm/{arch}", shape, spatial_out=False, **spec)
    def _():
        import timm
        return timm.create_model(arch, pretrained=False, num_classes=10, **create)


for _entry in _ENTRIES:
    _register(*_entry)
