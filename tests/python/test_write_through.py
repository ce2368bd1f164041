"""Writes through indexing: `x[i] = v`, `x[i].fill_()`, `x.unbind(0)[i].add_()` along a sharded dim reach the
owner's shard (select returns a replicated copy that is written back), and in-place ops on views of a Partial
tensor keep the pending sum's buffer, against the single-device result."""
import pytest
import torch
import torch.distributed as dist

import harness
import shardtensor as st
from cases_util import close, mesh, randn, uneven_extents

FORMS = [
    ("x[i] = v", lambda t: t.__setitem__(1, 7.0)),
    ("x[-1] = tensor", lambda t: t.__setitem__(-1, torch.arange(4.0))),
    ("x[i].fill_", lambda t: t[3].fill_(2.0)),
    ("unbind(0)[i].add_", lambda t: t.unbind(0)[4].add_(1.0)),
    ("x[i, j] = v", lambda t: t.__setitem__((2, 1), 9.0)),
    ("x[i][j:k].mul_", lambda t: t[0][1:3].mul_(3.0)),
    ("x[i] += v", lambda t: t[5].__iadd__(torch.ones(4))),
    ("x[i].copy_ twice", lambda t: (t[1].copy_(torch.full((4,), 5.0)), t[1].zero_())),
    ("out= into x[i]", lambda t: torch.add(torch.ones(4), 2.0, out=t[2])),
]


def _check_form(name, fn, x0, m, placements, ext):
    ref = x0.clone()
    fn(ref)
    xs = st.distribute_tensor(x0.clone(), m, placements, ext)
    before = st.to_local(xs).clone()
    fn(xs)
    close(xs.full_tensor(), ref, what=name)
    # Only the owner's shard changed, and only where one device changed. Checked on every rank together, so a
    # failure on one rank cannot leave the others waiting in the next case's collectives.
    offs = st.local_offsets(xs)
    local = st.to_local(xs)
    idx = tuple(slice(o, o + n) for o, n in zip(offs, local.shape))
    ok = torch.equal(local, ref[idx]) and torch.equal(local != before, ref[idx] != x0[idx])
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    assert all(flags), f"{name}: local shards differ from one device on ranks {[r for r, f in enumerate(flags) if not f]}"


def case_select_writes(seed):
    m = mesh()
    w = m.size()
    x0 = randn(6, 4, seed=seed)
    for name, fn in FORMS:
        _check_form(name, fn, x0, m, [st.Shard(0)], {0: uneven_extents(6, w, seed)})
    # The sharded dim at 1: x[:, i] = v and friends.
    x1 = randn(3, 6, seed=seed + 1)
    for name, fn in [("x[:, i] = v", lambda t: t.__setitem__((slice(None), 4), -1.0)),
                     ("x[:, i].mul_", lambda t: t[:, 2].mul_(0.5)),
                     ("x.unbind(1)[i].sub_", lambda t: t.unbind(1)[0].sub_(3.0)),
                     ("x[1:, i] = v", lambda t: t.__setitem__((slice(1, None), 5), 4.0))]:
        _check_form(name, fn, x1, m, [st.Shard(1)], {0: uneven_extents(6, w, seed + 2)})
    return True


def _corner_writes(t, rows):
    # HEALPix padding's corner patches: x[..., i, j] = v with i along the sharded dim (its copy is scattered along
    # j's dim, so j then selects along a split dim of a copy: taken from the base instead)
    t[..., 0, -1] = 5.0
    t[..., -1, 2] = torch.arange(6.0).reshape(2, 3)
    t[..., 1, 0] += 1.0
    row = t[..., rows - 2, :]        # a scattered copy that stays alive: a write through it, then through its
    row[..., 3] = 7.0                # element, shows in both, as views would on one device
    assert torch.equal(row[..., 3].full_tensor() if st.is_shard_tensor(row) else row[..., 3], torch.full((2, 3), 7.0))
    row.mul_(2.0)


def case_select_of_scattered_copy(seed):
    m = mesh()
    x0 = randn(2, 3, 9, 6, seed=seed)
    _check_form("x[..., i, j] writes", lambda t: _corner_writes(t, 9), x0, m, [st.Shard(2)],
                {0: uneven_extents(9, m.size(), seed)})
    xs = st.distribute_tensor(x0, m, [st.Shard(2)], {0: uneven_extents(9, m.size(), seed)})
    close(xs[..., 4, :][..., 1].full_tensor(), x0[..., 4, 1], what="read x[..., i, :][..., j]")
    xg = xs.clone().detach().requires_grad_()
    (xg[..., 2, :][..., 4] * 3).sum().backward()
    ref = torch.zeros_like(x0)
    ref[..., 2, 4] = 3.0
    close(xg.grad.full_tensor(), ref, what="gradient of x[..., i, :][..., j]")
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_select_of_scattered_copy(world):
    """x[..., i, j] = v with i along the sharded dim: the copy of x[..., i, :] is scattered along j's dim, and
    selecting j in it used to refuse writes ('a copy of a copy'; HEALPix padding on 2 ranks)."""
    harness.run(world, case_select_of_scattered_copy, world)


def case_select_writes_2d():
    m = mesh((2, 2), ("a", "b"))
    x0 = randn(5, 6, 3, seed=3)
    lay = [st.Shard(0), st.Shard(1)]
    ext = {0: [3, 2], 1: [1, 5]}
    for name, fn in FORMS[:4] + [
            ("x[i, j] = v, both sharded", lambda t: t.__setitem__((3, 4), 8.0)),
            ("x[i][j].fill_, both sharded", lambda t: t[1][0].fill_(6.0)),
            ("x[:, j].add_", lambda t: t[:, 2].add_(10.0))]:
        if name == "x[-1] = tensor":
            fn = lambda t: t.__setitem__(-1, torch.arange(18.0).view(6, 3))  # noqa: E731
        _check_form(name, fn, x0, m, lay, ext)
    # Replicated along one mesh dim, sharded along the other.
    _check_form("x[i] = v on [R, S(0)]", lambda t: t.__setitem__(4, 1.5), x0, m, [st.Replicate(), st.Shard(0)],
                {1: [0, 5]})
    return True


def case_partial_view_writes():
    m = mesh()
    x0 = randn(7, 3, seed=5)
    for name, fn in [("p[i] = v", lambda t: t.__setitem__(1, 7.0)),
                     ("p[i:j].relu_", lambda t: t[0:2].relu_()),
                     ("p.clamp_", lambda t: t.clamp_(-0.5, 0.5))]:
        ref = x0.sum(0)
        fn(ref)
        p = st.distribute_tensor(x0, m, [st.Shard(0)], {0: uneven_extents(7, m.size(), 1)}).sum(0)
        assert st.placements(p) == (st.Partial("sum"),)
        fn(p)
        close(p.full_tensor(), ref, what=name)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_select_writes_through(world):
    harness.run(world, case_select_writes, world)


def test_select_writes_through_2d():
    harness.run(4, case_select_writes_2d)


@pytest.mark.parametrize("world", [2, 3])
def test_partial_view_writes(world):
    harness.run(world, case_partial_view_writes)



def case_indexing_after_torch_collectives(iters):
    """x[i] on a sharded dim is a collective reached from Python's indexing, which holds the GIL; Gloo's run loop may
    at the same moment free a Python-owned tensor of an earlier collective (which needs the GIL) while holding its
    queue lock. The library issues and waits without the GIL, so this must not deadlock."""
    m = mesh()
    x = st.distribute_tensor(torch.arange(12.0).view(6, 2), m, [st.Shard(0)])
    for i in range(iters):
        dist.all_reduce(torch.ones(4))          # a temporary the run loop may free last
        row = x[i % 6]
        y = st.to_local(x).clone()              # the local now carries a Python object too
        assert y.shape[1] == 2
        x[(i + 1) % 6] = row + 1
        x.full_tensor()
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_indexing_after_torch_collectives(world):
    harness.run(world, case_indexing_after_torch_collectives, 300)
