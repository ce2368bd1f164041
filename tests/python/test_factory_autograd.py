"""Copies, factories and autograd plumbing: _to_copy, clone, *_like, new_*, item, detach, nn.Parameter
ShardTensors, gradient accumulation, an optimizer step, backward on Partial and replicated scalars, dropout,
and handlers registered from Python."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_grad_layout, check_op, close, full, mesh, randn, rank, uneven_extents


def case_copies_factories(seed):
    m = mesh()
    x = randn(7, 3, seed=seed)
    ext = {0: uneven_extents(7, m.size(), seed)}
    xs = st.distribute_tensor(x, m, [st.Shard(0)], ext)
    for name, fn in [("double", lambda t: t.double()), ("to half", lambda t: t.to(torch.float16).float()),
                     ("clone", lambda t: t.clone()), ("detach", lambda t: t.detach() * 1)]:
        check_op(fn, [x], [([st.Shard(0)], ext)], m, what=name)
    for name, fn, ref in [("zeros_like", torch.zeros_like, torch.zeros(7, 3)), ("ones_like", torch.ones_like, torch.ones(7, 3)),
                          ("full_like", lambda t: torch.full_like(t, 2.5), torch.full((7, 3), 2.5)),
                          ("new_zeros", lambda t: t.new_zeros(7, 3), torch.zeros(7, 3)),
                          ("new_ones other", lambda t: t.new_ones(2), torch.ones(2))]:
        y = fn(xs)
        assert st.is_shard_tensor(y), name
        close(full(y), ref, what=name)
    assert st.sharding_shapes(torch.empty_like(xs)) == ext
    r = torch.rand_like(xs)
    assert r.shape == x.shape and st.sharding_shapes(r) == ext
    assert abs(xs.sum().item() - x.sum().item()) < 1e-4
    assert abs(xs[2, 1].item() - x[2, 1].item()) < 1e-6
    assert torch.equal(xs, st.distribute_tensor(x, m, [st.Shard(0)]))
    assert xs.is_contiguous() and xs.dtype == torch.float32 and xs.device.type == "cpu"
    return True


def case_autograd_plumbing(seed):
    m = mesh()
    x = randn(8, 4, seed=seed)
    ext = {0: uneven_extents(8, m.size(), seed)}
    p = torch.nn.Parameter(st.distribute_tensor(x, m, [st.Shard(0)], ext))
    assert st.is_shard_tensor(p) and p.requires_grad and p.is_leaf
    ref = x.clone().requires_grad_(True)
    for _ in range(2):  # second backward accumulates (add_ on a ShardTensor .grad)
        (p * p).sum().backward()
        (ref * ref).sum().backward()
    assert st.sharding_shapes(p.grad) == ext
    close(full(p.grad), ref.grad, what="accumulated grad")
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    opt.step()
    opt_ref.step()
    close(full(p.detach()), ref.detach(), what="SGD step")
    # backward() on a replicated scalar and on a Partial scalar.
    y = st.distribute_tensor(x, m, [st.Shard(0)], ext).requires_grad_(True)
    y.mean().backward()
    check_grad_layout(y, what="Partial scalar backward")
    close(full(y.grad), torch.full_like(x, 1 / x.numel()), what="Partial scalar backward")
    z = st.distribute_tensor(x, m, [st.Replicate()]).requires_grad_(True)
    (z * 2).sum().backward()
    check_grad_layout(z, what="replicated scalar backward")
    close(full(z.grad), torch.full_like(x, 2.0), what="replicated scalar backward")
    return True


def case_dropout(seed):
    m = mesh()
    x = randn(6, 5, seed=seed)
    check_op(lambda t: F.dropout(t, 0.0, training=True), [x], [([st.Shard(0)], None)], m, what="dropout p=0")
    xs = st.distribute_tensor(x, m, [st.Shard(0)])
    d = F.dropout(xs, 0.5, training=True)
    kept = full(d) != 0
    close(full(d)[kept], (x * 2)[kept], what="dropout scale")
    return True


def _gathered(t):
    """Every rank's copy of a plain tensor (same shape on every rank)."""
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t.contiguous())
    return out


def case_random_streams(mesh_shape):
    """Random draws on ShardTensors (src/dispatch/shard_random.h): the shards draw from distinct streams, ranks of a
    replicated mesh dim draw alike, and the generator stays in step on every rank whatever the extents, so a later
    plain draw is the same everywhere (it differed after a dropout of uneven shards: replicated values diverged); a
    tensor no mesh dim splits draws what one device draws (MONAI's VAEs' reparameterised latents)."""
    m = mesh(mesh_shape)
    torch.manual_seed(11)  # seeded alike, the usual recipe
    x = torch.ones(24, 16)
    split = [st.Shard(0)] + [st.Replicate()] * (len(mesh_shape) - 1)
    xs = st.distribute_tensor(x, m, split, sharding_shapes={0: uneven_extents(24, m.size(0), seed=2)})
    d = F.dropout(xs, 0.5, training=True)
    noise = torch.randn_like(xs)
    after = torch.rand(8)                             # a plain draw after the sharded ones
    assert all(torch.equal(a, after) for a in _gathered(after)), "the generator is out of step between ranks"
    # distinct streams per shard: the first local row of each mesh-dim-0 coordinate differs (p = 2^-16 per pair)
    firsts = _gathered(torch.cat([d.to_local()[:1], noise.to_local()[:1]]) if d.to_local().shape[0] else
                       torch.full((2, 16), float(m.get_coordinate()[0] + 7)))
    coords = [m.mesh.flatten().tolist().index(r) for r in range(torch.distributed.get_world_size())]
    by_coord = {}
    for r, f in enumerate(firsts):
        c0 = divmod(coords[r], m.size(1))[0] if len(mesh_shape) > 1 else coords[r]
        by_coord.setdefault(c0, []).append(f)
    for group in by_coord.values():   # ranks sharing the split coordinate (a replicated mesh dim) draw alike
        assert all(torch.equal(group[0], g) for g in group), "replicated mesh dim drew differently"
    heads = [g[0] for g in by_coord.values()]
    assert len({tuple(h.flatten().tolist()) for h in heads}) == len(heads), "two shards drew the same numbers"
    kept = full(d) != 0
    close(full(d)[kept], (x * 2)[kept], what="dropout scale")
    assert 0.3 < kept.double().mean() < 0.7
    # a Replicate tensor's draw is one device's (a VAE's noise for a replicated latent), the same on every rank, and
    # the generator advances as on one device; a pending sum's fresh draw (Replicate) is the same on every rank
    torch.manual_seed(21)
    r = torch.rand_like(st.distribute_tensor(x, m, [st.Replicate()] * len(mesh_shape)))
    r_next = torch.rand(3)
    torch.manual_seed(21)
    assert torch.equal(r.to_local(), torch.rand_like(x)) and torch.equal(r_next, torch.rand(3))
    assert all(torch.equal(a, r.to_local()) for a in _gathered(r.to_local()))
    pending = xs.sum(0)
    assert type(st.placements(pending)[0]).__name__ == "Partial"
    noise_p = torch.randn_like(pending)
    assert all(torch.equal(a, noise_p.to_local()) for a in _gathered(noise_p.to_local()))
    # an explicit generator is kept in step too
    g = torch.Generator().manual_seed(5)
    xs.clone().uniform_(generator=g)
    nxt = torch.rand(4, generator=g)
    assert all(torch.equal(a, nxt) for a in _gathered(nxt))
    # reproducible: the same seed gives the same sharded draw
    torch.manual_seed(3)
    a = torch.randn_like(xs).to_local().clone()
    torch.manual_seed(3)
    assert torch.equal(torch.randn_like(xs).to_local(), a)
    # ops tagged random that draw nothing for these arguments leave the generator where one device leaves it (a VAE's
    # self-attention block advanced it, so its posterior noise afterwards differed from one device's)
    q = torch.randn(1, 2, 24, 4)
    qs = st.distribute_tensor(q, m, [st.Shard(2)] + [st.Replicate()] * (len(mesh_shape) - 1))
    calls = [("scaled_dot_product_attention", lambda t: F.scaled_dot_product_attention(t, t, t)),
             ("flash attention for cpu", lambda t: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(t, t, t)),
             ("native_dropout out of training", lambda t: torch.native_dropout(t, 0.5, False)),
             ("rrelu out of training", lambda t: F.rrelu(t, training=False))]
    for what, fn in calls:
        torch.manual_seed(9)
        fn(q)
        want = torch.rand(3)
        torch.manual_seed(9)
        fn(qs)
        assert torch.equal(torch.rand(3), want), f"{what} moved the generator"
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_random_streams(mesh_shape):
    harness.run(int(torch.tensor(mesh_shape).prod()), case_random_streams, mesh_shape)


def case_python_handler(seed):
    m = mesh()

    def hash_along_last(x, dim, keepdim=False, mode=0):
        # torch.hash_tensor along the last dim of a row-sharded tensor: local per row. Run on the local tensor and
        # rewrap the result with the rows' layout.
        assert list(dim) in ([-1], [2]) and not keepdim and st.placements(x) == (st.Shard(0),), "only this test's case"
        out = torch.ops.aten.hash_tensor.default(st.to_local(x), dim, keepdim=keepdim, mode=mode)
        return st.from_local(out, st.device_mesh(x), st.placements(x), sharding_shapes=st.sharding_shapes(x))

    # An op without a built-in rule (roll, rot90, renorm and mode, the former examples here, have one now).
    assert not st._C.has_handler("aten::hash_tensor")
    st.register_handler(torch.ops.aten.hash_tensor.default, hash_along_last)
    assert st._C.has_handler("aten::hash_tensor")
    x = torch.randn(5, 4, 6, generator=torch.Generator().manual_seed(seed))
    xs = st.distribute_tensor(x, m, [st.Shard(0)], {0: uneven_extents(5, m.size(), seed)})
    got = torch.hash_tensor(xs, [-1])
    assert st.placements(got) == (st.Shard(0),), st.placements(got)
    assert torch.equal(full(got), torch.hash_tensor(x, [-1])), "python handler values"
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_copies_factories(world):
    harness.run(world, case_copies_factories, world)


@pytest.mark.parametrize("world", [2, 4])
def test_autograd_plumbing(world):
    harness.run(world, case_autograd_plumbing, world)


@pytest.mark.parametrize("world", [2])
def test_dropout(world):
    harness.run(world, case_dropout, world)


def test_python_handler():
    harness.run(1, case_python_handler, 1)


def case_sync_module(shape):
    import torch.distributed as dist
    m = mesh(shape, ("a", "b")[: len(shape)] if len(shape) > 1 else ("domain",))
    torch.manual_seed(100 + rank())  # different weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    st.sync_module(model, m)
    flat = torch.cat([t.detach().flatten().float() for t in list(model.parameters()) + list(model.buffers())])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for g in gathered:
        assert torch.equal(g, gathered[0]), "parameters differ after sync_module"
    torch.manual_seed(100)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    close(model[0].weight.detach(), ref[0].weight.detach(), what="synced from rank 0")
    return True


def case_type_promotion(seed):
    m = mesh()
    x = randn(6, 3, seed=seed)
    i = torch.arange(18).reshape(6, 3)
    lay = ([st.Shard(0)], {0: uneven_extents(6, m.size(), seed)})
    out = check_op(lambda a, b: a * b, [x, i], [lay, lay], m, grad=False, what="float*int")
    assert out.dtype == torch.float32
    out = check_op(lambda b: b + 1.5, [i], [lay], m, grad=False, what="int+float scalar")
    assert out.dtype == torch.float32
    xs = st.distribute_tensor(x, m, [st.Shard(0)])
    assert torch.ops.aten.is_same_size(xs, torch.empty(6, 3))
    same = torch.as_strided(xs, xs.shape, xs.stride())
    close(full(same), x, what="identity as_strided")
    return True


def bad_as_strided():
    xs = st.distribute_tensor(torch.randn(6, 3), mesh(), [st.Shard(0)])
    torch.as_strided(xs, (2, 2), (1, 1))


def case_as_strided_unsharded():
    """A non-identity as_strided of a tensor sharded along no mesh dim (Replicate, or a pending sum) is the local
    one: forward and input gradient equal one device (as_strided_copy/_scatter of a Replicate tensor, whose
    backward restrides the gradient, too)."""
    m = mesh()
    x = randn(9, seed=4)
    rep = st.distribute_tensor(x, m, [st.Replicate()])
    check_op(lambda a: torch.as_strided(a, (2, 3), (1, 2), 1) * 2, [x], [([st.Replicate()], None)], m,
             what="as_strided of Replicate")
    check_op(lambda a: torch.as_strided_copy(a, (3, 2), (2, 1)), [x], [([st.Replicate()], None)], m,
             what="as_strided_copy of Replicate")
    out = torch.as_strided_scatter(rep, torch.ones(2, 2), (2, 2), (1, 3))
    close(full(out), torch.as_strided_scatter(x, torch.ones(2, 2), (2, 2), (1, 3)), what="as_strided_scatter")
    # A pending sum: each rank's term restrided, summed when read.
    import torch.distributed as dist
    part = st.from_local(x if dist.get_rank() == 0 else torch.zeros_like(x), m, [st.Partial()])
    close(full(torch.as_strided(part, (4,), (2,))), torch.as_strided(x, (4,), (2,)), what="as_strided of Partial")
    return True


def test_as_strided_unsharded():
    harness.run(2, case_as_strided_unsharded)


@pytest.mark.parametrize("world,shape", [(2, (2,)), (4, (2, 2))])
def test_sync_module(world, shape):
    harness.run(world, case_sync_module, shape)


def test_type_promotion():
    harness.run(3, case_type_promotion, 2)


def test_as_strided_non_identity_raises():
    harness.expect_error(2, bad_as_strided, match="identity")


def case_new_buffer_of_split_tokens(seed):
    """A buffer made with `new_zeros` at another length of a split dim keeps the split (the default split of the
    new length) and split values written into it stay divided: diffusers' Lumina2 joins its text and image tokens
    as `joint = img.new_zeros(B, L_txt + L_img, C); joint[i, :L_txt] = txt[i]; joint[i, L_txt:] = img[i]`. Forward
    and gradients against one device, and no all-gather (a Replicate buffer would gather every image token)."""
    m = mesh()
    w = m.size()
    B, L_txt, L_img, C = 2, 3, 11, 4
    img = randn(B, L_img, C, seed=seed)
    txt = randn(B, L_txt, C, seed=seed + 1)
    lay = ([st.Shard(1)], {0: uneven_extents(L_img, w, seed)})

    def join(i, t):
        joint = i.new_zeros(B, L_txt + L_img, C)
        for b in range(B):
            joint[b, :L_txt] = t[b]
            joint[b, L_txt:] = i[b]
        return joint * 2

    with st.use_strict():
        out = check_op(join, [img, txt], [lay, None], m, what="Lumina2's joint tokens",
                       expect_placements=[st.Shard(1)])
        assert st.sharding_shapes(out) == {0: [len(c) for c in torch.arange(L_txt + L_img).tensor_split(w)]}
        xs = st.distribute_tensor(img, m, *lay)
        st.reset_comm_stats()
        join(xs, txt)
        assert "all_gather" not in st.comm_stats()["calls"], st.comm_stats()
        # The unchanged dims keep their extents; another rank is Replicate.
        y = xs.new_zeros(B + 1, L_img, C)
        assert st.placements(y) == (st.Shard(1),) and st.sharding_shapes(y) == lay[1]
        # Another size along an unsharded dim too: something else (diffusers' UNet1D makes a convolution kernel
        # `x.new_zeros(C, C, k)` from a length-split signal), Replicate.
        assert st.placements(xs.new_zeros(C, C, 3)) == (st.Replicate(),)
        assert st.placements(xs.new_ones(5)) == (st.Replicate(),)
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_new_buffer_of_split_tokens(world):
    harness.run(world, case_new_buffer_of_split_tokens, world)


def case_new_kernel_on_2d_mesh(seed):
    """diffusers' UNet1D builds a convolution kernel from a signal whose batch and length are split on a 2-D mesh
    (`x.new_zeros(C, C, k)`: two dims changed): Replicate, so the convolution gets a whole weight."""
    m = mesh((2, 2), ("a", "b"))
    xs = st.distribute_tensor(randn(4, 3, 10, seed=seed), m, [st.Shard(0), st.Shard(2)])
    assert st.placements(xs.new_zeros(3, 3, 4)) == (st.Replicate(), st.Replicate())
    # Only the split length changed: the split is kept (a longer sequence).
    assert st.placements(xs.new_zeros(4, 3, 12)) == (st.Shard(0), st.Shard(2))
    return True


def test_new_kernel_on_2d_mesh():
    harness.run(4, case_new_kernel_on_2d_mesh, 0)


def case_sparse_of_shard_tensors():
    """A sparse tensor built of ShardTensor indices or values (PyG's GraphUNet: an adjacency whose edge weights are
    `x.new_ones(E)`, a replicated ShardTensor; split values too) holds their whole values and is a plain sparse
    tensor: its kernels run as on one device, and gradients reach the split values (the ShardTensor used to be stored
    inside the sparse tensor, and the first kernel failed with "Cannot access data pointer")."""
    m = mesh()
    w = m.size()
    idx = torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 3, 3]])
    vals = randn(5, seed=3, dtype=torch.float64)
    x = st.distribute_tensor(randn(8, 2, seed=4), m, [st.Shard(0)])
    split = st.distribute_tensor(vals, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(5, w, 1)})
    for name, v in (("replicated", x.new_ones(5, dtype=torch.float64) * vals), ("split", split)):
        v = v.detach().requires_grad_()
        coo = torch.sparse_coo_tensor(idx, v, (4, 4))
        csr = torch.sparse_csr_tensor(torch.tensor([0, 1, 3, 4, 5]), idx[1], v, size=(4, 4))
        assert not st.is_shard_tensor(coo) and not st.is_shard_tensor(csr), name
        dense = torch.sparse_coo_tensor(idx, vals, (4, 4)).to_dense()
        close((coo @ coo).to_dense(), dense @ dense, what=f"coo product, {name} values")
        close((csr @ csr).to_dense(), dense @ dense, what=f"csr product, {name} values")
        (coo.to_dense() * torch.arange(16.0, dtype=torch.float64).view(4, 4)).sum().backward()
        close(full(v.grad), torch.tensor([1.0, 4.0, 6.0, 11.0, 15.0], dtype=torch.float64), what=f"{name} grad")
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_sparse_of_shard_tensors(world):
    harness.run(world, case_sparse_of_shard_tensors)
