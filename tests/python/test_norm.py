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


def group_norm_channel_sharded():
    x = st.distribute_tensor(torch.randn(2, 4, 3), mesh(), [st.Shard(1)])
    F.group_norm(x, 2)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_group_norm(world):
    harness.run(world, case_group_norm, world)


def test_group_norm_2d():
    harness.run(4, case_group_norm_2d, 3)


def test_group_norm_channel_sharded_raises():
    harness.expect_error(2, group_norm_channel_sharded, match="channel dim sharded")


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
