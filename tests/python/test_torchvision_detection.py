"""torchvision's detection ops on split inputs (src/ops/torchvision_detection.cpp): roi_align over a feature map split
along H and/or W (and channels) -- each rank samples its own rows, the result a pending sum, no communication in
the forward; whole features with boxes split along their list; nms on a split box list; and the batch buffer a
detector's transform builds with ``new_full`` keeping the image's split. Against one device, forward and input
gradients, in strict mode (no fallback), uneven, one-row and empty shards, 1-D and 2-D meshes. The zoo runs the
whole detectors (benchmarks/zoo/zoo_models_eleventh.py)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn, tiny_extents, uneven_extents

tv_ops = pytest.importorskip("torchvision.ops", reason="torchvision is an optional test dependency")

TOL = dict(rtol=1e-9, atol=1e-9)

# (batch index, x1, y1, x2, y2) in image coordinates: inside, across every border, touching the edges, partly and
# wholly outside, a degenerate box.
BOXES = torch.tensor([[0, 2.0, 3.0, 30.0, 20.0], [1, 0.0, 0.0, 63.0, 47.0], [0, 40.0, 10.0, 44.0, 46.0],
                      [1, -6.0, 30.0, 10.0, 60.0], [0, 70.0, 70.0, 90.0, 80.0], [1, 17.5, 21.25, 17.5, 21.25],
                      [0, 12.3, 0.7, 52.9, 9.1]], dtype=torch.float64)


def _compare(x, lay, m, **kw):
    ref_x = x.clone().requires_grad_()
    ref = tv_ops.roi_align(ref_x, BOXES, **kw)
    xs = st.distribute_tensor(x, m, lay[0], sharding_shapes=lay[1]).requires_grad_()
    with st.CommCounter() as c:
        out = tv_ops.roi_align(xs, BOXES, **kw)
    assert c.total_calls == 0, dict(c.calls)   # each rank samples its own rows: nothing exchanged
    close(full(out), ref, **TOL, what=f"roi_align {kw}")
    w = randn(*ref.shape, seed=5, dtype=ref.dtype)
    (ref * w).sum().backward()
    (out * w).sum().backward()
    assert st.placements(xs.grad) == st.placements(xs)
    close(full(xs.grad), ref_x.grad, **TOL, what=f"roi_align input grad {kw}")


def case_roi_align(kind):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 12, 16, seed=1, dtype=torch.float64)
    ext = {"uneven": uneven_extents, "tiny": lambda n, k, seed=0: tiny_extents(n, k)}[kind]
    with st.use_strict():
        for dim in (2, 3):
            lay = ([st.Shard(dim)], {0: ext(x.shape[dim], w, seed=dim)})
            for kw in (dict(output_size=(4, 3), spatial_scale=0.25, sampling_ratio=2, aligned=False),
                       dict(output_size=5, spatial_scale=0.25, sampling_ratio=-1, aligned=True),
                       dict(output_size=(2, 2), spatial_scale=0.2, sampling_ratio=0, aligned=False)):
                _compare(x, lay, m, **kw)
        # Channels split: local, the output split alike.
        _compare(x, ([st.Shard(1)], {0: ext(3, w, seed=3)}), m, output_size=3, spatial_scale=0.25, sampling_ratio=2)
    return True


def case_roi_align_2d_mesh():
    m = mesh((2, 2))
    x = randn(2, 4, 10, 9, seed=2, dtype=torch.float64)
    with st.use_strict():
        _compare(x, ([st.Shard(2), st.Shard(3)], {0: [6, 4], 1: [0, 9]}), m, output_size=(3, 4), spatial_scale=0.2,
                 sampling_ratio=2, aligned=True)
        _compare(x, ([st.Shard(1), st.Shard(2)], {0: [1, 3], 1: [3, 7]}), m, output_size=2, spatial_scale=0.15,
                 sampling_ratio=-1)
    return True


def case_whole_features_split_boxes():
    """Mask R-CNN cuts its ground-truth masks (whole) to its proposals (split along the box list)."""
    m = mesh()
    w = m.size()
    masks = (randn(2, 1, 20, 20, seed=3, dtype=torch.float64) > 0).double()
    boxes = BOXES.clone()
    boxes[:, 1:] = boxes[:, 1:].clamp(0, 19)
    ref = tv_ops.roi_align(masks, boxes, (5, 5), 1.0, 0, True)
    bs = st.distribute_tensor(boxes, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(7, w, seed=4)})
    with st.use_strict():
        out = tv_ops.roi_align(masks, bs, (5, 5), 1.0, 0, True)
    assert st.placements(out) == (st.Shard(0),)
    close(full(out), ref, **TOL, what="whole masks, split boxes")
    return True


def case_nms():
    m = mesh()
    w = m.size()
    g = torch.Generator().manual_seed(6)
    xy = torch.rand(40, 2, generator=g, dtype=torch.float64) * 50
    dets = torch.cat([xy, xy + 5 + torch.rand(40, 2, generator=g, dtype=torch.float64) * 20], 1)
    scores = torch.rand(40, generator=g, dtype=torch.float64)
    ref = tv_ops.nms(dets, scores, 0.3)
    lay = {0: uneven_extents(40, w, seed=7)}
    with st.use_strict():
        keep = tv_ops.nms(st.distribute_tensor(dets, m, [st.Shard(0)], sharding_shapes=lay),
                          st.distribute_tensor(scores, m, [st.Shard(0)], sharding_shapes=lay), 0.3)
    assert torch.equal(full(keep), ref)
    return True


def case_batch_buffer():
    """torchvision's GeneralizedRCNNTransform: ``images[0].new_full((N, C, H', W'), 0)`` then a copy of each image
    into its corner -- the buffer keeps the image's split (it was Replicate: the copy gathered the image and the
    whole detector ran on every rank)."""
    m = mesh()
    w = m.size()
    img = randn(3, 13, 10, seed=8)
    ext = uneven_extents(13, w, seed=9)
    xs = st.distribute_tensor(img, m, [st.Shard(1)], sharding_shapes={0: ext})
    same = xs.new_full((1, 3, 13, 10), 0.0)
    assert st.placements(same) == (st.Shard(2),) and st.sharding_shapes(same) == st.sharding_shapes(
        st.distribute_tensor(img[None], m, [st.Shard(2)], sharding_shapes={0: ext}))
    grown = xs.new_full((2, 3, 16, 16), 0.0)
    assert st.placements(grown) == (st.Shard(2),)
    grown[0, :, :13, :10].copy_(xs)
    ref = torch.zeros(2, 3, 16, 16)
    ref[0, :, :13, :10] = img
    close(full(grown), ref, rtol=0, atol=0, what="padded batch buffer")
    # A shrinking trailing dim is some other tensor: Replicate, as before.
    assert st.placements(xs.new_zeros((2, 3, 4, 10))) == (st.Replicate(),)
    return True


def refuse_split_batch():
    m = mesh()
    xs = st.distribute_tensor(randn(2, 3, 8, 8, seed=10), m, [st.Shard(0)])
    with st.use_strict():
        tv_ops.roi_align(xs, BOXES.float(), 2)


@pytest.mark.parametrize("kind", ["uneven", "tiny"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_roi_align(world, kind):
    harness.run(world, case_roi_align, kind)


def test_roi_align_2d_mesh():
    harness.run(4, case_roi_align_2d_mesh)


@pytest.mark.parametrize("world", [2, 3])
def test_whole_features_split_boxes(world):
    harness.run(world, case_whole_features_split_boxes)


@pytest.mark.parametrize("world", [2, 3])
def test_nms(world):
    harness.run(world, case_nms)


@pytest.mark.parametrize("world", [2, 3])
def test_batch_buffer(world):
    harness.run(world, case_batch_buffer)


def test_split_batch_refused():
    harness.expect_error(2, refuse_split_batch, match="a split batch", kinds=("NotImplementedError",))
