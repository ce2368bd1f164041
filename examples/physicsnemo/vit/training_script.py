# Port of the PhysicsNeMo ShardTensor tutorial "ViT training loop" (ShardTensorExamples 5_vit_training_loop,
# training_script.py) to shardtensor. The same script runs
#   - on one device:                      python training_script.py
#   - data parallel (DDP):                torchrun --standalone --nproc-per-node 2 training_script.py --ddp_size 2
#   - domain parallel (1-D mesh):         torchrun --standalone --nproc-per-node 2 training_script.py --domain_size 2
#   - data x domain (FSDP over "ddp"):    torchrun --standalone --nproc-per-node 4 training_script.py \
#                                             --ddp_size 2 --domain_size 2
# and checks its losses and logits against the same training on one device. See ../README.md for the lines that
# differ from the tutorial.
import copy

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from model import HybridViT
from shardtensor.compat.physicsnemo import DistributedManager, distribute_module, distribute_tensor, scatter_tensor
from train_utils import end_to_end_benchmark, parse_args, print_and_save_results


def partition_model(name, submodule, device_mesh):
    """distribute_module's partition_fn: the positional embedding is sharded along its token dim, like the tokens
    of the sharded image; every other parameter stays replicated."""
    for key, param in submodule._parameters.items():
        if "pos_embed" in key:
            scattered_pos_emd = distribute_tensor(
                submodule.pos_embed,
                device_mesh=device_mesh,
                placements=[
                    Shard(1),
                ],
            )
            submodule.register_parameter(key, torch.nn.Parameter(scattered_pos_emd))


def main():
    args = parse_args()

    if args.dimension == 2:
        image_sizes = list(range(args.image_size_start, args.image_size_stop + 1, args.image_size_step))
    else:
        image_sizes = list(range(args.image_size_start, min(args.image_size_stop + 1, 513), args.image_size_step))

    DistributedManager.initialize()
    dm = DistributedManager()

    device = dm.device
    if torch.cuda.is_available():
        torch.cuda.set_device(device)

    if args.domain_size > 1:
        # A 2-D mesh: "ddp" groups, each training its own samples on "domain" ranks.
        mesh = dm.initialize_mesh(
            mesh_shape=(args.ddp_size, args.domain_size),
            mesh_dim_names=["ddp", "domain"],
        )
        ddp_mesh = mesh["ddp"]
        domain_mesh = mesh["domain"]

    num_classes = args.num_classes
    precision_mode = "FP16" if args.use_mixed_precision and torch.cuda.is_available() else "FP32"

    if dm.rank == 0:
        print(f"Device: {device}")
        print(f"Batch size: {args.batch_size}")
        print(f"Domain size: {args.domain_size}")
        print(f"DDP size: {args.ddp_size}")
        print(f"Number of classes: {num_classes}")
        print(f"Precision: {precision_mode}")
        print("-" * 80)

    results = []
    ddp_size = args.ddp_size
    domain_size = args.domain_size
    if ddp_size * domain_size != dm.world_size:
        raise ValueError(f"--ddp_size {ddp_size} x --domain_size {domain_size} != world size {dm.world_size}")

    for img_size in image_sizes:
        if dm.rank == 0:
            print(f"\nTesting image size: {img_size}x{img_size}")

        full_img_size = (img_size,) * args.dimension

        if args.batch_size // ddp_size == 0:
            raise ValueError(f"Batch size {args.batch_size} is not divisible by DDP size {ddp_size}")

        # The tutorial draws random data on every rank; here every rank draws the same global batch (the
        # single-device baseline needs all of it) and keeps its data group's part.
        local_batch = args.batch_size // ddp_size
        ddp_rank = dm.rank // domain_size
        group_slice = slice(ddp_rank * local_batch, (ddp_rank + 1) * local_batch)
        generator = torch.Generator().manual_seed(img_size)
        global_x = torch.randn(args.batch_size, 3, *full_img_size, generator=generator).to(device)
        global_target = torch.randint(0, num_classes, (args.batch_size,), generator=generator).to(device)
        x = global_x[group_slice].clone()
        target = global_target[group_slice].clone()

        if args.domain_size > 1:
            # The first rank of this domain group holds the data; scatter_tensor wants its global rank.
            global_rank_of_source = torch.distributed.get_global_rank(domain_mesh.get_group(), 0)

            x = scatter_tensor(
                x,
                global_rank_of_source,
                domain_mesh,
                placements=(Shard(2),),  # B C **H** W: split the height
                global_shape=x.shape,    # checked against the source's tensor
                dtype=x.dtype,
            )
            target = scatter_tensor(
                target,
                global_rank_of_source,
                domain_mesh,
                placements=(Replicate(),),  # every domain rank holds the labels
                global_shape=target.shape,
                dtype=target.dtype,
            )

        torch.manual_seed(0)  # the same initial weights on every rank and in the baseline
        model = HybridViT(img_size=full_img_size, in_channels=3, num_classes=num_classes,
                          embed_dim=args.embed_dim, num_heads=args.num_heads, depth=args.depth)
        model = model.to(device)
        baseline = copy.deepcopy(model)

        if args.ddp_size > 1 and args.domain_size == 1:
            model = DDP(model, device_ids=[dm.local_rank] if dm.cuda else None,
                        output_device=dm.local_rank if dm.cuda else None)
        if args.domain_size > 1:
            # Same weights on every domain rank, and the sharded positional embedding.
            model = distribute_module(
                model,
                device_mesh=domain_mesh,
                partition_fn=partition_model,
            )
            if args.ddp_size > 1:
                # Across the data groups: rank i of every domain group holds the same shard.
                if dm.cuda:
                    model = FSDP(model, device_mesh=ddp_mesh, use_orig_params=False)
                else:
                    # FSDP (v1) refuses CPU-only processes; its successor fully_shard (FSDP2) runs on Gloo.
                    model = fully_shard(model, mesh=ddp_mesh)

        result = end_to_end_benchmark(args, model, (x, target), (baseline, global_x, global_target), group_slice,
                                      full_img_size)
        results.append(result)

        if dm.rank == 0:
            print(f"Completed image size: {img_size}x{img_size}")
        assert result["match"], f"rank {dm.rank}: training differs from the single-device baseline: {result}"

    if dm.rank == 0:
        print_and_save_results(results, args, precision_mode, dm.world_size)


if __name__ == "__main__":
    main()
