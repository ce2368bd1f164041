"""Measuring what a step costs on this rank: allocator peak memory (CPU and CUDA)."""
from __future__ import annotations

import torch

__all__ = ["peak_memory"]


def peak_memory(fn, device=None, prepare=None) -> int:
    """Bytes of allocator peak while ``fn()`` runs, above what was allocated before (``prepare()`` runs first,
    unmeasured). CUDA: ``max_memory_allocated``; CPU: the profiler's raw allocation records in time order (not the
    per-op totals, which count nested ops' allocations more than once)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
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
    records = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                      if e.name() == "[memory]"), key=lambda r: r[0])
    cur = peak = 0
    for _, nbytes in records:
        cur += nbytes
        peak = max(peak, cur)
    return peak
