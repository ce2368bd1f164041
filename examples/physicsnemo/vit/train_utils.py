"""The training loop of the ViT example, and its check against one device.

The tutorial's utils/ time the forward and training steps with CUDA events and read CUDA peak memory; this
version runs the same loop (AdamW, cross-entropy) for a few steps on any device, times it, and replays it on an
unsharded copy of the model with the whole global batch, comparing every step's loss and the final logits.
"""
import argparse
import time

import torch
from torch import nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train the hybrid ViT with domain parallelism (small sizes)")
    p.add_argument("--batch_size", type=int, default=2, help="global batch size")
    p.add_argument("--dimension", type=int, default=2, choices=[2, 3], help="2-D images or 3-D volumes")
    p.add_argument("--image_size_start", type=int, default=32)
    p.add_argument("--image_size_stop", type=int, default=32)
    p.add_argument("--image_size_step", type=int, default=16)
    p.add_argument("--ddp_size", type=int, default=1, help="data-parallel size")
    p.add_argument("--domain_size", type=int, default=1, help="domain-parallel size")
    p.add_argument("--use_mixed_precision", action="store_true", help="autocast on CUDA")
    # Smaller than the tutorial's ViT-Base (768 wide, 16 blocks, 1000 classes) so it trains in seconds on a CPU.
    p.add_argument("--embed_dim", type=int, default=32)
    p.add_argument("--num_heads", type=int, default=2)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--num_classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=3, help="training steps compared with the baseline")
    return p.parse_args(argv)


def _context(use_mixed_precision):
    import contextlib
    if use_mixed_precision and torch.cuda.is_available():
        return torch.autocast("cuda")
    return contextlib.nullcontext()


def _value(t: torch.Tensor) -> float:
    # .item() of a sharded scalar is a collective (every rank of its mesh calls it).
    return float(t.detach().item())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def end_to_end_benchmark(args, model, inputs, baseline, group_slice, full_img_size):
    """Train ``model`` on ``inputs`` (this data group's sample, sharded or not) for ``args.steps`` steps, and the
    unsharded ``baseline`` model on the global batch ``(x, target)``; return the timings and whether every step's
    loss of this group's samples and the final logits agree."""
    x, target = inputs
    base_model, global_x, global_target = baseline
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    base_optimizer = torch.optim.AdamW(base_model.parameters(), lr=1e-3, weight_decay=0.05)
    loss_fn = nn.CrossEntropyLoss()
    context = _context(args.use_mixed_precision)

    losses, base_losses, step_times = [], [], []
    for _ in range(args.steps):
        start = time.time()
        optimizer.zero_grad()
        with context:
            loss = loss_fn(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(_value(loss))
        step_times.append(time.time() - start)

        # One device, the whole global batch: its mean loss is the mean of the data groups' losses, whose
        # gradients DDP/FSDP average.
        base_optimizer.zero_grad()
        with context:
            logits = base_model(global_x)
            base_loss = loss_fn(logits, global_target)
        base_loss.backward()
        base_optimizer.step()
        base_losses.append(float(loss_fn(logits[group_slice], global_target[group_slice]).detach()))

    with torch.no_grad():
        start = time.time()
        logits = _full(model(x))
        forward_time = time.time() - start
        base_logits = base_model(global_x)[group_slice]
    losses_match = torch.allclose(torch.tensor(losses), torch.tensor(base_losses), rtol=1e-4, atol=1e-5)
    logits_match = torch.allclose(logits, base_logits, rtol=1e-3, atol=1e-4)
    return {
        "image_size": full_img_size[0],
        "params": sum(p.numel() for p in base_model.parameters()),
        "forward_time": forward_time,
        "training_time": sum(step_times) / len(step_times),
        "losses": losses,
        "baseline_losses": base_losses,
        "max_logit_diff": float((logits - base_logits).abs().max()),
        "match": bool(losses_match and logits_match),
    }


def print_and_save_results(results, args, precision_mode, world_size):
    print("=" * 80)
    print(f"SUMMARY - hybrid ViT in {args.dimension}D ({precision_mode}), {world_size} ranks: "
          f"ddp {args.ddp_size} x domain {args.domain_size}")
    for r in results:
        print(f"  size {r['image_size']}: params {r['params']}, forward {r['forward_time']:.4f} s, train step "
              f"{r['training_time']:.4f} s, losses {[round(v, 6) for v in r['losses']]} vs single device "
              f"{[round(v, 6) for v in r['baseline_losses']]}, max logit diff {r['max_logit_diff']:.2e}, "
              f"baseline agreement? {r['match']}")
