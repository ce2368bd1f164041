"""Per-rank accounting of a block of code: FLOPs and memory traffic of the local kernels, collectives and bytes sent
per kind, peak memory, wall and CPU time. Works in real multi-rank runs and under ``st.simulate``."""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from . import _C
from .local_ops import LocalOpMode, active_local_mode

__all__ = ["RankStats"]


class _OpTally:
    """Listener of a LocalOpMode: FLOPs and traffic per op name, and the (flops, traffic) of every distinct op
    instance with its count (a compact list for a per-op roofline)."""

    def __init__(self):
        self.flops = defaultdict(int)
        self.traffic = defaultdict(int)
        self.calls = defaultdict(int)
        self.instances = defaultdict(int)  # (name, flops, traffic) -> count
        self.cpu_s = defaultdict(float)

    def on_op(self, name, flops, traffic, cpu_s):
        self.cpu_s[name] += cpu_s
        self.flops[name] += flops
        self.traffic[name] += traffic
        self.calls[name] += 1
        self.instances[(name, flops, traffic)] += 1


class RankStats:
    """``with st.RankStats() as s: step()`` — what this rank did inside the block:

    - ``s.flops`` (total), ``s.flops_by_op``: FLOPs of the local kernels (matmuls, convolutions, attention kernels;
      torch's ``FlopCounterMode`` rules), counted *through* ShardTensors (see ``shardtensor.local_ops``);
    - ``s.traffic_bytes``: bytes the local kernels read and wrote (every non-view op's tensors), for a roofline;
      ``s.op_instances``: ``[(op, flops, traffic_bytes, count), ...]``;
    - ``s.comm_calls``, ``s.comm_bytes`` (per collective kind, bytes this rank sent: ``st.CommCounter``);
    - ``s.replications``, ``s.replicated_bytes`` (per op): tensors sharded along a large dim that an op made
      replicated, where the work stopped being divided (``st.set_replication_threshold``);
    - ``s.peak_bytes``: peak memory above what was live at entry — the CPU allocator's (``st.peak_memory``'s
      tracker) with real tensors, CUDA's ``max_memory_allocated`` with ``device="cuda"``, and in a meta simulation the
      tally of the bytes the fake storages would hold (``s.memory_source`` says which);
    - ``s.wall_s``, ``s.cpu_s`` (this thread's CPU time);
    - ``s.kernel_cpu_s``, ``s.kernel_cpu_by_op``: this thread's CPU time inside the local kernels alone (real
      tensors; None in a meta simulation, which computes nothing) — the rank's local compute without the library's
      and the process group's host work around it. The counting mode slows the block; time it in a separate run.

    ``flops=False`` skips the op-level counting (no dispatch mode: the block runs at full speed, for timing)."""

    def __init__(self, flops: bool = True, memory: bool = True, device=None):
        self.count_flops = flops
        self.count_memory = memory
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def __enter__(self):
        from . import CommCounter
        self._tally = _OpTally() if self.count_flops else None
        outer = active_local_mode()
        self._meta_mode = outer if outer is not None and outer.fake is not None else None
        self._own_mode = None
        self._tracker = None
        if self._tally is not None:
            if outer is not None:
                outer.listeners.append(self._tally)
            else:
                self._own_mode = LocalOpMode()
                self._own_mode.listeners.append(self._tally)
        self._listening = outer if (self._tally is not None and outer is not None) else None
        if self.count_memory:
            if self._meta_mode is not None:
                self._base = self._meta_mode.live_bytes
                self._meta_mode.reset_peak()
                self.memory_source = "fake-storage tally (meta simulation)"
            elif self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                self._base = torch.cuda.memory_allocated(self.device)
                self.memory_source = "torch.cuda.max_memory_allocated"
            else:
                self._tracker = _C.CpuMemoryTracker()
                self._tracker.__enter__()
                self.memory_source = "CPU allocator tracker"
        self._comm = CommCounter().__enter__()
        if self._own_mode is not None:
            self._own_mode.__enter__()
        self._t0, self._c0 = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.wall_s = time.perf_counter() - self._t0
        self.cpu_s = time.thread_time() - self._c0
        if self._own_mode is not None:
            self._own_mode.__exit__(*exc)
        if self._listening is not None:
            self._listening.listeners.remove(self._tally)
        self._comm.__exit__(*exc)
        self.comm_calls, self.comm_bytes = dict(self._comm.calls), dict(self._comm.bytes)
        self.replications, self.replicated_bytes = dict(self._comm.replications), dict(self._comm.replicated_bytes)
        self.peak_bytes = None
        if self.count_memory:
            if self._meta_mode is not None:
                self.peak_bytes = self._meta_mode.peak_live_bytes - self._base
            elif self.device.type == "cuda":
                self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            else:
                self._tracker.__exit__(*exc)
                self.peak_bytes = self._tracker.peak_bytes
        t = self._tally
        self.flops_by_op = dict(t.flops) if t else {}
        self.flops = sum(self.flops_by_op.values()) if t else None
        self.traffic_bytes = sum(t.traffic.values()) if t else None
        self.calls_by_op = dict(t.calls) if t else {}
        self.op_instances = [(n, f, b, c) for (n, f, b), c in t.instances.items()] if t else []
        timed = t is not None and self._meta_mode is None
        self.kernel_cpu_by_op = dict(t.cpu_s) if timed else {}
        self.kernel_cpu_s = sum(self.kernel_cpu_by_op.values()) if timed else None
        return False

    @property
    def total_comm_bytes(self) -> int:
        return sum(self.comm_bytes.values())

    def summary(self) -> dict:
        """The figures as a JSON-friendly dict."""
        return {"flops": self.flops, "traffic_bytes": self.traffic_bytes, "flops_by_op": self.flops_by_op,
                "comm_calls": self.comm_calls, "comm_bytes": self.comm_bytes, "replications": self.replications,
                "replicated_bytes": self.replicated_bytes, "peak_bytes": self.peak_bytes,
                "memory_source": getattr(self, "memory_source", None), "wall_s": self.wall_s, "cpu_s": self.cpu_s,
                "kernel_cpu_s": self.kernel_cpu_s}
