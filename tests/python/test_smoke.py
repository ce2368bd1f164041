import torch

import harness
import shardtensor as st
from cases_util import close, full, mesh, randn, shard_of, uneven_extents


def case_roundtrip(n):
    m = mesh()
    x = randn(n, 5)
    ext = {0: uneven_extents(n, st.device_mesh and m.size(), seed=1)}
    xs = shard_of(x, m, [st.Shard(0)], ext)
    close(xs.full_tensor(), x, what="full_tensor")
    y = (xs * 2 + 1).sum()
    close(full(y), (x * 2 + 1).sum(), what="sum")
    return st.placements(xs)


def test_roundtrip():
    for w in (1, 2, 3):
        res = harness.run(w, case_roundtrip, 7)
        assert res[0] == (st.Shard(0),)


def test_quick_tier_is_consistent(request):
    """The quick tier (tests/python/conftest.py QUICK) names existing tests and covers every collected test file."""
    assert request.config.quick_tier_problems == []
