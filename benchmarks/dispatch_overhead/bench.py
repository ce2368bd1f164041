"""Dispatch overhead of ShardTensor ops, from Python.

For each op: the time per call on a plain local tensor and on a ShardTensor wrapping that same local tensor
(Shard(0) on a 1-rank mesh), and the difference, the per-op cost ShardTensor adds. Small tensors ([64, 32]
float32, CPU) so the kernel is cheap and the overhead dominates. Single process, world size 1, Gloo over a
FileStore; the library issues no collective on a size-1 mesh dim (checked: the comm counter must stay at 0).

    .venv/bin/python benchmarks/dispatch_overhead/bench.py                 # also what `make bench` runs
    .venv/bin/python benchmarks/dispatch_overhead/bench.py --repeat 3 --min-time 0.02   # quicker

Timing: timeit-style. For each op, `number` calls per sample (autoranged so one sample takes about
--min-time seconds), `--repeat` samples of local and ShardTensor interleaved, median per call reported.

Writes dispatch_overhead.json (figures, command, torch version, nproc, date, commit) into --out (default: the
git-ignored benchmarks/results/local; --out benchmarks/results updates the committed results, from a clean tree
or with --commit for a snapshot build). With --md it also writes dispatch_overhead.md there, a table of these
figures together with the C++ figures parsed from the summary at the end of dispatch_overhead_cpp.txt in the same
folder (when present).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import timeit

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

try:
    import shardtensor as st
except ModuleNotFoundError:  # no .pth / install in this environment: the source tree's package (built by `make build`)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import shardtensor as st
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from results_dir import add_out_argument, prepare  # noqa: E402
TARGET_US = 5.0
ROWS, COLS, OUT = 64, 32, 16

# name -> (grad mode, fn(x, y, w, b)). Same ops as bench.cpp.
OPS = {
    "add": (False, lambda x, y, w, b: x + y),
    "mul": (False, lambda x, y, w, b: x * y),
    "sum": (False, lambda x, y, w, b: x.sum()),          # sharded: reduces the sharded dim -> Partial(sum)
    "sum_dim1": (False, lambda x, y, w, b: x.sum(1)),    # keeps Shard(0)
    "sum_dim0": (False, lambda x, y, w, b: x.sum(0)),    # reduces the sharded dim -> Partial(sum)
    "view": (False, lambda x, y, w, b: x.view(ROWS, 4, COLS // 4)),
    "linear": (False, lambda x, y, w, b: F.linear(x, w, b)),
    # Grad mode on, every input (and the plain weight/bias) requires grad; forward only (records the graph).
    "add_grad": (True, lambda x, y, w, b: x + y),
    "linear_grad": (True, lambda x, y, w, b: F.linear(x, w, b)),
}


def init_single_rank():
    """World size 1: Gloo over a FileStore, a 1-D CPU DeviceMesh of size 1."""
    fd, path = tempfile.mkstemp(prefix="st_bench_store_")
    os.close(fd)
    os.unlink(path)
    store = dist.FileStore(path, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("domain",)), path


def make_inputs(mesh, grad: bool):
    torch.manual_seed(0)
    x, y = torch.randn(ROWS, COLS), torch.randn(ROWS, COLS)
    w, b = torch.randn(OUT, COLS), torch.randn(OUT)
    X = st.from_local(x, mesh, [st.Shard(0)], "even", global_shape=x.shape)
    Y = st.from_local(y, mesh, [st.Shard(0)], "even", global_shape=y.shape)
    if grad:
        for t in (x, y, w, b, X, Y):
            t.requires_grad_(True)
    return x, y, w, b, X, Y


def autorange(fn, min_time: float) -> int:
    number = 1
    while True:
        t = timeit.timeit(fn, number=number)
        if t >= min_time:
            return number
        number *= 2 if t <= 0 else max(2, min(10, int(1.5 * min_time / t) + 1))


def bench_op(name, mesh, repeat: int, min_time: float) -> dict:
    grad, fn = OPS[name]
    with torch.set_grad_enabled(grad):
        x, y, w, b, X, Y = make_inputs(mesh, grad)
        expect, got = fn(x, y, w, b), fn(X, Y, w, b)
        if not torch.allclose(expect.detach(), st.to_local(got).detach(), atol=1e-5, rtol=1e-5):
            raise AssertionError(f"{name}: ShardTensor result differs from the local result")
        local = lambda: fn(x, y, w, b)  # noqa: E731
        shard = lambda: fn(X, Y, w, b)  # noqa: E731
        for f in (local, shard):  # warm-up
            timeit.timeit(f, number=200)
        number = max(autorange(local, min_time), autorange(shard, min_time))
        tl, ts = [], []
        for _ in range(repeat):  # interleaved, so drift hits both sides alike
            tl.append(timeit.timeit(local, number=number) / number)
            ts.append(timeit.timeit(shard, number=number) / number)
    lu, su = statistics.median(tl) * 1e6, statistics.median(ts) * 1e6
    return {
        "op": name, "grad": grad, "local_us": lu, "shard_us": su, "added_us": su - lu,
        "target_met": (su - lu) <= TARGET_US, "number": number, "repeat": repeat,
        "local_samples_us": [t * 1e6 for t in tl], "shard_samples_us": [t * 1e6 for t in ts],
    }


def git_commit() -> dict:
    try:
        sha = subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True,
                                      stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "-C", ROOT, "status", "--porcelain", "--", "src", "include",
                                         "python"], text=True, stderr=subprocess.DEVNULL).strip()
        return {"commit": sha, "library_sources_modified": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "library_sources_modified": None}


def nproc() -> int:
    try:
        return int(subprocess.check_output(["nproc"], text=True).strip())
    except (OSError, subprocess.CalledProcessError, ValueError):
        return os.cpu_count() or 0


_CPP_ROW = re.compile(r"^(\w+)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+(met|MISSED)\s*$")


def parse_cpp(path: str) -> dict | None:
    """The C++ summary table and the command line (first line, '# command: ...') of dispatch_overhead_cpp.txt."""
    if not os.path.exists(path):
        return None
    rows, command, collectives, build, commit = [], None, None, [], None
    with open(path) as f:
        for line in f:
            if line.startswith("# command:"):
                command = line.split(":", 1)[1].strip()
            if line.startswith("# build:"):
                build.append(line.split(":", 1)[1].strip())
            if line.startswith("# library commit:"):
                commit = line.split(":", 1)[1].strip()
            m = _CPP_ROW.match(line)
            if m:
                rows.append({"op": m[1], "local_us": float(m[2]), "shard_us": float(m[3]),
                             "added_us": float(m[4]), "target_met": m[5] == "met"})
            if line.startswith("collectives issued"):
                collectives = int(re.search(r":\s*(\d+)", line)[1])
    return {"source": os.path.relpath(path, ROOT), "command": command, "build": build, "library_commit": commit,
            "rows": rows, "collectives_issued": collectives}


def write_md(path: str, data: dict) -> None:
    cpp = data.get("cpp")
    cpp_rows = {r["op"]: r for r in (cpp or {}).get("rows", [])}
    lines = [
        "# Dispatch overhead",
        "",
        "Added cost per op of a ShardTensor op over the same op on its local tensor: small tensors "
        f"([{ROWS}, {COLS}] float32, CPU; linear weight [{OUT}, {COLS}] and bias [{OUT}], plain), one rank "
        "(Shard(0) on a size-1 mesh; no collectives issued). Target: **at most "
        f"{TARGET_US:g} µs added per op**. `*_grad`: grad mode on, all inputs require grad, forward only.",
        "",
        f"Machine: `nproc` = {data['nproc']} ({data['cpu_model']}, {data['machine']}); torch {data['torch']}; "
        f"torch intra-op threads: {data['torch_threads']}; library commit `{(data['git'].get('commit') or '?')[:10]}`"
        f"{' (plus uncommitted changes under src/, include/ or python/)' if data['git'].get('library_sources_modified') else ''}; "
        f"{data['date']}.",
        "",
        *([data["note"], ""] if data.get("note") else []),
        "| op | C++ local µs | C++ shard µs | C++ added µs | Python local µs | Python shard µs | Python added µs | ≤ 5 µs? |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["python"]:
        c = cpp_rows.get(r["op"])
        cc = [f"{c[k]:.2f}" for k in ("local_us", "shard_us", "added_us")] if c else ["–"] * 3
        met = r["target_met"] and (c is None or c["target_met"])
        verdict = "yes" if met else "**no**"
        if c is not None and c["target_met"] != r["target_met"]:
            verdict += f" (C++ {'yes' if c['target_met'] else 'no'}, Python {'yes' if r['target_met'] else 'no'})"
        lines.append(f"| {r['op']} | {' | '.join(cc)} | {r['local_us']:.2f} | {r['shard_us']:.2f} | "
                     f"{r['added_us']:.2f} | {verdict} |")
    lines += [
        "",
        "Commands (from the repository root):",
        "",
        "```bash",
    ]
    if data.get("driver"):
        lines += [f"{data['driver']}   # which runs:"]
    if cpp and cpp.get("command"):
        lines += ["# C++ (Google Benchmark): raw output in dispatch_overhead_cpp.txt", *cpp.get("build", []),
                  cpp["command"]]
    lines += [
        "# Python: dispatch_overhead.json (and this file)",
        data["command"],
        "```",
        "",
        "C++ times: Google Benchmark real time per iteration, median over the repetitions; Python times: "
        "median over interleaved timeit samples (`number` calls each). Added = ShardTensor − local.",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--repeat", type=int, default=7, help="samples per side (median reported)")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per sample (sets `number`)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of: " + ",".join(OPS))
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: the tensors are too small to parallelize, and idle "
                        "workers only add noise on a small shared machine)")
    p.add_argument("--note", default=None, help="a line added to the markdown under the machine line")
    p.add_argument("--commit", default=None,
                   help="commit the measured library was built from (default: HEAD of this checkout, flagged when "
                        "src/, include/ or python/ have uncommitted changes)")
    p.add_argument("--driver", default=None, help="the command that ran this script, for the markdown")
    add_out_argument(p)
    p.add_argument("--cpp-txt", default=None,
                   help="C++ Google Benchmark output to fold into the JSON/markdown, if it exists (default: "
                        "dispatch_overhead_cpp.txt in --out)")
    p.add_argument("--md", action="store_true", help="also write the markdown table (dispatch_overhead.md in --out)")
    args = p.parse_args(argv)
    prepare(args.out, measures_a_snapshot=bool(args.commit))
    cpp_txt = args.cpp_txt or os.path.join(args.out, "dispatch_overhead_cpp.txt")
    json_path, md_path = os.path.join(args.out, "dispatch_overhead.json"), os.path.join(args.out, "dispatch_overhead.md")

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    mesh, store_path = init_single_rank()
    try:
        st.reset_comm_stats()
        rows = []
        print(f"{'op':<12} {'local_us':>9} {'shard_us':>9} {'added_us':>9}  target (<= {TARGET_US:g} us)")
        for name in [o.strip() for o in args.ops.split(",") if o.strip()]:
            r = bench_op(name, mesh, args.repeat, args.min_time)
            rows.append(r)
            print(f"{name:<12} {r['local_us']:9.2f} {r['shard_us']:9.2f} {r['added_us']:9.2f}  "
                  f"{'met' if r['target_met'] else 'MISSED'}", flush=True)
        comm = st.comm_stats()
        n_coll = sum(comm["calls"].values())
        print(f"collectives issued by the library: {n_coll} (expected 0 on a 1-rank mesh)")
    finally:
        dist.destroy_process_group()
        if os.path.exists(store_path):
            os.unlink(store_path)

    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT)
                                            else sys.executable,
                                            os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]])
    if os.environ.get("PYTHONPATH"):  # which shardtensor build was measured
        cmd = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} {cmd}"
    data = {
        "benchmark": "dispatch_overhead",
        "command": cmd,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "torch": torch.__version__,
        "python_version": platform.python_version(),
        "nproc": nproc(),
        "torch_threads": torch.get_num_threads(),
        "note": args.note,
        "load_average_at_end": list(os.getloadavg()),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_model": _cpu_model(),
        "git": {"commit": args.commit, "library_sources_modified": False} if args.commit else git_commit(),
        "driver": args.driver,
        "shardtensor_library": os.path.realpath(os.path.join(os.path.dirname(st.__file__), "lib", "libshardtensor.so")),
        "shape": {"x": [ROWS, COLS], "weight": [OUT, COLS], "bias": [OUT]},
        "target_added_us": TARGET_US,
        "collectives_issued": n_coll,
        "python": rows,
        "cpp": parse_cpp(cpp_txt),
    }
    with open(json_path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(json_path, ROOT)}")
    if args.md:
        write_md(md_path, data)
        print(f"wrote {os.path.relpath(md_path, ROOT)}")
    return 0 if n_coll == 0 else 2


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
