"""The model zoo's tenth set: MONAI's losses, metrics and array transforms on a 3-D volume split along its depth (the
eighteenth session's probe) -- what a medical-imaging or registration training step computes around the network:
overlap losses over every voxel (Dice and its generalized, masked, focal, Tversky, clDice forms), image similarity
(local normalized cross-correlation, global mutual information, 3-D SSIM), deformation regularizers (bending energy,
diffusion), multi-scale losses, and the intensity and smoothing transforms a pipeline applies to the volume itself.
Each entry wraps one public call in a module (``zoo_models_ninth.register_call``: the judge counts every torch function's
output inside it). Targets are derived from the input (a thresholded or arg-maxed copy), so they are split alike.
Registered like zoo_models.py's (zoo_models.py imports this module at its end)."""
import torch

from benchmarks.zoo.zoo_models_ninth import register_call

_VOL = (2, 3, 12, 10, 8)      # (B, C, D, H, W): D split
# Calls that compute in float32 whatever the input's dtype (MONAI's filter kernels, focal terms, metric buffers and
# transforms convert): run in float32, so one device's rounding is the reference's too.
_F32 = {"DiceFocalLoss", "FocalLoss", "GeneralizedDiceFocalLoss", "GlobalMutualInformationLoss_bspline", "SSIMLoss_3d",
        "ConfusionMatrix", "SSIMMetric_3d", "PSNR_RMSE_MAE", "GaussianSmooth", "GaussianSharpen", "MedianSmooth",
        "SavitzkyGolaySmooth", "ScaleIntensity", "NormalizeIntensity_channelwise", "ScaleIntensityRangePercentiles",
        "Affine", "Zoom", "SpatialPad", "CenterSpatialCrop", "Flip", "Rotate90", "SobelGradients"}


def _kw(name, kw):
    if name in _F32:
        kw.setdefault("dtype", "float32")
    return kw
_FIELD = (2, 3, 12, 10, 8)    # a displacement field (3 components) over the same grid


def _loss(name, fn, shape=_VOL, **kw):
    """Register ``fn(x)`` (monai imported inside) as ``monai_losses/<name>``, a scalar."""
    register_call("monai", f"monai_losses/{name}", shape, lambda: fn, spatial_out=False, **_kw(name, kw))


def _onehot_target(x):
    return torch.nn.functional.one_hot(x.argmax(1), x.shape[1]).movedim(-1, 1).to(x.dtype)


def _L():
    import monai.losses as losses
    return losses


# ---- overlap losses over every voxel (sums over the split depth)
_loss("DiceLoss_softmax", lambda x: _L().DiceLoss(softmax=True)(x, _onehot_target(x.flip(1))))
_loss("DiceLoss_sigmoid_batch", lambda x: _L().DiceLoss(sigmoid=True, batch=True, squared_pred=True)(
    x, (x.roll(1, 1) > 0).to(x.dtype)))
_loss("DiceCELoss", lambda x: _L().DiceCELoss(softmax=True, to_onehot_y=True)(x, x.argmin(1, keepdim=True)))
_loss("DiceFocalLoss", lambda x: _L().DiceFocalLoss(sigmoid=True, gamma=2.0)(x, (x.roll(1, 1) > 0).to(x.dtype)))
_loss("GeneralizedDiceLoss", lambda x: _L().GeneralizedDiceLoss(softmax=True)(x, _onehot_target(x.flip(1))),
      note="class weights from the target's global volume per class")
_loss("GeneralizedDiceFocalLoss", lambda x: _L().GeneralizedDiceFocalLoss(softmax=True)(
    x, _onehot_target(x.flip(1))))
_loss("FocalLoss", lambda x: _L().FocalLoss(gamma=2.0, alpha=0.25, use_softmax=True)(x, _onehot_target(x.flip(1))))
_loss("TverskyLoss", lambda x: _L().TverskyLoss(softmax=True, alpha=0.3, beta=0.7)(x, _onehot_target(x.flip(1))))
_loss("MaskedDiceLoss", lambda x: _L().MaskedDiceLoss(sigmoid=True)(
    x, (x.roll(1, 1) > 0).to(x.dtype), mask=(x[:, :1] > -0.5).to(x.dtype)))
_loss("SoftclDiceLoss", lambda x: _L().SoftclDiceLoss(iter_=3)(x.softmax(1), _onehot_target(x.flip(1))),
      note="soft skeletons by iterated 3-D max pooling")
_loss("SoftDiceclDiceLoss", lambda x: _L().SoftDiceclDiceLoss(iter_=2)(x.softmax(1), _onehot_target(x.flip(1))))
_loss("AsymmetricUnifiedFocalLoss", lambda x: _L().AsymmetricUnifiedFocalLoss(to_onehot_y=True)(
    x[:, :2].softmax(1), (x[:, :1] > 0).long()), shape=(2, 2, 12, 10, 8))
_loss("MCCLoss", lambda x: _L().MCCLoss(sigmoid=True)(x, (x.roll(1, 1) > 0).to(x.dtype)),
      note="Matthews correlation from voxel counts")

# ---- registration: image similarity and deformation regularizers
_loss("LocalNormalizedCrossCorrelationLoss", lambda x: _L().LocalNormalizedCrossCorrelationLoss(
    spatial_dims=3, kernel_size=3, kernel_type="rectangular")(x[:, :1], x[:, 1:2]),
      note="box-filtered local moments (3-D convolutions)")
_loss("LNCC_gaussian", lambda x: _L().LocalNormalizedCrossCorrelationLoss(
    spatial_dims=3, kernel_size=5, kernel_type="gaussian")(x[:, :1], torch.tanh(x[:, 1:2])))
_loss("GlobalMutualInformationLoss", lambda x: _L().GlobalMutualInformationLoss(num_bins=8)(
    torch.sigmoid(x[:, :1]), torch.sigmoid(x[:, 1:2])), note="Parzen-window joint histogram of every voxel")
_loss("GlobalMutualInformationLoss_bspline", lambda x: _L().GlobalMutualInformationLoss(
    kernel_type="b-spline", num_bins=8)(torch.sigmoid(x[:, :1]), torch.sigmoid(x[:, 1:2])))
_loss("BendingEnergyLoss", lambda x: _L().BendingEnergyLoss()(x), shape=_FIELD,
      note="second differences of a displacement field")
_loss("DiffusionLoss", lambda x: _L().DiffusionLoss()(x), shape=_FIELD)
_loss("SSIMLoss_3d", lambda x: _L().SSIMLoss(spatial_dims=3, data_range=1.0, win_size=5)(
    torch.sigmoid(x), torch.sigmoid(x.roll(1, 1))), note="Gaussian-windowed local statistics in 3-D")
_loss("MultiScaleLoss", lambda x: _L().MultiScaleLoss(_L().DiceLoss(sigmoid=True), scales=[0, 1, 2])(
    x, (x.roll(1, 1) > 0).to(x.dtype)), note="the loss of Gaussian-smoothed copies at several scales")
_loss("NACLLoss", lambda x: _L().NACLLoss(classes=3, dim=3)(x, x.flip(1).argmax(1)),
      note="neighbour-aware calibration: a mean filter of the one-hot target")


def _metric(name, fn, shape=_VOL, **kw):
    register_call("monai", f"monai_metrics/{name}", shape, lambda: fn, spatial_out=False, forward_only=True,
                  **_kw(name, kw))


def _M():
    import monai.metrics as metrics
    return metrics


# ---- metrics (no gradient: their values are compared): sums over the volume
_metric("DiceMetric", lambda x: _M().compute_dice(torch.sigmoid(x), (x.roll(1, 1) > 0).to(x.dtype)))
_metric("MeanIoU", lambda x: _M().compute_iou(torch.sigmoid(x), (x.roll(1, 1) > 0).to(x.dtype)))
_metric("SSIMMetric_3d", lambda x: _M().SSIMMetric(spatial_dims=3, data_range=1.0, win_size=5)(
    torch.sigmoid(x), torch.sigmoid(x.roll(1, 1))))
_metric("PSNR_RMSE_MAE", lambda x: torch.cat([
    _M().PSNRMetric(max_val=1.0)(torch.sigmoid(x), torch.sigmoid(x.roll(1, 1))),
    _M().RMSEMetric()(x, x.roll(1, 1)), _M().MAEMetric()(x, x.roll(1, 1))], 1))
_metric("GeneralizedDiceScore", lambda x: _M().compute_generalized_dice(
    _onehot_target(x), _onehot_target(x.flip(1))))
_metric("ConfusionMatrix", lambda x: _M().get_confusion_matrix(
    (x > 0).to(x.dtype), (x.roll(1, 1) > 0).to(x.dtype)), note="tp/fp/tn/fn counts per class")


def _transform(name, build, shape=(3, 12, 10, 8), **kw):
    """An array transform on a channel-first volume (no batch dim): dim 1 (depth) split."""
    def make():
        t = build()
        return lambda x: t(x.clone())   # transforms may write into their input (a pipeline's is no leaf)

    register_call("monai", f"monai_transforms/{name}", shape, make, shard_dims=(1,), spatial=(1, 2, 3),
                  **_kw(name, kw))


def _T():
    import monai.transforms as transforms
    return transforms


# ---- array transforms applied to the volume itself
_transform("GaussianSmooth", lambda: _T().GaussianSmooth(sigma=1.0))
_transform("GaussianSharpen", lambda: _T().GaussianSharpen())
_transform("SobelGradients", lambda: _T().SobelGradients(kernel_size=3, spatial_axes=(0, 1)))
_transform("MedianSmooth", lambda: _T().MedianSmooth(radius=1))
_transform("SavitzkyGolaySmooth", lambda: _T().SavitzkyGolaySmooth(window_length=5, order=2, axis=1),
           note="a 1-D polynomial filter along the split depth")
_transform("ScaleIntensity", lambda: _T().ScaleIntensity(), note="global min and max")
_transform("NormalizeIntensity_channelwise", lambda: _T().NormalizeIntensity(channel_wise=True), forward_only=True,
           note="per-channel mean and std of the whole volume (written in place into unbind views: no gradient on "
           "one device either)")
_transform("ScaleIntensityRangePercentiles", lambda: _T().ScaleIntensityRangePercentiles(
    lower=5, upper=95, b_min=0.0, b_max=1.0), note="global percentiles (a quantile over every voxel)")
_transform("Zoom", lambda: _T().Zoom(zoom=0.5, keep_size=False), spatial_out=False, align=2)
_transform("Flip", lambda: _T().Flip(spatial_axis=0))
_transform("Rotate90", lambda: _T().Rotate90(k=1, spatial_axes=(0, 1)), spatial_out=False)
_transform("SpatialPad", lambda: _T().SpatialPad(spatial_size=(16, 12, 8), mode="reflect"))
_transform("CenterSpatialCrop", lambda: _T().CenterSpatialCrop(roi_size=(8, 6, 8)))
_transform("Affine", lambda: _T().Affine(rotate_params=(0.2, 0.0, 0.1), scale_params=(1.1, 0.9, 1.0),
                                         padding_mode="zeros", image_only=True),
           note="a resampling grid every rank builds whole, grid_sample of the split volume")
