"""Simulated ranks against real Gloo ranks, side by side: for each workload and P, every rank r of a real P-rank Gloo
run and rank r simulated in one process (``shardtensor.simulate``, device "cpu") measure the same inference and
training step; the report gives, per rank, whether the collectives (calls and bytes per kind) and the peak memory
agree, and the ratio of the simulated rank's CPU time to the real rank's (median of ``--iters``; this thread's CPU
time, so time-slicing with other processes does not count, but cache and memory-bandwidth contention do).

    python -m benchmarks.scaling.validate_sim --ranks 2,3,4 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import shardtensor as st  # noqa: E402

from benchmarks import results_dir  # noqa: E402
from benchmarks.scaling import launch  # noqa: E402


def workloads():
    """Small CPU configurations of the three workloads (name -> (Workload, cfg args, size))."""
    import importlib.util

    def load(name):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", name, "bench.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    vit, tr, ss = load("vit"), load("transolver"), load("stormscope")
    return {"vit": (vit.ViT(), (96, 96)), "transolver": (tr.Transolver(), 3001), "stormscope": (ss.StormScope(), (48, 84))}


def _cfg(workload):
    from benchmarks.scaling.runner import parse_args
    args = parse_args(workload, ["--quick"])
    return workload.config(args)


def measure(workload, size, mesh, iters: int):
    """RankStats of inference and a training step, then ``iters`` timed steps (thread CPU time)."""
    cfg = _cfg(workload)
    torch.manual_seed(0)
    model = workload.build(cfg, size)
    st.sync_module(model, mesh)
    inputs, target = workload.make_input(cfg, size, 1, 1000)
    from benchmarks.scaling.data import shard_inputs
    inputs, target = shard_inputs(workload, inputs, target, mesh, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def fwd():
        with torch.no_grad():
            model(*inputs)

    def step():
        opt.zero_grad(set_to_none=True)
        workload.loss(model(*inputs), target, inputs).backward()
        opt.step()

    step()
    out = {}
    for kind, fn in (("fwd", fwd), ("step", step)):
        if kind == "step":
            opt.zero_grad(set_to_none=True)
        with st.RankStats(flops=False) as s:
            fn()
        cpu = []
        for _ in range(iters):
            c0 = time.thread_time()
            fn()
            cpu.append(time.thread_time() - c0)
        out[kind] = {"comm": {"calls": s.comm_calls, "bytes": s.comm_bytes}, "peak_bytes": s.peak_bytes,
                     "cpu_s": statistics.median(cpu), "cpu_range_s": [min(cpu), max(cpu)]}
    return out


def _real_rank(rank, world, port, name, iters, path):
    import faulthandler
    faulthandler.dump_traceback_later(240, exit=True)  # a hung rank shows where it is, then exits
    launch.init_process_group(rank, world, "cpu", 1, port)
    from torch.distributed.device_mesh import init_device_mesh
    workload, size = workloads()[name]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    res = measure(workload, size, mesh, iters)
    got = [None] * world
    dist.all_gather_object(got, res)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--workloads", default="vit,transolver,stormscope")
    ap.add_argument("--iters", type=int, default=5)
    results_dir.add_out_argument(ap)
    args = ap.parse_args(argv)
    results_dir.prepare(args.out)
    torch.set_num_threads(1)
    rows = []
    for name in args.workloads.split(","):
        workload, size = workloads()[name]
        for P in (int(p) for p in args.ranks.split(",")):
            tmp = os.path.join(args.out, f".validate_{name}_{P}.json")
            launch.spawn(_real_rank, P, (name, args.iters, tmp))
            with open(tmp) as f:
                real = json.load(f)
            os.remove(tmp)
            for r in range(P):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", st.SimulationWarning)
                    with st.simulate(r, P) as sim:
                        sim_res = measure(workload, size, sim.mesh, args.iters)
                for kind in ("fwd", "step"):
                    a, b = real[r][kind], sim_res[kind]
                    rows.append({"workload": name, "size": workload.label(size), "ranks": P, "rank": r, "kind": kind,
                                 "comm_equal": a["comm"] == b["comm"], "peak_real": a["peak_bytes"],
                                 "peak_sim": b["peak_bytes"], "cpu_real_s": a["cpu_s"], "cpu_sim_s": b["cpu_s"],
                                 "cpu_real_range_s": a["cpu_range_s"], "cpu_sim_range_s": b["cpu_range_s"],
                                 "bytes": sum(b["comm"]["bytes"].values())})
                    print(f"{name} P={P} rank {r} {kind}: collectives {'equal' if rows[-1]['comm_equal'] else 'DIFFER'}, "
                          f"peak {a['peak_bytes']} real / {b['peak_bytes']} sim, CPU time sim/real "
                          f"{b['cpu_s'] / a['cpu_s']:.2f}", flush=True)
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    meta = {"command": "python -m benchmarks.scaling.validate_sim " + " ".join(argv or sys.argv[1:]),
            "commit": commit + ("+dirty" if results_dir.tree_is_dirty() else ""),
            "torch": torch.__version__, "loadavg": results_dir.loadavg(), "iters": args.iters}
    path = os.path.join(args.out, "sim_validation")
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}.json")


if __name__ == "__main__":
    main()
