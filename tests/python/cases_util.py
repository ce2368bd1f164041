"""Helpers used inside rank processes: meshes, seeded data, comparisons."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import shardtensor as st

_meshes = {}


def mesh(shape=None, names=None):
    """A cached CPU DeviceMesh over all ranks (1-D by default)."""
    world = dist.get_world_size()
    shape = tuple(shape or (world,))
    names = tuple(names or (("domain",) if len(shape) == 1 else tuple(f"d{i}" for i in range(len(shape)))))
    key = (shape, names)
    if key not in _meshes:
        _meshes[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[key]


def suite_device() -> str:
    """The device of the CUDA suite (tests/python/test_cuda.py): ``SHARDTENSOR_TEST_DEVICE``, ``cuda`` by default;
    ``cpu`` runs the same cases on the CPU (the dry run of benchmarks/gpu_check.sh)."""
    return os.environ.get("SHARDTENSOR_TEST_DEVICE", "cuda")


def setup_device(device) -> torch.device:
    """In a rank process: ranks share GPU 0, and TF32 is off (cuDNN convolutions use it by default), so CUDA results
    meet the CPU suite's 1e-4..1e-6 tolerances."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def rank():
    return dist.get_rank()


def world():
    return dist.get_world_size()


def randn(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


def uneven_extents(n, k, seed=0):
    """A deterministic uneven split of n over k (zero extents allowed), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + seed)
    cuts = sorted(torch.randint(0, n + 1, (k - 1,), generator=g).tolist())
    bounds = [0] + cuts + [n]
    return [bounds[i + 1] - bounds[i] for i in range(k)]


def tiny_extents(n, k):
    """One element on rank 0, nothing on rank 1 (k >= 3), the rest split unevenly: the smallest shards."""
    if k == 1:
        return [n]
    if k == 2:
        return [1, n - 1]
    rest = n - 1
    return [1, 0] + [rest // (k - 2) + (1 if i < rest % (k - 2) else 0) for i in range(k - 2)]


def narrow_extents(n, w):
    """A zero-extent first rank, then one-row ranks (narrower than any halo), the rest on the last rank."""
    if w == 1:
        return [n]
    if w == 2:
        return [1, n - 1]
    return [0] + [1] * (w - 2) + [n - (w - 2)]


def strict(case, *args):
    """Run a case in strict mode: a gather fallback anywhere would raise."""
    with st.use_strict():
        return case(*args)


def shard_of(full, m, placements, extents=None):
    """Distribute a full tensor (same on every rank) with optional explicit extents per mesh dim."""
    return st.distribute_tensor(full, m, placements, sharding_shapes=extents)


def close(actual, expected, rtol=1e-5, atol=1e-6, what="", equal_nan=False):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=equal_nan,
                               msg=lambda m: f"{what}: {m}")


def full(x):
    return st.full_tensor(x) if st.is_shard_tensor(x) else x


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []



def check_conv2d_gradient_subset(shard, x, w, b, kw, x_grad, w_grad, seed, tol, what):
    """`F.conv2d(x, w, b, **kw)` with `x` sharded by `shard(x)` against one device, with gradients for the input only
    (`x_grad`, frozen weights) or the parameters only (`w_grad`, an input that needs none): the output and the
    gradients that exist equal one device's."""
    xs = shard(x).requires_grad_(x_grad)
    xr = x.clone().requires_grad_(x_grad)
    ws, wr = w.clone().requires_grad_(w_grad), w.clone().requires_grad_(w_grad)
    bs, br = b.clone().requires_grad_(w_grad), b.clone().requires_grad_(w_grad)
    y, yr = F.conv2d(xs, ws, bs, **kw), F.conv2d(xr, wr, br, **kw)
    close(full(y), yr, **tol, what=what + " output")
    g = randn(*yr.shape, seed=seed)
    torch.autograd.backward(y, g)
    torch.autograd.backward(yr, g)
    if x_grad:
        close(full(xs.grad), xr.grad, **tol, what=what + " input gradient")
    if w_grad:
        close(full(ws.grad), wr.grad, **tol, what=what + " weight gradient")
        close(full(bs.grad), br.grad, **tol, what=what + " bias gradient")

def check_grad_layout(leaf, what=""):
    """A sharded leaf's gradient has exactly the leaf's layout: placements (Partial read as Replicate), extents
    and local shape, with a dense local tensor (never the global size on every rank)."""
    g = leaf.grad
    want = tuple(st.Replicate() if type(p).__name__ == "Partial" else p for p in st.placements(leaf))
    assert st.placements(g) == want, f"{what}: placements {st.placements(g)}, leaf {st.placements(leaf)}"
    assert st.sharding_shapes(g) == st.sharding_shapes(leaf), \
        f"{what}: extents {st.sharding_shapes(g)}, leaf {st.sharding_shapes(leaf)}"
    gl, ll = g.to_local(), leaf.to_local()
    assert gl.shape == ll.shape, f"{what}: local shape {tuple(gl.shape)}, leaf {tuple(ll.shape)}"
    assert _dense(gl), f"{what}: local gradient strides {gl.stride()} (not dense)"


def _dense(t):
    """Non-overlapping and dense: some order of the dims is contiguous (size-1 dims aside). A rank's local
    gradient may be a permutation of its leaf's layout: the global strides say nothing of dims that some rank holds
    one row of, and rank-local layouts are not forced to agree."""
    if t.numel() == 0:
        return True
    dims = sorted((st_, sz) for st_, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class LargestPlain(TorchDispatchMode):
    """A dispatch mode watching the ops below it: ``numel`` is the size of the largest plain (not ShardTensor) tensor
    an op returned, among those ``counts`` accepts (default: every one), so a test can show that no rank allocated a
    tensor whole along a split dim. Use as a context manager."""

    def __init__(self, counts=None):
        super().__init__()
        self.numel = 0
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not st.is_shard_tensor(t) and (self.counts is None or self.counts(t)):
                self.numel = max(self.numel, t.numel())
        return out


def check_op(fn, inputs, layouts, m, grad=True, rtol=1e-5, atol=1e-6, what="", expect_placements=None):
    """Compare ``fn`` on sharded inputs against ``fn`` on the full inputs, forward and backward.

    ``inputs``: full tensors, identical on every rank. ``layouts``: per input, ``None`` (pass the plain tensor,
    i.e. Replicate) or ``(placements, sharding_shapes or None)``. Floating inputs get gradients; the loss is a
    fixed random weighting of every floating output, so gradients are not trivial.
    """
    refs = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
    args = []
    for t, lay in zip(inputs, layouts):
        leaf = t.detach().clone()
        if lay is None:
            args.append(leaf.requires_grad_(grad and t.is_floating_point()))
        else:
            pl, ext = lay if isinstance(lay, tuple) else (lay, None)
            s = st.distribute_tensor(leaf, m, pl, sharding_shapes=ext)
            args.append(s.requires_grad_(grad and t.is_floating_point()))
    out_ref = fn(*refs)
    out = fn(*args)
    ref_ts, out_ts = _tensors(out_ref), _tensors(out)
    assert len(ref_ts) == len(out_ts), f"{what}: {len(out_ts)} outputs, expected {len(ref_ts)}"
    for i, (a, b) in enumerate(zip(out_ts, ref_ts)):
        assert tuple(a.shape) == tuple(b.shape), f"{what}: output {i} global shape {tuple(a.shape)} != {tuple(b.shape)}"
        close(full(a), b, rtol=rtol, atol=atol, what=f"{what} output {i}")
    if expect_placements is not None:
        assert st.placements(out_ts[0]) == tuple(expect_placements), f"{what}: placements {st.placements(out_ts[0])}"
    if not grad:
        return out
    loss_ref, loss = 0.0, 0.0
    for i, (a, b) in enumerate(zip(out_ts, ref_ts)):
        if not b.is_floating_point() or not b.requires_grad:
            continue
        w = randn(*b.shape, seed=77 + i, dtype=b.dtype).to(b.device)  # on the outputs' device (CUDA cases)
        loss_ref = loss_ref + (b * w).sum()
        loss = loss + (a * w).sum()
    if not isinstance(loss_ref, torch.Tensor):
        return out
    loss_ref.backward()
    loss.backward()
    for i, (a, r) in enumerate(zip(args, refs)):
        if r.grad is None:
            assert a.grad is None or full(a.grad).abs().max() == 0, f"{what}: unexpected grad for input {i}"
            continue
        assert a.grad is not None, f"{what}: no grad for input {i}"
        if st.is_shard_tensor(a):
            assert st.is_shard_tensor(a.grad), f"{what}: grad of sharded input {i} is plain"
            check_grad_layout(a, what=f"{what} grad {i}")
        else:
            assert not st.is_shard_tensor(a.grad), f"{what}: grad of plain input {i} is a ShardTensor"
        close(full(a.grad), r.grad, rtol=rtol, atol=atol * 10, what=f"{what} grad {i}")
    return out


def needs_library(module: str, what: str):
    """A pytest skip mark for a test of an optional library (the zoo's dependencies, tests/requirements-zoo.txt)."""
    import importlib.util
    import pytest
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{what} is an optional test dependency (tests/requirements-zoo.txt)")


def check_integration_routing(first: str, second: str, module: str, function: str, disabled_too: bool = True) -> None:
    """A ``shardtensor.integrations`` routing is installed whichever of ``first`` / ``second`` (shardtensor and the
    library) is imported first, and (``disabled_too``) ``SHARDTENSOR_NO_INTEGRATIONS=1`` leaves ``module.function``
    alone: checked in fresh interpreters (the import order is per process; the switch does not depend on it, so
    callers checking both orders check it with one)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (f"import {first}, {second}, shardtensor.integrations as i, {module} as m; "
            f"print(hasattr(m.{function}, '_shardtensor_route'), {module!r} in i.installed())")
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    for switch, expected in (("", "True True"), ("1", "False False"))[:2 if disabled_too else 1]:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env=dict(env, SHARDTENSOR_NO_INTEGRATIONS=switch))
        assert out.stdout.strip().splitlines()[-1:] == [expected], (switch, out.stdout[-500:], out.stderr[-2000:])
