"""Shared benchmark helpers: median timing and allocator peak memory of one call, collective counts as text."""
from __future__ import annotations

import statistics
import time

import torch

from shardtensor.profiling import peak_memory


def sync_cuda():
    """Wait for the GPU when this process has used it (CUDA kernels return before they finish)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, warmup: int = 2, iters: int = 7, samples: list | None = None) -> float:
    """Median wall time of ``fn()`` in seconds, the GPU's work included (synchronised before and after each
    call); ``samples``, if given, receives every iteration's time."""
    for _ in range(warmup):
        fn()
    samples = [] if samples is None else samples
    for _ in range(iters):
        sync_cuda()
        t0 = time.perf_counter()
        fn()
        sync_cuda()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def peak_bytes(fn, device, prepare=None) -> int:
    """Allocator peak while ``fn`` runs (see ``shardtensor.profiling.peak_memory``)."""
    return peak_memory(fn, device, prepare)


def format_collectives(calls: dict, nbytes: dict) -> str:
    """``CommCounter`` calls and bytes as ``kind ×n (x KiB)``, or ``none``."""
    if not calls:
        return "none"
    return ", ".join(f"{k} ×{v} ({nbytes[k] / 1024:.1f} KiB)" for k, v in sorted(calls.items()))


def reduce_over_ranks(value: float, op=None) -> float:
    """`value` reduced over the default process group (`op`: a torch.distributed.ReduceOp, MAX by default)."""
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op is None else op)
    return t.item()


def init_cpu_rank(rank: int, world: int, port: int, retain_heap: bool = False, mesh_shape=None, mesh_dim_names=None):
    """A spawned benchmark rank's start: the Gloo default group on 127.0.0.1:``port``, one intra-op thread (the ranks
    share the host's cores), freed memory kept mapped when ``retain_heap`` (``retain_freed_memory``); returns the 1-D
    CPU mesh over every rank, its dim named "domain" (or the mesh of ``mesh_shape`` and ``mesh_dim_names``)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if retain_heap:
        retain_freed_memory()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if mesh_shape is not None:
        return init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))


def write_rank0_rows(rank: int, rows, scratch: str) -> None:
    """The other half of ``spawn_rank0_rows``: rank 0 writes its rows (any JSON value) to ``scratch`` for the parent."""
    import json
    if rank == 0:
        with open(scratch, "w") as f:
            json.dump(rows, f)


def spawn_rank0_rows(run, world: int, scratch: str, *args):
    """Spawn ``world`` Gloo ranks running ``run(rank, world, port, scratch, *args)`` on a free port; ``run`` writes rank
    0's rows as JSON to ``scratch``, which is read, removed and returned."""
    import json
    import os
    import socket
    import sys

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if os.path.exists(scratch):
        os.remove(scratch)  # a failed run's: only this run's rows may be read below
    try:
        mp.spawn(run, args=(world, port, scratch, *args), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        # An intermittent native abort while a rank shuts down ("terminate called without an active exception", no
        # Python frame; docs/workloads/vit.md): rank 0 writes the rows only after every rank finished measuring, so
        # when they are there they are complete, and kept.
        if not os.path.exists(scratch):
            raise
        print(f"spawn_rank0_rows: {e} after rank 0 wrote its rows; kept", file=sys.stderr)
    with open(scratch) as f:
        rows = json.load(f)
    os.remove(scratch)
    return rows


def write_report(out: str, name: str, payload: dict, lines: list) -> None:
    """``name.json`` (the payload) and ``name.md`` (the lines) into ``out``; the markdown is printed too."""
    import json
    import os
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def retain_freed_memory() -> bool:
    """Keep memory freed by this process in glibc's heap instead of returning it to the OS (mallopt: no trimming of
    the heap top, a fixed mmap threshold of 32 MiB, 64 MiB of top padding). PyTorch's CPU allocator does not cache:
    with glibc's defaults, whether a step's freed activations are trimmed from the heap (and every page of them
    faulted in again, zero-filled, the next step) depends on where small live allocations happen to sit, so it
    differs between processes and between variants timed in one process by up to tens of ms per step at 256². Call
    at the start of every rank, before timing, so all variants run on a heap that stays mapped (the effect
    jemalloc/tcmalloc have). glibc caps the mmap threshold at 32 MiB: larger tensors (a 1024² rank's activation of
    16 channels is 32 MiB) are still mapped and unmapped per allocation, in every variant alike. False where mallopt
    is unavailable (not glibc)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1
        ok = libc.mallopt(m_trim_threshold, 1 << 30) == 1 and ok
        return libc.mallopt(m_top_pad, 64 << 20) == 1 and ok
    except (OSError, AttributeError):
        return False
