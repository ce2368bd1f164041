"""Contractions, softmax and embedding against single-device results: token-sharded linear/matmul (uneven
tokens are never flattened away), contracted-dim sharding (Partial), bmm/baddbmm/einsum, nn.Linear parameter
gradients reduced exactly once, softmax over sharded and unsharded dims, embedding with sharded indices."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, uneven_extents


def case_linear(seed):
    m = mesh()
    w = m.size()
    x = randn(3, 7, 6, seed=seed)
    wt, b = randn(5, 6, seed=seed + 1), randn(5, seed=seed + 2)
    tok = ([st.Shard(1)], {0: uneven_extents(7, w, seed)})
    bat = ([st.Shard(0)], {0: uneven_extents(3, w, seed)})
    check_op(F.linear, [x, wt, b], [tok, None, None], m, what="linear tokens")
    check_op(F.linear, [x, wt, b], [bat, None, None], m, what="linear batch")
    check_op(lambda x, w: F.linear(x, w), [x, wt], [tok, None], m, what="linear no bias")
    check_op(lambda x, w: x @ w.t(), [x, wt], [tok, None], m, what="matmul 3-d @ 2-d")
    check_op(lambda x, q: x @ q, [x, b.new_ones(6)], [tok, None], m, what="matmul 3-d @ 1-d")
    # Contracted dim sharded. An output at least as wide as the input per rank (C_in / P <= C_out): the split moves to
    # the largest leading dim first (the tokens; one all-to-all) and the output is divided; a narrow output keeps a
    # pending sum, resolved on use.
    feat = ([st.Shard(2)], {0: uneven_extents(6, w, seed + 3)})
    moved = [st.Shard(1)] if w > 1 else [st.Partial()]
    check_op(F.linear, [x, wt, b], [feat, None, None], m, what="linear contracted sharded", expect_placements=moved)
    check_op(lambda x, w: F.linear(x, w), [x, wt], [feat, None], m, what="no bias", expect_placements=moved)
    if w > 1:
        check_op(F.linear, [x, wt[:1], b[:1]], [feat, None, None], m, what="linear contracted sharded, narrow",
                 expect_placements=[st.Partial()])
        xs = st.distribute_tensor(x, m, *feat[:1], sharding_shapes=feat[1])
        with st.CommCounter() as c:
            F.linear(xs, wt, b)
        assert c.calls == {"all_to_all": 1}, c.calls
    a2, b2 = randn(7, 6, seed=seed + 4), randn(6, 4, seed=seed + 5)
    check_op(torch.mm, [a2, b2], [([st.Shard(0)], None), None], m, what="mm rows")
    check_op(torch.mm, [a2, b2], [None, ([st.Shard(1)], None)], m, what="mm cols")
    check_op(torch.mm, [a2, b2], [([st.Shard(1)], None), ([st.Shard(0)], None)], m, what="mm contracted")
    check_op(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), [randn(4, seed=1), a2, b2],
             [None, ([st.Shard(1)], None), None], m, what="addmm partial bias once")
    p, q = randn(4, 7, 3, seed=seed + 6), randn(4, 3, 5, seed=seed + 7)
    check_op(torch.bmm, [p, q], [([st.Shard(1)], None), None], m, what="bmm")
    check_op(torch.bmm, [p, q], [([st.Shard(0)], None), ([st.Shard(0)], None)], m, what="bmm batch")
    check_op(lambda c, p, q: torch.baddbmm(c, p, q), [randn(4, 7, 5, seed=2), p, q],
             [([st.Shard(1)], None), ([st.Shard(1)], None), None], m, what="baddbmm")
    check_op(lambda p, q: torch.einsum("bik,bkj->bij", p, q), [p, q], [([st.Shard(1)], None), None], m, what="einsum")
    return True


def case_batched_matmul_inner_shard(seed):
    """(B, heads, windows, N, d) @ (B, heads, windows, d, N) with the windows sharded in both (Pangu/FengWu's 3-D
    window attention): local per rank, the output sharded like the windows (the decomposition's batch merge used
    to redistribute onto the heads dim, two all-to-alls per product, and the head merge after it ended Partial)."""
    m = mesh()
    w = m.size()
    q, k = randn(2, 3, 7, 4, 5, seed=seed), randn(2, 3, 7, 5, 4, seed=seed + 1)
    win = ([st.Shard(2)], {0: uneven_extents(7, w, seed)})
    check_op(torch.matmul, [q, k], [win, win], m, what="matmul inner batch shard", expect_placements=[st.Shard(2)])
    qs = st.distribute_tensor(q, m, [st.Shard(2)], sharding_shapes=win[1])
    ks = st.distribute_tensor(k, m, [st.Shard(2)], sharding_shapes=win[1])
    with st.CommCounter() as c:
        out = qs @ ks
    assert c.total_calls == 0, c.calls
    assert st.sharding_shapes(out) == st.sharding_shapes(qs), (st.sharding_shapes(out), st.sharding_shapes(qs))
    # A 2-D mesh: the windows on one mesh dim; heads and windows on both (values only: the decomposition's own
    # path); a different split of one operand (likewise).
    if w == 4:
        m2 = mesh((2, 2))
        one = ([st.Replicate(), st.Shard(2)], {1: uneven_extents(7, 2, seed)})
        check_op(torch.matmul, [q, k], [one, one], m2, what="matmul inner batch shard, 2-D mesh",
                 expect_placements=[st.Replicate(), st.Shard(2)])
        two = ([st.Shard(1), st.Shard(2)], {0: uneven_extents(3, 2, seed), 1: uneven_extents(7, 2, seed + 1)})
        check_op(torch.matmul, [q, k], [two, two], m2, what="matmul two inner batch shards")
    if w > 1:
        other = ([st.Shard(2)], {0: list(reversed(uneven_extents(7, w, seed)))})
        check_op(torch.matmul, [q, k], [win, other], m, what="matmul batch shards split differently")


def case_einsum_split_labels(seed):
    """torch.einsum with split operands keeps each split on its label: a split free label (torch-harmonics'
    `bgckxy,gock->bgoxy` of a latitude-split field) stays split with no communication (ATen's decomposition merged it
    behind the batch label and re-laid the operand out); a split contracted label leaves a pending sum with no
    communication (a spherical harmonic transform's Legendre contraction `...km,mlk->...lm`, an integral over the
    split dim); ellipses, uneven and empty shards, 2-D mesh."""
    m = mesh()
    w = m.size()
    x = randn(2, 1, 3, 4, 7, 5, seed=seed)
    wt = randn(1, 6, 3, 4, seed=seed + 1)
    split_x = ([st.Shard(4)], {0: uneven_extents(7, w, seed)})
    eq = "bgckxy,gock->bgoxy"
    out = check_op(lambda a, b: torch.einsum(eq, a, b), [x, wt], [split_x, None], m, what=eq,
                   expect_placements=[st.Shard(3)])
    xs = st.distribute_tensor(x, m, [st.Shard(4)], sharding_shapes=split_x[1])
    with st.CommCounter() as c:
        torch.einsum(eq, xs, wt)
    assert c.total_calls == 0, c.calls
    # The Legendre contraction over a split latitude k (ellipsis): a pending sum, nothing moved.
    f, leg = randn(2, 3, 9, 6, seed=seed + 2), randn(6, 5, 9, seed=seed + 3)
    split_k = ([st.Shard(2)], {0: uneven_extents(9, w, seed + 1)})
    eq = "...km,mlk->...lm"
    out = check_op(lambda a, b: torch.einsum(eq, a, b), [f, leg], [split_k, None], m, what=eq)
    fs = st.distribute_tensor(f, m, [st.Shard(2)], sharding_shapes=split_k[1])
    with st.CommCounter() as c:
        spec = torch.einsum(eq, fs, leg)
    if w > 1:
        assert st.placements(spec) == (st.Partial(),), st.placements(spec)
    assert not c.calls, c.calls
    # A split m (an output label the other operand shares) stays split.
    check_op(lambda a, b: torch.einsum("...lm,mlk->...km", a, b), [randn(2, 3, 5, 6, seed=seed + 4), leg],
             [([st.Shard(3)], {0: uneven_extents(6, w, seed + 2)}), None], m, what="inverse",
             expect_placements=[st.Shard(3)])
    # A small output (an integral over the split dim): a pending sum, nothing moved.
    g = randn(3, 7, 5, seed=seed + 5)
    eq = "bchw,chw->bc"
    out = check_op(lambda a, b: torch.einsum(eq, a, b), [randn(2, 3, 7, 5, seed=seed + 6), g],
                   [([st.Shard(2)], {0: uneven_extents(7, w, seed + 3)}), None], m, what=eq)
    if w > 1:
        assert st.placements(out) == (st.Partial(),), st.placements(out)
    # Both operands split alike on the contracted label: local partial sums.
    a2, b2 = randn(4, 9, seed=seed + 7), randn(9, 3, seed=seed + 8)
    ext = uneven_extents(9, w, seed + 4)
    out = check_op(lambda a, b: torch.einsum("ik,kj->ij", a, b), [a2, b2],
                   [([st.Shard(1)], {0: ext}), ([st.Shard(0)], {0: ext})], m, what="ik,kj->ij")
    if w > 1:
        assert st.placements(out) == (st.Partial(),), st.placements(out)
    if w == 4:  # 2-D mesh: height split on one mesh dim, batch or nothing on the other
        m2 = mesh((2, 2))
        h = randn(4, 3, 6, 5, seed=seed + 9)
        check_op(lambda a, b: torch.einsum("bchw,dc->bdhw", a, b), [h, randn(2, 3, seed=seed + 10)],
                 [([st.Replicate(), st.Shard(2)], {1: [4, 2]}), None], m2, what="2-D mesh, height",
                 expect_placements=[st.Replicate(), st.Shard(2)])
        # Two split labels of one operand, which ATen's decomposition would merge into one group (and gather one):
        # the blocks' own einsum, no communication. Free labels (kornia's colour transforms, a batch and a height),
        # batch labels with a plain weight (a spectral layer's modes, complex, a zero block), a contracted one (a
        # pending sum), an operand holding a split label unsplit (cut to the block).
        kernel = randn(2, 3, seed=seed + 10)
        spectrum = torch.complex(randn(3, 4, 5, 3, seed=seed + 11), randn(3, 4, 5, 3, seed=seed + 12))
        weight = torch.complex(randn(4, 2, 5, 3, seed=seed + 13), randn(4, 2, 5, 3, seed=seed + 14))
        cases = [
            ("oi,...ihw->...ohw", [kernel, h], [None, ([st.Shard(2), st.Shard(3)], {0: [4, 2], 1: [1, 4]})],
             (st.Shard(2), st.Shard(3))),
            ("bchw,dc->bdhw", [h, kernel], [([st.Shard(0), st.Shard(2)], {1: [4, 2]}), None],
             (st.Shard(0), st.Shard(2))),
            ("bixy,ioxy->boxy", [spectrum, weight], [([st.Shard(2), st.Shard(3)], {0: [5, 0], 1: [2, 1]}), None],
             (st.Shard(2), st.Shard(3))),
            ("bixy,ioxy->boxy", [spectrum.real.contiguous(), weight.real.contiguous()],
             [([st.Shard(2), st.Shard(3)], {0: [2, 3], 1: [2, 1]}), None], (st.Shard(2), st.Shard(3))),
            ("bchw,bwk->bhk", [h, randn(4, 5, 2, seed=seed + 15)],
             [([st.Shard(2), st.Shard(3)], {0: [3, 3], 1: [2, 3]}), ([st.Replicate(), st.Shard(1)], {1: [2, 3]})],
             (st.Shard(1), st.Partial())),
            ("bchw,hw->bc", [h, randn(6, 5, seed=seed + 16)], [([st.Shard(2), st.Shard(3)], None), None],
             (st.Partial(), st.Partial())),
        ]
        # A pending sum over the other mesh dim stays pending (a spherical harmonic transform's spectrum, split
        # along the batch, weighted by a plain tensor): ATen's path re-laid the batch out onto the modes.
        pending = randn(4, 3, 5, 6, 7, seed=seed + 17)
        check_op(lambda a, b: torch.einsum("...ilm,oil->...olm", a.sum(-1), b), [pending, randn(2, 3, 5, seed=seed)],
                 [([st.Shard(0), st.Shard(4)], {0: [3, 1], 1: [4, 3]}), None], m2, what="2-D mesh: a pending sum",
                 expect_placements=(st.Shard(0), st.Partial()))
        # Twice differentiable: the local einsum's backward is einsum through the same rule.
        def second(x, k):
            y = torch.einsum("oi,...ihw->...ohw", k, x)
            g, = torch.autograd.grad((y * y).sum(), x, create_graph=True)
            (g * g * g).sum().backward()
        xr, kr, kt = h.clone().requires_grad_(), kernel.clone().requires_grad_(), kernel.clone().requires_grad_()
        xs = st.distribute_tensor(h.clone(), m2, [st.Shard(2), st.Shard(3)]).requires_grad_()
        second(xr, kr)
        second(xs, kt)
        close(full(xs.grad), xr.grad, what="second derivative, input")
        close(kt.grad, kr.grad, what="second derivative, kernel")
        for eq, inputs, lays, placements in cases:
            check_op(lambda *t, eq=eq: torch.einsum(eq, *t), inputs, lays, m2, what="2-D mesh: " + eq,
                     expect_placements=placements)
            args = [st.distribute_tensor(t, m2, *lay) if lay else t for t, lay in zip(inputs, lays)]
            with st.CommCounter() as c:
                torch.einsum(eq, *args)
            assert not c.calls, (eq, c.calls)
    return True


def case_nn_linear_module(seed):
    """An nn.Linear on token-sharded input: weight and bias grads equal single-device, plain tensors."""
    m = mesh()
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4)
    ref = torch.nn.Linear(6, 4)
    ref.load_state_dict(lin.state_dict())
    x = randn(2, 9, 6, seed=seed)
    xs = st.distribute_tensor(x, m, [st.Shard(1)], {0: uneven_extents(9, m.size(), seed)})
    lin(xs).square().mean().backward()
    ref(x).square().mean().backward()
    for (n, p), (_, r) in zip(lin.named_parameters(), ref.named_parameters()):
        assert not st.is_shard_tensor(p.grad), n
        close(p.grad, r.grad, what=n)
    return True


def case_softmax(seed):
    m = mesh()
    x = randn(3, 8, 5, seed=seed)
    tok = ([st.Shard(1)], {0: uneven_extents(8, m.size(), seed)})
    check_op(lambda t: torch.softmax(t, -1), [x], [tok], m, what="softmax unsharded dim")
    check_op(lambda t: torch.log_softmax(t, 0), [x], [tok], m, what="log_softmax unsharded dim")
    check_op(lambda t: torch.softmax(t, 1), [x], [tok], m, what="softmax sharded dim")
    check_op(lambda t: torch.log_softmax(t, 1), [x], [tok], m, what="log_softmax sharded dim")
    return True


def case_embedding(seed):
    m = mesh()
    idx = torch.randint(0, 10, (3, 7), generator=torch.Generator().manual_seed(seed))
    table = randn(10, 4, seed=seed)
    tok = ([st.Shard(1)], {0: uneven_extents(7, m.size(), seed)})
    check_op(lambda i, t: F.embedding(i, t), [idx, table], [tok, None], m, what="embedding")
    w = m.size()
    cols = ([st.Shard(1)], {0: uneven_extents(4, w, seed + 1)})
    rows = ([st.Shard(0)], {0: uneven_extents(10, w, seed + 2)})
    with st.use_strict():
        # Column-parallel table: each rank its own columns, the output sharded on its last dim.
        out = check_op(lambda i, t: F.embedding(i, t), [idx, table], [None, cols], m, what="column-sharded table",
                       expect_placements=[st.Shard(2)])
        check_op(lambda i, t: F.embedding(i, t, padding_idx=3), [idx, table], [tok, cols], m,
                 what="column-sharded table, sharded indices, padding_idx")
        # Row-parallel table: index_select of the rows (fetched from their owners when the indices are sharded on
        # the same mesh dim), its gradient rows sent home.
        check_op(lambda i, t: F.embedding(i, t), [idx, table], [None, rows], m, what="row-sharded table")
        flat = idx.reshape(-1)
        out = check_op(lambda i, t: F.embedding(i, t), [flat, table],
                       [([st.Shard(0)], {0: uneven_extents(21, w, seed + 3)}), rows], m,
                       what="row-sharded table, indices sharded on the same mesh dim", expect_placements=[st.Shard(0)])
        t = st.distribute_tensor(table, m, *rows).requires_grad_(True)
        F.embedding(st.distribute_tensor(flat, m, [st.Shard(0)]), t).sum().backward()
        assert st.placements(t.grad) == (st.Shard(0),) and t.grad.to_local().shape[0] == rows[1][0][m.get_coordinate()[0]]
    # padding_idx with a row-sharded table: its derivative formula (through the fallback where needed).
    check_op(lambda i, t: F.embedding(i, t, padding_idx=2), [idx, table], [None, rows], m,
             what="row-sharded table, padding_idx")
    return True


def case_embedding_max_norm(seed):
    """F.embedding(max_norm=): the rows the ids name are renormalized in place first (embedding_renorm_, which had no
    rule: it raised). Ids split with a plain table: every rank renormalizes the rows of every rank's ids, so the
    table copies stay equal; a table split along rows, columns (the norms completed over the column ranks) or both
    on a 2x2 mesh: each rank its own part. The table after the call and the lookup against one device (p = 2, 1, inf, 0)."""
    world = dist.get_world_size()
    m = mesh((2, 2)) if world == 4 else mesh()
    w = world if world != 4 else 2
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 10, (3, 7), generator=g)
    table = 2 * randn(10, 6, seed=seed)
    layouts = {"ids split, table plain": ((st.Shard(1),) * m.ndim, None, {0: uneven_extents(7, w, seed)}),
               "rows": (None, (st.Shard(0),) + (st.Replicate(),) * (m.ndim - 1), {0: uneven_extents(10, w, seed)}),
               "columns": (None, (st.Shard(1),) + (st.Replicate(),) * (m.ndim - 1), {0: uneven_extents(6, w, seed)})}
    if m.ndim == 2:
        layouts = {"ids split, table plain": ((st.Shard(0), st.Shard(1)), None, {0: [1, 2], 1: [5, 2]}),
                   "rows x columns": (None, (st.Shard(0), st.Shard(1)), {0: [7, 3], 1: [0, 6]}),
                   "ids split, table columns": ((st.Shard(1), st.Replicate()), (st.Replicate(), st.Shard(1)),
                                                {0: [2, 5], 1: [4, 2]})}
    for p in (2.0, 1.0, float("inf"), 0.0):
        for what, (ids_pl, table_pl, ext) in layouts.items():
            ref_table = table.clone()
            ref = F.embedding(idx, ref_table, max_norm=1.5, norm_type=p)
            ids = idx if ids_pl is None else st.distribute_tensor(
                idx, m, list(ids_pl), {k: v for k, v in ext.items() if ids_pl[k].is_shard()})
            t = table.clone() if table_pl is None else st.distribute_tensor(
                table, m, list(table_pl), {k: v for k, v in ext.items() if table_pl[k].is_shard()})
            with st.use_strict():
                out = F.embedding(ids, t, max_norm=1.5, norm_type=p)
            close(full(out), ref, rtol=1e-5, atol=1e-6, what=f"max_norm lookup, {what}, p={p}")
            close(full(t), ref_table, rtol=1e-5, atol=1e-6, what=f"max_norm table, {what}, p={p}")
    return True


def case_embedding_bag(seed):
    """F.embedding_bag / nn.EmbeddingBag with the bags split: a 2-D [bags, L] input split along its bags (every mode,
    padding_idx, per-sample weights split like the input, the table replicated or split along its columns) and 1-D
    indices with offsets split at bag boundaries (include_last_offset, empty bags, a rank without bags), in strict
    mode: each rank its own bags, the table gradient a pending sum. A bag crossing a shard boundary declines (strict
    mode refuses on every rank; the fallback gives one device's value)."""
    m = mesh()
    w = m.size()
    g = torch.Generator().manual_seed(seed)
    table = randn(10, 4, seed=seed)
    idx2 = torch.randint(0, 10, (6, 3), generator=g)
    psw2 = torch.rand(6, 3, generator=g) + 0.5
    bags = ([st.Shard(0)], {0: uneven_extents(6, w, seed)})
    cols = ([st.Shard(1)], {0: uneven_extents(4, w, seed + 1)})
    # 1-D indices: bags of lengths 2, 0, 3, 1, 0, 4 (10 indices); shard boundaries on bag starts
    idx1 = torch.randint(0, 10, (10,), generator=g)
    starts = [0, 2, 2, 5, 6, 6]
    offsets = torch.tensor(starts)
    cuts = {1: [10], 2: [5, 5], 3: [2, 0, 8] if seed % 2 else [5, 1, 4], 4: [2, 3, 1, 4]}[w]
    flat = ([st.Shard(0)], {0: cuts})
    with st.use_strict():
        for mode in ("sum", "mean", "max"):
            check_op(lambda i, t: F.embedding_bag(i, t, mode=mode), [idx2, table], [bags, None], m,
                     what=f"embedding_bag 2-D {mode}")
            check_op(lambda i, t: F.embedding_bag(i, t, mode=mode, padding_idx=3), [idx2, table], [bags, None], m,
                     what=f"embedding_bag 2-D {mode}, padding_idx")
            check_op(lambda i, t: F.embedding_bag(i, t, mode=mode, padding_idx=3), [idx2, table], [None, cols], m,
                     what=f"embedding_bag 2-D {mode}, padding_idx, column-split table")
            check_op(lambda i, t: F.embedding_bag(i, t, offsets, mode=mode), [idx1, table], [flat, None], m,
                     what=f"embedding_bag 1-D {mode}")
            check_op(lambda i, t: F.embedding_bag(i, t, torch.tensor(starts + [10]), mode=mode,
                                                  include_last_offset=True),
                     [idx1, table], [flat, None], m, what=f"embedding_bag 1-D {mode}, include_last_offset")
        check_op(lambda i, t, p: F.embedding_bag(i, t, per_sample_weights=p, mode="sum"), [idx2, table, psw2],
                 [bags, None, bags], m, what="embedding_bag per-sample weights")
        check_op(lambda i, t, p: F.embedding_bag(i, t, per_sample_weights=p, mode="sum", padding_idx=1),
                 [idx2, table, psw2], [None, cols, None], m,
                 what="embedding_bag per-sample weights, padding_idx, column-split table")
        check_op(lambda i, t, p: F.embedding_bag(i, t, offsets, per_sample_weights=p, mode="sum"),
                 [idx1, table, psw2.reshape(-1)[:10]], [flat, None, flat], m,
                 what="embedding_bag 1-D per-sample weights")
        check_op(lambda i, t, p: F.embedding_bag(i, t, torch.tensor(starts + [10]), per_sample_weights=p, mode="sum",
                                                 include_last_offset=True),
                 [idx1, table, psw2.reshape(-1)[:10]], [flat, None, flat], m,
                 what="embedding_bag 1-D per-sample weights, include_last_offset")
        # nn.EmbeddingBag: its weight gradient against one device
        torch.manual_seed(seed)
        ref_mod = torch.nn.EmbeddingBag(10, 4, mode="mean")
        mod = torch.nn.EmbeddingBag(10, 4, mode="mean")
        mod.load_state_dict(ref_mod.state_dict())
        ref_mod(idx2).pow(2).sum().backward()
        out = mod(st.distribute_tensor(idx2, m, *bags))
        assert st.placements(out) == (st.Shard(0),)
        out.pow(2).sum().backward()
        close(full(mod.weight.grad), ref_mod.weight.grad, rtol=1e-5, atol=1e-6, what="EmbeddingBag weight grad")
    if w > 1:
        across = ([st.Shard(0)], {0: [3] + [7 // (w - 1) + (1 if i < 7 % (w - 1) else 0) for i in range(w - 1)]})
        ids = st.distribute_tensor(idx1, m, *across)
        with st.use_strict(), pytest.raises(NotImplementedError, match="crosses a shard boundary"):
            F.embedding_bag(ids, table, offsets)
        check_op(lambda i, t: F.embedding_bag(i, t, offsets), [idx1, table], [across, None], m,
                 what="embedding_bag, a bag across ranks (fallback)")
    return True


def case_embedding_bag_2d(seed):
    """A 2x2 mesh: the bags on one mesh dim, the table's columns on the other (every mode, per-sample weights)."""
    m = mesh((2, 2))
    g = torch.Generator().manual_seed(seed)
    table = randn(10, 5, seed=seed)
    idx = torch.randint(0, 10, (5, 3), generator=g)
    psw = torch.rand(5, 3, generator=g) + 0.5
    bags = ([st.Shard(0), st.Replicate()], {0: [4, 1]})
    cols = ([st.Replicate(), st.Shard(1)], {1: [2, 3]})
    with st.use_strict():
        for mode in ("sum", "mean", "max"):
            check_op(lambda i, t: F.embedding_bag(i, t, mode=mode), [idx, table], [bags, cols], m,
                     what=f"embedding_bag 2x2 {mode}", expect_placements=[st.Shard(0), st.Shard(1)])
        check_op(lambda i, t, p: F.embedding_bag(i, t, per_sample_weights=p, mode="sum"), [idx, table, psw],
                 [bags, cols, bags],
                 m, what="embedding_bag 2x2 per-sample weights")
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_embedding_max_norm(world):
    harness.run(world, case_embedding_max_norm, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_linear(world):
    harness.run(world, case_linear, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_batched_matmul_inner_shard(world):
    harness.run(world, case_batched_matmul_inner_shard, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_einsum_split_labels(world):
    assert all(harness.run(world, case_einsum_split_labels, 5))


@pytest.mark.parametrize("world", [2, 3])
def test_nn_linear_module(world):
    harness.run(world, case_nn_linear_module, world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_softmax(world):
    harness.run(world, case_softmax, world)


@pytest.mark.parametrize("world", [2, 3])
def test_embedding(world):
    harness.run(world, case_embedding, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_embedding_bag(world):
    harness.run(world, case_embedding_bag, world)


def test_embedding_bag_2d():
    harness.run(4, case_embedding_bag_2d, 4)


def case_bilinear(world):
    """F.bilinear / nn.Bilinear (aten::_trilinear, forward and backward): rows split (the output's rows, the weight's
    gradient a partial sum), one input whole, a 3-D input, the weight split along its output features, an empty
    batch with the features split."""
    m = mesh()
    d64 = dict(dtype=torch.float64)
    tight = dict(rtol=1e-9, atol=1e-10)
    a, b = randn(7, 4, seed=1, **d64), randn(7, 3, seed=2, **d64)
    w, bias = randn(5, 4, 3, seed=3, **d64), randn(5, seed=4, **d64)
    rows = ([st.Shard(0)], {0: uneven_extents(7, world, seed=5)})
    with st.use_strict():
        out = check_op(F.bilinear, [a, b, w, bias], [rows, rows, None, None], m, **tight, what="bilinear rows")
        assert st.placements(out) == (st.Shard(0),)
        check_op(F.bilinear, [a, b, w], [rows, None, None], m, **tight, what="bilinear, one input whole")
        a3, b3 = randn(2, 6, 4, seed=6, **d64), randn(2, 6, 3, seed=7, **d64)
        l3 = ([st.Shard(1)], {0: uneven_extents(6, world, seed=8)})
        check_op(F.bilinear, [a3, b3, w, bias], [l3, l3, None, None], m, **tight, what="bilinear 3-D")
        out = check_op(F.bilinear, [a, b, w, bias], [None, None, ([st.Shard(0)], None), None], m, **tight,
                       what="bilinear, weight split along its outputs")
        assert st.placements(out) == (st.Shard(1),)
        # An empty batch with the first input split along its features: an empty result, no gradient terms.
        e1, e2 = randn(0, 4, seed=9, **d64), randn(0, 3, seed=10, **d64)
        out = check_op(F.bilinear, [e1, e2, w, bias], [([st.Shard(1)], None), None, None, None], m, **tight,
                       what="bilinear, empty batch, features split")
        assert tuple(out.shape) == (0, 5)
        torch.manual_seed(0)   # the same parameters on every rank
        layer = torch.nn.Bilinear(4, 3, 5).double()
        check_op(lambda x, y: layer(x, y), [a, b], [rows, rows], m, **tight, what="nn.Bilinear")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_bilinear(world):
    harness.run(world, case_bilinear, world)


def case_addbmm(world):
    """addbmm (beta * self + alpha * the batch sum of batch1 @ batch2) from the rules of bmm, sum and add, strict mode:
    `self` split on its rows with plain batches; batch1 split on its rows (the result split alike); the batch split
    (each rank's products a pending sum); beta = 0 ignores a NaN in self; values and gradients of every input."""
    m = mesh()
    s, b1, b2 = randn(5, 6, seed=80), randn(4, 5, 3, seed=81), randn(4, 3, 6, seed=82)
    rows = ([st.Shard(0)], {0: uneven_extents(5, world, seed=83)})
    batch = ([st.Shard(0)], {0: uneven_extents(4, world, seed=84)})
    b1_rows = ([st.Shard(1)], {0: uneven_extents(5, world, seed=83)})
    with st.use_strict():
        check_op(lambda a, p, q: torch.addbmm(a, p, q, beta=0.5, alpha=2.0), [s, b1, b2], [rows, None, None], m,
                 what="addbmm, self split")
        out = check_op(lambda a, p, q: torch.addbmm(a, p, q), [s, b1, b2], [rows, b1_rows, None], m,
                       what="addbmm, batch1's rows split")
        assert st.placements(out) == (st.Shard(0),), st.placements(out)
        check_op(lambda a, p, q: torch.addbmm(a, p, q), [s, b1, b2], [None, batch, batch], m,
                 what="addbmm, the batch split")
        check_op(lambda a, p, q: torch.addbmm(a, p, q), [s[0], b1, b2], [([st.Replicate()], None), batch, batch], m,
                 what="addbmm, self broadcast")
        bad = s.clone()
        bad[1, 2] = float("nan")
        got = torch.addbmm(st.distribute_tensor(bad, m, *rows), b1, b2, beta=0)
        close(st.full_tensor(got), torch.addbmm(bad, b1, b2, beta=0), what="addbmm beta=0")
        # Integer tensors: torch takes beta and alpha as integers (0.6 -> 0, 2.7 -> 2); the result stays int64.
        g = torch.Generator().manual_seed(85)
        si, p1, p2 = (torch.randint(-4, 5, t.shape, generator=g) for t in (s, b1, b2))
        for beta, alpha in [(0.6, 2.7), (3, 1)]:
            got = torch.addbmm(st.distribute_tensor(si, m, *rows), p1, p2, beta=beta, alpha=alpha)
            want = torch.addbmm(si, p1, p2, beta=beta, alpha=alpha)
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            assert torch.equal(st.full_tensor(got), want), f"integer addbmm beta={beta} alpha={alpha}"
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_addbmm(world):
    harness.run(world, case_addbmm, world)
