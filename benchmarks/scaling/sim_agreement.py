"""Is a simulated rank's CPU time the real rank's, within noise? The summary that ``validate_sim.py`` writes and
``paper_scale.py`` renders (the tables are here too).

Each row of ``sim_validation.json`` is one rank and pass of one workload at one P, with one entry per repeat:
``cpu_real_s[k]`` / ``cpu_sim_s[k]`` (and ``compute_*``, ``kernel_*``) are the medians over ``--iters`` of repeat
k (one paired launch: the real and the simulated ranks took turns, so repeat k of both saw the same machine).
"""
from __future__ import annotations

import statistics

from .report import fmt_bytes


def spread(values) -> float | None:
    """Run-to-run spread, relative: (max - min) / median; None with fewer than two repeats (no noise estimate)."""
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def verdict(ratio: float, noise: float | None) -> bool | None:
    """Within noise when the ratio's distance from 1 is at most the real run's own spread; None without one."""
    return None if noise is None else abs(ratio - 1) <= noise


def _rank_mean(rows, key, k):
    return statistics.fmean(r[key][k] for r in rows)


def summarize(rows, measure: str = "cpu") -> list[dict]:
    """Per workload, P and pass: the mean over ranks of each repeat's median CPU time, real and simulated; the real
    run's spread; the ratio of the medians over repeats, the range of the per-repeat ratios, the verdict; and per
    rank the same ratio against that rank's own real spread. ``measure``: "cpu" (the thread's whole CPU time, keys
    ``cpu_real_s``/``cpu_sim_s``), "compute" (outside the library's collective calls, ``compute_*``) or "kernel"
    (inside the local aten ops, ``kernel_*``)."""
    real_key, sim_key = f"{measure}_real_s", f"{measure}_sim_s"
    rows = [r for r in rows if real_key in r]
    groups = {}
    for r in rows:
        groups.setdefault((r["workload"], r["ranks"], r["kind"]), []).append(r)
    out = []
    for (w, P, kind), rs in groups.items():
        K = len(rs[0][real_key])
        real = [_rank_mean(rs, real_key, k) for k in range(K)]
        sim = [_rank_mean(rs, sim_key, k) for k in range(K)]
        per_repeat = [s / t for s, t in zip(sim, real)]
        ratio = statistics.median(sim) / statistics.median(real)
        noise = spread(real)
        per_rank = []
        for r in sorted(rs, key=lambda r: r["rank"]):
            rr = statistics.median(r[sim_key]) / statistics.median(r[real_key])
            n = spread(r[real_key])
            per_rank.append({"rank": r["rank"], "ratio": round(rr, 4), "real_spread": n and round(n, 4),
                             "within_noise": verdict(rr, n)})
        out.append({"workload": w, "size": rs[0]["size"], "ranks": P, "kind": kind, "repeats": K,
                    "calls": statistics.fmean(r.get("calls", 0) for r in rs),
                    "gap_s": statistics.median(real) - statistics.median(sim),
                    "real_s": real, "sim_s": sim, "real_spread": noise, "sim_spread": spread(sim),
                    "ratio": ratio, "ratio_range": [min(per_repeat), max(per_repeat)],
                    "within_noise": verdict(ratio, noise), "per_rank": per_rank})
    return out


def _ms(s):
    return f"{s * 1e3:.2f}"


def _pct(x):
    return "-" if x is None else f"{x * 100:.1f} %"


MEASURES = (("kernel", "local kernels"), ("compute", "local compute"), ("cpu", "whole CPU time"))


def summary_key(key) -> str:
    """Where a sim_validation.json stores the summary of one measure ("cpu", the first, as "summary")."""
    return "summary" if key == "cpu" else f"summary_{key}"


def summary_of(v, key):
    """The summary of one measure in a sim_validation.json."""
    return (v or {}).get(summary_key(key), [])


def _median_of(rs, key):
    vals = [x for r in rs for x in r.get(key, [])]
    return statistics.median(vals) if vals else None


def validation_lines(v, normal=None):
    """The agreement tables of sim_validation.json (transport threads idle) and, when given, the ratios of the run
    at normal priority (sim_validation_normal.json) beside them."""
    if not v or "summary_kernel" not in v:
        return ["(no sim_validation.json in the current format: run `python -m benchmarks.scaling.validate_sim --out "
                "benchmarks/results`)"]
    m = v["meta"]
    lines = [f"Command: `{m['command']}` ({m['repeats']} paired launches per workload and P, {m['iters']} timed "
             f"iterations per measure each; commit {m['commit']}; transport threads {m['transport_priority']}; load "
             f"average at the end {m.get('loadavg')}).", "",
             "| workload | P | ranks × passes × repeats | collectives equal | peak memory equal | largest peak "
             "difference |", "|---|---|---|---|---|---|"]
    groups = {}
    for r in v["rows"]:
        groups.setdefault((r["workload"], r["ranks"]), []).append(r)
    for (w, P), rs in groups.items():
        n = sum(len(r["comm_equal"]) for r in rs)
        ce = sum(sum(r["comm_equal"]) for r in rs)
        pairs = [(a, b) for r in rs for a, b in zip(r["peak_real"], r["peak_sim"])]
        pe = sum(a == b for a, b in pairs)
        diff, real = max(((abs(a - b), a) for a, b in pairs), key=lambda t: t[0])
        lines.append(f"| {w} ({rs[0]['size']}) | {P} | {n} | {ce}/{n} | {pe}/{n} | {fmt_bytes(diff)} "
                     f"({diff / real * 100:.2f} %) |")
    summ = {key: {(s["workload"], s["ranks"], s["kind"]): s for s in summary_of(v, key)} for key, _ in MEASURES}
    norm = {key: {(s["workload"], s["ranks"], s["kind"]): s for s in summary_of(normal, key)} for key, _ in MEASURES}
    rows_by = {}
    for r in v["rows"]:
        rows_by.setdefault((r["workload"], r["ranks"], r["kind"]), []).append(r)
    lines += ["", "Simulated / real time per rank, three ways (mean over ranks of each repeat's median; in brackets the "
              "range of the per-repeat ratios; ✓ = within noise, |ratio − 1| ≤ the real side's spread over repeats, "
              "(max − min) / median): *kernels* = CPU time inside the local aten ops, *compute* = the step outside "
              "the library's collective calls, *whole* = the step. The last columns are the real ranks' host load "
              "per step (medians): the main thread's wait in the run queue, and the CPU time of the process's "
              "other threads (Gloo's TCP loop and workers)" +
              (f"; *normal* = the kernels' ratio of a separate run with those threads at normal priority "
               f"(`{normal['meta']['command']}`)" if normal else "") + ".", "",
              "| workload | P | pass | real kernels ms | real spread | kernels | compute | whole | run-queue wait ms | "
              "other threads ms |" + (" normal: kernels | normal: whole |" if normal else ""),
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if normal else "")]

    def cell(s):
        return (f"{s['ratio']:.2f} ({s['ratio_range'][0]:.2f}–{s['ratio_range'][1]:.2f})"
                f"{' ✓' if s['within_noise'] else ''}")

    for k, sk in summ["kernel"].items():
        rs = rows_by[k]
        rq, oth = _median_of(rs, "runqueue_real_s"), _median_of(rs, "other_threads_cpu_real_s")
        nk, nc = norm["kernel"].get(k), norm["cpu"].get(k)
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {_ms(statistics.median(sk['real_s']))} | {_pct(sk['real_spread'])} "
                     f"| {cell(sk)} | {cell(summ['compute'][k])} | {cell(summ['cpu'][k])} | "
                     f"{'-' if rq is None else _ms(rq)} | {'-' if oth is None else _ms(oth)} |" +
                     ((f" {cell(nk) if nk else '-'} | {cell(nc) if nc else '-'} |") if normal else ""))
    return lines


def validation_counts(v, normal=None) -> dict:
    """What the prose under the tables states, computed from the results."""
    pairs = [(a, b) for r in (v or {}).get("rows", []) for a, b in zip(r["peak_real"], r["peak_sim"])]
    out = {"comm_all_equal": all(all(r["comm_equal"]) for r in (v or {}).get("rows", [])),
           "peak_max_diff": max((a - b for a, b in pairs), default=0),
           "peak_sim_above": sum(b > a for a, b in pairs),
           "peak_pairs": len(pairs), "peak_equal": sum(a == b for a, b in pairs),
           # where the real peak is higher, by no more than the bytes the pass's collectives sent (buffers a
           # process group's threads still hold, not a miscount, which would scale with the activations)
           "peak_diff_within_comm_bytes": all(a - b <= r["bytes"] for r in (v or {}).get("rows", [])
                                              for a, b in zip(r["peak_real"], r["peak_sim"]))}

    def verdicts(s):
        return {"groups": len(s), "within": sum(bool(x["within_noise"]) for x in s), "ratios": [x["ratio"] for x in s],
                # stricter, for paired launches: the per-repeat ratios (each from one launch) straddle 1
                "straddle": sum(x["ratio_range"][0] <= 1 <= x["ratio_range"][1] for x in s)}

    for key, _ in MEASURES:
        out[key] = verdicts(summary_of(v, key))
        if summary_of(normal, key):
            out[f"normal_{key}"] = verdicts(summary_of(normal, key))
    for name, d in (("", v), ("normal_", normal)):
        steps = [r for r in (d or {}).get("rows", []) if r["kind"] == "step" and r.get("other_threads_cpu_real_s")]
        if steps:  # medians over the training-step rows of the real ranks' host load per step
            out[f"{name}step_other_threads_s"] = statistics.median(
                statistics.median(r["other_threads_cpu_real_s"]) for r in steps)
            out[f"{name}step_runqueue_s"] = statistics.median(statistics.median(r["runqueue_real_s"]) for r in steps)
            out[f"{name}step_cpu_s"] = statistics.median(statistics.median(r["cpu_real_s"]) for r in steps)
    return out
