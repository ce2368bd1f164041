"""torchvision's multi-scale RoI pooling with its result split along the boxes (``shardtensor.integrations.
torchvision_roi_pooling``: ``MultiScaleRoIAlign``, the pooling of Faster / Mask / Keypoint R-CNN's heads), against one
device.

Without the integration the pooled features were a plain tensor written level by level (``torch.zeros(K, C, 7, 7)``,
then ``result[idx] = roi_align(...)``): whole on every rank, and every head after it computed in full on every rank.
Checked: the pooled features are a ShardTensor split along the boxes (each rank its own rows: the default split),
channels split as the features are; a box head (two linear layers) and a convolution after it, the features' and
every parameter's gradients equal one device's in strict mode with nothing made whole; a pyramid of three levels and
one level, two images, uneven and one-row feature shards, 2-3 ranks, H x W and channels x H on a 2x2 mesh; features
split along the batch keep torchvision's body (roi_align's refusal on every rank); a gradient penalty through the
pooling (roi_align's backward recorded: it is linear in the features); the routing in either import order."""
import copy

import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_integration_routing, close, full, mesh, needs_library, tiny_extents, uneven_extents

needs_torchvision = needs_library("torchvision", "torchvision")

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)
C, SIZE = 3, 4
LEVELS = {"0": 32, "1": 16, "2": 8}   # feature map sides for a 128 x 128 image: scales 1/4, 1/8, 1/16


class _Heads(torch.nn.Module):
    """MultiScaleRoIAlign, then a convolution per box (a mask head's) and a box head (TwoMLPHead's two layers)."""

    def __init__(self, names):
        super().__init__()
        from torchvision.models.detection.faster_rcnn import TwoMLPHead
        from torchvision.ops import MultiScaleRoIAlign
        self.pool = MultiScaleRoIAlign(names, SIZE, sampling_ratio=2)
        self.conv = torch.nn.Conv2d(C, C, 3, padding=1)
        self.head = TwoMLPHead(C * SIZE * SIZE, 6)

    def forward(self, feats, boxes):
        pooled = self.pool(feats, boxes, [(128, 128), (128, 128)])
        return self.head(torch.relu(self.conv(pooled))), pooled


def _boxes():
    """Two images' boxes: small ones (pooled from the finest level) and large ones (coarser levels)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for n in (4, 3):
        xy = torch.rand(n, 2, generator=g, dtype=D) * 60
        wh = torch.cat([torch.rand(n - 2, 2, generator=g, dtype=D) * 30 + 4,
                        torch.rand(2, 2, generator=g, dtype=D) * 60 + 60])
        out.append(torch.cat([xy, (xy + wh).clamp(max=127)], 1))
    return out


def _compare(names, placements, extents_of, batch_split=False):
    m = mesh() if len(placements) == 1 else mesh((2, 2))
    torch.manual_seed(0)
    ref = _Heads(names).to(D)
    net = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    feats = {k: torch.randn(2, C, LEVELS[k], LEVELS[k], dtype=D, generator=g) for k in names}
    fr = {k: v.clone().requires_grad_() for k, v in feats.items()}
    fs = {k: st.distribute_tensor(v, m, placements, sharding_shapes=extents_of(v)).requires_grad_()
          for k, v in feats.items()}
    boxes = _boxes()
    y_ref, pooled_ref = ref(fr, boxes)
    with st.use_strict(not batch_split), st.CommCounter() as counter:
        y, pooled = net(fs, boxes)
    close(full(pooled), pooled_ref, what="pooled features", **TOL)
    close(full(y), y_ref, what="box head output", **TOL)
    if not batch_split:
        assert counter.replications == {}, counter.replications
        assert st.is_shard_tensor(pooled), "the pooled features are a plain tensor (whole on every rank)"
        spatial = [i for i, p in enumerate(placements) if p.is_shard() and p.dim in (2, 3)]
        expect = [st.Shard(0) if i == spatial[0] else st.Shard(1) if p.is_shard() and p.dim == 1 else st.Replicate()
                  for i, p in enumerate(placements)]
        assert list(st.placements(pooled)) == expect, st.placements(pooled)
        k, parts = pooled_ref.shape[0], m.size(spatial[0])
        own = k // parts + (1 if m.get_coordinate()[spatial[0]] < k % parts else 0)
        assert st.to_local(pooled).shape[0] == own, (st.to_local(pooled).shape, own)
        assert st.is_shard_tensor(y) and st.placements(y)[spatial[0]] == st.Shard(0), "the box head ran whole"
    w = torch.randn(y_ref.shape, dtype=D, generator=torch.Generator().manual_seed(2))
    (y_ref * w).sum().backward()
    with st.use_strict(not batch_split):
        (y * w).sum().backward()
    for k in names:
        close(full(fs[k].grad), fr[k].grad, what=f"level {k} gradient", **TOL)
    for (n, p), (_, pr) in zip(net.named_parameters(), ref.named_parameters()):
        close(full(p.grad), pr.grad, what=n, **TOL)
    return True


def case_split_h(names, kind):
    w = mesh().size()
    split = (lambda v: {0: tiny_extents(v.shape[2], w)}) if kind == "tiny" else \
        (lambda v: {0: uneven_extents(v.shape[2], w, seed=v.shape[2])})
    return _compare(names, [st.Shard(2)], split)


def case_2d_mesh(kind):
    if kind == "hw":
        return _compare(list(LEVELS), [st.Shard(2), st.Shard(3)],
                        lambda v: {0: uneven_extents(v.shape[2], 2, 1), 1: uneven_extents(v.shape[3], 2, 2)})
    return _compare(list(LEVELS), [st.Shard(1), st.Shard(2)],   # channel extents other than the default split
                    lambda v: {0: [1, 2], 1: uneven_extents(v.shape[2], 2, 3)})


def case_batch_split():
    with pytest.raises(NotImplementedError, match="split batch"):
        _compare(list(LEVELS), [st.Shard(0)], lambda v: {0: [1, 1]}, batch_split=True)
    return True


def case_double_backward():
    """A gradient penalty through the pooling (roi_align is linear in the features: its backward is recorded)."""
    m = mesh()
    torch.manual_seed(0)
    ref = _Heads(list(LEVELS)).to(D)
    net = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    feats = {k: torch.randn(2, C, LEVELS[k], LEVELS[k], dtype=D, generator=g) for k in LEVELS}
    # One device: torchvision's kernel has no double backward; its pure-torch roi_align (the same sampling, written
    # with differentiable ops) is the reference.
    import sys
    import torchvision.ops.poolers as poolers
    pure = sys.modules["torchvision.ops.roi_align"]._roi_align
    pure = getattr(pure, "__wrapped__", pure)   # the function itself, not torchvision's lazy torch.compile of it

    def differentiable_roi_align(x, rois, output_size, spatial_scale, sampling_ratio, aligned=False):
        return pure(x, rois, spatial_scale, output_size[0], output_size[1], sampling_ratio, aligned)
    results = []
    for model, inputs in ((ref, {k: v.clone().requires_grad_() for k, v in feats.items()}),
                          (net, {k: st.distribute_tensor(v, m, [st.Shard(2)],
                                                         sharding_shapes={0: uneven_extents(v.shape[2], m.size(), 4)})
                                 .requires_grad_() for k, v in feats.items()})):
        kernel = poolers.roi_align
        poolers.roi_align = differentiable_roi_align if model is ref else kernel
        try:
            with st.use_strict():
                y, _ = model(inputs, _boxes())
                grads = torch.autograd.grad(y.square().sum(), list(inputs.values()), create_graph=True)
                sum(gr.square().sum() for gr in grads).backward()
        finally:
            poolers.roi_align = kernel
        results.append(([full(gr) for gr in grads], [full(t.grad) for t in inputs.values()],
                        [full(p.grad) for p in model.parameters()]))
    for what, a, b in zip(("first derivative", "feature gradient", "parameter gradient"), results[1], results[0]):
        for x, y in zip(a, b):
            close(x, y, what=what, **TOL)
    return True


@needs_torchvision
def test_double_backward():
    assert all(harness.run(2, case_double_backward))


@needs_torchvision
@pytest.mark.parametrize("world,names,kind", [(2, "pyramid", "uneven"), (3, "pyramid", "tiny"),
                                              (2, "one level", "uneven")])
def test_multiscale_roi_align(world, names, kind):
    assert all(harness.run(world, case_split_h, list(LEVELS) if names == "pyramid" else ["0"], kind))


@needs_torchvision
@pytest.mark.parametrize("kind", ["hw", "channels"])
def test_2d_mesh(kind):
    assert all(harness.run(4, case_2d_mesh, kind))


@needs_torchvision
def test_batch_split_keeps_torchvision_body():
    """roi_align refuses a split batch (each box names its image by index): the same clear error on every rank as
    without the integration, not a hang or a wrong layout."""
    assert all(harness.run(2, case_batch_split))


@needs_torchvision
def test_routing_either_import_order():
    check_integration_routing("shardtensor", "torchvision.ops.poolers", "torchvision.ops.poolers",
                              "_multiscale_roi_align")
    check_integration_routing("torchvision.ops.poolers", "shardtensor", "torchvision.ops.poolers",
                              "_multiscale_roi_align", disabled_too=False)
