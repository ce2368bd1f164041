"""Where benchmark results are written, and the caveats every plot carries.

A run writes into ``benchmarks/results/local/`` (git-ignored) unless ``--out`` says otherwise, so trying a
benchmark never overwrites the committed results. ``--out benchmarks/results`` updates those, and only from a
clean tree (no uncommitted changes outside ``benchmarks/results``), so every committed figure belongs to a commit.
"""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "benchmarks", "results")
LOCAL = os.path.join(COMMITTED, "local")

OUT_HELP = ("directory for the result files; the default is git-ignored. Pass benchmarks/results to update the "
            "committed results (refused when the tree has uncommitted changes)")


def add_out_argument(parser) -> None:
    parser.add_argument("--out", default=LOCAL, help=OUT_HELP)


def is_committed_dir(path: str) -> bool:
    return os.path.realpath(path) == os.path.realpath(COMMITTED)


def git(*args) -> str:
    """The output of ``git *args`` in the repository (stripped; empty when git fails)."""
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def tree_is_dirty() -> bool:
    """Uncommitted changes to tracked files outside benchmarks/results (earlier results there do not count)."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                             ":(exclude)benchmarks/results"], capture_output=True, text=True, cwd=ROOT)
    return status.returncode != 0 or bool(status.stdout.strip())


def prepare(out: str, measuring: bool = True, measures_a_snapshot: bool = False) -> str:
    """Create ``out``; refuse new measurements into the committed results from a dirty tree (re-plotting recorded
    JSON, or measuring a snapshot of a commit, is allowed)."""
    if measuring and not measures_a_snapshot and is_committed_dir(out) and tree_is_dirty():
        raise SystemExit(f"refusing to write new measurements into {os.path.relpath(COMMITTED)}: the tree has "
                         "uncommitted changes (git status), so the results would match no commit. Commit first, or "
                         f"write elsewhere (--out {os.path.relpath(LOCAL)}, the default)")
    os.makedirs(out, exist_ok=True)
    return out


def loadavg():
    """(1, 5, 15)-minute load averages, rounded, or None."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def load_caveat(start, end, cpus=None) -> str:
    """One line for a plot: the machine's load around the run and what it means for wall-clock figures."""
    cpus = cpus or os.cpu_count()
    if not start and not end:
        return "Machine load not recorded: wall-clock times may include time-slicing with other processes."
    peak = max(v[0] for v in (start, end) if v)
    text = (f"Machine load (1-min load average) {start[0] if start else '?'} at start, {end[0] if end else '?'} at "
            f"end, {cpus} CPUs.")
    if peak > 0.5 * cpus:
        return text + " Busy machine: wall-clock times carry other processes' noise; compare ratios, not absolutes."
    return text + " Wall-clock times can still vary with other load; error bars show the spread of repeated timings."


def spread(samples) -> list:
    """[min, max] of repeated timings (the error bar drawn around their median)."""
    return [min(samples), max(samples)] if samples else None


def add_caveat(fig, text: str) -> None:
    """The caveat as a footnote of the figure (kept inside the saved PNG)."""
    fig.text(0.005, 0.005, text, fontsize=7, color="dimgray", ha="left", va="bottom")
