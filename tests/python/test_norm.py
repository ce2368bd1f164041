"""layer_norm and rms_norm against single-device results: token-sharded inputs (local statistics), sharded
normalized dims (global statistics), with and without affine parameters, uneven shards, 2-D meshes, large
means, and nn.LayerNorm parameter gradients."""
import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_grad_layout, check_op, close, full, mesh, randn, uneven_extents


def case_layer_norm(seed):
    m = mesh()
    w = m.size()
    x = randn(3, 7, 6, seed=seed) * 3 + 2
    wt, b = randn(6, seed=seed + 1), randn(6, seed=seed + 2)
    tok = ([st.Shard(1)], {0: uneven_extents(7, w, seed)})
    feat = ([st.Shard(2)], {0: uneven_extents(6, w, seed + 1)})
    for name, lay in [("tokens", tok), ("features", feat)]:
        check_op(lambda x, w, b: F.layer_norm(x, (6,), w, b), [x, wt, b], [lay, None, None], m, rtol=1e-4, atol=1e-5,
                 what=f"layer_norm {name}")
        check_op(lambda x: F.layer_norm(x, (6,)), [x], [lay], m, rtol=1e-4, atol=1e-5, what=f"no affine {name}")
        check_op(lambda x, w: F.layer_norm(x, (7, 6), w), [x, randn(7, 6, seed=4)], [lay, None], m, rtol=1e-4,
                 atol=1e-5, what=f"2 normalized dims {name}")
        check_op(lambda x, w: F.rms_norm(x, (6,), w), [x, wt], [lay, None], m, rtol=1e-4, atol=1e-5, what=f"rms_norm {name}")
    big = randn(2, 5, 8, seed=seed) + 1e3
    check_op(lambda x: F.layer_norm(x, (8,)), [big], [([st.Shard(2)], None)], m, rtol=1e-3, atol=1e-3, what="large mean")
    return True


def case_layer_norm_2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(4, 5, 6, seed=seed)
    wt, b = randn(6, seed=1), randn(6, seed=2)
    lay = ([st.Shard(1), st.Shard(2)], {0: uneven_extents(5, 2, seed), 1: uneven_extents(6, 2, seed + 1)})
    check_op(lambda x, w, b: F.layer_norm(x, (6,), w, b), [x, wt, b], [lay, None, None], m, rtol=1e-4, atol=1e-5,
             what="2-D mesh layer_norm")
    return True


def case_layer_norm_module(seed):
    m = mesh()
    torch.manual_seed(0)
    ln, ref = torch.nn.LayerNorm(6), torch.nn.LayerNorm(6)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ln.weight)
    x = randn(2, 9, 6, seed=seed)
    xs = st.distribute_tensor(x, m, [st.Shard(1)], {0: uneven_extents(9, m.size(), seed)})
    ln(xs).pow(3).mean().backward()
    ref(x).pow(3).mean().backward()
    for (n, p), (_, r) in zip(ln.named_parameters(), ref.named_parameters()):
        assert not st.is_shard_tensor(p.grad)
        close(p.grad, r.grad, rtol=1e-4, atol=1e-6, what=n)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layer_norm(world):
    harness.run(world, case_layer_norm, world)


def test_layer_norm_2d():
    harness.run(4, case_layer_norm_2d, 1)


@pytest.mark.parametrize("world", [2, 3])
def test_layer_norm_module(world):
    harness.run(world, case_layer_norm_module, world)


def case_group_norm(seed):
    m = mesh()
    w = m.size()
    x = randn(2, 6, 9, 5, seed=seed) * 2 + 3
    wt, b = randn(6, seed=seed + 1), randn(6, seed=seed + 2)
    for name, lay in [("height", ([st.Shard(2)], {0: uneven_extents(9, w, seed)})),
                      ("width", ([st.Shard(3)], {0: uneven_extents(5, w, seed + 1)})),
                      ("batch", ([st.Shard(0)], {0: uneven_extents(2, w, seed + 2)}))]:
        check_op(lambda x, w, b: F.group_norm(x, 3, w, b), [x, wt, b], [lay, None, None], m, rtol=1e-4, atol=1e-5,
                 what=f"group_norm {name}")
        check_op(lambda x: F.group_norm(x, 2), [x], [lay], m, rtol=1e-4, atol=1e-5, what=f"group_norm no affine {name}")
    return True


def case_group_norm_2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 4, 7, 6, seed=seed)
    lay = ([st.Shard(2), st.Shard(3)], {0: uneven_extents(7, 2, seed), 1: uneven_extents(6, 2, seed + 1)})
    check_op(lambda x, w, b: F.group_norm(x, 2, w, b), [x, randn(4, seed=1), randn(4, seed=2)], [lay, None, None], m,
             rtol=1e-4, atol=1e-5, what="2-D mesh group_norm")
    return True


def case_group_norm_split_groups(seed):
    """Channel shards that cut groups (a group's channels on two or three ranks, one-channel and empty shards): each
    group's sums and centred squares combined over the channel mesh dim by two small all-reduces, the statistics
    whole there; forward, input and parameter gradients in strict mode (no fallback), against one device, with a
    large mean (the centred combination keeps the variance exact); a (N, C) input split along C; a 2x2 mesh of
    channels x height."""
    m = mesh()
    w = m.size()
    x = randn(2, 6, 5, 4, seed=seed, dtype=torch.float64) * 2 + 1000
    wt, b = randn(6, seed=seed + 1, dtype=torch.float64), randn(6, seed=seed + 2, dtype=torch.float64)
    with st.use_strict():
        for extents in ([1, 5], [4, 2], [3, 0, 3], [1, 2, 3], [0, 1, 5], [2, 2, 2], [1, 1, 4]):
            if len(extents) != w:
                continue
            lay = ([st.Shard(1)], {0: extents})
            check_op(lambda x, w, b: F.group_norm(x, 2, w, b), [x, wt, b], [lay, None, None], m, rtol=1e-9,
                     atol=1e-10, what=f"group_norm, 2 groups over {extents}")
            check_op(lambda x: F.group_norm(x, 3), [x], [lay], m, rtol=1e-9, atol=1e-10,
                     what=f"group_norm no affine, 3 groups over {extents}")
        x2 = randn(5, 6, seed=seed + 3, dtype=torch.float64)
        check_op(lambda x, w, b: F.group_norm(x, 2, w, b), [x2, wt, b],
                 [([st.Shard(1)], {0: uneven_extents(6, w, seed + 4)}), None, None], m, rtol=1e-9, atol=1e-10,
                 what="group_norm of (N, C) split along C")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_group_norm_split_groups(world):
    harness.run(world, case_group_norm_split_groups, world)


def case_group_norm_split_groups_2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 6, 7, 3, seed=seed, dtype=torch.float64)
    wt, b = randn(6, seed=1, dtype=torch.float64), randn(6, seed=2, dtype=torch.float64)
    with st.use_strict():
        for what, lay in (("channels x height", ([st.Shard(1), st.Shard(2)], {0: [1, 5], 1: uneven_extents(7, 2, seed)})),
                          # a rank pair without samples (its sums are empty: it skips the channel all-reduce)
                          ("batch with an empty shard x channels", ([st.Shard(0), st.Shard(1)], {0: [2, 0], 1: [1, 5]}))):
            check_op(lambda x, w, b: F.group_norm(x, 3, w, b), [x, wt, b], [lay, None, None], m, rtol=1e-9,
                     atol=1e-10, what=f"group_norm split groups, {what}")
    return True


def test_group_norm_split_groups_2d():
    harness.run(4, case_group_norm_split_groups_2d, 3)


def case_group_norm_channels(seed):
    """Channel shards of whole groups: each rank normalizes its own groups, no communication; the statistics and
    the parameter gradients are sharded with the groups (with a spatial dim sharded too, on a 2-D mesh)."""
    m = mesh()
    w = m.size()
    x = randn(2, 12, 5, 4, seed=seed) * 2 + 1
    wt, b = randn(12, seed=seed + 1), randn(12, seed=seed + 2)
    groups = [2 * e for e in uneven_extents(6, w, seed)]  # 6 groups of 2 channels, a zero extent for some seeds
    lay = ([st.Shard(1)], {0: groups})
    with st.use_strict():
        xs = st.distribute_tensor(x, m, *lay)
        st.reset_comm_stats()
        F.group_norm(xs, 6, wt, b)
        assert sum(st.comm_stats()["calls"].values()) == 0, st.comm_stats()
        check_op(lambda x, w, b: F.group_norm(x, 6, w, b), [x, wt, b], [lay, None, None], m, rtol=1e-4, atol=1e-5,
                 what="group_norm channels sharded")
        check_op(lambda x: F.group_norm(x, 3), [x], [([st.Shard(1)], {0: [4 * e for e in uneven_extents(3, w, 1)]})],
                 m, rtol=1e-4, atol=1e-5, what="group_norm channels sharded, no affine")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_group_norm_channels(world):
    harness.run(world, case_group_norm_channels, world)


def case_group_norm_channels_2d(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(2, 8, 7, 3, seed=seed)
    lay = ([st.Shard(1), st.Shard(2)], {0: [2, 6], 1: uneven_extents(7, 2, seed)})
    with st.use_strict():
        check_op(lambda x, w, b: F.group_norm(x, 4, w, b), [x, randn(8, seed=1), randn(8, seed=2)], [lay, None, None],
                 m, rtol=1e-4, atol=1e-5, what="group_norm channels and height sharded")
    return True


def test_group_norm_channels_2d():
    harness.run(4, case_group_norm_channels_2d, 3)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_group_norm(world):
    harness.run(world, case_group_norm, world)


def test_group_norm_2d():
    harness.run(4, case_group_norm_2d, 3)


def case_batch_norm_module(dim_sharded, momentum, seed):
    """nn.BatchNorm2d trained a few steps on sharded input: outputs, input and parameter gradients, running
    statistics and num_batches_tracked equal single-device on every rank; then evaluation mode."""
    m = mesh()
    torch.manual_seed(0)
    bn, ref = torch.nn.BatchNorm2d(4, momentum=momentum), torch.nn.BatchNorm2d(4, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    ref.load_state_dict(bn.state_dict())
    for step in range(3):
        x = randn(3, 4, 7, 5, seed=seed + step) * 2 + 5
        ext = {0: uneven_extents(x.shape[dim_sharded], m.size(), seed + step)}
        xs = st.distribute_tensor(x, m, [st.Shard(dim_sharded)], ext).requires_grad_(True)
        xr = x.clone().requires_grad_(True)
        wgt = randn(3, 4, 7, 5, seed=99)
        (bn(xs) * wgt).sum().backward()
        (ref(xr) * wgt).sum().backward()
        check_grad_layout(xs, what=f"input grad step {step}")
        close(st.full_tensor(xs.grad), xr.grad, rtol=1e-4, atol=1e-5, what=f"input grad step {step}")
    for (n, p), (_, r) in zip(bn.named_parameters(), ref.named_parameters()):
        assert not st.is_shard_tensor(p.grad)
        close(p.grad, r.grad, rtol=1e-4, atol=1e-5, what=f"grad {n}")
    for (n, b), (_, r) in zip(bn.named_buffers(), ref.named_buffers()):
        close(b, r, rtol=1e-5, atol=1e-6, what=f"buffer {n}")
    bn.eval()
    ref.eval()
    x = randn(2, 4, 6, 5, seed=7)
    check_op(lambda x: bn(x), [x], [([st.Shard(dim_sharded)], None)], m, grad=False, what="eval")
    close(st.full_tensor(bn(st.distribute_tensor(x, m, [st.Shard(dim_sharded)]))), ref(x), rtol=1e-5, atol=1e-5,
          what="eval vs reference")
    return True


def case_batch_norm_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(4, 3, 6, 5, seed=seed)
    lay = ([st.Shard(2), st.Shard(0)], {0: uneven_extents(6, 2, seed), 1: uneven_extents(4, 2, seed + 1)})
    check_op(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), [x, randn(3, seed=1), randn(3, seed=2)],
             [lay, None, None], m, rtol=1e-4, atol=1e-5, what="2-D mesh batch_norm")
    return True


def case_instance_norm(seed):
    m = mesh()
    x = randn(2, 3, 8, 5, seed=seed) + 2
    lay = ([st.Shard(2)], {0: uneven_extents(8, m.size(), seed)})
    check_op(lambda x: F.instance_norm(x), [x], [lay], m, rtol=1e-4, atol=1e-5, what="instance_norm")
    check_op(lambda x, w, b: F.instance_norm(x, weight=w, bias=b), [x, randn(3, seed=1), randn(3, seed=2)],
             [lay, None, None], m, rtol=1e-4, atol=1e-5, what="instance_norm affine")
    return True


def case_batch_norm_internal_ops(dim_sharded, seed):
    """The internal batch-norm ops torch.compile and torch's decompositions call (native_batch_norm,
    _native_batch_norm_legit and its no_stats overload, _batch_norm_with_update/_no_update), in strict mode: the
    output, the saved statistics (all channels, also with the channel dim sharded), the running statistics they
    update, and the input, weight and bias gradients equal one device."""
    m = mesh()
    aten = torch.ops.aten
    x = randn(3, 4, 7, 5, seed=seed) * 2 + 1
    w, b = randn(4, seed=seed + 1), randn(4, seed=seed + 2)
    ext = {0: uneven_extents(x.shape[dim_sharded], m.size(), seed)}
    calls = {
        "native_batch_norm": lambda x, w, b, rm, rv: aten.native_batch_norm(x, w, b, rm, rv, True, 0.2, 1e-5),
        "native_batch_norm eval": lambda x, w, b, rm, rv: aten.native_batch_norm(x, w, b, rm, rv, False, 0.2, 1e-5),
        "_native_batch_norm_legit": lambda x, w, b, rm, rv: aten._native_batch_norm_legit(x, w, b, rm, rv, True, 0.2,
                                                                                          1e-5),
        "_native_batch_norm_legit.no_stats": lambda x, w, b, rm, rv: aten._native_batch_norm_legit.no_stats(
            x, w, b, True, 0.2, 1e-5),
        "_batch_norm_with_update": lambda x, w, b, rm, rv: aten._batch_norm_with_update(x, w, b, rm, rv, 0.2, 1e-5),
        "_batch_norm_no_update": lambda x, w, b, rm, rv: aten._batch_norm_no_update(x, w, b, rm, rv, 0.2, 1e-5),
    }
    g = randn(3, 4, 7, 5, seed=seed + 3)
    for name, call in calls.items():
        rm, rv = randn(4, seed=5), randn(4, seed=6).abs() + 0.5
        rm_s, rv_s = rm.clone(), rv.clone()
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        xs = st.distribute_tensor(x, m, [st.Shard(dim_sharded)], ext).requires_grad_()
        ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
        ref = call(xr, wr, br, rm, rv)
        with st.use_strict():
            out = call(xs, ws, bs, rm_s, rv_s)
            assert len(out) == len(ref), name
            for i, (o, r) in enumerate(zip(out, ref)):
                o = st.full_tensor(o) if st.is_shard_tensor(o) else o
                assert o.shape == r.shape and o.dtype == r.dtype, (name, i, o.shape, r.shape)
                close(o, r, rtol=1e-4, atol=1e-5, what=f"{name} output {i}")
            close(rm_s, rm, rtol=1e-5, atol=1e-6, what=f"{name} running_mean")
            close(rv_s, rv, rtol=1e-5, atol=1e-6, what=f"{name} running_var")
            (out[0] * st.distribute_tensor(g, m, [st.Shard(dim_sharded)], ext)).sum().backward()
        (ref[0] * g).sum().backward()
        close(st.full_tensor(xs.grad), xr.grad, rtol=1e-4, atol=1e-5, what=f"{name} input grad")
        close(ws.grad, wr.grad, rtol=1e-4, atol=1e-5, what=f"{name} weight grad")
        close(bs.grad, br.grad, rtol=1e-4, atol=1e-5, what=f"{name} bias grad")
    return True


def case_batch_norm_split_parameters():
    """Per-channel weight, bias and statistics that are themselves split (Shard(0) ShardTensors), with a sharded
    or a plain input: the C values are gathered, the input's layout is kept; their gradients come back laid out
    like them."""
    m = mesh()
    w_ = m.size()
    x = randn(3, 5, 7, 4, seed=11)
    w, b = randn(5, seed=12), randn(5, seed=13)
    rm, rv = randn(5, seed=14), randn(5, seed=15).abs() + 0.5
    cext = {0: uneven_extents(5, w_, 16)}
    split = ([st.Shard(0)], cext)
    for name, xlay in (("spatial input", ([st.Shard(2)], {0: uneven_extents(7, w_, 17)})),
                       ("channel input", ([st.Shard(1)], cext)), ("plain input", None)):
        for training in (True, False):
            check_op(lambda x, w, b, rm=rm, rv=rv, t=training: F.batch_norm(x, rm.clone(), rv.clone(), w, b, t),
                     [x, w, b], [xlay, split, split], m, rtol=1e-5, atol=1e-5, what=f"{name} training={training}")
        stats_s = [st.distribute_tensor(t, m, *split) for t in (rm, rv)]

        def fn(x, w, b):  # the split statistics with the split parameters, the plain ones for the reference
            stats = stats_s if st.is_shard_tensor(w) else (rm, rv)
            return torch.ops.aten.native_batch_norm(x, w, b, *stats, False, 0.1, 1e-5)[0]
        check_op(fn, [x, w, b], [xlay, split, split], m, rtol=1e-5, atol=1e-5, what=f"{name} native_batch_norm")
    return True


def test_batch_norm_split_parameters():
    harness.run(3, case_batch_norm_split_parameters)


@pytest.mark.parametrize("world,dim_sharded", [(2, 2), (3, 1), (2, 0)])
def test_batch_norm_internal_ops(world, dim_sharded):
    harness.run(world, case_batch_norm_internal_ops, dim_sharded, world)


@pytest.mark.parametrize("world,dim_sharded,momentum", [(2, 2, 0.1), (3, 0, 0.1), (2, 1, 0.3), (4, 3, None)])
def test_batch_norm_module(world, dim_sharded, momentum):
    harness.run(world, case_batch_norm_module, dim_sharded, momentum, world)


def test_batch_norm_2d_mesh():
    harness.run(4, case_batch_norm_2d_mesh, 5)


@pytest.mark.parametrize("world", [2, 3])
def test_instance_norm(world):
    harness.run(world, case_instance_norm, world)


def case_bf16(seed):
    """bf16 inputs: statistics accumulate in fp32, so the sharded bf16 result matches the single-device result
    computed in fp32 on the same bf16 values to bf16 precision (no loss from sharding, even with a large mean)."""
    m = mesh()
    w = m.size()
    x = (randn(2, 6, 9, 8, seed=seed) * 2 + 50).to(torch.bfloat16)
    sp = ([st.Shard(2)], {0: uneven_extents(9, w, seed)})
    for name, fn, lay in [("layer_norm features", lambda t: F.layer_norm(t, (8,)), ([st.Shard(3)], None)),
                          ("group_norm", lambda t: F.group_norm(t, 3), sp),
                          ("batch_norm", lambda t: F.batch_norm(t, None, None, training=True), sp),
                          ("softmax", lambda t: torch.softmax(t, 2), sp),
                          ("var", lambda t: t.var(2), sp)]:
        pl, ext = lay
        out = fn(st.distribute_tensor(x, m, pl, sharding_shapes=ext))
        assert out.dtype == torch.bfloat16, name
        ref = fn(x.float())
        close(full(out).float(), ref, rtol=2e-2, atol=2e-2, what=f"bf16 {name}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_bf16(world):
    harness.run(world, case_bf16, world)


def case_instance_norm_running(seed):
    m = mesh()
    torch.manual_seed(0)
    inn = torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=True)
    ref = torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=True)
    ref.load_state_dict(inn.state_dict())
    for step in range(2):
        x = randn(2, 3, 6, 5, seed=seed + step) + 4
        # A zero-extent rank along the sharded dim when the world allows it.
        ext = [0] + uneven_extents(6, m.size() - 1, seed) if m.size() > 1 else [6]
        xs = st.distribute_tensor(x, m, [st.Shard(2)], {0: ext})
        wgt = randn(2, 3, 6, 5, seed=50 + step)
        (inn(xs) * wgt).sum().backward()
        (ref(x) * wgt).sum().backward()
    for (n, b), (_, r) in zip(inn.named_buffers(), ref.named_buffers()):
        close(b, r, rtol=1e-5, atol=1e-6, what=f"buffer {n}")
    for (n, p), (_, r) in zip(inn.named_parameters(), ref.named_parameters()):
        close(p.grad, r.grad, rtol=1e-4, atol=1e-5, what=f"grad {n}")
    inn.eval()
    ref.eval()
    x = randn(2, 3, 6, 5, seed=9)
    close(full(inn(st.distribute_tensor(x, m, [st.Shard(2)]))), ref(x), rtol=1e-5, atol=1e-5, what="eval")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_instance_norm_running(world):
    harness.run(world, case_instance_norm_running, world)


def case_local_response_norm(seed):
    m = mesh()
    x = randn(2, 6, 7, 5, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(7, m.size(), seed)})
    check_op(lambda t: F.local_response_norm(t, 3), [x], [lay], m, rtol=1e-4, atol=1e-5, what="local_response_norm")
    ch = ([st.Shard(1)], {0: uneven_extents(6, m.size(), seed + 1)})
    check_op(lambda t: F.local_response_norm(t, 3), [x], [ch], m, rtol=1e-4, atol=1e-5,
             what="local_response_norm channels sharded (halo over channels)")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_local_response_norm(world):
    harness.run(world, case_local_response_norm, world)


def case_norm_inference_with_trainable_weights():
    """Modules whose weights require grad, evaluated under no_grad / inference_mode (plain weights meet the
    sharded input below autograd)."""
    m = mesh()
    x = randn(2, 4, 9, 6, seed=3)
    xs = st.distribute_tensor(x, m, [st.Shard(2)])
    torch.manual_seed(0)  # the same convolution weights on every rank
    for mod in (torch.nn.LayerNorm(6), torch.nn.GroupNorm(2, 4), torch.nn.BatchNorm2d(4).eval(),
                torch.nn.Conv2d(4, 3, 3, padding=1)):
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx():
                ref, out = mod(x), mod(xs)
            close(full(out), ref, rtol=1e-5, atol=1e-5, what=f"{type(mod).__name__} under {ctx.__name__}")
            assert not out.requires_grad
    return True


def test_norm_inference_with_trainable_weights():
    harness.run(2, case_norm_inference_with_trainable_weights)


class _GnBnModel(torch.nn.Module):
    """Conv2d -> GroupNorm -> ReLU -> Conv2d -> BatchNorm2d -> ReLU."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 4)
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4, momentum=momentum)

    def forward(self, x):
        return torch.relu(self.bn(self.c2(torch.relu(self.gn(self.c1(x))))))


def case_gn_bn_model(layouts, momentum=0.1, dtype=torch.float32, channels_last=False, mesh_shape=None):
    """Two training steps (loss = mean of the output) and an evaluation of the group-norm + batch-norm model on
    inputs split by each layout (placements, sharding shapes) in turn, against one device: output, loss, the input
    gradient (with the input's own layout), every parameter gradient, the running statistics and
    num_batches_tracked, and the evaluation output."""
    m = mesh(mesh_shape) if mesh_shape else mesh()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for placements, extents in layouts:
        torch.manual_seed(0)
        model, ref = _GnBnModel(momentum), _GnBnModel(momentum)
        ref.load_state_dict(model.state_dict())
        model, ref = model.to(dtype=dtype, memory_format=fmt), ref.to(dtype=dtype, memory_format=fmt)
        what = f"{placements} {extents} momentum={momentum} {dtype} channels_last={channels_last}"
        for step in range(2):
            x = randn(2, 3, 8, 5, seed=step).to(dtype).contiguous(memory_format=fmt)
            xs = st.distribute_tensor(x, m, placements, extents).requires_grad_()
            xr = x.clone().requires_grad_()
            out, out_ref = model(xs), ref(xr)
            close(full(out), out_ref, **tol, what=f"{what} output step {step}")
            loss, loss_ref = out.mean(), out_ref.mean()
            close(full(loss), loss_ref, **tol, what=f"{what} loss step {step}")
            loss.backward()
            loss_ref.backward()
            assert st.placements(xs.grad) == st.placements(xs), what
            assert st.sharding_shapes(xs.grad) == st.sharding_shapes(xs), what
            close(full(xs.grad), xr.grad, rtol=tol["rtol"], atol=tol["atol"] / 10, what=f"{what} input grad {step}")
        for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            assert not st.is_shard_tensor(p.grad), n
            close(p.grad, r.grad, **tol, what=f"{what} grad {n}")
        for (n, b), (_, r) in zip(model.named_buffers(), ref.named_buffers()):
            close(b, r, **tol, what=f"{what} buffer {n}")
        model.eval()
        ref.eval()
        x = randn(2, 3, 8, 5, seed=9).to(dtype).contiguous(memory_format=fmt)
        with torch.no_grad():
            close(full(model(st.distribute_tensor(x, m, placements, extents))), ref(x), **tol, what=f"{what} eval")
    return True


H_SPLITS = {2: [[0, 8], [1, 7]], 3: [[0, 1, 7], [1, 0, 7], [5, 2, 1]], 4: [[0, 1, 0, 7], [3, 3, 2, 0]]}


@pytest.mark.parametrize("world,momentum", [(2, 0.1), (3, 0.1), (3, None), (4, 0.3)])
def test_gn_bn_model(world, momentum):
    layouts = [([st.Shard(2)], {0: e}) for e in H_SPLITS[world]]
    layouts.append(([st.Shard(0)], {0: [0] * (world - 1) + [2]}))  # the batch dim: one rank holds every sample
    harness.run(world, case_gn_bn_model, layouts, momentum)


def test_gn_bn_model_2d_mesh():
    layouts = [([st.Shard(0), st.Shard(2)], {0: [0, 2], 1: [1, 7]}), ([st.Shard(2), st.Shard(3)], {0: [5, 3], 1: [0, 5]})]
    harness.run(4, case_gn_bn_model, layouts, None, torch.float32, False, (2, 2))


def test_gn_bn_model_bf16_channels_last():
    layouts = [([st.Shard(2)], {0: [0, 1, 7]}), ([st.Shard(3)], {0: [1, 0, 4]})]
    harness.run(3, case_gn_bn_model, layouts, 0.1, torch.float32, True)
    harness.run(3, case_gn_bn_model, layouts, 0.1, torch.bfloat16)


def case_norm_shapes(seed):
    """1-D (B, C), (B, C, L) and 3-D inputs with a rank holding nothing along the sharded dim: BatchNorm1d/3d
    (training, running statistics, evaluation) and group norm, forward and gradients."""
    m = mesh()
    w = m.size()
    ext = lambda n: [0] + uneven_extents(n, w - 1, seed) if w > 1 else [n]  # noqa: E731
    cases = [("BatchNorm1d (B, C), batch", lambda: torch.nn.BatchNorm1d(4), (7, 4), 0),
             ("BatchNorm1d (B, C, L), L", lambda: torch.nn.BatchNorm1d(4), (2, 4, 7), 2),
             ("BatchNorm1d (B, C, L), batch", lambda: torch.nn.BatchNorm1d(4, momentum=None), (5, 4, 3), 0),
             ("BatchNorm3d, depth", lambda: torch.nn.BatchNorm3d(4), (2, 4, 5, 3, 2), 2),
             ("GroupNorm (B, C, L), L", lambda: torch.nn.GroupNorm(2, 4), (2, 4, 7), 2),
             ("GroupNorm 3-D, width", lambda: torch.nn.GroupNorm(4, 4), (2, 4, 3, 2, 6), 4)]
    for name, make, shape, dim in cases:
        torch.manual_seed(0)
        mod, ref = make(), make()
        ref.load_state_dict(mod.state_dict())
        for step in range(2):
            x = randn(*shape, seed=seed + step) * 2 + 1
            xs = st.distribute_tensor(x, m, [st.Shard(dim)], {0: ext(shape[dim])}).requires_grad_()
            xr = x.clone().requires_grad_()
            g = randn(*shape, seed=40)
            out, out_ref = mod(xs), ref(xr)
            close(full(out), out_ref, rtol=1e-4, atol=1e-5, what=f"{name} output")
            (out * g).sum().backward()
            (out_ref * g).sum().backward()
            close(full(xs.grad), xr.grad, rtol=1e-4, atol=1e-5, what=f"{name} input grad")
        for (n, p), (_, r) in zip(mod.named_parameters(), ref.named_parameters()):
            close(p.grad, r.grad, rtol=1e-4, atol=1e-5, what=f"{name} grad {n}")
        for (n, b), (_, r) in zip(mod.named_buffers(), ref.named_buffers()):
            close(b, r, rtol=1e-5, atol=1e-6, what=f"{name} buffer {n}")
        mod.eval()
        ref.eval()
        x = randn(*shape, seed=99)
        with torch.no_grad():
            close(full(mod(st.distribute_tensor(x, m, [st.Shard(dim)], {0: ext(shape[dim])}))), ref(x), rtol=1e-5,
                  atol=1e-5, what=f"{name} eval")
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_norm_shapes(world):
    harness.run(world, case_norm_shapes, world)


def case_batch_norm_replicated_buffers(ext):
    """Module state held as Replicate ShardTensors (parameters and running buffers), as a DTensor-style
    distribution of the whole module does: training updates the buffers' local values in place, evaluation reads
    them; results equal one device."""
    m = mesh()
    torch.manual_seed(0)
    bn, ref = torch.nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
    ref.load_state_dict(bn.state_dict())
    for name, p in list(bn.named_parameters()):
        setattr(bn, name, torch.nn.Parameter(st.distribute_tensor(p.detach(), m, [st.Replicate()])))
    for name, b in list(bn.named_buffers()):
        bn.register_buffer(name, st.distribute_tensor(b, m, [st.Replicate()]))
    for step in range(2):
        x = randn(2, 3, sum(ext), 4, seed=step) + 3
        xs = st.distribute_tensor(x, m, [st.Shard(2)], {0: ext})
        bn(xs).square().mean().backward()
        ref(x).square().mean().backward()
    for (n, b), (_, r) in zip(bn.named_buffers(), ref.named_buffers()):
        assert st.is_shard_tensor(b), n
        close(full(b), r, rtol=1e-5, atol=1e-6, what=f"buffer {n}")
    for (n, p), (_, r) in zip(bn.named_parameters(), ref.named_parameters()):
        close(full(p.grad), r.grad, rtol=1e-4, atol=1e-5, what=f"grad {n}")
    bn.eval()
    ref.eval()
    x = randn(2, 3, sum(ext), 4, seed=7)
    with torch.no_grad():
        close(full(bn(st.distribute_tensor(x, m, [st.Shard(2)], {0: ext}))), ref(x), rtol=1e-5, atol=1e-5, what="eval")
    return True


def batch_norm_sharded_buffers():
    m = mesh()
    bn = torch.nn.BatchNorm2d(4)
    bn.register_buffer("running_mean", st.distribute_tensor(bn.running_mean, m, [st.Shard(0)]))
    bn(st.distribute_tensor(randn(2, 4, 6, 3), m, [st.Shard(2)]))


def test_batch_norm_replicated_buffers():
    harness.run(3, case_batch_norm_replicated_buffers, [0, 1, 6])
    harness.expect_error(2, batch_norm_sharded_buffers, match="redistribute them to Replicate",
                         kinds=("NotImplementedError",))


def case_statistics_in_one_collective(seed):
    """The statistics executor (comm/stat_reduce.h): softmax over a sharded dim sends its (max, sum of exp) pairs in
    one collective (so do _safe_softmax, scaled_dot_product_attention's math form, and logsumexp), max with indices its values and
    indices in one, layer_norm over a sharded dim its moments in one;
    results equal one device's with a zero-extent rank, -inf rows on a rank and ties across ranks."""
    m = mesh()
    w = m.size()
    x = randn(3, 9, 4, seed=seed)
    x[0, :3] = float("-inf")                  # rank 0's rows of sample 0 (extents below start with 3) are all -inf
    x[1, :, 1] = 2.5                          # every row ties: the first index wins
    ext = [3, 0] + uneven_extents(6, w - 2, seed) if w > 2 else uneven_extents(9, w, seed)
    if w > 2:
        assert sum(ext) == 9
    xs = st.distribute_tensor(x, m, [st.Shard(1)], {0: ext})
    y = randn(3, 9, 4, seed=seed + 1) * 3 + 2     # finite: layer_norm of -inf rows is nan on one device too
    ys = st.distribute_tensor(y, m, [st.Shard(1)], {0: ext})
    z = x.clone()
    z[2, :, 3] = float("-inf")                # a fully masked row: _safe_softmax gives zeros there
    zs = st.distribute_tensor(z, m, [st.Shard(1)], {0: ext})

    def calls():
        return sum(st.comm_stats()["calls"].values())

    for name, fn, cmp, inp in [("softmax", lambda t: torch.softmax(t, 1), None, (x, xs)),
                               ("log_softmax", lambda t: torch.log_softmax(t, 1), None, (x, xs)),
                               ("max", lambda t: t.max(1), "tuple", (x, xs)),
                               ("_safe_softmax", lambda t: torch._safe_softmax(t, 1), None, (z, zs)),
                               ("logsumexp", lambda t: torch.logsumexp(t, 1), None, (z, zs)),
                               ("logsumexp keepdim", lambda t: torch.logsumexp(t, (0, 1), keepdim=True), None, (x, xs)),
                               ("layer_norm", lambda t: F.layer_norm(t.transpose(1, 2), (9,)), None, (y, ys))]:
        before = calls()
        out = fn(inp[1])
        assert calls() - before == 1, f"{name}: {calls() - before} collectives"
        ref = fn(inp[0])
        if cmp == "tuple":
            close(full(out.values), ref.values, what=f"{name} values")
            assert torch.equal(full(out.indices), ref.indices), name
        else:
            close(full(out), ref, rtol=1e-5, atol=1e-6, what=name)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_statistics_in_one_collective(world):
    harness.run(world, case_statistics_in_one_collective, world)


def case_safe_softmax_grad(seed):
    """_safe_softmax (scaled_dot_product_attention's math form) over sharded and unsharded dims, forward and input
    gradient against one device, with a fully masked row and a dtype conversion."""
    m = mesh()
    x = randn(2, 7, 5, seed=seed)
    x[1, :, 2] = float("-inf")
    lay = ([st.Shard(1)], {0: uneven_extents(7, m.size(), seed)})
    for dim in (1, 2):
        check_op(lambda t: torch._safe_softmax(t, dim), [x], [lay], m, rtol=1e-5, atol=1e-6,
                 what=f"_safe_softmax dim {dim}")
    check_op(lambda t: torch._safe_softmax(t, 1, torch.float64), [x], [lay], m, rtol=1e-5, atol=1e-6,
             what="_safe_softmax to float64")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_safe_softmax_grad(world):
    harness.run(world, case_safe_softmax_grad, world)


def case_batch_norm_of_pending_sum(world):
    """A classifier head's BatchNorm1d of a global pool (RepViT, EfficientViT-M, SHViT, LeViT): its input is a pending
    sum (or max) over the sharded spatial dims. The gradient reaches the input through the completed value."""
    m = mesh()
    x = randn(3, 6, 7, 5, seed=70, dtype=torch.float64)
    lay = ([st.Shard(2)], {0: uneven_extents(7, world, seed=71)})
    w, b = randn(6, seed=72, dtype=torch.float64), randn(6, seed=73, dtype=torch.float64)
    tight = dict(rtol=1e-9, atol=1e-10)
    check_op(lambda t, ww, bb: F.batch_norm(t.mean((2, 3)), None, None, ww, bb, training=True), [x, w, b],
             [lay, None, None], m, **tight, what="batch_norm of a mean (training)")
    check_op(lambda t: F.batch_norm(t.amax((2, 3)), None, None, training=True), [x], [lay], m, **tight,
             what="batch_norm of a max")
    rm, rv = randn(6, seed=74, dtype=torch.float64), randn(6, seed=75, dtype=torch.float64).abs() + 0.5
    check_op(lambda t, ww: F.batch_norm(t.mean((2, 3), keepdim=True), rm, rv, ww, training=False), [x, w],
             [lay, None], m, **tight, what="batch_norm of a mean (eval, running statistics)")
    # the module after a pool, in training, with its running statistics updated alike
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(6).double()
    ref = torch.nn.BatchNorm1d(6).double()
    ref.load_state_dict(bn.state_dict())
    xs = st.distribute_tensor(x, m, lay[0], sharding_shapes=lay[1]).requires_grad_()
    xr = x.clone().requires_grad_()
    bn(xs.mean((2, 3))).square().sum().backward()
    ref(xr.mean((2, 3))).square().sum().backward()
    close(full(xs.grad), xr.grad, **tight, what="input gradient through BatchNorm1d")
    close(bn.weight.grad, ref.weight.grad, **tight, what="weight gradient")
    close(bn.running_var, ref.running_var, **tight, what="running_var")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_batch_norm_of_pending_sum(world):
    harness.run(world, case_batch_norm_of_pending_sum, world)


def case_batch_norm_empty_batch(dim):
    """A batch of zero samples split along a spatial dim (or the channels): as torch's batch_norm, the output is empty
    and the running statistics stay (the unbiased variance divided 0 by -1 and made them NaN); the internal
    `native_batch_norm` raises as on one device, on every rank."""
    m = mesh()
    torch.manual_seed(0)
    ref, net = torch.nn.BatchNorm2d(3).double(), torch.nn.BatchNorm2d(3).double()
    x = torch.randn(0, 3, 4, 5, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    xs = st.distribute_tensor(x, m, [st.Shard(dim)]).requires_grad_()
    y_ref, y = ref(xr), net(xs)
    assert tuple(y.shape) == tuple(y_ref.shape)
    y_ref.sum().backward()
    y.sum().backward()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        close(full(getattr(net, name)), getattr(ref, name), what=name)
    close(full(net.weight.grad), ref.weight.grad, what="weight grad")
    with pytest.raises(RuntimeError, match="at least one element") as ref_error:
        torch.native_batch_norm(x, None, None, torch.zeros(3, dtype=torch.float64),
                                torch.ones(3, dtype=torch.float64), True, 0.1, 1e-5)
    with pytest.raises(RuntimeError, match="at least one element") as error:
        torch.native_batch_norm(st.distribute_tensor(x, m, [st.Shard(dim)]), None, None,
                                torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), True, 0.1, 1e-5)
    assert type(error.value) is type(ref_error.value)
    return True


@pytest.mark.parametrize("dim", [1, 3])
def test_batch_norm_empty_batch(dim):
    assert all(harness.run(2, case_batch_norm_empty_batch, dim))
