"""pixel_shuffle, pixel_unshuffle and channel_shuffle with the batch or spatial dims sharded (uneven, a zero-extent
rank, 2-D meshes): local, no communication, forward and gradients equal one device; what must decline does."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, mesh, randn, uneven_extents


def calls():
    return sum(st.comm_stats()["calls"].values())


def case_pixel_ops(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 8, 5, 6, seed=seed)
    for d, n in ((2, 5), (3, 6), (0, 2)):
        lay = ([st.Shard(d)], {0: uneven_extents(n, w, seed)})
        xs = st.distribute_tensor(x, m, *lay)
        before = calls()
        with st.use_strict():
            out = F.pixel_shuffle(xs, 2)
        assert calls() == before, f"pixel_shuffle along dim {d} communicated"
        assert st.placements(out) == (st.Shard(d),)
        check_op(lambda t: F.pixel_shuffle(t, 2), [x], [lay], m, what=f"pixel_shuffle dim {d}")
        check_op(lambda t: torch.channel_shuffle(t, 4), [x], [lay], m, what=f"channel_shuffle dim {d}")
        check_op(lambda t: torch.nn.ChannelShuffle(2)(t), [x], [lay], m, what=f"ChannelShuffle dim {d}")
    # Unshuffle: extents in whole blocks of r rows.
    y = randn(2, 3, 4 * w, 6, seed=seed + 1)
    ext = [4] * w if w < 3 else [8, 0] + [4] * (w - 2)
    lay = ([st.Shard(2)], {0: ext})
    ys = st.distribute_tensor(y, m, *lay)
    with st.use_strict():
        before = calls()
        F.pixel_unshuffle(ys, 2)
        assert calls() == before, "pixel_unshuffle communicated"
    check_op(lambda t: F.pixel_unshuffle(t, 2), [y], [lay], m, what="pixel_unshuffle")
    check_op(lambda t: F.pixel_shuffle(F.pixel_unshuffle(t, 2), 2), [y], [lay], m, what="round trip")
    # A split channel dim: pixel_unshuffle keeps it (each channel becomes r^2 adjacent ones) and so does pixel_shuffle
    # when every rank holds whole groups of r^2 channels — no communication; otherwise (and channel_shuffle, whose
    # permutation spans the channels) the split moves to the largest other dim (one all-to-all), strict mode.
    z = randn(2, 4 * 2 * w, 5, 6, seed=seed + 2)
    grouped = ([st.Shard(1)], {0: [8] * w if w < 3 else [16, 0] + [8] * (w - 2)})
    uneven = ([st.Shard(1)], {0: uneven_extents(8 * w, w, seed)})
    with st.use_strict():
        moved = {"all_to_all": 1} if w > 1 else {}
        for what, lay, fn, want in (
                ("pixel_unshuffle, channels", uneven, lambda t: F.pixel_unshuffle(t[..., :4, :4], 2), {}),
                ("pixel_shuffle, whole groups", grouped, lambda t: F.pixel_shuffle(t, 2), {}),
                ("pixel_shuffle, channels", uneven, lambda t: F.pixel_shuffle(t, 2),
                 {} if all(e % 4 == 0 for e in uneven[1][0]) else moved),
                ("channel_shuffle, channels", uneven, lambda t: torch.channel_shuffle(t, 4), moved)):
            zs = st.distribute_tensor(z, m, *lay)
            st.reset_comm_stats()
            fn(zs)
            assert st.comm_stats()["calls"] == want, (what, st.comm_stats()["calls"])
            check_op(fn, [z], [lay], m, what=what)
    if w > 1:
        # Rows not in whole blocks: the shard boundaries round to multiples of r first (one all-to-all of the rows
        # that move), then the local op; strict mode, the output in whole blocks, the gradient in the input's layout.
        odd = ([st.Shard(2)], {0: [1] + [1] * (w - 2) + [4 * w - (w - 1)]})
        fn = lambda t: F.pixel_unshuffle(t, 2)  # noqa: E731
        with st.use_strict():
            ys = st.distribute_tensor(y, m, *odd)
            st.reset_comm_stats()
            out = fn(ys)
            assert st.comm_stats()["calls"] == {"all_to_all": 1}, st.comm_stats()["calls"]
            # Boundaries after 1 (and 2) input rows round to 0 (and 2): output rows [0, 4] / [0, 1, 5].
            assert list(st.sharding_shapes(out)[0]) == ([0, 4] if w == 2 else [0, 1, 5]), st.sharding_shapes(out)
            check_op(fn, [y], [odd], m, what="odd rows re-aligned")
            check_op(lambda t: F.pixel_shuffle(F.pixel_unshuffle(t * 2, 2), 2), [y], [odd], m,
                     what="odd rows, round trip")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pixel_ops(world):
    harness.run(world, case_pixel_ops, world)


def case_pixel_ops_mesh2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 8, 5, 6, seed=seed)
    lay = ([st.Shard(2), st.Shard(3)], {0: uneven_extents(5, 2, seed), 1: uneven_extents(6, 2, seed + 1)})
    check_op(lambda t: F.pixel_shuffle(t, 2), [x], [lay], m, what="pixel_shuffle 2x2")
    y = randn(1, 2, 8, 4, seed=seed)
    check_op(lambda t: F.pixel_unshuffle(t, 2), [y], [([st.Shard(2), st.Shard(3)], {0: [2, 6], 1: [2, 2]})], m,
             what="pixel_unshuffle 2x2")
    return True


def test_pixel_ops_mesh2d():
    harness.run(4, case_pixel_ops_mesh2d, 4)
