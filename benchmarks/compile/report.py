"""compile.json and compile.md from the benchmark's payload (bench.py); `python report.py DIR` re-renders DIR's
compile.md from its compile.json."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import write_report  # noqa: E402
from results_dir import load_caveat  # noqa: E402


def _ms(s):
    return "–" if s is None else f"{s * 1e3:.1f} ms"


def _mode_row(w, m):
    if "error" in m:
        what = "did not compile" if m["mode"] != "eager" else "failed"
        return f"| {w['workload']} | {m['mode']} | {what}: {m['error'].replace('|', '/')} |" + " |" * 7
    lo, hi = m.get("step_spread_s") or (None, None)
    step = f"{_ms(m.get('step_s'))} ({_ms(lo)}–{_ms(hi)})"
    if m["mode"] == "eager":
        return f"| {w['workload']} | eager | ok | {step} | 1 | – | – | – | – | – |"
    ranks = m.get("first_step_s_per_rank") or []
    compile_s = f"{m['compile_s']:.1f} s" + (f" (first step per rank: {', '.join(f'{t:.1f}' for t in ranks if t)} s)"
                                              if ranks else "")
    ratio = f"**{m['ratio_to_eager']:.2f}**" if "ratio_to_eager" in m else "–"
    loss = f"{m['first_loss_vs_eager']:.1e}" if "first_loss_vs_eager" in m else "–"
    return (f"| {w['workload']} | {m['mode']} | ok | {step} | {ratio} | {compile_s} | {m['dynamo_graphs']} "
            f"({m['unique_graphs']}) | {m['graph_breaks']} | {m['fw_graphs']} / {m['bw_graphs']} | "
            f"{m['recompiles_in_timed_steps']} · {loss} |")


def _dispatch_lines(d):
    if d is None:
        return ["Dispatch overhead: not measured (--no-dispatch)."]
    if "error" in d:
        return [f"Dispatch overhead: the run failed: `{d['error']}`"]
    b, a = d["before"], d["after"]
    lines = [f"Before: `{b['file']}` (measured on commit `{b['measured_commit']}`, committed in `{b['file_commit']}`, "
             f"{b['date']}). After: this tree (commit `{a['commit']}`, {a['date']}), `{a['command']}`. Machine speed "
             f"ratio now / then (median over ops of the plain local-op time): {d['speed_ratio']:.2f}; the committed "
             f"added cost is scaled by it, and growth is an added cost above the scaled one by more than "
             f"{d['tolerance']}. Collectives issued: {a['collectives_issued']}.", "",
             "| op | before: local / shard µs | before: added µs (scaled) | after: local / shard µs "
             "| after: added µs | grew? |",
             "|---|---:|---:|---:|---:|---|"]
    for r in d["ops"]:
        before = (f"{r['before_local_us']:.2f} / {r['before_shard_us']:.2f} | {r['before_added_us']:.2f} "
                  f"({r['before_added_scaled_us']:.2f})" if "before_added_us" in r else "– | –")
        grew = "**yes**" if r.get("grew") else ("no" if "grew" in r else "–")
        lines.append(f"| {r['op']} | {before} | {r['after_local_us']:.2f} / {r['after_shard_us']:.2f} | "
                     f"{r['after_added_us']:.2f} | {grew} |")
    return lines


def lines(payload) -> list:
    meta = payload["meta"]
    out = ["# torch.compile of ShardTensor training steps vs eager", "",
           f"{meta['world_size']} Gloo CPU ranks, {meta['torch_threads_per_rank']} torch thread per rank, `nproc` = "
           f"{meta['nproc']}; torch {meta['torch']}; commit `{meta['commit']}`"
           f"{' (uncommitted changes)' if meta['tree_dirty'] else ''}; {meta['date']}; attention strategy "
           f"`{meta['attention_strategy']}`; extension `{meta['library']['file']}` built {meta['library']['built']}. "
           f"Command: `{meta['command']}` ({meta['wall_s'] / 60:.1f} min).",
           load_caveat(meta["load_start"], meta["load_end"], meta["nproc"]), "",
           "Step = forward (`torch.compile(model)` or eager) + loss + backward + SGD step, eagerly outside the model. "
           f"Step time: rank 0, median of {meta['steps']} steps after the first and {meta['warmup']} warm-up steps "
           "(range in brackets); the modes alternate step by step, so compiled / eager is a ratio within this run. "
           "Compile time: rank 0's first step minus its steady step (inductor cold: fresh cache, 1 compile "
           "thread per rank). Dynamo graphs: graphs handed to the backend (unique_graphs counter in brackets); "
           "graph breaks: `counters['graph_break']` over the first step; fw / bw: AOTAutograd forward / backward "
           "graphs compiled; recompiles during the timed steps · |first loss − eager first loss|.", ""]
    for w in payload["workloads"]:
        out.append(f"- **{w['workload']}**: {w['description']}; input sharded on dim 2 with extents "
                   f"{w['extents_dim2']}.")
    out += ["", "| workload | mode | status | step (range) | compiled / eager | compile time | Dynamo graphs "
            "(unique) | graph breaks | fw / bw graphs | recompiles · loss diff |", "|---" * 10 + "|"]
    out += [_mode_row(w, m) for w in payload["workloads"] for m in w["modes"]]
    reasons = [(w["workload"], m["mode"], k, v) for w in payload["workloads"] for m in w["modes"]
               for k, v in (m.get("graph_break_reasons") or {}).items()]
    if reasons:
        out += ["", "Graph break reasons:", ""] + [f"- {w} / {mo}: {k} (×{v})" for w, mo, k, v in reasons]
    out += ["", "## Eager dispatch overhead: committed vs this tree", ""]
    out += _dispatch_lines(payload["dispatch_overhead"])
    return out


def write(out_dir: str, payload: dict) -> None:
    write_report(out_dir, "compile", payload, lines(payload))


if __name__ == "__main__":
    with open(os.path.join(sys.argv[1], "compile.json")) as f:
        data = json.load(f)
    with open(os.path.join(sys.argv[1], "compile.md"), "w") as f:
        f.write("\n".join(lines(data)) + "\n")
