"""scaled_dot_product_attention with the sequence sharded, against single-device F.scaled_dot_product_attention:
outputs and q/k/v gradients; ring and head-parallel all-to-all strategies; uneven shards (a rank with one token,
zero-extent ranks), causal, boolean/additive masks (plain and sharded with the queries), scale, GQA,
cross-attention with independent shards, q-replicated and k/v-replicated layouts, 2-D meshes, bf16,
nn.MultiheadAttention, learned attention biases (mask gradients), batch-only (window) sharding without
communication, and the refusals (dropout, sharded head dim, mismatched meshes)."""
import pytest
import torch
import torch.nn.attention
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_grad_layout, check_op, close, full, mesh, randn, rank, tiny_extents, uneven_extents

TOL = dict(rtol=1e-4, atol=1e-5)


def seq(n, k, kind):
    ext = tiny_extents(n, k) if kind == "tiny" else uneven_extents(n, k, seed=n) if kind == "uneven" else None
    return ([st.Shard(2)], {0: ext} if ext else None)


def sdpa(**kw):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)


def case_self(strategy, kind):
    m = mesh()
    w = m.size()
    prev = st.set_attention_strategy(strategy)
    try:
        q, k, v = randn(2, 4, 11, 8, seed=1), randn(2, 4, 11, 8, seed=2), randn(2, 4, 11, 8, seed=3)
        lay = seq(11, w, kind)
        for causal in (False, True):
            check_op(sdpa(is_causal=causal), [q, k, v], [lay, lay, lay], m, **TOL,
                     what=f"{strategy} {kind} causal={causal}", expect_placements=lay[0])
        check_op(sdpa(scale=0.7, is_causal=True), [q, k, v], [lay, lay, lay], m, **TOL, what=f"{strategy} scale")
        # q and k/v with different (independent) extents of the same sequence.
        other = ([st.Shard(2)], {0: uneven_extents(11, w, seed=5)})
        check_op(sdpa(is_causal=True), [q, k, v], [lay, other, other], m, **TOL, what=f"{strategy} q/kv extents")
    finally:
        st.set_attention_strategy(prev)
    return True


def case_masks(strategy):
    m = mesh()
    w = m.size()
    prev = st.set_attention_strategy(strategy)
    try:
        q, k, v = randn(2, 4, 10, 8, seed=4), randn(2, 4, 10, 8, seed=5), randn(2, 4, 10, 8, seed=6)
        lay = seq(10, w, "tiny")
        g = torch.Generator().manual_seed(7)
        bmask = (torch.rand(2, 1, 10, 10, generator=g) > 0.4) | torch.eye(10, dtype=torch.bool)
        amask = randn(10, 10, seed=8)
        hmask = randn(2, 4, 10, 10, seed=9)
        for name, mk in (("bool", bmask), ("additive", amask), ("per-head additive", hmask)):
            check_op(sdpa(attn_mask=mk), [q, k, v], [lay, lay, lay], m, **TOL, what=f"{strategy} plain {name}")
            # The mask as a ShardTensor sharded with the queries.
            ms = st.distribute_tensor(mk, m, [st.Shard(mk.dim() - 2)], {0: lay[1][0]} if lay[1] else None)
            check_op(lambda q, k, v, mk=mk, ms=ms: F.scaled_dot_product_attention(
                q, k, v, attn_mask=ms if st.is_shard_tensor(q) else mk), [q, k, v], [lay, lay, lay], m, **TOL,
                what=f"{strategy} sharded {name}")
        check_op(sdpa(attn_mask=amask, is_causal=True), [q, k, v], [lay, lay, lay], m, **TOL,
                 what=f"{strategy} mask+causal")
        # A float64 query with a float32 additive mask (EoMT's `attention_mask.float()` in a float64 model): added in
        # the scores' dtype, exactly. torch 2.11's CPU flash kernel reads such a mask wrongly, so the one-device
        # reference is the math backend's.
        m32 = amask.float()

        def float32_mask(q, k, v):
            if st.is_shard_tensor(q):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m32)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m32)
        check_op(float32_mask, [q.double(), k.double(), v.double()], [lay, lay, lay], m,
                 what=f"{strategy} float64 query, float32 mask")
    finally:
        st.set_attention_strategy(prev)
    return True


def case_gqa_cross(strategy):
    m = mesh()
    w = m.size()
    prev = st.set_attention_strategy(strategy)
    try:
        # Grouped-query attention: 4 query heads, 2 key/value heads.
        q, k, v = randn(2, 4, 9, 8, seed=10), randn(2, 2, 9, 8, seed=11), randn(2, 2, 9, 8, seed=12)
        lay = seq(9, w, "uneven")
        for causal in (False, True):
            check_op(sdpa(is_causal=causal, enable_gqa=True), [q, k, v], [lay, lay, lay], m, **TOL,
                     what=f"{strategy} gqa causal={causal}")
        # Multi-query attention (MobileNetV4's hybrid blocks): one key/value head broadcast over the query heads,
        # as torch does without enable_gqa; key/value sharded like the query, or whole
        k1, v1 = randn(2, 1, 9, 8, seed=17), randn(2, 1, 9, 8, seed=18)
        check_op(sdpa(), [q, k1, v1], [lay, lay, lay], m, **TOL, what=f"{strategy} multi-query")
        check_op(sdpa(is_causal=True), [q, k1, v1], [lay, None, None], m, **TOL, what=f"{strategy} multi-query, whole kv")
        # the query heads split (not in whole groups): each rank's heads read the one key/value head
        heads = ([st.Shard(1)], {0: [1, 3] if w == 2 else [1, 1, 1, 1][:w - 1] + [4 - (w - 1)]})
        check_op(sdpa(), [q, k1, v1], [heads, None, None], m, **TOL, what=f"{strategy} multi-query, heads split")
        check_op(sdpa(enable_gqa=True), [q, k, v], [heads, None, None], m, **TOL, what=f"{strategy} gqa, heads split")
        # Cross-attention: Sq=7, Skv=12, value dim 6, independent shard extents.
        q, k, v = randn(1, 2, 7, 8, seed=13), randn(1, 2, 12, 8, seed=14), randn(1, 2, 12, 6, seed=15)
        lq, lkv = seq(7, w, "tiny"), seq(12, w, "uneven")
        for causal in (False, True):
            check_op(sdpa(is_causal=causal), [q, k, v], [lq, lkv, lkv], m, **TOL, what=f"{strategy} cross causal={causal}")
        mk = randn(7, 12, seed=16)
        check_op(sdpa(attn_mask=mk), [q, k, v], [lq, lkv, lkv], m, **TOL, what=f"{strategy} cross mask")
    finally:
        st.set_attention_strategy(prev)
    return True


def case_replicated_sides():
    m = mesh()
    w = m.size()
    q, k, v = randn(2, 2, 9, 8, seed=20), randn(2, 2, 13, 8, seed=21), randn(2, 2, 13, 8, seed=22)
    lq, lkv = seq(9, w, "tiny"), seq(13, w, "uneven")
    rep = ([st.Replicate()], None)
    for causal in (False, True):
        # k/v replicated (plain and Replicate ShardTensors), q sharded: local attention, dK/dV all-reduced.
        check_op(sdpa(is_causal=causal), [q, k, v], [lq, None, None], m, **TOL, what=f"kv plain causal={causal}")
        check_op(sdpa(is_causal=causal), [q, k, v], [lq, rep, rep], m, **TOL, what=f"kv replicated causal={causal}",
                 expect_placements=lq[0])
        # q replicated, k/v sharded: the output keeps q's layout.
        check_op(sdpa(is_causal=causal), [q, k, v], [rep, lkv, lkv], m, **TOL, what=f"q replicated causal={causal}",
                 expect_placements=[st.Replicate()])
        check_op(sdpa(is_causal=causal), [q, k, v], [None, lkv, lkv], m, **TOL, what=f"q plain causal={causal}")
    # Batch-sharded (no sequence sharding): local.
    bat = ([st.Shard(0)], None)
    check_op(sdpa(is_causal=True), [q, k, v], [bat, bat, bat], m, **TOL, what="batch sharded")
    # q replicated or plain (learned latents, a Perceiver), k/v split along the batch or the heads: every output row
    # needs its own q, k, v rows only, so the output keeps k/v's split as a broadcast elementwise op does -- no
    # gather (Aurora's level aggregation gathered its tokens here).
    qb, kb, vb = randn(5, 3, 4, 8, seed=23), randn(5, 3, 6, 8, seed=24), randn(5, 3, 6, 8, seed=25)
    for d in (0, 1):
        lay = ([st.Shard(d)], None)
        for q_lay, name in ((rep, "replicated"), (None, "plain")):
            check_op(sdpa(), [qb, kb, vb], [q_lay, lay, lay], m, **TOL, what=f"q {name}, k/v Shard({d})",
                     expect_placements=[st.Shard(d)])
            qs = qb if q_lay is None else st.distribute_tensor(qb, m, q_lay[0])
            ks, vs = (st.distribute_tensor(t, m, lay[0]) for t in (kb, vb))
            with st.CommCounter() as cc:
                F.scaled_dot_product_attention(qs, ks, vs)
            assert not cc.calls and not cc.replications, f"q {name}, k/v Shard({d}): {cc.calls}"
    # k sharded, v replicated: v is brought to k's layout.
    check_op(sdpa(), [q, k, v], [lq, lkv, rep], m, **TOL, what="k sharded v replicated")
    return True


def case_2d_mesh(strategy):
    m = mesh((2, 2))
    prev = st.set_attention_strategy(strategy)
    try:
        q, k, v = randn(2, 4, 10, 8, seed=30), randn(2, 4, 10, 8, seed=31), randn(2, 4, 10, 8, seed=32)
        lay = ([st.Shard(0), st.Shard(2)], {1: [3, 7]})
        check_op(sdpa(is_causal=True), [q, k, v], [lay, lay, lay], m, **TOL, what=f"2-d batch x seq {strategy}")
        # Heads sharded on the other mesh dim: the all-to-all cannot re-shard heads; "auto" falls back to the ring.
        lay = ([st.Shard(1), st.Shard(2)], {1: [1, 9]})
        with st.use_attention_strategy("auto" if strategy == "all_to_all" else strategy):
            check_op(sdpa(), [q, k, v], [lay, lay, lay], m, **TOL, what=f"2-d heads x seq {strategy}")
    finally:
        st.set_attention_strategy(prev)
    return True


def case_bf16(strategy):
    m = mesh()
    w = m.size()
    prev = st.set_attention_strategy(strategy)
    try:
        q, k, v = (randn(2, 4, 11, 8, seed=s) for s in (40, 41, 42))
        lay = seq(11, w, "uneven")
        for causal in (False, True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # fp32 single-device reference
            args = [st.distribute_tensor(t.bfloat16(), m, lay[0], lay[1]).requires_grad_() for t in (q, k, v)]
            refs = [t.clone().requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*args, is_causal=causal)
            assert o.dtype == torch.bfloat16
            close(full(o).float(), out, rtol=3e-2, atol=3e-2, what=f"bf16 {strategy} out")
            wt = randn(*out.shape, seed=43)
            (o.float() * wt).sum().backward()
            (F.scaled_dot_product_attention(*refs, is_causal=causal) * wt).sum().backward()
            for a, r in zip(args, refs):
                assert a.grad.dtype == torch.bfloat16
                check_grad_layout(a, what=f"bf16 {strategy} grad")
                close(full(a.grad).float(), r.grad, rtol=5e-2, atol=5e-2, what=f"bf16 {strategy} grad")
    finally:
        st.set_attention_strategy(prev)
    return True


def case_strategy_choice():
    """What each strategy communicates: the ring passes K/V blocks, the all-to-all re-shards heads; auto picks
    the all-to-all when key/value heads divide evenly by the mesh size (and it moves no more bytes)."""
    m = mesh()
    w = m.size()
    q, k, v = (randn(1, 4, 8, 4, seed=s) for s in (50, 51, 52))
    qs, ks, vs = (st.distribute_tensor(t, m, [st.Shard(2)]) for t in (q, k, v))
    kinds = {}
    for strategy in ("ring", "all_to_all", "auto"):
        with st.use_attention_strategy(strategy):
            with st.CommCounter() as c:
                o = F.scaled_dot_product_attention(qs, ks, vs)
            close(full(o), F.scaled_dot_product_attention(q, k, v), **TOL, what=strategy)
            kinds[strategy] = c
    assert st.attention_strategy() == "auto"
    return {s: dict(c.calls) for s, c in kinds.items()}


def case_mha(need_weights, batch_first):
    m = mesh()
    w = m.size()
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)
    ref.load_state_dict(mha.state_dict())
    x = randn(2, 9, 8, seed=60) if batch_first else randn(9, 2, 8, seed=60)
    sd = 1 if batch_first else 0
    xs = st.distribute_tensor(x, m, [st.Shard(sd)], {0: tiny_extents(9, w)}).requires_grad_()
    xr = x.clone().requires_grad_()
    out, wts = mha(xs, xs, xs, need_weights=need_weights)
    out_ref, wts_ref = ref(xr, xr, xr, need_weights=need_weights)
    close(full(out), out_ref, **TOL, what="mha out")
    if need_weights:
        close(full(wts), wts_ref, **TOL, what="mha weights")
    wt = randn(*out_ref.shape, seed=61)
    (out * wt).sum().backward()
    (out_ref * wt).sum().backward()
    check_grad_layout(xs, what="mha input grad")
    close(full(xs.grad), xr.grad, rtol=1e-4, atol=1e-4, what="mha input grad")
    for (n, p), (_, r) in zip(mha.named_parameters(), ref.named_parameters()):
        assert not st.is_shard_tensor(p.grad), n
        close(p.grad, r.grad, rtol=1e-4, atol=1e-4, what=f"mha {n}")
    return True


def case_inference():
    m = mesh()
    w = m.size()
    q, k, v = (randn(1, 2, 7, 4, seed=s) for s in (70, 71, 72))
    qs, ks, vs = (st.distribute_tensor(t, m, [st.Shard(2)], {0: tiny_extents(7, w)}) for t in (q, k, v))
    with torch.inference_mode():
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    close(full(o), F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL, what="inference mode")
    return True


def _rel_bias(table, n):
    """A relative position bias (heads, n, n) gathered from a (2n-1, heads) table, as Swin/CoAtNet/MaxViT do."""
    idx = torch.arange(n).unsqueeze(1) - torch.arange(n).unsqueeze(0) + n - 1
    return table[idx].permute(2, 0, 1)


def case_learned_bias(kind):
    """attn_mask that requires grad: a learned relative position bias (through an index of a plain table, and a
    plain leaf), windows folded into the batch dim (sharded) or the sequence sharded (ring form: keys gathered)."""
    m = mesh()
    w = m.size()
    n = 6
    q, k, v = (randn(5, 2, n, 4, seed=s) for s in (91, 92, 93))
    table = randn(2 * n - 1, 2, seed=94)
    leaf = randn(1, 2, n, n, seed=95)
    lay = ([st.Shard(0)], {0: uneven_extents(5, w, seed=96)}) if kind == "windows" else \
        ([st.Shard(2)], {0: uneven_extents(n, w, seed=97)})
    check_op(lambda a, b, c, t: F.scaled_dot_product_attention(a, b, c, attn_mask=_rel_bias(t, n)),
             [q, k, v, table], [lay, lay, lay, None], m, **TOL, what=f"{kind} gathered bias",
             expect_placements=lay[0])
    check_op(lambda a, b, c, t: F.scaled_dot_product_attention(a, b, c, attn_mask=t, scale=0.3),
             [q, k, v, leaf], [lay, lay, lay, None], m, **TOL, what=f"{kind} leaf bias")
    # GQA with a learned bias.
    k2, v2 = randn(5, 1, n, 4, seed=98), randn(5, 1, n, 4, seed=99)
    check_op(lambda a, b, c, t: F.scaled_dot_product_attention(a, b, c, attn_mask=t, enable_gqa=True),
             [q, k2, v2, leaf], [lay, lay, lay, None], m, **TOL, what=f"{kind} gqa leaf bias")
    return True


def case_batch_only_is_local():
    """Windows folded into the batch dim: with only that dim sharded attention is local, forward and backward (no
    collective), with a plain mask too, and the output keeps the batch shards."""
    m = mesh()
    w = m.size()
    q, k, v = (randn(7, 2, 5, 4, seed=s) for s in (100, 101, 102))
    mask = randn(2, 5, 5, seed=103)
    ext = {0: uneven_extents(7, w, seed=104)}
    qs, ks, vs = (st.distribute_tensor(t, m, [st.Shard(0)], ext).requires_grad_() for t in (q, k, v))
    for strategy in ("auto", "ring", "all_to_all"):
        with st.use_attention_strategy(strategy):
            with st.CommCounter() as c:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
                o.backward(torch.ones_like(o))
            assert c.total_calls == 0, f"{strategy}: batch-sharded attention communicated: {dict(c.calls)}"
            assert st.placements(o) == (st.Shard(0),)
            close(full(o), F.scaled_dot_product_attention(q, k, v, attn_mask=mask), **TOL, what=strategy)
    return True


# ---- refusals (must raise on every rank) ----

def _qkv(m, placements=(st.Shard(2),)):
    return [st.distribute_tensor(randn(1, 2, 6, 4, seed=s), m, list(placements)) for s in (80, 81, 82)]


def case_err_dropout():
    q, k, v = _qkv(mesh())
    F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def case_err_mha_dropout():
    m = mesh()
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    xs = st.distribute_tensor(randn(2, 6, 8, seed=1), m, [st.Shard(1)])
    mha(xs, xs, xs, need_weights=False)


def case_head_dim_split():
    """A split head dim moves to the heads (enough heads, no GQA) or the sequence: no all-reduce of the scores."""
    m = mesh()
    w = m.size()
    q, k, v = randn(2, 4, 9, 6, seed=60), randn(2, 4, 11, 6, seed=61), randn(2, 4, 11, 6, seed=62)
    head = ([st.Shard(3)], {0: uneven_extents(6, w, seed=3)})
    check_op(sdpa(), [q, k, v], [head, head, head], m, **TOL, what="head dim -> heads",
             expect_placements=[st.Shard(1)] if w > 1 else None)
    qs, ks, vs = (st.distribute_tensor(t, m, head[0], sharding_shapes=head[1]) for t in (q, k, v))
    with st.CommCounter() as c:
        F.scaled_dot_product_attention(qs, ks, vs)
    assert "all_reduce" not in dict(c.calls), dict(c.calls)  # no sum of partial scores
    check_op(sdpa(is_causal=True), [q, k, v], [head, None, head], m, **TOL, what="q and v head dim, k plain")
    # One key/value head (multi-query): the heads cannot take the split, the sequence does.
    k1, v1 = randn(2, 1, 11, 6, seed=63), randn(2, 1, 11, 6, seed=64)
    check_op(sdpa(is_causal=True), [q, k1, v1], [head, head, None], m, **TOL, what="head dim -> sequence (MQA)",
             expect_placements=[st.Shard(2)] if w > 1 else None)
    # Fewer heads than ranks: the sequence.
    q2, k2, v2 = randn(1, 1, 8, 6, seed=65), randn(1, 1, 8, 6, seed=66), randn(1, 1, 8, 6, seed=67)
    check_op(sdpa(), [q2, k2, v2], [head, head, head], m, **TOL, what="head dim -> sequence (one head)")
    return True


def case_head_dim_split_2d():
    m = mesh((2, 2))
    q, k, v = randn(2, 4, 10, 6, seed=70), randn(2, 4, 10, 6, seed=71), randn(2, 4, 10, 6, seed=72)
    # Sequence on mesh dim 0, head dim on mesh dim 1: the head-dim split moves to the heads.
    lay = ([st.Shard(2), st.Shard(3)], {0: [3, 7]})
    check_op(sdpa(is_causal=True), [q, k, v], [lay, lay, lay], m, **TOL, what="2-d seq x head dim",
             expect_placements=[st.Shard(2), st.Shard(1)])
    return True


def case_err_head_dim():
    # The head dim split on mesh dim 1 while mesh dim 0 splits q's sequence and k's heads: neither can take it.
    m = mesh((2, 2))
    q, _, v = _qkv(m, (st.Shard(2), st.Shard(3)))
    _, k, _ = _qkv(m, (st.Shard(1), st.Shard(3)))
    F.scaled_dot_product_attention(q, k, v)


def case_err_meshes():
    q, _, _ = _qkv(mesh())
    _, k, v = _qkv(mesh((2, 2)), (st.Replicate(), st.Shard(2)))
    F.scaled_dot_product_attention(q, k, v)


def case_err_a2a_heads():
    m = mesh((2, 2))
    q, k, v = _qkv(m, (st.Shard(1), st.Shard(2)))
    with st.use_attention_strategy("all_to_all"):
        F.scaled_dot_product_attention(q, k, v)


def case_err_two_seq_dims():
    m = mesh((2, 2))
    q, _, _ = _qkv(m, (st.Shard(2), st.Replicate()))
    _, k, v = _qkv(m, (st.Replicate(), st.Shard(2)))
    F.scaled_dot_product_attention(q, k, v)

def case_zigzag():
    """Causal self-attention on the ring runs in the zigzag layout (rank c computes chunks c and 2n-1-c of 2n):
    the permutations are all-to-alls around the ring passes; 'ring_contiguous' keeps the plain layout (no
    all-to-all). Sequences shorter than 2n leave chunks empty."""
    m = mesh()
    w = m.size()
    calls = {}
    for s_len in (3, 2 * w + 1, 13):
        q, k, v = (randn(1, 3, s_len, 4, seed=s) for s in (60, 61, 62))
        for kind in ("even", "uneven"):
            ext = uneven_extents(s_len, w, seed=s_len) if kind == "uneven" else None
            lay = ([st.Shard(2)], {0: ext} if ext else None)
            for strategy in ("ring", "ring_contiguous"):
                with st.use_attention_strategy(strategy):
                    with st.CommCounter() as c:
                        check_op(sdpa(is_causal=True), [q, k, v], [lay, lay, lay], m, **TOL,
                                 what=f"{strategy} S={s_len} {kind}")
                calls[(strategy, s_len, kind)] = dict(c.calls)
    return calls


def fused_cpu(**kw):
    return lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, **kw)


def case_fused_cpu_kernel(kind):
    """The fused CPU kernel SDPA decomposes to, called on ShardTensors (compiled code that runs eagerly reaches it
    where SDPA was not bound): the output and every query's log-sum-exp, and the q/k/v gradients through its
    backward op, as on one device; strict mode: no gather fallback."""
    with st.use_strict():
        return _fused_cpu_kernel(kind)


def _fused_cpu_kernel(kind):
    m = mesh()
    w = m.size()
    q, k, v = randn(2, 4, 11, 8, seed=21), randn(2, 4, 11, 8, seed=22), randn(2, 4, 11, 8, seed=23)
    lay = seq(11, w, kind)
    for causal in (False, True):
        out = check_op(fused_cpu(is_causal=causal), [q, k, v], [lay, lay, lay], m, **TOL,
                       what=f"fused {kind} causal={causal}")
        assert st.placements(out[1]) == tuple(lay[0]), st.placements(out[1])   # the lse split like the queries
    check_op(fused_cpu(attn_mask=randn(11, 11, seed=24), scale=0.5), [q, k, v], [lay, lay, lay], m, **TOL,
             what=f"fused {kind} additive mask")
    # Queries whole, keys/values split (the output and lse come back whole).
    check_op(fused_cpu(), [q, k, v], [None, lay, lay], m, **TOL, what=f"fused {kind} q replicated")
    # Dropout: refused on every rank, as by SDPA itself.
    qs, ks, vs = (st.distribute_tensor(t, m, lay[0], sharding_shapes=lay[1]) for t in (q, k, v))
    with pytest.raises(NotImplementedError, match="dropout_p > 0"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.1)
    return True


def case_fused_cpu_kernel_2d():
    """The fused CPU kernel on a 2x2 mesh: batch on one mesh dim, the sequence on the other."""
    m = mesh((2, 2))
    q, k, v = randn(2, 4, 9, 8, seed=25), randn(2, 4, 9, 8, seed=26), randn(2, 4, 9, 8, seed=27)
    lay = ([st.Shard(0), st.Shard(2)], {1: [6, 3]})
    with st.use_strict():
        for causal in (False, True):
            check_op(fused_cpu(is_causal=causal), [q, k, v], [lay, lay, lay], m, **TOL, what=f"fused 2x2 {causal}")
    return True


# ---- tests ----

@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["ring", "ring_contiguous", "all_to_all"])
def test_self_attention(world, strategy):
    harness.run(world, case_self, strategy, "tiny")
    if world > 1:
        harness.run(world, case_self, strategy, "uneven")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_masks(world, strategy):
    harness.run(world, case_masks, strategy)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["ring", "ring_contiguous", "all_to_all"])
def test_gqa_cross(world, strategy):
    harness.run(world, case_gqa_cross, strategy)


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_sides(world):
    harness.run(world, case_replicated_sides)


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_2d_mesh(strategy):
    harness.run(4, case_2d_mesh, strategy)


@pytest.mark.parametrize("strategy", ["ring", "ring_contiguous", "all_to_all"])
def test_bf16(strategy):
    harness.run(3, case_bf16, strategy)


def test_strategy_choice():
    calls = harness.run(4, case_strategy_choice)[0]
    assert calls["ring"].get("ring_pass", 0) > 0 and calls["ring"].get("all_to_all", 0) == 0, calls
    assert calls["all_to_all"].get("all_to_all", 0) > 0 and calls["all_to_all"].get("ring_pass", 0) == 0, calls
    assert calls["auto"] == calls["all_to_all"], calls  # 4 heads over 4 ranks: evenly divisible, fewer bytes


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_causal_ring(world):
    calls = harness.run(world, case_zigzag)[0]
    for (strategy, s_len, kind), c in calls.items():
        assert c.get("ring_pass", 0) > 0, (strategy, c)
        # The zigzag permutations are row exchanges between the ranks holding the rows (comm::gather_rows, point to
        # point like a halo exchange: counted as `halo`); nothing else in attention exchanges rows that way.
        if strategy == "ring_contiguous":
            assert c.get("halo", 0) == 0 and c.get("all_to_all", 0) == 0, (strategy, c)
        elif s_len == 13 and kind == "even":
            # The permutations, tensors of one dtype packed into one exchange: q|k|v in and the output back
            # (forward); dO|q|k|v in and dQ|dK|dV back (backward).
            assert c.get("halo", 0) == 4 and c.get("all_to_all", 0) == 0, (strategy, c)
        # (Shorter or uneven layouts may already hold their zigzag rows: then nothing moves.)


@pytest.mark.parametrize("need_weights,batch_first", [(False, True), (True, True), (False, False)])
def test_multihead_attention(need_weights, batch_first):
    harness.run(2, case_mha, need_weights, batch_first)


def test_inference_mode():
    harness.run(3, case_inference)


@pytest.mark.parametrize("kind", ["windows", "sequence"])
@pytest.mark.parametrize("world", [2, 3])
def test_learned_bias(world, kind):
    harness.run(world, case_learned_bias, kind)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_batch_only_is_local(world):
    harness.run(world, case_batch_only_is_local)


def test_refusals():
    harness.expect_error(2, case_err_dropout, match="dropout_p > 0", kinds=("NotImplementedError",))
    harness.expect_error(2, case_err_mha_dropout, match="dropout_p > 0", kinds=("NotImplementedError",))


def test_refusals_2d():
    harness.expect_error(4, case_err_meshes, match="different meshes", kinds=("NotImplementedError",))
    harness.expect_error(4, case_err_a2a_heads, match="all_to_all strategy", kinds=("NotImplementedError",))
    harness.expect_error(4, case_err_two_seq_dims, match="more than one mesh dim", kinds=("NotImplementedError",))
    harness.expect_error(4, case_err_head_dim, match="dim -1 is sharded and neither", kinds=("NotImplementedError",))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_head_dim_split(world):
    harness.run(world, case_head_dim_split)


def test_head_dim_split_2d():
    harness.run(4, case_head_dim_split_2d)


def case_partial_qkv():
    """q, k, v that are pending sums (bias-free projections of a contraction over the sharded point dim, as in
    Transolver's slice attention) are completed by one all-reduce together; outputs and every gradient match one
    device."""
    m = mesh()
    w_pts = randn(1, 10, 2, 3, seed=70)   # (B, N, H, S) point weights, points sharded
    fx = randn(1, 10, 2, 4, seed=71)      # (B, N, H, D)
    W = [randn(4, 4, seed=s) for s in (72, 73, 74)]

    def f(a, b, ws):
        z = torch.einsum("bnhs,bnhd->bhsd", a, b)   # a pending sum when the points are sharded
        q, k, v = (z @ wt for wt in ws)
        return F.scaled_dot_product_attention(q, k, v)

    refs = [t.clone().requires_grad_() for t in (w_pts, fx)]
    wr = [t.clone().requires_grad_() for t in W]
    ref = f(*refs, wr)
    g = randn(*ref.shape, seed=75)
    (ref * g).sum().backward()
    lay = uneven_extents(10, m.size(), seed=3)
    shards = [st.distribute_tensor(t, m, [st.Shard(1)], {0: lay}).requires_grad_() for t in (w_pts, fx)]
    ws = [t.clone().requires_grad_() for t in W]
    with st.CommCounter() as c:
        out = f(*shards, ws)
    close(full(out), ref, **TOL, what="partial q/k/v out")
    (out * g).sum().backward()
    for a, b, name in zip(shards + ws, refs + wr, ("w", "fx", "Wq", "Wk", "Wv")):
        if st.is_shard_tensor(a):
            check_grad_layout(a, what=f"partial q/k/v grad {name}")
        close(full(a.grad) if st.is_shard_tensor(a.grad) else a.grad, b.grad, rtol=1e-4, atol=1e-4,
              what=f"partial q/k/v grad {name}")
    if m.size() > 1:
        assert dict(c.calls) == {"all_reduce": 1}, dict(c.calls)
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_partial_qkv(world):
    harness.run(world, case_partial_qkv)


def case_float64(strategy):
    # fp64 inputs accumulate in fp64 (block outputs, log-sum-exps, gradients): single-device agreement to 1e-10.
    m = mesh()
    prev = st.set_attention_strategy(strategy)
    try:
        q, k, v = (randn(1, 2, 9, 4, seed=s, dtype=torch.float64) for s in (31, 32, 33))
        lay = seq(9, m.size(), "uneven")
        mk = randn(9, 9, seed=34, dtype=torch.float64)
        for kw in (dict(is_causal=True), dict(attn_mask=mk)):
            check_op(sdpa(**kw), [q, k, v], [lay, lay, lay], m, rtol=1e-10, atol=1e-11,
                     what=f"{strategy} fp64 {list(kw)}")
    finally:
        st.set_attention_strategy(prev)
    return True


@pytest.mark.parametrize("strategy", ["ring", "ring_contiguous"])
def test_float64(strategy):
    harness.run(3, case_float64, strategy)


def case_large_logits(dim):
    """fp32 logits of a few hundred: OpInfo's own samples for SDPA (inputs in [-9, 9], a 3-D query, 3-D or 4-D key
    and value broadcast against it; the query split along `dim`, key and value plain): output and dq within 5x
    torch's own fp32 error against fp64 (plus 1e-6 of the largest value). The blocks' weights were exp(s - lse), which
    carries the log-sum-exp's rounding (an ulp of |lse|) into every weight: 10-20x torch's error, "wrong" in the
    OpInfo probe beyond the first sample (tests/python/op_sweep_samples.py); now normalized by the row's sum about its
    maximum (a block of every key: softmax in the backward too), and 3-D inputs take the fused kernel as one head.
    A 3-D query against 4-D keys raised (torch broadcasts the batch dims)."""
    from torch.testing._internal.common_methods_invocations import op_db
    m = mesh()
    info = next(o for o in op_db if o.name == "nn.functional.scaled_dot_product_attention")
    torch.manual_seed(0)
    checked = 0
    for sample in info.sample_inputs("cpu", torch.float32, requires_grad=False):
        q, k, v = sample.input, *sample.args[:2]
        if q.dim() != 3 or sample.kwargs.get("dropout_p", 0.0) != 0.0 or q.size(dim) < 2:
            continue
        qs = st.distribute_tensor(q, m, [st.Shard(dim)], {0: uneven_extents(q.size(dim), m.size(), q.numel())})
        qs.requires_grad_()
        q32, q64 = q.clone().requires_grad_(), q.double().requires_grad_()
        with st.use_strict():
            out = F.scaled_dot_product_attention(qs, k, v, **sample.kwargs)
        ref32 = F.scaled_dot_product_attention(q32, k, v, **sample.kwargs)
        ref64 = F.scaled_dot_product_attention(q64, k.double(), v.double(), **sample.kwargs)
        w = torch.randn(ref32.shape, generator=torch.Generator().manual_seed(7))
        (out * st.distribute_tensor(w, m, st.placements(out), st.sharding_shapes(out))).sum().backward()
        (ref32 * w).sum().backward()
        (ref64 * w.double()).sum().backward()
        for what, ours, theirs, exact in (("output", full(out), ref32, ref64), ("dq", full(qs.grad), q32.grad, q64.grad)):
            err = (ours.double() - exact).abs().max().item()
            bound = 5 * (theirs.double() - exact).abs().max().item() + 1e-6 * exact.abs().max().item()
            assert err <= bound, (what, sample.kwargs, tuple(k.shape), err, bound)
        checked += 1
    assert checked >= 4, checked
    return True


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_large_logits_precision(dim):
    harness.run(2, case_large_logits, dim)


# ---- the strategy setting: per thread, and captured per call (issue 30 item 1) ----

def case_strategy_block_in_another_thread():
    """Rank 0 holds a `use_attention_strategy` block open in a second thread while its main thread (and every other
    rank's) runs causal attention: the block must not reach the main thread (it used to, so the ranks took the
    zigzag ring and the contiguous ring, or the all-to-all, and one aborted)."""
    import threading
    m = mesh()
    q, k, v = (randn(1, 4, 9, 4, seed=s) for s in (70, 71, 72))
    lay = ([st.Shard(2)], {0: uneven_extents(9, m.size(), seed=9)})
    inside, leave = threading.Event(), threading.Event()
    seen = {}

    def other():
        with st.use_attention_strategy("ring_contiguous" if rank() == 0 else "all_to_all"):
            seen["other"] = st.attention_strategy()
            inside.set()
            leave.wait(60)

    t = threading.Thread(target=other)
    t.start()
    try:
        inside.wait(60)
        assert st.attention_strategy() == "auto", st.attention_strategy()
        with st.use_attention_strategy("ring"):
            check_op(sdpa(is_causal=True), [q, k, v], [lay, lay, lay], m, **TOL, what="ring while another thread "
                     "holds a block")
        check_op(sdpa(is_causal=True), [q, k, v], [lay, lay, lay], m, **TOL, what="auto while another thread holds a "
                 "block")
    finally:
        leave.set()
        t.join()
    assert seen["other"] == ("ring_contiguous" if rank() == 0 else "all_to_all")
    assert st.attention_strategy() == "auto"
    return True


def case_backward_after_strategy_block(strategy):
    """The backward runs after the block that chose the strategy has closed: it must follow the forward's choice
    (the ring's backward re-read the setting, so a forward in the contiguous layout was differentiated in the zigzag
    layout)."""
    m = mesh()
    q, k, v = (randn(1, 2, 10, 4, seed=s) for s in (73, 74, 75))
    lay = ([st.Shard(2)], {0: uneven_extents(10, m.size(), seed=10)})
    qs, ks, vs = (st.distribute_tensor(t, m, lay[0], lay[1]).requires_grad_() for t in (q, k, v))
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    with st.use_attention_strategy(strategy):
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    other = "ring" if strategy == "ring_contiguous" else "ring_contiguous"
    w = randn(*out.shape, seed=76)
    with st.use_attention_strategy(other):
        (out * st.distribute_tensor(w, m, lay[0], lay[1])).sum().backward()
    (F.scaled_dot_product_attention(ql, kl, vl, is_causal=True) * w).sum().backward()
    for name, a, b in (("q", qs, ql), ("k", ks, kl), ("v", vs, vl)):
        close(full(a.grad), b.grad, **TOL, what=f"{strategy} then {other}: d{name}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_strategy_is_per_thread(world):
    harness.run(world, case_strategy_block_in_another_thread)


@pytest.mark.parametrize("strategy", ["ring", "ring_contiguous"])
def test_backward_follows_forward_strategy(strategy):
    harness.run(3, case_backward_after_strategy_block, strategy)


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_fused_cpu_kernel(world, kind):
    harness.run(world, case_fused_cpu_kernel, kind)


def test_fused_cpu_kernel_2d_mesh():
    harness.run(4, case_fused_cpu_kernel_2d)
