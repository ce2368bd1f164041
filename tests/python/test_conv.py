"""Convolutions over sharded spatial dims (halo exchange) against single-device results: every kernel size,
stride, dilation, padding (ints, tuples, 'same', 'valid'), groups and depthwise, bias, 1-D/2-D/3-D, uneven shards
including shards narrower than the halo and zero-extent ranks, batch sharding, 2-D meshes with corners; input,
weight and bias gradients."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_conv2d_gradient_subset, check_op, mesh, randn, uneven_extents

TOL = dict(rtol=1e-4, atol=1e-5)


def case_conv1d_sweep(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 17, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(17, w, seed)})
    for k in (1, 2, 3, 4, 5):
        for stride in (1, 2, 3):
            for dil in (1, 2):
                for pad in (0, 1, k // 2 + 1):
                    wt = randn(4, 3, k, seed=seed + k)
                    check_op(lambda x, wt, b: F.conv1d(x, wt, b, stride=stride, padding=pad, dilation=dil),
                             [x, wt, randn(4, seed=3)], [lay, None, None], m, **TOL,
                             what=f"conv1d k={k} s={stride} d={dil} p={pad}")
    return True


def case_conv_padding_groups(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 4, 11, 9, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(11, w, seed)})
    for name, fn, wshape in [
        ("same odd", lambda x, wt: F.conv2d(x, wt, padding="same"), (5, 4, 3, 3)),
        ("same even", lambda x, wt: F.conv2d(x, wt, padding="same"), (5, 4, 4, 2)),
        ("valid", lambda x, wt: F.conv2d(x, wt, padding="valid"), (5, 4, 3, 3)),
        ("tuple padding stride", lambda x, wt: F.conv2d(x, wt, stride=(2, 1), padding=(2, 1)), (5, 4, 3, 3)),
        ("groups", lambda x, wt: F.conv2d(x, wt, padding=1, groups=2), (6, 2, 3, 3)),
        ("depthwise", lambda x, wt: F.conv2d(x, wt, padding=1, groups=4), (4, 1, 3, 3)),
        ("dilated strided", lambda x, wt: F.conv2d(x, wt, stride=2, dilation=2, padding=2), (3, 4, 3, 3)),
    ]:
        check_op(fn, [x, randn(*wshape, seed=seed + 1)], [lay, None], m, **TOL, what=f"conv2d {name}")
    # Width sharded, batch sharded.
    check_op(lambda x, wt: F.conv2d(x, wt, padding=1), [x, randn(5, 4, 3, 3, seed=2)],
             [([st.Shard(3)], {0: uneven_extents(9, w, seed + 1)}), None], m, **TOL, what="conv2d width")
    check_op(lambda x, wt: F.conv2d(x, wt, padding=1), [x, randn(5, 4, 3, 3, seed=2)],
             [([st.Shard(0)], None), None], m, **TOL, what="conv2d batch")
    return True


def case_conv_narrow_shards(seed):
    """Shards narrower than the halo (one row, zero rows): data comes from several ranks away."""
    m = mesh()
    w = m.size()
    x = randn(1, 2, 9, seed=seed)
    ext = [1] * (w - 1) + [9 - (w - 1)] if w > 1 else [9]
    if w > 2:
        ext = [0, 1] + [1] * (w - 3) + [9 - (w - 2)]
    check_op(lambda x, wt: F.conv1d(x, wt, padding=3), [x, randn(3, 2, 7, seed=1)], [([st.Shard(2)], {0: ext}), None],
             m, **TOL, what="conv1d k=7 narrow shards")
    return True


def case_conv3d(seed):
    m = mesh()
    x = randn(1, 2, 7, 6, 5, seed=seed)
    check_op(lambda x, wt, b: F.conv3d(x, wt, b, padding=1, stride=(1, 2, 1)),
             [x, randn(3, 2, 3, 3, 3, seed=1), randn(3, seed=2)], [([st.Shard(2)], {0: uneven_extents(7, m.size(), seed)}), None, None],
             m, **TOL, what="conv3d")
    return True


def case_conv_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 3, 9, 8, seed=seed)
    lay = ([st.Shard(2), st.Shard(3)], {0: uneven_extents(9, 2, seed), 1: uneven_extents(8, 2, seed + 1)})
    check_op(lambda x, wt, b: F.conv2d(x, wt, b, padding=1), [x, randn(4, 3, 3, 3, seed=1), randn(4, seed=2)],
             [lay, None, None], m, **TOL, what="2-D mesh conv (corners)")
    check_op(lambda x, wt: F.conv2d(x, wt, stride=2, padding=2, dilation=2), [x, randn(4, 3, 3, 3, seed=1)], [lay, None],
             m, **TOL, what="2-D mesh strided dilated")
    return True


def case_conv_module_training(seed):
    """A small conv stack trained for a few steps: parameters stay equal to single-device training."""
    m = mesh()
    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.GELU(), torch.nn.Conv2d(4, 2, 5, padding=2, stride=2))

    net, ref = make(), make()
    ref.load_state_dict(net.state_dict())
    opt, opt_ref = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = randn(2, 2, 13, 10, seed=seed + step)
        xs = st.distribute_tensor(x, m, [st.Shard(2)], {0: uneven_extents(13, m.size(), seed + step)})
        for model, inp, o in ((net, xs, opt), (ref, x, opt_ref)):
            o.zero_grad()
            model(inp).square().mean().backward()
            o.step()
    for (n, p), (_, r) in zip(net.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-6, msg=n)
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_conv1d_sweep(world):
    harness.run(world, case_conv1d_sweep, world, timeout=300)


@pytest.mark.parametrize("world", [2, 4])
def test_conv_padding_groups(world):
    harness.run(world, case_conv_padding_groups, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv_narrow_shards(world):
    harness.run(world, case_conv_narrow_shards, world)


@pytest.mark.parametrize("world", [2, 3])
def test_conv3d(world):
    harness.run(world, case_conv3d, world)


def test_conv_2d_mesh():
    harness.run(4, case_conv_2d_mesh, 1)


@pytest.mark.parametrize("world", [2, 3])
def test_conv_module_training(world):
    harness.run(world, case_conv_module_training, world)


def case_conv_gradient_subsets(seed):
    """Only the input gradient (frozen weights) or only the parameter gradients (an input that needs none), with
    layouts where neighbouring ranks run the convolution differently (one from its own rows plus border windows, the
    next from its gathered window: offsets off the stride grid): every rank still exchanges the same rows, and the
    gradients equal one device's."""
    m = mesh()
    k = m.size()
    x = randn(2, 3, 23, 5, seed=seed)
    odd = [3, 4, 4][:k - 1]  # rank 1 starts at an odd row: off the stride-2 grid
    layouts = [odd + [23 - sum(odd)], uneven_extents(23, k, seed)]
    for ext in layouts:
        for stride, kernel, pad, dil in ((2, 3, 1, 1), (1, 3, 1, 1), (1, 4, 2, 1), (3, 5, 2, 2)):
            w = randn(4, 3, kernel, 3, seed=seed + 1)
            b = randn(4, seed=seed + 2)
            for x_grad, w_grad in ((True, False), (False, True)):
                what = f"extents {ext} k={kernel} s={stride} p={pad} d={dil} input grad {x_grad} weight grad {w_grad}"
                check_conv2d_gradient_subset(lambda t: st.distribute_tensor(t, m, [st.Shard(2)], {0: ext}), x, w, b,
                                             dict(stride=(stride, 1), padding=(pad, 1), dilation=(dil, 1)),
                                             x_grad, w_grad, seed + 3, TOL, what)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_conv_gradient_subsets(world):
    harness.run(world, case_conv_gradient_subsets, world)


def case_pad_modes(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 10, 6, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(10, w, seed)})
    for mode in ("constant", "reflect", "replicate", "circular"):
        check_op(lambda t: F.pad(t, (1, 2, 3, 2), mode=mode), [x], [lay], m, what=f"pad {mode}")
    check_op(lambda t: F.pad(t, (0, 0, 2, 1), value=1.5), [x], [lay], m, what="pad value")
    check_op(lambda t: F.pad(t, (0, 0, -2, -3)), [x], [lay], m, what="negative pad (crop)")
    for mode in ("reflect", "replicate", "circular"):
        check_op(lambda t, wt: F.conv2d(F.pad(t, (1, 1, 1, 1), mode=mode), wt), [x, randn(4, 3, 3, 3, seed=1)],
                 [lay, None], m, **TOL, what=f"conv padding_mode={mode}")
    torch.manual_seed(0)  # the same weights on every rank
    conv = torch.nn.Conv2d(3, 2, 3, padding=1, padding_mode="reflect")
    check_op(lambda t: conv(t), [x], [lay], m, **TOL, what="nn.Conv2d reflect")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pad_modes(world):
    harness.run(world, case_pad_modes, world)


def case_conv_transpose(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 9, 7, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(9, w, seed)})
    for k, stride, pad, opad, dil in [(3, 1, 1, 0, 1), (2, 2, 0, 0, 1), (4, 2, 1, 1, 1), (3, 3, 2, 2, 2), (5, 2, 0, 1, 1)]:
        check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, stride=stride, padding=pad, output_padding=opad, dilation=dil),
                 [x, randn(3, 4, k, k, seed=k), randn(4, seed=2)], [lay, None, None], m, **TOL,
                 what=f"conv_transpose2d k={k} s={stride} p={pad} op={opad} d={dil}")
    check_op(lambda x, wt: F.conv_transpose2d(x, wt, stride=2, groups=3), [x, randn(3, 2, 3, 3, seed=5)], [lay, None], m,
             **TOL, what="conv_transpose2d groups")
    x1 = randn(1, 2, 8, seed=seed)
    check_op(lambda x, wt: F.conv_transpose1d(x, wt, stride=3, padding=1), [x1, randn(2, 3, 4, seed=1)],
             [([st.Shard(2)], {0: uneven_extents(8, w, seed + 1)}), None], m, **TOL, what="conv_transpose1d")
    x3 = randn(1, 2, 5, 4, 3, seed=seed)
    check_op(lambda x, wt: F.conv_transpose3d(x, wt, stride=2, padding=1), [x3, randn(2, 2, 3, 3, 3, seed=1)],
             [([st.Shard(3)], {0: uneven_extents(4, w, seed + 2)}), None], m, **TOL, what="conv_transpose3d")
    return True


def case_conv_transpose_follows_input(seed):
    """A transposed convolution's output is split like its input (each rank owns the rows its own inputs produce,
    less a halo that differs by at most one row between the sides), so uneven shards keep their proportions: a
    U-Net's upsampled features line up with the skip connection split like the encoder's input, and the
    concatenation moves nothing (the default split of the output made it re-lay one of them out)."""
    m = mesh()
    w = m.size()
    ext = [2 * e for e in uneven_extents(8, w, seed)]   # even boundaries, uneven sizes (zero extents allowed)
    x = randn(1, 3, 16, 6, seed=seed)
    lay = ([st.Shard(2)], {0: ext})
    down = randn(3, 3, 3, 3, seed=1)
    for k, stride, pad, opad in [(2, 2, 0, 0), (4, 2, 1, 0), (3, 2, 1, 1)]:
        up = randn(3, 2, k, k, seed=k)

        def unet_level(t):
            y = F.conv2d(t, down, stride=2, padding=1)
            return torch.cat([F.conv_transpose2d(y, up, stride=stride, padding=pad, output_padding=opad), t], dim=1)

        xs = st.distribute_tensor(x, m, *lay)
        with st.use_strict(), st.CommCounter() as c:
            out = unet_level(xs)
        assert list(st.sharding_shapes(out)[0]) == ext, (k, stride, pad, opad, st.sharding_shapes(out))
        assert set(c.calls) <= {"halo"}, c.calls
        check_op(unet_level, [x], [lay], m, **TOL, what=f"U-Net level k={k} s={stride} p={pad} op={opad}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_conv_transpose_follows_input(world):
    harness.run(world, case_conv_transpose_follows_input, world)


def case_conv_transpose_even(seed):
    """Shards whose kernels produce every output row they own (even extents): the main call writes the own rows,
    bias included, and the neighbours' rows travel from border calls (ops/conv.cpp transposed_direct); one uneven
    layout beside it puts ranks on both paths in one exchange."""
    m = mesh()
    w = m.size()
    x = randn(2, 3, 12, 5, seed=seed)
    layouts = [([st.Shard(2)], {0: [12 // w] * w})]
    if w > 1:
        layouts.append(([st.Shard(2)], {0: [12 // w + 1] + [12 // w] * (w - 2) + [12 // w - 1]}))
    for lay in layouts:
        for k, stride, pad, opad, dil in [(2, 2, 0, 0, 1), (4, 2, 1, 0, 1), (3, 2, 1, 1, 1), (3, 1, 1, 0, 1),
                                          (5, 2, 2, 1, 1), (3, 2, 2, 1, 2), (1, 1, 0, 0, 1)]:
            check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, stride=stride, padding=pad, output_padding=opad,
                                                         dilation=dil),
                     [x, randn(3, 4, k, k, seed=k), randn(4, seed=2)], [lay, None, None], m, **TOL,
                     what=f"conv_transpose2d {lay[1]} k={k} s={stride} p={pad} op={opad} d={dil}")
    x1 = randn(1, 2, 12, seed=seed)
    check_op(lambda x, wt: F.conv_transpose1d(x, wt, stride=2, padding=1), [x1, randn(2, 3, 4, seed=1)],
             [layouts[0], None], m, **TOL, what="conv_transpose1d even")
    return True


def case_conv_transpose_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(1, 2, 6, 5, seed=seed)
    lay = ([st.Shard(2), st.Shard(3)], {0: uneven_extents(6, 2, seed), 1: uneven_extents(5, 2, seed + 1)})
    check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, stride=2, padding=1, output_padding=1),
             [x, randn(2, 3, 3, 3, seed=1), randn(3, seed=2)], [lay, None, None], m, **TOL, what="2-D mesh conv_transpose")
    # Kernel = stride, no padding (a U-Net's upsampling): every window is the rank's own output rows, no exchange.
    # Overlapping kernels on even (and one mixed) layouts: every rank's own block from the main call, the rows its
    # neighbours own (corners included) home through the steps in reverse (ops/conv.cpp transposed_multi_forward).
    x8 = randn(2, 2, 8, 6, seed=seed + 2)
    for ext in ({0: [4, 4], 1: [3, 3]}, {0: [5, 3], 1: [3, 3]}):
        for k, stride, pad, opad, dil in [(4, 2, 1, 0, 1), (3, 2, 1, 1, 1), (3, 1, 1, 0, 1), (3, 2, 2, 1, 2)]:
            check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, stride=stride, padding=pad, output_padding=opad,
                                                         dilation=dil),
                     [x8, randn(2, 3, k, k, seed=k), randn(3, seed=5)], [([st.Shard(2), st.Shard(3)], ext), None, None],
                     m, **TOL, what=f"2-D mesh conv_transpose {ext} k={k} s={stride} p={pad} op={opad} d={dil}")
    x3 = randn(1, 2, 4, 6, 3, seed=seed + 3)
    check_op(lambda x, wt: F.conv_transpose3d(x, wt, stride=2, padding=1), [x3, randn(2, 2, 4, 4, 4, seed=6)],
             [([st.Shard(2), st.Shard(3)], {0: [2, 2], 1: [3, 3]}), None], m, **TOL,
             what="2-D mesh conv_transpose3d k4 s2 p1")
    x4 = randn(1, 2, 6, 4, seed=seed + 1)
    for ext in ({0: [3, 3], 1: [2, 2]}, {0: uneven_extents(6, 2, seed), 1: [1, 3]}):
        check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, stride=2),
                 [x4, randn(2, 3, 2, 2, seed=3), randn(3, seed=4)], [([st.Shard(2), st.Shard(3)], ext), None, None],
                 m, **TOL, what=f"2-D mesh conv_transpose k2 s2 {ext}")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_conv_transpose(world):
    harness.run(world, case_conv_transpose, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv_transpose_even(world):
    harness.run(world, case_conv_transpose_even, world)


def test_conv_transpose_2d_mesh():
    harness.run(4, case_conv_transpose_2d_mesh, 2)


def case_conv_channel_sharded(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 6, 7, 5, seed=seed)
    ch = ([st.Shard(1)], {0: uneven_extents(6, w, seed)})
    # groups == 1 with C_in / P <= C_out: the split moves to a spatial dim first (one all-to-all of the input) and
    # the output stays divided; a narrow output (C_in / P > C_out) keeps the cheaper pending sum.
    out = check_op(lambda x, wt, b: F.conv2d(x, wt, b, padding=1), [x, randn(4, 6, 3, 3, seed=1), randn(4, seed=2)],
                   [ch, None, None], m, **TOL, what="conv2d channels sharded (moved to space)")
    if w > 1:
        assert st.placements(out) == (st.Shard(2),), st.placements(out)
    out = check_op(lambda x, wt, b: F.conv2d(x, wt, b, padding=1), [x, randn(1, 6, 3, 3, seed=11), randn(1, seed=12)],
                   [ch, None, None], m, **TOL, what="conv2d channels sharded, one output channel (Partial)")
    if w > 1:
        assert st.placements(out) == (st.Partial(),), st.placements(out)
    # Depthwise / grouped: shards aligned with whole groups run locally.
    aligned = [2 * e for e in uneven_extents(3, w, seed + 1)]
    check_op(lambda x, wt, b: F.conv2d(x, wt, b, padding=1, groups=3), [x, randn(6, 2, 3, 3, seed=3), randn(6, seed=4)],
             [([st.Shard(1)], {0: aligned}), None, None], m, **TOL, what="grouped conv channels sharded")
    check_op(lambda x, wt: F.conv2d(x, wt, padding=1, groups=6), [x, randn(12, 1, 3, 3, seed=5)], [ch, None], m, **TOL,
             what="depthwise conv channels sharded")
    # Transposed (weights [in, out / groups, k...]): the input channels are the weight's rows.
    with st.use_strict():
        check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, stride=2, padding=1, output_padding=1),
                 [x, randn(6, 4, 3, 3, seed=6), randn(4, seed=7)], [ch, None, None], m, **TOL,
                 what="conv_transpose2d channels sharded (moved to space)")
        check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, stride=2, groups=3),
                 [x, randn(6, 3, 2, 2, seed=8), randn(9, seed=9)], [([st.Shard(1)], {0: aligned}), None, None], m,
                 **TOL, what="grouped conv_transpose2d channels sharded")
        check_op(lambda x, wt: F.conv_transpose1d(x, wt, padding=1), [x[0, :, :, 0], randn(6, 3, 3, seed=10)],
                 [([st.Shard(0)], {0: uneven_extents(6, w, seed)}), None], m, **TOL,
                 what="unbatched conv_transpose1d channels sharded")
    return True


def case_conv_channels_and_height(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(1, 4, 9, 6, seed=seed)
    lay = ([st.Shard(1), st.Shard(2)], {0: uneven_extents(4, 2, seed), 1: uneven_extents(9, 2, seed + 1)})
    check_op(lambda x, wt, b: F.conv2d(x, wt, b, padding=1), [x, randn(3, 4, 3, 3, seed=1), randn(3, seed=2)],
             [lay, None, None], m, **TOL, what="channels and height sharded")
    check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, stride=2), [x, randn(4, 3, 2, 2, seed=3), randn(3, seed=4)],
             [lay, None, None], m, **TOL, what="transposed, channels and height sharded")
    check_op(lambda x, wt, b: F.conv_transpose2d(x, wt, b, padding=1), [x, randn(4, 3, 3, 3, seed=5), randn(3, seed=6)],
             [lay, None, None], m, **TOL, what="transposed k3, channels and height sharded")
    return True


def bad_grouped_split():
    x = st.distribute_tensor(torch.randn(1, 6, 5, 5), mesh(), [st.Shard(1)], sharding_shapes={0: [1, 5]})
    with st.use_strict():   # else the refusal runs the gather-compute fallback (test_fallback.py)
        F.conv2d(x, torch.randn(6, 2, 3, 3), groups=3)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_conv_channel_sharded(world):
    harness.run(world, case_conv_channel_sharded, world)


def test_conv_channels_and_height():
    harness.run(4, case_conv_channels_and_height, 1)


def test_grouped_conv_split_group_raises():
    harness.expect_error(2, bad_grouped_split, match="split")


def case_output_partition(seed):
    """Outputs are owned by the rank holding their window centre: 'same'-padded stride-1 layers keep the input
    extents (no drift through a stack), stride 2 halves them; pooling follows the same rule."""
    m = mesh()
    w = m.size()
    ext = uneven_extents(16, w, seed)
    x = st.distribute_tensor(randn(1, 2, 16, 5, seed=seed), m, [st.Shard(2)], {0: ext})
    for k in (3, 5, 7):
        y = F.conv2d(x, randn(2, 2, k, k, seed=k), padding=k // 2)
        assert st.sharding_shapes(y)[0] == ext, (k, st.sharding_shapes(y), ext)
        y = F.max_pool2d(x, k, stride=1, padding=k // 2)
        assert st.sharding_shapes(y)[0] == ext, ("pool", k, st.sharding_shapes(y), ext)
    if all(e % 2 == 0 for e in ext):
        y = F.conv2d(x, randn(2, 2, 3, 3, seed=9), padding=1, stride=2)
        assert st.sharding_shapes(y)[0] == [e // 2 for e in ext], (st.sharding_shapes(y), ext)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_output_partition(world):
    harness.run(world, case_output_partition, world)
