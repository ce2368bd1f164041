"""F.interpolate / nn.Upsample over sharded spatial dims against single-device results, forward and input
gradients: nearest, nearest-exact, linear, bilinear, trilinear, bicubic; align_corners both ways; size or
scale_factor (with and without recompute_scale_factor, including PyTorch's output == 2 * input and
output == input special cases); up- and down-sampling; uneven shards with zero-extent ranks; 1-D and 2-D meshes;
batch-sharded inputs; antialias over sharded spatial dims through a re-layout onto the batch or channels, or (a single
field) in two stages with the split moved between them."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, mesh, randn, uneven_extents

TOL = dict(rtol=1e-5, atol=1e-5)
CUBIC_TOL = dict(rtol=1e-4, atol=1e-4)

# (kwargs) resizing specs for a 2-D input of spatial size (6, 5)
SPECS_2D = [
    dict(size=(13, 7)),                                          # upsample, non-integer ratios
    dict(size=(4, 3)),                                           # downsample
    dict(size=(1, 1)),
    dict(scale_factor=2.0),
    dict(scale_factor=0.5),
    dict(scale_factor=(1.7, 2.6), recompute_scale_factor=False),
    dict(scale_factor=(1.7, 0.6), recompute_scale_factor=True),
    dict(scale_factor=2.1),                                      # output == 2 * input, scale != 2
    dict(scale_factor=1.1),                                      # output == input, scale != 1
]


def _fn(mode, ac, kw):
    extra = {} if ac is None else dict(align_corners=ac)
    return lambda x: F.interpolate(x, mode=mode, **extra, **kw)


def case_interp_2d_sweep(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 6, 5, seed=seed)
    ext = uneven_extents(6, w, seed)
    if w > 2:
        ext = [0, 5] + [0] * (w - 3) + [1]      # zero-extent ranks and a one-row rank
    lay = ([st.Shard(2)], {0: ext})
    for mode, acs in (("nearest", [None]), ("nearest-exact", [None]), ("bilinear", [False, True]),
                      ("bicubic", [False, True])):
        for ac in acs:
            for kw in SPECS_2D:
                tol = CUBIC_TOL if mode == "bicubic" else TOL
                check_op(_fn(mode, ac, kw), [x], [lay], m, **tol, what=f"{mode} ac={ac} {kw} ext={ext}")
    # Width sharded (the last dim), default split.
    check_op(_fn("bilinear", False, dict(scale_factor=3.0)), [x], [([st.Shard(3)], None)], m, **TOL,
             what="bilinear width sharded")
    return True


def case_interp_1d_3d(seed):
    m = mesh()
    w = m.size()
    x1 = randn(2, 3, 11, seed=seed)
    lay1 = ([st.Shard(2)], {0: uneven_extents(11, w, seed)})
    for mode, acs in (("nearest", [None]), ("nearest-exact", [None]), ("linear", [False, True])):
        for ac in acs:
            for kw in (dict(size=25), dict(size=4), dict(scale_factor=2.1), dict(scale_factor=1.05),
                       dict(scale_factor=0.7, recompute_scale_factor=False), dict(scale_factor=3.0)):
                check_op(_fn(mode, ac, kw), [x1], [lay1], m, **TOL, what=f"1d {mode} ac={ac} {kw}")
    x3 = randn(1, 2, 5, 4, 3, seed=seed)
    for dim in (2, 3):
        lay3 = ([st.Shard(dim)], {0: uneven_extents(x3.shape[dim], w, seed + dim)})
        for mode, acs in (("nearest", [None]), ("nearest-exact", [None]), ("trilinear", [False, True])):
            for ac in acs:
                for kw in (dict(size=(7, 9, 2)), dict(scale_factor=2.1), dict(scale_factor=(0.6, 1.5, 1.0))):
                    check_op(_fn(mode, ac, kw), [x3], [lay3], m, **TOL, what=f"3d dim={dim} {mode} ac={ac} {kw}")
    return True


def case_interp_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 2, 7, 6, seed=seed)
    lay = ([st.Shard(2), st.Shard(3)], {0: [7, 0] if seed % 2 else uneven_extents(7, 2, seed),
                                        1: uneven_extents(6, 2, seed + 1)})
    for mode, acs in (("nearest", [None]), ("nearest-exact", [None]), ("bilinear", [False, True]),
                      ("bicubic", [False, True])):
        for ac in acs:
            for kw in (dict(size=(15, 4)), dict(scale_factor=2.0), dict(scale_factor=(0.6, 1.6), recompute_scale_factor=False)):
                tol = CUBIC_TOL if mode == "bicubic" else TOL
                check_op(_fn(mode, ac, kw), [x], [lay], m, **tol, what=f"2-D mesh {mode} ac={ac} {kw}")
    # Batch on one mesh dim, height on the other.
    check_op(_fn("bilinear", True, dict(scale_factor=2.0)), [x], [([st.Shard(0), st.Shard(2)], None)], m, **TOL,
             what="2-D mesh batch x height")
    return True


def case_interp_module_and_layout(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 3, 9, 4, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(9, w, seed)})
    up = torch.nn.Upsample(scale_factor=2, mode="nearest")
    out = check_op(up, [x], [lay], m, **TOL, what="nn.Upsample nearest", expect_placements=[st.Shard(2)])
    # Nearest x2 keeps data local: each rank's output is exactly twice its input rows.
    assert st.sharding_shapes(out)[0] == [2 * e for e in lay[1][0]], st.sharding_shapes(out)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], {0: lay[1][0]}).requires_grad_()
    with st.CommCounter() as c:
        up(xs).sum().backward()
    assert c.total_calls == 0, c.calls  # nearest x2 moves no data, forward or backward
    check_op(torch.nn.Upsample(size=(5, 11), mode="bilinear", align_corners=True), [x], [lay], m, **TOL,
             what="nn.Upsample bilinear")
    # Batch-sharded inputs run locally (antialias included).
    for kw in (dict(mode="bilinear", antialias=True, scale_factor=0.5), dict(mode="bicubic", antialias=True, size=(4, 7)),
               dict(mode="bicubic", size=(4, 7))):
        check_op(lambda t: F.interpolate(t, **kw), [x], [([st.Shard(0)], None)], m, **CUBIC_TOL, what=f"batch {kw}")
    # Conv -> upsample -> conv, trained for two steps: parameters stay equal to single-device training.
    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Upsample(scale_factor=2, mode="bilinear"),
                                   torch.nn.Conv2d(4, 2, 3, padding=1))

    net, ref = make(), make()
    ref.load_state_dict(net.state_dict())
    for model, inp in ((net, st.distribute_tensor(x, m, [st.Shard(2)], {0: lay[1][0]})), (ref, x)):
        model(inp).square().mean().backward()
    for (n, p), (_, r) in zip(net.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6, msg=n)
    return True


def border_extents(n, w):
    """Wide shards (interior outputs from the own rows) beside a zero-extent and a one-row shard."""
    if w == 2:
        return [n - 8, 8]
    if w == 3:
        return [1, n - 9, 8]
    return [8, 0, 1, n - 9]


def case_interp_border_split(seed):
    """Shards wide enough for interior outputs: the main call resamples the own rows, the border outputs come from
    border windows (no window built), forward and input gradient against one device; every mode, align_corners both
    ways, up- and down-sampling, sizes and scale factors, 1-D and 3-D, and a 2-D mesh with both spatial dims sharded
    (each dim's pass runs its own split)."""
    m = mesh()
    w = m.size()
    x = randn(1, 2, 20, 4, seed=seed)
    for ext in (border_extents(20, w), uneven_extents(20, w, seed + 7)):
        lay = ([st.Shard(2)], {0: ext})
        for mode, acs in (("nearest", [None]), ("nearest-exact", [None]), ("bilinear", [False, True]),
                          ("bicubic", [False, True])):
            for ac in acs:
                for kw in (dict(size=(47, 5)), dict(size=(9, 4)), dict(scale_factor=2.0),
                           dict(scale_factor=(1.3, 1.0), recompute_scale_factor=False)):
                    tol = CUBIC_TOL if mode == "bicubic" else TOL
                    check_op(_fn(mode, ac, kw), [x], [lay], m, **tol, what=f"border {mode} ac={ac} {kw} ext={ext}")
    x1 = randn(2, 2, 24, seed=seed + 1)
    for ac in (False, True):
        check_op(_fn("linear", ac, dict(scale_factor=1.7, recompute_scale_factor=False)), [x1],
                 [([st.Shard(2)], {0: border_extents(24, w)})], m, **TOL, what=f"border 1d linear ac={ac}")
    x3 = randn(1, 1, 3, 18, 2, seed=seed + 2)
    check_op(_fn("trilinear", False, dict(size=(4, 31, 3))), [x3], [([st.Shard(3)], {0: border_extents(18, w)})], m,
             **TOL, what="border 3d trilinear")
    return True


def case_interp_border_split_2d_mesh(seed):
    m = mesh((2, 2))
    x = randn(1, 2, 14, 12, seed=seed)
    for eh, ew in (([10, 4], [1, 11]), ([0, 14], [8, 4])):
        lay = ([st.Shard(2), st.Shard(3)], {0: eh, 1: ew})
        for mode, ac in (("nearest", None), ("bilinear", False), ("bicubic", True)):
            tol = CUBIC_TOL if mode == "bicubic" else TOL
            check_op(_fn(mode, ac, dict(size=(29, 17))), [x], [lay], m, **tol, what=f"2-D mesh border {mode} {eh} {ew}")
    return True


def case_interp_double(seed):
    m = mesh()
    x = randn(1, 2, 7, 5, seed=seed, dtype=torch.float64)
    lay = ([st.Shard(2)], {0: uneven_extents(7, m.size(), seed)})
    for mode, ac in (("nearest", None), ("bilinear", False), ("bicubic", True)):
        check_op(_fn(mode, ac, dict(scale_factor=(1.3, 2.0), recompute_scale_factor=False)), [x], [lay], m,
                 rtol=1e-10, atol=1e-10, what=f"fp64 {mode}")
    return True


def case_interp_direct_ops(seed):
    """The non-.vec aten ops below autograd (aten's own backward formula calls the *_backward rule) and the .vec
    entry point under inference mode."""
    m = mesh()
    x = randn(2, 2, 7, 5, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(7, m.size(), seed)})
    check_op(lambda t: torch.ops.aten.upsample_bilinear2d(t, [12, 4], False, None, None), [x], [lay], m, **TOL,
             what="aten.upsample_bilinear2d")
    check_op(lambda t: torch.ops.aten.upsample_nearest2d(t, [15, 5], 2.1, None), [x], [lay], m, **TOL,
             what="aten.upsample_nearest2d")
    check_op(lambda t: torch.ops.aten.upsample_bicubic2d(t, [9, 9], True, None, None), [x], [lay], m, **CUBIC_TOL,
             what="aten.upsample_bicubic2d")
    xs = st.distribute_tensor(x, m, [st.Shard(2)], {0: lay[1][0]})
    with torch.inference_mode():
        y = F.interpolate(xs, scale_factor=1.5, mode="bilinear")
    torch.testing.assert_close(st.full_tensor(y), F.interpolate(x, scale_factor=1.5, mode="bilinear"), rtol=1e-5, atol=1e-6)
    return True


def case_antialias_sharded_raises(seed):
    m = mesh()
    # no batch or channel dim takes the split, and the output's single column cannot hold it between the two passes
    x = st.distribute_tensor(randn(1, 1, 8, 8, seed=seed), m, [st.Shard(2)])
    with st.use_strict():   # else the refusal runs the gather-compute fallback (test_fallback.py)
        F.interpolate(x, size=(4, 1), mode="bilinear", antialias=True)


def case_antialias_single_field(world):
    """Antialiased resizing of one field (batch and channels smaller than the mesh dim, so neither takes the split):
    the separable filter runs in two stages -- W on each rank's rows, the split moved to the output's W (one
    all-to-all), H on each rank's columns (a split along W moves to H first) -- bit-exact with one device forward (the
    kernel's own pass order), the gradient staged the other way round. Strict mode: no fallback, only all-to-alls,
    the output divided; uneven and zero-extent shards, down- and up-sampling, both modes, align_corners both ways."""
    m = mesh()
    x = randn(1, 1, 23, 17, seed=40, dtype=torch.float64)
    exact = dict(rtol=0, atol=0)
    with st.use_strict():
        for lay in (([st.Shard(2)], {0: uneven_extents(23, world, seed=41)}), ([st.Shard(2)], None),
                    ([st.Shard(3)], {0: uneven_extents(17, world, seed=42)})):
            for kw in (dict(mode="bilinear", antialias=True, scale_factor=0.5),
                       dict(mode="bicubic", antialias=True, size=(9, 30), align_corners=True),
                       dict(mode="bilinear", antialias=True, size=(40, 6)),
                       dict(mode="bicubic", antialias=True, scale_factor=(0.3, 0.7))):
                fn = (lambda t, kw=kw: F.interpolate(t, **kw))
                xs = st.distribute_tensor(x, m, *lay)
                st.reset_comm_stats()
                out = fn(xs)
                assert set(st.comm_stats()["calls"]) <= {"all_to_all"}, st.comm_stats()["calls"]
                assert world == 1 or st.placements(out) == (st.Shard(3),), st.placements(out)
                torch.testing.assert_close(st.full_tensor(out), fn(x), **exact, msg=f"{kw} {lay[0]} forward")
                check_op(fn, [x], [lay], m, rtol=1e-12, atol=1e-12, what=f"single field {kw} {lay[0]}")
    return True


def case_antialias_spatial_split(world):
    """Antialiased bilinear/bicubic of a spatially split input (the filter's support grows with the downscale): the
    split moves to the channel (or batch) dim first, one all-to-all, then the local op; forward and gradient equal
    one device, the output stays divided (on a 2x2 mesh H's split goes to the channels, W's to the batch)."""
    m = mesh() if world < 4 else mesh((2, 2))
    x = randn(2, 4, 9, 10, seed=5)
    if world < 4:
        lays = [([st.Shard(2)], {0: uneven_extents(9, world, seed=6)}), ([st.Shard(3)], {0: uneven_extents(10, world, 7)})]
    else:
        lays = [([st.Shard(2), st.Shard(3)], {0: [4, 5], 1: [3, 7]})]
    with st.use_strict():
        for lay in lays:
            for kw in (dict(mode="bilinear", antialias=True, scale_factor=0.5),
                       dict(mode="bicubic", antialias=True, size=(4, 7), align_corners=True)):
                xs = st.distribute_tensor(x, m, *lay)
                st.reset_comm_stats()
                out = F.interpolate(xs, **kw)
                assert set(st.comm_stats()["calls"]) <= {"all_to_all"}, st.comm_stats()["calls"]
                assert st.to_local(out).numel() < out.numel(), st.placements(out)
                check_op(lambda t, kw=kw: F.interpolate(t, **kw), [x], [lay], m, **CUBIC_TOL, what=f"{kw} {lay[0]}")
    return True


def case_antialias_one_image_2d_mesh(seed):
    """Both spatial dims split on a 2x2 mesh, one image of a few channels (the batch cannot take a split): one split
    moves to the channels and the other runs the staged passes -- strict mode, only all-to-alls, the output divided,
    forward and gradient against one device, uneven and zero-extent shards. A single-channel image leaves both splits
    in place: refused on every rank (strict mode; else the fallback)."""
    m = mesh((2, 2))
    x = randn(1, 3, 11, 13, seed=seed, dtype=torch.float64)
    with st.use_strict():
        for ext in ({0: [5, 6], 1: [7, 6]}, {0: [0, 11], 1: [13, 0]}, {0: [10, 1], 1: [2, 11]}):
            lay = ([st.Shard(2), st.Shard(3)], ext)
            for kw in (dict(mode="bilinear", antialias=True, scale_factor=0.5),
                       dict(mode="bicubic", antialias=True, size=(7, 20), align_corners=True),
                       dict(mode="bicubic", antialias=True, size=(22, 5))):
                xs = st.distribute_tensor(x, m, *lay)
                st.reset_comm_stats()
                out = F.interpolate(xs, **kw)
                assert set(st.comm_stats()["calls"]) <= {"all_to_all"}, st.comm_stats()["calls"]
                assert st.to_local(out).numel() < out.numel() or out.numel() == 0, st.placements(out)
                check_op(lambda t, kw=kw: F.interpolate(t, **kw), [x], [lay], m, rtol=1e-12, atol=1e-12,
                         what=f"one image 2x2 {kw} {ext}")
        one = st.distribute_tensor(x[:, :1].contiguous(), m, [st.Shard(2), st.Shard(3)])
        with pytest.raises(NotImplementedError, match="antialias"):
            F.interpolate(one, scale_factor=0.5, mode="bilinear", antialias=True)
    return True


def test_antialias_one_image_2d_mesh():
    harness.run(4, case_antialias_one_image_2d_mesh, 4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_antialias_spatial_split(world):
    harness.run(world, case_antialias_spatial_split, world)


def case_interp_native_main(seed):
    """Layouts where the single-device kernel runs the main call (a rank's first output falls on its first row:
    scale 2 up, scale 2 down at even offsets, 1-D and 3-D), with an odd-offset layout beside them whose ranks mix
    that path and the tap-by-tap one in one exchange; forward and input gradient."""
    m = mesh()
    w = m.size()
    even = [24 // w] * w
    odd = [24 // w + 1] + [24 // w] * (w - 2) + [24 // w - 1]
    x = randn(2, 3, 24, 7, seed=seed)
    for ext in (even, odd):
        lay = ([st.Shard(2)], {0: ext})
        for mode, kw in (("bilinear", dict(scale_factor=2.0)), ("bilinear", dict(scale_factor=0.5)),
                         ("bilinear", dict(size=(48, 14))), ("bicubic", dict(scale_factor=2.0)),
                         ("bicubic", dict(scale_factor=0.5)), ("nearest", dict(scale_factor=2.0)),
                         ("nearest", dict(scale_factor=0.5)), ("nearest-exact", dict(scale_factor=2.0)),
                         ("bilinear", dict(scale_factor=(2.0, 1.0)))):
            ac = dict(align_corners=False) if mode in ("bilinear", "bicubic") else {}
            tol = CUBIC_TOL if mode == "bicubic" else TOL
            check_op(lambda t: F.interpolate(t, mode=mode, **ac, **kw), [x], [lay], m, **tol,
                     what=f"{mode} {kw} ext={ext}")
    x1 = randn(2, 3, 24, seed=seed)
    check_op(lambda t: F.interpolate(t, scale_factor=2.0, mode="linear", align_corners=False), [x1],
             [([st.Shard(2)], {0: even})], m, **TOL, what="linear 1-D x2")
    x3 = randn(1, 2, 4, 24, 3, seed=seed)
    check_op(lambda t: F.interpolate(t, scale_factor=2.0, mode="trilinear", align_corners=False), [x3],
             [([st.Shard(3)], {0: even})], m, **TOL, what="trilinear x2, the second spatial dim sharded")
    check_op(lambda t: F.interpolate(t, scale_factor=(1.0, 2.0, 2.0), mode="trilinear", align_corners=False), [x3],
             [([st.Shard(3)], {0: even})], m, **TOL, what="trilinear, the dim before the sharded one unchanged")
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_interp_native_main(world):
    harness.run(world, case_interp_native_main, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_interp_2d_sweep(world):
    harness.run(world, case_interp_2d_sweep, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_interp_1d_3d(world):
    harness.run(world, case_interp_1d_3d, world, timeout=300)


@pytest.mark.parametrize("seed", [0, 1])
def test_interp_2d_mesh(seed):
    harness.run(4, case_interp_2d_mesh, seed, timeout=300)


@pytest.mark.parametrize("world", [2, 4])
def test_interp_module_and_layout(world):
    harness.run(world, case_interp_module_and_layout, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_interp_border_split(world):
    harness.run(world, case_interp_border_split, world, timeout=300)


def test_interp_border_split_2d_mesh():
    harness.run(4, case_interp_border_split_2d_mesh, 0, timeout=300)


def test_interp_double():
    harness.run(3, case_interp_double, 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_antialias_single_field(world):
    harness.run(world, case_antialias_single_field, world)


def test_antialias_sharded_raises():
    harness.expect_error(2, case_antialias_sharded_raises, 0, match="antialias", kinds=("NotImplementedError",))


@pytest.mark.parametrize("world", [3])
def test_interp_direct_ops(world):
    harness.run(world, case_interp_direct_ops, 0)
