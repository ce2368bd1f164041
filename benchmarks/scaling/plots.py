"""One PNG per results JSON: strong-scaling speed-up and efficiency against ranks (with the ideal lines), weak
scaling efficiency, latency against input size with the single-device crossover, per-rank memory and
communication against input size."""
from __future__ import annotations

from benchmarks import results_dir

from . import report


def _spread_ms(stat: dict):
    """(below, above) the median in ms: the range of the timed iterations (the std when no samples were kept).
    The kept samples are rounded, so a median that is itself the lowest or highest sample (one or two iterations)
    may fall just outside their range: clamped at 0."""
    med = stat["median"]
    if stat.get("samples"):
        return max(med - min(stat["samples"]), 0.0) * 1e3, max(max(stat["samples"]) - med, 0.0) * 1e3
    return min(stat.get("std", 0.0), med) * 1e3, stat.get("std", 0.0) * 1e3


def _floats(values):
    return [float(v) for v in values] if values else None


def _crossover(single, sharded, kind):
    """Smallest size (elements) from which the sharded run is faster than one device at every larger size."""
    by_size = {r["elements"]: r for r in single if kind in r}
    pts = sorted((r["elements"], r[kind]["median"] < by_size[r["elements"]][kind]["median"])
                 for r in sharded if kind in r and r["elements"] in by_size)
    cross = None
    for e, faster in pts:
        if faster and cross is None:
            cross = e
        elif not faster:
            cross = None
    return cross


def plot(data: dict, path: str):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    meta, rows = data["meta"], report.measured(data["rows"])
    unit = meta.get("unit", "elements")
    strong = [r for r in rows if "strong" in r["modes"]]
    ranks = sorted({r["ranks"] for r in rows})
    sizes = sorted({r["elements"] for r in strong})
    over = any(report.oversubscribed(meta, r) for r in rows)
    fig, ax = plt.subplots(2, 3, figsize=(16, 9))
    kinds = [k for k in ("fwd", "step") if any(k in r for r in rows)]
    names = {"fwd": "inference", "step": "train step"}
    styles = {"fwd": "-", "step": "--"}

    # (0,0) speed-up vs ranks, one line per size; (0,1) efficiency.
    for e in sizes:
        sel = sorted((r for r in strong if r["elements"] == e), key=lambda r: r["ranks"])
        for kind in kinds:
            pts = [(r["ranks"], report.speedup(data["rows"], r, kind)) for r in sel]
            pts = [(p, s) for p, s in pts if s is not None]
            if len(pts) < 2:
                continue
            label = f"{sel[0]['size']} {names[kind]}"
            ax[0, 0].plot([p for p, _ in pts], [s for _, s in pts], styles[kind], marker="o", label=label)
            ax[0, 1].plot([p for p, _ in pts], [s / p for p, s in pts], styles[kind], marker="o", label=label)
    # CPU runs: the per-rank thread CPU-time ratio of the largest size (the compute split, without waiting).
    if meta.get("device") == "cpu" and sizes:
        sel = sorted((r for r in strong if r["elements"] == sizes[-1]), key=lambda r: r["ranks"])
        for kind in kinds:
            pts = [(r["ranks"], report.speedup(data["rows"], r, kind + "_cpu")) for r in sel]
            pts = [(p, v) for p, v in pts if v is not None]
            if len(pts) > 1:
                ax[0, 0].plot([p for p, _ in pts], [v for _, v in pts], styles[kind], marker="x", color="k", lw=0.8,
                              label=f"{sel[0]['size']} {names[kind]}, CPU time")
    ax[0, 0].plot(ranks, ranks, color="gray", lw=1, ls=":", label="ideal")
    for a in ax[0]:
        a.set_xticks(ranks)
    ax[0, 1].axhline(1.0, color="gray", lw=1, ls=":", label="ideal")
    ax[0, 0].set(title="strong scaling: speed-up", xlabel="ranks", ylabel="T(1 device) / T(P)")
    ax[0, 1].set(title="strong scaling: efficiency", xlabel="ranks", ylabel="speed-up / P")

    # (0,2) weak scaling efficiency.
    weak = report.weak_rows(data["rows"])
    for kind in kinds:
        pts = [(r["ranks"], report.weak_efficiency(data["rows"], r, kind)) for r in weak]
        pts = [(p, e) for p, e in pts if e is not None]
        if pts:
            ax[0, 2].plot([p for p, _ in pts], [e for _, e in pts], styles[kind], marker="s", label=names[kind])
    ax[0, 2].axhline(1.0, color="gray", lw=1, ls=":", label="ideal")
    ax[0, 2].set(title="weak scaling: T(1, n) / T(P, P·n)", xlabel="ranks", ylabel="efficiency")

    # (1,0) latency vs size per rank count, crossover marked.
    single = [r for r in strong if r.get("single")]
    for p in ranks:
        sel = sorted((r for r in strong if r["ranks"] == p), key=lambda r: r["elements"])
        for kind in kinds:
            pts = [(r["elements"], r[kind]["median"] * 1e3, _spread_ms(r[kind])) for r in sel if kind in r]
            if pts:
                ax[1, 0].errorbar([x for x, _, _ in pts], [y for _, y, _ in pts],
                                  yerr=[[e[0] for _, _, e in pts], [e[1] for _, _, e in pts]], fmt=styles[kind],
                                  marker="o", capsize=3, label=f"{'1 device' if p == 1 else f'{p} ranks'} {names[kind]}")
        if p > 1:
            for kind in kinds:
                c = _crossover(single, sel, kind)
                if c is not None:
                    ax[1, 0].axvline(c, color="k", lw=0.8, ls=styles[kind])
                    ax[1, 0].annotate(f"crossover {names[kind]}, {p} ranks", (c, 0.98),
                                      xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7)
    ax[1, 0].set(title="latency vs input size (bars: range of the timed iterations)", xlabel=unit,
                 ylabel="ms (median, max over ranks)")
    ax[1, 0].set_xscale("log")
    ax[1, 0].set_yscale("log")

    # (1,1) memory per rank vs size; ideal = single / P.
    for p in ranks:
        sel = sorted((r for r in strong if r["ranks"] == p), key=lambda r: r["elements"])
        for kind in kinds:
            pts = [(r["elements"], max(report.per_rank_total(r, kind)) / 2**20) for r in sel if report.per_rank_total(r, kind)]
            if pts:
                ax[1, 1].plot([x for x, _ in pts], [y for _, y in pts], styles[kind], marker="o",
                              label=f"{'1 device' if p == 1 else f'{p} ranks (max over ranks)'} {names[kind]}")
    for p in ranks:
        if p == 1:
            continue
        for kind in kinds[-1:]:
            pts = [(r["elements"], max(report.per_rank_total(r, kind)) / 2**20 / p) for r in sorted(single, key=lambda r: r["elements"])
                   if report.per_rank_total(r, kind)]
            if pts:
                ax[1, 1].plot([x for x, _ in pts], [y for _, y in pts], color="gray", lw=0.8, ls=":",
                              label=f"ideal 1/{p} of single ({names[kind]})")
    ax[1, 1].set(title="peak memory per rank", xlabel=unit, ylabel="MiB")
    ax[1, 1].set_xscale("log")
    ax[1, 1].set_yscale("log")

    # (1,2) communication per rank per step vs size.
    for p in ranks:
        if p == 1:
            continue
        sel = sorted((r for r in strong if r["ranks"] == p), key=lambda r: r["elements"])
        for kind in kinds:
            key = "comm_" + kind
            pts = [(r["elements"], max(report.comm_total_bytes(c) for c in r.get(key + "_per_rank", [r.get(key)])) / 2**20)
                   for r in sel if r.get(key)]
            if pts:
                ax[1, 2].plot([x for x, _ in pts], [max(y, 1e-6) for _, y in pts], styles[kind], marker="o",
                              label=f"{p} ranks {names[kind]}")
    ax[1, 2].set(title="library communication per rank", xlabel=unit, ylabel="MiB sent (max over ranks)")
    ax[1, 2].set_xscale("log")
    ax[1, 2].set_yscale("log")

    from matplotlib.ticker import NullFormatter
    for a in ax[1]:
        a.xaxis.set_minor_formatter(NullFormatter())  # log axes: major labels only, no overlapping minor ones
    for a in ax.flat:
        a.grid(True, which="both", lw=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    title = (f"{meta['workload']} on {meta['device']} (torch {meta['torch']}, {meta['threads_per_rank']} thread/rank"
             + (", oversubscribed: times are time-sliced" if over else "") + ")")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.025, 1, 1))
    results_dir.add_caveat(fig, results_dir.load_caveat(_floats(meta.get("loadavg_at_start")),
                                                        _floats(meta.get("loadavg_at_end")),
                                                        (meta.get("machine") or {}).get("cpu_count")))
    fig.savefig(path, dpi=100)
    plt.close(fig)
