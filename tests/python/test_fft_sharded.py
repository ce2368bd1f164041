"""torch.fft along sharded dims (pencil transposes: the shard moves to an untransformed dim by one all-to-all, or
between the stages of a separable transform when none can take it) against one device: every transform and norm
mode, n=/s= padding and cropping, uneven and zero extents, 1-D and 2-D meshes, layouts and collective counts,
gradients, an FNO-style spectral block, and the refusal when no dim can hold the shard."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, tiny_extents, uneven_extents

TOL = dict(rtol=1e-4, atol=1e-5)
NORMS = (None, "ortho", "forward")


def _real(t):
    """Outputs compared as real pairs (check_op's loss weights are real)."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def case_transforms(kind):
    m = mesh()
    w = m.size()
    x = randn(3, 4, 10, 6, seed=1)
    ext = uneven_extents(10, w, seed=2) if kind == "uneven" else tiny_extents(10, w)
    lay = ([st.Shard(2)], {0: ext})
    fns = {
        "rfft2": lambda t, nm: torch.fft.rfft2(t, norm=nm),
        "fft2": lambda t, nm: torch.fft.fft2(t, norm=nm),
        "rfftn s": lambda t, nm: torch.fft.rfftn(t, s=(12, 5), dim=(2, 3), norm=nm),
        "rfft along sharded": lambda t, nm: torch.fft.rfft(t, dim=2, norm=nm),
        "fft n crop": lambda t, nm: torch.fft.fft(t, n=7, dim=2, norm=nm),
        "ihfft": lambda t, nm: torch.fft.ihfft(t, dim=2, norm=nm),
        "irfft2 of rfft2": lambda t, nm: torch.fft.irfft2(torch.fft.rfft2(t, norm=nm), s=(10, 6), norm=nm),
        "ifft2 of fft2": lambda t, nm: torch.fft.ifft2(torch.fft.fft2(t, norm=nm), norm=nm).real,
        "irfft along sharded": lambda t, nm: torch.fft.irfft(torch.fft.rfft(t, dim=2, norm=nm), n=10, dim=2, norm=nm),
        "hfft": lambda t, nm: torch.fft.hfft(torch.fft.ihfft(t, dim=2), n=10, dim=2, norm=nm),
        "fftshift": lambda t, nm: torch.fft.fftshift(torch.fft.fft2(t, norm=nm), dim=(2, 3)).abs(),
        # The Hermitian inverse transforms conjugate their complex output (_conj_physical, elementwise).
        "ihfft2": lambda t, nm: torch.fft.ihfft2(t, norm=nm),
        "ihfftn s": lambda t, nm: torch.fft.ihfftn(t, s=(12, 5), dim=(2, 3), norm=nm),
    }
    with st.use_strict():   # every transform above is a rule (no gather)
        for name, fn in fns.items():
            for nm in NORMS:
                check_op(lambda t, fn=fn, nm=nm: _real(fn(t, nm)), [x], [lay], m, **TOL, what=f"{name} norm={nm}")
    return True


def case_layout_and_traffic():
    """rfft2 of (B, C, H, W) with H sharded: one all-to-all moves the shard to the channels (the largest untransformed
    dim with a row per rank); its inverse transforms locally in that layout."""
    m = mesh()
    w = m.size()
    x = randn(1, 8, 9, 6, seed=3)
    xs = st.distribute_tensor(x, m, [st.Shard(2)], {0: uneven_extents(9, w, seed=4)})
    with st.CommCounter() as c:
        spec = torch.fft.rfft2(xs)
    assert st.placements(spec) == (st.Shard(1),), st.placements(spec)
    assert c.calls.get("all_to_all", 0) == (1 if w > 1 else 0) and c.total_calls == c.calls.get("all_to_all", 0), \
        dict(c.calls)
    with st.CommCounter() as c2:
        back = torch.fft.irfft2(spec, s=(9, 6))
    assert c2.total_calls == 0, dict(c2.calls)
    close(full(back), x, **TOL, what="roundtrip")
    close(full(spec), torch.fft.rfft2(x), **TOL, what="spectrum")
    return True


def case_staged():
    """No untransformed dim can take the shard (a single-channel field, a 1-D signal): the transform is split into
    stages and the shard moves between their dims."""
    m = mesh()
    w = m.size()
    f = randn(1, 1, 11, 8, seed=5)
    lay = ([st.Shard(2)], {0: uneven_extents(11, w, seed=6)})
    for nm in NORMS:
        check_op(lambda t, nm=nm: _real(torch.fft.rfft2(t, norm=nm)), [f], [lay], m, **TOL, what=f"staged rfft2 {nm}")
        check_op(lambda t, nm=nm: torch.fft.irfft2(torch.fft.rfft2(t, norm=nm) * 2, s=(11, 8), norm=nm), [f], [lay],
                 m, **TOL, what=f"staged irfft2 {nm}")
        check_op(lambda t, nm=nm: _real(torch.fft.fft2(t, norm=nm)), [f], [lay], m, **TOL, what=f"staged fft2 {nm}")
    # The width sharded: r2c along it needs the shard on the height first.
    check_op(lambda t: _real(torch.fft.rfft2(t)), [f], [([st.Shard(3)], {0: uneven_extents(8, w, seed=7)})], m,
             **TOL, what="staged rfft2, last dim sharded")
    return True


def case_2d_mesh():
    m = mesh((2, 2))
    x = randn(2, 4, 6, 5, seed=8)
    # H and W sharded on different mesh dims: both shards move (to C and B).
    lay = ([st.Shard(2), st.Shard(3)], {0: [2, 4], 1: [5, 0]})
    for name, fn in (("rfft2", lambda t: _real(torch.fft.rfft2(t))),
                     ("irfft2 of rfft2", lambda t: torch.fft.irfft2(torch.fft.rfft2(t), s=(6, 5))),
                     ("fft along H only", lambda t: _real(torch.fft.fft(t, dim=2)))):
        check_op(fn, [x], [lay], m, **TOL, what=f"2-D mesh {name}")
    # Batch and channels sharded: no transformed dim is sharded, no communication.
    xs = st.distribute_tensor(x, m, [st.Shard(0), st.Shard(1)])
    with st.CommCounter() as c:
        y = torch.fft.rfft2(xs)
    assert c.total_calls == 0 and st.placements(y) == (st.Shard(0), st.Shard(1))
    return True


def case_pencil_2d_mesh():
    """A 3-D volume split along two of its dims on a 2x2 mesh, transformed along all three (a spectral solver's
    pencil decomposition) or along both split dims with one free dim: no dim can take both shards at once, so the
    split dims are transformed one at a time, each after its shard moves to a dim transformed already (it raised
    "no other dim can hold its shard", and the fallback gathered the volume; the OpInfo 2x2 probe)."""
    m = mesh((2, 2))
    v = randn(5, 6, 7, seed=4)
    lay = ([st.Shard(0), st.Shard(2)], {0: [2, 3], 1: [4, 3]})
    with st.use_strict():
        for norm in NORMS:
            for name, fn in (("fftn", lambda t: _real(torch.fft.fftn(t, norm=norm))),
                             ("ifftn", lambda t: _real(torch.fft.ifftn(t, norm=norm))),
                             ("rfftn", lambda t: _real(torch.fft.rfftn(t, norm=norm))),
                             ("irfftn of rfftn", lambda t: torch.fft.irfftn(torch.fft.rfftn(t, norm=norm), s=(5, 6, 7),
                                                                            norm=norm)),
                             ("fft2 over the split dims", lambda t: _real(torch.fft.fft2(t, dim=(0, 2), norm=norm))),
                             ("hfftn", lambda t: torch.fft.hfftn(t, norm=norm))):
                check_op(fn, [v], [lay], m, **TOL, what=f"pencil {name} norm={norm}")
        # A spectral derivative along every dim, as a DNS code takes it: ik * u^ then back.
        k = [torch.fft.fftfreq(n, d=1.0 / n) for n in (5, 6, 7)]
        kk = (k[0][:, None, None] + k[1][None, :, None] + k[2][None, None, :]).to(torch.complex64)
        check_op(lambda t: torch.fft.ifftn(1j * kk * torch.fft.fftn(t)).real, [v], [lay], m, **TOL,
                 what="pencil spectral derivative")
        vs = st.distribute_tensor(v, m, *lay)
        with st.CommCounter() as c:
            torch.fft.fftn(vs)
        assert c.calls == {"all_to_all": 2}, c.calls   # one per split dim
    return True


class SpectralConv2d(torch.nn.Module):
    """An FNO spectral convolution in plain torch: rfft2, a per-mode complex contraction of the low modes with a
    complex weight, irfft2."""

    def __init__(self, cin, cout, modes, alloc="pad"):
        super().__init__()
        self.modes, self.alloc = modes, alloc
        g = torch.Generator().manual_seed(9)
        self.weight = torch.nn.Parameter(torch.randn(cin, cout, modes, modes, 2, generator=g) / (cin * cout))

    def forward(self, x):
        h, w = x.shape[-2:]
        xf = torch.fft.rfft2(x)
        low = xf[..., : self.modes, : self.modes]
        mixed = torch.einsum("bixy,ioxy->boxy", low, torch.view_as_complex(self.weight))
        if self.alloc == "pad":
            out = torch.nn.functional.pad(mixed, (0, w // 2 + 1 - self.modes, 0, h - self.modes))
        else:   # neuraloperator's form, allocated from the spectrum instead of torch.zeros
            out = xf.new_zeros(mixed.shape[0], mixed.shape[1], h, w // 2 + 1)
            out[..., : self.modes, : self.modes] = mixed
        self.spectrum = out
        return torch.fft.irfft2(out, s=(h, w))


def case_fno_block(alloc):
    """An FNO layer against one device; the padded (or written) full spectrum stays divided over the ranks (a
    pending channel sum is reduce-scattered, not replicated)."""
    m = mesh()
    w = m.size()
    torch.manual_seed(0)
    block = SpectralConv2d(4, 4, 3, alloc)
    skip = torch.nn.Conv2d(4, 4, 1)
    x = randn(2, 4, 10, 8, seed=10)

    def fno(t):
        return torch.nn.functional.gelu(block(t) + skip(t))

    ref_x = x.clone().requires_grad_()
    ref = fno(ref_x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in (*block.parameters(), *skip.parameters())]
    for p in (*block.parameters(), *skip.parameters()):
        p.grad = None
    xs = st.distribute_tensor(x, m, [st.Shard(2)], {0: uneven_extents(10, w, seed=11)}).requires_grad_()
    out = fno(xs)
    close(full(out), ref, **TOL, what="fno forward")
    assert any(p.is_shard() for p in st.placements(block.spectrum)), st.placements(block.spectrum)
    out.square().sum().backward()
    close(full(xs.grad), ref_x.grad, **TOL, what="fno input grad")
    for p, r in zip((*block.parameters(), *skip.parameters()), ref_grads):
        close(full(p.grad) if st.is_shard_tensor(p.grad) else p.grad, r, rtol=1e-4, atol=1e-4, what="fno param grad")
    return True


def case_four_step(shape):
    """A 1-D transform along the only dim that could hold the split (a long signal; batch and channels of 1): the
    four-step FFT on ShardTensors -- a rule (strict mode), all-to-alls only, the output split along the transformed
    dim; forward and input gradients of every transform kind and norm against one device, uneven and tiny
    extents, even and odd lengths; prime lengths through Bluestein's algorithm (its convolution a four-step of a
    power-of-two length)."""
    m = mesh()
    w = m.size()
    n = shape[-1]
    x = randn(*shape, seed=20 + n, dtype=torch.float64)
    z = torch.complex(x, randn(*shape, seed=21 + n, dtype=torch.float64))
    dim = len(shape) - 1
    tol = dict(rtol=1e-9, atol=1e-9)
    with st.use_strict():
        for ext in (uneven_extents(n, w, seed=n), tiny_extents(n, w)):
            lay = ([st.Shard(dim)], {0: ext})
            for nm in NORMS:
                check_op(lambda t, nm=nm: _real(torch.fft.fft(t, norm=nm)), [x], [lay], m, **tol, what=f"fft {nm}")
                check_op(lambda t, nm=nm: _real(torch.fft.ifft(torch.view_as_complex(t), norm=nm)),
                         [torch.view_as_real(z)], [([st.Shard(dim)], {0: ext})], m, **tol, what=f"ifft {nm}")
                check_op(lambda t, nm=nm: _real(torch.fft.rfft(t, norm=nm)), [x], [lay], m, **tol, what=f"rfft {nm}")
                check_op(lambda t, nm=nm: torch.fft.irfft(torch.fft.rfft(t, norm=nm) * 1.5, n=n, norm=nm), [x],
                         [lay], m, **tol, what=f"irfft of rfft {nm}")
            # A half spectrum with imaginary DC / Nyquist parts (c2r ignores them) and hfft/ihfft through c2r/r2c.
            half = torch.fft.rfft(x) + 0.3j
            lay_h = ([st.Shard(dim)], {0: uneven_extents(half.shape[-1], w, seed=3)})
            check_op(lambda t: torch.fft.irfft(torch.view_as_complex(t), n=n), [torch.view_as_real(half)],
                     [([st.Shard(dim)], lay_h[1])], m, **tol, what="irfft of a non-Hermitian DC")
            check_op(lambda t: torch.fft.hfft(torch.fft.ihfft(t), n=n), [x], [lay], m, **tol, what="hfft(ihfft)")
        xs = st.distribute_tensor(x, m, [st.Shard(dim)], {0: uneven_extents(n, w, seed=n)})
        with st.CommCounter() as c:
            y = torch.fft.fft(xs)
    assert st.placements(y) == (st.Shard(dim),), st.placements(y)
    assert set(c.calls) <= {"all_to_all"}, dict(c.calls)
    # Bluestein (a prime length): three four-steps of at most four each (the signal, the chirp filter, the inverse)
    # and the re-layout of its first n outputs
    prime = all(n % d for d in range(2, int(n ** 0.5) + 1))
    assert c.calls.get("all_to_all", 0) <= (13 if prime else 4), dict(c.calls)
    return True


def case_bluestein_2d_mesh():
    """A prime length along a dim split by one mesh dim of a 2x2 mesh while the other splits the batch (which then
    cannot take the shard): Bluestein through the four-step, strict mode, forward and gradients, all-to-alls only."""
    m = mesh((2, 2))
    x = randn(2, 13, seed=31, dtype=torch.float64)
    lay = ([st.Shard(0), st.Shard(1)], {1: [9, 4]})
    with st.use_strict():
        for nm in NORMS:
            check_op(lambda t, nm=nm: _real(torch.fft.fft(t, dim=1, norm=nm)), [x], [lay], m, rtol=1e-9, atol=1e-9,
                     what=f"2x2 prime fft {nm}")
            check_op(lambda t, nm=nm: torch.fft.irfft(torch.fft.rfft(t, dim=1, norm=nm), n=13, dim=1, norm=nm), [x],
                     [lay], m, rtol=1e-9, atol=1e-9, what=f"2x2 prime irfft(rfft) {nm}")
        xs = st.distribute_tensor(x, m, *lay)
        with st.CommCounter() as c:
            torch.fft.fft(xs, dim=1)
    assert set(c.calls) <= {"all_to_all"}, dict(c.calls)
    return True


def refuse_no_dim_for_the_shard():
    m = mesh((2, 2))
    x = st.distribute_tensor(torch.randn(5, 6), m, [st.Shard(0), st.Shard(1)])
    with st.use_strict():
        torch.fft.fft2(x)  # both dims transformed and split: no third dim for the pencil


def case_no_dim_falls_back():
    """Without strict mode the declined transform runs through the gather-compute fallback: right values."""
    m = mesh((2, 2))
    f = torch.randn(5, 6, generator=torch.Generator().manual_seed(12))
    x = st.distribute_tensor(f, m, [st.Shard(0), st.Shard(1)], {0: [4, 1], 1: [2, 4]})
    close(full(torch.fft.rfft2(x)), torch.fft.rfft2(f), **TOL, what="2-D rfft2 via the fallback")
    return True


@pytest.mark.parametrize("kind", ["uneven", "tiny"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_transforms(world, kind):
    harness.run(world, case_transforms, kind)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_layout_and_traffic(world):
    harness.run(world, case_layout_and_traffic)


@pytest.mark.parametrize("world", [2, 3])
def test_staged(world):
    harness.run(world, case_staged)


def test_pencil_2d_mesh():
    harness.run(4, case_pencil_2d_mesh)


def test_2d_mesh():
    harness.run(4, case_2d_mesh)


@pytest.mark.parametrize("alloc", ["pad", "new_zeros"])
@pytest.mark.parametrize("world", [2, 3])
def test_fno_block(world, alloc):
    harness.run(world, case_fno_block, alloc)


# (13,), (1, 31), (1, 1, 7): prime lengths, Bluestein's algorithm through the four-step
@pytest.mark.parametrize("world,shape", [(2, (12,)), (3, (1, 1, 45)), (4, (1, 32)), (2, (1, 1, 9)), (2, (13,)),
                                         (3, (1, 31)), (4, (1, 1, 7))])
def test_four_step(world, shape):
    harness.run(world, case_four_step, shape)


def test_bluestein_2d_mesh():
    harness.run(4, case_bluestein_2d_mesh)


def test_refusal():
    harness.expect_error(4, refuse_no_dim_for_the_shard, match="no other dim can hold its shard",
                         kinds=("NotImplementedError",))
    harness.run(4, case_no_dim_falls_back)


class AFNOFilter(torch.nn.Module):
    """An AFNO token mixer in plain torch (FourCastNet style): tokens-first (B, H, W, C), rfft2 over (H, W), a
    block-diagonal complex two-layer MLP over channel blocks with ReLU and softshrink, irfft2, plus the residual."""

    def __init__(self, channels, blocks):
        super().__init__()
        self.blocks, self.bs = blocks, channels // blocks
        g = torch.Generator().manual_seed(13)
        self.w1 = torch.nn.Parameter(0.3 * torch.randn(2, blocks, self.bs, self.bs, generator=g))
        self.w2 = torch.nn.Parameter(0.3 * torch.randn(2, blocks, self.bs, self.bs, generator=g))

    def forward(self, x):
        b, h, w, c = x.shape
        xf = torch.fft.rfft2(x, dim=(1, 2), norm="ortho").reshape(b, h, w // 2 + 1, self.blocks, self.bs)
        w1 = torch.complex(self.w1[0], self.w1[1])
        w2 = torch.complex(self.w2[0], self.w2[1])
        o1 = torch.einsum("...bi,bio->...bo", xf, w1)
        o1 = torch.complex(torch.relu(o1.real), torch.relu(o1.imag))
        o2 = torch.einsum("...bi,bio->...bo", o1, w2)
        o2 = torch.view_as_complex(torch.nn.functional.softshrink(torch.view_as_real(o2), 0.01))
        out = torch.fft.irfft2(o2.reshape(b, h, w // 2 + 1, c), s=(h, w), dim=(1, 2), norm="ortho")
        return out + x


def case_afno_block():
    m = mesh()
    w = m.size()
    block = AFNOFilter(8, 2)
    x = randn(2, 10, 8, 8, seed=14)
    for ext in (uneven_extents(10, w, seed=15), tiny_extents(10, w)):
        check_op(lambda t, p1, p2: block(t), [x, block.w1.detach(), block.w2.detach()],
                 [([st.Shard(1)], {0: ext}), None, None], m, **TOL, what=f"afno ext={ext}")
    # Parameter gradients against one device (check_op's backward above accumulated into block's parameters).
    block.zero_grad(set_to_none=True)
    ref = AFNOFilter(8, 2)
    xs = st.distribute_tensor(x, m, [st.Shard(1)], {0: uneven_extents(10, w, seed=16)}).requires_grad_()
    xr = x.clone().requires_grad_()
    block(xs).square().sum().backward()
    ref(xr).square().sum().backward()
    close(full(xs.grad), xr.grad, **TOL, what="afno input grad")
    for p, r in zip(block.parameters(), ref.parameters()):
        close(p.grad, r.grad, rtol=1e-4, atol=1e-4, what="afno param grad")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_afno_block(world):
    harness.run(world, case_afno_block)
