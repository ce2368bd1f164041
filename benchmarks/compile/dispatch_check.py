"""Did the eager dispatch overhead grow? benchmarks/dispatch_overhead/bench.py (its Python part: no C++ rebuild) on this
tree, into a temporary folder, against the committed benchmarks/results/dispatch_overhead.json, per op.

The two runs are days apart on a shared machine whose speed varies with its load (plain ops alike have run twice as
slow), so the committed added cost is first scaled by the machine's speed ratio — the median over ops of local-op
time now / then — and growth is an added cost above that by more than the larger of TOLERANCE_US and
TOLERANCE_FRACTION of it.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMITTED = os.path.join(ROOT, "benchmarks", "results", "dispatch_overhead.json")
SCRIPT = os.path.join(ROOT, "benchmarks", "dispatch_overhead", "bench.py")
if os.path.join(ROOT, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from results_dir import git  # noqa: E402
TOLERANCE_US, TOLERANCE_FRACTION = 0.5, 0.5


def compare(quick: bool) -> dict:
    with open(COMMITTED) as f:
        before = json.load(f)
    opts = ["--threads", "1"] + (["--repeat", "3", "--min-time", "0.01"] if quick else [])
    with tempfile.TemporaryDirectory(prefix="compile_bench_dispatch_") as tmp:
        done = subprocess.run([sys.executable, SCRIPT, *opts, "--out", tmp], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": (done.stderr or done.stdout).strip()[-600:]}
        with open(os.path.join(tmp, "dispatch_overhead.json")) as f:
            after = json.load(f)
    old = {r["op"]: r for r in before["python"]}
    speed = statistics.median([r["local_us"] / old[r["op"]]["local_us"] for r in after["python"] if r["op"] in old])
    rows = []
    for r in after["python"]:
        b = old.get(r["op"])
        row = {"op": r["op"], "after_local_us": r["local_us"], "after_shard_us": r["shard_us"],
               "after_added_us": r["added_us"]}
        if b is not None:
            scaled = b["added_us"] * speed
            row.update(before_local_us=b["local_us"], before_shard_us=b["shard_us"], before_added_us=b["added_us"],
                       before_added_scaled_us=scaled,
                       grew=r["added_us"] > scaled + max(TOLERANCE_US, TOLERANCE_FRACTION * scaled))
        rows.append(row)
    return {
        "before": {"file": os.path.relpath(COMMITTED, ROOT), "measured_commit": (before["git"]["commit"] or "")[:10],
                   "file_commit": git("log", "-1", "--format=%h", "--", os.path.relpath(COMMITTED, ROOT)),
                   "date": before["date"], "load_average_at_end": before.get("load_average_at_end")},
        "after": {"command": f"python benchmarks/dispatch_overhead/bench.py {' '.join(opts)} --out <temporary>",
                  "commit": git("rev-parse", "--short", "HEAD"), "date": after["date"],
                  "load_average_at_end": after.get("load_average_at_end"),
                  "collectives_issued": after["collectives_issued"]},
        "speed_ratio": speed,
        "tolerance": f"max({TOLERANCE_US} µs, {TOLERANCE_FRACTION:.0%} of the scaled committed added cost)",
        "ops": rows,
    }
