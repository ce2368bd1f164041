"""Host time of one simulated training step against the simulated world size P: a height-sharded conv + layer-norm
step on a meta simulation (``st.simulate(..., device="meta")``), each P in its own process.

    .venv/bin/python benchmarks/scaling/sim_host_time.py [--worlds 1024,2048,4096,8192]

Under a meta simulation every tensor op is a Python dispatch through the fake-tensor mode, so host work that grows
with P (a tensor op per peer in an exchange) shows directly; the library's exchanges touch only the peers that
exchange rows, so the step's time should not grow with P. Prints a table (seconds to plan the shard, seconds per
step); nothing is written.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

STEP = r"""
import sys, time, torch, torch.nn.functional as F
import shardtensor as st
P = int(sys.argv[1])
with st.simulate(P // 2, P, device="meta", warn=False) as sim:
    t0 = time.perf_counter()
    x = sim.shard((1, 3, 4 * P, 64), [st.Shard(2)], requires_grad=True)
    t1 = time.perf_counter()
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    y = F.layer_norm(F.conv2d(x, w, padding=1).permute(0, 2, 3, 1), (4,))
    y.sum().backward()
    t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f}")
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1024,2048,4096,8192")
    args = parser.parse_args()
    print("| P | sim.shard (s) | training step (s) |\n|---|---|---|")
    for p in (int(v) for v in args.worlds.split(",")):
        out = subprocess.run([sys.executable, "-c", STEP, str(p)], capture_output=True, text=True, check=True)
        shard, step = out.stdout.split()
        print(f"| {p} | {shard} | {step} |", flush=True)


if __name__ == "__main__":
    main()
