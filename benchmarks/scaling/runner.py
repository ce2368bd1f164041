"""The workload CLI: strong and weak scaling of inference and of a training step, per-rank memory and
communication, a correctness check against one device first, and a 2-D (data x domain) mesh with DDP or FSDP2.

Launch: ``--ranks N`` spawns Gloo ranks itself, once per rank count (1, 2, 4, ..., N; 1 = the plain single-device
model, no ShardTensor); under torchrun the world size is the rank count and rank 0 also measures the single-device
baseline while the others wait (``--no-baseline`` skips it).
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from benchmarks import results_dir

from . import launch, plots, report, simulation
from .check import check, fmt_errs
from .measure import run_cases
from .parallel import build_meshes

def parse_args(workload, argv=None):
    ap = argparse.ArgumentParser(description=f"{workload.title}: strong/weak scaling, per-rank memory and "
                                 "communication of a domain-parallel model (ShardTensor)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="largest rank count when self-spawning (ignored under torchrun)")
    ap.add_argument("--rank-counts", default=None, help="comma-separated rank counts (default 1,2,4,...,--ranks)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model and data live")
    ap.add_argument("--mesh", default=None, help="DxM: 2-D mesh, D data-parallel groups of M domain ranks (sample "
                    "sharded on the domain axis, gradients averaged over the data axis)")
    ap.add_argument("--data-parallel", default="ddp", choices=["ddp", "fsdp2"], help="wrapper on the data axis of --mesh")
    ap.add_argument("--sizes", default=None, help="global sizes of the strong sweep (workload syntax, comma-separated)")
    ap.add_argument("--weak-base", default=None, help="per-rank size of weak scaling")
    ap.add_argument("--no-weak", action="store_true", help="skip weak scaling")
    ap.add_argument("--no-train", action="store_true", help="time inference only")
    ap.add_argument("--no-baseline", action="store_true", help="under torchrun: skip the single-device baseline")
    ap.add_argument("--batch", type=int, default=1, help="samples per domain group")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations before timing")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations (median reported, range as error bars)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (and for the baseline)")
    ap.add_argument("--check-tol", type=float, default=1e-4, help="max error relative to the largest reference value")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check (not recommended)")
    ap.add_argument("--check-warn-only", action="store_true", help="record a failed correctness check in the "
                    "results (headline of the report) and time anyway, instead of aborting")
    ap.add_argument("--system-malloc", dest="cache_malloc", action="store_false",
                    help="CPU: keep glibc's default of returning large freed blocks to the OS (by default the "
                    "spawned ranks keep them, see MALLOC_ENV)")
    ap.add_argument("--trace-comm", action="store_true", help="attribute forward collectives to modules (report)")
    ap.add_argument("--quick", action="store_true", help="CI-sized model and sizes")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    results_dir.add_out_argument(ap)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG (and Markdown) from the JSON")
    simulation.add_args(ap)
    workload.add_args(ap)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def stem(workload, args) -> str:
    s = workload.name
    if args.device != "cpu":
        s += f"_{args.device}"
    if args.mesh:
        s += f"_mesh{args.mesh}_{args.data_parallel}"
    if args.quick:
        s += "_quick"
    return s + (f"_{args.tag}" if args.tag else "")


def mesh_shape(args, world: int) -> tuple[int, int]:
    """(data, domain) for a launch of ``world`` ranks."""
    if args.mesh and world > 1:
        d, m = (int(v) for v in args.mesh.lower().split("x"))
        if d * m != world:
            raise SystemExit(f"--mesh {args.mesh} needs {d * m} ranks, got {world}")
        return d, m
    return 1, world


def plan(workload, args, world: int) -> list[dict]:
    """The cases one launch of ``world`` ranks runs: the strong sweep (every size, skipping the ones the
    workload cannot shard that way) and the weak-scaling size; a size in both is run once and tagged twice."""
    data, domain = mesh_shape(args, world)
    cases = {}
    for size in workload.sizes(args):
        cases.setdefault(workload.label(size), {"size": size, "modes": []})["modes"].append("strong")
    if not args.no_weak and not args.mesh:
        size = workload.weak_size(workload.weak_base(args), domain)
        cases.setdefault(workload.label(size), {"size": size, "modes": []})["modes"].append("weak")
    out = []
    for c in cases.values():
        why = workload.supports(c["size"], domain)
        out.append(dict(c, ranks=world, data=data, domain=domain, skip=why))
    return sorted(out, key=lambda c: workload.elements(c["size"]))


def rank_main(rank, world, args, workload, include_single: bool):
    """Everything one rank does in one launch; returns (rows, check errors) on rank 0."""
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    device = launch.pick_device(args.device, int(os.environ.get("LOCAL_RANK", rank)))
    import shardtensor  # noqa: F401  (loads the backend)
    rows, check_errs = [], None
    cases = plan(workload, args, world)
    if world > 1:
        meshes = build_meshes(args, world, device, *mesh_shape(args, world))
        if not args.no_check:
            cfg = workload.config(args)
            check_errs = check(workload, cfg, args, workload.check_size(args), device, meshes)
            if rank == 0:
                print(f"correctness at {workload.label(workload.check_size(args))} on {meshes['data']}x"
                      f"{meshes['domain']} ranks: {fmt_errs(check_errs)}", flush=True)
        rows += run_cases(workload, args, cases, device, meshes, single=False, rank=rank)
    if include_single:
        # The plain single-device model on rank 0 while the others wait (a torchrun launch), or alone.
        if rank == 0:
            single_cases = [dict(c, ranks=1, data=1, domain=1, skip=None) for c in plan(workload, args, 1)]
            rows += run_cases(workload, args, single_cases, device, None, single=True, rank=rank)
        if world > 1:
            dist.barrier()
    return rows, check_errs


def _spawned(rank, world, port, args, workload, out_path):
    faulthandler.enable(all_threads=True)  # a rank that aborts in native code still shows where it was
    launch.init_process_group(rank, world, args.device, args.threads, port)
    try:
        rows, errs = rank_main(rank, world, args, workload, include_single=(world == 1))
        if rank == 0:  # all ranks are past their last collective; written whole (rename) or not at all
            with open(out_path + ".part", "w") as f:
                json.dump({"rows": rows, "check": errs}, f)
            os.replace(out_path + ".part", out_path)
    finally:
        dist.destroy_process_group()


def _complete(path: str) -> bool:
    """True if a launch's result file exists and parses (rank 0 writes it in one go after every case)."""
    try:
        with open(path) as f:
            return "rows" in json.load(f)
    except (OSError, ValueError):
        return False


def rank_counts(args) -> list[int]:
    if args.rank_counts:
        return sorted({int(v) for v in args.rank_counts.split(",")})
    if args.mesh:
        d, m = (int(v) for v in args.mesh.lower().split("x"))
        return [1, d * m]
    out, p = [1], 2
    while p < args.ranks:
        out.append(p)
        p *= 2
    return sorted(set(out + [args.ranks]))


def _loadavg():
    """1, 5 and 15 minute load averages (other jobs on a shared machine skew the timings)."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[:3]
    except OSError:
        return None


def meta(workload, args, wall: float, checks: dict) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
    # Uncommitted code changes mark the commit; regenerated result files (written by earlier runs) do not.
    dirty = results_dir.tree_is_dirty()
    load = _loadavg()
    script = os.path.relpath(sys.argv[0], os.path.join(here, "..", "..")) if sys.argv and sys.argv[0] else "?"
    dev = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    if args.device == "cuda":
        dev["gpu"] = torch.cuda.get_device_name(0)
        dev["gpus"] = torch.cuda.device_count()
    return {"command": f"python {script} " + " ".join(args.argv), "workload": workload.name, "device": args.device,
            "torch": torch.__version__, "commit": commit + ("+dirty" if dirty else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "loadavg_at_end": load, "threads_per_rank": args.threads, "batch": args.batch, "warmup": args.warmup,
            "iters": args.iters, "config": workload.config(args), "mesh": args.mesh,
            "data_parallel": args.data_parallel if args.mesh else None, "checks": checks, "wall_s": round(wall, 1),
            "malloc_env": {k: os.environ[k] for k in MALLOC_ENV if k in os.environ}, "unit": workload.unit,
            "machine": dev, "torchrun": launch.under_torchrun(), "notes": workload.notes(workload.config(args))}


def main(workload, argv=None):
    args = parse_args(workload, argv)
    workload.config(args)  # resolves the configuration once (the spawned ranks get the workload pickled)
    if args.simulate:
        return simulation.run(workload, args)
    results_dir.prepare(args.out, measuring=not args.plot_only)
    path = os.path.join(args.out, stem(workload, args))
    if args.plot_only:
        with open(path + ".json") as f:
            data = json.load(f)
        report.write_markdown(data, path + ".md")
        plots.plot(data, path + ".png")
        return
    if args.mesh and args.data_parallel == "fsdp2":
        from .parallel import FSDP2_REFUSAL
        if FSDP2_REFUSAL:
            raise SystemExit(FSDP2_REFUSAL)
    if args.mesh:
        from .parallel import DDP_REFUSAL
        if args.data_parallel == "ddp" and DDP_REFUSAL:
            raise SystemExit(DDP_REFUSAL)
    if args.device == "cpu" and args.cache_malloc and not launch.under_torchrun():
        # glibc returns large freed blocks to the OS (mmap/munmap, trim), so every step page-faults its big
        # temporaries back in: measured here, that doubled a no_grad forward's CPU time (freed early) against a
        # training forward (kept alive). Keeping them, like CUDA's caching allocator, times the model instead.
        # Read by glibc at process start, so it reaches the spawned ranks (under torchrun, export it yourself).
        for k in MALLOC_ENV:
            os.environ.setdefault(k, MALLOC_ENV[k])
    t0 = time.perf_counter()
    load_start = _loadavg()
    rows, checks, aborts = [], {}, []
    if launch.under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        faulthandler.enable(all_threads=True)
        launch.init_process_group(rank, world, args.device, args.threads)
        got, errs = rank_main(rank, world, args, workload, include_single=not args.no_baseline or world == 1)
        if rank != 0:
            dist.destroy_process_group()
            return
        rows, checks = got, ({str(world): errs} if errs else {})
        dist.destroy_process_group()
    else:
        for world in rank_counts(args):
            tmp = os.path.join(tempfile.gettempdir(), f"{os.path.basename(path)}.P{world}.{os.getpid()}.json")
            if os.path.exists(tmp):
                os.remove(tmp)
            for attempt in (1, 2):
                try:
                    launch.spawn(_spawned, world, (args, workload, tmp))
                    break
                except Exception as e:  # a rank raised: show its traceback, stop with its message
                    print(str(e), file=sys.stderr)
                    last = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
                    # A rank killed by a signal: an intermittent native abort ("terminate called without an
                    # active exception", no Python frame) seen a few times in ~40 launches, after the last case,
                    # while the processes were shutting down. If rank 0 already wrote the results (written only
                    # after every rank finished every case), they are complete and kept; otherwise the launch is
                    # retried once. Either way it is recorded; Python errors are not retried.
                    if "terminated with signal" in last and _complete(tmp):
                        aborts.append(f"launch on {world} ranks: {last} after the results were written; kept")
                        break
                    if attempt == 1 and "terminated with signal" in last:
                        aborts.append(f"launch on {world} ranks: {last}; retried")
                        if os.path.exists(tmp):
                            os.remove(tmp)
                        print(f"{workload.name}: {last}; retrying the launch once", file=sys.stderr)
                        continue
                    raise SystemExit(f"{workload.name}: the launch on {world} ranks failed: {last}")
            with open(tmp) as f:
                got = json.load(f)
            os.remove(tmp)
            rows += got["rows"]
            if got["check"]:
                checks[str(world)] = got["check"]
    report.annotate_memory_ratios(rows)  # the baseline comes from another launch: derived once all are in
    data = {"meta": dict(meta(workload, args, time.perf_counter() - t0, checks), loadavg_at_start=load_start,
                         aborted_launches=aborts),
            "rows": rows}
    with open(path + ".json", "w") as f:
        json.dump(data, f, indent=1)
    report.write_markdown(data, path + ".md")
    plots.plot(data, path + ".png")
    print(open(path + ".md").read())
    print(f"wrote {path}.json/.md/.png")
