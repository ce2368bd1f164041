"""Every backward rule driven by incoming gradients of every layout autograd can hand it: a transposed local (the
memory order reversed), an expanded one (stride 0 along a dim, as `sum`/`mean` backward make), channels-last, a
sliced one (a storage offset and gaps: a view into a larger buffer), a gradient that reaches the rule through
views (`flatten(2).transpose(1, 2)` of the output, XCiT's stem after its BatchNorm) and a plain full gradient.
Each rule's input and parameter gradients are compared with the single-device computation on the same gradient,
float64, uneven extents (zero included) on 2 ranks, one row / no row / the rest on 3. A rule that read its gradient's memory as if it were
contiguous, or that assumed the gradient's layout equals its output's, returns a wrong value here."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn, tiny_extents, uneven_extents
from shardtensor.ops import knn, neighborhood_attention2d

D = torch.float64
KINDS = ("transposed", "expanded", "channels_last", "sliced", "via_views", "plain")


def _rnd(*shape, seed=0):
    return randn(*shape, seed=seed, dtype=D)


def _sharded_dims(t):
    return {p.dim for p in st.placements(t) if type(p).__name__ == "Shard"}


def _local_slice(g_full, out, m):
    """This rank's block of the full gradient, in `out`'s layout (Partial read as Replicate)."""
    ext = st.sharding_shapes(out)
    coord = m.get_coordinate()
    local = g_full
    for i, p in enumerate(st.placements(out)):
        if type(p).__name__ != "Shard":
            continue
        off = sum(ext[i][:coord[i]])
        local = local.narrow(p.dim, off, ext[i][coord[i]])
    return local


def _relayout(local, kind):
    nd = local.dim()
    if kind == "transposed" and nd >= 2:
        rev = list(reversed(range(nd)))
        return local.permute(rev).contiguous().permute(rev)
    if kind == "channels_last" and nd in (4, 5):
        return local.contiguous(memory_format=torch.channels_last if nd == 4 else torch.channels_last_3d)
    if kind == "channels_last" and nd == 3:
        return local.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    if kind == "sliced":
        big = torch.zeros(*local.shape[:-1], local.shape[-1] + 3, dtype=local.dtype)
        big[..., 1:-2] = local
        return big[..., 1:-2]
    return local


def _grad_full(shape, kind, out, seed):
    """The full incoming gradient; `expanded` is a stride-0 broadcast along the largest dim."""
    if kind == "expanded" and len(shape) > 0:
        d = max(range(len(shape)), key=lambda i: shape[i])
        small = list(shape)
        small[d] = 1
        return _rnd(*small, seed=seed).expand(shape)
    return _rnd(*shape, seed=seed)


def _sharded_grad(g_full, out, kind, m):
    if kind == "plain" or not st.is_shard_tensor(out):
        if kind == "plain" and g_full.dim() >= 2:
            return g_full.t().contiguous().t() if g_full.dim() == 2 else g_full.transpose(0, -1).contiguous().transpose(0, -1)
        return g_full
    pl = [st.Replicate() if type(p).__name__ == "Partial" else p for p in st.placements(out)]
    local = _relayout(_local_slice(g_full, out, m), kind)
    return st.from_local(local, m, pl, sharding_shapes=st.sharding_shapes(out), global_shape=list(out.shape),
                         check=False)


def check_grad_layouts(fn, inputs, layouts, m, kinds=KINDS, rtol=1e-9, atol=1e-10, what=""):
    """For each gradient layout: autograd.grad of `fn`'s (first tensor) output w.r.t. every floating input (plain
    ones are parameters) with that gradient, against one device."""
    for kind in kinds:
        refs, args = [], []
        for i, (t, lay) in enumerate(zip(inputs, layouts)):
            rg = t.is_floating_point() or t.is_complex()
            refs.append(t.detach().clone().requires_grad_(rg))
            leaf = t.detach().clone()
            if lay is not None:
                pl, ext = lay
                leaf = st.distribute_tensor(leaf, m, pl, sharding_shapes=ext)
            args.append(leaf.requires_grad_(rg))
        post = (lambda y: y.flatten(2).transpose(1, 2)) if kind == "via_views" else (lambda y: y)
        out_ref, out = fn(*refs), fn(*args)
        if isinstance(out_ref, (tuple, list)):
            out_ref, out = out_ref[0], out[0]
        if kind == "via_views" and out_ref.dim() < 3:
            continue
        out_ref, out = post(out_ref), post(out)
        close(full(out), out_ref, rtol=rtol, atol=atol, what=f"{what} [{kind}] forward")
        g_full = _grad_full(tuple(out_ref.shape), "transposed" if kind == "via_views" else kind, out, seed=31)
        if out_ref.is_complex():
            g_full = torch.complex(g_full, _grad_full(tuple(out_ref.shape), kind, out, seed=32))
        wrt_ref = [r for r in refs if r.requires_grad]
        wrt = [a for a in args if a.requires_grad]
        want = torch.autograd.grad(out_ref, wrt_ref, g_full, allow_unused=True)
        got = torch.autograd.grad(out, wrt, _sharded_grad(g_full, out, kind, m), allow_unused=True)
        for i, (a, b) in enumerate(zip(got, want)):
            if b is None:
                assert a is None or full(a).abs().max() == 0, f"{what} [{kind}]: unexpected gradient {i}"
                continue
            assert a is not None, f"{what} [{kind}]: no gradient {i}"
            close(full(a), b, rtol=rtol, atol=atol, what=f"{what} [{kind}] gradient {i}")


def _sh(dim, n, w, seed=0):
    # 3 ranks: one row, nothing, the rest (a local size-1 dim carries no stride order; an empty rank none at all)
    return ([st.Shard(dim)], {0: tiny_extents(n, w) if w == 3 else uneven_extents(n, w, seed=seed)})


def _rules(w):
    """name -> (fn, inputs, layouts): one small case per backward rule, sharded along a dim the rule supports."""
    x4 = _rnd(2, 3, 7, 5, seed=1)
    on_h = _sh(2, 7, w)
    c3, c4 = _rnd(3, seed=2), _rnd(3, seed=3)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    tok = _rnd(2, 7, 6, seed=4)
    on_n = _sh(1, 7, w, seed=1)
    w6, b6 = _rnd(6, seed=5), _rnd(6, seed=6)
    lin_w, lin_b = _rnd(5, 6, seed=7), _rnd(5, seed=8)
    conv_w, conv_b = _rnd(4, 3, 3, 3, seed=9), _rnd(4, seed=10)
    seq = _rnd(1, 2, 9, 4, seed=11)
    on_s = _sh(2, 9, w, seed=2)
    idx = torch.tensor([[1, 0, 4], [3, 3, 2], [0, 2, 1], [4, 1, 0], [2, 2, 3], [1, 4, 4], [0, 3, 2]])
    table = _rnd(5, 4, seed=12)
    target = _rnd(2, 3, 7, 5, seed=13)
    cls = torch.tensor([[[0, 1, 2, 1, 0]] * 7, [[2, 2, 1, 0, 1]] * 7])  # (2, 7, 5) class ids
    return {
        # normalizations
        "layer_norm": (lambda t, a, b: F.layer_norm(t, (6,), a, b), [tok, w6, b6], [on_n, None, None]),
        "layer_norm_sharded_stats": (lambda t, a, b: F.layer_norm(t, (7, 6)), [tok, w6, b6], [on_n, None, None]),
        "rms_norm": (lambda t, a: F.rms_norm(t, (6,), a), [tok, w6], [on_n, None]),
        "group_norm": (lambda t, a, b: F.group_norm(t, 3, a, b), [x4, c3, c4], [on_h, None, None]),
        "batch_norm_train": (lambda t, a, b: F.batch_norm(t, rm.clone(), rv.clone(), a, b, training=True),
                             [x4, c3, c4], [on_h, None, None]),
        "batch_norm_eval": (lambda t, a, b: F.batch_norm(t, rm + 0.5, rv * 2, a, b, training=False),
                            [x4, c3, c4], [on_h, None, None]),
        "instance_norm": (lambda t, a, b: F.instance_norm(t, weight=a, bias=b), [x4, c3, c4], [on_h, None, None]),
        "local_response_norm": (lambda t: F.local_response_norm(t, 2), [x4], [on_h]),
        # windows
        "conv2d": (lambda t, a, b: F.conv2d(t, a, b, padding=1), [x4, conv_w, conv_b], [on_h, None, None]),
        "conv2d_stride2": (lambda t, a: F.conv2d(t, a, stride=2), [x4, conv_w], [on_h, None]),
        "conv_transpose2d": (lambda t, a: F.conv_transpose2d(t, a.transpose(0, 1).contiguous(), stride=2),
                             [x4, conv_w], [on_h, None]),
        "conv1d": (lambda t, a: F.conv1d(t, a, padding=1), [tok.transpose(1, 2).contiguous(), _rnd(4, 6, 3, seed=14)],
                   [_sh(2, 7, w, seed=1), None]),
        "max_pool2d": (lambda t: F.max_pool2d(t, 3, 2, 1), [x4], [on_h]),
        "max_pool1d": (lambda t: F.max_pool1d(t, 2), [tok.transpose(1, 2).contiguous()], [_sh(2, 7, w)]),
        "avg_pool2d": (lambda t: F.avg_pool2d(t, 3, 2, 1, count_include_pad=False), [x4], [on_h]),
        "adaptive_avg_pool2d": (lambda t: F.adaptive_avg_pool2d(t, (4, 3)), [x4], [on_h]),
        "adaptive_max_pool2d": (lambda t: F.adaptive_max_pool2d(t, (4, 3)), [x4], [on_h]),
        "global_avg_pool": (lambda t: F.adaptive_avg_pool2d(t, 1), [x4], [on_h]),
        "global_max_pool": (lambda t: F.adaptive_max_pool2d(t, 1), [x4], [on_h]),
        "interp_bilinear": (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), [x4], [on_h]),
        "interp_nearest": (lambda t: F.interpolate(t, size=(10, 4), mode="nearest"), [x4], [on_h]),
        "interp_bicubic": (lambda t: F.interpolate(t, size=(5, 8), mode="bicubic", align_corners=True), [x4], [on_h]),
        "pad_reflect": (lambda t: F.pad(t, (1, 2, 2, 1), mode="reflect"), [x4], [on_h]),
        "pad_replicate": (lambda t: F.pad(t, (1, 2, 2, 1), mode="replicate"), [x4], [on_h]),
        "pad_circular": (lambda t: F.pad(t, (1, 2, 2, 1), mode="circular"), [x4], [on_h]),
        "pad_constant": (lambda t: F.pad(t, (1, -1, 2, -1), value=0.5), [x4], [on_h]),
        "roll": (lambda t: torch.roll(t, (3, -1), (2, 3)), [x4], [on_h]),
        "flip": (lambda t: torch.flip(t, (2,)), [x4], [on_h]),
        # contractions and attention
        "linear": (lambda t, a, b: F.linear(t, a, b), [tok, lin_w, lin_b], [on_n, None, None]),
        "matmul": (lambda t, a: t @ a.t(), [tok, lin_w], [on_n, None]),
        "bmm": (lambda t, a: torch.bmm(t, a), [tok, _rnd(2, 6, 3, seed=15)], [_sh(0, 2, w), None]),
        "mm_contracted": (lambda t, a: t[0] @ a, [tok, _rnd(6, 4, seed=16)], [_sh(2, 6, w), None]),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [seq, seq * 0.5, seq.flip(-1)], [on_s] * 3),
        "sdpa_causal": (lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), [seq], [on_s]),
        "neighborhood_attention": (lambda q: neighborhood_attention2d(q, q * 0.7, q, (3, 3)),
                                   [_rnd(1, 7, 5, 2, 3, seed=17)], [_sh(1, 7, w)]),
        "knn_distances": (lambda p, q: knn(p, q, 2)[1], [_rnd(9, 3, seed=18), _rnd(7, 3, seed=19)],
                          [_sh(0, 9, w), _sh(0, 7, w, seed=3)]),
        # softmax, losses, scans
        "softmax_sharded_dim": (lambda t: torch.softmax(t, 1), [tok], [on_n]),
        "log_softmax": (lambda t: torch.log_softmax(t, -1), [tok], [on_n]),
        "logsumexp": (lambda t: torch.logsumexp(t, 1), [tok], [on_n]),
        "cumsum": (lambda t: torch.cumsum(t, 1), [tok], [on_n]),
        "mse_loss": (lambda t, y: F.mse_loss(t, y, reduction="none"), [x4, target], [on_h, on_h]),
        "smooth_l1_loss": (lambda t, y: F.smooth_l1_loss(t, y, reduction="none", beta=0.5), [x4, target], [on_h, on_h]),
        "huber_loss": (lambda t, y: F.huber_loss(t, y, reduction="none", delta=0.7), [x4, target], [on_h, on_h]),
        "cross_entropy": (lambda t, c: F.cross_entropy(t, c, reduction="none"), [x4, cls], [on_h, _sh(1, 7, w)]),
        # reductions, indexing, activations
        "sum_dim": (lambda t: t.sum(2), [x4], [on_h]),
        "mean_dims": (lambda t: t.mean((1, 3), keepdim=True), [x4], [on_h]),
        "amax": (lambda t: t.amax(3), [x4], [on_h]),
        "max_dim": (lambda t: t.max(1).values, [x4], [on_h]),
        "var": (lambda t: t.var(2), [x4], [on_h]),
        "norm": (lambda t: torch.linalg.vector_norm(t, dim=3), [x4], [on_h]),
        "prod": (lambda t: t.prod(1), [x4], [on_h]),
        "embedding": (lambda i, a: F.embedding(i, a), [idx, table], [_sh(0, 7, w), None]),
        "index_select_sharded": (lambda t: t.index_select(2, torch.tensor([6, 0, 3, 3])), [x4], [on_h]),
        "gather": (lambda t: t.gather(3, torch.tensor([[[[4, 0]] * 7] * 3] * 2)), [x4], [on_h]),
        "slice_select": (lambda t: t[:, 1, 2:6], [x4], [on_h]),
        "prelu": (lambda t, a: F.prelu(t, a), [x4, c3], [on_h, None]),
        "gelu": (lambda t: F.gelu(t), [x4], [on_h]),
        "silu": (lambda t: F.silu(t), [x4], [on_h]),
        "hardswish": (lambda t: F.hardswish(t * 3), [x4], [on_h]),
        "relu": (lambda t: torch.relu(t), [x4], [on_h]),
        "fft_rfft": (lambda t: torch.fft.rfft(t, dim=3), [x4], [on_h]),
        "fft_sharded_dim": (lambda t: torch.fft.fft2(t, dim=(2, 3)), [x4], [on_h]),
        # views the gradient is re-laid out through (W sharded: flatten re-lays out, XCiT's stem order)
        "flatten_transpose": (lambda t: t.flatten(2).transpose(1, 2), [x4], [_sh(3, 5, w)]),
        "bn_flatten_transpose": (lambda t, a, b: F.batch_norm(t, None, None, a, b, training=True)
                                 .flatten(2).transpose(1, 2), [x4, c3, c4], [on_h, None, None]),
        "in_permute": (lambda t: F.instance_norm(t).permute(0, 2, 3, 1), [x4], [on_h]),
    }


RULES = sorted(_rules(2))


def case_rule(name):
    m = mesh()
    fn, inputs, layouts = _rules(m.size())[name]
    check_grad_layouts(fn, inputs, layouts, m, what=name)
    return True


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("name", RULES)
def test_backward_with_grad_layouts(name, world):
    harness.run(world, case_rule, name)
