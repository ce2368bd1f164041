"""Is a simulated rank's CPU time the real rank's, within noise? The summary that ``validate_sim.py`` writes and
``paper_scale.py`` renders (the tables are here too).

Each row of ``sim_validation.json`` is one rank and pass of one workload at one P, with one entry per repeat:
``cpu_real_s[k]`` / ``cpu_sim_s[k]`` are the medians over ``--iters`` of repeat k (the real job and the set of
simulated ranks run back to back, so repeat k of both sees about the same machine load).
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
    ``cpu_real_s``/``cpu_sim_s``) or "compute" (outside the library's collective calls, ``compute_*``)."""
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
        # The part of the gap a real collective's own CPU cost explains: calls x the measured cost of one call.
        comm_est = statistics.fmean(r["calls"] * statistics.median(r["collective_cpu_s"]) for r in rs) \
            if all("collective_cpu_s" in r for r in rs) else None
        out.append({"workload": w, "size": rs[0]["size"], "ranks": P, "kind": kind, "repeats": K,
                    "calls": statistics.fmean(r.get("calls", 0) for r in rs), "collective_cpu_est_s": comm_est,
                    "gap_s": statistics.median(real) - statistics.median(sim),
                    "real_s": real, "sim_s": sim, "real_spread": noise, "sim_spread": spread(sim),
                    "ratio": ratio, "ratio_range": [min(per_repeat), max(per_repeat)],
                    "within_noise": verdict(ratio, noise), "per_rank": per_rank})
    return out


def _ms(s):
    return f"{s * 1e3:.2f}"


def _pct(x):
    return "-" if x is None else f"{x * 100:.1f} %"


def _yes(b):
    return {True: "yes", False: "**no**", None: "- (one repeat)"}[b]


def validation_lines(v, serial=None):
    """The agreement tables of sim_validation.json (and, when present, the serial run's ratios beside them)."""
    if not v or "summary" not in v:
        return ["(no sim_validation.json in the current format: run `python -m benchmarks.scaling.validate_sim --out "
                "benchmarks/results`)"]
    m = v["meta"]
    lines = [f"Command: `{m['command']}` ({m['repeats']} repeats of the real job and the simulated set, "
             f"{m['iters']} timed iterations each; commit {m['commit']}; load average at the end {m.get('loadavg')}).",
             "", "| workload | P | ranks × passes × repeats | collectives equal | peak memory equal | largest peak "
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
    ser = {(s["workload"], s["ranks"], s["kind"]): s for s in (serial or {}).get("summary", [])}
    lines += ["", "CPU time per rank (mean over ranks of each repeat's median; *real spread* = (max − min) / median "
              "of the real job's repeats; *within noise* = |ratio − 1| ≤ real spread)" +
              (f"; the last column is a separate run with the simulated ranks one after another, each alone "
               f"(`{serial['meta']['command']}`)" if ser else "") + ":", "",
              "| workload | P | pass | real ms | real spread | simulated / real (per-repeat range) | within noise | "
              "ranks within their own noise | real − simulated ms | collectives per rank × CPU per call ms |" +
              (" serial simulated / real |" if ser else ""),
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if ser else "")]
    for s in v["summary"]:
        ranks_ok = sum(bool(p["within_noise"]) for p in s["per_rank"])
        o = ser.get((s["workload"], s["ranks"], s["kind"]))
        lines.append(f"| {s['workload']} | {s['ranks']} | {s['kind']} | {_ms(statistics.median(s['real_s']))} | "
                     f"{_pct(s['real_spread'])} | {s['ratio']:.3f} ({s['ratio_range'][0]:.3f}–{s['ratio_range'][1]:.3f})"
                     f" | {_yes(s['within_noise'])} | {ranks_ok}/{len(s['per_rank'])} | {_ms(s['gap_s'])} | "
                     f"{'-' if s['collective_cpu_est_s'] is None else _ms(s['collective_cpu_est_s'])} "
                     f"({s['calls']:.0f} calls) |" +
                     ((f" {o['ratio']:.3f} |" if o else " |") if ser else ""))
    comp = v.get("summary_compute")
    if comp:
        lines += ["", "Local compute per rank: the same, counting only the thread's CPU time outside the library's "
                  "collective calls (issuing, waiting and waking up are measured in C++ around every collective, on "
                  "both sides; a fake group's collectives cost about nothing):", "",
                  "| workload | P | pass | real ms | real spread | simulated / real (per-repeat range) | within noise | "
                  "ranks within their own noise |", "|---|---|---|---|---|---|---|---|"]
        for s in comp:
            ranks_ok = sum(bool(p["within_noise"]) for p in s["per_rank"])
            lines.append(f"| {s['workload']} | {s['ranks']} | {s['kind']} | {_ms(statistics.median(s['real_s']))} | "
                         f"{_pct(s['real_spread'])} | {s['ratio']:.3f} ({s['ratio_range'][0]:.3f}–"
                         f"{s['ratio_range'][1]:.3f}) | {_yes(s['within_noise'])} | {ranks_ok}/{len(s['per_rank'])} |")
    return lines


def validation_counts(v) -> dict:
    """What the prose under the tables states, computed from the results."""
    s = v.get("summary", []) if v else []
    pairs = [(a, b) for r in (v or {}).get("rows", []) for a, b in zip(r["peak_real"], r["peak_sim"])]
    sc = v.get("summary_compute", []) if v else []
    return {"groups": len(s), "within": sum(bool(x["within_noise"]) for x in s),
            "compute_groups": len(sc), "compute_within": sum(bool(x["within_noise"]) for x in sc),
            "compute_ratios": [x["ratio"] for x in sc],
            # how much the ratio moves when the time inside collectives is left out, per group
            "compute_rise": [x["ratio"] - y["ratio"] for x in sc for y in s
                             if (x["workload"], x["ranks"], x["kind"]) == (y["workload"], y["ranks"], y["kind"])],
            "comm_all_equal": all(all(r["comm_equal"]) for r in (v or {}).get("rows", [])),
            "peak_max_diff": max((a - b for a, b in pairs), default=0),
            "peak_sim_above": sum(b > a for a, b in pairs), "ratios": [x["ratio"] for x in s],
            # every rank whose peaks differ in some repeat matches exactly in another (a race, not a miscount)
            "peak_diff_matches_elsewhere": all(any(a == b for a, b in zip(r["peak_real"], r["peak_sim"]))
                                               for r in (v or {}).get("rows", [])),
            "per_call_s": [x for r in (v or {}).get("rows", []) for x in r.get("collective_cpu_s", [])],
            "explained": [x["collective_cpu_est_s"] / x["gap_s"] for x in s
                          if x.get("collective_cpu_est_s") is not None and x["gap_s"] > 0]}
