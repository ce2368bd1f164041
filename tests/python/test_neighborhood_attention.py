"""Neighbourhood attention (shardtensor.ops.neighborhood_attention1d/2d/3d) against a dense reference: softmax
attention over all tokens with a boolean neighbourhood mask built here from the NATTEN window rule (window of K
starting at clamp(i - K//2, 0, L - K) per dim). Single device: 1-3 spatial dims, kernel == extent, D != Dv,
scale, q/k/v gradients, gradcheck in double, bf16, the geometry ops on a key window. Sharded vs single device on
1-4 ranks: uneven shards, shards narrower than the radius, zero extents, batch/heads shards, 2-D meshes with two
spatial dims sharded, k/v laid out differently from q, bf16, inference mode; errors raise on every rank."""
import pytest
import torch

import harness
import shardtensor as st
from shardtensor.ops import neighborhood_attention, neighborhood_attention1d, neighborhood_attention2d, \
    neighborhood_attention3d
from cases_util import check_grad_layout, check_op, close, full, mesh, narrow_extents, randn, uneven_extents

FNS = {1: neighborhood_attention1d, 2: neighborhood_attention2d, 3: neighborhood_attention3d}


# ---- reference ----

def window_mask_1d(L, K, d=1):
    """Dilation d: the positions i mod d form a group; inside it the plain clamped window of K group members."""
    mask = torch.zeros(L, L, dtype=torch.bool)
    for r in range(d):
        group = list(range(r, L, d))
        n = len(group)
        for gi, i in enumerate(group):
            start = min(max(gi - K // 2, 0), n - K)
            for t in range(K):
                mask[i, group[start + t]] = True
    return mask


def neighbourhood_mask(sizes, kernel, dilation=None):
    """(N, N) boolean: query token (row-major over sizes) may see key token."""
    mask = torch.ones(1, 1, dtype=torch.bool)
    for L, K, d in zip(sizes, kernel, dilation or [1] * len(kernel)):
        m = window_mask_1d(L, K, d)
        n = mask.shape[0]
        mask = (mask[:, None, :, None] & m[None, :, None, :]).reshape(n * L, n * L)
    return mask


def reference(q, k, v, kernel, scale=None, dilation=None):
    nd = q.dim() - 3
    sizes = q.shape[1:1 + nd]
    B, H, D, Dv = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    qf, kf, vf = (t.reshape(B, -1, H, t.shape[-1]).transpose(1, 2) for t in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~neighbourhood_mask(sizes, kernel, dilation), float("-inf"))
    o = s.softmax(-1) @ vf
    return o.transpose(1, 2).reshape(B, *sizes, H, Dv)


def qkv(shape, dv=None, seed=0, dtype=torch.float32, requires_grad=False):
    vshape = list(shape[:-1]) + [dv or shape[-1]]
    return (randn(*shape, seed=seed, dtype=dtype, requires_grad=requires_grad),
            randn(*shape, seed=seed + 1, dtype=dtype, requires_grad=requires_grad),
            randn(*vshape, seed=seed + 2, dtype=dtype, requires_grad=requires_grad))


# ---- single device ----

SINGLE = [
    # (shape (B, spatial..., H, D), Dv, kernel)
    ((2, 7, 2, 4), 4, (3,)),
    ((1, 5, 3, 4), 6, (5,)),           # kernel == extent
    ((1, 9, 1, 3), 3, (1,)),           # kernel 1: each query sees only itself
    ((2, 5, 6, 2, 4), 3, (3, 5)),
    ((1, 4, 3, 1, 5), 5, (3, 3)),      # kernel == extent on dim 2
    ((1, 4, 3, 5, 2, 3), 2, (3, 1, 5)),
]


@pytest.mark.parametrize("shape,dv,kernel", SINGLE)
def test_single_device_forward_backward(shape, dv, kernel):
    nd = len(kernel)
    q, k, v = qkv(shape, dv, requires_grad=True)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = FNS[nd](q, k, v, kernel)
    ref = reference(qr, kr, vr, kernel)
    close(out, ref, rtol=1e-5, atol=1e-5, what="forward")
    w = randn(*ref.shape, seed=9)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for a, b, name in ((q, qr, "dq"), (k, kr, "dk"), (v, vr, "dv")):
        close(a.grad, b.grad, rtol=1e-5, atol=1e-5, what=name)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("shape,kernel,dilation", [((1, 7, 6, 1, 3), (3, 5), (2, 1)), ((2, 9, 3, 2), (5,), (1,)),
                                                    ((1, 5, 4, 3, 2, 2), (3, 3, 1), (1, 1, 2))])
def test_backward_forms(threads, shape, kernel, dilation):
    """CPU backward: one task per (batch, head) when they fill the threads, else dq per query then dk/dv per key."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = qkv(shape, 3, requires_grad=True)
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = FNS[len(kernel)](q, k, v, kernel, dilation=dilation)
        ref = reference(qr, kr, vr, kernel, dilation=dilation)
        w = randn(*ref.shape, seed=2)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        for a, b, name in ((q, qr, "dq"), (k, kr, "dk"), (v, vr, "dv")):
            close(a.grad, b.grad, rtol=1e-5, atol=1e-5, what=f"threads={threads} {name}")
    finally:
        torch.set_num_threads(old)


def test_generic_entry_scale_and_int_kernel():
    q, k, v = qkv((1, 6, 5, 2, 4), 3)
    close(neighborhood_attention(q, k, v, 3, scale=0.7), reference(q, k, v, (3, 3), scale=0.7), what="scale")
    close(torch.ops.shardtensor.neighborhood_attention(q, k, v, [3, 5], None), reference(q, k, v, (3, 5)),
          what="torch.ops")


DILATED = [
    # (shape, kernel, dilation)
    ((1, 10, 2, 3), (3,), (3,)),        # groups of 4, 3, 3
    ((1, 9, 1, 4), (3,), (3,)),         # K * d == L
    ((1, 11, 7, 2, 3), (3, 3), (2, 1)),
    ((2, 7, 8, 1, 2), (3, 1), (2, 5)),
    ((1, 5, 4, 6, 1, 2), (1, 3, 3), (2, 1, 2)),
]


@pytest.mark.parametrize("shape,kernel,dilation", DILATED)
def test_dilation(shape, kernel, dilation):
    nd = len(kernel)
    q, k, v = qkv(shape, 3, requires_grad=True)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = FNS[nd](q, k, v, kernel, dilation=dilation)
    ref = reference(qr, kr, vr, kernel, dilation=dilation)
    close(out, ref, rtol=1e-5, atol=1e-5, what="forward")
    w = randn(*ref.shape, seed=9)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for a, b, name in ((q, qr, "dq"), (k, kr, "dk"), (v, vr, "dv")):
        close(a.grad, b.grad, rtol=1e-5, atol=1e-5, what=name)


def test_gradcheck_double():
    q, k, v = qkv((1, 4, 3, 2, 3), 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: neighborhood_attention2d(a, b, c, (3, 3)), (q, k, v))
    q, k, v = qkv((2, 5, 1, 2), 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: neighborhood_attention1d(a, b, c, 3), (q, k, v))
    q, k, v = qkv((1, 7, 1, 2), 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: neighborhood_attention1d(a, b, c, 3, dilation=2), (q, k, v))


def test_bf16_and_inference():
    q, k, v = qkv((1, 6, 5, 2, 8), 8)
    ref = reference(q, k, v, (3, 3))
    out = neighborhood_attention2d(q.bfloat16(), k.bfloat16(), v.bfloat16(), 3)
    assert out.dtype == torch.bfloat16
    close(out.float(), ref, rtol=2e-2, atol=2e-2, what="bf16")
    with torch.inference_mode():
        close(neighborhood_attention2d(q, k, v, 3), ref, what="inference mode")


def test_opcheck_and_compile():
    """Schema, autograd registration, fake-tensor (Meta) kernels, and torch.compile through the autograd function."""
    q, k, v = qkv((1, 6, 5, 2, 4), 3, requires_grad=True)
    res = torch.library.opcheck(torch.ops.shardtensor.neighborhood_attention.default, (q, k, v, [3, 3], [2, 1], None))
    assert all(r == "SUCCESS" for r in res.values()), res
    qd, kd, vd = (t.detach() for t in (q, k, v))
    res = torch.library.opcheck(torch.ops.shardtensor.neighborhood_attention_forward.default,
                                (qd[:, 1:4], kd, vd, [3, 3], [1, 1], [1, 0], [0, 0], [6, 5], 0.5))
    assert all(r == "SUCCESS" for r in res.values()), res
    f = torch.compile(lambda a, b, c: neighborhood_attention2d(a, b, c, 3), backend="aot_eager", fullgraph=True)
    out = f(q, k, v)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, (3, 3))
    close(out, ref, what="compiled forward")
    out.sum().backward()
    ref.sum().backward()
    for a, b, name in ((q, qr, "dq"), (k, kr, "dk"), (v, vr, "dv")):
        close(a.grad, b.grad, rtol=1e-5, atol=1e-5, what=f"compiled {name}")


def test_geometry_ops_on_a_key_window():
    """The internal forward/backward ops with global offsets: queries 4..6 of L=10 against keys 1..9."""
    K, L = 5, 10
    q, k, v = qkv((1, L, 2, 3), 4, requires_grad=True)
    out_full = neighborhood_attention1d(q, k, v, K)
    qs, kw, vw = q.detach()[:, 4:7], k.detach()[:, 1:10], v.detach()[:, 1:10]
    out, lse = torch.ops.shardtensor.neighborhood_attention_forward(qs, kw, vw, [K], [1], [4], [1], [L], 3 ** -0.5)
    close(out, out_full.detach()[:, 4:7], what="window forward")
    assert lse.shape == (1, 3, 2)
    g = torch.zeros_like(out_full)
    g[:, 4:7] = randn(1, 3, 2, 4, seed=3)
    out_full.backward(g)
    dq, dk, dv = torch.ops.shardtensor.neighborhood_attention_backward(g[:, 4:7], qs, kw, vw, out, lse, [K], [1], [4],
                                                                       [1], [L], 3 ** -0.5)
    close(dq, q.grad[:, 4:7], what="window dq")
    close(dk, k.grad[:, 1:10], what="window dk")
    close(dv, v.grad[:, 1:10], what="window dv")
    with pytest.raises(ValueError, match="do not cover"):
        torch.ops.shardtensor.neighborhood_attention_forward(qs, kw[:, 2:], vw[:, 2:], [K], [1], [4], [3], [L], 1.0)


def test_errors_single_device():
    q, k, v = qkv((1, 4, 5, 2, 4))
    with pytest.raises(ValueError, match="smaller than the kernel size"):
        neighborhood_attention2d(q, k, v, 5)
    with pytest.raises(ValueError, match="odd"):
        neighborhood_attention2d(q, k, v, (2, 3))
    with pytest.raises(ValueError, match="entries"):
        neighborhood_attention2d(q, k, v, (3,))
    with pytest.raises(ValueError):
        neighborhood_attention1d(q, k, v, 3)
    with pytest.raises(ValueError, match="agree"):
        neighborhood_attention2d(q, k[:, :3], v, 3)
    with pytest.raises(ValueError, match="times the dilation"):
        neighborhood_attention2d(q, k, v, 3, dilation=(1, 2))
    with pytest.raises(ValueError, match="dilation must be positive"):
        neighborhood_attention2d(q, k, v, 3, dilation=0)


# ---- sharded (rank processes) ----

def case_1d(seed):
    m = mesh()
    w = m.size()
    L = 11
    q, k, v = qkv((2, L, 2, 3), 4, seed=seed)
    for K in (1, 3, 5, 11):
        for ext in (None, uneven_extents(L, w, seed), narrow_extents(L, w)):
            lay = ([st.Shard(1)], None if ext is None else {0: ext})
            check_op(lambda a, b, c: neighborhood_attention1d(a, b, c, K), [q, k, v], [lay] * 3, m, rtol=1e-5,
                     atol=1e-5, what=f"1d K={K} ext={ext}")
    return True


def case_2d(seed):
    m = mesh()
    w = m.size()
    q, k, v = qkv((1, 9, 5, 2, 3), 2, seed=seed)
    for kernel in ((5, 3), (9, 5), (3, 1)):
        for ext in (uneven_extents(9, w, seed), narrow_extents(9, w)):
            lay = ([st.Shard(1)], {0: ext})
            check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, kernel), [q, k, v], [lay] * 3, m, rtol=1e-5,
                     atol=1e-5, what=f"2d height-sharded K={kernel} ext={ext}")
    # Width sharded, batch sharded, heads sharded: the last two are local.
    lay = ([st.Shard(2)], {0: narrow_extents(5, w)})
    check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, 3), [q, k, v], [lay] * 3, m, rtol=1e-5, atol=1e-5,
             what="2d width-sharded")
    q2, k2, v2 = qkv((3, 5, 4, 3, 2), 2, seed=seed + 5)
    for d in (0, 3):
        check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, 3), [q2, k2, v2], [[st.Shard(d)]] * 3, m,
                 rtol=1e-5, atol=1e-5, what=f"2d dim {d} sharded")
    return True


def case_3d(seed):
    m = mesh()
    w = m.size()
    q, k, v = qkv((1, 4, 7, 3, 2, 2), 3, seed=seed)
    lay = ([st.Shard(2)], {0: narrow_extents(7, w)})
    check_op(lambda a, b, c: neighborhood_attention3d(a, b, c, (3, 5, 3)), [q, k, v], [lay] * 3, m, rtol=1e-5,
             atol=1e-5, what="3d")
    return True


def case_2d_mesh(seed):
    """2x2 mesh: height on mesh dim 0, width on mesh dim 1 (uneven, zero extents: corners come along)."""
    m = mesh((2, 2))
    q, k, v = qkv((1, 7, 6, 2, 3), 3, seed=seed)
    for kernel, eh, ew in (((3, 3), [2, 5], [4, 2]), ((5, 3), [0, 7], [1, 5]), ((7, 5), [3, 4], [6, 0])):
        lay = ([st.Shard(1), st.Shard(2)], {0: eh, 1: ew})
        check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, kernel), [q, k, v], [lay] * 3, m, rtol=1e-5,
                 atol=1e-5, what=f"2-D mesh K={kernel} {eh} {ew}")
    # Batch on one mesh dim, height on the other; heads with width.
    q2, k2, v2 = qkv((2, 6, 5, 2, 3), 3, seed=seed + 1)
    check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, 3), [q2, k2, v2],
             [([st.Shard(0), st.Shard(1)], {1: [1, 5]})] * 3, m, rtol=1e-5, atol=1e-5, what="batch + height")
    check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, 3), [q2, k2, v2],
             [([st.Shard(3), st.Shard(2)], None)] * 3, m, rtol=1e-5, atol=1e-5, what="heads + width")
    return True


def case_mixed_layouts(seed):
    """k/v not laid out like q: redistributed to q's layout (gradients flow back through the redistribution)."""
    m = mesh()
    w = m.size()
    q, k, v = qkv((1, 8, 3, 2, 3), 3, seed=seed)
    fn = lambda a, b, c: neighborhood_attention2d(a, b, c, (5, 3))  # noqa: E731
    check_op(fn, [q, k, v], [([st.Shard(1)], {0: uneven_extents(8, w, seed)}), None, ([st.Shard(2)], None)], m,
             rtol=1e-5, atol=1e-5, what="q height, k plain, v width")
    check_op(fn, [q, k, v], [None, ([st.Shard(1)], None), ([st.Shard(1)], None)], m, rtol=1e-5, atol=1e-5,
             what="q plain, k/v height")
    return True


def case_low_precision_and_inference(seed):
    m = mesh()
    w = m.size()
    q, k, v = qkv((1, 9, 4, 2, 8), 8, seed=seed)
    ref = reference(q, k, v, (5, 3))
    lay = dict(sharding_shapes={0: narrow_extents(9, w)})
    qs, ks, vs = (st.distribute_tensor(t.bfloat16(), m, [st.Shard(1)], **lay) for t in (q, k, v))
    out = neighborhood_attention2d(qs, ks, vs, (5, 3))
    assert st.is_shard_tensor(out) and out.dtype == torch.bfloat16
    assert st.placements(out) == (st.Shard(1),)
    close(full(out).float(), ref, rtol=3e-2, atol=3e-2, what="bf16")
    qs, ks, vs = (st.distribute_tensor(t, m, [st.Shard(1)], **lay) for t in (q, k, v))
    with torch.inference_mode():
        out = neighborhood_attention2d(qs, ks, vs, (5, 3))
    close(full(out), ref, rtol=1e-5, atol=1e-5, what="inference mode")
    with torch.no_grad():
        out = neighborhood_attention2d(qs, ks, vs, (5, 3))
    close(full(out), ref, rtol=1e-5, atol=1e-5, what="no_grad")
    return True


def case_large_kernel(seed):
    """The StormScope-like setting: kernel 31 on a grid sharded along height; windows reach several ranks away."""
    m = mesh()
    w = m.size()
    q, k, v = qkv((1, 33, 31, 2, 4), 4, seed=seed)
    for ext in ([11, 11, 11][:w] if w == 3 else None, [2, 1, 30] if w == 3 else None):
        lay = ([st.Shard(1)], None if ext is None else {0: ext})
        check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, 31), [q, k, v], [lay] * 3, m, rtol=1e-5,
                 atol=1e-5, what=f"K=31 ext={ext}")
    return True


def case_dilation(seed):
    """Dilated windows over sharded dims: the gathered rows span the other groups' rows in between."""
    m = mesh()
    w = m.size()
    q, k, v = qkv((1, 13, 6, 2, 3), 2, seed=seed)
    for kernel, dil in (((3, 3), (3, 2)), ((5, 1), (2, 3)), ((3, 3), (4, 1))):
        for ext in (uneven_extents(13, w, seed), narrow_extents(13, w)):
            lay = ([st.Shard(1)], {0: ext})
            check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, kernel, dilation=dil), [q, k, v], [lay] * 3, m,
                     rtol=1e-5, atol=1e-5, what=f"dilated K={kernel} d={dil} ext={ext}")
    return True


def case_partial_grads(seed):
    """Only q (or only v) requires grad: the other gradients are neither computed into ShardTensors nor sent home."""
    m = mesh()
    w = m.size()
    q, k, v = qkv((1, 9, 4, 2, 3), 3, seed=seed)
    ext = {0: narrow_extents(9, w)}
    for needs in ((True, False, False), (False, False, True)):
        full_in = [t.detach().clone().requires_grad_(r) for t, r in zip((q, k, v), needs)]
        ref = reference(*full_in, (5, 3))
        sh = [st.distribute_tensor(t.detach().clone(), m, [st.Shard(1)], sharding_shapes=ext).requires_grad_(r)
              for t, r in zip((q, k, v), needs)]
        out = neighborhood_attention2d(*sh, (5, 3))
        wgt = randn(*ref.shape, seed=4)
        (ref * wgt).sum().backward()
        (out * wgt).sum().backward()
        for a, b, r in zip(sh, full_in, needs):
            if r:
                check_grad_layout(a, what=f"needs={needs}")
                close(full(a.grad), b.grad, rtol=1e-5, atol=1e-5, what=f"needs={needs}")
            else:
                assert a.grad is None
    return True


def border_extents(L, w):
    """Wide shards (an interior: the main call runs) next to a zero-extent and a 1-row one (windows reach past them)."""
    if w == 1:
        return [L]
    if w == 2:
        return [L - 9, 9]
    if w == 3:
        return [1, L - 10, 9]
    return [9, 0, 1, L - 10]


def case_border_split(seed):
    """Shards wide enough for an interior: the main call on the own keys, border queries from border windows (no key
    window built), forward and q/k/v gradients against one device; every rank's split differs (interior, zero, one
    row), dilation, kernels near the shard width, 1-D and 2-D meshes with one sharded spatial dim."""
    m = mesh()
    w = m.size()
    L = 26
    q, k, v = qkv((2, L, 5, 2, 3), 4, seed=seed)
    for kernel, dil in (((3, 3), (1, 1)), ((5, 3), (1, 1)), ((3, 1), (3, 1)), ((5, 3), (2, 1)), ((9, 5), (1, 1))):
        for ext in (border_extents(L, w), uneven_extents(L, w, seed + 3), [L // w + (r < L % w) for r in range(w)]):
            lay = ([st.Shard(1)], {0: ext})
            check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, kernel, dilation=dil), [q, k, v], [lay] * 3, m,
                     rtol=1e-5, atol=1e-5, what=f"border split K={kernel} d={dil} ext={ext}")
    # 1-D, the sharded dim last among the spatial ones, and a 3-D case.
    q1, k1, v1 = qkv((1, L, 2, 3), 2, seed=seed + 1)
    check_op(lambda a, b, c: neighborhood_attention1d(a, b, c, 7, dilation=2), [q1, k1, v1],
             [([st.Shard(1)], {0: border_extents(L, w)})] * 3, m, rtol=1e-5, atol=1e-5, what="1d K=7 d=2")
    q3, k3, v3 = qkv((1, 3, 4, 20, 1, 2), 2, seed=seed + 2)
    check_op(lambda a, b, c: neighborhood_attention3d(a, b, c, (3, 3, 5)), [q3, k3, v3],
             [([st.Shard(3)], {0: [20 // w + (r < 20 % w) for r in range(w)]})] * 3, m, rtol=1e-5, atol=1e-5,
             what="3d width-sharded")
    return True


def case_border_split_2d_mesh(seed):
    """2x2 mesh, one sharded spatial dim and a batch shard: the border execution along the spatial mesh dim."""
    m = mesh((2, 2))
    q, k, v = qkv((2, 18, 4, 2, 3), 3, seed=seed)
    for ext in ([10, 8], [17, 1], [0, 18]):
        check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, (5, 3), dilation=(2, 1)), [q, k, v],
                 [([st.Shard(0), st.Shard(1)], {1: ext})] * 3, m, rtol=1e-5, atol=1e-5, what=f"batch + height {ext}")
    return True


def case_border_split_two_dims(seed):
    """2x2 mesh, two sharded spatial dims wide enough for interiors: the main call on the own block, the border
    queries in slabs against key regions (corners from the diagonal ranks over two hops), no key window built;
    ranks without an interior along a dim (one row, zero rows) gather their window in the same exchange, so both
    paths meet; dilation; two of three spatial dims sharded."""
    m = mesh((2, 2))
    q, k, v = qkv((2, 18, 16, 2, 3), 4, seed=seed)
    for kernel, dil, eh, ew in (((3, 3), (1, 1), [10, 8], [9, 7]), ((5, 3), (1, 1), [7, 11], [8, 8]),
                                ((5, 5), (2, 1), [9, 9], [10, 6]), ((3, 5), (1, 2), [17, 1], [8, 8]),
                                ((5, 3), (1, 1), [0, 18], [12, 4]), ((7, 3), (1, 1), [9, 9], [3, 13])):
        check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, kernel, dilation=dil), [q, k, v],
                 [([st.Shard(1), st.Shard(2)], {0: eh, 1: ew})] * 3, m, rtol=1e-5, atol=1e-5,
                 what=f"two dims K={kernel} d={dil} {eh} {ew}")
    # Width on mesh dim 0 and height on mesh dim 1 (the plan's order is the mesh's).
    check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, (3, 5)), [q, k, v],
             [([st.Shard(2), st.Shard(1)], {0: [7, 9], 1: [11, 7]})] * 3, m, rtol=1e-5, atol=1e-5,
             what="width x height")
    q3, k3, v3 = qkv((1, 12, 3, 14, 1, 2), 2, seed=seed + 1)
    check_op(lambda a, b, c: neighborhood_attention3d(a, b, c, (3, 3, 5)), [q3, k3, v3],
             [([st.Shard(1), st.Shard(3)], {0: [5, 7], 1: [8, 6]})] * 3, m, rtol=1e-5, atol=1e-5,
             what="3d depth x width")
    return True


def case_head_dim_sharded(seed):
    m = mesh()
    q, k, v = qkv((1, 5, 4, 2, 4), 4, seed=seed)
    qs, ks, vs = (st.distribute_tensor(t, m, [st.Shard(4)]) for t in (q, k, v))
    neighborhood_attention2d(qs, ks, vs, 3)


def case_kernel_too_large(seed):
    m = mesh()
    q, k, v = qkv((1, 5, 4, 2, 4), 4, seed=seed)
    qs, ks, vs = (st.distribute_tensor(t, m, [st.Shard(1)]) for t in (q, k, v))
    neighborhood_attention2d(qs, ks, vs, (5, 5))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_1d(world):
    harness.run(world, case_1d, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_2d(world):
    harness.run(world, case_2d, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_3d(world):
    harness.run(world, case_3d, world)


def test_sharded_2d_mesh():
    harness.run(4, case_2d_mesh, 1, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_mixed_layouts(world):
    harness.run(world, case_mixed_layouts, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_dilation(world):
    harness.run(world, case_dilation, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_large_kernel(world):
    harness.run(world, case_large_kernel, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_partial_grads(world):
    harness.run(world, case_partial_grads, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_border_split(world):
    harness.run(world, case_border_split, world, timeout=300)


def test_border_split_two_dims():
    harness.run(4, case_border_split_two_dims, 1, timeout=300)


def test_border_split_2d_mesh():
    harness.run(4, case_border_split_2d_mesh, 1, timeout=300)


def test_low_precision_and_inference():
    harness.run(3, case_low_precision_and_inference, 3)


def test_errors_sharded():
    harness.expect_error(2, case_head_dim_sharded, 0, match="head_dim", kinds=("NotImplementedError",))
    harness.expect_error(3, case_kernel_too_large, 0, match="smaller than the kernel size", kinds=("ValueError",))


# ---- CUDA kernel (a GPU machine only: benchmarks/gpu_check.sh runs these) ----

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-10), (torch.bfloat16, 3e-2),
                                       (torch.float16, 5e-3)])
@pytest.mark.parametrize("shape,dv,kernel,dilation", [
    ((2, 11, 3, 8), 8, (5,), (1,)),
    ((1, 9, 10, 2, 64), 48, (5, 7), (1, 1)),        # head dims over 32: several values per lane
    ((1, 13, 6, 2, 200), 256, (3, 3), (3, 2)),      # dilation, head dims near the 256 limit
    ((1, 5, 6, 7, 2, 16), 16, (3, 5, 3), (1, 1, 2)),
])
def test_cuda_kernel_matches_cpu(dtype, tol, shape, dv, kernel, dilation):
    q, k, v = qkv(shape, dv, dtype=dtype, requires_grad=True)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    fn = FNS[len(kernel)]
    out = fn(q, k, v, kernel, dilation=dilation)
    out_c = fn(qc, kc, vc, kernel, dilation=dilation)
    assert out_c.is_cuda and out_c.dtype == dtype
    close(out_c.cpu().double(), out.double(), rtol=tol, atol=tol, what="cuda forward")
    g = randn(*out.shape, seed=5, dtype=dtype)
    out.backward(g)
    out_c.backward(g.cuda())
    for a, b, name in ((qc, q, "dq"), (kc, k, "dk"), (vc, v, "dv")):
        close(a.grad.cpu().double(), b.grad.double(), rtol=tol, atol=tol * 10, what=f"cuda {name}")


@cuda_only
def test_cuda_head_dim_limit():
    q, k, v = (t.cuda() for t in qkv((1, 5, 1, 300), 4))
    with pytest.raises(NotImplementedError, match="head dims up to 256"):
        neighborhood_attention1d(q, k, v, 3)


def case_cuda_sharded(seed):
    torch.cuda.set_device(0)
    m = mesh()
    w = m.size()
    q, k, v = (t.cuda() for t in qkv((1, 11, 7, 2, 40), 24, seed=seed))
    for kernel, dil in (((5, 3), (1, 1)), ((3, 3), (2, 2)), ((11, 7), (1, 1))):
        for ext in (uneven_extents(11, w, seed), narrow_extents(11, w)):
            lay = ([st.Shard(1)], {0: ext})
            check_op(lambda a, b, c: neighborhood_attention2d(a, b, c, kernel, dilation=dil), [q, k, v], [lay] * 3, m,
                     rtol=1e-4, atol=1e-5, what=f"cuda sharded K={kernel} d={dil} ext={ext}")
    return True


@cuda_only
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_sharded(world):
    harness.run(world, case_cuda_sharded, world, timeout=300)
