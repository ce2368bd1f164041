# Port of the PhysicsNeMo ShardTensor tutorial "convolution" (ShardTensorExamples 4_convolution, sharded_conv.py)
# to shardtensor: a Conv2d on an image sharded along its height, forward and backward, checked against one device,
# and the gradient's placement printed (it stays sharded like the input).
#
#   torchrun --standalone --nproc-per-node 2 examples/physicsnemo/sharded_conv.py
import torch
from torch.distributed.tensor import Shard

from shardtensor.compat.physicsnemo import DistributedManager, ShardTensor, distribute_module, scatter_tensor

DistributedManager.initialize()
dm = DistributedManager()

# The tutorial's image is 1 x 8 x 1024 x 1024; 64 x 64 runs in a blink on a CPU and still gives every rank rows.
original_tensor = torch.randn(1, 8, 64, 64, device=dm.device, requires_grad=True)

conv = torch.nn.Conv2d(8, 8, 3, stride=1, padding=1).to(dm.device)

single_gpu_output = conv(original_tensor)

single_gpu_output.mean().backward()
original_tensor_grad = original_tensor.grad.data.clone()

mesh = dm.initialize_mesh(mesh_shape=(-1,), mesh_dim_names=("domain_parallel",))

# Rank 0's image, split along H; a leaf that accumulates its own (sharded) gradient.
sharded_tensor = scatter_tensor(original_tensor, 0, mesh, (Shard(2),), requires_grad=True)

# Every rank gets rank 0's weights.
distributed_conv = distribute_module(conv, mesh)

sharded_output = distributed_conv(sharded_tensor)
sharded_output.mean().backward()

full_output = sharded_output.full_tensor()
full_grad = sharded_tensor.grad.full_tensor()

if dm.rank == 0:
    # Rank 0's data and weights were the ones distributed, so rank 0 compares.
    assert torch.allclose(full_output, single_gpu_output, atol=1e-3, rtol=1e-3)
    print("Global operation matches local! ")

    assert torch.allclose(original_tensor_grad, full_grad)
    print("Gradient check passed!")

print(f"Distributed grad sharding and local shape: {sharded_tensor.grad._spec.placements}, "
      f"{sharded_tensor.grad.to_local().shape}")
