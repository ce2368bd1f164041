"""Local shards that are not contiguous: every rule that hands local tensors to a kernel or packs them into buffers
gets transposed, permuted, sliced and channels-last inputs (the views real models make: SongUNet's permute +
qkv[..., i, :], NHWC convolutions, tokens-first attention), against the single-device computation, forward and
backward, uneven extents, 1-4 ranks. A kernel that assumed contiguity returned silently wrong values here."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, mesh, randn, tiny_extents, uneven_extents
from shardtensor.ops import knn, neighborhood_attention2d

TOL = dict(rtol=1e-4, atol=1e-5)
STRATEGIES = ("ring", "ring_contiguous", "all_to_all")


def _with_strategy(strategy, fn):
    prev = st.set_attention_strategy(strategy)
    try:
        fn()
    finally:
        st.set_attention_strategy(prev)


def case_sdpa_transposed_head_dim(strategy):
    """The issue's repro: q/k/v (B, H, S, D) as a transposed view of (B, H, D, S) with S sharded, so the head dim
    of every local shard is strided."""
    m = mesh()
    w = m.size()

    def body():
        t = randn(1, 1, 8, 16, seed=1)
        for ext in (None, uneven_extents(16, w, seed=3), tiny_extents(16, w)):
            lay = ([st.Shard(3)], None if ext is None else {0: ext})
            for causal in (False, True):
                check_op(lambda a: F.scaled_dot_product_attention(*[a.transpose(-1, -2)] * 3, is_causal=causal),
                         [t], [lay], m, **TOL, what=f"{strategy} self-transposed ext={ext} causal={causal}")
        q, k, v = randn(2, 2, 6, 11, seed=4), randn(2, 2, 6, 11, seed=5), randn(2, 2, 6, 11, seed=6)
        lay = ([st.Shard(3)], {0: uneven_extents(11, w, seed=7)})
        check_op(lambda a, b, c: F.scaled_dot_product_attention(a.transpose(-1, -2), b.transpose(-1, -2),
                                                                c.transpose(-1, -2)),
                 [q, k, v], [lay] * 3, m, **TOL, what=f"{strategy} q/k/v transposed")

    _with_strategy(strategy, body)
    return True


def case_sdpa_songunet_qkv(strategy):
    """SongUNet-style attention: one conv output (B, 3*H*D, S) reshaped and permuted, q/k/v selected from it; the
    sequence (flattened spatial) dim is sharded."""
    m = mesh()
    w = m.size()

    def attn(x):
        b, c3, s = x.shape
        qkv = x.reshape(b, 2, 3, c3 // 6, s).permute(0, 1, 4, 2, 3)  # (B, heads, S, 3, D)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        o = F.scaled_dot_product_attention(q, k, v)  # (B, heads, S, D)
        return o.permute(0, 1, 3, 2).reshape(b, -1, s)

    def body():
        x = randn(2, 24, 13, seed=8)
        for ext in (None, uneven_extents(13, w, seed=9)):
            lay = ([st.Shard(2)], None if ext is None else {0: ext})
            check_op(attn, [x], [lay], m, **TOL, what=f"{strategy} songunet ext={ext}")

    _with_strategy(strategy, body)
    return True


def case_sdpa_tokens_first(strategy):
    """(B, S, H, D) projections transposed to (B, H, S, D): the usual ViT/DiT path, sequence sharded."""
    m = mesh()
    w = m.size()

    def attn(a):
        q = a.transpose(1, 2)
        return F.scaled_dot_product_attention(q, q * 0.5, q.flip(-1), is_causal=True)

    def body():
        x = randn(2, 10, 2, 8, seed=10)
        check_op(attn, [x], [([st.Shard(1)], {0: uneven_extents(10, w, seed=11)})], m, **TOL,
                 what=f"{strategy} tokens-first")

    _with_strategy(strategy, body)
    return True


def case_halo_ops_strided():
    """Halo exchange packs boundary rows of strided locals: channels-last and transposed inputs through conv, pad,
    pooling and interpolation, sharded along H (and W on a second rank count)."""
    m = mesh()
    w = m.size()
    x = randn(2, 3, 9, 7, seed=12)
    weight = randn(4, 3, 3, 3, seed=13)
    cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731
    ops = {
        "conv": lambda t, wt: F.conv2d(t, wt, padding=1),
        "conv stride 2": lambda t, wt: F.conv2d(t, wt, stride=2),
        "reflect pad": lambda t, wt: F.pad(t, (1, 1, 2, 2), mode="reflect"),
        "max pool": lambda t, wt: F.max_pool2d(t, 3, stride=2, padding=1),
        "avg pool": lambda t, wt: F.avg_pool2d(t, 2),
        "bilinear": lambda t, wt: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=False),
    }
    for name, op in ops.items():
        for dim, ext in ((2, uneven_extents(9, w, seed=14)), (3, tiny_extents(7, w))):
            lay = ([st.Shard(dim)], {0: ext})
            check_op(lambda t, wt, op=op: op(cl(t), wt), [x, weight], [lay, None], m, **TOL,
                     what=f"{name} channels-last dim {dim}")
        # A transposed view: the sharded W of the input becomes H of the operand.
        xt = randn(2, 3, 7, 9, seed=15)
        check_op(lambda t, wt, op=op: op(t.transpose(-1, -2), wt), [xt, weight],
                 [([st.Shard(3)], {0: uneven_extents(9, w, seed=16)}), None], m, **TOL, what=f"{name} transposed")
    x3 = randn(1, 2, 6, 5, 4, seed=17)
    w3 = randn(3, 2, 3, 3, 3, seed=18)
    check_op(lambda t, wt: F.conv3d(t.contiguous(memory_format=torch.channels_last_3d), wt, padding=1), [x3, w3],
             [([st.Shard(2)], {0: uneven_extents(6, w, seed=19)}), None], m, **TOL, what="conv3d channels-last")
    return True


def case_neighborhood_strided():
    """Neighbourhood attention on (B, H, W, heads, D) permuted from a channels-first tensor."""
    m = mesh()
    w = m.size()
    x = randn(1, 2, 3, 9, 5, seed=20)  # (B, heads, D, H, W)
    na = lambda t: neighborhood_attention2d(*[t.permute(0, 3, 4, 1, 2)] * 3, (3, 3))  # noqa: E731
    check_op(na, [x], [([st.Shard(3)], {0: uneven_extents(9, w, seed=21)})], m, rtol=1e-5, atol=1e-5,
             what="neighbourhood attention permuted")
    return True


def case_knn_strided():
    """knn on points and queries that are transposed views of (3, N)."""
    m = mesh()
    w = m.size()
    pts = randn(3, 12, seed=22, dtype=torch.float64)
    qry = randn(3, 7, seed=23, dtype=torch.float64)

    def search(p, q):
        idx, dist = knn(p.t(), q.t(), 3)
        return idx, dist

    check_op(search, [pts, qry], [([st.Shard(1)], {0: uneven_extents(12, w, seed=24)}), None], m, rtol=1e-6,
             atol=1e-9, what="knn transposed points")
    check_op(search, [pts, qry], [([st.Shard(1)], None), ([st.Shard(1)], {0: tiny_extents(7, w)})], m, rtol=1e-6,
             atol=1e-9, what="knn transposed points and queries")
    return True


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sdpa_transposed_head_dim(world, strategy):
    harness.run(world, case_sdpa_transposed_head_dim, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sdpa_songunet_qkv(strategy):
    harness.run(2, case_sdpa_songunet_qkv, strategy)
    harness.run(3, case_sdpa_songunet_qkv, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sdpa_tokens_first(strategy):
    harness.run(2, case_sdpa_tokens_first, strategy)


@pytest.mark.parametrize("world", [2, 3])
def test_halo_ops_strided(world):
    harness.run(world, case_halo_ops_strided)


@pytest.mark.parametrize("world", [2, 4])
def test_neighborhood_strided(world):
    harness.run(world, case_neighborhood_strided)


@pytest.mark.parametrize("world", [2, 3])
def test_knn_strided(world):
    harness.run(world, case_knn_strided)
