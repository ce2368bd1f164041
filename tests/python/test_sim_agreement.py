"""The noise criterion of benchmarks/scaling/validate_sim.py (sim_agreement.summarize): a simulated rank's CPU time
agrees with the real rank's only when the ratio's distance from 1 is within the real job's own run-to-run spread,
and one repeat gives no verdict. Pure arithmetic on made-up rows: no processes are started."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.scaling import sim_agreement  # noqa: E402


def _row(rank, real, sim, kind="fwd"):
    return {"workload": "w", "size": "s", "ranks": 2, "rank": rank, "kind": kind, "cpu_real_s": real,
            "cpu_sim_s": sim}


def test_within_and_outside_noise():
    # real repeats 1.0, 1.1, 0.9 (mean over the two ranks): spread 0.2 / 1.0 = 20 %
    inside = [_row(0, [1.0, 1.1, 0.9], [1.1, 1.1, 1.1]), _row(1, [1.0, 1.1, 0.9], [1.1, 1.1, 1.1])]
    (s,) = sim_agreement.summarize(inside)
    assert s["real_spread"] == pytest.approx(0.2)
    assert s["ratio"] == pytest.approx(1.1)
    assert s["ratio_range"] == pytest.approx([1.0, 1.1 / 0.9])
    assert s["within_noise"] is True
    assert [p["within_noise"] for p in s["per_rank"]] == [True, True]
    outside = [_row(0, [1.0, 1.02, 0.98], [0.7, 0.7, 0.7]), _row(1, [1.0, 1.02, 0.98], [0.7, 0.7, 0.7])]
    (s,) = sim_agreement.summarize(outside)
    assert s["ratio"] == pytest.approx(0.7) and s["within_noise"] is False


def test_groups_by_pass_and_one_repeat_gives_no_verdict():
    rows = [_row(0, [1.0], [1.0]), _row(0, [2.0], [2.0], kind="step")]
    out = sim_agreement.summarize(rows)
    assert [s["kind"] for s in out] == ["fwd", "step"]
    assert all(s["real_spread"] is None and s["within_noise"] is None for s in out)


def test_compute_measure_uses_its_own_keys():
    rows = [dict(_row(0, [1.0, 1.1, 0.9], [0.5, 0.5, 0.5]), compute_real_s=[0.8, 0.85, 0.75],
                 compute_sim_s=[0.8, 0.8, 0.8])]
    (cpu,) = sim_agreement.summarize(rows)
    (comp,) = sim_agreement.summarize(rows, "compute")
    assert cpu["within_noise"] is False and cpu["ratio"] == pytest.approx(0.5)
    assert comp["ratio"] == pytest.approx(0.8 / 0.8) and comp["within_noise"] is True
    assert sim_agreement.summarize([_row(0, [1.0], [1.0])], "compute") == []   # rows without the measure


def _full_row(rank, kind, kernel_sim):
    r = _row(rank, [1.0, 1.1, 0.9], [0.8, 0.8, 0.8], kind)
    r.update(compute_real_s=[0.9, 0.95, 0.85], compute_sim_s=[0.8, 0.8, 0.8], kernel_real_s=[0.5, 0.55, 0.45],
             kernel_sim_s=kernel_sim, runqueue_real_s=[0.001] * 3, runqueue_sim_s=[0.0] * 3,
             other_threads_cpu_real_s=[0.002] * 3, other_threads_cpu_sim_s=[0.0] * 3, comm_equal=[True] * 3,
             peak_real=[100, 100, 164], peak_sim=[100] * 3, bytes=0)
    return r


def test_rendered_tables_and_counts():
    rows = [_full_row(0, "fwd", [0.5] * 3), _full_row(1, "fwd", [0.5] * 3),
            _full_row(0, "step", [0.3] * 3), _full_row(1, "step", [0.3] * 3)]
    v = {"meta": {"command": "validate_sim", "repeats": 3, "iters": 5, "commit": "abc", "transport_priority": "idle"},
         "rows": rows, "summary": sim_agreement.summarize(rows)}
    for key in ("compute", "kernel"):
        v[f"summary_{key}"] = sim_agreement.summarize(rows, key)
    text = "\n".join(sim_agreement.validation_lines(v))
    assert "| w | 2 | fwd | 500.00 | 20.0 % | 1.00 (0.91–1.11) ✓ |" in text      # kernels agree
    assert "| w | 2 | step | 500.00 | 20.0 % | 0.60 (0.55–0.67) |" in text       # kernels 0.6: outside noise
    assert "| 1.00 | 2.00 |" in text                                             # run-queue and other threads, ms
    c = sim_agreement.validation_counts(v)
    assert c["kernel"] == {"groups": 2, "within": 1, "ratios": [1.0, 0.6], "straddle": 1}
    assert c["comm_all_equal"] and c["peak_max_diff"] == 64 and c["peak_sim_above"] == 0
    assert (c["peak_pairs"], c["peak_equal"]) == (12, 8) and c["step_other_threads_s"] == 0.002
    assert not c["peak_diff_within_comm_bytes"]  # 64 B above, and the made-up rows sent nothing
    for r in rows:
        r["bytes"] = 64
    assert sim_agreement.validation_counts(v)["peak_diff_within_comm_bytes"]
    assert "normal_kernel" not in c
    assert sim_agreement.validation_lines({"rows": []})[0].startswith("(no sim_validation.json")
