"""The model zoo's eleventh set: torchvision's object detectors on one image split along its rows (the eighteenth
session's probe) -- high-resolution aerial or microscopy images are where a detector's input outgrows one device.
Unmodified torchvision models with random weights: the transform's normalization and batching (a padded batch
buffer the image is copied into), the backbone and FPN, the region proposal network (anchors, box decoding, top-k
over every anchor, NMS), RoIAlign over the split feature maps, the box and mask heads; one training step with
fixed targets (the losses; the proposal sampler's draws reseeded alike) and one eval forward (the detections).
Registered like zoo_models.py's (zoo_models.py imports this module at its end).

The detections are compared tie-aware (`tied_detections`, zoo_models._compare_detections): at random init many
boxes pool identical features (ReLU zeros) and score exactly alike, and a one-ulp difference in one of them (a sum
taken in another order next to a shard boundary) decides which of the tied boxes NMS keeps and in which order --
fasterrcnn_mobilenet_v3_large_320_fpn's eval output changed that way on an AMD EPYC host (thirtieth session: three
scores of 0.2078542658705139 on one device, one of them an ulp lower sharded, and NMS then kept the other of two
overlapping boxes). The sorted scores must match, and every detection whose score no other one shares must match
field by field.

SSD-lite (ssdlite320_mobilenet_v3_large, two images resized by its own transform to 320) runs with its random
weights perturbed (`_untied`): at torchvision's init most anchors score exactly alike (38 distinct scores among 300
detections, the depthwise blocks' ReLU6 zeros), and on a 2x2 mesh one tied box kept instead of another suppressed
different neighbours, so image 1's sorted scores differed by 4.5 % (the thirty-first session's probe; its training
step equal). With every parameter moved by seeded noise and the BatchNorm shifts made positive the scores are
distinct and the detections equal one device's field by field on 2 and 3 ranks and on 2x2."""
import torch

from benchmarks.zoo.zoo_models import model

_IMG = (1, 3, 128, 128)


def _targets():
    boxes = torch.tensor([[10.0, 12.0, 60.0, 70.0], [50.0, 40.0, 120.0, 100.0], [5.0, 80.0, 40.0, 125.0]])
    labels = torch.tensor([1, 2, 3])
    masks = torch.zeros(3, 128, 128, dtype=torch.uint8)
    for i, (x1, y1, x2, y2) in enumerate(boxes.long().tolist()):
        masks[i, y1:y2, x1:x2] = 1
    keypoints = torch.stack([torch.stack([boxes[:, 0] + 3.0 * k, boxes[:, 1] + 2.0 * k, torch.ones(3)], 1)
                             for k in range(4)], 1)
    return {"targets": [{"boxes": boxes, "labels": labels, "masks": masks, "keypoints": keypoints}]}


def _det(arch, **kw):
    import torchvision
    return getattr(torchvision.models.detection, arch)(weights=None, weights_backbone=None, min_size=128,
                                                       max_size=128, **kw)


for _arch, _kw, _note in [
    ("fasterrcnn_mobilenet_v3_large_320_fpn", {"num_classes": 5}, "RPN, RoIAlign box head"),
    ("fasterrcnn_resnet50_fpn", {"num_classes": 5, "trainable_backbone_layers": 5}, "ResNet-50 FPN, MultiScaleRoIAlign"),
    ("maskrcnn_resnet50_fpn", {"num_classes": 5, "trainable_backbone_layers": 5}, "mask head on RoIAlign features"),
    ("keypointrcnn_resnet50_fpn", {"num_classes": 5, "num_keypoints": 4, "trainable_backbone_layers": 5},
     "keypoint head"),
    ("retinanet_resnet50_fpn", {"num_classes": 5, "trainable_backbone_layers": 5}, "dense focal-loss head over every "
     "anchor"),
    ("fcos_resnet50_fpn", {"num_classes": 5, "trainable_backbone_layers": 5}, "anchor-free: centerness, GIoU"),
]:
    @model("torchvision", f"torchvision_det/{_arch}", _IMG, spatial_out=False, reseed=True, extra=_targets,
           tied_detections=True, note=_note)
    def _(_arch=_arch, _kw=_kw):
        return _det(_arch, **_kw)


def _untied(m):
    """Seeded noise on every parameter, positive BatchNorm shifts and running variances of 0.5: the features stop
    being ReLU6 zeros, so the anchors' scores stop tying (which of tied boxes NMS keeps is not a value)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.bias.add_(0.2)
                mod.running_var.fill_(0.5)
    return m


def _two_targets():
    boxes = torch.tensor([[10.0, 12.0, 60.0, 70.0], [50.0, 40.0, 120.0, 100.0]])
    labels = torch.tensor([1, 2])
    return {"targets": [{"boxes": boxes, "labels": labels}, {"boxes": boxes[:1] + 3.0, "labels": labels[:1]}]}


@model("torchvision", "torchvision_det/ssdlite320_mobilenet_v3_large", (2, 3, 128, 128), spatial_out=False, reseed=True,
       extra=_two_targets, tied_detections=True, note="two images resized to 320 by its transform, SSD-lite head "
       "over six feature maps, hard negative mining")
def _():
    import torchvision
    return _untied(torchvision.models.detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                            num_classes=5))
