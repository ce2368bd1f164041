"""Shared benchmark helpers: median timing and allocator peak memory of one call."""
from __future__ import annotations

import statistics
import time

import torch

from shardtensor.profiling import peak_memory


def timed(fn, warmup: int = 2, iters: int = 7, samples: list | None = None) -> float:
    """Median wall time of ``fn()`` in seconds (``samples``, if given, receives every iteration's time)."""
    for _ in range(warmup):
        fn()
    samples = [] if samples is None else samples
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def peak_bytes(fn, device, prepare=None) -> int:
    """Allocator peak while ``fn`` runs (see ``shardtensor.profiling.peak_memory``)."""
    return peak_memory(fn, device, prepare)
