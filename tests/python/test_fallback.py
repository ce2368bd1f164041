"""The gather-compute fallback: functional ops without a domain-parallel rule (or whose rule declines) run on the
full tensors, forward and backward, against one device; its layouts, warning, communication count and strict mode;
what it must refuse (views, in-place, out=, random ops)."""
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import harness
import shardtensor as st
from cases_util import check_op, close, full, mesh, randn, shard_of, uneven_extents


def _sharded(n, k, dim, seed=0):
    return ([st.Shard(dim)], {0: uneven_extents(n, k, seed)})


def _fallback_warnings(record, op):
    return [w for w in record if "ShardTensor: " + op in str(w.message) and "ran on the full tensors" in str(w.message)]


# ---- the long tail, forward and backward against one device ----

def case_median(world):
    m = mesh()
    x = randn(7, 5, seed=1)
    lay = _sharded(7, world, 0, seed=1)
    # values and (global) indices along the sharded dim; the backward goes through the index rules
    out = check_op(lambda t: torch.median(t, dim=0), [x], [lay], m, what="median.dim")
    for o in out:
        assert st.placements(o) == (st.Replicate(),), st.placements(o)
    check_op(lambda t: torch.median(t, dim=1, keepdim=True), [x], [lay], m, what="median.dim keepdim")
    check_op(lambda t: torch.median(t), [x], [lay], m, what="median")
    check_op(lambda t: torch.nanmedian(t, dim=0).values, [x], [lay], m, what="nanmedian")
    check_op(lambda t: torch.kthvalue(t, 3, dim=0), [x], [lay], m, what="kthvalue")


def case_quantile(world):
    """quantile decomposes into sort along the dim (a distributed sort along a sharded dim, its outputs laid out like
    the input), gather and lerp, then in-place views of the result (unsqueeze_/transpose_/squeeze_): all rules."""
    m = mesh()
    x = randn(9, 4, seed=2)
    q = torch.tensor([0.1, 0.5, 0.9])
    lay = _sharded(9, world, 0, seed=2)
    xs = shard_of(x, m, *lay)
    values, indices = torch.sort(xs, dim=0)
    assert st.placements(values) == (st.Shard(0),) and st.sharding_shapes(values) == st.sharding_shapes(xs)
    close(full(indices), torch.sort(x, dim=0).indices, what="sort indices")
    check_op(lambda t: torch.quantile(t, q, dim=0), [x], [lay], m, what="quantile dim 0")
    check_op(lambda t: torch.quantile(t, 0.3, dim=0, keepdim=True, interpolation="midpoint"), [x], [lay], m,
             what="quantile midpoint")


def case_cdist(world):
    """cdist with its feature dim sharded: no longer a fallback (the split moves to the rows first; a distance is not
    a sum of per-rank terms for every p): test_vector_ops.py::test_cdist has the rule's cases; here the layouts the
    fallback used to take."""
    m = mesh()
    x1, x2 = randn(7, 3, seed=3), randn(5, 3, seed=4)
    lay = _sharded(3, world, 1, seed=3)
    for p in (1.0, 2.0, 3.0):
        out = check_op(lambda a, b: torch.cdist(a, b, p=p), [x1, x2], [lay, None], m, what=f"cdist p={p}")
        assert st.placements(out) == (st.Shard(0),), st.placements(out)
    check_op(lambda a, b: torch.cdist(a, b), [x1, x2], [lay, _sharded(3, world, 1, seed=5)], m, what="cdist both")


def case_unique(world):
    m = mesh()
    x = torch.tensor([[3, 1, 2, 3, 1], [0, 2, 2, 5, 3], [3, 1, 2, 3, 1], [4, 4, 0, 0, 1], [0, 2, 2, 5, 3],
                      [7, 1, 7, 1, 7], [3, 1, 2, 3, 1]])
    xs = shard_of(x, m, *_sharded(7, world, 0, seed=8))
    values, inverse, counts = torch.unique(xs, return_inverse=True, return_counts=True)
    ref = torch.unique(x, return_inverse=True, return_counts=True)
    for a, b in zip((values, inverse, counts), ref):
        assert a.shape == b.shape
        close(full(a), b, what="unique")
    # data-dependent shape: Replicate; the inverse has the input's shape, so it takes the input's layout
    assert st.placements(values) == (st.Replicate(),)
    assert st.placements(inverse) == (st.Shard(0),) and st.sharding_shapes(inverse) == st.sharding_shapes(xs)
    rows, inv = torch.unique(xs, dim=0, return_inverse=True)
    rrows, rinv = torch.unique(x, dim=0, return_inverse=True)
    close(full(rows), rrows, what="unique dim=0")
    close(full(inv), rinv, what="unique dim=0 inverse")
    cons = torch.unique_consecutive(xs.flatten())
    close(full(cons), torch.unique_consecutive(x.flatten()), what="unique_consecutive")


def case_grid_sample(world, mode, padding_mode, align_corners):
    m = mesh()
    x = randn(2, 3, 7, 6, seed=9)
    grid = (randn(2, 7, 6, 2, seed=10) * 0.7)
    lay_x = _sharded(7, world, 2, seed=9)
    fn = lambda a, g: F.grid_sample(a, g, mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    what = f"grid_sample {mode} {padding_mode} {align_corners}"
    # the output has the input's shape (same grid size), so it keeps the input's layout
    out = check_op(fn, [x, grid], [lay_x, None], m, what=what)
    assert st.placements(out) == (st.Shard(2),) and st.sharding_shapes(out) == {0: lay_x[1][0]}
    # the grid sharded (along its output rows) too; another output size gives a Replicate output
    check_op(fn, [x, grid], [lay_x, _sharded(7, world, 1, seed=11)], m, what=what + " grid sharded")
    small = randn(2, 4, 5, 2, seed=12) * 0.9
    out = check_op(fn, [x, small], [lay_x, None], m, what=what + " other size")
    assert st.placements(out) == (st.Replicate(),)


def case_grid_sample_2d_mesh():
    m = mesh((2, 2))
    x = randn(2, 3, 7, 6, seed=13)
    grid = randn(2, 7, 6, 2, seed=14) * 0.7
    lay = ([st.Shard(2), st.Shard(3)], {0: [3, 4], 1: [6, 0]})
    out = check_op(lambda a, g: F.grid_sample(a, g, mode="bicubic", padding_mode="reflection", align_corners=False),
                   [x, grid],
                   [lay, None], m, what="grid_sample 2-D mesh")
    assert st.placements(out) == (st.Shard(2), st.Shard(3)) and st.sharding_shapes(out) == lay[1]


def case_unfold(world):
    m = mesh()
    x = randn(2, 3, 7, 6, seed=15)
    lay = _sharded(7, world, 2, seed=15)
    # F.unfold is im2col (and its backward col2im); both have rules now (test_fold_rot90_grid.py), kept here as a
    # long-tail model-level check
    check_op(lambda t: F.unfold(t, kernel_size=(3, 2), padding=1, stride=(2, 1)), [x], [lay], m, what="F.unfold")
    cols = randn(2, 3 * 2 * 2, 9, seed=16)     # 3 x 3 blocks of 2 x 2 in a 4 x 6 image
    check_op(lambda c: F.fold(c, output_size=(4, 6), kernel_size=2, stride=(1, 2)), [cols],
             [_sharded(9, world, 2, seed=16)], m, what="F.fold")


def case_list_and_optional_args(world):
    """Tensor[] (block_diag) and Tensor? (bincount weights) arguments are gathered too."""
    m = mesh()
    a, b = randn(5, 2, seed=17), randn(3, 4, seed=18)
    check_op(lambda s, t: torch.block_diag(s, t), [a, b], [_sharded(5, world, 0, seed=17), _sharded(4, world, 1)],
             m, what="block_diag")
    idx = torch.tensor([0, 3, 1, 3, 3, 2, 0, 6])
    w = randn(8, seed=19, dtype=torch.float64)
    lay = _sharded(8, world, 0, seed=19)
    out = torch.bincount(shard_of(idx, m, *lay), weights=shard_of(w, m, *lay), minlength=9)
    close(full(out), torch.bincount(idx, weights=w, minlength=9), what="bincount")


def case_partial_input():
    """A Partial argument is completed (all-reduce) before the op runs."""
    m = mesh()
    x = randn(6, 5, seed=20)
    xs = shard_of(x, m, [st.Shard(0)])
    s = xs.sum(0, keepdim=True)          # Partial(sum)
    assert type(st.placements(s)[0]).__name__ == "Partial"
    two = torch.tensor([[1.0], [2.0]])
    with st.CommCounter() as c:
        out = F.pdist(s * two)        # the product keeps the pending sum; pdist has no rule
    close(full(out), F.pdist(x.sum(0, keepdim=True) * two), what="pdist of Partial")
    assert set(c.calls) == {"fallback_all_reduce"}, c.calls


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", [case_median, case_cdist, case_unique, case_unfold, case_list_and_optional_args])
def test_long_tail(case, world):
    harness.run(world, case, world)


@pytest.mark.parametrize("world", [2, 3])
def test_quantile(world):
    """quantile's decomposition ends in in-place views (unsqueeze_, transpose_, squeeze_): they have rules
    (src/ops/view_inplace.cpp)."""
    harness.run(world, case_quantile, world)


# a spatially split input runs on windows (test_fold_rot90_grid.py, strict mode) but for bicubic sampling with
# reflection padding (each tap mirrored about the input's edges), which declines to the fallback
@pytest.mark.parametrize("mode,padding_mode,align_corners", [("bicubic", "reflection", True),
                                                             ("bicubic", "reflection", False)])
@pytest.mark.parametrize("world", [1, 3])
def test_grid_sample(world, mode, padding_mode, align_corners):
    harness.run(world, case_grid_sample, world, mode, padding_mode, align_corners)


def test_grid_sample_2d_mesh():
    harness.run(4, case_grid_sample_2d_mesh)


def test_partial_input():
    harness.run(2, case_partial_input)


# ---- rules that decline fall back too (functional ops below autograd) ----

def case_declined_rules(world):
    m = mesh()
    x = randn(7, 4, seed=21)
    lay = _sharded(7, world, 0, seed=21)
    check_op(lambda t: torch.cumprod(t, dim=0), [x], [lay], m, what="cumprod")
    # scatter along a sharded dim (out of place)
    src = randn(2, 4, seed=26)
    index = torch.tensor([[6, 0, 1, 2]] * 2)
    check_op(lambda t, s: t.scatter(0, index, s), [x, src], [lay, None], m, what="scatter along sharded dim")
    # forward only: the backward of index writes in place (index_put_), which the fallback refuses
    check_op(lambda t: t[torch.tensor([6, 0, 0, 3])], [x], [lay], m, grad=False, what="tensor index on sharded dim")
    check_op(lambda t: torch.fft.rfft(t, dim=0).abs(), [x], [lay], m, what="rfft along sharded dim")
    # a grouped convolution whose channel shards split a group
    img, weight = randn(1, 6, 5, 5, seed=27), randn(6, 2, 3, 3, seed=28)
    split = [1, 5] if world == 2 else [1, 2, 3]
    check_op(lambda t, w: F.conv2d(t, w, groups=3, padding=1), [img, weight], [([st.Shard(1)], {0: split}), None],
             m, what="grouped conv split group")
    # antialiased interpolation over a sharded spatial dim with no batch or channel dim to take the split, to a
    # single column (which cannot hold the split between the filter's two passes)
    check_op(lambda t: F.interpolate(t, size=(3, 1), mode="bilinear", antialias=True), [img[:, :1]],
             [_sharded(5, world, 2, seed=29)], m, what="antialias")


@pytest.mark.parametrize("world", [2, 3])
def test_declined_rules_fall_back(world):
    harness.run(world, case_declined_rules, world)


# ---- the warning and the communication count ----

def case_warning_once_and_count(world):
    m = mesh()
    x = randn(8, 3, seed=27)
    xs = shard_of(x, m, [st.Shard(1)])          # even: padded to the largest extent
    st._C._reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with st.CommCounter() as first:
            F.pdist(xs, p=1.0)                   # no rule: the fallback
        with st.CommCounter() as second:
            F.pdist(xs, p=1.0)
        torch.block_diag(xs, xs)                 # another op warns once too
    ours = _fallback_warnings(record, "aten::_pdist_forward")
    assert len(ours) == 1, [str(w.message) for w in record]
    msg = str(ours[0].message)
    assert "once per op" in msg and "SHARDTENSOR_STRICT=1" in msg and "self: (Shard(1))" in msg, msg
    nbytes = int(re.search(r"(\d+) bytes collected", msg).group(1))
    largest = -(-3 // world)
    expected = largest * 8 * 4 * world if world > 1 else 0   # all_gather counts the padded input times the group
    assert nbytes == expected == first.bytes.get("fallback_all_gather", 0), (nbytes, expected, first.bytes)
    # The gather, and the fallback's agreement on strict mode and its size guard (one small all-reduce).
    assert first.calls == second.calls == ({"fallback_all_gather": 1, "fallback_all_reduce": 1} if world > 1 else {}), \
        first.calls
    assert first.bytes == second.bytes
    assert len(_fallback_warnings(record, "aten::block_diag")) == 1
    # a backward through the fallback is counted as well (its gathers are the fallback's)
    a = shard_of(x, m, [st.Shard(1)]).requires_grad_()
    with st.CommCounter() as c:
        F.pdist(a, p=1.0).sum().backward()
    if world > 1:
        assert c.calls.get("fallback_all_gather", 0) >= 2, c.calls


@pytest.mark.parametrize("world", [1, 2, 3])
def test_warning_once_per_op_and_comm_count(world):
    harness.run(world, case_warning_once_and_count, world)


# ---- strict mode ----

def case_strict(which):
    m = mesh()
    xs = shard_of(randn(7, 4, seed=29), m, [st.Shard(0)], {0: uneven_extents(7, m.size(), 29)})
    assert not st.strict()
    with st.use_strict():
        assert st.strict()
        if which == "no_rule":
            F.pdist(xs)
        elif which == "declined":
            torch.mode(xs[:, 0])   # the mode of a 1-D input along its split dim: no dim to take the split
        else:
            F.grid_sample(xs.reshape(1, 1, 7, 4), randn(1, 3, 3, 2, seed=30), mode="bicubic", padding_mode="reflection")


@pytest.mark.parametrize("which,match", [("no_rule", "aten::_pdist_forward has no domain-parallel rule"),
                                         ("declined", "aten::mode was refused by its domain-parallel rule"),
                                         ("grid_sample", "aten::grid_sampler_2d was refused by its domain-parallel rule "
                                                         "(aten::grid_sampler_2d with input")])
def test_strict_raises_on_every_rank(which, match):
    for world in (2, 3):
        harness.expect_error(world, case_strict, which, match=match, kinds=("NotImplementedError",))
    harness.run(2, case_strict_is_restored)


def case_strict_is_restored():
    assert not st.strict()
    assert st.set_strict(True) is False
    assert st.set_strict(False) is True


def test_strict_from_environment():
    code = "import shardtensor as st; print(st.strict())"
    for value, expected in (("1", "True"), ("0", "False")):
        env = {**__import__("os").environ, "SHARDTENSOR_STRICT": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, out


# ---- what the fallback refuses ----

def case_refused(which):
    m = mesh()
    xs = shard_of(randn(7, 4, seed=31), m, [st.Shard(0)], {0: uneven_extents(7, m.size(), 31)})
    if which == "view":
        xs.as_strided((3, 4), (1, 1))                       # overlapping windows: no sub-grid of its elements
    elif which == "inplace":
        xs.renorm_(2, 0, 1.0)
    elif which == "out":
        v, i = torch.empty(4), torch.empty(4, dtype=torch.long)
        torch.median(xs, 0, out=(shard_of(v, m, [st.Replicate()]), shard_of(i, m, [st.Replicate()])))
    elif which == "random":
        torch.poisson(xs.abs())
    elif which == "random_multinomial":
        torch.multinomial(xs.abs() + 0.1, 2)


@pytest.mark.parametrize("which,match", [("view", "aten::as_strided was refused by its domain-parallel rule"),
                                         ("inplace", "aten::renorm_"),
                                         ("out", "aten::median.dim_values"), ("random", "aten::poisson"),
                                         ("random_multinomial", "aten::multinomial")])
def test_refused_without_rule(which, match):
    harness.expect_error(2, case_refused, which, match=match if "rule" in match else match + " has no domain-parallel rule",
                         kinds=("NotImplementedError",))


# ---- the size guard and strict mode agreed across ranks (issue 30 item 4) ----

def case_strict_on_one_rank(which):
    """Strict mode on rank 0 only: rank 0 refused at once while the others waited in the fallback's gather until the
    process group's timeout. Now every rank raises, naming the setting."""
    m = mesh()
    xs = shard_of(randn(7, 4, seed=31), m, [st.Shard(0)], {0: uneven_extents(7, m.size(), 31)})
    with st.use_strict(torch.distributed.get_rank() == 0):
        if which == "no_rule":
            F.pdist(xs)
        else:
            torch.mode(xs[:, 0])


def case_after_errors():
    """The ranks still agree after the refusals: a fallback runs."""
    m = mesh()
    x = randn(6, 4, seed=32)
    close(full(F.pdist(shard_of(x, m, [st.Shard(0)]))), F.pdist(x), what="pdist after refusals")
    return True


@pytest.mark.parametrize("which", ["no_rule", "declined"])
def test_strict_on_one_rank_raises_everywhere(which):
    for world in (2, 3):
        errors = harness.expect_error(world, case_strict_on_one_rank, which, match="set it alike on every rank",
                                      kinds=("NotImplementedError",))
        assert len({msg for _, msg, _ in errors.values()}) == 1, errors
        harness.run(world, case_after_errors)


def case_budget(which):
    m = mesh()
    xs = shard_of(randn(8, 4, seed=33), m, [st.Shard(0)])
    if which == "auto":
        # A global shape no rank could hold (a stride-0 view: no memory here), gathered: refused before it starts.
        huge = xs[:, :1].expand(8, 10 ** 12)
        before = st.comm_stats()["calls"].get("fallback_all_gather", 0)
        try:
            F.pdist(huge)
        finally:
            assert st.comm_stats()["calls"].get("fallback_all_gather", 0) == before, "gathered before refusing"
        return
    budget = 100 if which == "fixed" else (100 if torch.distributed.get_rank() == 0 else None)
    previous = st.set_fallback_budget(budget)
    try:
        assert st.fallback_budget() == budget
        F.pdist(xs)                # 8 x 4 floats gathered + room for the 28 distances: 240 bytes > 100
    finally:
        st.set_fallback_budget(previous)


def case_budget_allows():
    m = mesh()
    x = randn(8, 4, seed=34)
    previous = st.set_fallback_budget(1024)  # 8 x 4 gathered + the 28 distances: 240 bytes
    try:
        close(full(F.pdist(shard_of(x, m, [st.Shard(0)]))), F.pdist(x), what="pdist within the budget")
    finally:
        st.set_fallback_budget(previous)
    assert st.fallback_budget() is None
    return True


@pytest.mark.parametrize("which", ["fixed", "one_rank", "auto"])
def test_fallback_size_guard(which):
    for world in (2, 3):
        errors = harness.expect_error(world, case_budget, which, match="fallback budget",
                                      kinds=("NotImplementedError",))
        for _, msg, _ in errors.values():
            assert "aten::_pdist_forward" in msg and "set_fallback_budget" in msg and "bytes" in msg, msg
        assert len({msg for _, msg, _ in errors.values()}) == 1, errors
    harness.run(2, case_budget_allows)


def test_fallback_budget_setting():
    with pytest.raises(ValueError, match="bytes"):
        st.set_fallback_budget(-5)
    with pytest.raises(ValueError, match="bytes"):
        st.set_fallback_budget(1.5)
    assert st.fallback_budget() is None


# ---- replications: an op that makes a tensor sharded along a large dim replicated ----

def _replication_warnings(record, op):
    return [w for w in record if "ShardTensor: " + op in str(w.message)
            and "the work is no longer divided" in str(w.message)]


def _cat_twice(xs):
    out = []
    for _ in range(2):   # one call site, two calls: one warning
        out.append(torch.cat([xs, xs * 2], 0))
    return out


def case_replication_watch(world):
    """cat of two inputs sharded along the cat dim gathers both (then re-splits): counted per op in CommCounter and
    RankStats, warned once per op and call site; full_tensor/redistribute are not; small tensors (the threshold) and
    dims no longer than the mesh are not; strict mode raises on every rank before anything moves; the fallback's
    gathers are counted under its op without a second warning."""
    m = mesh()
    k = m.size()
    x = randn(9, 5, seed=41)
    lay = ([st.Shard(0)], {0: uneven_extents(9, k, 41)})
    previous = st.set_replication_threshold(0)
    try:
        st._C._reset_replication_warnings()
        xs = st.distribute_tensor(x, m, *lay)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with st.CommCounter() as c, st.RankStats(flops=False, memory=False) as s:
                outs = _cat_twice(xs)
        for o in outs:
            close(full(o), torch.cat([x, x * 2], 0), what="cat of sharded inputs")
        nbytes = 9 * 5 * 4
        if k > 1:
            assert c.replications == {"aten::cat": 4}, c.replications
            assert c.replicated_bytes == {"aten::cat": 4 * nbytes}, c.replicated_bytes
            assert s.replications == c.replications and s.replicated_bytes == c.replicated_bytes, s.summary()
            assert len(_replication_warnings(record, "aten::cat")) == 1, [str(w.message) for w in record]
            msg = str(_replication_warnings(record, "aten::cat")[0].message)
            assert "[9, 5]" in msg and "Shard(0)" in msg and "_cat_twice" in msg, msg
        else:   # nothing is gathered on one rank
            assert c.replications == {} and not _replication_warnings(record, "aten::cat"), c.replications
        # Explicit requests: neither counted nor warned.
        with warnings.catch_warnings(record=True) as record, st.CommCounter() as c:
            warnings.simplefilter("always")
            close(xs.full_tensor(), x, what="full_tensor")
            close(full(xs.redistribute([st.Replicate()])), x, what="redistribute")
        assert c.replications == {} and not [w for w in record if "no longer divided" in str(w.message)], c.replications
        # A dim no longer than the mesh is not large.
        small = st.distribute_tensor(randn(k, 5, seed=42), m, [st.Shard(0)])
        with st.CommCounter() as c:
            torch.cat([small, small], 0)
        assert c.replications == {}, c.replications
        # Strict mode refuses it, on every rank, before any collective.
        with st.use_strict(), st.CommCounter() as c:
            if k > 1:
                with pytest.raises(NotImplementedError, match="aten::cat turned a tensor of shape \\[9, 5\\].*strict mode"):
                    torch.cat([xs, xs], 0)
            else:
                torch.cat([xs, xs], 0)
        assert c.calls == {}, c.calls
        # The fallback's gathers: counted under its op; its own warning only.
        st._C._reset_fallback_warnings()
        with warnings.catch_warnings(record=True) as record, st.CommCounter() as c:
            warnings.simplefilter("always")
            v = F.pdist(xs)
        close(full(v), F.pdist(x), what="pdist")
        if k > 1:
            assert c.replications == {"aten::_pdist_forward": 1}, c.replications
        assert not _replication_warnings(record, "aten::_pdist_forward"), [str(w.message) for w in record]
    finally:
        st.set_replication_threshold(previous)
    # The default threshold: these small tensors are never counted.
    assert st.replication_threshold() == 16384
    with st.CommCounter() as c:
        torch.cat([xs, xs], 0)
    assert c.replications == {}, c.replications
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_replication_counted_warned_and_strict(world):
    harness.run(world, case_replication_watch, world)


def test_replication_threshold_argument():
    with pytest.raises(ValueError, match="element count"):
        st.set_replication_threshold(-1)
    assert st.replication_threshold() == 16384
