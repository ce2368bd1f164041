"""The five PhysicsNeMo ShardTensor tutorial examples ported in examples/physicsnemo/ (only their PhysicsNeMo imports
changed): each runs on 2 and 4 ranks and asserts its match with its single-device baseline. They run as they are
(``runpy``, as ``__main__``) in the harness's rank pools, which spares a torchrun start per example; one real
torchrun launch and one plain ``python script.py`` run check the launch paths. The pools are discarded afterwards:
the examples register handlers (torch.dot, knn) that must not reach other tests."""
import os
import runpy
import subprocess
import sys

import pytest

import harness

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = os.path.join(ROOT, "examples", "physicsnemo")
SCRIPTS = ["vector_add_sharded.py", "vector_dot_sharded.py", "knn_brute_force_sharded.py",
           "knn_brute_force_ring_sharded.py", "sharded_conv.py"]


def case_example(script, argv):
    """Run one example on this rank as a script: ``sys.argv`` and ``sys.path`` as ``python script.py argv``."""
    path = os.path.join(EXAMPLES, script)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path] + list(argv)
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return True


@pytest.fixture(scope="module", autouse=True)
def _fresh_pools_afterwards():
    yield
    for world in (2, 4):
        harness.discard(world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("script", SCRIPTS)
def test_example(script, world):
    harness.run(world, case_example, script, [])


VIT = os.path.join("vit", "training_script.py")


# The 2-D layout shards the positional embedding over "domain" and wraps the model in FSDP over "ddp" (FSDP2's
# fully_shard on CPUs, where FSDP v1 refuses to run): fully_shard localizes the sharded parameter first
# (shardtensor.data_parallel).
@pytest.mark.parametrize("world,argv", [
    (2, ["--domain_size", "2"]),                       # 1-D domain mesh
    (2, ["--ddp_size", "2"]),                          # data parallel only (DDP)
    (4, ["--domain_size", "4"]),                       # 1-D domain mesh
    (4, ["--ddp_size", "2", "--domain_size", "2"]),   # 2-D: data (FSDP) x domain
], ids=["2-domain2", "2-ddp2", "4-domain4", "4-ddp2xdomain2"])
def test_vit_training(world, argv):
    pytest.importorskip("einops")
    harness.run(world, case_example, VIT, ["--batch_size", "2"] + argv)


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "python"), env.get("PYTHONPATH")]))
    return env


def test_torchrun_launch():
    """A real launch, as the README says: torchrun with a free port, 2 ranks. The timeout only catches a hang."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          os.path.join(EXAMPLES, "vector_add_sharded.py")], capture_output=True, text=True,
                         timeout=300, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Tensor agreement? True" in out.stdout, out.stdout


def test_single_process_run():
    """``python script.py``: a one-process world (the script is its own single-device reference)."""
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "knn_brute_force_ring_sharded.py")],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Neighbors agreement? True" in out.stdout and "Distances agreement? True" in out.stdout, out.stdout
