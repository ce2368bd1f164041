"""benchmarks/compile/bench.py --quick (aot_eager; the conv stack and the ViT) runs end to end, dispatch-overhead
comparison included: every mode has a row; the conv stack compiles into one Dynamo graph, one forward and one backward
graph, no graph break and no recompile, and its first loss equals eager's; a mode that does not compile is a row with
its error, not a crash. About 30 s on 2 cores."""
import json
import os
import subprocess
import sys

import shardtensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "compile", "bench.py")


def test_compile_bench_quick(tmp_path):
    # The ranks and the dispatch benchmark import the shardtensor this test imports.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(shardtensor.__file__)))
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--workloads", "conv,vit", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    data = json.loads((tmp_path / "compile.json").read_text())
    rows = {(w["workload"], m["mode"]): m for w in data["workloads"] for m in w["modes"]}
    assert set(rows) == {(w, m) for w in ("conv", "vit") for m in ("eager", "aot_eager")}
    assert "error" not in rows["conv", "eager"] and "error" not in rows["vit", "eager"]
    conv = rows["conv", "aot_eager"]
    assert "error" not in conv, conv["error"]
    assert (conv["dynamo_graphs"], conv["graph_breaks"], conv["fw_graphs"], conv["bw_graphs"]) == (1, 0, 1, 1)
    assert conv["recompiles_in_timed_steps"] == 0 and conv["first_loss_vs_eager"] < 1e-5
    assert conv["ratio_to_eager"] > 0
    vit = rows["vit", "aot_eager"]
    assert "error" in vit or vit["first_loss_vs_eager"] < 1e-4
    ops = data["dispatch_overhead"]["ops"]
    assert ops and all("before_added_us" in o and "after_added_us" in o for o in ops)
    assert "| conv | aot_eager | ok |" in (tmp_path / "compile.md").read_text()
