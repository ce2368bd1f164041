"""Per-rank training-step memory of a 3-D U-Net (conv, strided conv down, transposed conv up, skip concatenation,
GroupNorm) against one device, over simulated ranks (``st.simulate``): ``P x per-rank peak / single-device peak``
(1.0 would be a perfect split; halos add a little), and what holds the bytes at the peak, by the op that created
them (meta simulation: the allocation tally).

    .venv/bin/python benchmarks/unet_memory/bench.py [--size 64] [--ranks 2,4] [--sim-device meta|cpu] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import shardtensor as st  # noqa: E402
from shardtensor import local_ops  # noqa: E402
from results_dir import add_out_argument, prepare  # noqa: E402


class UNet3d(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv3d(2, c, 3, padding=1), nn.GroupNorm(4, c), nn.GELU())
        self.down = nn.Conv3d(c, 2 * c, 3, stride=2, padding=1)
        self.enc2 = nn.Sequential(nn.GroupNorm(4, 2 * c), nn.GELU(), nn.Conv3d(2 * c, 2 * c, 3, padding=1))
        self.up = nn.ConvTranspose3d(2 * c, c, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv3d(2 * c, c, 3, padding=1), nn.GroupNorm(4, c), nn.GELU(), nn.Conv3d(c, 1, 1))

    def forward(self, x):
        e1 = self.enc1(x)
        return self.dec(torch.cat([self.up(self.enc2(self.down(e1))), e1], 1))


def step_peak(P, rank, size, device, attribute=False):
    """Peak of a training step above the live state on rank ``rank`` of ``P`` (P = 1: the plain model), and with
    ``attribute`` (meta only) the live bytes at the peak by creating op."""
    origin, snap = {}, {"peak": -1, "by": {}}
    orig = local_ops.LocalOpMode._run_fake

    def patched(self, func, args, kwargs):
        before = set(self._storage_bytes)
        out = orig(self, func, args, kwargs)
        for k in set(self._storage_bytes) - before:
            origin[k] = str(func)
        if self.live_bytes > snap["peak"]:
            snap["peak"] = self.live_bytes
            by = defaultdict(int)
            for k, b in self._storage_bytes.items():
                by[origin.get(k, "before the step")] += b
            snap["by"] = dict(by)
        return out

    if attribute:
        local_ops.LocalOpMode._run_fake = patched
    try:
        with st.simulate(rank, P, device=device, warn=False) as sim:
            torch.manual_seed(0)
            net = UNet3d()
            shape = (1, 2, size, size, size)
            x = sim.shard(shape, [st.Shard(2)]) if P > 1 else torch.randn(shape)
            target = torch.zeros_like(x[:, :1])

            def step():
                net.zero_grad(set_to_none=True)
                F.mse_loss(net(x), target).backward()

            step()
            net.zero_grad(set_to_none=True)
            snap["peak"] = -1
            with st.RankStats(flops=False) as s:
                step()
    finally:
        local_ops.LocalOpMode._run_fake = orig
    return s.peak_bytes, snap["by"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sim-device", default="meta", choices=["meta", "cpu"])
    add_out_argument(ap)
    args = ap.parse_args()
    prepare(args.out)
    torch.set_num_threads(1)
    attr = args.sim_device == "meta"
    single, by1 = step_peak(1, 0, args.size, args.sim_device, attr)
    lines = [f"# 3-D U-Net training step: per-rank peak against one device ({args.sim_device} simulation)", "",
             f"Command: `python benchmarks/unet_memory/bench.py {' '.join(sys.argv[1:])}`. Input (1, 2, {args.size}³) "
             "sharded along depth; peak above the live state (parameters, input) of a training step.", "",
             f"Single device: {single / 2**20:.1f} MiB.", "",
             "| P | rank | per-rank peak | P × peak / single |", "|---|---|---|---|"]
    worst = {}
    for P in (int(p) for p in args.ranks.split(",")):
        for r in sorted({0, 1, P // 2, P - 1}):
            peak, by = step_peak(P, r, args.size, args.sim_device, attr)
            lines.append(f"| {P} | {r} | {peak / 2**20:.1f} MiB | {P * peak / single:.3f} |")
            if P not in worst or peak > worst[P][0]:
                worst[P] = (peak, by, r)
    if attr:
        for P, (peak, by, r) in worst.items():
            lines += ["", f"Live at the peak by creating op, P = {P} rank {r} (× P) against one device (MiB):", "",
                      "| op | one device | P × rank |", "|---|---|---|"]
            for k in sorted(set(by1) | set(by), key=lambda k: -max(by1.get(k, 0), P * by.get(k, 0))):
                a, b = by1.get(k, 0), P * by.get(k, 0)
                if max(a, b) > 2**20:
                    lines.append(f"| {k} | {a / 2**20:.1f} | {b / 2**20:.1f} |")
    if args.sim_device == "meta":
        lines += ["", "The tally counts what ops return (no kernel workspaces). Above one device's split remain the "
                  "input window the convolution backward regathers (a copy of the saved input plus its halo rows, "
                  "`aten.full`) and the halo rows of every window; GroupNorm's outputs are `aten.mul` here (the "
                  "sharded rule's own kernels)."]
    else:
        lines += ["", "Why the CPU figure can exceed one device's: ATen picks the CPU convolution algorithm from the "
                  "*local* shape (`torch._C._select_conv_backend`): for batch 1, groups 1 and 3x3x3 kernels it uses "
                  "oneDNN (mkldnn) only when N·C·D·H > 20480 (W is not in the product), else `slow_conv3d`, whose "
                  "backward allocates im2col columns of C_in·27 × the output's voxels (27x the input). At 32³ the "
                  "decoder conv (32 channels, input 32·32·32 = 32768 > 20480) runs mkldnn on one device (4 MiB "
                  "workspace), but its depth-sharded window (1, 32, 18, 32, 32) gives 18432 and falls back to "
                  "`slow_conv3d`: 54 MiB of columns in its backward, the whole P = 2 peak (found with "
                  "torch.profiler's memory events, live allocations at the peak). Memory format, contiguity and the "
                  "halo window's layout do not change the choice (only the shape does), so it is ATen's heuristic, "
                  "not the library's. At 64³ (`--size 64 --sim-device cpu`) every window stays above the threshold "
                  "and P × peak / single is 1.19 (P = 2) and 1.22 (P = 4), near the meta tally's library surplus."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, f"unet_memory_{args.sim_device}.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
