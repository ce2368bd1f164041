# Port of the PhysicsNeMo ShardTensor tutorial "kNN, brute force, sharded" (ShardTensorExamples 3_knn,
# knn_brute_force_sharded.py) to shardtensor: the single-device kNN runs unchanged on sharded point clouds, op by
# op (in PhysicsNeMo through DTensor's fallbacks; here through the library's rules).
#
#   torchrun --standalone --nproc-per-node 2 examples/physicsnemo/knn_brute_force_sharded.py
import time

import torch
from torch.distributed.tensor.placement_types import Shard

from shardtensor.compat.physicsnemo import DistributedManager, scatter_tensor

# The tutorial searches 234,568 points for 12,496 targets (a 12,496 x 234,568 distance matrix); this size keeps
# the matrix small on a CPU.
N_points_to_search = 2_345
N_target_points = 125
num_neighbors = 7

DistributedManager.initialize()
dm = DistributedManager()

a = torch.randn(N_points_to_search, 3, device=dm.device)
b = torch.randn(N_target_points, 3, device=dm.device)


def knn(x, y, n):
    """The n points of x nearest to each point of y, and their distances."""
    # Every pair's displacement, then its length.
    displacement_vec = x[None, :, :] - y[:, None, :]
    distance = torch.norm(displacement_vec, dim=2)
    distances, indices = torch.topk(distance, k=n, dim=1, largest=False)
    x_results = x[indices]
    return x_results, distances


y_neighbors_to_x, neighbor_distances = knn(a, b, num_neighbors)

if dm.rank == 0:
    print(y_neighbors_to_x.shape)    # (N_target_points, num_neighbors, 3)
    print(neighbor_distances.shape)  # (N_target_points, num_neighbors)

mesh = dm.initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
placements = (Shard(0),)
a_sharded = scatter_tensor(tensor=a, global_src=0, mesh=mesh, placements=placements)
b_sharded = scatter_tensor(tensor=b, global_src=0, mesh=mesh, placements=placements)

y_neighbors_to_x_sharded, neighbor_distances_sharded = knn(a_sharded, b_sharded, num_neighbors)

# Collectives: on every rank, outside the rank-0 block below.
y_neighbors_to_x_sharded = y_neighbors_to_x_sharded.full_tensor()
neighbor_distances_sharded = neighbor_distances_sharded.full_tensor()

if dm.rank == 0:
    neighbors_ok = torch.allclose(y_neighbors_to_x, y_neighbors_to_x_sharded)
    distances_ok = torch.allclose(neighbor_distances, neighbor_distances_sharded)
    print(f"Neighbors agreement? {neighbors_ok}")
    print(f"Distances agreement? {distances_ok}")
    assert neighbors_ok and distances_ok, "the sharded kNN differs from the single-device kNN"

for _ in range(5):
    _ = knn(a_sharded, b_sharded, num_neighbors)

if torch.cuda.is_available():
    torch.cuda.synchronize()
start_time = time.time()
for _ in range(10):
    _ = knn(a_sharded, b_sharded, num_neighbors)
if torch.cuda.is_available():
    torch.cuda.synchronize()
elapsed_time = time.time() - start_time

if dm.rank == 0:
    print(f"Execution time for 10 runs: {elapsed_time:.4f} seconds")
