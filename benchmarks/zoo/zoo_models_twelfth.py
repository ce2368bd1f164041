"""The model zoo's twelfth set: torchvision's v2 image transforms (functional, on tensors) and
segmentation-models-pytorch's losses, on an image split along its rows (the eighteenth session's probe): the
preprocessing a pipeline applies to one enormous image, and the losses segmentation training computes over every
pixel. Each entry wraps one public call in a module (``zoo_models_ninth.register_call``: the judge counts every torch
function's output inside it); inputs in [0, 1] where the transform expects an image (``unit``). Registered like
zoo_models.py's (zoo_models.py imports this module at its end)."""
import torch

from benchmarks.zoo.zoo_models_ninth import register_call, with_library

_IMG = (2, 3, 32, 24)


def _functional():
    import torchvision.transforms.v2.functional as F
    return F


def _tf(name, fn, shape=_IMG, unit=True, **kw):
    """``fn(F, x)`` with ``F = torchvision.transforms.v2.functional``, as ``tv_transforms/<name>``."""
    register_call("torchvision", f"tv_transforms/{name}", shape, lambda: with_library(fn, _functional()), unit, **kw)


_tf("resize_bilinear_aa", lambda F, x: F.resize(x, [20, 16], antialias=True), spatial_out=False,
    note="antialiased downsampling of a split image")
_tf("resize_bicubic", lambda F, x: F.resize(x, [40, 30], interpolation=F.InterpolationMode.BICUBIC, antialias=False),
    spatial_out=False)
_tf("gaussian_blur", lambda F, x: F.gaussian_blur(x, [5, 3], [1.5, 0.8]), note="reflect padding, separable")
_tf("adjust_chain", lambda F, x: F.adjust_gamma(F.adjust_saturation(F.adjust_contrast(F.adjust_brightness(
    x, 1.2), 0.8), 1.3), 0.9), note="contrast: the mean of the grayscale image")
_tf("adjust_hue", lambda F, x: F.adjust_hue(x, 0.1), forward_only=True, note="writes into unbind views: no "
    "gradient on one device either")
_tf("adjust_sharpness", lambda F, x: F.adjust_sharpness(x, 2.0), forward_only=True, note="a 3x3 blur kept off "
    "the border (in-place clamps: no gradient on one device either)")
_tf("autocontrast", lambda F, x: F.autocontrast(x), forward_only=True, note="per-image, per-channel min and max "
    "(in place: no gradient on one device either)")
_tf("equalize_uint8", lambda F, x: F.equalize((x * 255).to(torch.uint8)).to(x.dtype) * x, spatial_out=True,
    note="per-image histograms (uint8), cumulative lookup")
_tf("solarize_invert", lambda F, x: F.invert(F.solarize(x, 0.6)))
_tf("posterize_uint8", lambda F, x: F.posterize((x * 255).to(torch.uint8), 3), forward_only=True,
    note="integer images: no gradient")
_tf("normalize", lambda F, x: F.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]))
_tf("rgb_to_grayscale", lambda F, x: F.rgb_to_grayscale(x, num_output_channels=3))
_tf("affine", lambda F, x: F.affine(x, angle=20.0, translate=[2, -3], scale=1.1, shear=[5.0, 0.0],
                                    interpolation=F.InterpolationMode.BILINEAR),
    note="grid_sample of the split image by a grid every rank builds whole")
_tf("rotate_expand", lambda F, x: F.rotate(x, 30.0, interpolation=F.InterpolationMode.BILINEAR, expand=True),
    spatial_out=False)
_tf("perspective", lambda F, x: F.perspective(x, [[0, 0], [23, 0], [23, 31], [0, 31]],
                                              [[2, 1], [21, 3], [22, 30], [1, 29]],
                                              interpolation=F.InterpolationMode.BILINEAR))
_tf("elastic", lambda F, x: F.elastic(x, torch.linspace(-1, 1, 32 * 24 * 2, dtype=x.dtype).reshape(1, 32, 24, 2)
                                      .sin() * 0.05, interpolation=F.InterpolationMode.BILINEAR))
_tf("pad_reflect_crop", lambda F, x: F.center_crop(F.pad(x, [3, 5, 2, 4], padding_mode="reflect"), [30, 20]))
_tf("resized_crop", lambda F, x: F.resized_crop(x, 4, 3, 20, 16, [24, 24], antialias=True), spatial_out=False)
_tf("vflip_hflip", lambda F, x: F.vertical_flip(F.horizontal_flip(x)))
_tf("erase", lambda F, x: F.erase(x, 5, 4, 12, 10, torch.zeros(3, 12, 10, dtype=x.dtype)),
    note="a block across the split written in place of a copy")
_tf("to_dtype_scale", lambda F, x: F.to_dtype(F.to_dtype(x, torch.uint8, scale=True), x.dtype, scale=True) * x)
_tf("resize_blur_sharpen", lambda F, x: F.adjust_sharpness(F.gaussian_blur(F.resize(x, [48, 36], antialias=True),
                                                                            [3, 3]), 1.5),
    spatial_out=False, forward_only=True)


def _smp_loss(name, build, target, pred=lambda x: x, **kw):
    def make():
        loss = build()
        return lambda x: loss(pred(x), target(x))

    register_call("smp", f"smp_losses/{name}", (2, 3, 20, 16), make, spatial_out=False, **kw)


def _losses():
    import segmentation_models_pytorch.losses as losses
    return losses


_smp_loss("DiceLoss_multiclass", lambda: _losses().DiceLoss("multiclass"), lambda x: x.flip(1).argmax(1))
_smp_loss("DiceLoss_multilabel_log", lambda: _losses().DiceLoss("multilabel", log_loss=True),
          lambda x: (x.roll(1, 1) > 0).to(x.dtype))
_smp_loss("JaccardLoss", lambda: _losses().JaccardLoss("multiclass"), lambda x: x.flip(1).argmax(1))
_smp_loss("TverskyLoss", lambda: _losses().TverskyLoss("multiclass", alpha=0.3, beta=0.7), lambda x: x.argmin(1))
_smp_loss("FocalLoss", lambda: _losses().FocalLoss("multiclass"), lambda x: x.flip(1).argmax(1))
_smp_loss("LovaszLoss_multiclass", lambda: _losses().LovaszLoss("multiclass"), lambda x: x.argmin(1),
          dtype="float32", note="errors sorted over every pixel (its gradient vector is float32)")
_smp_loss("LovaszLoss_binary", lambda: _losses().LovaszLoss("binary", per_image=True),
          lambda x: (x[:, 1:2] > 0).to(x.dtype), pred=lambda x: x[:, :1], dtype="float32")
_smp_loss("SoftBCEWithLogitsLoss", lambda: _losses().SoftBCEWithLogitsLoss(smooth_factor=0.1),
          lambda x: (x.roll(1, 1) > 0).to(x.dtype))
_smp_loss("SoftCrossEntropyLoss", lambda: _losses().SoftCrossEntropyLoss(smooth_factor=0.1),
          lambda x: x.flip(1).argmax(1))
_smp_loss("MCCLoss", lambda: _losses().MCCLoss(), lambda x: (x.roll(1, 1) > 0).to(x.dtype))
