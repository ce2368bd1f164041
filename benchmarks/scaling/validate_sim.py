"""Simulated ranks against real Gloo ranks, side by side: for each workload and P, every rank r of a real P-rank Gloo
run and rank r simulated (``shardtensor.simulate``, device "cpu") measure the same inference and training step;
the report gives, per rank, whether the collectives (calls and bytes per kind) and the peak memory agree, and the
ratio of the simulated rank's CPU time to the real rank's (median of ``--iters``; this thread's CPU time, so
time-slicing with other processes does not count, but cache and memory-bandwidth contention do).

The P simulated ranks run as P processes started together, one torch thread each, like the real job: the real
ranks share this machine's cores, caches and memory bandwidth, and a simulated rank alone would not
(``--sim-serial``: one after another in this process, to show that effect). Both sides start every timed iteration
together (a barrier outside the timed region). The real job and the simulated set run ``--repeats`` times, back to
back; the run-to-run spread of the real job is the noise the ratio is judged against (``sim_agreement.py``).

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
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import shardtensor as st  # noqa: E402

from benchmarks import results_dir  # noqa: E402
from benchmarks.scaling import launch, sim_agreement  # noqa: E402


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


def measure(workload, size, mesh, iters: int, sync=None):
    """RankStats of inference and a training step, then ``iters`` timed steps (thread CPU time); ``sync()`` runs
    before each timed step, outside the timed region, so concurrent ranks start each step together."""
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
        cpu, compute = [], []
        for _ in range(iters):
            if sync:
                sync()
            k0 = st._C.collective_thread_cpu_seconds()
            c0 = time.thread_time()
            fn()
            cpu.append(time.thread_time() - c0)
            # Local compute: this thread's CPU time outside the library's collective calls (issuing, waiting,
            # waking up: what a fake group's instant collectives do not cost).
            compute.append(cpu[-1] - (st._C.collective_thread_cpu_seconds() - k0))
        out[kind] = {"comm": {"calls": s.comm_calls, "bytes": s.comm_bytes}, "peak_bytes": s.peak_bytes,
                     "cpu_s": statistics.median(cpu), "cpu_range_s": [min(cpu), max(cpu)],
                     "compute_s": statistics.median(compute)}
    return out


def _watchdog():
    import faulthandler
    faulthandler.dump_traceback_later(120, exit=True)  # a hung rank shows where it is, then exits


def collective_cpu_per_call(n: int = 50) -> float:
    """This thread's CPU time for one small Gloo all-to-all: issuing it, waiting and waking up (the fake group of a
    simulated rank costs about nothing). An estimate of what each real collective adds to a real rank's CPU time
    (kinds and sizes differ; the call from Python adds its own dispatch)."""
    x = torch.zeros(256 * dist.get_world_size())  # all_to_all_single splits it evenly
    y = torch.empty_like(x)
    for _ in range(5):
        dist.all_to_all_single(y, x)
    dist.barrier()
    c0 = time.thread_time()
    for _ in range(n):
        dist.all_to_all_single(y, x)
    return (time.thread_time() - c0) / n


def _real_rank(rank, world, port, name, iters, path):
    _watchdog()
    launch.init_process_group(rank, world, "cpu", 1, port)
    from torch.distributed.device_mesh import init_device_mesh
    workload, size = workloads()[name]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    res = measure(workload, size, mesh, iters, sync=dist.barrier)
    res["collective_cpu_s"] = collective_cpu_per_call()
    got = [None] * world
    dist.all_gather_object(got, res)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()
    # Leave without tearing down this frame's objects: a real job here hung about one time in three in that
    # teardown, after every result was written (the watchdog showed no Python frame left; not yet diagnosed).
    sys.stdout.flush()
    os._exit(0)


def _simulate(rank, world, name, iters, sync=None):
    workload, size = workloads()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", st.SimulationWarning)
        with st.simulate(rank, world) as sim:
            return measure(workload, size, sim.mesh, iters, sync)


def _sim_rank(rank, world, _port, name, iters, path, barrier):
    _watchdog()
    torch.set_num_threads(1)  # as init_process_group does for a real rank
    res = _simulate(rank, world, name, iters, barrier.wait)
    with open(f"{path}.{rank}", "w") as f:
        json.dump(res, f)


HUNG = []  # (workload, P) of real jobs that hung (the watchdog ended them) and were rerun


def run_real(name, P, iters, tmp, tries: int = 3):
    # Should a real job still hang, its rank's watchdog ends it and the job is rerun; the report counts reruns.
    for t in range(tries):
        try:
            launch.spawn(_real_rank, P, (name, iters, tmp))
            break
        except mp.ProcessExitedException:
            if t == tries - 1:
                raise
            HUNG.append([name, P])
            print(f"{name} P={P}: a real rank exited (hung?), rerunning the job", flush=True)
    with open(tmp) as f:
        real = json.load(f)
    os.remove(tmp)
    return real


def run_sim(name, P, iters, tmp, serial: bool):
    """The P simulated ranks: concurrent processes started together (default), or one after another here."""
    if serial:
        return [_simulate(r, P, name, iters) for r in range(P)]
    launch.spawn(_sim_rank, P, (name, iters, tmp, mp.get_context("spawn").Barrier(P)))
    out = []
    for r in range(P):
        with open(f"{tmp}.{r}") as f:
            out.append(json.load(f))
        os.remove(f"{tmp}.{r}")
    return out


def compare(name, size_label, P, reps):
    """Per rank and pass, one row with one entry per repeat; reps = [(real, sim)] per repeat."""
    rows = []
    for r in range(P):
        for kind in ("fwd", "step"):
            a = [real[r][kind] for real, _ in reps]
            b = [sim[r][kind] for _, sim in reps]
            rows.append({"workload": name, "size": size_label, "ranks": P, "rank": r, "kind": kind,
                         "comm_equal": [x["comm"] == y["comm"] for x, y in zip(a, b)],
                         "peak_real": [x["peak_bytes"] for x in a], "peak_sim": [y["peak_bytes"] for y in b],
                         "cpu_real_s": [x["cpu_s"] for x in a], "cpu_sim_s": [y["cpu_s"] for y in b],
                         "compute_real_s": [x["compute_s"] for x in a], "compute_sim_s": [y["compute_s"] for y in b],
                         "cpu_real_range_s": [x["cpu_range_s"] for x in a],
                         "cpu_sim_range_s": [y["cpu_range_s"] for y in b],
                         "bytes": sum(b[0]["comm"]["bytes"].values()),
                         "calls": sum(b[0]["comm"]["calls"].values()),
                         "collective_cpu_s": [real[r]["collective_cpu_s"] for real, _ in reps]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--workloads", default="vit,transolver,stormscope")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="real jobs and simulated sets per workload and P")
    ap.add_argument("--sim-serial", action="store_true",
                    help="simulate the ranks one after another in this process, each alone on the machine "
                         "(writes sim_validation_serial.json)")
    results_dir.add_out_argument(ap)
    args = ap.parse_args(argv)
    results_dir.prepare(args.out)
    torch.set_num_threads(1)
    rows = []
    for name in args.workloads.split(","):
        workload, size = workloads()[name]
        for P in (int(p) for p in args.ranks.split(",")):
            tmp = os.path.join(args.out, f".validate_{name}_{P}.json")
            reps = [(run_real(name, P, args.iters, tmp), run_sim(name, P, args.iters, tmp, args.sim_serial))
                    for _ in range(args.repeats)]
            rows += compare(name, workload.label(size), P, reps)
            for s in sim_agreement.summarize(rows[-2 * P:], "compute"):
                print(f"{name} P={P} {s['kind']}: local compute sim/real {s['ratio']:.3f} "
                      f"(repeats {s['ratio_range'][0]:.3f}-{s['ratio_range'][1]:.3f}), within noise: "
                      f"{s['within_noise']}", flush=True)
            for s in sim_agreement.summarize(rows[-2 * P:]):
                print(f"{name} P={P} {s['kind']}: CPU time sim/real {s['ratio']:.3f} "
                      f"(repeats {s['ratio_range'][0]:.3f}-{s['ratio_range'][1]:.3f}), real spread "
                      f"{s['real_spread'] if s['real_spread'] is None else round(s['real_spread'], 3)}, "
                      f"within noise: {s['within_noise']}", flush=True)
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    meta = {"command": "python -m benchmarks.scaling.validate_sim " + " ".join(argv or sys.argv[1:]),
            "commit": commit + ("+dirty" if results_dir.tree_is_dirty() else ""),
            "torch": torch.__version__, "loadavg": results_dir.loadavg(), "iters": args.iters,
            "repeats": args.repeats, "sim": "serial" if args.sim_serial else "concurrent", "cpus": os.cpu_count(),
            "real_jobs_rerun": HUNG}
    path = os.path.join(args.out, "sim_validation" + ("_serial" if args.sim_serial else ""))
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, "summary": sim_agreement.summarize(rows),
                   "summary_compute": sim_agreement.summarize(rows, "compute"), "rows": rows}, f, indent=1)
    print(f"wrote {path}.json")


if __name__ == "__main__":
    main()
