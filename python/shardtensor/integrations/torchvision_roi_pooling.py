"""torchvision's multi-scale RoI pooling with its result divided along the boxes (``MultiScaleRoIAlign``: the box,
mask and keypoint heads of Faster / Mask / Keypoint R-CNN).

``_multiscale_roi_align`` allocates its result as a plain tensor of every box's pooled features
(``torch.zeros(num_rois, C, ph, pw)``) and writes each pyramid level's ``roi_align`` into it. With the feature maps
split along H or W, ``roi_align`` gives a pending sum (each rank's taps), and the write into the plain tensor
completed it whole on every rank: the heads after it -- two fully connected layers per box, Mask R-CNN's four
convolutions on 14 x 14 per box -- ran in full on every rank, most of the model's work.

Routed here (``st.register_function``), the result is a ShardTensor split along the boxes on the first mesh dim
that splits H or W (channels stay split as the features are; other mesh dims that split H or W complete their sums
there): each level's pending sum is completed as it is written, each rank keeps its own boxes' rows, and the heads
run divided through the op rules (the losses and the post-processing read the rows they need). A single level is
completed into the same layout. Features split along the batch, or not split spatially, run torchvision's own
body."""
from __future__ import annotations

import torch

from .. import Replicate, Shard, device_mesh, from_local, is_shard_tensor, placements, redistribute, sharding_shapes
from ..io.layout import default_split


def _box_layout(features):
    """The result's placements from the features' (the first mesh dim splitting H or W splits the boxes), or None
    when the features are not all ShardTensors split spatially on the same mesh, or are split along the batch."""
    if not features or not all(is_shard_tensor(f) and f.dim() == 4 for f in features):
        return None
    pl = placements(features[0])
    if any(placements(f) != pl for f in features):
        return None
    out, boxes_split = [], False
    for p in pl:
        if p.is_shard() and p.dim == 0:
            return None
        if p.is_shard() and p.dim in (2, 3) and not boxes_split:
            out.append(Shard(0))
            boxes_split = True
        elif p.is_shard() and p.dim == 1:
            out.append(Shard(1))
        else:
            out.append(Replicate())
    return out if boxes_split else None


def _zeros_split(shape, layout, like):
    """Zeros of ``shape`` laid out as ``layout``, built from local blocks: the boxes split by the default split, the
    channels as ``like``'s (so each level's pooled features are written without moving their channels)."""
    mesh = device_mesh(like)
    coords = mesh.get_coordinate()
    like_shapes = sharding_shapes(like)
    local, shapes = list(shape), {}
    for m, p in enumerate(layout):
        if p.is_shard():
            n, k = shape[p.dim], mesh.size(m)
            extents = list(like_shapes[m]) if p.dim == 1 else default_split(n, k)
            shapes[m] = extents
            local[p.dim] = extents[coords[m]]
    return from_local(torch.zeros(local, dtype=like.dtype, device=like.device), mesh, layout, sharding_shapes=shapes,
                      global_shape=list(shape), check=False)


def _handler_for(fn):
    def multiscale_roi_align_divided(x_filtered, boxes, output_size, sampling_ratio, scales, mapper):
        layout = _box_layout(list(x_filtered))
        if layout is None or scales is None or mapper is None:
            return fn(x_filtered, boxes, output_size, sampling_ratio, scales, mapper)
        from torchvision.ops import roi_align
        from torchvision.ops.poolers import _convert_to_roi_format
        rois = _convert_to_roi_format(boxes)
        if len(x_filtered) == 1:
            out = roi_align(x_filtered[0], rois, output_size=output_size, spatial_scale=scales[0],
                            sampling_ratio=sampling_ratio)
            return redistribute(out, placements=layout)
        levels = mapper(boxes)
        first = x_filtered[0]
        result = _zeros_split((len(rois), first.shape[1]) + tuple(output_size), layout, first)
        for level, (feature, scale) in enumerate(zip(x_filtered, scales)):
            idx_in_level = torch.where(levels == level)[0]
            pooled = roi_align(feature, rois[idx_in_level], output_size=output_size, spatial_scale=scale,
                               sampling_ratio=sampling_ratio)
            result[idx_in_level] = pooled.to(result.dtype)
        return result

    multiscale_roi_align_divided.__name__ = "_multiscale_roi_align_divided"
    return multiscale_roi_align_divided


def install(module) -> None:
    """Route torchvision.ops.poolers._multiscale_roi_align."""
    from ..functions import register_function
    fn = getattr(module, "_multiscale_roi_align", None)
    if fn is not None:
        register_function(fn, _handler_for(fn))
