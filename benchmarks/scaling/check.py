"""The correctness check against one device that runs before any timing."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import memory
from .data import full, shard_inputs, to_device
from .parallel import wrap_data_parallel


def rel_err(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf")
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def param_grads(model) -> dict:
    """Full gradient of every parameter by its name without wrapper prefixes (DDP's ``module.``)."""
    out = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):  # FSDP2: a DTensor sharded over the data axis
            g = g.full_tensor()
        out[name] = full(g)
    return out


def perturbed(model):
    """Seeded noise on every parameter, so that zero-initialised layers (adaLN-Zero gates, zero output heads)
    do not make outputs or gradients trivially equal."""
    g = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)
    return model


def reference(workload, cfg, size, batches, data_rank, device, dtype):
    """Single-device output and loss of this rank's sample and every parameter gradient of the mean loss over
    the data groups' samples, in ``dtype``."""
    torch.manual_seed(0)
    ref = perturbed(workload.build(cfg, size)).to(device=device, dtype=dtype)
    out_d = loss_d = None
    for d, (inputs, target) in enumerate(batches):
        cast = lambda t: to_device(t, device).to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() \
            else to_device(t, device)  # noqa: E731
        dev_inputs = tuple(cast(t) for t in inputs)
        out = ref(*dev_inputs)
        loss = workload.loss(out, cast(target), dev_inputs)
        (loss / len(batches)).backward()
        if d == data_rank:
            out_d, loss_d = out.detach(), loss.detach()
    return out_d, loss_d, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def check(workload, cfg, args, size, device, meshes) -> dict:
    """Sharded forward output, loss and every parameter gradient against the single-device model (computed on
    every rank; with a data axis the reference gradient is that of the mean loss over the data groups'
    samples). Errors are max |sharded - reference| / max |reference| against a float64 single-device reference;
    a tensor fails when its error exceeds both ``--check-tol`` and 10x the float32 single-device error (sums
    over many points cancel: fp32 rounding alone can be large relative to such a gradient). Raises on every
    rank when anything fails."""
    domain_mesh, data, data_rank = meshes["domain_mesh"], meshes["data"], meshes["data_rank"]
    batches = [workload.make_input(cfg, size, args.batch, 1000 + d) for d in range(data)]
    r32 = reference(workload, cfg, size, batches, data_rank, device, torch.float32)
    r64 = reference(workload, cfg, size, batches, data_rank, device, torch.float64)

    torch.manual_seed(0)
    model = wrap_data_parallel(perturbed(workload.build(cfg, size)).to(device), args, meshes, device)
    inputs, target = shard_inputs(workload, *batches[data_rank], domain_mesh, device)
    out = model(*inputs)
    loss = workload.loss(out, target, inputs)
    loss.backward()
    got = {"output": full(out), "loss": full(loss), **{"grad:" + n: g for n, g in param_grads(model).items()}}
    want32 = {"output": r32[0], "loss": r32[1], **{"grad:" + n: g for n, g in r32[2].items()}}
    want64 = {"output": r64[0], "loss": r64[1], **{"grad:" + n: g for n, g in r64[2].items()}}
    missing = sorted(set(want64) - set(got))
    errs, bad = {}, []
    worst = (None, -1.0, 0.0)
    for key, g in got.items():
        e, floor = rel_err(g, want64[key]), rel_err(want32[key], want64[key])
        if e > max(args.check_tol, 10 * floor):
            bad.append(f"{key}: error {e:.3g} (fp32 single device: {floor:.3g})")
        if key in ("output", "loss"):
            errs[key], errs[key + "_fp32_single"] = e, floor
        elif e > worst[1]:
            worst = (key[5:], e, floor)
    errs["grad_worst_param"], errs["grad_max"], errs["grad_max_fp32_single"] = worst
    if missing:
        bad.append(f"no gradient for {missing}")
    flag = torch.tensor([1.0 if bad else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0 and args.check_warn_only:
        errs["FAILED"] = memory.gather(bad, dist.group.WORLD)  # every rank's failures, recorded in the results
        return errs
    if flag.item() > 0:
        raise AssertionError(f"{workload.title}: sharded result differs from single device at size "
                             f"{workload.label(size)} on {data}x{meshes['domain']} ranks: "
                             + ("; ".join(bad) if bad else f"rank {dist.get_rank()} agrees, another rank failed"))
    return errs


def fmt_errs(e) -> str:
    fails = e.get("FAILED") or []
    head = (f"FAILED (timing anyway, --check-warn-only): {sum(len(f) for f in fails)} tensor(s) over all ranks, "
            f"rank 0's first: {fails[0][:3]}; " if fails else "")
    return head + (f"output {e['output']:.2g} (fp32 single device {e['output_fp32_single']:.2g}), loss {e['loss']:.2g}, "
            f"worst parameter gradient {e['grad_max']:.2g} ({e['grad_worst_param']}; fp32 single device "
            f"{e['grad_max_fp32_single']:.2g}), max abs error / max abs value of the float64 single-device result")
