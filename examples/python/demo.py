"""The main job: a small vision transformer on a height-sharded image, on 2 CPU ranks, against the same model
on one process.

Patch-embedding convolution (halo exchange where a patch straddles two shards), learned positional embedding,
pre-norm transformer blocks (LayerNorm, attention over the sharded tokens, MLP), mean-pooled head. Prints the
relative error of the output, of every parameter gradient and of the output after one SGD step (the weights a
training step produces), the step time and the per-rank peak memory.

Run with `make demo` (it spawns 2 Gloo ranks itself) or under torchrun:
    torchrun --nproc-per-node 2 examples/python/demo.py
"""
from __future__ import annotations

import os
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

BATCH, CHANNELS, HEIGHT, WIDTH, PATCH = 2, 3, 72, 48, 8
DIM, HEADS, DEPTH, CLASSES, STEPS = 48, 4, 2, 10, 5


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v)           # tokens sharded: ring or all-to-all
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(CHANNELS, DIM, PATCH, stride=PATCH)
        tokens = (HEIGHT // PATCH) * (WIDTH // PATCH)
        self.pos = nn.Parameter(torch.randn(1, tokens, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, image):
        x = self.patch(image).flatten(2).transpose(1, 2)          # [B, tokens, DIM], tokens sharded with the rows
        x = x + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(1))                    # mean over sharded tokens: a Partial sum


def make_inputs():
    torch.manual_seed(0)
    model = TinyViT()
    x = torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH)
    return model, x


def peak_mib(model, x) -> float:
    """Allocator peak of one training step on this rank (shardtensor.peak_memory)."""
    return st.peak_memory(lambda: train_step(model, x)) / 2**20


def train_step(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = model(x)
    loss = out.square().mean()
    loss.backward()
    return out, x.grad, {n: p.grad for n, p in model.named_parameters()}


def output_after_sgd_step(model, x):
    """One training step (forward, backward, SGD update), then the updated model's output."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train_step(model, x)
    opt.step()
    with torch.no_grad():
        return model(x)


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
    # Only rank 0 needs the image; it is scattered along its height (uneven rows: patches straddle shards).
    height_rows = [HEIGHT // world + (4 if r == 0 else 0) - (4 if r == world - 1 and world > 1 else 0) for r in range(world)]
    xs = st.scatter_tensor(x if rank == 0 else None, src=0, mesh=mesh, placements=[st.Shard(2)],
                           sharding_shapes={0: height_rows})
    out, gx, grads, t_shard = timed(model, xs)
    mem_shard = peak_mib(model, xs)
    out_full, gx_full = out.full_tensor(), gx.full_tensor()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    stepped = output_after_sgd_step(model, xs).full_tensor()
    # A redistribute round trip: rows -> columns -> rows (all-to-all, then back).
    back = xs.redistribute([st.Shard(3)]).redistribute([st.Shard(2)], sharding_shapes={0: height_rows})
    roundtrip = rel_err(back.full_tensor(), x)
    rows = None
    if rank == 0:
        ref_model, _ = make_inputs()
        ref_model.load_state_dict(initial)
        ref_out, ref_gx, ref_grads, t_single = timed(ref_model, x)
        mem_single = peak_mib(ref_model, x)
        rows = [("output", rel_err(out_full, ref_out)), ("input grad", rel_err(gx_full, ref_gx)),
                ("redistribute round trip", roundtrip)]
        rows += [(f"grad {n}", rel_err(grads[n], ref_grads[n])) for n in ref_grads]
        rows += [("output after one SGD step", rel_err(stepped, output_after_sgd_step(ref_model, x)))]
        rows = (rows, t_single, t_shard, mem_single)
    gathered = [None] * world
    dist.all_gather_object(gathered, (rank, mem_shard, t_shard, st.local_offsets(xs), tuple(st.to_local(xs).shape)))
    if rank == 0:
        (rows, t_single, t_shard, mem_single) = rows
        print(f"\nShardTensor demo: TinyViT ({DEPTH} blocks, width {DIM}, {HEADS} heads, patch {PATCH}) on images "
              f"[{BATCH}, {CHANNELS}, {HEIGHT}, {WIDTH}] sharded along height over {world} Gloo ranks vs one process\n")
        print(f"{'quantity':<34}{'max relative error':>20}")
        for name, err in rows:
            print(f"{name:<34}{err:>20.2e}")
        worst = max(e for _, e in rows)
        print(f"\n{'':<28}{'single device':>16}{'sharded':>12}")
        print(f"{'time per train step (ms)':<28}{t_single * 1e3:>16.2f}{t_shard * 1e3:>12.2f}")
        print(f"{'peak memory per step (MiB)':<28}{mem_single:>16.2f}{max(g[1] for g in gathered):>12.2f}  (max over ranks)")
        for r, mem, t, off, shape in gathered:
            print(f"  rank {r}: local image {list(shape)} at offset {list(off)}, step {t * 1e3:.2f} ms, peak memory {mem:.2f} MiB")
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
