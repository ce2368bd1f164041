"""The OpInfo sweep (tests/python/op_sweep.py) inside `make test`: a fixed subset of the ops, sharded along their first
and last dims (2 ranks) and along both on a 2x2 mesh, must give the outcomes recorded in op_sweep_expected.json (a better outcome fails too, so the file and
the docs stay true: regenerate them with `.venv/bin/python tests/python/op_sweep.py --update`); the expected file
covers every float32 op of this torch's OpInfo database; docs/supported-ops.md's generated op list is current."""
import pytest

import op_sweep

STRIDE = 10   # every 10th op of the database: ~70 ops, every family of the database represented


def test_expected_file_covers_every_op():
    expected = op_sweep.load_expected()
    keys = set(op_sweep.float32_ops())
    for pattern in op_sweep.PATTERNS:
        missing, extra = keys - set(expected[pattern]), set(expected[pattern]) - keys
        assert not missing and not extra, (pattern, sorted(missing)[:10], sorted(extra)[:10])


def test_docs_section_current():
    ok, _ = op_sweep.docs_section_current()
    assert ok, ("docs/supported-ops.md's generated op list differs from the expected file and the registry: run "
                "`.venv/bin/python tests/python/op_sweep.py --docs`")


@pytest.mark.parametrize("pattern", ["first", "last", op_sweep.MESH_2D])
def test_sweep_subset(pattern):
    keys = list(op_sweep.float32_ops())[::STRIDE]
    got = op_sweep.sweep_pattern(pattern, keys, op_sweep._world(pattern))
    diff = op_sweep.differences(op_sweep.load_expected(), {pattern: got})
    assert not diff, ("the sweep's outcomes changed (run `.venv/bin/python tests/python/op_sweep.py --update` if "
                      "the change is an improvement):\n" + "\n".join(diff))
