"""The OpInfo sweep over every sample, a probe (not part of `make test`): where tests/python/op_sweep.py judges each
op on its first suitable sample, this runs up to `--samples N` of its samples per pattern (sharded unevenly along the
first, last or a middle dim on 2 ranks, forward and input gradient against one device; op_sweep's outcomes) and
reports each op whose samples disagree with its first: a `wrong`, `raises` or `diverged` sample, or a `fallback`
where the first sample ran on a rule. Other samples carry the kwargs and shapes the first does not (a dim argument,
keepdim, broadcasting operands, scalars), so this finds what the committed sweep cannot.

  PYTHONPATH=python .venv/bin/python tests/python/op_sweep_samples.py --samples 8 --out report.json [--ops a,b] [--world 3]
      [--patterns 'first x last']   # a 2x2 mesh splitting the first and the last dim
      [--dtype complex64]           # the samples of another dtype (float64, complex64, int64, bool, ...)
      [--errors]                    # OpInfo's error inputs: refused as on one device, on every rank, no hang
      [--reference]                 # OpInfo's reference inputs (larger and edge-case samples) instead
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _dtype():
    """The samples' dtype (`--dtype`, set before the rank pool starts)."""
    import torch
    return getattr(torch, os.environ.get("SHARDTENSOR_SWEEP_DTYPE", "float32"))


def dtype_ops(dtype):
    """The OpInfos with CPU samples of `dtype`, in the database's order, by key."""
    from op_sweep import op_key
    from torch.testing._internal.common_methods_invocations import op_db
    out = {}
    for info in op_db:
        if dtype in info.supported_dtypes("cpu") and op_key(info) not in out:
            out[op_key(info)] = info
    return out


def _samples(info, pattern, limit):
    import random

    import torch
    from op_sweep import _shard_dims
    # Sample generators may draw from Python's `random` or torch's generator: every rank must build the same samples.
    random.seed(0)
    torch.manual_seed(0)
    out = []
    dtype = _dtype()
    # --reference: OpInfo's reference inputs (the samples plus larger and edge-case ones, where an op defines them).
    source = info.reference_inputs if os.environ.get("SHARDTENSOR_SWEEP_REFERENCE") else info.sample_inputs
    for sample in source("cpu", dtype, requires_grad=False):
        x = sample.input
        if isinstance(x, torch.Tensor) and x.dtype == dtype and _shard_dims(x, pattern) is not None:
            out.append(sample)
            if len(out) >= limit:
                break
    return out


def run_samples(info, pattern, m, limit):
    """Every sample's outcome, as one string (agreed across ranks like op_sweep's single outcome)."""
    from op_sweep import _random, _run, strict_then_fallback
    outcomes = []
    for sample in _samples(info, pattern, limit):
        if _random(info, sample):
            outcomes.append("random")
            continue
        outcomes.append(strict_then_fallback(lambda strict, s=sample: _run(info, s, pattern, m, strict)))
    return "|".join(outcomes) or "n/a"


def run_error_inputs(info, pattern, m):
    """OpInfo's error inputs (arguments torch refuses), sharded like the samples: 'refused' when the op raises an
    exception of the type torch raises on one device (every rank: outcomes are agreed), 'no error' when it runs,
    'raises T' for another type, 'n/a' when one device does not raise or the input cannot be split."""
    import torch
    import shardtensor as st
    from cases_util import uneven_extents
    from op_sweep import _shard_dims
    outcomes = []
    try:
        errors = list(info.error_inputs("cpu"))
    except Exception:  # noqa: BLE001  (no error inputs on this device)
        return "n/a"
    for e in errors:
        sample = e.sample_input
        x = sample.input
        dims = _shard_dims(x, pattern) if isinstance(x, torch.Tensor) and x.dim() > 0 else None
        if dims is None or not (x.is_floating_point() or x.is_complex() or x.dtype in (torch.long, torch.bool)):
            outcomes.append("n/a")
            continue
        try:
            info.op(x.clone(), *sample.args, **sample.kwargs)
            outcomes.append("n/a")  # one device accepts it here
            continue
        except Exception as ref_error:  # noqa: BLE001
            ref_type = type(ref_error)
        ext = {i: uneven_extents(x.size(d), m.size(i), seed=x.numel() + i) for i, d in enumerate(dims)}
        xs = st.distribute_tensor(x.detach().clone(), m, [st.Shard(d) for d in dims], ext)
        try:
            info.op(xs, *sample.args, **sample.kwargs)
            outcomes.append("no error")
        except Exception as err:  # noqa: BLE001
            outcomes.append("refused" if isinstance(err, ref_type) or isinstance(err, e.error_type)
                            else f"raises {type(err).__name__} for {ref_type.__name__}")
    return "|".join(outcomes) or "n/a"


def case_errors(pattern, keys, log_path=None):
    from op_sweep import agreed_outcomes, pattern_mesh
    m = pattern_mesh(pattern)
    ops = dtype_ops(_dtype())
    return agreed_outcomes(keys, lambda key: run_error_inputs(ops[key], pattern, m), log_path)


def case_samples(pattern, keys, log_path=None):
    from op_sweep import agreed_outcomes, pattern_mesh
    limit = int(os.environ.get("SHARDTENSOR_SWEEP_SAMPLES", "8"))  # set before the rank pool starts
    m = pattern_mesh(pattern)
    ops = dtype_ops(_dtype())
    return agreed_outcomes(keys, lambda key: run_samples(ops[key], pattern, m, limit), log_path)


def findings(report):
    """(pattern, op, sample index, outcome) where a sample's outcome is worse than the op's first."""
    bad = []
    for pattern, ops in report.items():
        for op, joined in ops.items():
            outcomes = joined.split("|")
            first = outcomes[0]
            for i, o in enumerate(outcomes):
                if o.startswith("raises") or o in ("wrong", "diverged") or (o == "fallback" and first == "rule"):
                    if o != first or o in ("wrong", "diverged"):
                        bad.append((pattern, op, i, o))
    return bad


def main():
    sys.path.insert(0, HERE)
    import op_sweep
    import op_sweep_samples  # this file as a module: the ranks look case_samples up by its module's name
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8, help="samples per op and pattern (default 8)")
    parser.add_argument("--ops", help="comma-separated op keys (default: every op)")
    parser.add_argument("--world", type=int, default=op_sweep.WORLD, help="ranks of the 1-D patterns (default 2)")
    parser.add_argument("--patterns", default=",".join(op_sweep.PATTERNS),
                        help=f"comma-separated patterns (default: the 1-D ones; '{op_sweep.MESH_2D}': a 2x2 mesh)")
    parser.add_argument("--dtype", default="float32", help="the samples' dtype (default float32)")
    parser.add_argument("--reference", action="store_true",
                        help="OpInfo's reference inputs (samples plus larger and edge-case ones), not its samples")
    parser.add_argument("--errors", action="store_true",
                        help="OpInfo's error inputs instead: refused like one device, on every rank?")
    parser.add_argument("--out", required=True, help="the JSON report: {pattern: {op: 'outcome|outcome|...'}}")
    args = parser.parse_args()
    import harness
    try:
        import torch
        keys = args.ops.split(",") if args.ops else list(dtype_ops(getattr(torch, args.dtype)))
        os.environ["SHARDTENSOR_SWEEP_SAMPLES"] = str(args.samples)
        os.environ["SHARDTENSOR_SWEEP_DTYPE"] = args.dtype
        if args.reference:
            os.environ["SHARDTENSOR_SWEEP_REFERENCE"] = "1"
        # Some generators iterate a set of strings (meshgrid's indexing), whose order follows the per-process string
        # hash: the ranks (spawned after this) must hash alike to build the same samples.
        os.environ["PYTHONHASHSEED"] = "0"
        case = op_sweep_samples.case_errors if args.errors else op_sweep_samples.case_samples
        report = {p: op_sweep.sweep_pattern(p, keys, world=4 if p == op_sweep.MESH_2D else args.world, case=case)
                  for p in args.patterns.split(",")}
    finally:
        harness.close_all()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    if args.errors:
        for pattern, ops in report.items():
            for op, joined in ops.items():
                for i, o in enumerate(joined.split("|")):
                    if o not in ("refused", "n/a"):
                        print(f"{pattern:6} {op:40} error input {i}: {o}")
        return 0
    for pattern, op, i, o in findings(report):
        print(f"{pattern:6} {op:40} sample {i}: {o}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
