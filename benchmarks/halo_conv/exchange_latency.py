"""Is a rank's wait in a halo exchange transfer or imbalance? On N=2 Gloo ranks (1 thread each), per rank: a bare
exchange of one row [C, W] with the neighbour (torch isend/irecv, waited at once); the local 3x3 convolution of the
rank's own rows [1, C, H/2, W]; the same convolution through this library (its halo exchange overlapped with it);
and the exchange posted, the local convolution run, then waited (the wait's median reported): a wait near zero on
one rank while the other waits about the difference of their convolution times is imbalance of the ranks' CPU
share, not transfer time.

    .venv/bin/python benchmarks/halo_conv/exchange_latency.py [--size 256] [--channels 16] [--iters 50]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import shardtensor as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import init_cpu_rank  # noqa: E402
from results_dir import loadavg  # noqa: E402


def run_rank(rank, world, port, args):
    mesh = init_cpu_rank(rank, world, port, retain_heap=True)
    conv = nn.Conv2d(args.channels, args.channels, 3, padding=1)
    xs = st.distribute_tensor(torch.randn(1, args.channels, args.size, args.size), mesh, [st.Shard(2)])
    xl = st.to_local(xs).clone()
    row, buf = torch.randn(args.channels, args.size), torch.empty(args.channels, args.size)
    peer = 1 - rank
    waits = []

    def exchange():
        s, r = dist.isend(row, peer), dist.irecv(buf, peer)
        r.wait()
        s.wait()

    def conv_local():
        with torch.no_grad():
            conv(xl)

    def conv_sharded():
        with torch.no_grad():
            conv(xs)

    def posted_conv_wait():
        s, r = dist.isend(row, peer), dist.irecv(buf, peer)
        conv_local()
        t = time.perf_counter()
        r.wait()
        s.wait()
        waits.append(time.perf_counter() - t)

    cases = [("bare exchange", exchange, args.iters * 4), ("conv local", conv_local, args.iters),
             ("conv sharded", conv_sharded, args.iters), ("post; conv local; wait", posted_conv_wait, args.iters)]
    out = []
    for name, fn, n in cases:
        for _ in range(5):
            fn()
        waits.clear()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            fn()
        out.append(f"{name} {(time.perf_counter() - t0) / n * 1e6:.0f} µs wall / {(time.thread_time() - c0) / n * 1e6:.0f} µs CPU")
    out.append(f"median wait after the convolution {statistics.median(waits) * 1e6:.0f} µs")
    print(f"rank {rank} (load {loadavg()[0]}): " + "; ".join(out), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
