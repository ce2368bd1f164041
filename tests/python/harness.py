"""Multi-rank test harness: persistent pools of Gloo ranks (one pool per world size) that run test cases
(top-level functions of test modules) on every rank and fail on a hang instead of waiting for CI's limit.

A case function runs on every rank as ``fn(*args)``; it asserts against the single-device computation itself
and may return a picklable value. ``run(world, fn, *args)`` returns the per-rank results, or raises the first
rank's error (``RankError`` with every rank's error attached).
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
CASE_TIMEOUT = float(os.environ.get("SHARDTENSOR_TEST_TIMEOUT", "120"))


class RankError(AssertionError):
    """A case failed on one or more ranks: ``errors`` maps rank -> (exception type name, message, traceback)."""

    def __init__(self, errors):
        self.errors = errors
        first = min(errors)
        kind, msg, tb = errors[first]
        super().__init__(f"rank {first} raised {kind}: {msg}\n{tb}\n(failed ranks: {sorted(errors)})")


class CaseTimeout(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn):
    sys.path.insert(0, HERE)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import faulthandler
    import signal

    # On a hang the parent asks every rank for its Python stacks before killing the pool.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    import shardtensor  # noqa: F401  (load the backend once)

    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, name, args = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send(("ok", fn(*args)))
        except BaseException as e:  # report everything, keep serving
            conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()
    # Skip the interpreter's teardown: the zoo's libraries leave threads and exit handlers (a pool of them took
    # 10-14 s to close, the parent's join limit) and nothing is left to write.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Pool:
    def __init__(self, world: int):
        self.world = world
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world, port, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn, *args, timeout: float = CASE_TIMEOUT):
        for c in self.conns:
            c.send((fn.__module__, fn.__name__, args))
        results, errors = {}, {}
        # One deadline for the whole case: polling each rank for the full limit in turn let a case run for up to
        # world x timeout (a 3-rank zoo model that thrashed ran on for 12 minutes under a 180 s limit).
        deadline = time.monotonic() + timeout
        for r, c in enumerate(self.conns):
            if not c.poll(max(deadline - time.monotonic(), 0.0)):
                self.dump_stacks()
                self.kill()
                raise CaseTimeout(f"{fn.__name__}{args}: rank {r} did not finish within {timeout}s (hang?)")
            status, value = c.recv()
            if status == "ok":
                results[r] = value
            else:
                errors[r] = value
        if errors:
            raise RankError(errors)
        return [results[r] for r in range(self.world)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def dump_stacks(self):
        import signal

        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(2)
        if os.environ.get("SHARDTENSOR_TEST_GDB"):  # native stacks too (debugging hangs; needs gdb)
            import subprocess

            for r, p in enumerate(self.procs):
                if p.is_alive():
                    bt = subprocess.run(["gdb", "-p", str(p.pid), "-batch", "-ex", "thread apply all bt 30"],
                                        capture_output=True, text=True, timeout=120).stdout
                    print(f"==== rank {r} native stacks ====\n{bt}", file=sys.stderr)

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
        self.kill()


_pools: dict = {}


def run(world: int, fn, *args, timeout: float = CASE_TIMEOUT):
    """Run ``fn(*args)`` on every rank of a ``world``-rank Gloo job; a dead or hung pool is replaced."""
    pool = _pools.get(world)
    if pool is None or not pool.alive():
        pool = _pools[world] = Pool(world)
    try:
        return pool.run(fn, *args, timeout=timeout)
    except CaseTimeout:
        _pools.pop(world, None)
        raise


def discard(world: int):
    """Close and forget the pool of ``world`` ranks: after a case that may have left collectives unmatched (one
    rank raised while another was inside a collective), the next case starts on fresh process groups."""
    pool = _pools.pop(world, None)
    if pool is not None:
        pool.close()


def expect_error(world: int, fn, *args, match: str = "", kinds=("NotImplementedError", "ValueError", "TypeError",
                                                                 "RuntimeError", "IndexError")):
    """Run a case that must raise on *every* rank (and must not hang)."""
    try:
        run(world, fn, *args)
    except RankError as e:
        missing = set(range(world)) - set(e.errors)
        assert not missing, f"ranks {sorted(missing)} did not raise"
        for r, (kind, msg, _) in e.errors.items():
            assert kind in kinds, f"rank {r} raised {kind}: {msg}"
            assert match in msg, f"rank {r}: {match!r} not in {msg!r}"
        return e.errors
    raise AssertionError(f"{fn.__name__} did not raise")


def close_all():
    for p in _pools.values():
        p.close()
    _pools.clear()
