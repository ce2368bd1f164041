"""Convolutions over two sharded spatial dims (2x2, 2x1 and 1x2 meshes) against single-device results: the border
execution without the window (main call on the own block, border slabs from region windows whose corners arrive
through the second dim's exchange) and ranks on the window path beside it (zero-extent and 1-row shards); stride,
dilation, padding, groups, Conv2d and Conv3d; forward, input, weight and bias gradients."""
import harness
import shardtensor as st
import torch.nn.functional as F
import torch
from cases_util import check_conv2d_gradient_subset, check_op, mesh, randn

TOL = dict(rtol=1e-4, atol=1e-5)

# Per mesh dim of 2 coordinates: even, a 1-row neighbour, a zero-extent one.
SPLITS_9 = ([4, 5], [1, 8], [8, 1], [0, 9], [9, 0])
SPLITS_8 = ([4, 4], [7, 1], [1, 7], [0, 8])


def conv2d_variants():
    return [
        ("k3 p1 bias", (4, 3, 3, 3), True, dict(padding=1)),
        ("k5 p2", (4, 3, 5, 5), False, dict(padding=2)),
        ("stride 2 dilation 2", (4, 3, 3, 3), True, dict(stride=2, padding=2, dilation=2)),
        ("stride (2,1) padding (1,2)", (4, 3, 3, 5), False, dict(stride=(2, 1), padding=(1, 2))),
        ("even kernel same", (4, 3, 4, 2), False, dict(padding="same")),
        ("valid", (4, 3, 3, 3), True, dict(padding=0)),
        ("groups 3", (6, 1, 3, 3), True, dict(padding=1, groups=3)),
    ]


def run_conv2d(m, exts):
    x = randn(2, 3, 9, 8, seed=3)
    for e0, e1 in exts:
        sharding = {}
        if m.shape[0] > 1:
            sharding[0] = e0
        if m.shape[1] > 1:
            sharding[1] = e1
        lay = ([st.Shard(2), st.Shard(3)], sharding)
        for name, wshape, bias, kw in conv2d_variants():
            inputs = [x, randn(*wshape, seed=4)] + ([randn(wshape[0], seed=5)] if bias else [])
            layouts = [lay, None] + ([None] if bias else [])
            check_op(lambda x, w, b=None: F.conv2d(x, w, b, **kw), inputs, layouts, m, **TOL,
                     what=f"mesh {tuple(m.shape)} H {e0} W {e1} conv2d {name}")


def case_conv2d_mesh_2x2(seed):
    m = mesh((2, 2), ("a", "b"))
    run_conv2d(m, [([4, 5], [4, 4]), ([1, 8], [7, 1]), ([0, 9], [1, 7]), ([8, 1], [0, 8])])
    return True


def case_conv2d_mesh_2x1_1x2(seed):
    for shape in ((2, 1), (1, 2)):
        run_conv2d(mesh(shape, ("a", "b")), [(e0, e1) for e0, e1 in zip(SPLITS_9, SPLITS_8)])
    return True


def case_conv3d_mesh_2x2(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(1, 2, 7, 6, 5, seed=seed)
    for dims, e0, e1 in [((2, 3), [3, 4], [1, 5]), ((3, 4), [0, 6], [2, 3]), ((2, 4), [6, 1], [4, 1])]:
        lay = ([st.Shard(dims[0]), st.Shard(dims[1])], {0: e0, 1: e1})
        check_op(lambda x, w, b: F.conv3d(x, w, b, padding=1, stride=(1, 2, 1)),
                 [x, randn(3, 2, 3, 3, 3, seed=1), randn(3, seed=2)], [lay, None, None], m, **TOL,
                 what=f"conv3d dims {dims} {e0} {e1}")
        check_op(lambda x, w: F.conv3d(x, w, padding=2, dilation=2, groups=2),
                 [x, randn(4, 1, 3, 3, 3, seed=1)], [lay, None], m, **TOL,
                 what=f"conv3d dilated groups dims {dims} {e0} {e1}")
    return True


def case_conv2d_mesh_gradient_subsets(seed):
    """Only the input gradient (frozen weights) or only the parameter gradients on a 2x2 mesh, including a rank
    whose rows start off the stride grid (it builds its window while its neighbours do not)."""
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 3, 11, 9, seed=seed)
    for e0, e1 in (([3, 8], [4, 5]), ([0, 11], [1, 8]), ([6, 5], [9, 0])):
        for stride, kernel, pad, dil in ((2, 3, 1, 1), (1, 3, 1, 1), (1, 4, 2, 1)):
            w = randn(4, 3, kernel, 3, seed=seed + 1)
            b = randn(4, seed=seed + 2)
            for x_grad, w_grad in ((True, False), (False, True)):
                what = f"H {e0} W {e1} k={kernel} s={stride} p={pad} d={dil} input grad {x_grad} weight grad {w_grad}"
                check_conv2d_gradient_subset(
                    lambda t: st.distribute_tensor(t, m, [st.Shard(2), st.Shard(3)], {0: e0, 1: e1}), x, w, b,
                    dict(stride=(stride, 1), padding=(pad, 1), dilation=(dil, 1)), x_grad, w_grad, seed + 3, TOL, what)
    return True


def test_conv2d_mesh_gradient_subsets():
    harness.run(4, case_conv2d_mesh_gradient_subsets, 1)


def test_conv2d_mesh_2x2():
    harness.run(4, case_conv2d_mesh_2x2, 1)


def test_conv2d_mesh_2x1_1x2():
    harness.run(2, case_conv2d_mesh_2x1_1x2, 1)


def test_conv3d_mesh_2x2():
    harness.run(4, case_conv3d_mesh_2x2, 1)
