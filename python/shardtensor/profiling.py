"""Measuring what a step costs on this rank: allocator peak memory (CPU and CUDA)."""
from __future__ import annotations

import torch

__all__ = ["peak_memory"]


def peak_memory(fn, device=None, prepare=None) -> int:
    """Bytes of allocator peak while ``fn()`` runs, above what was allocated before (``prepare()`` runs first,
    unmeasured). CUDA: ``max_memory_allocated``; CPU: ``shardtensor._C.CpuMemoryTracker`` (C++), which wraps c10's
    CPU allocator while ``fn`` runs (restoring it afterwards; the profiler's state is never touched, so
    ``torch.profiler``, ``record_function`` and collectives work inside and around it) and keeps the running total
    of the allocations made meanwhile, on any thread, minus their frees, and its peak."""
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
    from . import _C

    with _C.CpuMemoryTracker() as tracker:
        fn()
    return tracker.peak_bytes
