"""In-place ops on views of ShardTensors that take part in autograd, against the single-device computation
(forward, input gradients, parameter gradients): slices along unsharded and sharded dims (new extents, zero
allowed), views of views, transposes/permutes, unsqueeze/squeeze, reshapes, selects (along a sharded dim too),
`x[...] = v`, an in-place op on the base after a view was taken, the in-place activation after InstanceNorm
(whose output is a view) of MONAI's blocks; 1-4 ranks and a 2-D mesh. Autograd replays these views with the ops
that made them (CopySlices never needs `as_strided`); `unbind` pieces refuse in-place writes as on one device; an
`as_strided` of a sub-grid is rebuilt from views, any other non-identity one raises on every rank. Views computed as
copies (re-laid out) carry writes back into their input, and writes into the input into them."""
import pytest
import torch
import torch.nn as nn

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, uneven_extents

TOL = dict(rtol=1e-5, atol=1e-6)


def _param_like(p, v):
    """The parameter `p` (shape (5,)) broadcast to the view when its last dim is 5, else its sum (a scalar)."""
    return p if v.dim() >= 1 and v.shape[-1] == 5 else p.sum()


# In-place ops that have in-place rules; `p` is a plain parameter that requires grad (its gradient is checked).
OPS = [
    ("mul_", lambda v, p: v.mul_(2.0)),
    ("mul_ tensor", lambda v, p: v.mul_(v.detach() * 0 + 3.0)),
    ("add_ param", lambda v, p: v.add_(_param_like(p, v))),
    ("mul_ param", lambda v, p: v.mul_(_param_like(p, v).sigmoid())),
    ("relu_", lambda v, p: v.relu_()),
    ("clamp_", lambda v, p: v.clamp_(-0.5, 0.5)),
    ("fill_", lambda v, p: v.fill_(1.5)),
    ("zero_", lambda v, p: v.zero_()),
    ("copy_", lambda v, p: v.copy_(torch.full_like(v, 0.25))),
    ("copy_ param", lambda v, p: v.copy_(_param_like(p, v).expand(v.shape))),
    ("masked_fill_", lambda v, p: v.masked_fill_(v.detach() > 0.3, -2.0)),
    ("sigmoid_", lambda v, p: v.sigmoid_()),
]


# Views the library supports for reading, of a (4, 6, 5) tensor.
VIEWS = [
    ("[:, :c]", lambda h: h[:, :3]),
    ("[:, 1:5:2]", lambda h: h[:, 1:5:2]),
    ("[1:3]", lambda h: h[1:3]),
    ("[..., 1:]", lambda h: h[..., 1:]),
    ("[:, :c][..., 1:]", lambda h: h[:, :4][..., 1:]),
    ("[:, :c][1:][..., :2]", lambda h: h[:, :4][1:][..., :2]),
    ("transpose(0, 2)", lambda h: h.transpose(0, 2)),
    ("permute(2, 0, 1)[:, 1:]", lambda h: h.permute(2, 0, 1)[:, 1:]),
    ("unsqueeze(1)", lambda h: h.unsqueeze(1)),
    ("unsqueeze(0)[:, 1:]", lambda h: h.unsqueeze(0)[:, 1:]),
    ("[:, 2]", lambda h: h[:, 2]),
    ("[1]", lambda h: h[1]),
    ("[:, None, 1:3]", lambda h: h[:, None, 1:3]),
    ("view(4, 30)[:, 5:]", lambda h: h.view(4, 30)[:, 5:]),
    ("narrow(2, 1, 3)", lambda h: h.narrow(2, 1, 3)),
]


def _check_all(x, lay, m, tag, views=VIEWS):
    p = randn(5, seed=9)
    probe = st.distribute_tensor(x, m, lay[0], lay[1])
    done = 0
    for vname, view in views:
        try:
            with torch.no_grad():
                view(probe * 1.0).mul_(1.0)
        except NotImplementedError:
            # Not a view the library reads in this layout -- decided from the layout, alike on every rank. (Views
            # it computes as copies carry writes back into the input: test_relaid_view_written.)
            continue
        done += 1
        for oname, op in OPS:
            def fn(t, p, view=view, op=op):
                h = t * 1.0  # not a leaf, so its views may be written with autograd recording
                op(view(h), p)
                return h * 1.5

            check_op(fn, [x, p], [lay, None], m, **TOL, what=f"{tag} {vname}.{oname}")
    assert done >= len(views) - 2, f"{tag}: only {done} of {len(views)} views are readable"


def case_inplace_views(shard_dim, seed):
    m = mesh()
    wld = m.size()
    x = randn(4, 6, 5, seed=seed)
    lay = ([st.Shard(shard_dim)], {0: uneven_extents(x.shape[shard_dim], wld, seed)})
    _check_all(x, lay, m, f"S({shard_dim})")
    return True


def case_inplace_views_2d_mesh():
    m = mesh((2, 2), ("a", "b"))
    x = randn(4, 6, 5, seed=4)
    lay = ([st.Shard(1), st.Shard(2)], {0: [0, 6], 1: [3, 2]})
    _check_all(x, lay, m, "[S(1), S(2)]", VIEWS[:9])
    lay = ([st.Shard(0), st.Replicate()], {0: [3, 1]})
    _check_all(x, lay, m, "[S(0), R]", VIEWS[4:])
    return True


def case_views_of_changed_base(seed):
    """The base is written after the view was taken (the view's history is rebuilt from the base by replaying
    the view), and a view written after another view of the same base was used."""
    m = mesh()
    wld = m.size()
    x = randn(4, 6, 5, seed=seed)
    for d in (1, 2):
        lay = ([st.Shard(d)], {0: uneven_extents(x.shape[d], wld, seed + d)})

        def base_then_view(t):
            h = t * 1.0
            v = h[:, 1:4].transpose(1, 2)
            h.mul_(2.0)
            return v * 3.0, h

        def two_views(t):
            h = t * 2.0 + 1.0
            a = h[:, :3]
            b = h[:, 3:]
            s = a.sum() + b.sum()
            b.mul_(0.5)
            a.relu_()  # last: relu_ saves its result, which a later write to the same base would invalidate
            return h, s

        def setitem(t, v):
            h = t * 1.0
            h[:, 1:3] = v
            h[..., :2] *= 2.0
            return h

        check_op(base_then_view, [x], [lay], m, **TOL, what=f"S({d}) base written after view")
        check_op(two_views, [x], [lay], m, **TOL, what=f"S({d}) two views")
        check_op(setitem, [x, randn(4, 2, 5, seed=3)], [lay, None], m, **TOL, what=f"S({d}) setitem plain v")
        check_op(setitem, [x, randn(4, 2, 5, seed=3)], [lay, lay if d == 2 else None], m, **TOL,
                 what=f"S({d}) setitem sharded v")
    return True


class _NormActBlock(nn.Module):
    """MONAI's Convolution/UnetResBlock pattern: conv -> InstanceNorm -> in-place activation, the activation
    writing a view (instance_norm returns a reshaped view of batch_norm's output); channel slices written in place
    (DynUNet/UNETR-style skip handling)."""

    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.InstanceNorm2d(4, affine=True)
        self.act = act

    def forward(self, x):
        y = self.norm(self.conv(x))
        y[:, :2].mul_(2.0)
        return self.act(y)


def case_norm_act(seed):
    m = mesh()
    wld = m.size()
    x = randn(2, 3, 7, 6, seed=seed)
    for act_name, act in [("ReLU", nn.ReLU(inplace=True)), ("LeakyReLU", nn.LeakyReLU(0.1, inplace=True))]:
        for d in (2, 3):
            ref = _NormActBlock(act)
            torch.manual_seed(seed)
            for p in ref.parameters():
                nn.init.normal_(p, std=0.5)
            mod = _NormActBlock(act)
            mod.load_state_dict(ref.state_dict())
            xr = x.clone().requires_grad_()
            yr = ref(xr)
            xs = st.distribute_tensor(x.clone(), m, [st.Shard(d)], {0: uneven_extents(x.shape[d], wld, seed + d)})
            xs.requires_grad_()
            ys = mod(xs)
            torch.testing.assert_close(ys.full_tensor(), yr, rtol=1e-4, atol=1e-5)
            g = randn(*yr.shape, seed=5)
            (yr * g).sum().backward()
            (ys * g).sum().backward()
            torch.testing.assert_close(xs.grad.full_tensor(), xr.grad, rtol=1e-4, atol=1e-5)
            for (n, pr), ps in zip(ref.named_parameters(), mod.parameters()):
                gs = ps.grad.full_tensor() if st.is_shard_tensor(ps.grad) else ps.grad
                torch.testing.assert_close(gs, pr.grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda s, n=n: f"{act_name} S({d}) grad {n}: {s}")
    return True


def case_unbind_inplace_refused():
    """Writing an unbind piece in place is refused by autograd on one device too (multi-output views); the
    ShardTensor raises the same error on every rank."""
    m = mesh()
    x = st.distribute_tensor(randn(4, 6), m, [st.Shard(1)]).requires_grad_()
    h = x * 1.0
    h.unbind(0)[1].mul_(2.0)


def case_unbind_read():
    m = mesh()
    x = randn(4, 6, seed=2)
    check_op(lambda t: [p * (i + 1) for i, p in enumerate(t.unbind(0))], [x], [([st.Shard(1)], None)], m, **TOL,
             what="unbind read")
    check_op(lambda t: [p * (i + 1) for i, p in enumerate(t.unbind(1))], [x], [([st.Shard(1)], None)], m, **TOL,
             what="unbind sharded dim read")
    return True


def case_as_strided_identity(seed):
    """`as_strided(_)` with the tensor's own geometry (strides of size-1 dims may differ) is the identity, for values
    and gradients; the wrapper takes the requested strides and keeps its spec, a pending Partial included."""
    m = mesh()
    w = m.size()
    x = randn(3, 4, 1, seed=seed)
    lay = ([st.Shard(1)], {0: uneven_extents(4, w, seed)})
    # The tensor's own strides with another stride on the size-1 dim (global strides follow each rank's local).
    check_op(lambda t: t.as_strided((3, 4, 1), t.stride()[:2] + (7,)) * 2.0, [x], [lay], m, **TOL,
             what="as_strided identity")
    check_op(lambda t: (t * 1.0).as_strided_((3, 4, 1), t.stride()[:2] + (9,)) * 2.0, [x], [lay], m, **TOL,
             what="as_strided_ identity")
    x4 = randn(2, 3, 5, 4, seed=seed)
    xs = st.distribute_tensor(x4, m, [st.Shard(2)], {0: uneven_extents(5, w, seed + 1)})
    p = xs.sum((2, 3), keepdim=True)
    want = st.placements(p)
    assert p.as_strided_((2, 3, 1, 1), (3, 1, 3, 3)) is p
    assert st.placements(p) == want and p.stride() == (3, 1, 3, 3), (st.placements(p), p.stride())
    assert p.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(p.full_tensor(), x4.sum((2, 3), keepdim=True), **TOL)
    return True


def case_as_strided_refused(kind):
    """Overlapping windows (two output dims walking the same dim) are no sub-grid: refused on every rank."""
    m = mesh()
    xs = st.distribute_tensor(randn(3, 4, seed=1), m, [st.Shard(1)]).requires_grad_(kind == "grad")
    if kind == "inplace":
        xs.as_strided_((3, 4), (1, 3))
    xs.as_strided((2, 3), (1, 1))


# Geometries of a contiguous (3, 4, 5) tensor that select a sub-grid of its elements: (size, stride, offset).
SUB_GRIDS = [
    ((), (), None),               # the first element (torchdiffeq's adjoint: torch.as_strided(y, (), ()))
    ((), (), 27),                 # one element by its offset (index (1, 1, 2))
    ((3, 2, 5), (20, 10, 1), None),  # x[:, ::2]
    ((2, 3), (1, 20), 6),         # x[:, 1, 1:3].t(): a transposition
    ((2, 2, 1), (20, 5, 7), 26),  # x[1:3, 1:3, 1:2] with a size-1 dim of any stride
    ((4, 3), (5, 20), 0),         # x[:, :, 0].t()
]


def case_as_strided_sub_grids(seed):
    """Sub-grids are rebuilt from slices, selects and a permutation: values and gradients equal one device on
    uneven shards of every dim."""
    m = mesh()
    x = randn(3, 4, 5, seed=seed)
    for d in range(3):
        lay = ([st.Shard(d)], {0: uneven_extents(x.shape[d], m.size(), seed + d)})
        for size, stride, offset in SUB_GRIDS:
            check_op(lambda t: torch.as_strided(t, size, stride, offset) * 2.0, [x], [lay], m, **TOL,
                     what=f"as_strided{size, stride, offset} with dim {d} split")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shard_dim", [0, 1, 2])
def test_inplace_views(world, shard_dim):
    harness.run(world, case_inplace_views, shard_dim, world + shard_dim)


def test_inplace_views_2d_mesh():
    harness.run(4, case_inplace_views_2d_mesh)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_views_of_changed_base(world):
    harness.run(world, case_views_of_changed_base, world)


@pytest.mark.parametrize("world", [2, 3])
def test_norm_act(world):
    harness.run(world, case_norm_act, world)


def test_unbind():
    harness.run(2, case_unbind_read)
    harness.expect_error(2, case_unbind_inplace_refused, match="multiple views", kinds=("RuntimeError",))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_as_strided_sub_grids(world):
    harness.run(world, case_as_strided_sub_grids, 50 + world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_as_strided(world):
    harness.run(world, case_as_strided_identity, world)
    for kind in ("plain", "grad", "inplace"):
        harness.expect_error(world, case_as_strided_refused, kind, match="no global storage to restride",
                             kinds=("NotImplementedError",))


# Views the library computes as copies (the input re-laid out first, or the result moved after a local view), written
# in place: the write is carried back into the input (write_back.h), so the input and everything read from it after
# the write equal one device, gradients too. (name, view, full shape, placements)
RELAID = [
    # a sharded inner dim of a merge (the shard moves to the outer dim first)
    ("view(4, 30)[:, 5:]", lambda h: h.view(4, 30)[:, 5:], (4, 6, 5), [st.Shard(2)]),
    # einops' rearrange(x, 'b c h w -> b (h w) c') with W split (vit-pytorch's CCT tokenizer, then `x += pos`)
    ("permute.reshape", lambda h: h.permute(0, 2, 3, 1).reshape(2, 30, 3), (2, 3, 6, 5), [st.Shard(3)]),
    # a split whose outer factor is small (the result's shard moves inward after a local view)
    ("view(2, 2, 6, 5)", lambda h: h.view(2, 2, 6, 5), (2, 12, 5), [st.Shard(1)]),
    # a view of a re-laid view
    ("view.view", lambda h: h.view(4, 30).view(4, 6, 5)[:, 1:], (4, 6, 5), [st.Shard(2)]),
    # a select copy (a row of the sharded dim, scattered along its rows) viewed, with a re-layout where the extents
    # do not fit: the write goes back through both
    ("select.view", lambda h: h[2].view(2, 10), (6, 4, 5), [st.Shard(0)]),
    # a select copy of 3 dims, scattered from the owner along the next dim
    ("select scattered", lambda h: h[:, 1], (3, 4, 6, 5), [st.Shard(1)]),
    # a select copy that one device cannot view either (x[:, 2] is not contiguous): reshape copies, the write stays
    # in the copy (the copy's strides are one device's, not its dense local tensor's)
    ("select.reshape", lambda h: h[:, 2].reshape(15), (3, 6, 5), [st.Shard(1)]),
]


def case_relaid_view_written(k, seed, written="view"):
    """Every in-place op of OPS through a re-laid view (``written="view"``: the input then read), or into the input
    after the view was taken (``"base"``: the view's copy is computed again, as a view would show the write on one
    device): against one device."""
    m = mesh()
    vname, view, shape, pl = RELAID[k]
    x = randn(*shape, seed=seed)
    p = randn(5, seed=9)
    lay = (pl, {0: uneven_extents(shape[pl[0].dim], m.size(), seed)})
    for oname, op in OPS:
        def fn(t, p, view=view, op=op):
            h = t * 1.0
            v = view(h)
            op(v if written == "view" else h, p)
            return h * 1.5, v * 0.5

        check_op(fn, [x, p], [lay, None], m, **TOL, what=f"{written} written, {vname}.{oname}")
    return True


def _two_relayouts(h):
    """Two views that each re-lay the input out on 2 ranks with extents (1, 5): a split of the sharded dim whose
    extents are not multiples of its inner factor, then a merge of it under the leading dim."""
    a = h.view(4, 3, 2, 5)
    return a, a.view(12, 2, 5)


def case_relaid_chain_written():
    """A write into the second of two re-laid views reaches the input through the first (kept alive), and the
    input's other views computed as copies are computed again."""
    m = mesh()
    x = randn(4, 6, 5, seed=3)
    p = randn(5, seed=9)
    lay = ([st.Shard(1)], {0: [1, 5]})
    for oname, op in OPS:
        def fn(t, p, op=op):
            h = t * 1.0
            a, b = _two_relayouts(h)
            op(b, p)
            return h * 1.5, a * 0.5, b * 2.0

        check_op(fn, [x, p], [lay, None], m, **TOL, what=f"chain {oname}")
    return True


def chain_middle_freed():
    """The first view's copy freed before the write, its input alive: the write cannot reach it, refused. (Under
    inference mode: elsewhere autograd's view record of the second view keeps the first alive, and the write goes
    through it.)"""
    m = mesh()
    with torch.inference_mode():
        h = st.distribute_tensor(randn(4, 6, 5, seed=3), m, [st.Shard(1)], sharding_shapes={0: [1, 5]}) * 1.0
        b = _two_relayouts(h)[1]
        b.mul_(2.0)


def case_chain_middle_dropped():
    """The first view's variable dropped before the write (autograd's view record keeps it): the write reaches the
    input as on one device."""
    m = mesh()
    x = randn(4, 6, 5, seed=3)
    h = st.distribute_tensor(x, m, [st.Shard(1)], sharding_shapes={0: [1, 5]}) * 1.0
    b = _two_relayouts(h)[1]
    b.mul_(2.0)
    close(full(h), x * 2.0, what="input written through two re-laid views")
    return True


def case_relaid_view_written_2d_mesh():
    """H and W of an image split on a 2x2 mesh, the pixels flattened into tokens (the W shard cannot stay under H's)
    and written: the write reaches the image."""
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 3, 6, 5, seed=5)
    p = randn(5, seed=9)
    for oname, op in OPS:
        def fn(t, p, op=op):
            h = t * 1.0
            v = h.permute(0, 2, 3, 1).reshape(2, 30, 3)
            op(v, p)
            return h * 1.5, v * 0.5

        check_op(fn, [x, p], [([st.Shard(2), st.Shard(3)], {0: [4, 2], 1: [2, 3]}), None], m, **TOL,
                 what=f"2x2 flatten.{oname}")
    return True


def case_relaid_view_read():
    """Reading the same re-laid-out view (no write) is fine, and writes to the input before the view reach it."""
    m = mesh()
    x = randn(4, 6, 5, seed=11)
    xs = st.distribute_tensor(x, m, [st.Shard(2)])
    h, hr = xs * 1.0, x * 1.0
    h[..., 1:].mul_(2.0)
    hr[..., 1:].mul_(2.0)
    close(full(h.view(4, 30)[:, 5:] * 3.0), hr.view(4, 30)[:, 5:] * 3.0, what="read a re-laid-out view")
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("k", range(len(RELAID)), ids=[r[0] for r in RELAID])
def test_relaid_view_written(world, k):
    harness.run(world, case_relaid_view_written, k, 30 + k)


@pytest.mark.parametrize("k", range(len(RELAID) - 1), ids=[r[0] for r in RELAID[:-1]])
def test_relaid_view_base_written(k):
    harness.run(3, case_relaid_view_written, k, 40 + k, "base")


def test_relaid_chain():
    harness.run(2, case_relaid_chain_written)
    harness.run(2, case_chain_middle_dropped)
    harness.expect_error(2, chain_middle_freed, match="copy that is gone", kinds=("NotImplementedError",))


def test_relaid_view_written_2d_mesh():
    harness.run(4, case_relaid_view_written_2d_mesh)
    harness.run(2, case_relaid_view_read)

