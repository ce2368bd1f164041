"""benchmarks/gpu_check.sh, the one-call check of a GPU machine, as a dry run on the CPU (DEVICE=cpu QUICK=1), so
that it cannot rot between the rare GPU runs: the build step (against the existing build/ tree), the CUDA suite's
cases on the CPU, the kernel tests' command line, a benchmark writing into benchmarks/results and a workload launch;
what comes back (three files in OUT, one tar of logs and results), and the tree's own results left as they were.
A second run checks that a spent budget skips steps and still writes the summary."""
import hashlib
import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def run_script(tmp_path, **env):
    out = tmp_path / "out"
    full = dict(os.environ, DEVICE="cpu", QUICK="1", PYTHON=sys.executable, OUT=str(out), TMPDIR=str(tmp_path))
    full.update(env)
    r = subprocess.run(["bash", SCRIPT], env=full, capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return r, out, summary


def results_digest():
    """Names and contents of the tree's benchmark results."""
    h = hashlib.sha256()
    base = os.path.join(ROOT, "benchmarks", "results")
    for folder, dirs, files in sorted(os.walk(base)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, base).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def step_status(summary, name):
    for line in summary.splitlines():
        parts = line.split()
        if parts and parts[0] == name:
            return parts[1]
    return None


def test_dry_run(tmp_path):
    steps = ["cuda_tests", "kernel_tests", "ring_attention", "vit_baseline"]
    env = {"PYTEST_K": "[2] or scatter"}
    if os.path.exists(os.path.join(ROOT, "build", "CMakeCache.txt")):
        steps.insert(0, "build")  # ninja finds the tree `make build` made up to date
        env["BUILD_DIR"] = "build"
    before = results_digest()
    r, out, summary = run_script(tmp_path, STEPS=",".join(steps), **env)
    assert r.returncode == 0, f"{summary}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert sorted(os.listdir(out)) == ["gpu_check.log", "results.tar.gz", "summary.txt"]
    for name in steps[:-1] + ["vit_baseline_quick"]:
        assert step_status(summary, name) == "ok", f"{name}:\n{summary}"
    assert "FAILED" not in summary and "TIMEOUT" not in summary, summary
    with tarfile.open(out / "results.tar.gz") as tar:
        names = set(tar.getnames())
    for want in ("summary.txt", "preflight.txt", "logs/cuda_tests.log", "logs/ring_attention.log",
                 "results/ring_attention.json", "results/workloads/vit_quick_baseline_quick.json"):
        assert want in names, f"{want} not in the tar: {sorted(names)}"
    assert results_digest() == before, "the dry run changed benchmarks/results"


def test_spent_budget_skips_steps(tmp_path):
    r, out, summary = run_script(tmp_path, STEPS="ring_attention,vit", BUDGET_S="1")
    assert r.returncode == 0, f"{summary}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert step_status(summary, "ring_attention") == "skipped", summary
    assert step_status(summary, "vit_baseline_quick") == "skipped", summary
    assert "budget" in summary
    assert sorted(os.listdir(out)) == ["gpu_check.log", "results.tar.gz", "summary.txt"]


def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))


def test_timed_synchronizes_cuda(monkeypatch):
    """bench_util.timed waits for the GPU around every timed call (kernels return before they finish)."""
    _benchmarks_on_path(monkeypatch)
    import torch
    import bench_util

    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    bench_util.timed(lambda: events.append("call"), warmup=1, iters=2)
    assert events == ["call", "sync", "call", "sync", "sync", "call", "sync"]


def test_shared_gpu_ranks_use_gloo(monkeypatch):
    """NCCL refuses two ranks on one GPU: ranks beyond the GPU count get plain Gloo (host staging), as the ring
    attention benchmark now does too."""
    _benchmarks_on_path(monkeypatch)
    import torch
    from scaling.launch import backend_for

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert backend_for(torch.device("cuda", 0), 2) == "gloo"
    assert backend_for(torch.device("cuda", 0), 1) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cpu"), 2) == "gloo"


def test_error_bars_of_one_rounded_sample(monkeypatch):
    """A single timed iteration (the dry run's --iters 1): the kept sample is rounded, the median is not; the error
    bar must not come out negative (matplotlib refuses it and the whole result file was lost)."""
    monkeypatch.syspath_prepend(ROOT)
    from benchmarks.scaling import plots, timing

    for t in (0.0012345678, 0.0012344321):  # rounded up, rounded down
        below, above = plots._spread_ms(timing.summary([t]))
        assert below >= 0 and above >= 0, (t, below, above)
