"""Indexing by tensors (index_select, gather, scatter*, index, index_put, index_add/index_copy/index_reduce), against the single-device computation:
forward, input gradients, uneven and zero-extent shards, 1-4 ranks, a 2-D mesh; along sharded dims the cheap
rules (owner picks + one all-reduce) and the refusals (on every rank, no hang)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import LargestPlain, check_op, close, full, mesh, randn, tiny_extents, uneven_extents


def _lay(shape, dim, w, seed, tiny=False):
    return ([st.Shard(dim)], {0: tiny_extents(shape[dim], w) if tiny else uneven_extents(shape[dim], w, seed)})


def _index(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (k,), generator=g)


def case_index_select(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(5, 7, 3, seed=seed)
    idx = _index(7, 9, seed)  # duplicates included
    # Unsharded dim: local, layout kept.
    lay0 = _lay(x.shape, 0, w, seed, tiny)
    check_op(lambda t: t.index_select(1, idx), [x], [lay0], m, what="index_select unsharded dim",
             expect_placements=[st.Shard(0)])
    check_op(lambda t: t.index_select(2, idx % 3), [x], [lay0], m, what="index_select last dim")
    # Sharded dim with a whole index: a routed read, the result split along the dim (default split of the index).
    lay1 = _lay(x.shape, 1, w, seed, tiny)
    out = check_op(lambda t: t.index_select(1, idx), [x], [lay1], m, what="index_select sharded dim",
                   expect_placements=[st.Shard(1)])
    assert st.sharding_shapes(out) == {0: [len(c) for c in torch.arange(9).tensor_split(w)]}
    # Fewer entries than ranks: owners pick, the result is Replicate there.
    check_op(lambda t: t.index_select(1, idx[: w - 1]), [x], [lay1], m, what="index_select few entries",
             expect_placements=[st.Replicate()] if w > 1 else None)
    check_op(lambda t: torch.index_select(t, 1, idx[:0]), [x], [lay1], m, what="index_select empty index")
    # A replicated table with a sharded index: the output is sharded like the index.
    xs = randn(6, 4, seed=seed)
    ilay = ([st.Shard(0)], {0: uneven_extents(9, w, seed + 1)})
    out = check_op(lambda t, i: t.index_select(0, i), [xs, idx % 6], [[st.Replicate()], ilay], m,
                   what="index_select sharded index", expect_placements=[st.Shard(0)])
    assert st.sharding_shapes(out) == {0: ilay[1][0]}
    # Integer and bool payloads travel through the owner picks.
    xi = (x * 10).to(torch.int64)
    check_op(lambda t: t.index_select(1, idx), [xi], [lay1], m, grad=False, what="index_select int sharded dim")
    check_op(lambda t: t.index_select(1, idx), [x > 0], [lay1], m, grad=False, what="index_select bool sharded dim")
    return True


def case_gather(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(5, 7, 3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, 7, (5, 4, 3), generator=g)
    lay0 = _lay(x.shape, 0, w, seed, tiny)
    check_op(lambda t: t.gather(1, index), [x], [lay0], m, what="gather plain index", expect_placements=[st.Shard(0)])
    check_op(lambda t, i: torch.gather(t, 1, i), [x, index], [lay0, lay0], m, what="gather sharded index")
    # Gather along the sharded dim with a whole index: a routed read, the output split along the dim.
    index0 = torch.randint(0, 5, (3, 7, 3), generator=g)
    lay1 = _lay(x.shape, 1, w, seed, tiny)
    check_op(lambda t: t.gather(0, index0), [x], [_lay(x.shape, 0, w, seed, tiny)], m, what="gather sharded dim",
             expect_placements=[st.Shard(0)] if w <= 3 else [st.Replicate()])
    check_op(lambda t, i: t.gather(0, i), [x, index0], [lay1, lay1], m, what="gather sharded dim 1, index alike")
    # sort + gather: the usual pairing (indices from a local op).
    check_op(lambda t: t.gather(1, t.argsort(1)), [x], [lay0], m, what="gather argsort")
    return True


def case_scatter(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(5, 7, 3, seed=seed)
    src = randn(5, 4, 3, seed=seed + 1)
    # Unique targets per (row, column) so overwriting scatters are deterministic.
    index = torch.stack([torch.randperm(7, generator=torch.Generator().manual_seed(seed + r))[:4]
                         for r in range(15)]).view(5, 3, 4).transpose(1, 2).contiguous()
    lay0 = _lay(x.shape, 0, w, seed, tiny)
    check_op(lambda t, s: t.scatter(1, index, s), [x, src], [lay0, None], m, what="scatter src",
             expect_placements=[st.Shard(0)])
    check_op(lambda t, s: t.scatter(1, index, s), [x, src], [lay0, lay0], m, what="scatter sharded src")
    check_op(lambda t: t.scatter(1, index, 2.5), [x], [lay0], m, what="scatter value")
    check_op(lambda t, s: t.scatter_add(1, index, s), [x, src], [lay0, lay0], m, what="scatter_add")
    check_op(lambda t, s: torch.scatter_add(t, 1, index.repeat(1, 2, 1), s.repeat(1, 2, 1)), [x, src], [lay0, lay0],
             m, what="scatter_add duplicates")
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            check_op(lambda t, s: t.scatter_reduce(1, index, s, reduce, include_self=include_self), [x, src],
                     [lay0, lay0], m, grad=reduce in ("sum", "mean", "amax"),
                     what=f"scatter_reduce {reduce} include_self={include_self}")
    check_op(lambda t, s: t.clone().scatter_(1, index, s), [x, src], [lay0, lay0], m, what="scatter_")
    check_op(lambda t, s: t.clone().scatter_(1, index, s, reduce="add"), [x, src], [lay0, lay0], m, grad=False,
             what="scatter_ reduce=add")
    check_op(lambda t, s: t.clone().scatter_add_(1, index, s), [x, src], [lay0, lay0], m, what="scatter_add_")
    # A gather along a sharded index dim: its backward scatters into the sharded layout.
    index2 = torch.randint(0, 7, (5, 7, 3), generator=torch.Generator().manual_seed(seed))
    check_op(lambda t: t.gather(1, index2), [x], [_lay(x.shape, 2, w, seed, tiny)], m, what="gather full index dim 2")
    return True


def case_scatter_sharded_dim(seed, tiny):
    """scatter / scatter_add / scatter_reduce along the sharded dim: a whole index gives each rank the elements that
    land in its rows (no collective); an index sharded on that dim (a graph's edges split across ranks, their
    messages summed into the nodes a rank owns) sends each element to its target's owner: one small all-gather of
    counts and one all-to-all each for values and positions -- so does a whole index with a sharded source (the
    index cut to the source's split); index and source smaller than the input, scalars, every reduction, forward
    and gradients."""
    m = mesh()
    w = m.size()
    nodes, edges, F_ = 7, 12, 3
    x = randn(nodes, F_, seed=seed)
    g = torch.Generator().manual_seed(seed)
    dst = torch.randint(0, nodes, (edges,), generator=g)
    index = dst.view(-1, 1).expand(edges, F_).contiguous()
    msg = randn(edges, F_, seed=seed + 1)
    lay_x = _lay(x.shape, 0, w, seed, tiny)
    lay_e = ([st.Shard(0)], {0: uneven_extents(edges, w, seed + 2)})
    with st.use_strict():
        for name, lay_i in (("whole index", None), ("index sharded on the dim", lay_e)):
            check_op(lambda t, i, s: t.scatter_add(0, i, s), [x, index, msg], [lay_x, lay_i, lay_i], m,
                     what=f"scatter_add, {name}", expect_placements=[st.Shard(0)])
            check_op(lambda t, i, s: torch.zeros_like(t).scatter_add_(0, i, s), [x, index, msg], [lay_x, lay_i, lay_e],
                     m, what=f"scatter_add_ into zeros, {name}, source sharded")
            for reduce in ("sum", "prod", "mean", "amax", "amin"):
                for include_self in (True, False):
                    check_op(lambda t, i, s: t.scatter_reduce(0, i, s, reduce, include_self=include_self),
                             [x, index, msg], [lay_x, lay_i, lay_i], m, grad=reduce in ("sum", "mean"),
                             what=f"scatter_reduce {reduce} include_self={include_self}, {name}")
            uniq = torch.randperm(nodes, generator=torch.Generator().manual_seed(seed))[:5]
            u_index = uniq.view(-1, 1).expand(5, F_).contiguous()
            lay_u = None if lay_i is None else ([st.Shard(0)], {0: uneven_extents(5, w, seed + 3)})
            check_op(lambda t, i, s: t.scatter(0, i, s), [x, u_index, msg], [lay_x, lay_u, None], m, grad=False,
                     what=f"scatter, source larger than the index, {name}")  # torch has no gradient for that
            check_op(lambda t, i, s: t.scatter(0, i, s), [x, u_index, msg[:5]], [lay_x, lay_u, lay_u], m,
                     what=f"scatter, {name}")
            check_op(lambda t, i: t.scatter(0, i, -2.5), [x, u_index], [lay_x, lay_u], m, what=f"scatter value, {name}")
            check_op(lambda t, i: t.scatter(0, i[:, :2], 1.5, reduce="multiply"), [x, u_index], [lay_x, lay_u], m,
                     grad=False, what=f"scatter value multiply, index narrower than the input, {name}")
        xs = st.distribute_tensor(x, m, *lay_x)
        index_s, msg_s = st.distribute_tensor(index, m, *lay_e), st.distribute_tensor(msg, m, *lay_e)
        st.reset_comm_stats()
        xs.scatter_add(0, index, msg)
        assert st.comm_stats()["calls"] == {}, st.comm_stats()
        xs.scatter_add(0, index_s, msg_s)
        calls = st.comm_stats()["calls"]
        assert calls == ({"all_gather": 1, "all_to_all": 2} if w > 1 else {}), calls
        # A whole index with a source split along the dim (PyTorch Geometric's `scatter`: the edge messages split
        # with the edges, `edge_index[1]` read whole by every rank): the index is cut to the source's split and the
        # elements routed like a split index's -- the source is not gathered to every rank.
        for reduce in ("sum", "amax"):
            st.reset_comm_stats()
            xs.scatter_reduce(0, index, msg_s, reduce, include_self=False)
            calls = st.comm_stats()["calls"]
            assert calls == ({"all_gather": 1, "all_to_all": 2} if w > 1 else {}), (reduce, calls)
    return True


def case_index_select_routed(seed, tiny):
    """index_select of rows a mesh dim shards with an index sharded on the same mesh dim (a graph's node features
    read at its edges, nodes and edges split across ranks): each rank fetches the rows its part of the index names
    from their owners, the output is sharded like the index, and the gradient rows go home (index_add); no tensor
    whole along either dim on any rank."""
    m = mesh()
    w = m.size()
    nodes, edges, F_ = 7, 12, 3
    x = randn(nodes, F_, seed=seed)
    src = torch.randint(0, nodes, (edges,), generator=torch.Generator().manual_seed(seed))
    lay_x = _lay(x.shape, 0, w, seed, tiny)
    lay_e = ([st.Shard(0)], {0: uneven_extents(edges, w, seed + 2)})
    with st.use_strict():
        out = check_op(lambda t, i: t.index_select(0, i), [x, src], [lay_x, lay_e], m, what="routed index_select",
                       expect_placements=[st.Shard(0)])
        assert st.sharding_shapes(out) == {0: lay_e[1][0]}, st.sharding_shapes(out)
        # A message-passing step: gather at the edges' sources, scatter-add into their destinations.
        dst = torch.randint(0, nodes, (edges,), generator=torch.Generator().manual_seed(seed + 1))

        def step(t, s, d):
            msg = torch.tanh(t.index_select(0, s))
            return torch.zeros_like(t).index_add(0, d, msg)
        check_op(step, [x, src, dst], [lay_x, lay_e, lay_e], m, what="message passing")
        xs = st.distribute_tensor(x, m, *lay_x).requires_grad_(True)
        si = st.distribute_tensor(src, m, *lay_e)
        st.reset_comm_stats()
        y = xs.index_select(0, si)
        (y * 2).sum().backward()
        calls = st.comm_stats()["calls"]
        # Forward: the requests (counts, then rows and positions) and the replies; backward: the gradient rows home
        # (index_add with the index sharded like them: counts, then rows and targets). Nothing gathers the index.
        assert calls == ({"all_gather": 3, "all_to_all": 5} if w > 1 else {}), calls
        assert st.placements(xs.grad) == (st.Shard(0),)
    if w > 1:
        with pytest.raises(IndexError, match="index out of range"):
            bad = src.clone()
            bad[-1] = nodes
            st.distribute_tensor(x, m, *lay_x).index_select(0, st.distribute_tensor(bad, m, *lay_e))
    return True


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, False), (3, True)])
def test_index_select_routed(world, tiny):
    harness.run(world, case_index_select_routed, world, tiny)


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, False), (3, True)])
def test_scatter_sharded_dim(world, tiny):
    harness.run(world, case_scatter_sharded_dim, world, tiny)


def case_scatter_out_of_range(seed):
    """An index out of range in one rank's part of a sharded index: every rank raises (the ranks agree with the
    counts), none waits."""
    m = mesh()
    xs = st.distribute_tensor(randn(6, 2, seed=seed), m, [st.Shard(0)])
    index = torch.zeros(6, 2, dtype=torch.long)
    index[5, 0] = 9  # on the last rank's part only
    lay = [st.Shard(0)]
    xs.scatter_add(0, st.distribute_tensor(index, m, lay), st.distribute_tensor(randn(6, 2, seed=1), m, lay))


def test_scatter_out_of_range_raises_everywhere():
    harness.expect_error(3, case_scatter_out_of_range, 3, kinds=("IndexError",), match="index out of range")


def case_index_put(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(5, 7, 3, seed=seed)
    idx = torch.tensor([6, 0, 3])
    lay0 = _lay(x.shape, 0, w, seed, tiny)
    lay2 = _lay(x.shape, 2, w, seed, tiny)
    v = randn(5, 3, 3, seed=seed + 1)

    def setitem(t, vals):
        y = t.clone()
        y[:, idx] = vals
        return y

    check_op(setitem, [x, v], [lay0, None], m, what="x[:, idx] = v", expect_placements=[st.Shard(0)])
    check_op(setitem, [x, v], [lay2, lay2], m, what="x[:, idx] = v, sharded last dim")
    check_op(setitem, [x, v[:1, :, :1]], [lay0, None], m, what="x[:, idx] = broadcast v")
    check_op(lambda t, vals: torch.ops.aten.index_put(t, [None, idx], vals, True), [x, v], [lay0, None], m,
             what="index_put accumulate")
    check_op(lambda t, vals: torch.ops.aten.index_put_(t.clone(), [None, idx, idx % 3], vals[:, :, 0], True),
             [x, v], [lay0, None], m, what="index_put_ two adjacent indices")
    # Reads: adjacent and non-adjacent index tensors (the result dims move to the front).
    check_op(lambda t: t[:, idx], [x], [lay0], m, what="x[:, idx]", expect_placements=[st.Shard(0)])
    check_op(lambda t: t[idx % 5, :, idx % 3], [x], [_lay(x.shape, 1, w, seed, tiny)], m, what="x[i, :, j]",
             expect_placements=[st.Shard(1)])
    check_op(lambda t: t[:, x[0, :, 0] > 0], [x], [lay0], m, what="x[:, mask]")

    # x[mask] = value with the mask laid out like x: local on every dim.
    def mask_put(t):
        y = t.clone()
        y[y > 0.5] = 0.0
        return y

    check_op(mask_put, [x], [lay0], m, what="x[x > 0.5] = 0", expect_placements=[st.Shard(0)])
    check_op(lambda t: t.masked_fill(t > 0.5, 1.0).index_put((t < 0,), torch.tensor(2.0)), [x], [lay2], m,
             what="index_put mask value")
    return True


def case_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(6, 5, 4, seed=seed)
    lay = ([st.Shard(0), st.Shard(2)], {0: uneven_extents(6, 2, seed), 1: uneven_extents(4, 2, seed + 1)})
    idx = torch.tensor([4, 0, 0, 2])
    check_op(lambda t: t.index_select(1, idx), [x], [lay], m, what="2-D index_select",
             expect_placements=[st.Shard(0), st.Shard(2)])
    check_op(lambda t: t.index_select(2, idx % 4), [x], [lay], m, what="2-D index_select sharded dim",
             expect_placements=[st.Shard(0), st.Shard(2)])
    index = torch.randint(0, 5, (6, 3, 4), generator=torch.Generator().manual_seed(seed))
    check_op(lambda t: t.gather(1, index), [x], [lay], m, what="2-D gather")
    index0 = torch.randint(0, 6, (2, 5, 4), generator=torch.Generator().manual_seed(seed))
    check_op(lambda t: t.gather(0, index0), [x], [lay], m, what="2-D gather sharded dim",
             expect_placements=[st.Shard(0), st.Shard(2)])
    src = randn(6, 3, 4, seed=seed + 2)
    check_op(lambda t, s: t.scatter_add(1, index, s), [x, src], [lay, lay], m, what="2-D scatter_add")

    def setitem(t):
        y = t.clone()
        y[:, idx] = 1.5
        return y

    check_op(setitem, [x], [lay], m, what="2-D x[:, idx] = 1.5")
    return True


def case_refusals(which):
    m = mesh()
    x = st.distribute_tensor(randn(5, 7, 3), m, [st.Shard(1)])
    index = torch.zeros(5, 2, 3, dtype=torch.long)
    # strict: the rules' refusals, not the gather-compute fallback they would run otherwise (test_fallback.py)
    with st.use_strict():
        _refused_op(which, m, x, index)
    return True


def _refused_op(which, m, x, index):
    if which == "gather_smaller":
        st.distribute_tensor(randn(5, 7, 3), m, [st.Shard(0)]).gather(1, index[:3])


def case_index_sharded_dim(seed, tiny):
    """`x[..., idx]` and `x[..., idx] = v` with an index into a sharded dim: owners read (one sum over the mesh dim,
    the result Replicate there) and write their own entries; PointNet++'s index_points, negative indices, a bool mask,
    accumulate, and the gradient (index's backward is an accumulating index_put into the sharded input)."""
    m = mesh()
    w = m.size()
    B, N, C, S = 2, 11, 3, 6
    pts = randn(B, N, C, seed=seed)
    lay = _lay(pts.shape, 1, w, seed, tiny)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, N, (B, S), generator=g)
    batch = torch.arange(B).view(B, 1).expand(B, S)
    with st.use_strict():
        xs = st.distribute_tensor(pts, m, *lay)
        st.reset_comm_stats()
        out = xs[batch, idx, :]
        # A routed read: the result split along the index's largest dim; one small all-gather checks that every
        # rank holds the same index, one all-to-all moves the entries.
        assert st.comm_stats()["calls"] == ({"all_gather": 1, "all_to_all": 1} if w > 1 else {}), st.comm_stats()
        assert st.placements(out) == (st.Shard(1),), st.placements(out)
        check_op(lambda t: t[batch, idx, :], [pts], [lay], m, what="index_points")
        check_op(lambda t: t[:, idx[0]], [pts], [lay], m, what="x[:, idx]")
        check_op(lambda t: t[:, torch.tensor([-1, 0, -N])], [pts], [lay], m, what="negative indices")
        mask = torch.zeros(N, dtype=torch.bool)
        mask[[1, 4, 9]] = True
        check_op(lambda t: t[:, mask], [pts], [lay], m, what="bool mask over the sharded dim")
        check_op(lambda t: t[:, idx[0], 1:], [pts], [lay], m, what="index then slice")
        # Writes: assignment (each rank writes what it owns) and accumulation (duplicates add).
        v = randn(B, S, C, seed=seed + 1)
        uniq = torch.randperm(N, generator=g)[:S]

        def assign(t, vv):
            t = t.clone()
            t[:, uniq] = vv
            return t
        check_op(assign, [pts, v], [lay, None], m, what="x[:, idx] = v")

        def accumulate(t, vv):
            return t.index_put((batch, idx), vv, accumulate=True)
        check_op(accumulate, [pts, v], [lay, None], m, what="index_put accumulate (duplicates)")

        def fill(t):
            t = t.clone()
            t[:, idx[1]] = 0.5
            return t
        check_op(fill, [pts], [lay], m, what="x[:, idx] = scalar")
    return True


def case_nonzero(seed, tiny):
    """nonzero / argwhere / torch.where(cond) of a tensor split on its leading dim: each rank's own coordinates (its
    offset added) are its block of the result (Shard(0), each rank's count its extent; one small collective, nothing
    gathered); a split along an inner dim is re-laid out on the leading dim first (prod's backward, over any layout)."""
    m = mesh()
    w = m.size()
    x = randn(9, 4, seed=seed)
    x[x.abs() < 0.5] = 0
    lay = _lay(x.shape, 0, w, seed, tiny)
    with st.use_strict():
        xs = st.distribute_tensor(x, m, *lay)
        st.reset_comm_stats()
        out = torch.nonzero(xs)
        assert set(st.comm_stats()["calls"]) <= {"all_gather"} and sum(st.comm_stats()["calls"].values()) <= 1
        assert st.placements(out) == (st.Shard(0),), st.placements(out)
        assert torch.equal(full(out), torch.nonzero(x))
        assert torch.equal(full(torch.argwhere(xs)), torch.argwhere(x))
        for got, ref in zip(torch.where(xs > 0), torch.where(x > 0)):
            assert torch.equal(full(got), ref)
        row = x[:1]  # [1, 4] split on its second dim: the leading dim has size 1
        assert torch.equal(full(torch.nonzero(st.distribute_tensor(row, m, [st.Shard(1)]))), torch.nonzero(row))
        assert torch.equal(full(torch.nonzero(st.distribute_tensor(x, m, [st.Replicate()]))), torch.nonzero(x))
        # Split on an inner dim the rows would interleave: re-laid out on the leading dim first (one all-to-all),
        # then the same blocks by counts.
        inner = st.distribute_tensor(x, m, *_lay(x.shape, 1, w, seed, tiny))
        st.reset_comm_stats()
        out = torch.nonzero(inner)
        if w > 1:
            assert st.comm_stats()["calls"] == {"all_to_all": 1, "all_gather": 1}, st.comm_stats()["calls"]
            assert st.placements(out) == (st.Shard(0),), st.placements(out)
        assert torch.equal(full(out), torch.nonzero(x))
        # prod's backward calls nonzero on `input == 0` whatever the layout: a full product over an inner split.
        z = randn(3, 5, 4, seed=seed + 1, dtype=torch.float64)
        z[1, 2, 3] = 0
        for zz in (z, z.abs() + 0.5):
            zs = st.distribute_tensor(zz, m, *_lay(zz.shape, 1, w, seed, tiny)).requires_grad_()
            zr = zz.clone().requires_grad_()
            p, pr = zs.prod(), zr.prod()
            close(full(p), pr, rtol=1e-12, atol=1e-12, what="prod over an inner split")
            p.backward(), pr.backward()
            close(full(zs.grad), zr.grad, rtol=1e-12, atol=1e-12, what="prod's gradient over an inner split")
        # nonzero_static: the first `size` rows, or the padded result (fill rows on the last rank's block).
        n = int((x != 0).sum())
        for size, fill in ((0, -1), (n // 2, -1), (n, 7), (n + 5, -1), (n + 3, 0)):
            for layout in (lay, _lay(x.shape, 1, w, seed, tiny)):
                xs = st.distribute_tensor(x, m, *layout)
                out = torch.nonzero_static(xs, size=size, fill_value=fill)
                assert torch.equal(full(out), torch.nonzero_static(x, size=size, fill_value=fill)), (size, fill)
                assert w == 1 or st.placements(out) == (st.Shard(0),), st.placements(out)
    return True


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, True)])
def test_nonzero(world, tiny):
    harness.run(world, case_nonzero, world, tiny)


def case_nonzero_2d_mesh(seed):
    """nonzero of a tensor split by both mesh dims of a 2x2 mesh (rows x columns: the row-major order interleaves the
    column ranks): the rows' mesh dim keeps its split and the columns are gathered within it, so the result is split
    over the rows' mesh dim (it refused, and the fallback gathered the whole tensor on every rank); prod's backward
    over that layout (the OpInfo 2x2 sweep's `prod`)."""
    m = mesh((2, 2))
    x = randn(7, 6, seed=seed)
    x[x.abs() < 0.5] = 0
    with st.use_strict():
        for pl, ext in (((st.Shard(0), st.Shard(1)), {0: [3, 4], 1: [6, 0]}),
                        ((st.Shard(1), st.Shard(0)), {0: [2, 4], 1: [7, 0]})):
            xs = st.distribute_tensor(x, m, list(pl), ext)
            out = torch.nonzero(xs)
            assert torch.equal(full(out), torch.nonzero(x)), pl
            rows = [i for i, p in enumerate(pl) if p.dim == 0][0]
            assert st.placements(out)[rows] == st.Shard(0), st.placements(out)
            assert torch.equal(full(torch.argwhere(xs)), torch.argwhere(x))
        z = randn(4, 5, seed=seed + 1, dtype=torch.float64)
        zs = st.distribute_tensor(z, m, [st.Shard(0), st.Shard(1)], {0: [1, 3], 1: [2, 3]}).requires_grad_()
        zr = z.clone().requires_grad_()
        p, pr = zs.prod(), zr.prod()
        close(full(p), pr, rtol=1e-12, atol=1e-12, what="prod on a 2x2 mesh")
        p.backward(), pr.backward()
        close(full(zs.grad), zr.grad, rtol=1e-12, atol=1e-12, what="prod's gradient on a 2x2 mesh")
    return True


def test_nonzero_2d_mesh():
    harness.run(4, case_nonzero_2d_mesh, 4)


def case_masked_select(seed):
    """masked_select (and `x[mask]`) over sharded dims: owners read their selected elements (one all-reduce of the
    result); its backward scatters into the input's layout."""
    m = mesh()
    w = m.size()
    x = randn(4, 9, seed=seed)
    lay = _lay(x.shape, 1, w, seed)
    mask = x > 0.3
    with st.use_strict():
        check_op(lambda t: torch.masked_select(t, mask), [x], [lay], m, what="masked_select, plain mask")
        check_op(lambda t: torch.masked_select(t, t > 0.3), [x], [lay], m, what="masked_select, sharded mask")
        check_op(lambda t: torch.masked_select(t, mask[0]), [x], [lay], m, what="masked_select, broadcast mask")
        check_op(lambda t: t[t > 0.3], [x], [lay], m, what="x[x > 0.3]")
        # A mask over the leading dims (rows picked with their trailing dim whole), split and plain.
        x3 = randn(3, 9, 4, seed=seed + 5)
        lay3 = _lay(x3.shape, 1, w, seed)
        pick = torch.rand(3, 9, generator=torch.Generator().manual_seed(seed)) > 0.5
        check_op(lambda t: t[t.sum(-1) > 0], [x3], [lay3], m, what="x[mask] over (B, N), N split, C whole")
        check_op(lambda t: t[pick], [x3], [lay3], m, what="x[plain mask] over (B, N), N split")
        check_op(lambda t: t[:, t[0, :, 0] > 0], [x3], [lay3], m, what="x[:, mask] along the split dim")
        # A field split on its leading dim, masked by itself: each rank keeps its own selection (Shard(0) with its
        # count as extent), nothing gathered.
        lead = _lay(x.shape, 0, w, seed)
        xs = st.distribute_tensor(x, m, *lead)
        sel = torch.masked_select(xs, xs > 0.3)
        if w > 1:
            assert st.placements(sel) == (st.Shard(0),), st.placements(sel)
            counts = [int((x[a:a + e] > 0.3).sum()) for a, e in zip([0] + list(torch.tensor(lead[1][0]).cumsum(0)[:-1]),
                                                                     lead[1][0])]
            assert st.sharding_shapes(sel)[0] == counts, (st.sharding_shapes(sel), counts)
        check_op(lambda t: torch.masked_select(t, t > 0.3), [x], [lead], m, what="masked_select, leading dim")
        row = x[:1]
        check_op(lambda t: torch.masked_select(t, t < 0), [row], [_lay(row.shape, 1, w, seed)], m,
                 what="masked_select, [1, N] split on N")
        # A field split on its batch under a plain mask broadcast over it (the selected spectral modes of The Well's
        # ReFNO, real and complex): the selection stays split, and its gradient -- masked_select's backward, a
        # masked_scatter_ of the split gradient into zeros laid out like the field -- reaches every rank's block
        # from the ranks that hold it (one neighbour exchange), no rank gathering the whole selection.
        for dt in (torch.float64, torch.complex128):
            f = randn(w + 2, 5, 3, seed=seed + 1).to(dt)
            fmask = torch.tensor([True, False, True, True, False]).view(1, 5, 1)
            flay = _lay(f.shape, 0, w, seed)
            check_op(lambda t: torch.masked_select(t, fmask), [f], [flay], m, what=f"masked_select {dt}, batch split")
            fs = st.distribute_tensor(f, m, *flay).requires_grad_()
            sel = torch.masked_select(fs, fmask)
            if w > 1:
                assert st.placements(sel) == (st.Shard(0),), st.placements(sel)
            with st.CommCounter() as c:
                (grad,) = torch.autograd.grad(sel, fs, sel.detach() * 2)
            assert "all_gather" not in c.calls and not c.replications, (dict(c.calls), c.replications)
            close(full(grad), torch.where(fmask, f * 2, torch.zeros_like(f)), what=f"masked_select {dt} grad")
        # masked_scatter_ of a split source whose shards are not the blocks' selections (the default split of the
        # source): each rank still receives exactly the elements its block takes.
        dst = st.distribute_tensor(torch.zeros(w + 2, 5, 3, dtype=torch.float64), m, *flay)
        src = randn(48, seed=seed + 3, dtype=torch.float64)
        dst.masked_scatter_(fmask, st.distribute_tensor(src, m, [st.Shard(0)]))
        want = torch.zeros(w + 2, 5, 3, dtype=torch.float64).masked_scatter_(fmask, src)
        close(full(dst), want, what="masked_scatter_, split source")
    return True


def case_masked_select_2d_mesh(seed):
    """A plain mask over a field split by two mesh dims (The Well's ReFNO: its spectral modes picked from a spectrum
    split along batch and channels): the leading dim's mesh dim keeps its split (the channels gathered within it), so
    the selection stays divided over that mesh dim instead of being completed on every rank; gradients exact."""
    m = mesh((2, 2))
    fmask = torch.tensor([True, False, True, True, False]).view(1, 5, 1)
    for dt in (torch.float64, torch.complex128):
        f = randn(5, 5, 4, seed=seed).to(dt)
        lay = ([st.Shard(0), st.Shard(2)], {0: [3, 2], 1: [1, 3]})
        with st.use_strict():
            out = check_op(lambda t: torch.masked_select(t, fmask), [f], [lay], m, what=f"masked_select {dt}, 2x2")
        assert st.placements(out) == (st.Shard(0), st.Replicate()), st.placements(out)
    # A mask that is the field's own (split like it) over both mesh dims, whole and over the leading dims only.
    x = randn(3, 9, 5, seed=seed + 1)
    with st.use_strict():
        for lay in (([st.Shard(1), st.Shard(2)], {0: [4, 5], 1: [3, 2]}),
                    ([st.Shard(0), st.Shard(1)], {0: [2, 1], 1: [4, 5]})):
            check_op(lambda t: t[t > 0], [x], [lay], m, what=f"x[x > 0], 2x2 {lay[0]}")
            check_op(lambda t: t[t.sum(-1) > 0], [x], [lay], m, what=f"x[mask] over leading dims, 2x2 {lay[0]}")
    return True


def test_masked_select_2d_mesh():
    harness.run(4, case_masked_select_2d_mesh, 4)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_masked_select(world):
    harness.run(world, case_masked_select, world)


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, False), (3, True)])
def test_index_sharded_dim(world, tiny):
    harness.run(world, case_index_sharded_dim, world, tiny)


def case_index_sharded_dim_mesh2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(7, 6, 3, seed=seed)
    lay = ([st.Shard(0), st.Shard(1)], {0: [4, 3], 1: [0, 6]})
    i = torch.tensor([6, 0, 3, 3])
    j = torch.tensor([1, 5, 0, 2])
    with st.use_strict():
        check_op(lambda t: t[i, j], [x], [lay], m, what="x[i, j] over two mesh dims")
        check_op(lambda t: t[:, j], [x], [lay], m, what="x[:, j] (dim 0 stays sharded, a routed read along j)",
                 expect_placements=[st.Shard(0), st.Shard(1)])

        def put(t):
            return t.index_put((i, j), torch.ones(3), accumulate=True)
        check_op(put, [x], [lay], m, what="accumulate over two mesh dims")
    return True


def test_index_sharded_dim_mesh2d():
    harness.run(4, case_index_sharded_dim_mesh2d, 4)


def case_aligned_index_reads(seed):
    """An index into a split dim that follows the result's own layout reads locally along that mesh dim: a masked
    autoencoder's `x[arange(B)[:, None], ids]` with the batch split (a 2-D mesh: the tokens on one mesh dim, the
    batch on the other; a 1-D mesh splitting the batch) keeps the batch split (x's extents, a zero one too) and
    routes only along the tokens' mesh dim, forward and backward; the same index writes locally
    (`index_put`); an index that does not follow the layout (a permuted batch) reads as before."""
    w = torch.distributed.get_world_size()
    B, N, C, K = 5, 13, 3, 6
    x = randn(B, N, C, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)])
    rows = torch.arange(B)[:, None]
    read = lambda t: t[rows, ids]                      # noqa: E731
    if w == 4:
        m = mesh((2, 2))
        layouts = {  # (x's layout, the result's placements, the collectives of the forward)
            "tokens on d0, batch on d1": (([st.Shard(1), st.Shard(0)], {0: [6, 7], 1: [3, 2]}),
                                          (st.Shard(1), st.Shard(0)), {"all_gather": 1, "all_to_all": 1}),
            "batch on d0 (a zero block), tokens on d1": (([st.Shard(0), st.Shard(1)], {0: [0, 5], 1: [9, 4]}),
                                                         (st.Shard(0), st.Shard(1)), {"all_gather": 1, "all_to_all": 1}),
        }
    else:
        m = mesh()
        ext = [3, 2] if w == 2 else [2, 0, 3]
        layouts = {"batch split": (([st.Shard(0)], {0: ext}), (st.Shard(0),), {})}
    with st.use_strict():
        for what, (lay, placements, calls) in layouts.items():
            out = check_op(read, [x], [lay], m, what=what, expect_placements=placements)
            b_dim = [p.dim for p in lay[0]].index(0)
            assert st.sharding_shapes(out)[b_dim] == lay[1][b_dim], (what, st.sharding_shapes(out))
            xs = st.distribute_tensor(x, m, *lay).requires_grad_()
            st.reset_comm_stats()
            y = read(xs)
            assert st.comm_stats()["calls"] == calls, (what, st.comm_stats())
            st.reset_comm_stats()
            (y * y).sum().backward()
            back = st.comm_stats()["calls"]
            assert back.get("all_reduce", 0) == 0 and back.get("all_to_all", 0) == calls.get("all_to_all", 0), \
                (what, st.comm_stats())
            # The write with the same index: each rank writes its own batch rows (values laid out like the read).
            v = randn(B, K, C, seed=seed + 1)
            check_op(lambda t, u: t.index_put((rows, ids), u), [x, v], [lay, lay if w != 4 else None], m,
                     what=what + ": index_put")
        # A batch of one on a mesh dim of 2 (an empty block): the rank without it reads nothing.
        if w != 4:
            one = randn(1, N, C, seed=seed + 2)
            check_op(lambda t: t[torch.zeros(1, 1, dtype=torch.long), ids[:1]], [one],
                     [([st.Shard(0)], {0: [1] + [0] * (w - 1)})], m, what="a batch of one",
                     expect_placements=(st.Shard(0),))
        # A batch index that does not follow the layout reads through the owners as before.
        perm = torch.tensor([4, 0, 3, 1, 2])[:, None]
        lay = layouts[next(iter(layouts))][0]
        check_op(lambda t: t[perm, ids], [x], [lay], m, what="permuted batch")
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_aligned_index_reads(world):
    harness.run(world, case_aligned_index_reads, world)


def case_index_writes(seed, tiny):
    """index_add / index_copy / index_reduce along unsharded and sharded dims: a whole source gives each rank the rows
    that land in its block (no collective); a source sharded on the same dim (a graph's edge messages summed into the
    nodes a rank owns) moves only the rows another rank owns, in one all-to-all; forward and gradients."""
    m = mesh()
    w = m.size()
    x = randn(7, 5, 3, seed=seed)
    idx = _index(7, 11, seed)  # duplicates included
    src = randn(11, 5, 3, seed=seed + 1)
    lay_x = _lay(x.shape, 0, w, seed, tiny)
    lay_src = ([st.Shard(0)], {0: uneven_extents(11, w, seed + 2)})
    lay_other = _lay(x.shape, 1, w, seed, tiny)
    with st.use_strict():
        for name, fn in [
            ("index_add", lambda t, s: t.index_add(0, idx, s, alpha=0.5)),
            ("index_copy", lambda t, s: t.index_copy(0, idx.unique(), s[: idx.unique().numel()])),
            ("index_reduce amax", lambda t, s: t.index_reduce(0, idx, s, "amax")),
            ("index_reduce mean", lambda t, s: t.index_reduce(0, idx, s, "mean", include_self=False)),
            ("index_reduce prod", lambda t, s: t.index_reduce(0, idx, s, "prod")),
        ]:
            grad = name in ("index_add", "index_copy")
            check_op(fn, [x, src], [lay_x, None], m, what=f"{name}, whole source", grad=grad)
            if name != "index_copy":
                check_op(fn, [x, src], [lay_x, lay_src], m, what=f"{name}, source sharded on the dim", grad=grad)
            check_op(fn, [x, src], [lay_other, _lay(src.shape, 1, w, seed, tiny)], m,
                     what=f"{name}, another dim sharded", grad=grad, expect_placements=[st.Shard(1)])
        check_op(lambda t, s: t.index_add(0, idx[:0], s[:0]), [x, src], [lay_x, None], m, what="empty index")
        # The index sharded like the source: each rank routes its own rows by its own part of the index.
        for name, fn in [("index_add", lambda t, i, s: t.index_add(0, i, s, alpha=-1.5)),
                         ("index_reduce mean", lambda t, i, s: t.index_reduce(0, i, s, "mean"))]:
            check_op(fn, [x, idx, src], [lay_x, lay_src, lay_src], m, what=f"{name}, index sharded like the source",
                     grad=name == "index_add")
        xs = st.distribute_tensor(x, m, *lay_x)
        i_s, s_s = st.distribute_tensor(idx, m, *lay_src), st.distribute_tensor(src, m, *lay_src)
        st.reset_comm_stats()
        xs.index_add(0, i_s, s_s)
        calls = st.comm_stats()["calls"]
        assert calls == ({"all_gather": 1, "all_to_all": 2} if w > 1 else {}), calls
        before = st.comm_stats()["calls"]
        out = xs.index_add(0, idx, src)
        assert st.comm_stats()["calls"] == before, "index_add with a whole source communicated"
        assert st.placements(out) == (st.Shard(0),)
        # In place, with a sharded source: exactly one all-to-all moves the rows.
        ss = st.distribute_tensor(src, m, *lay_src)
        before = dict(st.comm_stats()["calls"])
        xs.index_add_(0, idx, ss)
        after = st.comm_stats()["calls"]
        moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        # (and one small all-gather checks that every rank holds the same whole index)
        assert moved == ({"all_gather": 1, "all_to_all": 1} if w > 1 else {}), moved
        harness_close = torch.testing.assert_close
        harness_close(full(xs), x.index_add(0, idx, src))
    if w > 1:
        with pytest.raises(IndexError, match="index out of range"):
            st.distribute_tensor(x, m, *lay_x).index_add(0, torch.tensor([7]), src[:1])
    return True


def case_index_writes_into_plain(seed):
    """A plain written tensor with a ShardTensor source (and whole or source-sharded index) is Replicate: every rank
    holds the whole result, equal to one device; in place, the plain tensor itself is written (what aten's derivative
    formulas do with plain zeros: index_select's backward inside a torch.func transform, over a plain table)."""
    m = mesh()
    src = randn(6, 4, seed=seed)
    idx = torch.tensor([0, 3, 3, 1, 4, 0])
    base = randn(5, 4, seed=seed + 1)
    ref = base.index_add(0, idx, src, alpha=2)
    srcs = st.distribute_tensor(src, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(6, m.size(), seed)})
    idxs = st.distribute_tensor(idx, m, [st.Shard(0)], sharding_shapes=st.sharding_shapes(srcs))
    with st.use_strict():
        for index in (idx, idxs):
            out = base.index_add(0, index, srcs, alpha=2)
            close(full(out), ref, what="index_add into a plain tensor")
            written = base.clone()
            written.index_add_(0, index, srcs, alpha=2)
            assert not st.is_shard_tensor(written)
            close(written, ref, what="index_add_ into a plain tensor")
        # the gradient of a plain table read at a sharded index, inside torch.func.grad and by .backward()
        table = randn(5, 4, seed=seed + 2)
        loss = lambda t: (t.index_select(0, idxs) * srcs).square().sum()  # noqa: E731
        g = torch.func.grad(loss)(table)
        t = table.clone().requires_grad_()
        loss(t).backward()
    g_ref = torch.func.grad(lambda t: (t.index_select(0, idx) * src).square().sum())(table)
    assert not st.is_shard_tensor(g) and not st.is_shard_tensor(t.grad)
    close(g, g_ref, what="torch.func.grad of a plain table")
    close(t.grad, g_ref, what="backward of a plain table")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_index_writes_into_plain(world):
    harness.run(world, case_index_writes_into_plain, world)


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, False), (3, True)])
def test_index_writes(world, tiny):
    harness.run(world, case_index_writes, world, tiny)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_index_select(world):
    harness.run(world, case_index_select, world, False)


@pytest.mark.parametrize("world", [3, 4])
def test_index_select_tiny_shards(world):
    harness.run(world, case_index_select, world, True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather(world):
    harness.run(world, case_gather, world + 10, world >= 3)


def case_gather_empty_index():
    """An empty index of any number of dims (torch checks nothing else and returns an empty tensor of its shape): it
    raised "Index tensor must have the same number of dimensions" (found by the OpInfo probe beyond the first sample)."""
    m = mesh()
    x = randn(5, 4, seed=3)
    xs = st.distribute_tensor(x, m, [st.Shard(0)], {0: uneven_extents(5, m.size(), 1)})
    with st.use_strict():
        for index in (torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                      torch.zeros(3, 0, 2, dtype=torch.long)):
            out = torch.gather(xs, 0, index)
            ref = torch.gather(x, 0, index)
            assert full(out).shape == ref.shape and full(out).dtype == ref.dtype, (out.shape, ref.shape)
    return True


def test_gather_empty_index():
    harness.run(2, case_gather_empty_index)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_scatter(world):
    harness.run(world, case_scatter, world + 20, world == 3)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_index_put(world):
    harness.run(world, case_index_put, world + 30, world == 4)


def test_indexing_2d_mesh():
    harness.run(4, case_2d_mesh, 5)


@pytest.mark.parametrize("which", ["gather_smaller"])
def test_indexing_sharded_dim_refused(which):
    errors = harness.expect_error(3, case_refusals, which, kinds=("NotImplementedError",))
    for kind, msg, _ in errors.values():
        assert "Replicate()" in msg and "Shard(" in msg, msg


def case_bucketize_searchsorted(seed):
    """bucketize / searchsorted of a sharded tensor into a whole sorted sequence (plain or replicated): local lookups
    laid out like the input, no collective; a sharded 1-D sequence is gathered, an N-D one follows the input."""
    m = mesh()
    x = randn(3, 7, 4, seed=seed)
    lay = ([st.Shard(1)], {0: uneven_extents(7, m.size(), seed)})
    edges = torch.tensor([-1.0, -0.2, 0.0, 0.5, 1.5])
    sorter_seq = torch.tensor([0.5, -1.0, 1.5, 0.0, -0.2])
    sorter = torch.argsort(sorter_seq)
    xs = st.distribute_tensor(x, m, *lay)
    er = st.distribute_tensor(edges, m, [st.Replicate()])
    with st.use_strict():
        before = sum(st.comm_stats()["calls"].values())
        outs = [torch.bucketize(xs, edges), torch.bucketize(xs, edges, right=True, out_int32=True),
                torch.searchsorted(edges, xs), torch.searchsorted(edges, xs, side="right"),
                torch.searchsorted(sorter_seq, xs, sorter=sorter),
                torch.bucketize(xs, er)]
        assert sum(st.comm_stats()["calls"].values()) == before, "a lookup communicated"
    refs = [torch.bucketize(x, edges), torch.bucketize(x, edges, right=True, out_int32=True),
            torch.searchsorted(edges, x), torch.searchsorted(edges, x, side="right"),
            torch.searchsorted(sorter_seq, x, sorter=sorter), torch.bucketize(x, edges)]
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert st.placements(o) == (st.Shard(1),), i
        assert o.dtype == r.dtype and torch.equal(full(o), r), i
    with st.use_strict():
        # A sharded 1-D sequence is a lookup table: gathered (one all-gather), the result laid out like the input;
        # a plain input with it gives a Replicate result.
        es = st.distribute_tensor(edges, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(5, m.size(), seed + 1)})
        out = torch.bucketize(xs, es)
        assert st.placements(out) == (st.Shard(1),) and torch.equal(full(out), torch.bucketize(x, edges))
        assert torch.equal(full(torch.searchsorted(es, x)), torch.searchsorted(edges, x))
        # An N-D sequence pairs its leading dims with the input's: cut or redistributed to the input's layout
        seqs = torch.sort(randn(3, 7, 6, seed=seed + 2), -1).values
        for seq_lay in (None, lay, ([st.Shard(0)], None), ([st.Shard(2)], None)):
            sq = seqs if seq_lay is None else st.distribute_tensor(seqs, m, *seq_lay)
            for right in (False, True):
                out = torch.searchsorted(sq, xs, right=right)
                assert st.placements(out) == (st.Shard(1),)
                assert torch.equal(full(out), torch.searchsorted(seqs, x, right=right)), seq_lay
        # the input split along its last dim (the values of one row): the sequence's rows stay whole
        xl = st.distribute_tensor(x, m, [st.Shard(2)])
        assert torch.equal(full(torch.searchsorted(seqs, xl)), torch.searchsorted(seqs, x))
        # isin: membership in a whole, replicated or split set; a scalar's membership in split test elements
        ints = torch.arange(21).reshape(3, 7) % 5
        ints_s = st.distribute_tensor(ints, m, *lay)
        test = torch.tensor([4, 1, 7])
        test_s = st.distribute_tensor(test, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(3, m.size(), seed)})
        for tt in (test, test_s):
            for invert in (False, True):
                out = torch.isin(ints_s, tt, invert=invert)
                assert st.placements(out) == (st.Shard(1),)
                assert torch.equal(full(out), torch.isin(ints, test, invert=invert))
        assert torch.equal(full(torch.isin(ints_s, 3)), torch.isin(ints, 3))
        for v in (7, 2):
            for invert in (False, True):
                got = torch.isin(v, test_s, invert=invert)
                assert torch.equal(full(got), torch.isin(v, test, invert=invert)), (v, invert)
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bucketize_searchsorted(world):
    harness.run(world, case_bucketize_searchsorted, world)


def case_host_read_arguments():
    """Composite ops that read an argument tensor on the host: tensor_split with its index tensor split, ctc_loss
    with its length tensors split; the whole value is used, in strict mode, and the split input keeps its layout."""
    import torch.nn.functional as F
    m = mesh()
    w = m.size()
    x = randn(3, 11, seed=1)
    idx = torch.tensor([2, 5, 7, 9])
    ilay = ([st.Shard(0)], {0: tiny_extents(4, w)})
    with st.use_strict():
        for xlay in (([st.Shard(1)], {0: uneven_extents(11, w, 2)}), None):
            xs = st.distribute_tensor(x, m, *xlay) if xlay else x
            got = torch.tensor_split(xs, st.distribute_tensor(idx, m, *ilay), dim=1)
            ref = torch.tensor_split(x, idx, dim=1)
            assert len(got) == len(ref)
            for a, b in zip(got, ref):
                assert torch.equal(full(a), b)
        T, N, C, S = 12, 3, 5, 4
        log_probs = randn(T, N, C, seed=3).log_softmax(2)
        targets = torch.randint(1, C, (N, S), generator=torch.Generator().manual_seed(4))
        in_len, tgt_len = torch.tensor([12, 10, 11]), torch.tensor([4, 2, 3])
        nlay = ([st.Shard(0)], {0: tiny_extents(3, w)})
        for red in ("mean", "sum", "none"):
            got = F.ctc_loss(log_probs, targets, st.distribute_tensor(in_len, m, *nlay),
                             st.distribute_tensor(tgt_len, m, *nlay), reduction=red)
            torch.testing.assert_close(full(got), F.ctc_loss(log_probs, targets, in_len, tgt_len, reduction=red))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_host_read_arguments(world):
    harness.run(world, case_host_read_arguments)


def case_routed_reads(seed, tiny):
    """Reads of a sharded dim by a whole index stay divided (a routed read): a masked autoencoder's kept tokens
    (`gather` with an expanded index, `x[arange(B)[:, None], ids]`), PointNet++'s grouped points (a 3-D index), a
    1-D index under a leading dim (`x[:, idx]`, `index_select`), non-adjacent indices, negative indices, a bool mask,
    int and bool payloads: the result is split along the index's largest dim (the default split), one all-to-all
    forward and one backward, and no rank allocates a plain tensor whole along the read dim in either pass."""
    m = mesh()
    w = m.size()
    B, N, C, K = 2, 13, 4, 7
    x = randn(B, N, C, seed=seed)
    lay = _lay(x.shape, 1, w, seed, tiny)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)])  # the kept tokens of each sample
    grouped = torch.randint(0, N, (B, 5, 3), generator=g)                    # PointNet++'s groups (duplicates)
    split_k = [len(c) for c in torch.arange(K).tensor_split(w)]
    cases = {
        "MAE gather": (lambda t: torch.gather(t, 1, ids.unsqueeze(-1).expand(-1, -1, C)), (st.Shard(1),), split_k),
        "x[arange(B)[:, None], ids]": (lambda t: t[torch.arange(B)[:, None], ids], (st.Shard(1),), split_k),
        "index_points, 3-D index": (lambda t: t[torch.arange(B).view(B, 1, 1), grouped], (st.Shard(1),),
                                    [len(c) for c in torch.arange(5).tensor_split(w)]),
        "x[:, idx] (B > 1)": (lambda t: t[:, ids[0]], (st.Shard(1),), split_k),
        "index_select": (lambda t: t.index_select(1, ids[1]), (st.Shard(1),), split_k),
        "negative indices": (lambda t: t[:, ids[0] - N], (st.Shard(1),), split_k),
    }
    with st.use_strict():
        for what, (fn, placements, extents) in cases.items():
            out = check_op(fn, [x], [lay], m, what=what, expect_placements=placements)
            assert st.sharding_shapes(out) == {0: extents}, (what, st.sharding_shapes(out))
            xs = st.distribute_tensor(x, m, *lay).requires_grad_()
            st.reset_comm_stats()
            y = fn(xs)
            assert st.comm_stats()["calls"] == ({"all_gather": 1, "all_to_all": 1} if w > 1 else {}), \
                (what, st.comm_stats())
            st.reset_comm_stats()
            # Floating values only; meta tensors (shapes only) allocate nothing.
            with LargestPlain(counts=lambda t: t.is_floating_point() and t.device.type != "meta") as watch:
                (y * y).sum().backward()
            if w > 1:
                # One all-to-all sends the gradient home (index_select's backward, an index_add by the whole
                # index, checks the index's agreement in one small all-gather too); nothing is gathered whole.
                calls = st.comm_stats()["calls"]
                assert calls.get("all_to_all", 0) == 1, (what, st.comm_stats())
                assert calls.get("all_gather", 0) == (1 if what == "index_select" else 0), (what, st.comm_stats())
                assert st.comm_stats()["bytes"].get("all_gather", 0) <= 64, (what, st.comm_stats())
                # The largest legitimate plain tensor: a block of the input or of the result (never the whole dim).
                bound = max(B * C * max(lay[1][0]), out.numel() // out.shape[1] * max(extents))
                assert bound < x.numel(), (what, bound)
                assert watch.numel <= bound, (what, watch.numel, bound)
        # Non-adjacent indices: the index dims lead the result.
        x3 = randn(N, 3, 6, seed=seed + 1)
        lay3 = _lay(x3.shape, 0, w, seed, tiny)
        check_op(lambda t: t[ids[0], :, ids[1] % 6], [x3], [lay3], m, what="non-adjacent indices",
                 expect_placements=[st.Shard(0)])
        mask = torch.zeros(N, dtype=torch.bool)
        mask[[0, 3, 4, 8, 12]] = True
        check_op(lambda t: t[:, mask], [x], [lay], m, what="bool mask", expect_placements=[st.Shard(1)])
        xi = (x * 10).to(torch.int64)
        check_op(lambda t: t[:, ids[0]], [xi], [lay], m, grad=False, what="int payload")
        check_op(lambda t: torch.gather(t, 1, ids.unsqueeze(-1).expand(-1, -1, C)), [x > 0], [lay], m, grad=False,
                 what="bool payload")
        # Fewer entries than ranks: owners pick, the result is Replicate (a head wants a few tokens whole).
        if w > 1:
            check_op(lambda t: t[:, ids[0, : w - 1]], [x], [lay], m, what="few entries",
                     expect_placements=[st.Replicate()])
    # An empty result reads nothing and checks no index, as on one device.
    check_op(lambda t: t[:, torch.tensor([0, N + 3, 1]), 2:2], [x], [lay], m, what="empty result")
    if w > 1:
        xs = st.distribute_tensor(x, m, *lay)
        with pytest.raises(IndexError, match="out of range"):
            xs[:, torch.tensor([0, N, 1, 2])]
        with pytest.raises(IndexError, match="out of range"):
            torch.gather(xs, 1, torch.full((B, 4, C), N))
    return True


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, True), (4, False)])
def test_routed_reads(world, tiny):
    harness.run(world, case_routed_reads, world, tiny)


def case_disagreeing_index(seed):
    """A plain index drawn per rank (a masked autoencoder's token choice from unseeded ranks) differs between the
    ranks: the routed read's agreement check raises the same ValueError on every rank instead of leaving them
    waiting in an all-to-all of mismatched sizes."""
    m = mesh()
    x = st.distribute_tensor(randn(2, 12, 4, seed=seed), m, [st.Shard(1)])
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    ids = torch.multinomial(torch.ones(2, 12), 6, generator=g)
    x[torch.arange(2)[:, None], ids]
    return True


def test_disagreeing_index_raises_everywhere():
    errors = harness.expect_error(3, case_disagreeing_index, 0, kinds=("ValueError",))
    assert len(errors) == 3
    for kind, msg, _ in errors.values():
        assert "different values on different ranks" in msg, msg


def case_errors_everywhere(which):
    """Argument errors a fuzz of the routed reads found raised on some ranks only: each must raise on every rank."""
    if which == "gather_oob_2x2":
        # The gather dim split on one mesh dim, another dim on the other: the whole plain index is checked whole.
        m = mesh((2, 2), ("a", "b"))
        xs = st.distribute_tensor(randn(4, 6), m, [st.Shard(1), st.Shard(0)])
        index = torch.zeros(4, 3, dtype=torch.long)
        index[0, 0] = 6
        torch.gather(xs, 1, index)
    elif which == "index_put_dtype":
        # A rank holding none of the written entries runs no local kernel: the dtype check is made everywhere.
        m = mesh()
        xs = st.distribute_tensor(randn(2, 6, dtype=torch.float64), m, [st.Shard(1)],
                                  sharding_shapes={0: [6] + [0] * (m.size() - 1)})
        xs.index_put((torch.arange(2)[:, None], torch.tensor([[0, 1]])), torch.ones(2, 2))
    elif which == "broadcast":
        m = mesh()
        xs = st.distribute_tensor(randn(3, 5, 4), m, [st.Shard(1)])
        xs[:, torch.tensor([0, 1, 2, 3, 0, 1, 2]), torch.tensor([True, False, True, True])]
    return True


@pytest.mark.parametrize("which,world,kind,match", [
    ("gather_oob_2x2", 4, "IndexError", "out of range"),
    ("index_put_dtype", 2, "RuntimeError", "dtypes match"),
    ("broadcast", 2, "IndexError", "could not be broadcast together"),
])
def test_errors_raise_everywhere(which, world, kind, match):
    harness.expect_error(world, case_errors_everywhere, which, kinds=(kind,), match=match)


def case_index_select_0d_grad(seed):
    """index_select with a 0-d index along a split dim (a one-row result), forward and gradient."""
    m = mesh()
    x = randn(3, 5, seed=seed)
    check_op(lambda t: torch.index_select(t, 1, torch.tensor(2)), [x], [_lay(x.shape, 1, m.size(), seed)], m,
             what="index_select 0-d index")
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_index_select_0d_grad(world):
    harness.run(world, case_index_select_0d_grad, world)


def case_write_into_pending_reduction(world):
    """Writes into a pending reduction (torchvision's autocontrast: `minimum[maximum == minimum] = 0` into a per-image
    min over split rows; a masked write and a scatter into a pending sum): completed in place first, the value is one
    device's. It raised before ("writing into a Partial tensor")."""
    m = mesh()
    w = m.size()
    x = randn(2, 3, 9, 4, seed=40)
    x[1, 2] = 0.5   # a constant image channel: its max equals its min
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: uneven_extents(9, w, 40)})
    with st.use_strict():
        mn, mx = xs.amin(dim=(-2, -1), keepdim=True), xs.amax(dim=(-2, -1), keepdim=True)
        rmn, rmx = x.amin(dim=(-2, -1), keepdim=True), x.amax(dim=(-2, -1), keepdim=True)
        eq, req = mx == mn, rmx == rmn
        mn[eq] = 0.0
        rmn[req] = 0.0
        close(full(mn), rmn, rtol=0, atol=0, what="masked write into a pending min")
        s, rs = xs.sum(dim=2), x.sum(dim=2)                       # a pending sum over the split rows
        idx = torch.tensor([[[0, 2, 1, 1]] * 3] * 2)
        s.scatter_(1, idx, torch.ones(2, 3, 4))
        rs.scatter_(1, idx, torch.ones(2, 3, 4))
        close(full(s), rs, rtol=1e-6, atol=1e-6, what="scatter_ into a pending sum")
        mx[0, 0, 0, 0] = 7.0
        rmx[0, 0, 0, 0] = 7.0
        close(full(mx), rmx, rtol=0, atol=0, what="index write into a pending max")
    return True


def refuse_write_into_view_of_pending_sum():
    m = mesh()
    s = st.distribute_tensor(randn(2, 5, 4, seed=41), m, [st.Shard(1)]).sum(dim=1)   # pending sum
    with st.use_strict():
        s[0].scatter_(0, torch.tensor([[0, 1, 1, 0]]), torch.ones(1, 4))   # its base would keep the old terms


@pytest.mark.parametrize("world", [2, 3])
def test_write_into_pending_reduction(world):
    harness.run(world, case_write_into_pending_reduction, world)
    harness.expect_error(world, refuse_write_into_view_of_pending_sum, match="a view of a pending reduction",
                         kinds=("NotImplementedError",))
