"""Rules that are local along unsharded dims (sort, topk, argsort, cumulative scans, torch.fft, view_as_real,
x.view(dtype)), allclose/equal, reductions of empty tensors raising like torch, host access (tolist, numpy,
data_ptr) pointing to full_tensor()/to_local(), and sync_module with DTensor parameters. Each against the
single-device computation (forward, input gradients), uneven and zero-extent shards, 1-4 ranks, a 2-D mesh;
the refusals raise on every rank without hanging."""
import pytest
import torch
import torch.distributed as dist

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, tiny_extents, uneven_extents


def _lay(shape, dim, w, seed, tiny=False):
    return ([st.Shard(dim)], {0: tiny_extents(shape[dim], w) if tiny else uneven_extents(shape[dim], w, seed)})


def case_sort_topk_scans(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(5, 7, 3, seed=seed)
    lay = _lay(x.shape, 0, w, seed, tiny)
    for name, fn in [
        ("sort", lambda t: t.sort(1)),
        ("sort descending stable", lambda t: torch.sort(t, dim=-1, descending=True, stable=True)),
        ("topk", lambda t: t.topk(3, dim=1)),
        ("topk smallest unsorted", lambda t: torch.topk(t, 2, dim=2, largest=False, sorted=True)),
        ("argsort", lambda t: t.argsort(1)),
        ("msort", lambda t: torch.msort(t.transpose(0, 1)).transpose(0, 1)),
        ("cumprod", lambda t: (t * 0.3 + 1).cumprod(1)),
        ("cummax", lambda t: t.cummax(2)),
        ("cummin", lambda t: t.cummin(1)),
        ("logcumsumexp", lambda t: t.logcumsumexp(1)),
    ]:
        check_op(fn, [x], [lay], m, what=name, expect_placements=[st.Shard(0)])
    # Integer values (no gradient).
    xi = (x * 10).to(torch.int32)
    check_op(lambda t: t.sort(1, descending=True), [xi], [lay], m, grad=False, what="sort int")
    return True


def case_fft(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(5, 8, 6, seed=seed, dtype=torch.float64)
    lay = _lay(x.shape, 0, w, seed, tiny)
    for name, fn in [
        ("fft", lambda t: torch.fft.fft(t, dim=1).abs()),
        ("fft real", lambda t: torch.view_as_real(torch.fft.fft(t, dim=2, norm="ortho"))),
        ("ifft", lambda t: torch.fft.ifft(t, dim=1).real),
        ("rfft", lambda t: torch.view_as_real(torch.fft.rfft(t, dim=1))),
        ("irfft", lambda t: torch.fft.irfft(torch.fft.rfft(t, dim=2), n=6, dim=2)),
        ("fftn", lambda t: torch.fft.fftn(t, dim=(1, 2)).abs()),
        ("rfft2 irfft2", lambda t: torch.fft.irfft2(torch.fft.rfft2(t, dim=(1, 2)) * 0.5, s=(8, 6), dim=(1, 2))),
        ("complex roundtrip", lambda t: torch.view_as_complex(t.reshape(5, 8, 3, 2)).abs()),
    ]:
        check_op(fn, [x], [lay], m, rtol=1e-9, atol=1e-9, what=name)
    out = torch.fft.fft(st.distribute_tensor(x, m, lay[0], sharding_shapes=lay[1]), dim=1)
    assert out.dtype == torch.complex128 and st.placements(out) == (st.Shard(0),)
    return True


def case_view_dtype(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(5, 8, seed=seed)
    # Same element size: any layout.
    for d in (0, 1):
        check_op(lambda t: t.view(torch.int32), [x], [_lay(x.shape, d, w, seed, tiny)], m, grad=False,
                 what=f"view int32 (sharded {d})")
    # Smaller element: the last dim grows; sharded there, the extents scale.
    lay1 = _lay(x.shape, 1, w, seed, tiny)
    # (int16 read back as int32: Gloo moves no int16 tensors)
    out = check_op(lambda t: t.view(torch.int16).int(), [x], [lay1], m, grad=False, what="view int16 sharded last")
    assert st.sharding_shapes(out) == {0: [2 * e for e in lay1[1][0]]}
    check_op(lambda t: t.view(torch.uint8), [x], [_lay(x.shape, 0, w, seed, tiny)], m, grad=False, what="view uint8")
    # Larger element: the last dim shrinks (extents divisible by the ratio).
    even = ([st.Shard(1)], {0: [2 * e for e in uneven_extents(4, w, seed)]})
    check_op(lambda t: t.view(torch.float64), [x], [even], m, grad=False, what="view float64 sharded last")
    # (complex read back as real pairs: Gloo moves no complex tensors)
    check_op(lambda t: torch.view_as_real(t.view(torch.complex64)), [x], [_lay(x.shape, 0, w, seed, tiny)], m,
             grad=False, what="view complex64")
    return True


def case_view_dtype_refused():
    m = mesh()
    # Global size 10 is divisible by the ratio 2; the odd extents are not.
    x = st.distribute_tensor(randn(5, 10), m, [st.Shard(1)], sharding_shapes={0: [1, 8, 1]})
    x.view(torch.float64)


def case_allclose(seed, tiny):
    m = mesh()
    w = m.size()
    x = randn(6, 5, seed=seed)
    lay = _lay(x.shape, 0, w, seed, tiny)
    xs = st.distribute_tensor(x, m, lay[0], sharding_shapes=lay[1])
    near = xs + 1e-7
    assert torch.allclose(xs, near) is True
    assert torch.allclose(xs, x) is True  # one operand plain
    rows = st.distribute_tensor(x[:1].expand(6, 5).contiguous(), m, lay[0], sharding_shapes=lay[1])
    assert torch.allclose(x[0], rows) is True and torch.allclose(x[1], rows) is False  # broadcasting
    # One element far off on one rank only: every rank answers False.
    y = x.clone()
    y[5, 4] += 1.0
    assert torch.allclose(xs, y) is False
    assert torch.allclose(xs, st.distribute_tensor(y, m, [st.Shard(1)])) is False
    assert torch.allclose(xs, y, atol=2.0) is True
    nan = x.clone()
    nan[0, 0] = float("nan")
    ns = st.distribute_tensor(nan, m, lay[0], sharding_shapes=lay[1])
    assert torch.allclose(ns, nan) is False and torch.allclose(ns, nan, equal_nan=True) is True
    assert torch.equal(xs, x) is True and torch.equal(xs, y) is False
    assert torch.equal(xs, xs[:3]) is False
    return True


def case_allclose_dtype():
    m = mesh()
    xs = st.distribute_tensor(randn(4, 3), m, [st.Shard(0)])
    torch.allclose(xs, xs.double())


def case_empty_reduction(op, shape, dim):
    m = mesh()
    x = st.distribute_tensor(torch.zeros(shape), m, [st.Shard(dim)])
    fn = {"max": lambda t: t.max(), "min": lambda t: t.min(), "argmax": lambda t: t.argmax(),
          "argmin": lambda t: t.argmin(), "max0": lambda t: t.max(0), "min1": lambda t: t.min(1),
          "amax0": lambda t: t.amax(0), "amin": lambda t: t.amin(), "argmax0": lambda t: t.argmax(0),
          "argmin1": lambda t: t.argmin(1, keepdim=True)}[op]
    try:
        fn(torch.zeros(shape))
    except Exception as e:
        want = e
    else:
        raise AssertionError(f"{op} on {shape} does not raise on one device")
    try:
        fn(x)
    except type(want) as e:
        assert str(e) == str(want), f"{e} != {want}"
        raise
    raise AssertionError(f"{op} on an empty ShardTensor did not raise")


def case_zero_extent_reductions(seed):
    """Ranks with zero-extent shards of a non-empty tensor (and empty non-reduced dims) still reduce."""
    m = mesh()
    w = m.size()
    x = randn(2, 3, seed=seed)
    ext = [0] * (w - 2) + [1, 1] if w >= 2 else [2]
    lay = ([st.Shard(0)], {0: ext})
    for name, fn in [("max", lambda t: t.max()), ("min", lambda t: t.min()), ("argmax", lambda t: t.argmax()),
                     ("argmin 0", lambda t: t.argmin(0)), ("max 0", lambda t: t.max(0)), ("amax 0", lambda t: t.amax(0)),
                     ("amin", lambda t: t.amin()), ("min 1", lambda t: t.min(1))]:
        check_op(fn, [x], [lay], m, grad=not name.startswith("arg"), what=name)
    e = torch.zeros(4, 0)
    for name, fn in [("amax 0 of [4, 0]", lambda t: t.amax(0)), ("max 0 of [4, 0]", lambda t: t.max(0)),
                     ("argmax 0 of [4, 0]", lambda t: t.argmax(0))]:
        check_op(fn, [e], [_lay(e.shape, 0, w, seed)], m, grad=False, what=name)
    return True


def case_host_access(what):
    m = mesh()
    x = st.distribute_tensor(randn(4, 3), m, [st.Shard(0)])
    if what == "np.asarray":
        import numpy as np

        np.asarray(x)
    getattr(x, what)()


def case_host_access_plain_and_remedies():
    m = mesh()
    x = randn(4, 3)
    xs = st.distribute_tensor(x, m, [st.Shard(0)])
    assert xs.full_tensor().tolist() == x.tolist()
    assert (xs.to_local().numpy() == st.to_local(xs).numpy()).all()
    assert x.data_ptr() != 0 and isinstance(x.numpy(), type(x.numpy()))
    try:
        xs.data_ptr()
    except RuntimeError as e:  # still what PyTorch raised before, for code that catches it
        assert isinstance(e, TypeError)
    # Where no shard stands in the way the values come back: a replicated tensor (each rank's local tensor is the
    # whole tensor, no communication) and one element (a collective where it is sharded or a pending sum, as item()).
    import numpy as np

    xr = st.distribute_tensor(x, m, [st.Replicate()])
    assert xr.tolist() == x.tolist() and (xr.numpy() == x.numpy()).all() and (np.asarray(xr) == x.numpy()).all()
    total = xs.sum()  # Partial(sum)
    assert abs(total.tolist() - x.sum().item()) < 1e-5 and abs(float(total.numpy()) - x.sum().item()) < 1e-5
    one = st.distribute_tensor(x[:1, :1].contiguous(), m, [st.Shard(0)])  # one rank holds the element
    assert one.tolist() == x[:1, :1].tolist() and (one.numpy() == x[:1, :1].numpy()).all()
    assert xs.long().sum(0, keepdim=True)[:, :1].tolist() == x.long().sum(0, keepdim=True)[:, :1].tolist()
    return True


def case_sync_module_dtensor(seed):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    m = mesh()
    r = dist.get_rank()
    lin = torch.nn.Linear(3, 4)
    with torch.no_grad():
        lin.weight.fill_(float(r))  # differs per rank until synced
    full_w = torch.arange(8.0).view(8, 1)
    dt = distribute_tensor(full_w, m, [Shard(0)])
    with torch.no_grad():
        dt.to_local().add_(100 * r)  # rank-specific shard contents that a broadcast would overwrite
    lin.register_parameter("dt", torch.nn.Parameter(dt))
    lin.register_buffer("dbuf", distribute_tensor(torch.ones(4), m, [Shard(0)]) * (r + 1))
    before = lin.dt.to_local().clone(), lin.dbuf.to_local().clone()
    st.sync_module(lin, m)
    assert isinstance(lin.dt, DTensor)
    assert torch.equal(lin.dt.to_local(), before[0]), "sync_module overwrote a DTensor parameter's shard"
    assert torch.equal(lin.dbuf.to_local(), before[1]), "sync_module overwrote a DTensor buffer's shard"
    assert torch.equal(lin.weight, torch.zeros(4, 3)), "plain parameter not broadcast from rank 0"
    return True


def case_sharded_dim_refused(op):
    pairs = st.distribute_tensor(randn(5, 4, 2), mesh(), [st.Shard(2)])
    # FFTs along a sharded dim move the shard to another dim (test_fft_sharded.py), or run the four-step / Bluestein
    # along a 1-D signal (test_fft_sharded.py::test_four_step); a matrix split along both its dims on a 2x2 mesh and
    # transformed along both has no dim for either shard.
    matrix = st.distribute_tensor(randn(5, 6), mesh((2, 2)), [st.Shard(0), st.Shard(1)]) if op != "view_as_complex" else None
    # strict: the rules' refusals, not the gather-compute fallback they would run otherwise (test_fallback.py)
    with st.use_strict():
        _sharded_dim_op(op, pairs, matrix)


def _sharded_dim_op(op, pairs, matrix):
    {"fft": lambda: torch.fft.fft2(matrix), "rfft": lambda: torch.fft.rfft2(matrix),
     "fftn": lambda: torch.fft.fftn(matrix),
     "view_as_complex": lambda: torch.view_as_complex(pairs)}[op]()


def case_sort_sharded_dim(seed, tiny):
    """sort / argsort / msort along the sharded dim: a distributed sort (the sorted blocks round the ring, then each
    element to the owner of its position), the result laid out like the input; values, stable indices (ties, NaN,
    -0.0 and 0.0, descending), integer and bool inputs, the gradient (the inverse permutation, routed home)."""
    m = mesh()
    w = m.size()
    x = randn(3, 11, 2, seed=seed)
    x[0, 3, 0] = float("nan")
    x[0, 7, 1] = float("nan")
    x[1, :5, 1] = 0.5  # ties across ranks
    x[2, 5, 0], x[2, 6, 0], x[2, 1, 0] = -0.0, 0.0, float("-inf")
    ext = tiny_extents(11, w) if tiny else uneven_extents(11, w, seed)
    lay = ([st.Shard(1)], {0: ext})
    ints = torch.randint(-3, 4, (3, 11), generator=torch.Generator().manual_seed(seed))
    with st.use_strict():
        for desc in (False, True):
            xs = st.distribute_tensor(x, m, *lay)
            before = dict(st.comm_stats()["calls"])
            v, i = torch.sort(xs, dim=1, descending=desc, stable=True)
            after = st.comm_stats()["calls"]
            kinds = {k for k in after if after[k] != before.get(k, 0)}
            assert kinds <= {"ring_pass", "all_gather", "all_to_all"}, kinds  # nothing gathers the dim
            assert st.placements(v) == (st.Shard(1),) and st.sharding_shapes(v) == {0: ext}, st.sharding_shapes(v)
            rv, ri = torch.sort(x, dim=1, descending=desc, stable=True)
            assert torch.equal(full(i), ri), f"stable indices, descending={desc}"
            torch.testing.assert_close(full(v), rv, equal_nan=True)
            for t in (ints, ints > 0):
                ts = st.distribute_tensor(t, m, [st.Shard(1)], sharding_shapes={0: ext})
                tv, ti = torch.sort(ts, dim=1, descending=desc, stable=True)
                rv, ri = torch.sort(t, dim=1, descending=desc, stable=True)
                assert torch.equal(full(tv), rv) and torch.equal(full(ti), ri), (t.dtype, desc)
        y = randn(3, 11, 2, seed=seed + 1)
        check_op(lambda t: torch.sort(t, dim=1)[0], [y], [lay], m, what="sort values and gradient")
        check_op(lambda t: torch.sort(t, dim=1, descending=True)[0] * 2, [y], [lay], m, what="descending gradient")
        check_op(lambda t: torch.argsort(t, dim=1), [y], [lay], m, grad=False, what="argsort")
        check_op(lambda t: torch.msort(t.transpose(0, 1)), [y], [lay], m, what="msort")
    return True


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, False), (3, True), (4, True)])
def test_sort_sharded_dim(world, tiny):
    harness.run(world, case_sort_sharded_dim, world, tiny)


def case_order_statistics(seed, tiny):
    """kthvalue / median / nanmedian along the sharded dim (the distributed sort, then each slice's element from its
    owner) and along unsharded dims (local); NaN rows, keepdim, values and gradients. Indices are compared where
    torch defines them (no ties, no NaN). mode along the sharded dim (re-laid out whole) and along unsharded dims."""
    m = mesh()
    w = m.size()
    ext = tiny_extents(11, w) if tiny else uneven_extents(11, w, seed)
    lay = ([st.Shard(1)], {0: ext})
    x = randn(3, 11, 2, seed=seed)
    with st.use_strict():
        for fn, what in [(lambda t: torch.kthvalue(t, 4, dim=1), "kthvalue 4"),
                         (lambda t: torch.kthvalue(t, 11, dim=1, keepdim=True), "kthvalue 11 keepdim"),
                         (lambda t: torch.median(t, dim=1), "median"),
                         (lambda t: torch.nanmedian(t, dim=1, keepdim=True), "nanmedian"),
                         (lambda t: torch.median(t, dim=2), "median along an unsharded dim"),
                         (lambda t: torch.kthvalue(t, 2, dim=0), "kthvalue along an unsharded dim"),
                         (lambda t: torch.median(t), "median of every element"),
                         (lambda t: torch.nanmedian(t), "nanmedian of every element")]:
            out = check_op(fn, [x], [lay], m, what=what)
        out = check_op(lambda t: torch.kthvalue(t, 2, dim=0), [x], [lay], m, what="kthvalue dim 0")
        assert st.placements(out[0]) == (st.Shard(0),), st.placements(out[0])  # dim 1 became dim 0
        # mode: each slice along dim 1 holds one value 6 times (a unique most frequent value, so indices and the
        # gradient are torch's). Along the sharded dim the input is re-laid out with dim 1 whole and dim 0 split
        # (one all-to-all), then the local op; along an unsharded dim, local.
        g = torch.Generator().manual_seed(seed)
        xm = torch.randint(0, 5, (3, 11, 2), generator=g).to(torch.float32)
        for i in range(3):
            for j in range(2):
                xm[i, torch.randperm(11, generator=g)[:6], j] = float(i + 2 * j)
        xms = st.distribute_tensor(xm, m, *lay)
        st.reset_comm_stats()
        got = torch.mode(xms, dim=1)
        assert st.comm_stats()["calls"] == ({"all_to_all": 1} if w > 1 else {}), st.comm_stats()["calls"]
        if w > 1:
            assert st.placements(got.values) == (st.Shard(0),), st.placements(got.values)
        check_op(lambda t: torch.mode(t, dim=1), [xm], [lay], m, what="mode along the sharded dim")
        check_op(lambda t: torch.mode(t, dim=-1, keepdim=True), [xm], [lay], m, what="mode along an unsharded dim")
        if w > 1:
            with pytest.raises(NotImplementedError, match="mode along sharded dim 0"):
                torch.mode(st.distribute_tensor(xm[:, 0, 0], m, [st.Shard(0)]))
        y = x.clone()
        y[0, 2, 0] = y[1, :, 1] = y[2, 9, 1] = float("nan")
        ys = st.distribute_tensor(y, m, *lay)
        for name, fn in [("median", lambda t: torch.median(t, dim=1)), ("nanmedian", lambda t: torch.nanmedian(t, dim=1)),
                         ("kthvalue", lambda t: torch.kthvalue(t, 6, dim=1))]:
            got, ref = fn(ys), fn(y)
            torch.testing.assert_close(full(got.values), ref.values, equal_nan=True, msg=name)
            if name == "median":  # the first NaN, as torch's median reports
                assert torch.equal(full(got.indices), ref.indices), (name, full(got.indices), ref.indices)
            if name == "nanmedian":  # an all-NaN slice's index is torch's choice
                some = ~torch.isnan(ref.values)
                assert torch.equal(full(got.indices)[some], ref.indices[some]), (full(got.indices), ref.indices)
    return True


@pytest.mark.parametrize("world,tiny", [(1, False), (2, False), (3, True)])
def test_order_statistics(world, tiny):
    harness.run(world, case_order_statistics, world, tiny)


def case_sort_sharded_dim_2d(seed):
    """The sorted dim on one mesh dim, another dim on the other: each row group sorts within its mesh dim."""
    m = mesh((2, 2), ("a", "b"))
    x = randn(5, 9, 3, seed=seed)
    lay = ([st.Shard(0), st.Shard(1)], {0: uneven_extents(5, 2, seed), 1: [0, 9]})
    lay2 = ([st.Shard(1), st.Shard(2)], {0: [4, 5], 1: [2, 1]})
    with st.use_strict():
        check_op(lambda t: torch.sort(t, dim=1)[0], [x], [lay], m, what="2-D mesh, a coordinate without rows")
        check_op(lambda t: torch.sort(t, dim=1, descending=True)[0], [x], [lay2], m, what="2-D mesh sort")
    return True


def test_sort_sharded_dim_2d():
    harness.run(4, case_sort_sharded_dim_2d, 4)


def case_sort_then_loss_strides(seed):
    """The sorted values keep torch's layout (its input's strides) on every rank, also a rank without rows of the
    sorted dim: a sort of the classes (split [3, 0]) with H split on the other mesh dim, then cross_entropy. The
    sorted block was a moved-dim view on the ranks holding classes and contiguous on the others, so nll_loss2d's
    backward raised on two ranks while the other two waited in log_softmax's backward (found by fuzz_nets.py
    --family stats, seed 350)."""
    import torch.nn.functional as F
    m = mesh((2, 2), ("a", "b"))
    x = randn(1, 3, 10, 10, seed=seed)
    target = randn(1, 3, 10, 10, seed=seed + 1).argmax(1)
    lay = ([st.Shard(1), st.Shard(2)], {0: [3, 0], 1: [5, 5]})
    xs = st.distribute_tensor(x, m, lay[0], sharding_shapes=lay[1])
    v = torch.sort(xs, 1, descending=True).values
    assert v.to_local().stride() == v.to_local().contiguous().stride(), v.to_local().stride()
    assert F.log_softmax(v, 1).to_local().is_contiguous()
    with st.use_strict():
        check_op(lambda t: F.cross_entropy(torch.sort(t, 1, descending=True).values, target, label_smoothing=0.1,
                                           reduction="sum"), [x], [lay], m, what="sort of split classes, then loss")
    return True


def test_sort_then_loss_strides():
    harness.run(4, case_sort_then_loss_strides, 4)


def case_topk_sharded_dim(seed):
    """topk along the sharded dim: each rank's own top k merged in one collective (k candidates per rank), the
    result whole along the dim; the gradient scatters into each rank's own rows."""
    m = mesh()
    w = m.size()
    x = randn(3, 11, 4, seed=seed)
    for ext in (uneven_extents(11, w, seed), tiny_extents(11, w)):
        lay = ([st.Shard(1)], {0: ext})
        for k, largest in ((1, True), (4, True), (5, False), (11, True)):
            xs = st.distribute_tensor(x, m, *lay)
            st.reset_comm_stats()
            with st.use_strict():
                v, i = torch.topk(xs, k, dim=1, largest=largest)
            calls = sum(st.comm_stats()["calls"].values())
            assert calls == (1 if w > 1 else 0), f"topk k={k}: {st.comm_stats()['calls']}"
            assert st.placements(v) == (st.Replicate(),), st.placements(v)
            ref_v, ref_i = torch.topk(x, k, dim=1, largest=largest)
            close(full(v), ref_v, what=f"topk k={k} values")
            assert torch.equal(full(i), ref_i), f"topk k={k} indices"
            with st.use_strict():
                check_op(lambda t: torch.topk(t, k, dim=1, largest=largest).values, [x], [lay], m,
                         what=f"topk k={k} largest={largest} ext={ext}")
    # Other dims sharded beside it, and the gradient's layout: the input's.
    if w >= 2:
        m2 = mesh((2, w // 2), ("a", "b")) if w % 2 == 0 and w > 2 else None
        if m2 is not None:
            lay2 = ([st.Shard(1), st.Shard(0)], {0: uneven_extents(11, 2, seed), 1: uneven_extents(3, w // 2, seed)})
            with st.use_strict():
                check_op(lambda t: torch.topk(t, 3, dim=1).values.square(), [x], [lay2], m2, what="topk 2-D mesh")
    # k larger than the dim: torch's own error on every rank.
    xs = st.distribute_tensor(x, m, [st.Shard(1)])
    try:
        torch.topk(xs, 12, dim=1)
    except ValueError as e:
        assert "out of range" in str(e), e
    else:
        raise AssertionError("topk with k > size did not raise")
    return True


def case_cum_extremes_sharded_dim(seed):
    """cummax / cummin along the sharded dim: each rank's own scan with the lower ranks' carry (one collective),
    ties taking the later index and NaN sticking as on one device; the gradient reaches the carry's row on its
    owner (one collective of per-slice sums)."""
    m = mesh()
    w = m.size()
    x = randn(3, 13, 2, seed=seed)
    x[0, 5] = 4.0            # a running max that later elements tie
    x[0, 9] = 4.0
    x[1, 7:] = -5.0          # a long carried stretch for cummax (its gradient goes to one row)
    x[2, 2] = float("nan")   # NaN sticks
    x[2, 11] = float("nan")
    for ext in (uneven_extents(13, w, seed), tiny_extents(13, w)):
        lay = ([st.Shard(1)], {0: ext})
        xs = st.distribute_tensor(x, m, *lay)
        for name in ("cummax", "cummin"):
            st.reset_comm_stats()
            with st.use_strict():
                v, i = getattr(torch, name)(xs, dim=1)
            assert sum(st.comm_stats()["calls"].values()) == (1 if w > 1 else 0), st.comm_stats()["calls"]
            rv, ri = getattr(torch, name)(x, dim=1)
            close(full(v), rv, equal_nan=True, what=f"{name} values {ext}")
            assert torch.equal(full(i), ri), f"{name} indices {ext}: {full(i)} vs {ri}"
            finite = x.nan_to_num(0.0)  # gradients against one device without NaN (it would poison every check)
            with st.use_strict():
                check_op(lambda t: getattr(torch, name)(t, dim=1).values * 1.5, [finite], [lay], m,
                         what=f"{name} grad {ext}")
    if w >= 2 and w % 2 == 0:
        m2 = mesh((2, w // 2), ("a", "b"))
        lay2 = ([st.Shard(1), st.Shard(0)], {0: uneven_extents(13, 2, seed), 1: uneven_extents(3, w // 2, seed)})
        with st.use_strict():
            check_op(lambda t: torch.cummax(t, 1).values, [x.nan_to_num(0.0)], [lay2], m2, what="cummax 2-D mesh")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cum_extremes_sharded_dim(world):
    harness.run(world, case_cum_extremes_sharded_dim, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_topk_sharded_dim(world):
    harness.run(world, case_topk_sharded_dim, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sort_topk_scans(world):
    harness.run(world, case_sort_topk_scans, world, world >= 3)


def test_sort_2d_mesh():
    harness.run(4, case_sort_2d_mesh, 3)


def case_sort_2d_mesh(seed):
    m = mesh((2, 2), ("a", "b"))
    x = randn(6, 5, 4, seed=seed)
    lay = ([st.Shard(0), st.Shard(2)], {0: uneven_extents(6, 2, seed), 1: [0, 4]})
    check_op(lambda t: t.sort(1), [x], [lay], m, what="2-D sort", expect_placements=[st.Shard(0), st.Shard(2)])
    check_op(lambda t: t.topk(2, 1), [x], [lay], m, what="2-D topk")
    check_op(lambda t: torch.fft.fft(t.double(), dim=1).abs(), [x], [lay], m, rtol=1e-9, atol=1e-9, what="2-D fft")
    out = check_op(lambda t: t.view(torch.float64), [x], [lay], m, grad=False, what="2-D view float64")
    assert st.sharding_shapes(out)[1] == [0, 2]
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fft(world):
    harness.run(world, case_fft, world, world == 4)


@pytest.mark.parametrize("op", ["fft", "rfft", "fftn", "view_as_complex"])
def test_sort_fft_sharded_dim_refused(op):
    errors = harness.expect_error(2 if op == "view_as_complex" else 4, case_sharded_dim_refused, op,
                                  kinds=("NotImplementedError",))
    for _, msg, _ in errors.values():
        assert "sharded dim" in msg and "Replicate()" in msg, msg


@pytest.mark.parametrize("world", [1, 2, 3])
def test_view_dtype(world):
    harness.run(world, case_view_dtype, world, world == 3)


def test_view_dtype_refused():
    harness.expect_error(3, case_view_dtype_refused, kinds=("NotImplementedError",), match="multiples of 2")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_allclose_equal(world):
    harness.run(world, case_allclose, world, world == 3)


def test_allclose_dtype_mismatch_raises():
    harness.expect_error(2, case_allclose_dtype, kinds=("RuntimeError",), match="Float did not match Double")


@pytest.mark.parametrize("op,shape,dim", [
    ("max", (0, 3), 0), ("min", (3, 0), 0), ("argmax", (0, 3), 1), ("argmin", (0, 3), 0), ("max0", (0, 3), 0),
    ("min1", (3, 0), 0), ("amax0", (0, 3), 1), ("amin", (0, 3), 0), ("argmax0", (0, 3), 0), ("argmin1", (4, 0), 0),
])
def test_empty_reduction_raises_like_torch(op, shape, dim):
    errors = harness.expect_error(3, case_empty_reduction, op, shape, dim, kinds=("IndexError", "RuntimeError"))
    assert len({kind for kind, _, _ in errors.values()}) == 1


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero_extent_reductions(world):
    harness.run(world, case_zero_extent_reductions, world)


@pytest.mark.parametrize("what", ["tolist", "numpy", "data_ptr", "np.asarray"])
def test_host_access_points_to_full_tensor(what):
    errors = harness.expect_error(2, case_host_access, what, kinds=("ShardTensorHostAccessError",))
    for _, msg, _ in errors.values():
        assert "full_tensor()" in msg and "to_local()" in msg, msg


def test_host_access_remedies():
    harness.run(2, case_host_access_plain_and_remedies)


@pytest.mark.parametrize("world", [2, 3])
def test_sync_module_skips_dtensor(world):
    harness.run(world, case_sync_module_dtensor, world)


def case_integral_mean_and_softmax(what):
    """Sharded reductions and softmax refuse the dtypes torch refuses, with torch's message (the sharded formulas,
    a sum then a division, exp then a sum, would otherwise return a value)."""
    m = mesh()
    x = st.distribute_tensor(torch.arange(12).reshape(6, 2), m, [st.Shard(0)])
    if what == "mean":
        x.mean()
    elif what == "mean_bool":
        x.bool().mean(0)
    elif what == "mean_dtype":
        x.float().mean(0, dtype=torch.int64)
    else:
        torch.softmax(x, 0)


@pytest.mark.parametrize("what,match", [("mean", "Input dtype must be either a floating point or complex dtype"),
                                        ("mean_bool", "Got: Bool"), ("mean_dtype", "Optional dtype must be"),
                                        ("softmax", "not implemented for 'Long'")])
def test_integral_mean_and_softmax_raise_like_torch(what, match):
    harness.expect_error(2, case_integral_mean_and_softmax, what, match=match)


def case_assert_async(fail):
    """torch._assert_async on a value reduced over a split dim (a pending sum, as kornia's checks write it) and on a
    one-element split tensor: a rule, no fallback (strict mode); a false condition raises on every rank alike."""
    m = mesh()
    w = m.size()
    x = randn(7, 3, seed=1)
    xs = st.distribute_tensor(x, m, [st.Shard(0)], sharding_shapes={0: uneven_extents(7, w, 1)})
    with st.use_strict():
        total = xs.abs().sum()        # a pending sum until completed
        torch._assert_async(total > 0)
        torch._assert_async(total > (1e9 if fail == "msg" else 0), "sum must be positive")
        one = st.distribute_tensor(torch.tensor([1.0]), m, [st.Shard(0)])
        torch._assert_async(one if fail != "split" else one - 1)
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_assert_async(world):
    harness.run(world, case_assert_async, "")


@pytest.mark.parametrize("fail,match", [("msg", "sum must be positive"), ("split", "Expected Tensor with single "
                                                                                  "nonzero value, but got zero")])
def test_assert_async_false_raises_everywhere(fail, match):
    harness.expect_error(3, case_assert_async, fail, kinds=("RuntimeError",), match=match)
