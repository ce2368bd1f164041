"""Simulated ranks against real Gloo ranks, side by side: for each workload and P, every rank r of a real P-rank Gloo
job and rank r simulated (``shardtensor.simulate``, device "cpu") measure the same inference and training step; the
report gives, per rank, whether the collectives (calls and bytes per kind) and the peak memory agree, and the ratio
of the simulated rank's time to the real rank's, three ways (medians of ``--iters``; this thread's CPU time, so
time-slicing with other processes does not count): the whole step, its *compute* outside the library's collective
calls, and its *kernels* (CPU time inside the local aten ops alone, ``st.RankStats.kernel_cpu_s``).

Paired, so both sides see the same machine: the P real ranks and the P simulated ranks are 2P processes of one
launch, and they take turns: every timed step of one side runs while the other side's processes wait at a barrier
(blocked, using no CPU), and the side that goes first alternates. A host's speed drifts by tens of percent over
minutes here (other tenants); back-to-back runs would compare different machines.

The real job's transport threads (Gloo's TCP loop polls; its workers copy) run at ``SCHED_IDLE`` by default
(``--transport-priority idle``): they take only CPU time a rank's compute leaves free, as on a host with cores to
spare. At normal priority on 2 vCPUs they preempt the ranks' compute and slow it (``normal`` shows that; the rows
record each rank's other threads' CPU time and its run-queue wait per step either way).

The whole set runs ``--repeats`` times; the spread of the real side's repeats is the noise the ratio is judged
against (``sim_agreement.py``).

    python -m benchmarks.scaling.validate_sim --ranks 2,3,4 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import warnings

import torch

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


class Turns:
    """Whose turn it is: the 2P processes of a paired launch pass the same sequence of barriers; timed step n of the
    real side runs in slot 2n and the simulated side's in 2n + 1, or the other way round for odd n, and a process
    waits for its slot at the barrier (blocked: no CPU). ``begin()`` before a timed step, ``end()`` after it,
    ``finish()`` once at the end so every process passes every barrier."""

    def __init__(self, barrier, side: int):
        self.barrier, self.side, self.passed, self.n = barrier, side, 0, 0

    def _pass_to(self, k):
        while self.passed < k:
            self.barrier.wait()
            self.passed += 1

    def begin(self):
        self.slot = 2 * self.n + (self.side if self.n % 2 == 0 else 1 - self.side)
        self.n += 1
        self._pass_to(self.slot + 1)  # barrier k opens slot k

    def end(self):
        self._pass_to(self.slot + 2)

    def finish(self):
        self._pass_to(2 * self.n + 1)


def _schedstat(tid) -> tuple[int, int]:
    """(ns on CPU, ns waiting in the run queue) of one thread of this process (Linux; zeros elsewhere)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            run, wait, _ = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


def _threads():
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _host_sample():
    """(this thread's run-queue wait, the CPU time of this process's other threads), in seconds."""
    me = threading.get_native_id()
    others = sum(_schedstat(t)[0] for t in _threads() if t != me)
    return _schedstat(me)[1] / 1e9, others / 1e9


def idle_transport_threads():
    """Every thread of this process but this one (Gloo's TCP loop and workers, the store's) to SCHED_IDLE: they run
    only on CPU time no normal thread wants. Threads started later keep their priority; call it after the step
    has run once (every process group the step uses exists by then)."""
    me = threading.get_native_id()
    for t in _threads():
        if t != me:
            try:
                os.sched_setscheduler(t, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass  # the thread ended


def measure(workload, size, mesh, iters: int, turns: Turns, before_timing=None):
    """RankStats of inference and a training step, then per pass ``iters`` timed steps (whole thread CPU time and
    the part outside collective calls), and ``iters`` steps under the op-counting mode (CPU time inside the local
    kernels). Each timed step runs inside its turn (``turns``, see Turns)."""
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
    if before_timing:
        before_timing()
    out = {}
    for kind, fn in (("fwd", fwd), ("step", step)):
        if kind == "step":
            opt.zero_grad(set_to_none=True)
        with st.RankStats(flops=False) as s:
            fn()
        cpu, compute, kernel, rq, others = [], [], [], [], []
        for _ in range(iters):
            turns.begin()
            h0 = _host_sample()
            k0 = st._C.collective_thread_cpu_seconds()
            c0 = time.thread_time()
            fn()
            cpu.append(time.thread_time() - c0)
            # Local compute: this thread's CPU time outside the library's collective calls (issuing, waiting,
            # waking up: what a fake group's instant collectives do not cost).
            compute.append(cpu[-1] - (st._C.collective_thread_cpu_seconds() - k0))
            h1 = _host_sample()
            turns.end()
            rq.append(h1[0] - h0[0])
            others.append(h1[1] - h0[1])
        for _ in range(iters):
            # The local kernels alone (the counting mode slows the step, hence iterations of their own).
            turns.begin()
            with st.RankStats(memory=False) as k:
                fn()
            turns.end()
            kernel.append(k.kernel_cpu_s)
        med = statistics.median
        out[kind] = {"comm": {"calls": s.comm_calls, "bytes": s.comm_bytes}, "peak_bytes": s.peak_bytes,
                     "cpu_s": med(cpu), "cpu_range_s": [min(cpu), max(cpu)], "compute_s": med(compute),
                     "kernel_s": med(kernel), "runqueue_s": med(rq), "other_threads_cpu_s": med(others)}
    turns.finish()
    return out


def _watchdog():
    import faulthandler
    faulthandler.dump_traceback_later(300, exit=True)  # a hung rank shows where it is, then exits


def _paired_rank(idx, world2, port, name, iters, path, barrier, idle):
    """Process ``idx`` of a paired launch: real rank idx (< P) of a Gloo job on ``port``, else simulated rank
    idx - P. Writes its result to ``path.idx`` and leaves without teardown (a real job here hung about one time in
    three in teardown, after every result was written; not diagnosed)."""
    _watchdog()
    P = world2 // 2
    workload, size = workloads()[name]
    if idx < P:
        launch.init_process_group(idx, P, "cpu", 1, port)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("domain",))
        res = measure(workload, size, mesh, iters, Turns(barrier, 0), idle_transport_threads if idle else None)
    else:
        torch.set_num_threads(1)  # as init_process_group does for a real rank
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", st.SimulationWarning)
            with st.simulate(idx - P, P) as sim:
                res = measure(workload, size, sim.mesh, iters, Turns(barrier, 1))
    with open(f"{path}.{idx}", "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    os._exit(0)


HUNG = []  # (workload, P) of paired launches that hung (a watchdog ended them) and were rerun


def run_paired(name, P, iters, tmp, idle: bool, tries: int = 3):
    """One paired launch: ([real rank results], [simulated rank results])."""
    import torch.multiprocessing as mp
    for t in range(tries):
        try:
            # The barrier's parties are the 2P processes; the real ones talk over Gloo on the launch's port.
            launch.spawn(_paired_rank, 2 * P, (name, iters, tmp, mp.get_context("spawn").Barrier(2 * P), idle))
            break
        except mp.ProcessExitedException:
            if t == tries - 1:
                raise
            HUNG.append([name, P])
            print(f"{name} P={P}: a process exited (hung?), rerunning the launch", flush=True)
    out = []
    for i in range(2 * P):
        with open(f"{tmp}.{i}") as f:
            out.append(json.load(f))
        os.remove(f"{tmp}.{i}")
    return out[:P], out[P:]


def compare(name, size_label, P, reps):
    """Per rank and pass, one row with one entry per repeat; reps = [(real, sim)] per repeat."""
    rows = []
    for r in range(P):
        for kind in ("fwd", "step"):
            a = [real[r][kind] for real, _ in reps]
            b = [sim[r][kind] for _, sim in reps]
            row = {"workload": name, "size": size_label, "ranks": P, "rank": r, "kind": kind,
                   "comm_equal": [x["comm"] == y["comm"] for x, y in zip(a, b)],
                   "peak_real": [x["peak_bytes"] for x in a], "peak_sim": [y["peak_bytes"] for y in b],
                   "cpu_real_range_s": [x["cpu_range_s"] for x in a], "cpu_sim_range_s": [y["cpu_range_s"] for y in b],
                   "bytes": sum(b[0]["comm"]["bytes"].values()), "calls": sum(b[0]["comm"]["calls"].values())}
            for key in ("cpu", "compute", "kernel", "runqueue", "other_threads_cpu"):
                row[f"{key}_real_s"] = [x[f"{key}_s"] for x in a]
                row[f"{key}_sim_s"] = [y[f"{key}_s"] for y in b]
            rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--workloads", default="vit,transolver,stormscope")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="paired launches per workload and P")
    ap.add_argument("--transport-priority", default="idle", choices=["idle", "normal"],
                    help="the real ranks' transport threads: SCHED_IDLE (default; they use only CPU the compute "
                         "leaves free) or normal priority (they compete with it; writes sim_validation_normal.json)")
    results_dir.add_out_argument(ap)
    args = ap.parse_args(argv)
    results_dir.prepare(args.out)
    # The code that runs is the tree as it is now (edits during the run do not count).
    commit = results_dir.git("rev-parse", "--short", "HEAD") + ("+dirty" if results_dir.tree_is_dirty() else "")
    idle = args.transport_priority == "idle"
    rows = []
    for name in args.workloads.split(","):
        workload, size = workloads()[name]
        for P in (int(p) for p in args.ranks.split(",")):
            tmp = os.path.join(args.out, f".validate_{name}_{P}.json")
            reps = [run_paired(name, P, args.iters, tmp, idle) for _ in range(args.repeats)]
            rows += compare(name, workload.label(size), P, reps)
            for key, label in sim_agreement.MEASURES:
                for s in sim_agreement.summarize(rows[-2 * P:], key):
                    print(f"{name} P={P} {s['kind']}: {label} sim/real {s['ratio']:.3f} (repeats "
                          f"{s['ratio_range'][0]:.3f}-{s['ratio_range'][1]:.3f}), real spread "
                          f"{s['real_spread'] if s['real_spread'] is None else round(s['real_spread'], 3)}, "
                          f"within noise: {s['within_noise']}", flush=True)
    meta = {"command": "python -m benchmarks.scaling.validate_sim " + " ".join(argv or sys.argv[1:]),
            "commit": commit, "torch": torch.__version__, "loadavg": results_dir.loadavg(),
            "iters": args.iters, "repeats": args.repeats, "pairing": "interleaved turns",
            "transport_priority": args.transport_priority, "cpus": os.cpu_count(), "launches_rerun": HUNG}
    path = os.path.join(args.out, "sim_validation" + ("" if idle else "_normal"))
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, **{sim_agreement.summary_key(key): sim_agreement.summarize(rows, key)
                                    for key, _ in sim_agreement.MEASURES}, "rows": rows}, f, indent=1)
    print(f"wrote {path}.json")


if __name__ == "__main__":
    main()
