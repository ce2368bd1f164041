"""What `import shardtensor` changes in torch is exactly the inventory of python/shardtensor/_patches.py; a torch
other than the one the package was built and tested with is refused at import; the public namespace is __all__
and the documented subpackages."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a fresh interpreter: every attribute of the objects a patch could plausibly touch, before and after the
# import, by identity. The torch modules the package imports are imported first, so their arrival as attributes of
# their parent packages is not counted; what remains is what the package set.
_SNAPSHOT = r"""
import importlib, json, sys
import torch, torch.distributed, torch.nn.parallel, torch.nn.functional, torch._dynamo, torch._dynamo.eval_frame
import torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor
import torch.distributed.fsdp._fully_shard._fully_shard as fsdp2
import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp2_group
OWNERS = {
    "torch": torch, "torch.Tensor": torch.Tensor, "torch._C.TensorBase": torch._C.TensorBase,
    "torch.nn.Module": torch.nn.Module, "torch.nn.functional": torch.nn.functional,
    "torch.distributed": torch.distributed, "torch.distributed.tensor.DTensor": torch.distributed.tensor.DTensor,
    "torch.nn.parallel.DistributedDataParallel": torch.nn.parallel.DistributedDataParallel,
    "torch.distributed.fsdp.FullyShardedDataParallel": torch.distributed.fsdp.FullyShardedDataParallel,
    "torch.distributed.fsdp._fully_shard._fully_shard": fsdp2,
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup": fsdp2_group.FSDPParamGroup,
    "torch._dynamo.eval_frame.OptimizedModule": torch._dynamo.eval_frame.OptimizedModule,
    "torch._dynamo.eval_frame.OptimizeContext": torch._dynamo.eval_frame.OptimizeContext,
    "torch._functorch._aot_autograd.runtime_wrappers.AOTDispatchAutograd":
        torch._functorch._aot_autograd.runtime_wrappers.AOTDispatchAutograd,
    "torch.autograd.Function": torch.autograd.Function,
    "torch.nn.RNN": torch.nn.RNN,
    "torch.nn.LSTM": torch.nn.LSTM,
    "torch.nn.GRU": torch.nn.GRU,
}
def snapshot():
    return {owner: {k: id(v) for k, v in vars(obj).items() if not isinstance(v, type(sys))}
            for owner, obj in OWNERS.items()}
def bridge_kernels():
    out = []
    for packet_name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, packet_name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload)
            for key, kernel in list(op.py_kernels.items()):
                if getattr(kernel, "_shardtensor", False):
                    out.append(f"{op.name()}@{key}")
    return sorted(out)
before = snapshot()
import shardtensor
from shardtensor import _C, _patches
after = snapshot()
changed = sorted(f"{owner}.{k}" for owner in OWNERS for k in after[owner]
                 if before[owner].get(k) != after[owner][k])
removed = sorted(f"{owner}.{k}" for owner in OWNERS for k in before[owner] if k not in after[owner])
print(json.dumps({"changed": changed, "removed": removed,
                  "inventory": [p.target for p in _patches.PATCHES],
                  "installed": _patches.installed(),
                  "bridge": bridge_kernels(),
                  "above_autograd": sorted(_C.rules_above_autograd())}))
"""


def test_import_changes_exactly_the_inventory():
    r = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["removed"] == []
    assert sorted(got["changed"]) == sorted(got["installed"]), \
        f"import changed what the inventory does not list (or the reverse): {got['changed']} vs {got['installed']}"
    assert all(got["installed"].values()), got["installed"]
    # Every entry of the table is either installed or an optional owner this torch lacks (none here).
    assert sorted(got["installed"]) == sorted(got["inventory"])
    # The autograd bridge: Python kernels at the two autograd keys of aten ops whose rules run above autograd, and
    # of no other op.
    assert got["bridge"], "no bridge kernel installed"
    for entry in got["bridge"]:
        name, key = entry.split("@")
        assert name in got["above_autograd"], entry
        assert key in ("DispatchKey.AutogradCPU", "DispatchKey.AutogradCUDA"), entry


def _check_torch_with(monkeypatch, running, built):
    from shardtensor import _patches
    monkeypatch.setattr(torch, "__version__", running)
    info = types.ModuleType("shardtensor._build_info")
    info.TORCH_VERSION = built
    monkeypatch.setitem(sys.modules, "shardtensor._build_info", info)
    _patches.check_torch()


def test_torch_version_checks(monkeypatch):
    from shardtensor import _patches
    monkeypatch.delenv("SHARDTENSOR_ALLOW_UNTESTED_TORCH", raising=False)
    tested = _patches.TESTED_TORCH[0]
    _check_torch_with(monkeypatch, f"{tested}.7+cpu", f"{tested}.7+cu130")  # local build tags do not matter
    # Built for one torch, imported into another: always refused, naming both and the remedy.
    with pytest.raises(ImportError, match=r"built against torch 2\.11\.0 but this Python has torch 2\.11\.1.*rebuild"):
        _check_torch_with(monkeypatch, "2.11.1", "2.11.0")
    # A torch outside the tested range: refused, naming the private patches at risk and the way to proceed.
    with pytest.raises(ImportError) as err:
        _check_torch_with(monkeypatch, "2.99.0", "2.99.0")
    message = str(err.value)
    for patch in _patches.PATCHES:
        assert (patch.target in message) == patch.private, patch.target
    assert "SHARDTENSOR_ALLOW_UNTESTED_TORCH=1" in message
    monkeypatch.setenv("SHARDTENSOR_ALLOW_UNTESTED_TORCH", "1")
    with pytest.warns(RuntimeWarning, match="tested with torch"):
        _check_torch_with(monkeypatch, "2.99.0", "2.99.0")


def test_import_refuses_another_torch_build():
    """The real import path: the check runs before the compiled module loads."""
    code = "import torch; torch.__version__ = '2.11.9'; import shardtensor"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: shardtensor was built against torch"), r.stderr[-2000:]


def test_namespace_is_the_api():
    import shardtensor as st
    public = {n for n in dir(st) if not n.startswith("_")}
    assert public == set(st.__all__) | {"io", "ops", "compat", "checkpoint", "integrations"}
    for name in st.__all__:
        assert hasattr(st, name), name
    # PhysicsNeMo's names live behind shardtensor.compat.physicsnemo; on the package they say where.
    with pytest.raises(AttributeError, match="compat.physicsnemo"):
        st.DistributedManager
