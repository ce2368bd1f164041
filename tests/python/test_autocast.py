"""Mixed and reduced precision: torch.autocast on sharded inputs follows the device's own autocast policy, as on one
device; half and bfloat16 reductions over a split dim accumulate in float as torch's kernels do.

A ShardTensor carries its local tensor's autocast dispatch key (AutocastCPU here, AutocastCUDA for CUDA locals), so
torch's autocast kernels run on it above autograd: the ops of the lower-precision list cast their floating
arguments to bfloat16, those of the float32 list to float32, and the casts are recorded by autograd. Checked: the
dtype of every result equals one device's (each op below, on a split dim where the rule computes from primitives:
mse_loss is on the CPU float32 list and its rule does not call aten's mse_loss; before this the result stayed
bfloat16), the values to bfloat16's precision, and a small training step's gradients (their dtypes too). Strict
mode: nothing gathered. Reduced precision without autocast: a half mean, mse_loss and vector norm over a split dim
whose per-rank partial sums exceed half's range (65504) stay finite and equal torch's to half precision (they were
inf: the partial sums were taken in half), and softmax / log_softmax over a split dim round once, as torch's do."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import mesh, randn, uneven_extents


def ops():
    w = randn(8, 8, 3, 3, seed=1)
    return {
        "conv2d (float32 in)": (lambda a: F.conv2d(a.float(), w, padding=1), "field"),
        "group_norm": (lambda a: F.group_norm(a, 2), "field"),
        "batch_norm": (lambda a: F.batch_norm(a, None, None, training=True), "field"),
        "interpolate": (lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), "field"),
        "avg_pool2d": (lambda a: F.avg_pool2d(a, 2), "field"),
        "grid_sample": (lambda a: F.grid_sample(a, torch.zeros(2, 12, 12, 2)), "field"),
        "cross_entropy": (lambda a: F.cross_entropy(a, torch.zeros(2, 12, 12, dtype=torch.long)), "field"),
        "layer_norm": (lambda a: F.layer_norm(a, (8,)), "tokens"),
        "softmax over the split tokens": (lambda a: torch.softmax(a, 1), "tokens"),
        "log_softmax over the split tokens": (lambda a: torch.log_softmax(a, 1), "tokens"),
        "cdist": (lambda a: torch.cdist(a, a), "tokens"),
        "prod over the split tokens": (lambda a: a.prod(1), "tokens"),
        "mse_loss": (lambda a: F.mse_loss(a, a.detach() * 0.5), "tokens"),
        "sum over the split tokens": (lambda a: a.sum(1), "tokens"),
        "sdpa (float32 in)": (lambda a: F.scaled_dot_product_attention(a.float(), a.float(), a.float()), "tokens"),
        "linear (float32 in)": (lambda a: F.linear(a.float(), randn(4, 8, seed=2)), "tokens"),
        "cumsum over the split tokens": (lambda a: a.cumsum(1), "tokens"),
        "logsumexp over the split tokens": (lambda a: a.logsumexp(1), "tokens"),
        # einsum is no autocast op: its decomposition's bmm casts, so a bfloat16 and a float32 operand meet
        # (MaxViT's and MViT's attention, MONAI's GlobalNet on an autocast result and a float32 tensor).
        "einsum with a float32 operand": (lambda a: torch.einsum("bld,de->ble", a, randn(8, 3, seed=3)), "tokens"),
        "einsum over the split tokens": (lambda a: torch.einsum("bld,ble->bde", a, a.float()), "tokens"),
    }


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def case_op_dtypes(seed):
    m = mesh((2,))
    inputs = {"field": (randn(2, 8, 12, 12, seed=seed).bfloat16(), 2),
              "tokens": (randn(2, 12, 8, seed=seed + 1).bfloat16(), 1)}
    sharded = {k: st.distribute_tensor(x, m, [st.Shard(d)], sharding_shapes={0: uneven_extents(x.shape[d], 2, seed)})
               for k, (x, d) in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16), st.use_strict():
        for name, (f, kind) in ops().items():
            ref, out = f(inputs[kind][0]), f(sharded[kind])
            assert out.dtype == ref.dtype, f"{name}: {out.dtype} where one device gives {ref.dtype}"
            got = out.full_tensor() if st.is_shard_tensor(out) else out
            assert _rel(got, ref) < 3e-2, f"{name}: relative error {_rel(got, ref)}"
    return True


def test_op_dtypes():
    harness.run(2, case_op_dtypes, 0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        h = F.gelu(self.norm(self.conv1(x)))
        b, c, hh, ww = h.shape
        t = h.flatten(2).transpose(1, 2)
        t = t + self.attn(t, t, t, need_weights=False)[0]
        h = t.transpose(1, 2).reshape(b, c, hh, ww)
        return self.conv2(h)


def case_training_step(mesh_shape):
    m = mesh(mesh_shape)
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    x = randn(2, 3, 12, 10, seed=3)
    target = randn(2, 4, 12, 10, seed=4)
    dims = [2] if len(mesh_shape) == 1 else [2, 3]
    ext = {i: uneven_extents(x.shape[d], mesh_shape[i], 5 + i) for i, d in enumerate(dims)}
    xs = st.distribute_tensor(x, m, [st.Shard(d) for d in dims], sharding_shapes=ext).requires_grad_()
    xr = x.clone().requires_grad_()
    ts = st.distribute_tensor(target, m, [st.Shard(d) for d in dims], sharding_shapes=ext)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yr = ref(xr)
        lr = F.mse_loss(yr, target)
        with st.use_strict(len(mesh_shape) == 1):  # attention over tokens flattened from two split dims gathers
            y = net(xs)
            loss = F.mse_loss(y, ts)
    assert (y.dtype, loss.dtype) == (yr.dtype, lr.dtype), ((y.dtype, loss.dtype), (yr.dtype, lr.dtype))
    assert _rel(y.full_tensor(), yr) < 3e-2 and _rel(loss.full_tensor(), lr) < 3e-2
    loss.backward()
    lr.backward()
    assert xs.grad.dtype == xr.grad.dtype == torch.float32
    assert _rel(xs.grad.full_tensor(), xr.grad) < 5e-2, _rel(xs.grad.full_tensor(), xr.grad)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert p.grad.dtype == q.grad.dtype == torch.float32, name
        assert _rel(p.grad, q.grad) < 5e-2, (name, _rel(p.grad, q.grad))
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_training_step(mesh_shape):
    harness.run(len(mesh_shape) * 2, case_training_step, mesh_shape)


def case_cast_key():
    """The ShardTensor's autocast key is its local tensor's, so the CPU policy runs on it."""
    m = mesh((2,))
    xs = st.distribute_tensor(randn(4, 4), m, [st.Shard(0)])
    keys = str(torch._C._dispatch_keys(xs))
    assert "AutocastCPU" in keys and "AutocastPrivateUse1" not in keys, keys
    return True


def test_cast_key():
    harness.run(2, case_cast_key)


def case_reduced_precision(seed):
    m = mesh((2,))
    x64 = randn(2, 256, 16, seed=seed, dtype=torch.float64) * 3 + 5   # squares ~100: partial sums of ~4e5
    checks = {
        "mean": lambda a: a.square().mean(1),
        "mse_loss": lambda a: F.mse_loss(a, a.detach().flip(-1)),
        "vector_norm": lambda a: torch.linalg.vector_norm(a, dim=1),
        "normalize": lambda a: F.normalize(a, dim=1),
        "softmax": lambda a: torch.softmax(a, 1),
        "log_softmax": lambda a: torch.log_softmax(a, 1),
    }
    for dt in (torch.float16, torch.bfloat16):
        x = x64.to(dt)
        xs = st.distribute_tensor(x, m, [st.Shard(1)], sharding_shapes={0: uneven_extents(256, 2, seed)})
        with st.use_strict():
            for name, f in checks.items():
                exact, ref, out = f(x64), f(x).double(), f(xs)
                assert out.dtype == dt, (name, out.dtype)
                got = (out.full_tensor() if st.is_shard_tensor(out) else out).double()
                assert torch.isfinite(got).all(), f"{name} in {dt}: not finite where one device's is"
                err, ref_err = _rel(got, exact), _rel(ref, exact)
                assert err <= 1.5 * ref_err + (1e-3 if dt == torch.float16 else 8e-3), (name, dt, err, ref_err)
    return True


def test_reduced_precision():
    harness.run(2, case_reduced_precision, 0)
