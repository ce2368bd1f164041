"""torch.stft / torch.istft of a signal split along time, in strict mode (no gather fallback), against one device:
the spectrum, the signal's and the window's gradients; centred (reflect, constant, replicate, circular padding)
and uncentred frames, windows shorter than n_fft, align_to_window, normalized, one- and two-sided, complex input,
return_complex=False; uneven and tiny shards, 1-4 ranks, a 2-D mesh (batch x time). The frames stay divided: each
rank holds the frames that start in its rows."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, mesh, randn, strict, tiny_extents, uneven_extents

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-9)


def _stft(**kw):
    def fn(x, *w):
        return torch.stft(x, window=w[0] if w else None, **kw)
    return fn


def case_stft(kind):
    m = mesh()
    w = m.size()
    L = 97
    ext = uneven_extents(L, w, seed=2) if kind == "uneven" else tiny_extents(L, w)
    x = randn(3, L, seed=1, dtype=D)
    hann = torch.hann_window(16, dtype=D)
    short = torch.hann_window(11, dtype=D)
    cases = [
        ("default centred", dict(n_fft=16, return_complex=True), []),
        ("hann hop 5", dict(n_fft=16, hop_length=5, return_complex=True), [hann]),
        ("short window", dict(n_fft=16, hop_length=3, win_length=11, return_complex=True), [short]),
        ("constant pad, normalized", dict(n_fft=12, hop_length=4, pad_mode="constant", normalized=True,
                                          return_complex=True), []),
        ("replicate pad, two-sided", dict(n_fft=10, hop_length=2, pad_mode="replicate", onesided=False,
                                          return_complex=True), []),
        ("circular pad, real pairs", dict(n_fft=8, hop_length=3, pad_mode="circular", return_complex=False), []),
        ("uncentred", dict(n_fft=7, hop_length=2, center=False, return_complex=True), []),
        ("uncentred, aligned short window", dict(n_fft=16, hop_length=4, win_length=10, center=False,
                                                 align_to_window=True, return_complex=True),
         [torch.hann_window(10, dtype=D)]),
    ]
    for what, kw, extra in cases:
        for sig in (x, x[0]):  # batched and 1-D signals
            dim = sig.dim() - 1
            # the window's gradient (a learnable window) comes back replicated, as one device's
            check_op(_stft(**kw), [sig, *extra], [([st.Shard(dim)], {0: ext})] + [None] * len(extra), m, **TOL,
                     what=f"{what} {sig.dim()}-D", expect_placements=[st.Shard(dim + 1)])
    # a complex signal: two-sided by default
    xc = torch.complex(randn(2, L, seed=3, dtype=D), randn(2, L, seed=4, dtype=D))
    check_op(_stft(n_fft=12, hop_length=3, return_complex=True), [xc], [([st.Shard(1)], {0: ext})], m, **TOL,
             what="complex")
    # divided: a rank's frames are those that start in its rows (about n_frames / w), never all of them
    xs = st.distribute_tensor(x, m, [st.Shard(1)], sharding_shapes={0: ext})
    spec = torch.stft(xs, 16, hop_length=4, return_complex=True)
    frames = st.sharding_shapes(spec)[0]
    assert sum(frames) == spec.shape[-1] and (w == 1 or max(frames) < spec.shape[-1]), frames
    return True


@pytest.mark.parametrize("world,kind", [(1, "uneven"), (2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_stft(world, kind):
    harness.run(world, strict, case_stft, kind)


def case_istft(kind):
    """istft of frames split along time (the layout stft returns): overlap-add of each rank's frames, the
    overlapping tails sent to the next rank; the round trip gives the signal back."""
    m = mesh()
    w = m.size()
    x = randn(2, 90, seed=5, dtype=D)
    hann = torch.hann_window(16, dtype=D)
    spec = torch.stft(x, 16, hop_length=4, window=hann, return_complex=True)
    T = spec.shape[-1]
    ext = uneven_extents(T, w, seed=6) if kind == "uneven" else tiny_extents(T, w)
    check_op(lambda s, win: torch.istft(s, 16, hop_length=4, window=win), [spec, hann],
             [([st.Shard(2)], {0: ext}), None], m, **TOL, what="istft",
             expect_placements=[st.Shard(1)])
    check_op(lambda s, win: torch.istft(s, 16, hop_length=4, window=win, length=90, center=True), [spec, hann],
             [([st.Shard(2)], {0: ext}), None], m, **TOL, what="istft length")
    return True


@pytest.mark.parametrize("world,kind", [(2, "uneven"), (3, "tiny")])
def test_istft(world, kind):
    harness.run(world, strict, case_istft, kind)


def case_stft_2d_mesh():
    m = mesh((2, 2))
    x = randn(3, 61, seed=7, dtype=D)
    check_op(_stft(n_fft=8, hop_length=3, return_complex=True), [x], [([st.Shard(0), st.Shard(1)],
                                                                        {0: [2, 1], 1: [20, 41]})], m, **TOL,
             what="batch x time", expect_placements=[st.Shard(0), st.Shard(2)])
    return True


def test_stft_2d_mesh():
    harness.run(4, strict, case_stft_2d_mesh)


def case_stft_errors():
    m = mesh()
    xs = st.distribute_tensor(randn(2, 40, seed=8, dtype=D), m, [st.Shard(1)])
    with pytest.raises(RuntimeError, match="return_complex"):
        torch.stft(xs, 8)
    with pytest.raises(RuntimeError, match="n_fft"):
        torch.stft(xs, 64, center=False, return_complex=True)
    return True


def test_stft_errors():
    harness.run(2, case_stft_errors)
