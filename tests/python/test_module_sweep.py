"""The ModuleInfo sweep (tests/python/module_sweep.py) inside `make test`: a fixed subset of the modules, sharded along
their first and last dims (2 ranks) and along both over a 2x2 mesh, must give the outcomes recorded in module_sweep_expected.json (a better outcome fails too,
so the file and the docs stay true: regenerate them with `.venv/bin/python tests/python/module_sweep.py --update`);
the expected file covers every float64 module of this torch's ModuleInfo database; docs/supported-ops.md's
generated module list is current."""
import pytest

import module_sweep

STRIDE = 4   # every 4th module of the database: ~28 modules (convolutions, pools, norms, losses, recurrent, ...)


def test_expected_file_covers_every_module():
    expected = module_sweep.load_expected()
    keys = set(module_sweep.float64_modules())
    for pattern in module_sweep.PATTERNS:
        missing, extra = keys - set(expected[pattern]), set(expected[pattern]) - keys
        assert not missing and not extra, (pattern, sorted(missing)[:10], sorted(extra)[:10])


def test_docs_section_current():
    ok, _ = module_sweep.docs_section_current()
    assert ok, ("docs/supported-ops.md's generated module list differs from the expected file: run "
                "`.venv/bin/python tests/python/module_sweep.py --docs`")


@pytest.mark.parametrize("pattern,stride", [("first", STRIDE), ("last", STRIDE), (module_sweep.MESH_2D, 2 * STRIDE)])
def test_sweep_subset(pattern, stride):
    keys = list(module_sweep.float64_modules())[::stride]
    got = module_sweep.sweep_pattern(pattern, keys)
    diff = module_sweep.op_sweep.differences(module_sweep.load_expected(), {pattern: got})
    assert not diff, ("the sweep's outcomes changed (run `.venv/bin/python tests/python/module_sweep.py --update` "
                      "if the change is an improvement):\n" + "\n".join(diff))
