"""torch.compile of ShardTensor training steps against eager, on 2 Gloo CPU ranks spawned here: step time (median of
--steps after warm-up; the modes alternate step by step, so compiled / eager is a ratio within one run), compile time
(first compiled step minus a steady one), Dynamo graphs and graph breaks, AOTAutograd forward and backward graphs; and
the eager dispatch overhead of this tree (benchmarks/dispatch_overhead/bench.py, Python part) against the committed
benchmarks/results/dispatch_overhead.json.

    PYTHONPATH=$PWD/python .venv/bin/python benchmarks/compile/bench.py [--backends aot_eager,inductor]
        [--workloads conv,conv_gn,vit] [--steps N] [--quick] [--out DIR]     # compile.{json,md} into DIR

Workloads (workloads.py): a conv stack on a height-sharded (uneven) input, the same with GroupNorm, and the bundled ViT
(input sharded on H in multiples of the patch). A mode that fails to compile is a row "did not compile: <error>".
Inductor compiles cold (a fresh cache directory per rank and run) with one compile thread per rank: the two ranks
already share the 2 cores. --quick: a smaller configuration with aot_eager only (a smoke run).
DIR defaults to the git-ignored benchmarks/results/local; --out benchmarks/results updates the committed results
(from a clean tree only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
try:
    import shardtensor as st
except ModuleNotFoundError:  # not installed: the source tree's package (built by `make build`)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import shardtensor as st
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, HERE)
from bench_util import spawn_rank0_rows  # noqa: E402
from results_dir import add_out_argument, git, loadavg, prepare, spread  # noqa: E402
import dispatch_check  # noqa: E402
import report  # noqa: E402
from workloads import CountingBackend, make_input, specs  # noqa: E402

WORLD = 2


def _scalar(loss) -> float:
    return float((loss.full_tensor() if st.is_shard_tensor(loss) else loss).detach())


def _error(e: BaseException) -> str:
    """The exception in one line (Dynamo's messages run to many lines of context)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}{'…' if len(text) > 400 else ''}"


class Mode:
    """One way of running the step: eager, or the model compiled with one backend (own model copy and optimizer)."""

    def __init__(self, name, spec):
        _, make_model, _, _, _, self.loss_fn = spec
        self.name, self.model = name, make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.backend = None if name == "eager" else CountingBackend(name)
        self.fn = self.model if self.backend is None else torch.compile(self.model, backend=self.backend)
        self.times, self.row = [], {"mode": name}

    def step(self, x, target):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.fn(x), target)
        loss.backward()
        self.opt.step()
        return loss

    def first(self, x, target, warmup):
        """The first step (compiles) and the warm-up steps; the graph counts they produced."""
        from torch._dynamo.utils import counters
        counters.clear()
        try:
            dist.barrier()
            t0 = time.perf_counter()
            loss = self.step(x, target)
            self.row["first_step_s"] = time.perf_counter() - t0
            self.row["first_loss"] = _scalar(loss)
            for _ in range(warmup):
                self.step(x, target)
        except Exception as e:  # noqa: BLE001 - reported as the row ("did not compile"), the run goes on
            self.row["error"] = _error(e)
        if self.backend is not None:
            breaks = dict(counters["graph_break"])
            self.row.update(dynamo_graphs=self.backend.dynamo, fw_graphs=self.backend.fw, bw_graphs=self.backend.bw,
                            unique_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(breaks.values()),
                            graph_break_reasons={k[:200]: v for k, v in breaks.items()})
        dist.barrier()     # both ranks tried (a failure is reported by both alike)
        return "error" not in self.row

    def timed(self, x, target):
        dist.barrier()
        t0 = time.perf_counter()
        self.step(x, target)
        self.times.append(time.perf_counter() - t0)

    def finish(self, eager_row):
        r = self.row
        if self.times:
            r["step_s"] = statistics.median(self.times)
            r["step_spread_s"] = spread(self.times)
            if self.backend is not None:
                r["compile_s"] = r["first_step_s"] - r["step_s"]
                r["recompiles_in_timed_steps"] = self.backend.dynamo - r["dynamo_graphs"]
        if eager_row is not self.row and "step_s" in r and "step_s" in eager_row:
            r["ratio_to_eager"] = r["step_s"] / eager_row["step_s"]
            r["first_loss_vs_eager"] = abs(r["first_loss"] - eager_row["first_loss"])
        return r


def measure(name, spec, mesh, args):
    x = make_input(spec[2], spec[3], mesh)
    target = spec[4]()
    modes = [Mode(m, spec) for m in ["eager", *args.backends]]
    live = [m for m in modes if m.first(x, target, args.warmup)]
    for _ in range(args.steps):
        for m in live:     # alternating: load changes on the shared machine hit every mode alike
            m.timed(x, target)
    rows = [m.finish(modes[0].row) for m in modes]
    return {"workload": name, "description": spec[0], "input_shape": list(spec[2]), "extents_dim2": spec[3],
            "modes": rows}


def run(rank, world, port, scratch, args):
    cache = tempfile.mkdtemp(prefix=f"compile_bench_inductor_r{rank}_")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHINDUCTOR_CACHE_DIR=cache,
                      TORCHINDUCTOR_COMPILE_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    try:
        all_specs = specs(args.quick)
        rows = [measure(w, all_specs[w], mesh, args) for w in args.workloads]
        per_rank = [None] * world
        dist.all_gather_object(per_rank, [[m.get("first_step_s") for m in r["modes"]] for r in rows])
        for i, r in enumerate(rows):   # compile time differs per rank (each compiles its own shapes)
            for j, m in enumerate(r["modes"]):
                m["first_step_s_per_rank"] = [p[i][j] for p in per_rank]
        if rank == 0:
            with open(scratch, "w") as f:
                json.dump({"rows": rows, "attention": st.attention_strategy()}, f)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(cache, ignore_errors=True)


def _library() -> dict:
    """The extension measured: it is built apart from the commit (make build), so its file and build time say which."""
    path = st._C.__file__
    built = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    return {"file": os.path.relpath(path, ROOT), "built": built.isoformat(timespec="seconds")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--backends", default=None, help="comma-separated: aot_eager, inductor (default both; "
                                                     "--quick: aot_eager)")
    ap.add_argument("--workloads", default="conv,conv_gn,vit", help="comma-separated subset of conv, conv_gn, vit")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 50; --quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="steps after the first, untimed (default 3; --quick 1)")
    ap.add_argument("--timeout", type=int, default=900, help="Gloo timeout in s (a rank compiling holds the other)")
    ap.add_argument("--no-dispatch", action="store_true", help="skip the dispatch-overhead comparison")
    ap.add_argument("--quick", action="store_true", help="small smoke configuration (aot_eager, 3 steps)")
    add_out_argument(ap)
    args = ap.parse_args()
    args.backends = (args.backends or ("aot_eager" if args.quick else "aot_eager,inductor")).split(",")
    args.workloads = args.workloads.split(",")
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    out = prepare(args.out)
    load_start, t0 = loadavg(), time.perf_counter()
    ranks = spawn_rank0_rows(run, WORLD, os.path.join(out, ".compile_rank0.json"), args)
    dispatch = None if args.no_dispatch else dispatch_check.compare(args.quick)
    command = " ".join(shlex.quote(a) for a in ["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT),
                                                 *sys.argv[1:]])
    meta = {"command": command, "world_size": WORLD, "torch": torch.__version__, "nproc": os.cpu_count(),
            "torch_threads_per_rank": 1, "commit": git("rev-parse", "--short", "HEAD"),
            "tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_start": load_start, "load_end": loadavg(), "wall_s": time.perf_counter() - t0,
            "steps": args.steps, "warmup": args.warmup, "backends": args.backends, "quick": args.quick,
            "attention_strategy": ranks["attention"], "library": _library()}
    payload = {"meta": meta, "workloads": ranks["rows"], "dispatch_overhead": dispatch}
    report.write(out, payload)


if __name__ == "__main__":
    main()
