"""torch._segment_reduce (aten::segment_reduce) and its backward on ShardTensors, against one device: runs of rows
along an axis reduced per segment (PyG's `segment` readout over sorted nodes when torch_scatter is absent). Splits of
other dims stay local; a split axis reduces each rank's part of every segment and combines the parts over that mesh
dim (the result Replicate there). Forward, input gradients, every reduction with and without `initial`, lengths and
offsets, empty and rank-crossing segments, ties and zeros counted over the whole segment, 1-3 ranks, a 2x2 mesh;
strict mode throughout (no gather fallback)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, uneven_extents

REDUCTIONS = ["sum", "mean", "amax", "amin", "max", "prod"]


def _ties_and_zeros(*shape, seed):
    """Values with ties (halves) and zeros, so max/min share gradients and prod meets zeros."""
    return (randn(*shape, seed=seed) * 2).round() / 2


def _segment(r, initial=None, **kw):
    return lambda t: torch._segment_reduce(t, r, initial=initial, **kw)


def case_axis_split(seed):
    m = mesh()
    w = m.size()
    x = _ties_and_zeros(10, 3, seed=seed).double()
    lay = ([st.Shard(0)], {0: uneven_extents(10, w, seed)})
    full_lengths = torch.tensor([3, 4, 1, 2])   # no empty segment: every reduction finite
    lengths = torch.tensor([3, 0, 4, 1, 2])     # an empty segment: initial decides its value
    offsets = torch.tensor([1, 3, 3, 8])        # rows outside every segment (before 1, from 8)
    with st.use_strict():
        for r in REDUCTIONS:
            check_op(_segment(r, lengths=full_lengths), [x], [lay], m, what=f"{r}, lengths, axis split",
                     expect_placements=[st.Replicate()])
            check_op(_segment(r, initial=0.5, lengths=lengths), [x], [lay], m, what=f"{r}, initial, empty segment")
            check_op(_segment(r, initial=2.0, offsets=offsets), [x], [lay], m, what=f"{r}, offsets")
            # Without initial an empty segment is -inf / inf / NaN (mean) as on one device.
            got = full(torch._segment_reduce(st.distribute_tensor(x, m, *lay), r, lengths=lengths))
            close(got, torch._segment_reduce(x, r, lengths=lengths), what=f"{r} empty segment", equal_nan=True)
        # NaN rows (max / min / prod propagate them; their gradients follow aten's kernels) and a segment with two
        # zeros next to one with a single zero, compared with NaN equal.
        xn = x.clone()
        xn[4, 0], xn[1, 1] = float("nan"), float("nan")
        xn[3:5, 2], xn[8, 2], xn[9, 2] = 0.0, 0.0, 1.5
        g = randn(4, 3, seed=seed + 7).double()
        for r in ("amax", "amin", "prod", "mean"):
            ref = xn.clone().requires_grad_()
            want = _segment(r, initial=0.5, lengths=full_lengths)(ref)
            want.backward(g)
            xs = st.distribute_tensor(xn, m, *lay).requires_grad_()
            got = _segment(r, initial=0.5, lengths=full_lengths)(xs)
            got.backward(g)
            close(full(got), want, what=f"{r} with NaN and zeros", equal_nan=True)
            close(full(xs.grad), ref.grad, what=f"{r} with NaN and zeros, grad", equal_nan=True)
        # One rank of rows (the rest empty) and the rows each on their own rank.
        for ext in ([10] + [0] * (w - 1), [len(c) for c in torch.arange(10).tensor_split(w)]):
            check_op(_segment("amax", lengths=full_lengths), [x], [([st.Shard(0)], {0: ext})], m, what=f"amax {ext}")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_segment_reduce_axis_split(world):
    harness.run(world, case_axis_split, world)


def case_other_dims(seed):
    """axis 1 with per-row lengths: the leading dim split cuts the lengths to its block; the trailing dim local; the
    axis split as well."""
    m = mesh()
    w = m.size()
    x = _ties_and_zeros(4, 9, 2, seed=seed).double()
    lengths = torch.tensor([[2, 7, 0], [9, 0, 0], [3, 3, 3], [0, 1, 8]])
    with st.use_strict():
        for dim in (0, 1, 2):
            lay = ([st.Shard(dim)], {0: uneven_extents(x.shape[dim], w, seed)})
            for r in ("sum", "mean", "amax", "prod"):
                out = check_op(_segment(r, initial=1.5, lengths=lengths, axis=1), [x], [lay], m,
                               what=f"{r}, axis 1, dim {dim} split")
                if w > 1:
                    want = st.Replicate() if dim == 1 else st.Shard(dim)
                    assert st.placements(out) == (want,), (dim, st.placements(out))
        # A split of a dim other than the axis: no collective at all.
        xs = st.distribute_tensor(x, m, [st.Shard(0)])
        with st.CommCounter() as c:
            torch._segment_reduce(xs, "sum", lengths=lengths, axis=1)
        assert not c.calls, dict(c.calls)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_segment_reduce_other_dims(world):
    harness.run(world, case_other_dims, world)


def case_mesh2d(seed):
    m = mesh((2, 2))
    x = _ties_and_zeros(5, 8, 3, seed=seed).double()
    lengths = torch.tensor([[3, 5], [8, 0], [1, 7], [4, 4], [0, 8]])
    lay = ([st.Shard(0), st.Shard(1)], {0: [3, 2], 1: [5, 3]})
    with st.use_strict():
        for r in REDUCTIONS:
            out = check_op(_segment(r, initial=-1.0, lengths=lengths, axis=1), [x], [lay], m, what=f"{r}, 2x2")
            assert st.placements(out) == (st.Shard(0), st.Replicate()), st.placements(out)
    return True


def test_segment_reduce_mesh2d():
    harness.run(4, case_mesh2d, 4)


def case_bad_arguments_raise(seed):
    """Invalid lengths / offsets raise torch's errors on every rank (checked on the whole tensors)."""
    m = mesh()
    x = st.distribute_tensor(randn(6, 2, seed=seed), m, [st.Shard(0)])
    with pytest.raises(RuntimeError, match="sum to data.size"):
        torch._segment_reduce(x, "sum", lengths=torch.tensor([2, 2]))
    with pytest.raises(RuntimeError, match="negative"):
        torch._segment_reduce(x, "sum", lengths=torch.tensor([7, -1]))
    with pytest.raises(RuntimeError, match="segment_length >= 0"):
        torch._segment_reduce(x, "sum", offsets=torch.tensor([0, 4, 2, 6]))
    with pytest.raises(RuntimeError, match="not supported yet"):
        torch._segment_reduce(x, "sum", indices=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="must be either"):
        torch._segment_reduce(x, "median", lengths=torch.tensor([6]))
    return True


def test_segment_reduce_bad_arguments_raise():
    harness.run(2, case_bad_arguments_raise, 2)


def case_pyg_segment_readout(seed):
    """PyG's aggregations given `ptr` (graphs of sorted nodes, a batch of graphs split along the nodes) reduce through
    `torch._segment_reduce` when torch_scatter is absent: sum, mean, max and min readouts equal one device."""
    from torch_geometric.nn import aggr
    m = mesh()
    w = m.size()
    x = randn(11, 4, seed=seed).double()
    ptr = torch.tensor([0, 3, 3, 9, 11])   # four graphs, one empty
    lay = ([st.Shard(0)], {0: uneven_extents(11, w, seed)})
    with st.use_strict():
        for a in (aggr.SumAggregation(), aggr.MeanAggregation(), aggr.MaxAggregation(), aggr.MinAggregation()):
            check_op(lambda t: a(t, ptr=ptr), [x], [lay], m, what=f"PyG {type(a).__name__} with ptr")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_pyg_segment_readout(world):
    pytest.importorskip("torch_geometric", reason="PyTorch Geometric is a zoo dependency (tests/requirements-zoo.txt)")
    harness.run(world, case_pyg_segment_readout, world)
