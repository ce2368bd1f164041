"""A few seeds of the randomized networks (fuzz_nets.py) in every run: each family on 2 ranks, 3 ranks and a 2x2
mesh, strict mode, output and every gradient against one process. The long runs are fuzz_nets.py's command line."""
import pytest

from fuzz_nets import CONFIGS, run_seed

SEEDS = range(2 * len(CONFIGS))


@pytest.mark.parametrize("family", ["window", "tokens", "views"])
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_nets(family, seed):
    outcome, layers, layout, detail = run_seed(family, seed)
    assert outcome == "ok", f"{family} seed {seed}: {outcome}: layers {layers}, layout {layout}: {detail}"
