"""Reductions over sharded and unsharded dims, keepdim, uneven and zero-extent shards, 1-D and 2-D meshes,
against the single-device computation (values, indices, gradients)."""
import pytest
import torch

import harness
import shardtensor as st
from cases_util import LargestPlain, check_op, close, full, mesh, randn, uneven_extents


def _lay(shape, dim, w, seed):
    return ([st.Shard(dim)], {0: uneven_extents(shape[dim], w, seed)})


def case_reductions(dim_sharded, seed):
    m = mesh()
    w = m.size()
    x = randn(5, 7, 3, seed=seed)
    lay = _lay(x.shape, dim_sharded, w, seed)
    for name, fn in [
        ("sum", lambda t: t.sum()),
        ("sum dim", lambda t: t.sum(1)),
        ("sum dims keepdim", lambda t: t.sum((0, 2), keepdim=True)),
        ("mean", lambda t: t.mean()),
        ("mean dim", lambda t: t.mean(dim=(0, 1))),
        ("amax", lambda t: t.amax(1)),
        ("amin keepdim", lambda t: t.amin((0, 1), keepdim=True)),
        ("prod", lambda t: (t * 0.5 + 1).prod(1)),
        ("var", lambda t: t.var(1)),
        ("std keepdim", lambda t: t.std(dim=(0, 1), keepdim=True)),
        ("var unbiased=False", lambda t: t.var(unbiased=False)),
        ("var_mean", lambda t: torch.var_mean(t, dim=0)),
        ("norm", lambda t: t.norm()),
        ("norm p=1 dim", lambda t: torch.linalg.vector_norm(t, 1, dim=1)),
        ("norm inf", lambda t: torch.linalg.vector_norm(t, float("inf"), dim=(0, 1))),
    ]:
        check_op(fn, [x], [lay], m, rtol=1e-5, atol=1e-5, what=name)
    for name, fn in [("max dim", lambda t: t.max(1)), ("min dim keepdim", lambda t: t.min(0, keepdim=True)),
                     ("max", lambda t: t.max()), ("argmax dim", lambda t: t.argmax(1)),
                     ("argmin", lambda t: t.argmin()), ("all", lambda t: (t > -3).all(1)),
                     ("any", lambda t: (t > 1.5).any())]:
        check_op(fn, [x], [lay], m, grad=name.startswith("max") or name.startswith("min"), what=name)
    # NaN-ignoring sums and non-zero counts (strict: rules, a Partial sum over the sharded dims).
    xn = x.clone()
    xn[0, 1, 0] = xn[4, 6, 2] = xn[2, 3, 1] = float("nan")
    xz = x.clone()
    xz[x.abs() < 0.5] = 0
    with st.use_strict():
        for name, fn, inp, grad in [("nansum", lambda t: t.nansum(), xn, True),
                                    ("nansum dim", lambda t: torch.nansum(t, 1), xn, True),
                                    ("nanmean dims", lambda t: t.nanmean((0, 2)), xn, True),
                                    ("count_nonzero", lambda t: torch.count_nonzero(t), xz, False),
                                    ("count_nonzero dims", lambda t: torch.count_nonzero(t, (0, 1)), xz, False),
                                    ("aminmax", lambda t: torch.aminmax(t), x, False),
                                    ("aminmax dim keepdim", lambda t: torch.aminmax(t, dim=dim_sharded, keepdim=True),
                                     x, False),
                                    ("aminmax other dim", lambda t: torch.aminmax(t, dim=2 - dim_sharded), x, False),
                                    # torch's boolean checks (transformers' time-series models check lag indices)
                                    ("_is_all_true", lambda t: torch._is_all_true(t > -3), x, False),
                                    ("_is_all_true false", lambda t: torch._is_all_true(t > 0), x, False),
                                    ("_is_any_true", lambda t: torch._is_any_true(t > 1.5), x, False),
                                    ("_is_any_true false", lambda t: torch._is_any_true(t > 99), x, False)]:
            check_op(fn, [inp], [lay], m, grad=grad, rtol=1e-5, atol=1e-5, what=name)
    return True


def case_stable_variance(seed):
    """Large means: the parallel formula must not cancel catastrophically."""
    m = mesh()
    x = (randn(64, 3, seed=seed) + 1e4).float()
    lay = _lay(x.shape, 0, m.size(), seed)
    check_op(lambda t: t.var(0), [x], [lay], m, rtol=1e-4, atol=1e-3, what="var large mean")
    check_op(lambda t: t.std(0, correction=0), [x], [lay], m, rtol=1e-4, atol=1e-3, what="std large mean")
    return True


def case_ties_indices(seed):
    """Ties across ranks: the first global index wins, as on one device."""
    m = mesh()
    x = torch.zeros(6, 2)
    x[1], x[4] = 5.0, 5.0
    check_op(lambda t: t.max(0), [x], [_lay(x.shape, 0, m.size(), seed)], m, grad=False, what="ties")
    check_op(lambda t: t.argmax(0), [x], [_lay(x.shape, 0, m.size(), seed)], m, grad=False, what="argmax ties")
    # a mask's max with its index along the sharded dim (the first True: cumprod's gradient looks for the first zero)
    b = torch.zeros(6, 3, dtype=torch.bool)
    b[2, 0] = b[4, 0] = b[5, 1] = True
    check_op(lambda t: t.max(0), [b], [_lay(b.shape, 0, m.size(), seed)], m, grad=False, what="bool max")
    check_op(lambda t: t.min(0), [b], [_lay(b.shape, 0, m.size(), seed)], m, grad=False, what="bool min")
    return True


def case_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(6, 5, 4, seed=seed)
    lay = ([st.Shard(0), st.Shard(1)], {0: uneven_extents(6, 2, seed), 1: uneven_extents(5, 2, seed + 1)})
    for name, fn in [("sum", lambda t: t.sum()), ("mean 0", lambda t: t.mean(0)), ("var 01", lambda t: t.var((0, 1))),
                     ("amax 1", lambda t: t.amax(1)), ("max 0", lambda t: t.max(0))]:
        check_op(fn, [x], [lay], m, rtol=1e-5, atol=1e-5, what=f"2-D {name}")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dim_sharded", [0, 1])
def test_reductions(world, dim_sharded):
    harness.run(world, case_reductions, dim_sharded, world + dim_sharded)


@pytest.mark.parametrize("world", [2, 3])
def test_stable_variance(world):
    harness.run(world, case_stable_variance, world)


@pytest.mark.parametrize("world", [2, 4])
def test_ties_indices(world):
    harness.run(world, case_ties_indices, world)


def test_2d_mesh():
    harness.run(4, case_2d_mesh, 1)


def case_sum_of_partial_max(seed):
    """amax over the sharded dim leaves a pending max; summing or averaging it completes the max first (a sum of
    pending maxima would be wrong), forward and gradient."""
    m = mesh()
    x = randn(4, 9, 3, seed=seed)
    lay = _lay(x.shape, 1, m.size(), seed)
    check_op(lambda t: t.amax(1).sum(), [x], [lay], m, rtol=1e-5, atol=1e-5, what="sum of amax")
    check_op(lambda t: t.amin(1).mean(0), [x], [lay], m, rtol=1e-5, atol=1e-5, what="mean of amin")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_sum_of_partial_max(world):
    harness.run(world, case_sum_of_partial_max, world)


def case_selection_grad_divided(seed):
    """The gradient of max / min with indices and topk over a sharded dim (PointNet's global max pool over the
    points) scatters into each rank's own rows: right values, and no rank allocates a tensor whole along the dim."""
    m = mesh()
    w = m.size()
    x = randn(2, 5, 12, seed=seed)
    lay = ([st.Shard(2)], {0: uneven_extents(12, w, seed)})
    fns = {
        "max": lambda t: t.max(dim=2).values,
        "max keepdim": lambda t: torch.max(t, 2, keepdim=True)[0],
        "min": lambda t: t.min(dim=-1).values,
        "topk": lambda t: t.topk(3, dim=2).values,
    }
    for name, fn in fns.items():
        check_op(fn, [x], [lay], m, what=name)
        xs = st.distribute_tensor(x, m, *lay).requires_grad_()
        y = fn(xs)
        with LargestPlain() as watch:
            y.sum().backward()
        largest_shard = 2 * 5 * max(lay[1][0])
        if w > 1:
            assert watch.numel <= largest_shard, f"{name}: the backward allocated {watch.numel} elements"
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_selection_grad_divided(world):
    harness.run(world, case_selection_grad_divided, world)
