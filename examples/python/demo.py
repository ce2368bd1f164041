"""The main job: a small token-sharded model on 2 CPU ranks against the same model on one process.

Run with `make demo` (it spawns 2 Gloo ranks itself) or under torchrun:
    torchrun --nproc-per-node 2 examples/python/demo.py
"""
from __future__ import annotations

import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import shardtensor as st

BATCH, TOKENS, WIDTH, STEPS = 2, 509, 64, 5


class TokenMixer(nn.Module):
    """MLP block, layer norm written by hand (reductions), softmax pooling over the sharded token dim."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.gain = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.query = nn.Parameter(torch.randn(width) / width ** 0.5)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = x + self.fc2(F.gelu(self.fc1(x)))
        mu = h.mean(-1, keepdim=True)
        var = h.var(-1, keepdim=True, unbiased=False)
        h = (h - mu) / torch.sqrt(var + 1e-5) * self.gain + self.bias
        weights = torch.softmax(h @ self.query, dim=1)        # softmax over the (sharded) token dim
        pooled = (weights.unsqueeze(-1) * h).sum(1)             # sum over tokens -> Partial, resolved when used
        return self.head(pooled)


def make_inputs():
    torch.manual_seed(0)
    model = TokenMixer(WIDTH)
    x = torch.randn(BATCH, TOKENS, WIDTH)
    return model, x


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_step(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = model(x)
    loss = out.square().mean()
    loss.backward()
    return out, x.grad, {n: p.grad for n, p in model.named_parameters()}


def timed(model, x):
    train_step(model, x)  # warm-up
    t0 = time.perf_counter()
    for _ in range(STEPS):
        out, gx, grads = train_step(model, x)
    return out, gx, grads, (time.perf_counter() - t0) / STEPS


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def run_rank():
    rank, world = st.init_distributed()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    model, x = make_inputs()
    st.sync_module(model, mesh)
    rss0 = peak_rss_mib()
    # Only rank 0 needs the sample; it is scattered along the token dim (uneven: 509 tokens).
    xs = st.scatter_tensor(x if rank == 0 else None, src=0, mesh=mesh, placements=[st.Shard(1)])
    out, gx, grads, t_shard = timed(model, xs)
    rss_shard = peak_rss_mib() - rss0
    out_full, gx_full = out.full_tensor(), gx.full_tensor()
    # A redistribute round trip: tokens -> features -> tokens (all-to-all, then back).
    back = xs.redistribute([st.Shard(2)]).redistribute([st.Shard(1)])
    roundtrip = rel_err(back.full_tensor(), x)
    rows = None
    if rank == 0:
        ref_model, _ = make_inputs()
        ref_model.load_state_dict(model.state_dict())
        rss1 = peak_rss_mib()
        ref_out, ref_gx, ref_grads, t_single = timed(ref_model, x)
        rss_single = peak_rss_mib() - rss1
        rows = [("output", rel_err(out_full, ref_out)), ("input grad", rel_err(gx_full, ref_gx)),
                ("redistribute round trip", roundtrip)]
        rows += [(f"grad {n}", rel_err(grads[n], ref_grads[n])) for n in ref_grads]
        rows = (rows, t_single, t_shard, rss_single)
    gathered = [None] * world
    dist.all_gather_object(gathered, (rank, rss_shard, t_shard, st.local_offsets(xs), tuple(st.to_local(xs).shape)))
    if rank == 0:
        (rows, t_single, t_shard, rss_single) = rows
        print(f"\nShardTensor demo: TokenMixer on x[{BATCH}, {TOKENS}, {WIDTH}] sharded along tokens over {world} "
              f"Gloo ranks vs one process\n")
        print(f"{'quantity':<28}{'max relative error':>20}")
        for name, err in rows:
            print(f"{name:<28}{err:>20.2e}")
        worst = max(e for _, e in rows)
        print(f"\n{'':<28}{'single device':>16}{'sharded':>12}")
        print(f"{'time per train step (ms)':<28}{t_single * 1e3:>16.2f}{t_shard * 1e3:>12.2f}")
        print(f"{'peak RSS growth (MiB)':<28}{rss_single:>16.1f}{max(g[1] for g in gathered):>12.1f}  (max over ranks)")
        for r, rss, t, off, shape in gathered:
            print(f"  rank {r}: local x {list(shape)} at offset {list(off)}, step {t * 1e3:.2f} ms, peak RSS growth {rss:.1f} MiB")
        status = "OK" if worst < 1e-4 else "MISMATCH"
        print(f"\n{status}: worst relative error {worst:.2e} (tolerance 1e-4)")
        if worst >= 1e-4:
            sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank, world, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    run_rank()


def main():
    if "RANK" in os.environ:
        run_rank()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
