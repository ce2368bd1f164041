"""torchaudio's IIR filter on a signal split along time: ``torchaudio.functional.lfilter`` and what is built on it
(the biquads, ``filtfilt``, ``deemphasis``, ``Deemphasis``, ``Loudness``'s K-weighting, ...).

Why it is routed: torchaudio's ``DifferentiableIIR`` allocates its output as ``torch.zeros(B, C, T + order - 1)``
from the signal's *global* shape, a plain tensor, and lets the kernel ``torchaudio::_lfilter_core_loop`` run the
recurrence ``y[t] = u[t] - a1 y[t-1] - ... - aN y[t-N]`` into it, sample after sample. On a split signal every rank
would hold and compute the whole output. ``_lfilter(waveform, a_coeffs, b_coeffs)``, which every public filter goes
through, is routed here instead (``st.register_function``).

How a filter ``y = IIR_a(FIR_b(x))`` runs on rows split along time (a scan over the ranks, in the order of the
split; ``N`` the order, coefficients normalized by ``a0``):

1. FIR: each rank's rows after the ``N`` samples before them (every rank's last ``N`` samples, one small all-gather;
   a rank shorter than ``N`` contributes what it has and the ranks before it the rest), a local grouped ``conv1d``.
2. IIR from rest: torchaudio's own kernel over the rank's rows from a zero state.
3. Every rank's zero-start end state (its last ``N`` outputs), one small all-gather.
4. A state ``s`` entering a segment of ``L`` samples leaves it as ``A^L s`` plus the segment's zero-start end
   state, ``A`` the recurrence's companion matrix (``N x N``, powered by squaring). Each rank folds the ranks
   before it: the exact state entering its rows.
5. Each rank but the first runs the recurrence again from that state: ``N`` samples put in front whose zero-start
   outputs are the state (``p[j] = s[j] + a1 s[j-1] + ... + aj s[0]``), then dropped.

Backward is the same filter run backwards in time: the adjoint of ``IIR_a o FIR_b`` is time reversal, the IIR,
the FIR, time reversal (the two parts commute), so the gradient is the same scan over the ranks in reverse order;
the coefficients' gradients are correlations of the adjoint signal with the input and the output over each rank's
rows (plus the ``N`` samples before them, kept from the forward), summed over every mesh dim that splits the signal
(one all-reduce). Everything a backward communicates is issued inside one autograd node, in a fixed order.

Cost per pass: the local recurrence twice on ranks after the first (once on the first), two all-gathers of ``N``
values per row and channel, ``O(P N^3 log L)`` flops for the fold. The output keeps the signal's layout. Stability
is the filter's: the fold multiplies states by ``A^L``, which one device's run applies too.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import (Replicate, device_mesh, from_local, is_shard_tensor, local_offsets, placements,
                redistribute, sharding_shapes, to_local)
from ..ring import completed, sum_over_mesh_dims, whole

_MODULE = "torchaudio.functional.filtering"


def install(module) -> None:
    """Route ``module._lfilter`` (torchaudio's filter core) to the domain-parallel filter."""
    from ..functions import register_function
    register_function(module._lfilter, lfilter_sharded)


@dataclass(frozen=True)
class _Layout:
    """Where this rank's rows sit: the signal's mesh, placements and extents; ``time_dim`` the mesh dim splitting
    time (None: every rank holds whole signals); ``channels`` the slice of filters this rank applies."""
    mesh: object
    placements: tuple
    shapes: dict
    time_dim: Optional[int]
    channels: slice

    @property
    def ranks(self) -> int:
        return 1 if self.time_dim is None else self.mesh.size(self.time_dim)

    def position(self, reverse: bool) -> int:
        me = 0 if self.time_dim is None else self.mesh.get_coordinate()[self.time_dim]
        return self.ranks - 1 - me if reverse else me

    def extents(self, reverse: bool) -> list:
        ext = [0] if self.time_dim is None else [int(e) for e in self.shapes[self.time_dim]]
        return ext[::-1] if reverse else ext

    def gather(self, tail, reverse: bool):
        """Every rank's ``tail`` (B, C, N) along the time split, as (B, C, P, N) in scan order."""
        md, n = self.time_dim, tail.shape[-1]
        shapes = dict(self.shapes)
        shapes[md] = [n] * self.ranks
        whole = to_local(redistribute(from_local(tail.contiguous(), self.mesh, self.placements, sharding_shapes=shapes,
                                                 check=False),
                                      [Replicate() if d == md else p for d, p in enumerate(self.placements)]))
        whole = whole.unflatten(-1, (self.ranks, n))
        return whole.flip(-2) if reverse else whole

    def sum_over_splits(self, t):
        """``t`` summed over every rank that holds a part of the signal (the mesh dims that split it)."""
        return sum_over_mesh_dims(t, self.mesh, [d for d, p in enumerate(self.placements) if p.is_shard()])


def _before(tails, extents, pos, n):
    """The ``n`` samples before position ``pos``'s rows in scan order (zeros before the signal's start), from the
    gathered tails (each rank's last ``min(n, extent)`` samples, zero-padded in front)."""
    pieces = [tails[..., q, n - min(n, extents[q]):] for q in range(pos)]
    return F.pad(torch.cat(pieces, dim=-1) if pieces else tails[..., 0, :0], (n, 0))[..., -n:]


def _companion(a):
    """(C, N, N) matrices taking the state (y[t-N], ..., y[t-1]) of ``y[t] = -a1 y[t-1] - ... - aN y[t-N]`` one
    step on; ``a`` is (C, N + 1) with ``a[:, 0] == 1``."""
    c, n = a.shape[0], a.shape[1] - 1
    shift = torch.eye(n, dtype=a.dtype, device=a.device)[1:].expand(c, n - 1, n)
    return torch.cat([shift, -a[:, 1:].flip(-1).unsqueeze(1)], dim=1)


def _state_prefix(s, a):
    """The ``N`` inputs whose zero-start outputs are ``s`` (oldest first): ``p[j] = sum_k a[k] s[j - k]``."""
    n = s.shape[-1]
    return sum(a[:, k, None] * F.pad(s, (k, 0))[..., :n] for k in range(n))


def _fir(x, b, layout, reverse):
    """``sum_k b[k] x[t - k]`` over this rank's rows (in scan order; ``reverse``: time runs backwards, ranks in
    reverse order); returns it and the ``N`` samples of ``x`` before the rows."""
    n = b.shape[1] - 1
    if n == 0 or layout.ranks == 1:  # nothing before the rows to read
        before = F.pad(x[..., :0], (n, 0))
    else:
        before = _before(layout.gather(F.pad(x, (n, 0))[..., -n:], reverse), layout.extents(reverse),
                         layout.position(reverse), n)
    if x.shape[-1] == 0:  # no rows here (conv1d refuses an input shorter than its kernel)
        return x.clone(), before
    out = F.conv1d(torch.cat([before, x], dim=-1), b.flip(-1).unsqueeze(1), groups=b.shape[0])
    return out, before


def _iir(u, a, layout, reverse, iir):
    """``y[t] = u[t] - sum_k a[k] y[t - k]`` over this rank's rows, exact across ranks (steps 2-5); returns it and
    the ``N`` outputs before the rows (the state entering them)."""
    n = a.shape[1] - 1
    y0 = iir(u, a)
    if n == 0 or layout.ranks == 1:  # whole signals on every rank, or no recurrence
        return y0, F.pad(y0[..., :0], (n, 0))
    tails = layout.gather(F.pad(y0, (n, 0))[..., -n:], reverse)
    pos, extents = layout.position(reverse), layout.extents(reverse)
    state = torch.zeros_like(tails[..., 0, :])
    if pos == 0:
        return y0, state
    step = _companion(a)
    for q in range(pos):
        state = torch.einsum("cij,bcj->bci", torch.linalg.matrix_power(step, extents[q]), state) + tails[..., q, :]
    return iir(torch.cat([_state_prefix(state, a), u], dim=-1).contiguous(), a)[..., n:], state


def _correlate(g, s, before, n):
    """(C, N + 1): ``sum over batch and rows of g[t] s[t - k]`` for k = 0..N (``before``: the N samples of ``s``
    before the rows)."""
    full = torch.cat([before, s], dim=-1)
    length = s.shape[-1]
    return torch.stack([(g * full[..., n - k:n - k + length]).sum(dim=(0, 2)) for k in range(n + 1)], dim=1)


class _ScanLFilter(torch.autograd.Function):
    """``IIR_a(FIR_b(x))`` on this rank's rows of a signal split along time; ``a``, ``b`` normalized, whole."""

    @staticmethod
    def forward(ctx, x, a, b, layout, iir):
        ch = layout.channels
        u, x_before = _fir(x, b[ch], layout, False)
        y, y_before = _iir(u.contiguous(), a[ch], layout, False, iir)
        ctx.layout, ctx.iir = layout, iir
        ctx.save_for_backward(x, x_before, y, y_before, a, b)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, x_before, y, y_before, a, b = ctx.saved_tensors
        layout, ch, n = ctx.layout, ctx.layout.channels, a.shape[1] - 1
        # the adjoint: the same filter backwards in time (the IIR's first, for the coefficients' correlations)
        g_rev, _ = _iir(grad.flip(-1).contiguous(), a[ch], layout, True, ctx.iir)
        gx_rev, _ = _fir(g_rev, b[ch], layout, True)
        g_u = g_rev.flip(-1)
        da = db = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # (C, N + 1) each, this rank's rows only; the whole filter bank's, summed over the ranks (one all-reduce)
            terms = torch.zeros(2, *a.shape, dtype=a.dtype, device=a.device)
            terms[0, ch] = -_correlate(g_u, y, y_before, n)
            terms[0, :, 0] = 0  # a0 is 1 after normalization: the recurrence does not read it
            terms[1, ch] = _correlate(g_u, x, x_before, n)
            da, db = layout.sum_over_splits(terms).unbind(0)
        return gx_rev.flip(-1), da, db, None, None


def lfilter_sharded(waveform, a_coeffs, b_coeffs):
    """``torchaudio.functional.filtering._lfilter`` for a ShardTensor ``waveform`` of shape (B, C, T) and
    coefficients (C, N + 1) (see the module's docstring)."""
    module = sys.modules[_MODULE]
    if not is_shard_tensor(waveform):  # a ShardTensor coefficient on a plain signal: one device's filter
        return module._lfilter(waveform, whole(a_coeffs), whole(b_coeffs))
    mesh = device_mesh(waveform)
    waveform = completed(waveform)  # a pending sum: complete it first, the scan works on whole values
    pl = tuple(placements(waveform))
    # the mesh dim splitting time, if any (the library splits a tensor dim over one mesh dim at most)
    time_dim = next((d for d, p in enumerate(pl) if p.is_shard() and p.dim == waveform.dim() - 1), None)
    a, b = whole(a_coeffs), whole(b_coeffs)
    b, a = b / a[:, 0:1], a / a[:, 0:1]
    x = to_local(waveform).contiguous()
    channels = slice(None)
    if a.shape[0] > 1 and any(p.is_shard() and p.dim == 1 for p in pl):  # channels split: this rank's filters
        first = local_offsets(waveform)[1]
        channels = slice(first, first + x.shape[1])
    layout = _Layout(mesh, pl, sharding_shapes(waveform), time_dim, channels)
    y = _ScanLFilter.apply(x, a, b, layout, module.DifferentiableIIR.ts_apply)
    return from_local(y, mesh, pl, sharding_shapes=layout.shapes, check=False)
