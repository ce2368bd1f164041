"""st.peak_memory leaves other code alone: torch.profiler (inside or around it), record_function and collectives
(torch.distributed and the library's) work during and after it, and its CPU figures stay exact."""
import threading

import torch
import torch.distributed as dist

import harness
import shardtensor as st
from cases_util import close, mesh, randn


def _step(xs):
    t = torch.ones(1000)
    dist.all_reduce(t)                                   # a torch.distributed collective
    total = (xs * 2).sum().full_tensor()                 # the library's collectives
    with torch.profiler.record_function("shardtensor_test_region"):
        y = torch.ones(64, 64) @ torch.ones(64, 64)
    return t, total, y


def _profile(fn):
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def case_peak_memory_with_profiler_and_collectives():
    m = mesh()
    x = randn(8, 4, seed=1)
    xs = st.distribute_tensor(x, m, [st.Shard(0)])
    w = m.size()
    # The profiler inside the measured function, and the measured function inside the profiler.
    keys_inside = []
    peak = st.peak_memory(lambda: keys_inside.append(_profile(lambda: _step(xs))))
    assert peak > 0
    keys_around = _profile(lambda: st.peak_memory(lambda: _step(xs)))
    for keys in (keys_inside[0], keys_around):
        assert "shardtensor_test_region" in keys and "gloo:all_reduce" in keys, sorted(keys)
    # Afterwards: the profiler and collectives as usual, and the values right.
    keys_after = _profile(lambda: _step(xs))
    assert "shardtensor_test_region" in keys_after
    t, total, _ = _step(xs)
    close(t, torch.full((1000,), float(w)), what="all_reduce after peak_memory")
    close(total, (x * 2).sum(), what="sum after peak_memory")
    return True


def test_peak_memory_with_profiler_and_collectives():
    for world in (1, 2):
        harness.run(world, case_peak_memory_with_profiler_and_collectives)


def test_peak_memory_threads_and_nesting():
    """Allocations on other threads count (the whole process is measured); nested trackers each count from their
    own start; the figures are exact for known allocations."""
    def other_thread():
        holder = []
        th = threading.Thread(target=lambda: holder.append(torch.empty(256, 1024)))   # 1 MiB
        th.start()
        th.join()
        return holder

    assert st.peak_memory(other_thread) == 2**20
    with st._C.CpuMemoryTracker() as outer:
        a = torch.empty(512, 1024)                  # 2 MiB: outer only
        with st._C.CpuMemoryTracker() as inner:
            b = torch.empty(256, 1024)              # 1 MiB: both
            del a                                   # freed: outer's current drops, inner never saw it
        del b
    assert (outer.peak_bytes, outer.current_bytes) == (3 * 2**20, 0)
    assert (inner.peak_bytes, inner.current_bytes) == (2**20, 2**20)
