"""Padding, slicing and narrowing by negative amounts along sharded dims, against one device: forward and input
gradient for every padding mode with negative and mixed-sign pads (torch's circular mode crops first and wraps
the cropped tensor, the other modes map each output onto the uncropped input), pads that reach past a rank's
rows, negative slice bounds and steps, negative narrow starts; even, uneven and zero extents, 2-4 ranks, a 2-D
mesh with both padded dims sharded."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, close, mesh, narrow_extents, randn, tiny_extents, uneven_extents

# (left, right) pads of the sharded dim: crops on one side, pads on the other, crops on both, crops wider than a
# shard; every pair is valid for every mode at size 9.
PADS_1D = [(-1, 1), (1, -1), (-2, 3), (3, -2), (-1, -1), (-3, 0), (0, -4), (-4, 2), (2, -5), (-6, 1)]


def _extents(kind, n, w):
    return {"even": None, "uneven": {0: uneven_extents(n, w, seed=5)}, "tiny": {0: tiny_extents(n, w)},
            "narrow": {0: narrow_extents(n, w)}}[kind]


def case_issue_example():
    """The issue's repro: arange(4.) sharded [3, 1], F.pad(x, (-1, 1), mode="circular") is [1, 2, 3, 1]."""
    m = mesh()
    x = torch.arange(4.0).view(1, 1, 4)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: [3, 1]})
    got = F.pad(xs, (-1, 1), mode="circular").full_tensor()
    close(got, torch.tensor([[[1.0, 2.0, 3.0, 1.0]]]), what="circular (-1, 1)")
    return True


def test_issue_example():
    harness.run(2, case_issue_example)


def case_pad_negative(kind):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 9, seed=1)
    lay = ([st.Shard(2)], _extents(kind, 9, w))
    for mode in ("constant", "reflect", "replicate", "circular"):
        for pad in PADS_1D:
            kw = {"value": 0.5} if mode == "constant" else {}
            check_op(lambda t: F.pad(t, pad, mode=mode, **kw), [x], [lay], m, what=f"pad {mode} {pad} {kind}")
    return True


@pytest.mark.parametrize("world,kind", [(1, "even"), (2, "even"), (2, "uneven"), (3, "tiny"), (3, "uneven"),
                                        (4, "narrow")])
def test_pad_negative(world, kind):
    harness.run(world, case_pad_negative, kind)


def case_pad_negative_2d(mesh_shape):
    """Both padded dims sharded (a 2-D mesh) or one sharded and one local (a 1-D mesh), mixed-sign pads."""
    m = mesh(mesh_shape)
    x = randn(2, 2, 7, 8, seed=2)
    if len(mesh_shape) == 2:
        lay = ([st.Shard(2), st.Shard(3)], {0: uneven_extents(7, mesh_shape[0], seed=1),
                                            1: uneven_extents(8, mesh_shape[1], seed=2)})
    else:
        lay = ([st.Shard(3)], {0: uneven_extents(8, mesh_shape[0], seed=3)})
    for mode in ("constant", "reflect", "replicate", "circular"):
        for pad in [(-1, 2, 1, -2), (2, -3, -1, -1), (-2, 0, 0, 3)]:
            check_op(lambda t: F.pad(t, pad, mode=mode), [x], [lay], m, what=f"pad2d {mode} {pad} {mesh_shape}")
    # 3-D circular (DLWP-like faces pad through _pad_circular's 3-D form)
    x5 = randn(1, 2, 5, 6, 4, seed=3)
    lay5 = ([st.Shard(3)] + ([st.Shard(2)] if len(mesh_shape) == 2 else []), None)
    check_op(lambda t: F.pad(t, (1, -1, -2, 1, 0, -1), mode="circular"), [x5], [lay5], m, what="pad3d circular")
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_pad_negative_2d(mesh_shape):
    harness.run(int(torch.tensor(mesh_shape).prod()), case_pad_negative_2d, mesh_shape)


def case_pad_too_large(mode, pad):
    """Pads torch refuses (circular wrapping more than once, or wider than the cropped dim; reflect as wide as the
    dim) raise on every rank instead of returning a value."""
    m = mesh()
    x = randn(1, 2, 4, seed=4)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(4, m.size(), seed=1)})
    F.pad(xs, pad, mode=mode)


@pytest.mark.parametrize("mode,pad,torch_raises", [
    ("circular", (5, 0), True), ("reflect", (4, 0), True), ("constant", (-3, -2), True),
    ("reflect", (-4, 0), True), ("replicate", (-2, -2), True), ("reflect", (-5, 1), True),
    # A pad wider than the cropped dim: torch copies between overlapping slices of its output (a value that
    # depends on the copy order, or an overlap error for some shapes); every rank refuses it.
    ("circular", (-3, 2), False), ("circular", (3, -2), False)])
def test_pad_too_large_raises(mode, pad, torch_raises):
    if torch_raises:
        with pytest.raises(RuntimeError):
            F.pad(torch.randn(1, 2, 4), pad, mode=mode)  # torch refuses it on one device: so must every rank
    harness.expect_error(2, case_pad_too_large, mode, pad)


def case_slice_negative(kind):
    m = mesh()
    w = m.size()
    x = randn(3, 10, 4, seed=6)
    lay = ([st.Shard(1)], _extents(kind, 10, w))
    cases = {
        "x[:, -3:]": lambda t: t[:, -3:],
        "x[:, :-2]": lambda t: t[:, :-2],
        "x[:, -7:-1]": lambda t: t[:, -7:-1],
        "x[:, -20:4]": lambda t: t[:, -20:4],
        "x[:, 2:-20]": lambda t: t[:, 2:-20],
        "x[:, -8::3]": lambda t: t[:, -8::3],
        "x[:, 1:-1:2]": lambda t: t[:, 1:-1:2],
        "narrow(1, -4, 3)": lambda t: t.narrow(1, -4, 3),
        "narrow(-2, -10, 10)": lambda t: t.narrow(-2, -10, 10),
        "split(-1)": lambda t: t[:, -1],
        "tensor_split": lambda t: torch.tensor_split(t, (-6, -2), dim=1)[1],
    }
    for what, fn in cases.items():
        check_op(fn, [x], [lay], m, what=f"{what} {kind}")
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny"), (4, "narrow")])
def test_slice_negative(world, kind):
    harness.run(world, case_slice_negative, kind)
