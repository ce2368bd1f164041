"""Shape ops against single-device results: views that keep clean shards, views that re-lay a shard out first
(merged under an outer dim, split with boundaries inside rows; test_windows.py has the window partitions), global
slicing/selecting along sharded dims, split/chunk/cat/stack, repeat, expand, and clear errors."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, uneven_extents


def case_views(seed):
    m = mesh()
    w = m.size()
    x = randn(6, 4, 5, seed=seed)
    s0 = ([st.Shard(0)], {0: uneven_extents(6, w, seed)})
    s1 = ([st.Shard(1)], {0: uneven_extents(4, w, seed + 1)})
    cases = [
        ("flatten outer sharded", lambda t: t.flatten(0, 1), s0),
        ("flatten inner unsharded", lambda t: t.flatten(1, 2), s0),
        ("reshape keep", lambda t: t.reshape(6, 20), s0),
        ("view split last", lambda t: t.view(6, 4, 5, 1), s0),
        ("unflatten unsharded", lambda t: t.unflatten(1, (2, 2)), s0),
        ("permute", lambda t: t.permute(2, 0, 1), s0),
        ("transpose", lambda t: t.transpose(0, 2), s1),
        ("t of 2-d", lambda t: t[:, 0].t(), s0),
        ("unsqueeze", lambda t: t.unsqueeze(1), s0),
        ("squeeze unsharded", lambda t: t.unsqueeze(-1).squeeze(-1), s0),
        ("expand", lambda t: t.unsqueeze(1).expand(6, 3, 4, 5), s0),
        ("contiguous after permute", lambda t: t.permute(1, 0, 2).contiguous(), s0),
        ("slice sharded", lambda t: t[1:5], s0),
        ("slice sharded step", lambda t: t[::2], s0),
        ("slice negative", lambda t: t[-4:-1], s0),
        ("slice unsharded", lambda t: t[:, 1:3], s0),
        ("narrow sharded", lambda t: t.narrow(0, 2, 3), s0),
        ("select unsharded", lambda t: t[:, 2], s0),
        ("select sharded", lambda t: t[3], s0),
        ("index last", lambda t: t[..., -1], s1),
        ("split sharded", lambda t: t.split(2, 0), s0),
        ("chunk unsharded", lambda t: t.chunk(2, 2), s0),
        ("unbind", lambda t: t.unbind(1), s0),
        ("cat unsharded", lambda t: torch.cat([t, t * 2], 2), s0),
        ("cat sharded", lambda t: torch.cat([t, t + 1], 0), s0),
        ("stack", lambda t: torch.stack([t, -t], 1), s0),
        ("repeat unsharded", lambda t: t.repeat(1, 2, 1), s0),
        ("repeat sharded", lambda t: t.repeat(2, 1, 1), s0),
        ("repeat sharded, new leading dims", lambda t: t.repeat(2, 3, 1, 2), s0),
        ("flatten inner sharded", lambda t: t.flatten(0, 1), s1),
        ("reshape inner sharded", lambda t: t.reshape(-1), s1),
        ("split rows across shard boundaries", lambda t: t.reshape(24, 5).view(3, 8, 5), s0),
        ("unflatten sharded unaligned", lambda t: t.unflatten(0, (2, 3)), s0),
    ]
    for name, fn, lay in cases:
        check_op(fn, [x], [lay], m, what=name)
    return True


def case_view_2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(5, 6, 4, seed=seed)
    lay = ([st.Shard(0), st.Shard(2)], {0: uneven_extents(5, 2, seed), 1: uneven_extents(4, 2, seed + 1)})
    for name, fn in [("permute", lambda t: t.permute(1, 2, 0)), ("slice", lambda t: t[1:4, :, 1:]),
                     ("flatten middle", lambda t: t.flatten(1, 2) if False else t.transpose(0, 1)),
                     ("select unsharded", lambda t: t[:, 3]),
                     ("flatten inner sharded", lambda t: t.flatten(1, 2)),
                     ("flatten both sharded", lambda t: t.reshape(-1))]:
        check_op(fn, [x], [lay], m, what=f"2-D {name}")
    return True


def case_inner_merge():
    """A sharded inner dim merged under an outer dim of size > 1 moves its shard to the outer dim (one
    all-to-all, default split of the outer dim in whole rows), not a refusal."""
    m = mesh()
    k = m.size()
    x = randn(3, 6, seed=2)
    lay = ([st.Shard(1)], {0: uneven_extents(6, k, 3)})
    xs = st.distribute_tensor(x, m, *lay)
    with st.CommCounter() as c:
        out = xs.reshape(18)
    assert c.calls == ({"all_to_all": 1} if k > 1 else {}), c.calls
    assert st.placements(out) == (st.Shard(0),), st.placements(out)
    rows = [3 // k + (1 if i < 3 % k else 0) for i in range(k)]
    assert st.sharding_shapes(out) == {0: [6 * r for r in rows]}, st.sharding_shapes(out)
    check_op(lambda t: t.reshape(18), [x], [lay], m, what="inner merge")
    return True


def case_repeat_sharded(seed):
    """Repeating a sharded dim: each rank holds a default-split block of the repeated rows and receives only the rows
    it reads (one neighbour exchange, no gather of the dim); a 2-D mesh repeats both dims."""
    m = mesh()
    w = m.size()
    x = randn(5, 3, seed=seed)
    lay = ([st.Shard(0)], {0: uneven_extents(5, w, seed)})
    with st.use_strict():
        xs = st.distribute_tensor(x, m, *lay)
        before = st.comm_stats()["calls"]
        out = xs.repeat(3, 2)
        after = st.comm_stats()["calls"]
        kinds = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        if w > 1:
            assert set(kinds) == {"halo"} and kinds["halo"] == 1, kinds
        assert st.placements(out) == (st.Shard(0),), st.placements(out)
        assert out.to_local().shape[0] == [15 // w + (1 if i < 15 % w else 0) for i in range(w)][m.get_coordinate()[0]]
        close(full(out), x.repeat(3, 2), what="repeat of the sharded dim")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_views(world):
    harness.run(world, case_views, world)


def test_view_2d():
    harness.run(4, case_view_2d, 2)


def case_merge_two_splits_onto_batch(seed):
    """A merge of two split dims on a 2x2 mesh (a ViT's patch flatten `(B, C, H, W) -> (B, C, H*W)`, an FNO channel
    MLP's `reshape(B, C, -1)`): the outer split stays on the merged dim and the inner one moves onto the batch when it
    holds a row per rank -- the work stays divided over both mesh dims, no replication (strict mode) -- and the way
    back (`unflatten`) and the gradients equal one device; a batch of one cannot take it: the inner split is gathered,
    as before."""
    m = mesh((2, 2))
    lay = ([st.Shard(2), st.Shard(3)], {0: [3, 4], 1: [2, 4]})
    x = randn(2, 3, 7, 6, seed=seed)
    with st.use_strict():
        out = check_op(lambda t: t.flatten(2), [x], [lay], m, what="flatten(2) of H x W")
        assert st.placements(out) == (st.Shard(2), st.Shard(0)), st.placements(out)
        check_op(lambda t: t.flatten(2).transpose(1, 2).relu().transpose(1, 2).unflatten(2, (7, 6)), [x], [lay], m,
                 what="flatten, tokens, unflatten")
        check_op(lambda t: t.reshape(2, 3, -1) * 2, [x], [lay], m, what="reshape(B, C, -1)")
    one = randn(1, 3, 7, 6, seed=seed + 1)
    out = check_op(lambda t: t.flatten(2), [one], [lay], m, what="batch of one: gathered")
    assert st.placements(out) == (st.Shard(2), st.Replicate()), st.placements(out)
    return True


def test_merge_two_splits_onto_batch():
    harness.run(4, case_merge_two_splits_onto_batch, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_inner_merge(world):
    harness.run(world, case_inner_merge)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_repeat_sharded(world):
    harness.run(world, case_repeat_sharded, world)


def case_expand_partial():
    """Broadcasting a pending sum completes it first: one all-reduce of the small tensor, then a replicated
    expand that meets sharded operands locally (no all-to-all of the broadcast size)."""
    m = mesh()
    w = m.size()
    x = randn(2, 9, 3, seed=4)
    xs = st.distribute_tensor(x, m, [st.Shard(1)], {0: uneven_extents(9, w, 2)})
    total = xs.sum(1, keepdim=True)
    assert st.placements(total) == (st.Partial("sum"),)
    with st.CommCounter() as c:
        y = total.expand(2, 9, 3) * xs
    close(full(y), x.sum(1, keepdim=True).expand(2, 9, 3) * x, rtol=1e-5, atol=1e-6, what="expand of a pending sum")
    assert st.placements(y) == (st.Shard(1),), st.placements(y)
    assert dict(c.calls) == {"all_reduce": 1} and c.bytes["all_reduce"] == 2 * 3 * 4, (dict(c.calls), dict(c.bytes))
    return True


def test_expand_partial():
    harness.run(3, case_expand_partial)


def case_cat_joins(seed):
    """A whole tensor joining a sharded dim (a ViT/DeiT class or distillation token, a constant row) keeps the result
    sharded with no communication, in grad mode too (the token is a plain tensor that requires grad, promoted to a
    Replicate ShardTensor): pieces before the sharded input join the first rank, pieces after it the last."""
    m = mesh()
    w = m.size()
    x = randn(2, 7, 4, seed=seed)
    cls, dist_tok = randn(1, 1, 4, seed=seed + 1), randn(1, 1, 4, seed=seed + 2)
    ext = uneven_extents(7, w, seed)
    lay = ([st.Shard(1)], {0: ext})
    fns = {
        "cls": (lambda t, c, d: torch.cat([c.expand(2, -1, -1), t], 1), 1, 0),
        "cls + distillation": (lambda t, c, d: torch.cat([c.expand(2, -1, -1), d.expand(2, -1, -1), t], 1), 2, 0),
        "append": (lambda t, c, d: torch.cat([t, c.expand(2, -1, -1)], 1), 0, 1),
        "both sides": (lambda t, c, d: torch.cat([c.expand(2, -1, -1), t, d.expand(2, -1, -1)], dim=-2), 1, 1),
    }
    for name, (fn, before, after) in fns.items():
        for grad in (True, False):
            out = check_op(fn, [x, cls, dist_tok], [lay, None, None], m, grad=grad, what=f"cat {name} grad={grad}",
                           expect_placements=[st.Shard(1)])
            want = list(ext)
            want[0] += before
            want[-1] += after
            assert list(st.sharding_shapes(out)[0]) == want, f"cat {name}: extents {st.sharding_shapes(out)}, expected {want}"
        xs = st.distribute_tensor(x, m, lay[0], lay[1])
        with st.CommCounter() as c:
            fn(xs, cls.clone().requires_grad_(), dist_tok)
        assert c.total_calls == 0, f"cat {name} communicated: {dict(c.calls)}"
    # Two sharded inputs along the sharded dim whose rows interleave across ranks gather and re-split (correct).
    check_op(lambda t, c, d: torch.cat([t, t * 2], 1), [x, cls, dist_tok], [lay, None, None], m, what="cat two sharded",
             expect_placements=[st.Shard(1)])
    # A slice put back (CoaT's class token split off the sharded tokens, the rest convolved, then joined): the
    # pieces follow each other in coordinate order, so each rank joins its own, with no communication.
    for k in (1, 3):
        def put_back(t, c, d, k=k):
            return torch.cat([t[:, :k], c.expand(2, -1, -1), t[:, k:] * 2], 1)

        out = check_op(put_back, [x, cls, dist_tok], [lay, None, None], m, what=f"cat slices put back ({k})",
                       expect_placements=[st.Shard(1)])
        assert sum(st.sharding_shapes(out)[0]) == 8
        xs = st.distribute_tensor(x, m, lay[0], lay[1])
        pieces = [xs[:, :k], cls.expand(2, -1, -1), xs[:, k:] * 2]
        with st.CommCounter() as c:
            torch.cat(pieces, 1)
        assert c.total_calls == 0, f"cat of slices communicated: {dict(c.calls)}"
    return True


def case_cat_joins_2d():
    """2-D mesh: tokens on mesh dim 0, batch on mesh dim 1; the class token joins the token dim's first rank and is
    sliced along the batch shards."""
    m = mesh((2, 2))
    x = randn(3, 6, 4, seed=5)
    cls = randn(1, 1, 4, seed=6)
    lay = ([st.Shard(1), st.Shard(0)], {0: [4, 2], 1: [1, 2]})
    check_op(lambda t, c: torch.cat([c.expand(3, -1, -1), t], 1), [x, cls], [lay, None], m, what="cat 2-D",
             expect_placements=[st.Shard(1), st.Shard(0)])
    # Inputs split on different mesh dims along different dims (a meshgrid of latitudes split on mesh dim 0 and
    # longitudes on mesh dim 1, stacked): the result takes both splits, every input sliced locally -- no gather.
    lat, lon = randn(5, seed=7), randn(6, seed=8)
    lays = [([st.Shard(0), st.Replicate()], {0: [4, 1]}), ([st.Replicate(), st.Shard(0)], {1: [2, 4]})]
    grid = lambda a, b: torch.stack(torch.meshgrid(a, b, indexing="xy"), 0)  # noqa: E731
    check_op(grid, [lat, lon], lays, m, what="stacked meshgrid 2-D",
             expect_placements=[st.Shard(2), st.Shard(1)])
    a, b = (st.distribute_tensor(t, m, pl, sharding_shapes=e) for t, (pl, e) in zip((lat, lon), lays))
    with st.CommCounter() as c:
        out = grid(a, b)
    assert not c.calls, c.calls
    assert st.sharding_shapes(out) == {0: [4, 1], 1: [2, 4]}, st.sharding_shapes(out)
    return True


def case_cat_pending_joiner():
    """A pending sum joining a sharded dim (torchdiffeq's adjoint flattens its state tuple: a time derivative left
    pending beside the split field) completes on every rank -- it is a collective of the whole mesh dim -- though only
    the edge rank keeps it; completed by the edge rank alone, the ranks issued different collectives. Both the join
    onto a sharded input and the join among several split inputs in coordinate order, with empty shards."""
    m = mesh()
    w, r = m.size(), torch.distributed.get_rank()
    want_sum = float(sum(range(1, w + 1)))
    ext = [6] + [0] * (w - 1)
    a = st.distribute_tensor(torch.arange(6.0), m, [st.Shard(0)], sharding_shapes={0: ext})
    for name, pieces, expect in [
            ("one split input", lambda p: [p, a, torch.ones(2)], [want_sum] + list(range(6)) + [1.0, 1.0]),
            ("split inputs in order", lambda p: [p, a, a * 2, torch.ones(2)],
             [want_sum] + list(range(6)) + [2.0 * i for i in range(6)] + [1.0, 1.0])]:
        pending = st.from_local(torch.full((1,), float(r + 1)), m, [st.Partial("sum")], global_shape=[1])
        out = torch.cat(pieces(pending))
        close(full(out), torch.tensor(expect), what=f"cat with a pending joiner, {name}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_cat_pending_joiner(world):
    harness.run(world, case_cat_pending_joiner)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cat_joins_stay_sharded(world):
    harness.run(world, case_cat_joins, world)


def test_cat_joins_2d():
    harness.run(4, case_cat_joins_2d)


def _hiera_pool(q):
    """timm Hiera's unrolled pooling (the tokens of a pooling window are q apart), then a projection."""
    def fn(t, w, b):
        B, N, C = t.shape
        pooled = t.view(B, q, N // q, C).amax(1)
        return torch.nn.functional.linear(pooled, w, b), pooled.view(B, 2, N // q // 2, C).max(dim=1).values
    return fn


def case_split_small_outer(seed, n_ext):
    """A split whose outer factor is small (q * q < N // q) puts the shard on the inner dim, so the reduction over
    q that follows is local and its result stays sharded: one all-to-all, no all-reduce or all-gather, no Partial."""
    m = mesh()
    k = m.size()
    q, N, C = 4, sum(n_ext), 3
    x = randn(2, N, C, seed=seed)
    w, b = randn(5, C, seed=seed + 1), randn(5, seed=seed + 2)
    lay = ([st.Shard(1)], {0: n_ext})
    xs = st.distribute_tensor(x, m, *lay)
    with st.CommCounter() as c:
        pooled = xs.view(2, q, N // q, C).amax(1)
    assert set(c.calls) <= {"all_to_all"}, c.calls
    assert c.calls.get("all_to_all", 0) <= (2 if k > 1 else 0), c.calls
    if k > 1:   # (a one-rank mesh keeps the shard on q: nothing to divide)
        assert st.placements(pooled) == (st.Shard(1),), st.placements(pooled)
        assert st.sharding_shapes(pooled) == {0: [len(s) for s in torch.tensor_split(torch.arange(N // q), k)]}
    check_op(_hiera_pool(q), [x, w, b], [lay, None, None], m, what="Hiera pool",
             expect_placements=[st.Shard(1)] if k > 1 else None)
    return True


def case_split_small_outer_2d():
    """2-D mesh: batch on mesh dim 0, tokens on mesh dim 1: the token shard moves to the inner dim, the batch
    shard stays."""
    m = mesh((2, 2))
    q, N, C = 4, 96, 3
    x = randn(3, N, C, seed=3)
    w, b = randn(5, C, seed=4), randn(5, seed=5)
    lay = ([st.Shard(0), st.Shard(1)], {0: [2, 1], 1: [0, 96]})
    check_op(_hiera_pool(q), [x, w, b], [lay, None, None], m, what="Hiera pool 2-D",
             expect_placements=[st.Shard(0), st.Shard(1)])
    return True


@pytest.mark.parametrize("world,n_ext", [(1, [96]), (2, [48, 48]), (2, [23, 73]), (3, [0, 40, 56]),
                                         (4, [24, 24, 24, 24]), (4, [10, 0, 62, 24])])
def test_split_small_outer_stays_divided(world, n_ext):
    harness.run(world, case_split_small_outer, 7, n_ext)


def test_split_small_outer_2d():
    harness.run(4, case_split_small_outer_2d)


def _fengwu_fuse(V, H, W):
    """FengWu: the variables' token sequences folded into one sequence, a projection, and the fuser's 3-D view."""
    def fn(t, w, b):
        B, _, HW, C = t.shape
        seq = torch.nn.functional.linear(t.reshape(B, V * HW, C), w, b)
        grid = seq.view(B, V, H, W, -1)
        return seq, torch.nn.functional.linear(grid, w[:, :w.shape[0]], b)
    return fn


def case_fengwu_fold(hw_ext):
    """(B, V, H*W, C) sharded on the tokens: the fold into (B, V*H*W, C) keeps a Shard of the merged dim (whole
    variable blocks), so the projection after it is a Shard, never Partial; the fuser's view (B, V, H, W, C) then
    puts the shard on H (a small outer factor V: V * V < H * W), where the projection stays a Shard too."""
    m = mesh()
    k = m.size()
    V, H, W, C = 3, 4, 5, 4
    x = randn(2, V, H * W, C, seed=17)
    w, b = randn(C, C, seed=18), randn(C, seed=19)
    lay = ([st.Shard(2)], {0: hw_ext})
    out = check_op(_fengwu_fuse(V, H, W), [x, w, b], [lay, None, None], m, what="FengWu fold")
    seq, grid = out
    assert st.placements(seq) == (st.Shard(1),), st.placements(seq)
    assert not any(p.is_partial() for p in st.placements(seq) + st.placements(grid))
    if k > 1:
        assert st.placements(grid) == (st.Shard(2),), st.placements(grid)
    return True


@pytest.mark.parametrize("world,hw_ext", [(2, [8, 12]), (3, [0, 13, 7]), (4, [5, 5, 5, 5])])
def test_fengwu_fold_stays_sharded(world, hw_ext):
    harness.run(world, case_fengwu_fold, hw_ext)
