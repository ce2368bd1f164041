"""Timing, peak memory and communication of inference and of a training step for one case on this rank."""
from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist

from . import memory, timing
from .data import local_bytes, shard_inputs, to_device
from .parallel import wrap_data_parallel

try:
    from tqdm import tqdm
except ImportError:  # optional
    tqdm = None


def measure(workload, cfg, args, case, device, meshes, single: bool) -> dict:
    """Time inference and a training step, then one more of each for peak memory and communication."""
    size = case["size"]
    group = None if single else dist.group.WORLD
    data_rank = 0 if single else meshes["data_rank"]
    inputs, target = workload.make_input(cfg, size, args.batch, 1000 + data_rank)
    torch.manual_seed(0)
    model = workload.build(cfg, size).to(device)
    if not single:
        model = wrap_data_parallel(model, args, meshes, device)
        inputs, target = shard_inputs(workload, inputs, target, meshes["domain_mesh"], device)
    else:
        inputs, target = tuple(to_device(t, device) for t in inputs), to_device(target, device)
    param_bytes = memory.live_bytes(model)  # parameters only (no gradients or optimizer state yet)
    fwd, zero, step, opt = memory.training_closures(workload, model, inputs, target)

    row = {"size": workload.label(size), "elements": workload.elements(size), "ranks": case["ranks"],
           "data": case["data"], "domain": case["domain"], "modes": case["modes"], "single": single, "flops": workload.flops(cfg, size)}
    fc = []
    fw = timing.time_samples(fwd, device, args.iters, args.warmup, group, cpu=fc)
    row["fwd"] = timing.summary(timing.max_over_ranks(fw, group))
    row["fwd_cpu"] = timing.summary(timing.max_over_ranks(fc, group))
    row["fwd_per_rank_median"] = memory.gather(timing.summary(fw)["median"], group)
    row["comm_fwd"] = memory.comm(fwd)
    row["mem_fwd"] = memory.peak_bytes(fwd, device)
    row["live_state"] = memory.live_bytes(model)
    if not args.no_train:
        try:
            sc = []
            sw = timing.time_samples(step, device, args.iters, args.warmup, group, cpu=sc)
            row["step"] = timing.summary(timing.max_over_ranks(sw, group))
            row["step_cpu"] = timing.summary(timing.max_over_ranks(sc, group))
            row["step_per_rank_median"] = memory.gather(timing.summary(sw)["median"], group)
            row["comm_step"] = memory.comm(step)
            row["mem_step"] = memory.peak_bytes(step, device, prepare=zero)
            zero()
            row["live_state"] = memory.live_bytes(model, opt)  # params + optimizer state (grads freed)
        except RuntimeError as e:
            # A single-device training step that does not fit keeps its inference figures (no collective is
            # pending alone); a sharded one would leave the other ranks waiting, so it propagates.
            if not (single and is_oom(e)):
                raise
            row["step_skipped"] = "OOM"
        if row.get("step_skipped"):
            # Outside the except block: the failed step's frames (and their tensors) are released by now.
            zero()
            release(device)
    row["param_bytes"] = param_bytes
    row["input_bytes"] = sum(local_bytes(t) for t in inputs) + local_bytes(target)
    if device.type == "cuda":
        row["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
    if args.trace_comm and not single:
        from .trace import forward_comm_by_module, merge_max
        row["comm_fwd_by_module"] = merge_max(memory.gather(forward_comm_by_module(model, fwd), group))
    # Per-rank figures: every rank's own, gathered in rank order.
    per_rank = memory.gather({k: row.get(k) for k in KEYS_PER_RANK}, group)
    for k in KEYS_PER_RANK:
        if row.get(k) is not None:
            row[k + "_per_rank"] = [p[k] for p in per_rank]
    del model, opt, inputs, target
    release(device)
    return row


def release(device):
    """Hand cached CUDA blocks back after a case, so the next (larger) case starts from an empty cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


KEYS_PER_RANK = ("mem_fwd", "mem_step", "live_state", "param_bytes", "input_bytes", "comm_fwd", "comm_step",
                 "cuda_max_allocated")


def is_oom(e) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_cases(workload, args, cases, device, meshes, single: bool, rank: int) -> list[dict]:
    cfg = workload.config(args)
    rows = []
    bar = tqdm(total=len(cases), desc=f"{workload.name} P={cases[0]['ranks'] if not single else 1}", unit="case",
               file=sys.stdout) if (tqdm and rank == 0 and cases) else None
    for case in cases:
        if bar:
            bar.set_postfix_str(workload.label(case["size"]))
        if case["skip"]:
            rows.append({"size": workload.label(case["size"]), "elements": workload.elements(case["size"]),
                         "ranks": case["ranks"], "data": case["data"], "domain": case["domain"],
                         "modes": case["modes"], "single": single, "skipped": case["skip"]})
        else:
            oom = False
            try:
                rows.append(measure(workload, cfg, args, case, device, meshes, single))
            except RuntimeError as e:
                # Only a single-device OOM is recoverable (no collective is left half-issued); a sharded OOM
                # would leave other ranks waiting, so it propagates.
                if not (single and is_oom(e)):
                    raise
                oom = True
            if oom:
                release(device)
                rows.append({"size": workload.label(case["size"]), "elements": workload.elements(case["size"]),
                             "ranks": 1, "data": 1, "domain": 1, "modes": case["modes"], "single": True,
                             "skipped": "OOM"})
        if bar:
            bar.update()
    if bar:
        bar.close()
    return rows
