"""Starting ranks: under torchrun (environment already set) or self-spawned Gloo processes on this machine."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun() -> bool:
    """True when a launcher (torchrun) set this process's rank and world size."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(kind: str, local_rank: int) -> torch.device:
    """CPU, or the GPU of this local rank; with more ranks than GPUs several ranks share one (per-rank memory is
    then honest, timings are contended)."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def backend_for(device: torch.device, local_world: int) -> str:
    """Gloo on CPU. On CUDA NCCL when every local rank has its own GPU; plain Gloo when ranks share a GPU (NCCL
    refuses two ranks on one device; the library then stages CUDA collectives through host memory)."""
    if device.type == "cuda" and local_world <= torch.cuda.device_count():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_process_group(rank: int, world: int, device_kind: str, threads: int, port: int | None = None):
    """Initialise this rank's default process group; returns its device."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = pick_device(device_kind, local_rank)
    # One intra-op thread per rank by default: ranks on a small CPU must not oversubscribe its cores, and the
    # single-device baseline uses the same count so ratios compare like with like.
    torch.set_num_threads(threads)
    dist.init_process_group(backend_for(device, local_world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    return device


def spawn(fn, world: int, args: tuple):
    """Run ``fn(rank, world, port, *args)`` on ``world`` fresh processes (Gloo over 127.0.0.1)."""
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(fn, args=(world, port) + tuple(args), nprocs=world, join=True)
