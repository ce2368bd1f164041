"""The GPU projection's use of the measured hidden shares (benchmarks/scaling/projection.py, issue 28 item 6): the
share per CommCounter kind is the least over the overlap benchmark's workloads (forward and backward halos together,
blocking all-reduces and gradient buckets together), clipped to [0, 1], ignoring kinds that moved almost nothing;
a kind's exposed time is (1 - share) x its time, ring passes still hide behind attention, and without measurements
everything else is exposed in full."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.scaling.projection import Assumptions, measured_hidden, project_rank  # noqa: E402


def _kind(transfer, alone):
    return {"exposed_min": transfer, "exposed_max": transfer, "transfer": transfer, "alone": alone, "per_step": 1}


def _write(tmp_path, rows):
    path = tmp_path / "overlap.json"
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_least_share_over_workloads(tmp_path):
    rows = [
        {"setting": "bucket 1 MiB", "kinds": {"halo (forward)": _kind(1.0, 4.0), "halo (backward)": _kind(1.0, 4.0),
                                              "gradient buckets": _kind(0.5, 1.0), "all_reduce": _kind(0.5, 1.0)}},
        {"setting": "bucket 1 MiB", "kinds": {"halo (forward)": _kind(3.0, 4.0), "all_gather": _kind(5.0, 1.0),
                                              "all_to_all": _kind(0.001, 0.01)}},
        {"setting": "bucket 0", "kinds": {"halo (forward)": _kind(4.0, 4.0)}},   # another setting: not used
    ]
    shares = measured_hidden(_write(tmp_path, rows))
    assert shares["halo"] == pytest.approx(0.25)        # min(1 - 2/8, 1 - 3/4)
    assert shares["all_reduce"] == pytest.approx(0.5)   # bucket and blocking all-reduces together: 1 - 1/2
    assert shares["all_gather"] == 0.0                  # exposed longer than alone: clipped
    assert "all_to_all" not in shares                   # 0.01 ms alone: below the threshold


def test_missing_results_expose_everything(tmp_path):
    assert measured_hidden(str(tmp_path / "absent.json")) == {}


def _row():
    # One rank of P = 2 with 1 ms of halo, 1 ms of all-reduce and a ring pass; its attention kernels take long.
    op = ("aten::_scaled_dot_product_flash_attention", 1e12, 0, 1)
    comm = {"calls": {"halo": 1, "all_reduce": 1, "ring_pass": 1},
            "bytes": {"halo": 1 << 20, "all_reduce": 1 << 20, "ring_pass": 1 << 20}}
    return {"rank": 0, "ranks": 2, "step": {"op_instances": [op], "comm": comm}}


def test_exposed_scales_with_share():
    full = Assumptions(hidden_share={})
    half = Assumptions(hidden_share={"halo": 0.5, "all_reduce": 1.0, "ring_pass": 0.0})
    a, b = project_rank(_row(), "step", full), project_rank(_row(), "step", half)
    comm = a["comm_s"]
    assert comm["ring_pass"] < a["attention_s"]                  # the ring hides behind attention either way
    assert a["comm_exposed_s"] == pytest.approx(comm["halo"] + comm["all_reduce"])
    assert b["comm_exposed_s"] == pytest.approx(0.5 * comm["halo"])
