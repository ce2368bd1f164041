"""Selecting one index of a sharded dim keeps the work divided: the selected slice lives on one rank, and a result
of 3 or more dims (a field or a token sequence per sample) is scattered from that rank along the selected dim's
neighbour (the inner one, else the outer one) instead of being replicated to every rank; smaller results (a class
token) stay replicated. Against one device: forward, input and parameter gradients, uneven and zero extents, 1-4
ranks, a 2-D mesh; the result's layout and the collectives are asserted, and writes into the result still reach
the owner's shard (Pangu's surface level `output[:, :, 0]`, FengWu's per-variable decoders `x[:, i]`)."""
import pytest
import torch
import torch.distributed as dist

import harness
import shardtensor as st
from cases_util import check_op, close, mesh, randn


def _pangu_tail(t, w2, w3):
    """Pangu's output split: the surface level through a 2-D patch recovery, the upper levels through a 3-D one."""
    surface = torch.nn.functional.conv_transpose2d(t[:, :, 0], w2, stride=2)
    upper = torch.nn.functional.conv_transpose3d(t[:, :, 1:], w3, stride=(1, 2, 2))
    return surface, upper


def case_levels_select(l_ext, index):
    """(B, C, L, H, W) sharded on the levels L (uneven, zero extents): `x[:, :, i]` lands on H, scattered from the
    owner (one all-to-all of the slice, no broadcast); its gradient flows back to the owner's shard."""
    m = mesh()
    k = m.size()
    L = sum(l_ext)
    x = randn(2, 3, L, 6, 4, seed=11)
    lay = ([st.Shard(2)], {0: l_ext})
    xs = st.distribute_tensor(x, m, *lay)
    with st.CommCounter() as c:
        y = xs[:, :, index]
    close(y.full_tensor(), x[:, :, index], what="select")
    if k > 1:
        assert st.placements(y) == (st.Shard(2),), st.placements(y)
        assert st.sharding_shapes(y) == {0: [len(s) for s in torch.tensor_split(torch.arange(6), k)]}
        assert set(c.calls) == {"all_to_all"} and c.calls["all_to_all"] == 1, c.calls
    check_op(lambda t: t[:, :, index] * 2.0, [x], [lay], m, what="select levels",
             expect_placements=[st.Shard(2)] if k > 1 else None)
    w2, w3 = randn(3, 2, 2, 2, seed=12), randn(3, 2, 1, 2, 2, seed=13)
    if L > 1:
        check_op(_pangu_tail, [x, w2, w3], [lay, None, None], m, what="Pangu tail",
                 expect_placements=[st.Shard(2)] if k > 1 else None)
    # Every level selected and summed: each rank's gradient rows come back from every select.
    check_op(lambda t: sum(u.sin() for u in t.unbind(2)), [x], [lay], m, what="unbind levels",
             expect_placements=[st.Shard(2)] if k > 1 else None)
    return True


@pytest.mark.parametrize("world,l_ext,index", [(1, [5], 0), (2, [1, 4], 0), (2, [3, 2], -1), (3, [0, 3, 2], 4),
                                               (4, [2, 0, 2, 1], 2)])
def test_levels_select_stays_divided(world, l_ext, index):
    harness.run(world, case_levels_select, l_ext, index)


def _fengwu_decoders(V):
    """FengWu: the fused tokens split back into variables, each through its own projection."""
    def fn(t, w, b):
        return tuple(torch.nn.functional.linear(t[:, i], w[i], b[i]) for i in range(V))
    return fn


def case_variables_select(v_ext):
    """(B, V, N, C) sharded on the variables V: each `x[:, i]` is a (B, N, C) token sequence that lands on N, so
    every per-variable projection runs divided (a Shard, never Partial or Replicate)."""
    m = mesh()
    k = m.size()
    V, N, C = sum(v_ext), 8, 4
    x = randn(2, V, N, C, seed=21)
    w, b = randn(V, 5, C, seed=22), randn(V, 5, seed=23)
    lay = ([st.Shard(1)], {0: v_ext})
    outs = check_op(_fengwu_decoders(V), [x, w, b], [lay, None, None], m, what="FengWu decoders")
    if k > 1:
        for o in outs:
            assert st.placements(o) == (st.Shard(1),), st.placements(o)
    return True


@pytest.mark.parametrize("world,v_ext", [(2, [3, 3]), (3, [0, 4, 2]), (4, [2, 1, 0, 3])])
def test_variables_select_stays_divided(world, v_ext):
    harness.run(world, case_variables_select, v_ext)


def case_small_results_replicate():
    """A result of 1 or 2 dims (a class token `x[:, 0]` of (B, N, C)) stays replicated, as does one whose
    neighbours of the selected dim have fewer rows than ranks or whose outer neighbour is the channel dim 1."""
    m = mesh()
    k = m.size()
    x = randn(2, 7, 4, seed=31)
    lay = ([st.Shard(1)], {0: [1] + [6 // (k - 1) + (1 if i < 6 % (k - 1) else 0) for i in range(k - 1)]})
    check_op(lambda t: t[:, 0], [x], [lay], m, what="cls token", expect_placements=[st.Replicate()])
    y = randn(2, 3, 3, 5, 1, seed=32)   # (B, C, D, L, 1): the inner neighbour has 1 row, the outer one (D) 3
    lay_y = ([st.Shard(3)], None)
    check_op(lambda t: t[:, :, :, 1], [y], [lay_y], m, what="outer neighbour",
             expect_placements=[st.Shard(2)] if k <= 3 else [st.Replicate()])
    # The outer neighbour at dim 1 (the channels of (B, C, L, 1)) does not take it.
    check_op(lambda t: t[:, :, 1], [y[:, :, 0]], [([st.Shard(2)], None)], m, what="outer neighbour is C",
             expect_placements=[st.Replicate()])
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_small_results_replicate(world):
    harness.run(world, case_small_results_replicate)


def case_select_2d_mesh():
    """2-D mesh: levels on mesh dim 0, W on mesh dim 1. `x[:, :, i]` lands on H (free); with H taken by mesh dim 1
    and the outer neighbour the channels, it is replicated along mesh dim 0 (H stays sharded by mesh dim 1)."""
    m = mesh((2, 2))
    x = randn(2, 3, 5, 6, 4, seed=41)
    w2 = randn(3, 2, 2, 2, seed=42)
    lay = ([st.Shard(2), st.Shard(4)], {0: [4, 1], 1: [3, 1]})
    check_op(lambda t, w: torch.nn.functional.conv_transpose2d(t[:, :, 4], w, stride=2), [x, w2], [lay, None], m,
             what="2-D mesh, H free", expect_placements=[st.Shard(2), st.Shard(3)])
    check_op(lambda t: t[:, :, 0], [x], [lay], m, what="2-D mesh select", expect_placements=[st.Shard(2), st.Shard(3)])
    lay_h = ([st.Shard(2), st.Shard(3)], {0: [0, 5], 1: [5, 1]})
    check_op(lambda t: t[:, :, 3].cos(), [x], [lay_h], m, what="2-D mesh, H taken",
             expect_placements=[st.Replicate(), st.Shard(2)])
    return True


def test_select_2d_mesh():
    harness.run(4, case_select_2d_mesh)


def _check_write(name, fn, x0, m, lay):
    ref = x0.clone()
    fn(ref)
    xs = st.distribute_tensor(x0.clone(), m, *lay)
    fn(xs)
    close(xs.full_tensor(), ref, what=name)
    offs = st.local_offsets(xs)
    local = st.to_local(xs)
    idx = tuple(slice(o, o + n) for o, n in zip(offs, local.shape))
    ok = torch.equal(local, ref[idx])
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    assert all(flags), f"{name}: local shards differ from one device on ranks {[r for r, f in enumerate(flags) if not f]}"


def case_scattered_writes(l_ext):
    """Writes into a scattered select result (or a view of it) reach the owner's shard, as on one device."""
    m = mesh()
    L = sum(l_ext)
    x0 = randn(2, 3, L, 6, seed=51)
    lay = ([st.Shard(2)], {0: l_ext})
    for name, fn in [("x[:, :, i] = v", lambda t: t.__setitem__((slice(None), slice(None), 1), 7.0)),
                     ("x[:, :, i] = tensor", lambda t: t.__setitem__((slice(None), slice(None), -1),
                                                                     torch.arange(36.0).view(2, 3, 6))),
                     ("x[:, :, i].mul_", lambda t: t[:, :, 0].mul_(3.0)),
                     ("x[:, :, i][:, 1:].fill_", lambda t: t[:, :, 2][:, 1:].fill_(-2.0)),
                     ("unbind(2)[i].add_", lambda t: t.unbind(2)[L - 2].add_(1.0))]:
        _check_write(name, fn, x0, m, lay)
    return True


@pytest.mark.parametrize("world,l_ext", [(2, [1, 3]), (3, [2, 0, 2])])
def test_scattered_writes_reach_owner(world, l_ext):
    harness.run(world, case_scattered_writes, l_ext)


def case_chained_scattered_write_refused():
    """A select along a sharded dim of a scattered select result is a copy of a copy: a write into it raises on
    every rank (reading it is right)."""
    m = mesh((2, 2))
    x0 = randn(2, 3, 4, 6, 5, seed=61)
    xs = st.distribute_tensor(x0, m, [st.Shard(2), st.Shard(4)], {0: [2, 2], 1: [3, 2]})
    inner = xs[:, :, 1]            # (2, 3, 6, 5): levels scattered onto dim 2, W on mesh dim 1
    chained = inner[:, :, :, 4]    # a select along W, sharded on mesh dim 1
    close(chained.full_tensor(), x0[:, :, 1, :, 4], what="chained read")
    with pytest.raises(NotImplementedError, match="copy of a copy"):
        chained.fill_(1.0)
    return True


def test_chained_scattered_write_refused():
    harness.run(4, case_chained_scattered_write_refused)
