"""Which module issued which collectives in a forward pass (for the per-layer communication tables)."""
from __future__ import annotations

import shardtensor as st


def _diff(after: dict, before: dict) -> dict:
    out = {}
    for what in ("calls", "bytes"):
        d = {k: after[what].get(k, 0) - before[what].get(k, 0) for k in after[what]}
        out[what] = {k: v for k, v in d.items() if v}
    return out


def forward_comm_by_module(model, fwd) -> list[dict]:
    """Run ``fwd()`` once with hooks on every module; returns, per module that issued collectives itself
    (outside its children: functional calls like attention or ``mean`` in its ``forward``), its calls and bytes
    per kind, in execution order. Summed over the list: the whole forward."""
    stack, rows, handles = [], [], []

    def pre(name):
        def hook(mod, args):
            stack.append((name, st.comm_stats(), []))
        return hook

    def post(name):
        def hook(mod, args, out):
            n, before, children = stack.pop()
            total = _diff(st.comm_stats(), before)
            own = {w: dict(total[w]) for w in total}
            for c in children:
                for w in own:
                    for k, v in c[w].items():
                        own[w][k] = own[w].get(k, 0) - v
            own = {w: {k: v for k, v in own[w].items() if v} for w in own}
            if own["calls"]:
                rows.append({"module": n or "(model)", "type": type(mod).__name__, **own})
            if stack:
                stack[-1][2].append(total)
        return hook

    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(pre(name)))
        handles.append(mod.register_forward_hook(post(name)))
    try:
        fwd()
    finally:
        for h in handles:
            h.remove()
    return rows


def merge_max(per_rank: list[list[dict]]) -> list[dict]:
    """One list from every rank's (same modules, same order: the collectives are issued alike): per module and
    kind the max over ranks of calls and bytes (edge ranks of a halo exchange send less)."""
    merged = {}
    for rows in per_rank:
        for r in rows:
            m = merged.setdefault(r["module"], {"module": r["module"], "type": r["type"], "calls": {}, "bytes": {}})
            for what in ("calls", "bytes"):
                for k, v in r[what].items():
                    m[what][k] = max(m[what].get(k, 0), v)
    for m in merged.values():
        for k in m["calls"]:
            m["bytes"].setdefault(k, 0)
    return list(merged.values())
