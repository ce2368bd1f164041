"""The model zoo: every model of ``zoo_models.MODELS`` (or those matching ``--models``) run domain-parallel on a
pool of Gloo ranks against one process, one per row of a Markdown table: result (pass / raise / wrong /
not-parallel / hang / crash), the error or the max error, collectives per training step (forward + backward) and
per eval forward, the activation share, seconds.

    PYTHONPATH=python .venv/bin/python benchmarks/zoo/bench.py                       # all, 2 ranks
    PYTHONPATH=python .venv/bin/python benchmarks/zoo/bench.py --models 'timm/*' --world 3
    PYTHONPATH=python .venv/bin/python benchmarks/zoo/bench.py --out benchmarks/results  # the committed table

Each model runs with a time limit (``--timeout``); a hang or a crashed rank replaces the pool and the run goes
on with the next model. Writes ``zoo.md`` and ``zoo.json`` into ``--out`` (default benchmarks/results/local/).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests", "python")):
    if p not in sys.path:
        sys.path.insert(0, p)

import harness  # noqa: E402  (tests/python: persistent Gloo rank pools with a per-case time limit)
import results_dir  # noqa: E402
from benchmarks.zoo import zoo_models  # noqa: E402
from benchmarks.zoo.patterns import classify  # noqa: E402

SHORT = {"all_gather": "ag", "all_reduce": "ar", "all_to_all": "a2a", "broadcast": "bc", "ring_pass": "ring",
         "scatter": "sc"}


def fmt_calls(calls: dict) -> str:
    if not calls:
        return "0"
    return f"{sum(calls.values())} (" + " ".join(f"{SHORT.get(k, k)} {v}" for k, v in sorted(calls.items())) + ")"


def run_one(name, world, mesh_shape, timeout, dtype, along="default"):
    reason = zoo_models.available(name)
    if reason:
        return {"model": name, "library": zoo_models.MODELS[name].library, "result": "skip", "detail": reason,
                "seconds": 0.0}
    t0 = time.perf_counter()
    try:
        results = harness.run(world, zoo_models.run_model, name, mesh_shape, shard_dims_for(name, mesh_shape, along),
                              False, dtype, timeout=timeout)
    except harness.CaseTimeout:
        return {"model": name, "library": zoo_models.MODELS[name].library, "result": "hang",
                "detail": f"no reply within {timeout:.0f} s", "seconds": round(time.perf_counter() - t0, 1)}
    except harness.RankError as e:  # outside run_model's own verdicts (arguments, pickling)
        harness.discard(world)
        return {"model": name, "library": zoo_models.MODELS[name].library, "result": "raise",
                "detail": str(e).splitlines()[0][:300], "seconds": round(time.perf_counter() - t0, 1)}
    except (EOFError, OSError) as e:  # a rank died (segfault, abort) or the pool broke
        harness.discard(world)
        return {"model": name, "library": zoo_models.MODELS[name].library, "result": "crash",
                "detail": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                "seconds": round(time.perf_counter() - t0, 1)}
    res = results[0]
    verdicts = {r["result"] for r in results}
    if "raise" in verdicts:
        harness.discard(world)  # a rank may have raised while another waited in a collective
    if verdicts == {"raise"} and len({r["detail"] for r in results}) > 1:
        # Ranks raised differently: one refused, the others waited for it in a collective. The refusal is the
        # row's error; that it was not raised on every rank is the second finding.
        own = [r for r in results if "DistBackendError" not in r["detail"]]
        res = dict(own[0] if own else res)
        res["detail"] += " (raised on rank(s) " + ", ".join(str(i) for i, r in enumerate(results)
                                                            if "DistBackendError" not in r["detail"]) + \
            " only; the others timed out in a collective)"
    if len(verdicts) > 1:  # ranks disagree: report the worst
        order = ["wrong", "raise", "not-parallel", "pass"]
        res = min(results, key=lambda r: order.index(r["result"]) if r["result"] in order else 0)
        res["detail"] = f"ranks disagree ({sorted(verdicts)}); " + res.get("detail", "")
    return res


def shard_dims_for(name, mesh_shape, along):
    """The dims a 1-D mesh shards: the model's own (``default``, H for images) or its last spatial dim (``last``: W
    for images, the width of a volume) -- the same models with the other split; a 2-D mesh keeps the model's."""
    spec = zoo_models.MODELS[name]
    if along == "default" or (mesh_shape is not None and len(mesh_shape) > 1):
        return None
    spatial = spec.spatial or tuple(range(2, len(spec.shape)))
    return (spatial[-1],)


def table(rows) -> str:
    out = ["| model | library | result | error / max err | pattern | collectives per step (fwd+bwd) | eval fwd | "
           "act. share | plain | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = ""
        if "calls_forward" in r:
            step = fmt_calls({k: r["calls_forward"].get(k, 0) + r["calls_backward"].get(k, 0)
                              for k in set(r["calls_forward"]) | set(r["calls_backward"])})
        detail = r.get("detail", "").replace("|", "\\|")
        if r["result"] == "wrong":
            detail = f"**{detail}**"
        out.append(f"| {r['model']} | {r['library']} | {r['result']} | {detail} | {r.get('pattern', '')} | {step} | "
                   f"{fmt_calls(r['calls_eval']) if 'calls_eval' in r else ''} | {r.get('share', '')} | "
                   f"{r.get('plain_share', '')} | {r.get('seconds', '')} |")
    return "\n".join(out)


def summary(rows) -> str:
    counts = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def by_pattern(rows) -> str:
    groups = {}
    for r in rows:
        if r["result"] in ("pass", "skip", "n/a"):
            continue
        groups.setdefault(r.get("pattern") or "unclassified", []).append(r)
    lines = []
    from benchmarks.zoo.patterns import PATTERNS
    info = {p.key: p for p in PATTERNS}
    for key, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        p = info.get(key)
        lines.append(f"### {key} ({len(rs)})\n")
        if p:
            lines.append(f"{p.what}\n\nRepro: `{p.repro}`\n")
        lines.append("Models: " + ", ".join(f"{r['model']} ({r['result']})" for r in rs) + "\n")
        if not p:
            lines.extend(f"- {r['model']}: {r.get('detail', '')}" for r in rs)
            lines.append("")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
        dirty = results_dir.tree_is_dirty()
        return rev.strip() + (" (uncommitted changes)" if dirty else "")
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="*", help="comma-separated glob patterns over model names (timm/*, ...)")
    ap.add_argument("--world", type=int, default=2, help="ranks (a 1-D mesh unless --mesh)")
    ap.add_argument("--mesh", default=None, help="a mesh shape such as 2x2 (the input is sharded along H by mesh "
                    "dim 0 and W by mesh dim 1)")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per model before it counts as a hang")
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--along", default="default", choices=["default", "last"],
                    help="the dim a 1-D mesh shards: the model's own (H for images) or its last spatial dim (W)")
    ap.add_argument("--list", action="store_true", help="print the model names and exit")
    results_dir.add_out_argument(ap)
    ap.add_argument("--render", metavar="ZOO_JSON", action="append",
                    help="only rewrite zoo.md from recorded zoo.json files (the patterns of patterns.py applied anew; "
                    "a later file's rows replace an earlier one's of the same model); the commands and commits "
                    "stay the recorded ones")
    args = ap.parse_args()
    if args.render:
        recs = []
        for path in args.render:
            with open(path) as f:
                recs.append(json.load(f))
        by_name = {}
        for rec in recs:
            by_name.update({r["model"]: r for r in rec["rows"]})
        rows = [by_name[r["model"]] for r in recs[0]["rows"]] + \
            [r for n, r in by_name.items() if n not in {x["model"] for x in recs[0]["rows"]}]
        for r in rows:
            r["pattern"] = classify(r)
        rec = recs[0]
        out = results_dir.prepare(args.out, measuring=False)
        write(out, rows, "`; then `".join(r["command"] for r in recs), ", then ".join(r.get("commit", "?") for r in recs),
              rec.get("layout", f"{rec['world']} ranks, a 1-D mesh, H (or the length) sharded"), rec["dtype"],
              rec.get("minutes", sum(r.get("seconds", 0) for r in rows) / 60), rec["world"], rec.get("mesh"))
        return
    pats = [p.strip() for p in args.models.split(",") if p.strip()]
    names = [n for n in zoo_models.MODELS if any(fnmatch.fnmatch(n, p) for p in pats)]
    if args.list:
        print("\n".join(names))
        return
    out = results_dir.prepare(args.out)
    mesh_shape = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else None
    world = args.world if mesh_shape is None else int(__import__("math").prod(mesh_shape))
    command = "PYTHONPATH=python .venv/bin/python benchmarks/zoo/bench.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        from tqdm import tqdm
        bar = tqdm(names, unit="model", dynamic_ncols=True)
    except ImportError:
        bar = None
    rows = []
    commit = git_commit()
    t0 = time.perf_counter()
    try:
        for name in (bar if bar is not None else names):
            if bar is not None:
                bar.set_description(name)
            r = run_one(name, world, mesh_shape, args.timeout, args.dtype, args.along)
            r["pattern"] = classify(r)
            rows.append(r)
            line = f"{r['result']:12s} {name:36s} {r.get('detail', '')[:110]}"
            (bar.write if bar is not None else print)(line)
            # The table so far after every model: a run that is killed keeps what it measured.
            write(out, rows, command, commit, layout(args, world, mesh_shape), args.dtype,
                  (time.perf_counter() - t0) / 60, world, args.mesh, quiet=True)
    finally:
        harness.close_all()
    write(out, rows, command, commit, layout(args, world, mesh_shape), args.dtype, (time.perf_counter() - t0) / 60,
          world, args.mesh)


def layout(args, world, mesh_shape) -> str:
    if mesh_shape:
        return f"mesh {args.mesh}, H and W sharded"
    return f"{world} ranks, a 1-D mesh, " + ("the last spatial dim (W) sharded" if args.along == "last" else
                                             "H (or the length) sharded")


def write(out, rows, command, commit, layout, dtype, minutes, world, mesh, quiet=False):
    md = [f"# Model zoo: unmodified models, input sharded, against one process\n",
          f"Command: `{command}`\n",
          f"Commit {commit}, {platform.machine()}, torch {__import__('torch').__version__}, {layout}, "
          f"{dtype}, uneven extents (multiples of a model's patch size where it has one), Gloo process groups on CPU "
          f"(neighbour exchanges, small all-reduces and all-to-alls through the shared-memory rings of "
          f"src/comm/shm_transport); "
          f"{len(rows)} models in {minutes:.1f} min.\n",
          f"**{summary(rows)}.**\n",
          "Each model: seeded random init, one training step (forward, a fixed random weighting of every output as "
          "the loss, backward) and one eval forward; compared: outputs, the input gradient, every parameter "
          "gradient, every buffer (BatchNorm running statistics), the eval output. *wrong* = a silent wrong "
          "result (the first differing quantity, relative max error = max |diff| / max |reference|); "
          "*not-parallel* = values right but the output lost its spatial shard or the activations were not "
          "divided; *act. share* = local / global elements over every leaf module's ShardTensor outputs (1/world is "
          "perfectly divided; plain outputs are computed from parameters and constants only, such as Swin-V2's "
          "position-bias MLP, and are counted apart: *plain* = their share of all output elements). Collectives: ag all-gather, ar all-reduce, a2a all-to-all, ring send/recv passes, bc "
          "broadcast, sc scatter. Built by `benchmarks/zoo/bench.py` from `benchmarks/zoo/zoo_models.py`; the "
          "failure patterns (and their issue items) come from `benchmarks/zoo/patterns.py`.\n",
          table(rows), "\n## Failures by pattern\n", by_pattern(rows)]
    text = "\n".join(md) + "\n"
    with open(os.path.join(out, "zoo.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "zoo.json"), "w") as f:
        json.dump({"command": command, "commit": commit, "world": world, "mesh": mesh, "dtype": dtype,
                   "layout": layout, "minutes": round(minutes, 2), "rows": rows}, f, indent=1, default=str)
    if not quiet:
        print(f"\n{summary(rows)}; wrote {os.path.relpath(os.path.join(out, 'zoo.md'))} ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
