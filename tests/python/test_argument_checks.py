"""Rules check their arguments against the GLOBAL shapes before they communicate (issue 30 item 2): arguments that
torch refuses on the full tensors are refused on every rank with a ValueError naming the global shapes, never
accepted (a channel-sharded convolution slices the weight to its channels, so a wrong in_channels ran), run on some
ranks only, or refused after collectives with a shard's shapes. Each case is checked against torch on one device."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import mesh, randn

X4 = (2, 4, 8, 8)


def _cases():
    x4 = randn(*X4, seed=1)
    x5 = randn(1, 4, 6, 6, 6, seed=1)
    seq = randn(2, 8, 6, seed=2)
    qkv = randn(1, 2, 8, 4, seed=3)
    # name: (fn, input, placements, what the message must name)
    return {
        "conv channel-sharded, weight in_channels too large": (
            lambda x: F.conv2d(x, randn(3, 5, 3, 3)), x4, [st.Shard(1)], "[3, 5, 3, 3]"),
        "conv channel-sharded, weight in_channels too small": (
            lambda x: F.conv2d(x, randn(3, 3, 3, 3)), x4, [st.Shard(1)], "[2, 4, 8, 8]"),
        "conv H-sharded, wrong in_channels": (lambda x: F.conv2d(x, randn(3, 5, 3, 3)), x4, [st.Shard(2)], "[2, 4, 8, 8]"),
        "conv3d H-sharded, wrong in_channels": (
            lambda x: F.conv3d(x, randn(3, 5, 3, 3, 3)), x5, [st.Shard(2)], "[1, 4, 6, 6, 6]"),
        "conv bias size, channel-sharded": (
            lambda x: F.conv2d(x, randn(3, 4, 3, 3), randn(4)), x4, [st.Shard(1)], "bias [4]"),
        "conv kernel larger than the global input": (
            lambda x: F.conv2d(x, randn(3, 4, 9, 3)), x4, [st.Shard(2)], "[3, 4, 9, 3]"),
        "conv groups do not divide out_channels": (
            lambda x: F.conv2d(x, randn(3, 2, 3, 3), groups=2), x4, [st.Shard(1)], "groups=2"),
        "conv stride 0": (lambda x: F.conv2d(x, randn(3, 4, 3, 3), stride=0), x4, [st.Shard(2)], "stride"),
        "conv_transpose H-sharded, wrong in_channels": (
            lambda x: F.conv_transpose2d(x, randn(5, 3, 3, 3)), x4, [st.Shard(2)], "[2, 4, 8, 8]"),
        "linear feature-sharded, wrong in_features": (
            lambda x: F.linear(x, randn(3, 7)), seq, [st.Shard(2)], "[3, 7]"),
        "linear feature-sharded, in_features too small": (
            lambda x: F.linear(x, randn(3, 5)), seq, [st.Shard(2)], "[2, 8, 6]"),
        "linear token-sharded, wrong in_features": (lambda x: F.linear(x, randn(3, 7)), seq, [st.Shard(1)], "[2, 8, 6]"),
        "linear bias size": (lambda x: F.linear(x, randn(3, 6), randn(4)), seq, [st.Shard(1)], "bias [4]"),
        "matmul feature-sharded": (lambda x: x @ randn(7, 3), seq, [st.Shard(2)], "[7, 3]"),
        "mm contracted dim sharded": (lambda x: torch.mm(x, randn(7, 3)), randn(8, 6), [st.Shard(1)], "[7, 3]"),
        "bmm contracted dim sharded": (lambda x: torch.bmm(x, randn(2, 7, 3)), seq, [st.Shard(2)], "[2, 7, 3]"),
        "layer_norm normalized_shape": (lambda x: F.layer_norm(x, (5,)), seq, [st.Shard(1)], "[2, 8, 6]"),
        "layer_norm over a sharded dim, wrong shape": (lambda x: F.layer_norm(x, (7, 6)), seq, [st.Shard(1)],
                                                       "[2, 8, 6]"),
        "layer_norm weight": (lambda x: F.layer_norm(x, (6,), randn(5)), seq, [st.Shard(1)], "weight [5]"),
        "batch_norm running_mean": (
            lambda x: F.batch_norm(x, torch.zeros(3), torch.ones(3), training=True), x4, [st.Shard(2)], "[2, 4, 8, 8]"),
        "batch_norm weight, channel-sharded": (
            lambda x: F.batch_norm(x, None, None, randn(5), training=True), x4, [st.Shard(1)], "weight [5]"),
        "sdpa mask shape": (
            lambda x: F.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(5, 8, dtype=torch.bool)), qkv,
            [st.Shard(2)], "[1, 2, 8, 4]"),
        "sdpa head dims": (lambda x: F.scaled_dot_product_attention(x, x[..., :3], x), qkv, [st.Shard(2)],
                           "[1, 2, 8, 3]"),
        "max_pool padding": (lambda x: F.max_pool2d(x, 2, padding=2), x4, [st.Shard(2)], "pad"),
        "avg_pool kernel larger than the input": (lambda x: F.avg_pool2d(x, 10), x4, [st.Shard(2)], "input 8"),
        "interpolate non-positive size": (lambda x: F.interpolate(x, size=(-1, 4)), x4, [st.Shard(2)], "> 0"),
        # Found by the OpInfo probe's error inputs (op_sweep_samples.py --errors): accepted, or refused on some ranks.
        "gather index out of range along an unsplit dim": (
            lambda x: torch.gather(x, 1, torch.tensor([[0, 23], [1, 0], [0, 0], [1, 1]])), randn(4, 3),
            [st.Shard(0)], "size 3"),
        "gather index larger than self": (
            lambda x: torch.gather(x, 1, torch.zeros(4, 2, dtype=torch.long)), randn(2, 3), [st.Shard(0)], "[4, 2]"),
        "t of a 3-D tensor": (lambda x: x.t(), seq, [st.Shard(1)], "3D"),
        "amax over a dim named twice": (lambda x: x.amax((0, 0)), seq, [st.Shard(1)], "dim 0 appears"),
        "sum over dims 1 and -2": (lambda x: x.sum((1, -2)), seq, [st.Shard(1)], "dim 1 appears"),
        "huber_loss delta 0": (lambda x: F.huber_loss(x, x + 1, delta=0.0), seq, [st.Shard(1)], "delta"),
        "smooth_l1_loss negative beta": (lambda x: F.smooth_l1_loss(x, x + 1, beta=-1.0), seq, [st.Shard(1)], "beta"),
        "max_pool1d of an input without channels": (
            lambda x: F.max_pool1d(x, 1), torch.zeros(0, 10), [st.Shard(1)], "positive length"),
        "max_pool3d of an input without depth": (
            lambda x: F.max_pool3d(x, 1), torch.zeros(1, 0, 2, 10), [st.Shard(3)], "positive length"),
    }


def case_argument_checks():
    """Every case: torch raises on the full tensor; the sharded call raises too, before any collective (so a rank
    that accepted would leave the others waiting and time the case out). Returns (name, type, message) per case."""
    m = mesh()
    out = []
    for name, (fn, x, pl, named) in _cases().items():
        try:
            fn(x)
        except (RuntimeError, ValueError, IndexError):
            pass
        else:
            raise AssertionError(f"{name}: torch accepts it on one device; the case is wrong")
        xs = st.distribute_tensor(x, m, pl)
        before = st.comm_stats()["calls"]
        try:
            fn(xs)
        except (RuntimeError, ValueError, IndexError, NotImplementedError) as e:
            after = st.comm_stats()["calls"]
            calls = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
            out.append((name, type(e).__name__, str(e).splitlines()[0], named, calls))
            continue
        raise AssertionError(f"{name}: the sharded call was accepted")
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_arguments_checked_against_global_shapes(world):
    per_rank = harness.run(world, case_argument_checks)
    for r, results in enumerate(per_rank):
        for (name, kind, msg, named, calls), (_, kind0, msg0, _, _) in zip(results, per_rank[0]):
            assert (kind, msg) == (kind0, msg0), f"{name}: rank {r} raised {kind}: {msg}; rank 0 {kind0}: {msg0}"
            assert named in msg, f"{name}: {named!r} not in {msg!r}"
            assert calls == {}, f"{name}: communicated before refusing: {calls}"
    # The rules' own checks (this issue) raise ValueError and name the global shapes.
    for name, kind, msg, named, _ in per_rank[0]:
        if name.split()[0] in ("conv", "conv3d", "conv_transpose", "linear", "matmul", "mm", "bmm", "layer_norm",
                               "batch_norm"):
            assert kind == "ValueError", f"{name}: {kind}: {msg}"
            assert "[" not in named or "global shapes" in msg, f"{name}: {msg}"
