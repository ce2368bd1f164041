"""Timing: warm-up, then synchronised iterations; each iteration's time is the max over ranks (the step ends
when the slowest rank ends), and the statistics are over those maxima."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_samples(fn, device: torch.device, iters: int, warmup: int, group=None, cpu: list | None = None) -> list[float]:
    """Per-iteration wall time of ``fn()`` on this rank: a barrier before each iteration (so every rank starts
    together), a device synchronise after it (so queued CUDA work is inside the interval). ``cpu``, if given,
    receives this thread's CPU time per iteration: with one intra-op thread that is the rank's own compute and
    dispatch, without time spent waiting for other ranks or time-sliced away to other processes."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
    return samples


def max_over_ranks(samples: list[float], group=None) -> list[float]:
    """Element-wise max of every rank's per-iteration times (a collective on ``group``; identity alone)."""
    if group is None or dist.get_world_size(group) == 1:
        return list(samples)
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def summary(samples: list[float]) -> dict:
    """Median (the figure we report), mean, std, min and the raw samples, in seconds."""
    return {"median": statistics.median(samples), "mean": statistics.fmean(samples),
            "std": statistics.pstdev(samples) if len(samples) > 1 else 0.0, "min": min(samples),
            "samples": [round(s, 6) for s in samples]}


