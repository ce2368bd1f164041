# Port of the PhysicsNeMo ShardTensor tutorial "vector addition" (ShardTensorExamples 1_vector_addition.py,
# vector_add_sharded.py) to shardtensor. See README.md beside this file for the lines that differ.
#
#   torchrun --standalone --nproc-per-node 2 examples/physicsnemo/vector_add_sharded.py
#   python examples/physicsnemo/vector_add_sharded.py          (a one-process world)
import time

import torch
from torch.distributed.tensor.placement_types import Shard

from shardtensor.compat.physicsnemo import DistributedManager, scatter_tensor

# Small enough for a CPU with Gloo (the tutorial adds two vectors of 10^9 elements on GPUs); odd, so the shards
# are uneven.
N = 100_003

DistributedManager.initialize()
dm = DistributedManager()

device = dm.device

a = torch.randn(N, device=device)
b = torch.randn(N, device=device)


def f(x, y):
    # Elementwise: every rank adds its own shards, no communication.
    return x + y


# The single-device answer, on every rank's own data.
c_baseline = f(a, b)

# A 1-D mesh over all ranks; -1 is inferred from the world size.
mesh = dm.initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
placements = (Shard(0),)

# Rank 0's vectors are split along dim 0; each rank receives only its piece. global_src is a global rank.
a_sharded = scatter_tensor(tensor=a, global_src=0, mesh=mesh, placements=placements)
b_sharded = scatter_tensor(tensor=b, global_src=0, mesh=mesh, placements=placements)

c_sharded = f(a_sharded, b_sharded)

# Gathering the result is a collective: every rank calls it.
c_sharded = c_sharded.full_tensor()

for _ in range(5):
    c = f(a_sharded, b_sharded)

if torch.cuda.is_available():
    torch.cuda.synchronize()
start_time = time.time()
for _ in range(10):
    c = f(a_sharded, b_sharded)
if torch.cuda.is_available():
    torch.cuda.synchronize()
elapsed_time = time.time() - start_time

if dm.rank == 0:
    # The scatter used rank 0's data, so rank 0's baseline is the reference.
    agree = torch.allclose(c_baseline, c_sharded)
    print(f"Rank {dm.rank}, Tensor agreement? {agree}")
    print(f"Execution time for 10 runs: {elapsed_time:.4f} seconds")
    assert agree, "the sharded sum differs from the single-device sum"
