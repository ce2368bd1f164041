"""torchaudio's IIR filters on a signal split along time (``shardtensor.integrations.torchaudio_filtering``: a scan
over the ranks), in strict mode, against one device: ``lfilter`` of first to fourth order, several filters over
channels, coefficients that require grad (their gradients summed over the ranks' segments), ``filtfilt`` (a flip
of the split signal between two passes), a biquad; uneven, zero and one-sample shards (shorter than the filter's
order), 1-4 ranks, a 2-D mesh splitting batch and time; the output keeps the signal's layout and stays divided.
Also: the routing is installed whether torchaudio is imported before or after shardtensor."""

import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_integration_routing, check_op, mesh, randn, strict, tiny_extents, uneven_extents

pytest.importorskip("torchaudio", reason="torchaudio is an optional test dependency (tests/requirements-zoo.txt)")
import torchaudio.functional as AF  # noqa: E402

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-9)
# Stable filters: a (N + 1) denominators with poles inside the unit circle, b numerators of the same size.
FILTERS = {
    1: ([1.0, -0.9], [0.5, 0.5]),
    2: ([1.0, -1.2, 0.5], [0.1, 0.2, 0.1]),
    3: ([1.0, -0.5, 0.3, -0.1], [0.3, 0.1, -0.2, 0.05]),
    4: ([1.3, -1.0, 0.4, -0.2, 0.05], [0.2, 0.0, 0.3, -0.1, 0.1]),  # a0 != 1: normalized by torchaudio
}


def _coeffs(order):
    a, b = FILTERS[order]
    return torch.tensor(a, dtype=D), torch.tensor(b, dtype=D)


def case_lfilter(kind):
    m = mesh()
    w = m.size()
    T = 61
    ext = uneven_extents(T, w, seed=3) if kind == "uneven" else tiny_extents(T, w)
    x = randn(2, 3, T, seed=1, dtype=D)
    for order in FILTERS:
        a, b = _coeffs(order)
        # learnable coefficients: their gradients are compared too (plain inputs requiring grad)
        check_op(lambda s, a, b: AF.lfilter(s, a, b, clamp=False), [x, a, b], [([st.Shard(2)], {0: ext}), None, None],
                 m, **TOL, what=f"lfilter order {order}", expect_placements=[st.Shard(2)])
    # one filter per channel (2-D coefficients, batching), and the clamp of the default
    a2 = torch.stack([_coeffs(2)[0], torch.tensor([1.0, 0.3, -0.1], dtype=D), torch.tensor([1.0, -0.2, 0.1], dtype=D)])
    b2 = torch.stack([_coeffs(2)[1], torch.tensor([0.4, 0.3, 0.1], dtype=D), torch.tensor([0.2, -0.1, 0.3], dtype=D)])
    check_op(lambda s, a, b: AF.lfilter(s * 0.3, a, b), [x, a2, b2], [([st.Shard(2)], {0: ext}), None, None], m,
             **TOL, what="a filter per channel, clamped")
    # split along batch only: each rank filters whole signals; the coefficients' gradients still summed
    check_op(lambda s, a, b: AF.lfilter(s, a, b, clamp=False), [x, *_coeffs(2)],
             [([st.Shard(0)], {0: uneven_extents(2, w, seed=5)}), None, None], m, **TOL, what="batch split")
    # forward-backward filtering: the second pass runs over the flipped split signal
    a, b = _coeffs(2)
    check_op(lambda s: AF.filtfilt(s, a, b, clamp=False), [x], [([st.Shard(2)], {0: ext})], m, **TOL,
             what="filtfilt")
    check_op(lambda s: AF.lowpass_biquad(s * 0.3, 8000, 1000.0), [x[0]], [([st.Shard(1)], {0: ext})], m, **TOL,
             what="lowpass biquad, 2-D signal")
    # divided: each rank filters its own rows; nothing of another rank's length is materialized by the filter
    xs = st.distribute_tensor(x, m, [st.Shard(2)], sharding_shapes={0: ext})
    y = AF.lfilter(xs, *_coeffs(3), clamp=False)
    assert st.sharding_shapes(y) == {0: ext} and st.to_local(y).shape[-1] == ext[m.get_coordinate()[0]]
    return True


@pytest.mark.parametrize("world,kind", [(1, "uneven"), (2, "uneven"), (3, "tiny"), (4, "uneven")])
def test_lfilter(world, kind):
    harness.run(world, strict, case_lfilter, kind)


def case_lfilter_2d_mesh():
    """Batch split over one mesh dim, time over the other (uneven), and channels split with per-channel filters."""
    m = mesh((2, 2))
    T = 37
    x = randn(3, 2, T, seed=4, dtype=D)
    a, b = _coeffs(2)
    check_op(lambda s, a, b: AF.lfilter(s, a, b, clamp=False), [x, a, b],
             [([st.Shard(0), st.Shard(2)], {0: [2, 1], 1: [20, 17]}), None, None], m, **TOL, what="batch x time")
    a2 = torch.stack([a, torch.tensor([1.0, 0.3, -0.1], dtype=D)])
    b2 = torch.stack([b, torch.tensor([0.4, 0.3, 0.1], dtype=D)])
    check_op(lambda s, a, b: AF.lfilter(s, a, b, clamp=False), [x, a2, b2],
             [([st.Shard(1), st.Shard(2)], {0: [1, 1], 1: [5, 32]}), None, None], m, **TOL,
             what="channels x time, a filter per channel")
    return True


def test_lfilter_2d_mesh():
    harness.run(4, strict, case_lfilter_2d_mesh)


@pytest.mark.parametrize("first", ["torchaudio", "shardtensor"])
def test_routing_installed_in_either_import_order(first):
    """The integration routes torchaudio's filter core whichever library is imported first (an import hook when
    torchaudio comes second), and SHARDTENSOR_NO_INTEGRATIONS=1 leaves it alone."""
    second = "shardtensor" if first == "torchaudio" else "torchaudio.functional"
    check_integration_routing(first, second, "torchaudio.functional.filtering", "_lfilter",
                              disabled_too=first == "shardtensor")
