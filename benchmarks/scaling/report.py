"""Derived figures (speed-up, efficiency, per-rank totals) and the Markdown report of one results JSON."""
from __future__ import annotations


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def fmt_comm(c) -> str:
    """``all_reduce 12 (3.1 KiB), ...`` for one rank's calls/bytes per kind."""
    if not c or not c.get("calls"):
        return "none"
    return ", ".join(f"{k} {c['calls'][k]} ({fmt_bytes(c['bytes'].get(k, 0))})" for k in sorted(c["calls"]))


def comm_max(row, key: str):
    """Per kind, the max over ranks of calls and of bytes sent (a halo exchange sends different amounts from
    the edge ranks)."""
    per = row.get(key + "_per_rank") or ([row[key]] if row.get(key) else [])
    out = {"calls": {}, "bytes": {}}
    for c in per:
        for what in ("calls", "bytes"):
            for k, v in c[what].items():
                out[what][k] = max(out[what].get(k, 0), v)
    for k in out["calls"]:
        out["bytes"].setdefault(k, 0)
    return out


def comm_total_bytes(c) -> int:
    return sum(c["bytes"].values()) if c and c.get("bytes") else 0


def measured(rows):
    return [r for r in rows if not r.get("skipped")]


def baseline(rows, row):
    """The single-device row of the same global size (None if it was not measured)."""
    for r in rows:
        if r.get("single") and r["size"] == row["size"] and not r.get("skipped"):
            return r
    return None


def per_rank_total(row, kind: str) -> list:
    """Per-rank peak of inference (``fwd``) or a training step (``step``): the allocator peak of the pass above
    what was live before it, plus what was live (parameters, and for a step the optimizer state; the local
    inputs)."""
    peak = row.get(f"mem_{kind}_per_rank") or [row.get(f"mem_{kind}")]
    live = row.get("live_state_per_rank" if kind == "step" else "param_bytes_per_rank") or \
        [row.get("live_state" if kind == "step" else "param_bytes")]
    inp = row.get("input_bytes_per_rank") or [row.get("input_bytes")]
    return [p + l + i for p, l, i in zip(peak, live, inp) if p is not None]


def per_rank_above_live(row, kind: str) -> list:
    """Per-rank bytes that a perfect split divides by P: the pass's allocator peak above the live state plus the
    rank's input shard (activations, gradients, temporaries, halos; not the replicated parameters/optimizer
    state)."""
    peak = row.get(f"mem_{kind}_per_rank") or [row.get(f"mem_{kind}")]
    inp = row.get("input_bytes_per_rank") or [row.get("input_bytes")]
    return [p + i for p, i in zip(peak, inp) if p is not None]


def memory_ratios(rows, row) -> dict | None:
    """Per pass (``fwd``, ``step``), this row's max-over-ranks memory against the single-device row of the same
    global size: ``per_rank_over_single`` (per-rank total / single total), ``P_times_per_rank_over_single``
    (P x that: 1 = a perfect split of everything, replicated parameters and optimizer state make it larger) and
    ``P_times_above_live_over_single`` (the same for the part a split divides: peak above the live state + the
    input shard; 1 = no surplus, halos and regathered windows add to it). P is the domain ranks (a data x domain
    mesh splits one sample over ``domain``). None without a baseline or for the single-device row itself."""
    b = baseline(rows, row)
    if b is None or row.get("single") or row.get("skipped"):
        return None
    P = row.get("domain", row["ranks"])
    out = {}
    for kind in ("fwd", "step"):
        t, bt = per_rank_total(row, kind), per_rank_total(b, kind)
        a, ba = per_rank_above_live(row, kind), per_rank_above_live(b, kind)
        if not t or not bt or not max(bt):
            continue
        out[kind] = {"P": P, "per_rank_over_single": round(max(t) / max(bt), 4),
                     "P_times_per_rank_over_single": round(P * max(t) / max(bt), 4),
                     "P_times_above_live_over_single": round(P * max(a) / max(ba), 4) if a and ba and max(ba) else None}
    return out or None


def annotate_memory_ratios(rows):
    """Writes ``memory_ratio`` (see memory_ratios) into every sharded row that has a single-device baseline."""
    for r in rows:
        m = memory_ratios(rows, r)
        if m:
            r["memory_ratio"] = m


def speedup(rows, row, kind: str):
    """Throughput ratio against one device at the same global size: ``data * T(1) / T(P)`` (``data`` samples
    are processed per step on a data x domain mesh); None without a baseline."""
    b = baseline(rows, row)
    if b is None or kind not in row or kind not in b:
        return None
    return row.get("data", 1) * b[kind]["median"] / row[kind]["median"]


def weak_rows(rows):
    """(ranks, row) of the weak-scaling series, single device first."""
    out = [r for r in measured(rows) if "weak" in r["modes"]]
    return sorted(out, key=lambda r: r["ranks"])


def weak_efficiency(rows, row, kind: str):
    base = [r for r in weak_rows(rows) if r["ranks"] == 1]
    if not base or kind not in row or kind not in base[0]:
        return None
    return base[0][kind]["median"] / row[kind]["median"]


def oversubscribed(meta, row) -> bool:
    """More CPU ranks x threads than cores, or more ranks than GPUs (ranks sharing a GPU): time-sliced."""
    m = meta.get("machine") or {}
    if meta.get("device") == "cuda":
        return not meta.get("torchrun") and row["ranks"] > (m.get("gpus") or 1)
    cores = m.get("affinity") or m.get("cpu_count") or 1
    return row["ranks"] * meta.get("threads_per_rank", 1) > cores


def ms(row, kind):
    if kind not in row:
        return row.get(kind + "_skipped", "-")
    s = row[kind]
    return f"{s['median'] * 1e3:.1f} ± {s['std'] * 1e3:.1f}"


def write_markdown(data: dict, path: str):
    meta, rows = data["meta"], data["rows"]
    cfg = meta["config"]
    title = meta["workload"]
    maxp = max(r["ranks"] for r in rows) if rows else 1
    L = [f"# {title}: domain-parallel scaling, 1 to {maxp} {meta['device']} ranks", "",
         f"Command: `{meta['command']}`", "",
         f"torch {meta['torch']}, commit {meta['commit']}, {meta['date']}, {meta['threads_per_rank']} intra-op "
         f"thread(s) per rank and for the single device, batch {meta['batch']} per domain group, "
         f"{meta['warmup']} warm-up + {meta['iters']} timed iterations (median ± std of the per-iteration max over "
         f"ranks; a barrier before each iteration{', a CUDA synchronise after it' if meta['device'] == 'cuda' else ''})."
         f" Whole run {meta['wall_s']} s. Machine: {meta.get('machine')}; load average (1, 5, 15 min) "
         f"of the machine: {meta.get('loadavg_at_start', '?')} at the start, {meta.get('loadavg_at_end')} at the end" + (f"; {meta['load_note']}" if meta.get("load_note") else "") + ".",
         "", f"Model configuration: `{cfg}`.", ""]
    if meta.get("aborted_launches"):
        L += ["Rank processes that aborted (native abort while shutting down; see benchmarks/scaling/runner.py): "
              + "; ".join(meta["aborted_launches"]) + ".", ""]
    loads = [float(x[0]) for x in (meta.get("loadavg_at_start"), meta.get("loadavg_at_end")) if x]
    cores = (meta.get("machine") or {}).get("affinity") or 1
    if meta["device"] == "cpu" and loads and max(loads) > cores:
        L += [f"**The machine was shared**: 1-minute load average up to {max(loads):.1f} on {cores} cores (other "
              "jobs, e.g. compilers, were running), so the ranks and the baseline were time-sliced with them. "
              "Timings and speed-ups are rough; memory and communication figures are unaffected.", ""]
    if meta.get("mesh"):
        L += [f"Mesh {meta['mesh']} (data x domain), {meta['data_parallel']} on the data axis: each data group "
              "runs its own sample; speed-up is the throughput ratio data·T(1)/T(P).", ""]
    L += [f"- {n}" for n in meta.get("notes", [])]
    if meta.get("malloc_env"):
        L.append(f"- glibc malloc keeps large freed blocks ({', '.join(f'{k}={v}' for k, v in meta['malloc_env'].items())}): "
                 "otherwise every step page-faults its large temporaries back in, which doubled a no_grad forward's "
                 "CPU time here (`--system-malloc` turns this off).")
    failed = {p: e["FAILED"] for p, e in (meta.get("checks") or {}).items() if e.get("FAILED")}
    if failed:
        L += ["", "**CORRECTNESS CHECK FAILED** (run with `--check-warn-only`; the figures below time a computation "
              "that differs from one device): " + "; ".join(
                  f"{p} ranks: {sum(len(f) for f in v)} tensors over all ranks, e.g. " + "; ".join(v[0][:4])
                  for p, v in failed.items()) + " (full list in the JSON, meta.checks)."]
    L += ["", "## Correctness (before timing)", ""]
    if meta.get("checks"):
        for p, e in sorted(meta["checks"].items(), key=lambda kv: int(kv[0])):
            L.append(f"- {p} ranks: output {e['output']:.2g} (fp32 single device: {e['output_fp32_single']:.2g}), "
                     f"loss {e['loss']:.2g}, worst parameter gradient {e['grad_max']:.2g} (`{e['grad_worst_param']}`; "
                     f"fp32 single device: {e['grad_max_fp32_single']:.2g}).")
        L.append("- Error = max abs difference / max abs value against the float64 single-device computation; a "
                 "tensor fails (and the run aborts before timing) above both the tolerance and 10x the error of "
                 "the float32 single-device computation.")
    else:
        L.append("- not run (single rank only, or --no-check)")
    over = any(oversubscribed(meta, r) for r in rows)
    L += ["", "Definitions: inference = `model(x)` under `no_grad`; training step = `zero_grad`, forward, loss, "
          "backward, `AdamW.step` (foreach off). speed-up = T(1 device)/T(P) at the same global size; efficiency = "
          "speed-up/P. CPU-time speed-up = the same ratio of per-rank thread CPU time (max over ranks; CPU runs "
          "with one intra-op thread): the compute split alone, without waiting for other ranks or being "
          "time-sliced away by other processes (CPU only; not a wall-clock speed-up). Memory per rank = allocator peak of one pass above what was live before it + what was live "
          "(parameters; for a step also the AdamW state) + the rank's input shard; max over ranks, the per-rank "
          "list in brackets. Communication = collectives the library issued on each rank per inference / per "
          "training step (kind, calls, bytes sent; max over ranks); collectives of DDP/FSDP2 and "
          "`sync_module` are torch's own and not counted. Bytes per call as `st.CommCounter` counts them: "
          "all-reduce the tensor, all-gather the gathered result, all-to-all (halo exchanges included) and ring "
          "pass what the rank sends to other ranks (its own piece excluded)."
          + (" Rows marked * ran more ranks than this machine has cores or GPUs (time-sliced or sharing a GPU): "
             "their times are not speed-ups; memory and communication remain valid." if over else ""), ""]

    strong = [r for r in rows if "strong" in r["modes"]]
    if strong:
        L += ["## Strong scaling (fixed global input)", "",
              f"| size | {meta.get('unit', 'elements')} | ranks | inference ms | train step ms | inference speed-up (eff.) | "
              "train speed-up (eff.) | CPU-time speed-up inference / train | inference mem/rank | train mem/rank | "
              "comm/rank per step |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(strong, key=lambda r: (r["elements"], r["ranks"])):
            L.append(_row(meta, rows, r))
    ratio_rows = [(r, m) for r in sorted(measured(rows), key=lambda r: (r["elements"], r["ranks"]))
                  if (m := memory_ratios(rows, r))]
    if ratio_rows:
        L += ["", "## Memory per rank against one device", "",
              "P = domain ranks sharing one sample. **P x per-rank / single** = P x (max over ranks of the per-rank "
              "total) / (the single-device total at the same global size): 1.00 is a perfect split, replicated "
              "parameters and optimizer state raise it (each rank holds all of them). **activations** = the same "
              "ratio for what a split divides, the pass's peak above the live state plus the input shard: above "
              "1.00 is the surplus (halos, regathered windows, replicated intermediates). Equivalently, per-rank / "
              "ideal (single/P) is the P x figure.", "",
              "| size | ranks | P | inference per-rank / single | inference P x per-rank / single | inference "
              "activations P x / single | train per-rank / single | train P x per-rank / single | train activations "
              "P x / single |", "|---|---|---|---|---|---|---|---|---|"]
        for r, m in ratio_rows:
            cells = []
            for kind in ("fwd", "step"):
                k = m.get(kind)
                cells += ["-"] * 3 if not k else [
                    f"{k['per_rank_over_single']:.2f}", f"{k['P_times_per_rank_over_single']:.2f}",
                    "-" if k["P_times_above_live_over_single"] is None else f"{k['P_times_above_live_over_single']:.2f}"]
            L.append(f"| {r['size']} | {r['ranks']} | {m[next(iter(m))]['P']} | " + " | ".join(cells) + " |")
    weak = [r for r in rows if "weak" in r["modes"]]
    if weak:
        L += ["", "## Weak scaling (fixed input per rank)", "",
              "E_w = T(1 rank, n)/T(P ranks, P·n)" + ("; FLOP-normalised E_w·FLOP(P·n)/(P·FLOP(n)) in brackets "
                                                      "(global attention's per-rank FLOPs grow with P)"
                                                      if any(r.get("flops") for r in weak) else "") + ".", "",
              "| ranks | global size | inference ms | train step ms | inference E_w | train E_w | CPU-time E_w inference / train | train mem/rank | comm/rank per step |",
              "|---|---|---|---|---|---|---|---|---|"]
        base = [r for r in weak if r["ranks"] == 1 and not r.get("skipped")]
        for r in sorted(weak, key=lambda r: r["ranks"]):
            if r.get("skipped"):
                L.append(f"| {r['ranks']} | {r['size']} | skipped: {r['skipped']} | | | | | | |")
                continue
            eff = []
            for kind in ("fwd", "step"):
                e = weak_efficiency(rows, r, kind)
                if e is not None and base and r.get("flops") and base[0].get("flops"):
                    e_f = e * r["flops"] / (r["ranks"] * base[0]["flops"])
                    eff.append(f"{e:.2f} ({e_f:.2f})")
                else:
                    eff.append("-" if e is None else f"{e:.2f}")
            tm = per_rank_total(r, "step")
            ce = [weak_efficiency(rows, r, k + "_cpu") for k in ("fwd", "step")]
            ce = " / ".join("-" if e is None else f"{e:.2f}" for e in ce)
            L.append(f"| {r['ranks']}{'*' if oversubscribed(meta, r) else ''} | {r['size']} | {ms(r, 'fwd')} | "
                     f"{ms(r, 'step')} | {eff[0]} | {eff[1]} | {ce} | {fmt_bytes(max(tm)) if tm else '-'} | "
                     f"{fmt_comm(comm_max(r, 'comm_step'))} |")
    comm_rows = [r for r in measured(rows) if not r.get("single")]
    if comm_rows:
        L += ["", "## Communication per rank", "",
              "Per kind: calls (bytes sent), max over ranks; 'same on all ranks' compares every rank's calls "
              "and bytes (halo exchanges send different amounts from edge ranks).", "",
              "| size | ranks | inference | training step | same on all ranks |", "|---|---|---|---|---|"]
        for r in sorted(comm_rows, key=lambda r: (r["elements"], r["ranks"])):
            same = all(c == r["comm_step_per_rank"][0] for c in r.get("comm_step_per_rank", [])) and \
                all(c == r["comm_fwd_per_rank"][0] for c in r.get("comm_fwd_per_rank", []))
            L.append(f"| {r['size']} | {r['ranks']} | {fmt_comm(comm_max(r, 'comm_fwd'))} | {fmt_comm(comm_max(r, 'comm_step'))} | "
                     f"{'yes' if same else 'no (per rank: ' + str([comm_total_bytes(c) for c in r.get('comm_step_per_rank', [])]) + ' B)'} |")
    traced = [r for r in comm_rows if r.get("comm_fwd_by_module")]
    if traced:
        r = traced[0]
        L += ["", f"## Forward collectives by module (size {r['size']}, {r['ranks']} ranks)", "",
              "Collectives issued inside each module's own `forward` (children excluded), in completion order; "
              "calls and bytes sent, max over ranks.", "",
              "| module | type | collectives |", "|---|---|---|"]
        for m in r["comm_fwd_by_module"]:
            L.append(f"| `{m['module']}` | {m['type']} | {fmt_comm(m)} |")
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        L += ["", "Skipped: " + "; ".join(f"{r['size']} on {r['ranks']} ranks ({r['skipped']})" for r in skipped)]
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def _row(meta, rows, r) -> str:
    if r.get("skipped"):
        return f"| {r['size']} | {r['elements']} | {r['ranks']} | skipped: {r['skipped']} | | | | | | | |"
    cells = []
    for kind in ("fwd", "step"):
        s = speedup(rows, r, kind)
        cells.append("1" if r.get("single") else ("-" if s is None else f"{s:.2f} ({s / r['ranks']:.0%})"))
    mem = []
    b = baseline(rows, r)
    for kind in ("fwd", "step"):
        t = per_rank_total(r, kind)
        if not t:
            mem.append("-")
            continue
        txt = fmt_bytes(max(t))
        if len(t) > 1:
            txt += " [" + ", ".join(fmt_bytes(x) for x in t) + "]"
        bt = per_rank_total(b, kind) if b else None
        if bt and not r.get("single"):
            txt += f" ({max(t) / max(bt):.2f}x single)"
        mem.append(txt)
    cpu = []
    for kind in ("fwd", "step"):
        s = speedup(rows, r, kind + "_cpu")
        cpu.append("1" if r.get("single") else ("-" if s is None else f"{s:.2f}"))
    mark = "*" if oversubscribed(meta, r) else ""
    label = "1 (single device)" if r.get("single") else (f"{r['ranks']}{mark}" if r.get("data", 1) == 1
                                                          else f"{r['ranks']}{mark} ({r['data']}x{r['domain']})")
    return (f"| {r['size']} | {r['elements']} | {label} | {ms(r, 'fwd')} | {ms(r, 'step')} | {cells[0]} | "
            f"{cells[1]} | {cpu[0]} / {cpu[1]} | {mem[0]} | {mem[1]} | {fmt_comm(comm_max(r, 'comm_step'))} |")
