"""Shared benchmark helpers: median timing and allocator peak memory of one call."""
from __future__ import annotations

import statistics
import time

import torch


def timed(fn, warmup: int = 2, iters: int = 7) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def peak_bytes(fn, device, prepare=None) -> int:
    """Allocator peak while ``fn`` runs, above what was allocated before (``prepare`` runs first, unprofiled)."""
    if prepare is not None:
        prepare()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The raw allocator records (+bytes on allocation, -bytes on free) in time order. Not prof.events(): there
    # each op's cpu_memory_usage includes its children's allocations, so summing over nested ops double-counts.
    records = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                      if e.name() == "[memory]"), key=lambda r: r[0])
    cur = peak = 0
    for _, nbytes in records:
        cur += nbytes
        peak = max(peak, cur)
    return peak
