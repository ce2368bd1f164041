"""torch.roll against the single-device computation: along unsharded dims (local) and sharded dims (a neighbour
exchange of the rows that change owner), several dims at once, negative and larger-than-size shifts, the flattened
roll, fft.fftshift / ifftshift, Partial inputs, uneven and zero extents, 1-4 ranks and a 2-D mesh. Every case checks
the forward, the input gradient (a roll by the negated shifts, through the same rule) and that the output keeps the
input's layout."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, rank, uneven_extents


def _same_layout(out, xs, what):
    assert st.placements(out) == st.placements(xs), f"{what}: placements {st.placements(out)}"
    assert st.sharding_shapes(out) == st.sharding_shapes(xs), f"{what}: extents {st.sharding_shapes(out)}"


def case_roll_sharded_dim(seed):
    m = mesh()
    w = m.size()
    x = randn(9, 4, 3, seed=seed)
    for ext_seed in (seed, seed + 1):
        lay = ([st.Shard(0)], {0: uneven_extents(9, w, ext_seed)})
        for shift in (1, -1, 2, -4, 5, 8, 9, 0, 23, -31):
            out = check_op(lambda t: torch.roll(t, shift, 0), [x], [lay], m, what=f"roll({shift}, 0)")
            _same_layout(out, st.distribute_tensor(x, m, *lay), f"roll({shift}, 0)")
        # Other dims: local.
        check_op(lambda t: torch.roll(t, (2, -1), (1, 2)), [x], [lay], m, what="unsharded dims")
        # Several dims at once, the sharded one among them; a repeated dim adds its shifts.
        check_op(lambda t: torch.roll(t, (-3, 1, 2), (1, 0, -1)), [x], [lay], m, what="several dims")
        check_op(lambda t: torch.roll(t, (4, 3), (0, 0)), [x], [lay], m, what="repeated dim")
    # The sharded dim in the middle, every rank but one empty, and a tensor whose sharded dim is shorter than the mesh.
    lay = ([st.Shard(1)], {0: [0] * (w - 1) + [4]})
    check_op(lambda t: torch.roll(t, 3, 1), [x], [lay], m, what="all rows on one rank")
    y = randn(2, 3, seed=seed + 2)
    check_op(lambda t: torch.roll(t, -2, 1), [y], [([st.Shard(1)], None)], m, what="short sharded dim")
    return True


def case_roll_only_moved_rows_travel(seed):
    """Rows that stay with their owner are copied locally; only the others travel (one all-to-all)."""
    m = mesh()
    w = m.size()
    x = randn(4 * w, 3, seed=seed)
    xs = st.distribute_tensor(x, m, [st.Shard(0)])
    with st.CommCounter() as c:
        out = torch.roll(xs, 1, 0)
    close(full(out), torch.roll(x, 1, 0), what="roll by one")
    assert c.calls == ({"halo": 1} if w > 1 else {}), f"calls {c.calls}"
    row = 3 * x.element_size()
    assert c.bytes.get("halo", 0) == (row if w > 1 else 0), f"bytes {c.bytes}: one row per rank expected"
    with st.CommCounter() as c:
        out = torch.roll(xs, (4 * w, 2), (0, 1))  # a whole turn of the sharded dim
    close(full(out), torch.roll(x, 2, 1), what="whole turn")
    assert c.calls == {}, f"a whole turn moves nothing: {c.calls}"
    return True


def case_roll_flattened(seed):
    m = mesh()
    w = m.size()
    x = randn(7, 3, 2, seed=seed)
    lay = ([st.Shard(0)], {0: uneven_extents(7, w, seed)})
    for shift in (1, 5, 6, -7, 40, 0):
        check_op(lambda t: torch.roll(t, shift), [x], [lay], m, what=f"flattened roll({shift})")
    # Leading size-1 dims before the sharded dim keep the shards contiguous in the flattened order.
    x1 = randn(1, 6, 5, seed=seed + 1)
    check_op(lambda t: torch.roll(t, -8), [x1], [([st.Shard(1)], {0: uneven_extents(6, w, seed)})], m,
             what="flattened, leading size-1 dim")
    # A replicated tensor rolls locally.
    check_op(lambda t: torch.roll(t, 4), [x], [([st.Replicate()], None)], m, what="flattened replicated")
    return True


def case_roll_flattened_refused(seed):
    m = mesh()
    xs = st.distribute_tensor(randn(3, 6, seed=seed), m, [st.Shard(1)])
    with st.use_strict():  # the rule's refusal, not the gather-compute fallback that runs otherwise
        torch.roll(xs, 2)
    return True


def case_roll_flattened_falls_back(seed):
    m = mesh()
    x = randn(3, 6, seed=seed)
    xs = st.distribute_tensor(x, m, [st.Shard(1)], {0: uneven_extents(6, m.size(), seed)})
    close(full(torch.roll(xs, 2)), torch.roll(x, 2), what="flattened roll through the fallback")
    return True


def case_fftshift(seed):
    m = mesh()
    w = m.size()
    x = randn(8, 7, 3, seed=seed)
    for d in (0, 1):
        lay = ([st.Shard(d)], {0: uneven_extents(x.shape[d], w, seed + d)})
        check_op(lambda t: torch.fft.fftshift(t, dim=(0, 1)), [x], [lay], m, what=f"fftshift Shard({d})")
        check_op(lambda t: torch.fft.ifftshift(t, dim=d), [x], [lay], m, what=f"ifftshift Shard({d})")
        check_op(lambda t: torch.fft.ifftshift(torch.fft.fftshift(t)), [x], [lay], m, what=f"round trip Shard({d})")
    return True


def case_roll_partial(seed):
    """roll is linear: a Partial input stays Partial (no communication), its sum rolled."""
    m = mesh()
    part = st.from_local(randn(6, 4, seed=seed + 10 + rank()), m, [st.Partial()])
    total = full(part)
    with st.CommCounter() as c:
        out = torch.roll(part, (2, -1), (0, 1))
    assert c.calls == {}, f"collectives {c.calls}"
    assert st.placements(out) == (st.Partial(),), f"placements {st.placements(out)}"
    close(full(out), torch.roll(total, (2, -1), (0, 1)), what="Partial roll")
    return True


def case_roll_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(7, 5, 3, seed=seed)
    lay = ([st.Shard(0), st.Shard(1)], {0: uneven_extents(7, 2, seed), 1: uneven_extents(5, 2, seed + 1)})
    for shifts, dims in [((3, -2), (0, 1)), ((1, 1, 2), (0, 1, 2)), ((-9,), (1,)), ((4,), (0,))]:
        out = check_op(lambda t: torch.roll(t, shifts, dims), [x], [lay], m, what=f"2-D roll{shifts}{dims}")
        _same_layout(out, st.distribute_tensor(x, m, *lay), f"2-D roll{shifts}{dims}")
    lay = ([st.Shard(1), st.Replicate()], {0: uneven_extents(5, 2, seed)})
    check_op(lambda t: torch.roll(t, (2, 3), (1, 0)), [x], [lay], m, what="2-D roll, one sharded mesh dim")
    check_op(lambda t: torch.fft.fftshift(t, dim=(0, 1)), [x], [([st.Shard(1), st.Shard(0)], None)], m,
             what="2-D fftshift")
    return True


def case_swin_shift(seed):
    """Swin's shifted windows: roll by -s before attention and by +s after, over two sharded spatial dims."""
    m = mesh()
    w = m.size()
    x = randn(2, 8, 6, 4, seed=seed)  # (B, H, W, C)
    lay = ([st.Shard(1)], {0: uneven_extents(8, w, seed)})
    check_op(lambda t: torch.roll(torch.roll(t, (-2, -2), (1, 2)).tanh(), (2, 2), (1, 2)), [x], [lay], m,
             what="shifted windows")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_roll_sharded_dim(world):
    harness.run(world, case_roll_sharded_dim, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_roll_only_moved_rows_travel(world):
    harness.run(world, case_roll_only_moved_rows_travel, world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_roll_flattened(world):
    harness.run(world, case_roll_flattened, world)


def test_roll_flattened_refused():
    harness.expect_error(2, case_roll_flattened_refused, 0, match="flattened roll", kinds=("NotImplementedError",))
    harness.run(2, case_roll_flattened_falls_back, 0)


@pytest.mark.parametrize("world", [2, 3])
def test_fftshift(world):
    harness.run(world, case_fftshift, world)


@pytest.mark.parametrize("world", [2, 3])
def test_roll_partial(world):
    harness.run(world, case_roll_partial, world)


def test_roll_2d_mesh():
    harness.run(4, case_roll_2d_mesh, 5)


@pytest.mark.parametrize("world", [2, 3])
def test_swin_shift(world):
    harness.run(world, case_swin_shift, world)
