"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` on a ShardTensor sequence (``shardtensor/rnn.py``), in strict mode, against
one device: the output, the final states, the input's gradient and every weight's gradient; a sequence split along
time (the ranks relay the state, a unidirectional stack as a wavefront; uneven and empty shards), along batch, or
both on a 2-D mesh; one to three layers, bidirectional, batch_first or not, LSTM projections, a given initial
state, unbatched input. The work stays divided: each rank's output rows are its own, and no op runs through the
fallback (strict mode would raise)."""
import copy

import pytest
import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn, strict, tiny_extents, uneven_extents

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-9)


def _module(kind, **kw):
    torch.manual_seed(0)
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[kind]
    return cls(5, 6, **kw).to(D)


def _states(h):
    return list(h) if isinstance(h, tuple) else [h]


def _compare(mod, x, layout, m, hx=None, what=""):
    """One training step of ``mod`` on the split ``x`` against a copy on the whole ``x``: outputs, final states,
    the input's and every parameter's gradient."""
    ref_mod = copy.deepcopy(mod)
    x_ref = x.detach().clone().requires_grad_(True)
    pl, ext = layout
    xs = st.distribute_tensor(x.detach().clone(), m, pl, sharding_shapes=ext).requires_grad_(True)
    out_ref, h_ref = ref_mod(x_ref, hx)
    out, h = mod(xs, hx)
    assert st.is_shard_tensor(out) and st.placements(out) == tuple(pl), (what, st.placements(out))
    close(full(out), out_ref, **TOL, what=f"{what} output")
    for i, (a, b) in enumerate(zip(_states(h), _states(h_ref))):
        close(full(a), b, **TOL, what=f"{what} final state {i}")
    w = randn(*out_ref.shape, seed=7, dtype=D)
    loss_ref = (out_ref * w).sum() + sum((s * (i + 2)).sum() for i, s in enumerate(_states(h_ref)))
    loss = (out * w).sum() + sum((s * (i + 2)).sum() for i, s in enumerate(_states(h)))
    loss_ref.backward()
    loss.backward()
    close(full(xs.grad), x_ref.grad, **TOL, what=f"{what} input grad")
    for (name, p), (_, q) in zip(mod.named_parameters(), ref_mod.named_parameters()):
        assert not st.is_shard_tensor(p.grad), f"{what}: {name}.grad is a ShardTensor"
        close(p.grad, q.grad, **TOL, what=f"{what} grad {name}")


def case_time_split(kind, split):
    m = mesh()
    w = m.size()
    T = 13
    ext = uneven_extents(T, w, seed=4) if split == "uneven" else tiny_extents(T, w)
    for kw in (dict(num_layers=3), dict(bidirectional=True, batch_first=True), dict(num_layers=2, bidirectional=True)):
        mod = _module(kind, **kw)
        bf = kw.get("batch_first", False)
        x = randn(*((3, T, 5) if bf else (T, 3, 5)), seed=1, dtype=D)
        _compare(mod, x, ([st.Shard(1 if bf else 0)], {0: ext}), m, what=f"{kind} {kw}")
    if kind == "lstm":  # projections, and a given initial state
        mod = _module(kind, proj_size=4, num_layers=2)
        x = randn(T, 3, 5, seed=2, dtype=D)
        _compare(mod, x, ([st.Shard(0)], {0: ext}), m, what="lstm proj")
        hx = (randn(2, 3, 4, seed=3, dtype=D), randn(2, 3, 6, seed=4, dtype=D))
        _compare(_module(kind, proj_size=4, num_layers=2), x, ([st.Shard(0)], {0: ext}), m, hx=hx, what="lstm hx")
    # unbatched (T, I): time is dim 0
    _compare(_module(kind), randn(T, 5, seed=5, dtype=D), ([st.Shard(0)], {0: ext}), m, what=f"{kind} unbatched")
    return True


@pytest.mark.parametrize("world,kind,split", [(1, "lstm", "uneven"), (2, "lstm", "uneven"), (3, "gru", "tiny"),
                                              (2, "rnn", "uneven"), (4, "lstm", "tiny")])
def test_time_split(world, kind, split):
    harness.run(world, strict, case_time_split, kind, split)


def case_batch_split():
    m = mesh()
    w = m.size()
    B = 5
    ext = uneven_extents(B, w, seed=6)
    for kind, kw in (("lstm", dict(num_layers=2, bidirectional=True)), ("gru", dict(num_layers=2)),
                     ("rnn", dict(num_layers=3))):
        mod = _module(kind, batch_first=True, **kw)
        _compare(mod, randn(B, 9, 5, seed=8, dtype=D), ([st.Shard(0)], {0: ext}), m, what=f"{kind} {kw} batch")
    return True


def case_sharded_initial_state():
    """A learnable initial state given as a ShardTensor laid out otherwise than the input's batch rows (Replicate):
    redistributed to them; its gradient is one device's."""
    m = mesh()
    w = m.size()
    B, T = 4, 9
    for split, dim, ext in (("batch", 0, uneven_extents(B, w, seed=10)), ("time", 1, uneven_extents(T, w, seed=11))):
        mod = _module("lstm", batch_first=True)
        ref = copy.deepcopy(mod)
        x = randn(B, T, 5, seed=12, dtype=D)
        h = [randn(1, B, 6, seed=13 + i, dtype=D) for i in range(2)]
        h_ref = [t.clone().requires_grad_(True) for t in h]
        h_st = [st.distribute_tensor(t.clone(), m, [st.Replicate()]).requires_grad_(True) for t in h]
        xs = st.distribute_tensor(x.clone(), m, [st.Shard(dim)], sharding_shapes={0: ext})
        out_ref, (hn_ref, cn_ref) = ref(x, tuple(h_ref))
        out, (hn, cn) = mod(xs, tuple(h_st))
        wt = randn(*out_ref.shape, seed=20, dtype=D)
        ((out_ref * wt).sum() + hn_ref.sum() + 3 * cn_ref.sum()).backward()
        ((out * wt).sum() + hn.sum() + 3 * cn.sum()).backward()
        close(full(out), out_ref, **TOL, what=f"{split}: output")
        for i, (a, b) in enumerate(zip(h_st, h_ref)):
            close(full(a.grad), b.grad, **TOL, what=f"{split}: initial state {i} grad")
    return True


def test_sharded_initial_state():
    harness.run(2, strict, case_sharded_initial_state)


def test_batch_split():
    harness.run(3, strict, case_batch_split)


def case_2d_mesh():
    """Batch over one mesh dim, time over the other (uneven)."""
    m = mesh((2, 2))
    mod = _module("lstm", num_layers=2, bidirectional=True)
    _compare(mod, randn(11, 3, 5, seed=9, dtype=D), ([st.Shard(1), st.Shard(0)], {0: [2, 1], 1: [7, 4]}), m,
             what="lstm batch x time")
    return True


def test_2d_mesh():
    harness.run(4, strict, case_2d_mesh)
