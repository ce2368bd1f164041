"""The model zoo's ninth set: kornia, a computer-vision library of differentiable image operators (the eighteenth
session's probe) -- the preprocessing, filtering, warping and losses a scientist runs on one enormous image before
and around a network, split along its rows like the networks of the other sets. Most of kornia is functions, not
modules: each entry wraps one call of kornia's public API (or a short chain of them) in a module whose forward is
that call on the input, unchanged; kornia's own modules and networks (DexiNed, KeyNet, DISK, TinyViT, XFeat) are
built as they are. Inputs are ``torch.sigmoid(x)`` where kornia expects an image in [0, 1] (colour conversions,
enhancement): the sigmoid is part of the wrapped forward. Registered like zoo_models.py's (zoo_models.py imports
this module at its end)."""
import torch

from benchmarks.zoo.zoo_models import model

_IMG = (2, 3, 32, 32)


class Call(torch.nn.Module):
    """forward(x) = fn(x): a kornia function as a module (fn is module-level or a lambda over kornia's API). The
    zoo measures its activation share over every torch function's output inside the call (``share_by_ops``)."""

    share_by_ops = True

    def __init__(self, fn, unit: bool = False):
        super().__init__()
        self.fn, self.unit = fn, unit

    def forward(self, x):
        return self.fn(torch.sigmoid(x) if self.unit else x)


def with_library(fn, library):
    """``x -> fn(library, x)``: a closure, which the zoo's deep copy of the model shares (a module object inside a
    ``functools.partial`` would be copied, and cannot be)."""
    return lambda x: fn(library, x)


def register_call(library, name, shape, make, unit=False, **kw):
    """Register ``Call(make(), unit)`` as model ``name``: ``make`` imports the library when the model is built and
    returns the function of the input (the ninth, tenth and twelfth sets are made of these)."""
    @model(library, name, shape, **kw)
    def _():
        return Call(make(), unit)


def _k():
    import kornia
    return kornia


def _op(name, fn, shape=_IMG, unit=False, **kw):
    """Register the call ``fn(kornia, x)`` as model ``kornia/<name>``."""
    register_call("kornia", f"kornia/{name}", shape, lambda: with_library(fn, _k()), unit, **kw)


def _mod(name, build, shape=_IMG, unit=False, **kw):
    """Register the kornia module ``build(kornia)`` as model ``kornia/<name>``."""
    @model("kornia", f"kornia/{name}", shape, **kw)
    def _():
        m = build(_k())
        return torch.nn.Sequential(torch.nn.Sigmoid(), m) if unit else m


# ---- filters: separable and 2-D kernels with kornia's border modes (reflect, replicate, circular), edge-preserving
_mod("GaussianBlur2d", lambda k: k.filters.GaussianBlur2d((5, 5), (1.5, 1.5)), note="separable, reflect border")
_mod("GaussianBlur2d_replicate", lambda k: k.filters.GaussianBlur2d((7, 3), (2.0, 0.8), border_type="replicate"))
_mod("BoxBlur_circular", lambda k: k.filters.BoxBlur((3, 5), border_type="circular"), note="circular border: "
     "wraps along the split dim")
_mod("MedianBlur", lambda k: k.filters.MedianBlur((3, 3)), note="patches by a one-hot conv, median over them")
_mod("BilateralBlur", lambda k: k.filters.BilateralBlur((5, 5), 0.1, (1.5, 1.5)), note="unfold, per-pixel weights")
_op("JointBilateralBlur", lambda k, x: k.filters.joint_bilateral_blur(x, torch.tanh(x), (3, 3), 0.2, (1.0, 1.0)))
_op("guided_blur", lambda k, x: k.filters.guided_blur(torch.tanh(x), x, 3, 0.1), note="box filters of products")
_mod("UnsharpMask", lambda k: k.filters.UnsharpMask((3, 3), (1.5, 1.5)))
_mod("MotionBlur", lambda k: k.filters.MotionBlur(5, 35.0, 0.5), note="rotated line kernel (warp_affine of the "
     "kernel)")
_mod("Sobel", lambda k: k.filters.Sobel(), note="gradient magnitude")
_mod("Laplacian", lambda k: k.filters.Laplacian(5))
_op("SpatialGradient_diff", lambda k, x: k.filters.spatial_gradient(x, "diff", 2).flatten(1, 2),
    note="second order; [B, C, 2/3, H, W] flattened")
_mod("Canny", lambda k: k.filters.Canny(), unit=True, spatial_out=False, note="non-maximum suppression, "
     "hysteresis by a data-dependent loop")
_mod("BlurPool2D", lambda k: k.filters.BlurPool2D(3, 2), align=2)
_mod("MaxBlurPool2D", lambda k: k.filters.MaxBlurPool2D(3), align=2)
_mod("EdgeAwareBlurPool2D", lambda k: k.filters.EdgeAwareBlurPool2D(3))
_op("filter2d_circular", lambda k, x: k.filters.filter2d(
    x, torch.linspace(0.1, 1.0, 15, dtype=x.dtype).reshape(1, 3, 5), "circular", normalized=True))
_op("in_range", lambda k, x: x * k.filters.in_range(x, (0.2, 0.2, 0.2), (0.8, 0.8, 0.8), return_mask=True),
    unit=True)
_mod("DenseSIFTDescriptor", lambda k: k.feature.DenseSIFTDescriptor(), shape=(2, 1, 32, 32),
     note="gradient orientation histograms pooled by convolutions, root-SIFT normalization")

# ---- morphology (kornia's unfold engine and its convolution engine)
_op("dilation", lambda k, x: k.morphology.dilation(x, torch.ones(3, 3, dtype=x.dtype)))
_op("erosion_conv", lambda k, x: k.morphology.erosion(x, torch.ones(3, 5, dtype=x.dtype), engine="convolution"))
_op("opening", lambda k, x: k.morphology.opening(x, torch.ones(3, 3, dtype=x.dtype)))
_op("gradient", lambda k, x: k.morphology.gradient(x, torch.ones(5, 3, dtype=x.dtype)))
_op("top_hat", lambda k, x: k.morphology.top_hat(x, torch.ones(3, 3, dtype=x.dtype)))

# ---- colour spaces (pointwise on the channel dim)
_mod("RgbToHsv", lambda k: k.color.RgbToHsv(), unit=True)
_mod("RgbToHls", lambda k: k.color.RgbToHls(), unit=True)
_mod("RgbToLab", lambda k: k.color.RgbToLab(), unit=True)
_mod("RgbToLuv", lambda k: k.color.RgbToLuv(), unit=True)
_mod("RgbToYcbcr", lambda k: k.color.RgbToYcbcr(), unit=True)
_mod("RgbToGrayscale", lambda k: k.color.RgbToGrayscale(), unit=True)
_op("rgb_to_yuv420", lambda k, x: torch.cat([t.flatten(1) for t in k.color.rgb_to_yuv420(x)], 1), unit=True,
    align=2, spatial_out=False, note="chroma subsampled 2x2")

# ---- enhancement: global and per-image statistics, histograms, integral images, JPEG blocks
_op("adjust_chain", lambda k, x: k.enhance.adjust_gamma(k.enhance.adjust_saturation(k.enhance.adjust_hue(
    k.enhance.adjust_contrast(k.enhance.adjust_brightness(x, 0.1), 1.3), 0.4), 1.5), 0.8), unit=True)
_op("adjust_sigmoid_log", lambda k, x: k.enhance.adjust_log(k.enhance.adjust_sigmoid(x, 0.5, 10.0), 1.2), unit=True)
_op("sharpness", lambda k, x: k.enhance.sharpness(x, 0.7), unit=True, note="a 3x3 blur kept off the border")
_op("normalize_min_max", lambda k, x: k.enhance.normalize_min_max(x), note="per-image min and max")
_op("equalize", lambda k, x: k.enhance.equalize(x), unit=True, note="per-image histogram, cumulative sum lookup")
_op("equalize_clahe", lambda k, x: k.enhance.equalize_clahe(x, 4.0, (2, 2), slow_and_differentiable=True), unit=True, align=2,
    note="tiles' histograms, bilinear between tiles")
_op("integral_image", lambda k, x: k.enhance.integral_image(x), note="cumulative sums along both dims")
_op("jpeg_codec_differentiable", lambda k, x: k.enhance.jpeg_codec_differentiable(
    x, torch.tensor([50.0], dtype=x.dtype)), unit=True, align=16, note="8x8 DCT blocks, 2x2 chroma subsampling")
_op("image_histogram2d", lambda k, x: k.enhance.image_histogram2d(x, n_bins=16, kernel="gaussian")[0], unit=True,
    spatial_out=False, note="differentiable kernel histogram of every pixel")

# ---- geometry: resampling, pyramids, warps with a global transform, crops
_mod("Resize", lambda k: k.geometry.transform.Resize((24, 40)), spatial_out=False, note="antialias off")
_op("resize_antialias", lambda k, x: k.geometry.transform.resize(x, (16, 16), antialias=True), spatial_out=False,
    note="Gaussian blur before the bilinear resample")
_mod("PyrDown", lambda k: k.geometry.transform.PyrDown(), align=2)
_mod("PyrUp", lambda k: k.geometry.transform.PyrUp())
_op("laplacian_pyramid", lambda k, x: torch.cat([t.flatten(1) for t in k.geometry.transform.build_laplacian_pyramid(
    x, 3)], 1), align=4, spatial_out=False)
_mod("Rotate", lambda k: k.geometry.transform.Rotate(torch.tensor([30.0, -15.0], dtype=torch.float64)),
     note="warp_affine: grid_sample of a grid every rank builds whole")
_mod("Affine", lambda k: k.geometry.transform.Affine(
    angle=torch.tensor([10.0, 0.0], dtype=torch.float64), translation=torch.tensor([[2.0, -3.0], [0.5, 1.0]],
                                                                                  dtype=torch.float64),
    scale_factor=torch.tensor([[1.1, 0.9], [1.0, 1.0]], dtype=torch.float64),
    shear=torch.tensor([[0.1, 0.0], [0.0, 0.2]], dtype=torch.float64), padding_mode="reflection"))
_op("warp_perspective", lambda k, x: k.geometry.transform.warp_perspective(x, torch.tensor(
    [[[1.0, 0.05, 1.0], [0.02, 0.95, -2.0], [1e-3, 2e-3, 1.0]]], dtype=x.dtype).expand(x.shape[0], 3, 3), (32, 32)))
_op("elastic_transform2d", lambda k, x: k.geometry.transform.elastic_transform2d(
    x, torch.linspace(-1, 1, 2 * 2 * 32 * 32, dtype=x.dtype).reshape(2, 2, 32, 32).sin(), (7, 7), (4.0, 4.0),
    (1.0, 1.0)), note="a noise field blurred into a displacement, grid_sample")
_mod("Vflip", lambda k: k.geometry.transform.Vflip(), note="flip along the split dim")
_mod("Rot180", lambda k: k.geometry.transform.Rot180())
_op("center_crop", lambda k, x: k.geometry.transform.center_crop(x, (20, 24)), note="a perspective crop "
    "(warp_affine) of the centre")
_op("crop_by_indices", lambda k, x: k.geometry.transform.crop_by_indices(x, torch.tensor(
    [[[3, 5], [20, 5], [20, 27], [3, 27]]] * 2, dtype=torch.long), (16, 16)), spatial_out=False)
_op("remap", lambda k, x: k.geometry.transform.remap(
    x, *[g.to(x.dtype).expand(x.shape[0], 32, 32) for g in torch.meshgrid(torch.arange(32.0) * 0.9 + 1.3, torch.arange(32.0) * 1.1 - 0.7,
                                               indexing="xy")], align_corners=True))
_op("ScalePyramid", lambda k, x: torch.cat([t.flatten(1) for t in k.geometry.transform.ScalePyramid(
    2, min_size=8)(x)[0]], 1), spatial_out=False, note="octaves of Gaussian blurs and downsampling")

# ---- losses (scalars): the second image is a blur or a shift of the first, so both stay split alike
_op("SSIMLoss", lambda k, x: k.losses.ssim_loss(x, k.filters.box_blur(x, (3, 3)), 5), unit=True,
    spatial_out=False)
_op("MS_SSIMLoss", lambda k, x: k.losses.MS_SSIMLoss(sigmas=[0.5, 1.0, 2.0], data_range=1.0)(
    x, k.filters.box_blur(x, (3, 3))), unit=True, spatial_out=False, note="multi-scale Gaussian statistics")
_op("PSNRLoss", lambda k, x: k.losses.psnr_loss(x, x.flip(-1), 1.0), unit=True, spatial_out=False)
_op("TotalVariation", lambda k, x: k.losses.total_variation(x), spatial_out=False)
_op("robust_losses", lambda k, x: (k.losses.charbonnier_loss(x, x.roll(1, -1), "mean")
                                   + k.losses.welsch_loss(x, x.roll(1, -1), "sum")
                                   + k.losses.cauchy_loss(x, x.roll(1, -1), "mean")
                                   + k.losses.geman_mcclure_loss(x, x.roll(1, -1), "mean")), spatial_out=False)
_op("InverseDepthSmoothnessLoss", lambda k, x: k.losses.inverse_depth_smoothness_loss(
    torch.sigmoid(x[:, :1]) + 0.1, x), spatial_out=False)
_op("segmentation_losses", lambda k, x: (k.losses.dice_loss(x, x.argmax(1))
                                         + k.losses.focal_loss(x, x.argmin(1), 0.25, 2.0, "mean")
                                         + k.losses.tversky_loss(x, x.argmax(1), 0.3, 0.7)), spatial_out=False)
_op("LovaszSoftmaxLoss", lambda k, x: k.losses.lovasz_softmax_loss(x, x.argmin(1)), spatial_out=False,
    note="errors sorted over every pixel")
_op("kl_js_div_2d", lambda k, x: (k.losses.kl_div_loss_2d(x.softmax(-1), x.flip(-1).softmax(-1))
                                  + k.losses.js_div_loss_2d(x.softmax(-1), x.flip(-1).softmax(-1))),
    spatial_out=False)
_op("HausdorffERLoss", lambda k, x: k.losses.HausdorffERLoss(k=3)(x.softmax(1), x.argmin(1, keepdim=True)),
    spatial_out=False, note="erosions of the error map")

# ---- feature responses and contrib
_mod("CornerHarris", lambda k: k.feature.CornerHarris(0.04), note="structure tensor, Gaussian weights")
_mod("CornerGFTT", lambda k: k.feature.CornerGFTT())
_mod("BlobHessian", lambda k: k.feature.BlobHessian())
_mod("BlobDoGSingle", lambda k: k.feature.BlobDoGSingle())
_op("extract_tensor_patches", lambda k, x: k.contrib.extract_tensor_patches(x, 4, 4).flatten(2),
    spatial_out=False, align=4)
_op("connected_components", lambda k, x: x[:, :1] * k.contrib.connected_components(
    (x[:, :1] > 0.3).to(x.dtype), 20),
    note="label propagation by max pooling")
_mod("DistanceTransform", lambda k: k.contrib.DistanceTransform(3), unit=True, spatial_out=True,
     note="iterated convolutions until every pixel is reached")

# ---- kornia's networks
_mod("DexiNed", lambda k: __import__("kornia.models.dexined").models.dexined.DexiNed(pretrained=False), shape=(1, 3, 32, 32), spatial_out=True,
     note="edge detection, six up-sampled side outputs fused")
_mod("KeyNet", lambda k: k.feature.KeyNet(pretrained=False), shape=(1, 1, 32, 32),
     note="handcrafted derivative features over a pyramid, learned filters")
_mod("DISK", lambda k: k.feature.DISK(desc_dim=16).unet, shape=(1, 3, 32, 32), align=16,
     note="the U-Net that produces heatmaps and descriptors")
_mod("XFeatModel", lambda k: k.feature.XFeatModel(), shape=(1, 1, 64, 64), align=32, spatial_out=False,
     note="pixel unshuffle stem, interpolated feature pyramid")
_mod("TinyViT", lambda k: k.contrib.TinyViT(img_size=64, num_classes=10, embed_dims=(16, 32, 32, 32),
                                            depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 2), window_sizes=(4, 4, 4, 4)),
     shape=(2, 3, 64, 64), align=32, spatial_out=False, note="windowed attention with local convolutions (batch 2: "
     "with batch 1 torch's own CPU batch-norm backward is wrong on one device -- the gradient its token view hands it "
     "is channels-last with an ambiguous batch stride, the input is not, and the kernel reads the input as "
     "channels-last; this library's result is the exact one)")
