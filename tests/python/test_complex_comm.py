"""Complex tensors through every collective (c10d backends move none: Gloo rejects them, so they travel as their
real view): full_tensor (all-gather), redistribute (all-to-all), Partial sums (all-reduce), scatter_tensor,
conjugate views, a complex spectrum gathered after a local FFT, and gradients through those, against one device.
Likewise the dtypes Gloo lacks (int16, uint16, uint32, uint64, float8): moved as a same-size dtype, reduced in a wider
one."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, rank, uneven_extents


def _z(*shape, seed=0, dtype=torch.complex64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=g)


def case_complex_collectives(dtype):
    m = mesh()
    w = m.size()
    z = _z(7, 6, seed=1, dtype=dtype)
    ext = {0: uneven_extents(7, w, seed=2)}
    x = st.distribute_tensor(z, m, [st.Shard(0)], ext)
    assert torch.equal(x.full_tensor(), z)                                     # all-gather, uneven
    assert torch.equal(x.redistribute([st.Shard(1)]).full_tensor(), z)          # all-to-all
    assert torch.equal(x.redistribute([st.Shard(0)], sharding_shapes={0: list(reversed(ext[0]))}).full_tensor(), z)
    close(full(x.sum(0)), z.sum(0), what="Partial sum of a complex tensor")    # all-reduce
    close(full(x.mean()), z.mean(), what="complex mean")
    assert torch.equal(x.conj().full_tensor(), z.conj())                        # a conjugate view
    s = st.scatter_tensor(z if rank() == 0 else None, 0, m, [st.Shard(1)])
    assert torch.equal(s.full_tensor(), z)                                     # scatter
    # A spectrum of a height-sharded field (the transform along the unsharded width), gathered.
    f = torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(3))
    fs = st.distribute_tensor(f, m, [st.Shard(1)], {0: uneven_extents(7, w, seed=4)})
    close(full(torch.fft.rfft(fs, dim=-1)), torch.fft.rfft(f, dim=-1), what="gathered spectrum")
    return True


def case_complex_gradients():
    """A complex intermediate whose Partial sum and redistribution run in backward too."""
    m = mesh()
    w = m.size()
    f = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    ref = f.clone().requires_grad_()
    xs = st.distribute_tensor(f, m, [st.Shard(0)], {0: uneven_extents(6, w, seed=6)}).requires_grad_()

    def fn(t):
        spec = torch.fft.rfft(t, dim=1)
        spec = spec.redistribute([st.Shard(1)]) if st.is_shard_tensor(spec) else spec
        return (spec * spec.conj()).real.sum() + spec.sum().abs()

    loss, loss_ref = fn(xs), fn(ref)
    close(full(loss), loss_ref, rtol=1e-5, atol=1e-5, what="complex loss")
    loss.backward()
    loss_ref.backward()
    close(full(xs.grad), ref.grad, rtol=1e-5, atol=1e-5, what="grad through complex collectives")
    return True


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("world", [2, 3])
def test_complex_collectives(world, dtype):
    harness.run(world, case_complex_collectives, dtype)


@pytest.mark.parametrize("world", [2, 3])
def test_complex_gradients(world):
    harness.run(world, case_complex_gradients)


def case_dtypes_gloo_lacks():
    m = mesh()
    w = m.size()
    ext = {0: uneven_extents(7, w, seed=3)}
    base = torch.arange(21).reshape(7, 3)
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn):
        v = (base % 9).to(dtype) if dtype == torch.float8_e4m3fn else base.to(dtype)
        x = st.distribute_tensor(v, m, [st.Shard(0)], ext)
        assert x.dtype == dtype
        assert torch.equal(x.full_tensor().view(torch.uint8), v.view(torch.uint8)), dtype          # all-gather
        assert torch.equal(x.redistribute([st.Shard(1)]).full_tensor().view(torch.uint8), v.view(torch.uint8))
        s = st.scatter_tensor(v if rank() == 0 else None, 0, m, [st.Shard(1)])
        assert torch.equal(s.full_tensor().view(torch.uint8), v.view(torch.uint8)), dtype           # scatter
    # Reductions (torch's CPU kernels reduce int16 but not the unsigned ones): max, min, and a sum kept in int16 that
    # wraps around as torch's does.
    v = (base * 1000).to(torch.int16)
    x = st.distribute_tensor(v, m, [st.Shard(0)], ext)
    assert torch.equal(full(x.amax(0)), v.amax(0))
    assert torch.equal(full(x.amin(0)), v.amin(0))
    assert torch.equal(full(x.sum(0, dtype=torch.int16)), v.sum(0, dtype=torch.int16))
    return True


def test_dtypes_gloo_lacks():
    harness.run(3, case_dtypes_gloo_lacks)
