# Port of the PhysicsNeMo ShardTensor tutorial "kNN with a ring" (ShardTensorExamples 3_knn,
# knn_brute_force_ring_sharded.py) to shardtensor: the user's own knn function is routed to a handler that streams
# the searched points around the ring instead of building the whole distance matrix. The function keeps
# PhysicsNeMo's has_torch_function / handle_torch_function guard, as written for PhysicsNeMo.
#
#   torchrun --standalone --nproc-per-node 2 examples/physicsnemo/knn_brute_force_ring_sharded.py
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Shard
from torch.overrides import handle_torch_function, has_torch_function

from shardtensor.compat.physicsnemo import (DistributedManager, RingPassingConfig, ShardTensor,
                                            perform_ring_iteration, scatter_tensor)

N_points_to_search = 2_345
N_target_points = 125
num_neighbors = 7

DistributedManager.initialize()
dm = DistributedManager()

device = dm.device

a = torch.randn(N_points_to_search, 3, device=device)
b = torch.randn(N_target_points, 3, device=device)


def knn(x, y, n):
    """The n points of x nearest to each point of y, and their distances."""
    # PhysicsNeMo's hook for __torch_function__ subclasses (a no-op for plain tensors).
    if has_torch_function((x, y)):
        return handle_torch_function(knn, (x, y), x, y, n)

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


def knn_ring(func, types, args, kwargs):
    """knn on sharded x and y: each rank searches its queries against one block of x at a time, passes the block on
    around the ring, and keeps a running top-n. The full distance matrix never exists."""

    def extract_args(x, y, n, *args, **kwargs):
        return x, y, n

    x, y, n = extract_args(*args, **kwargs)

    x_spec = x._spec
    y_spec = y._spec

    # Both clouds are sharded along the point axis by construction; a general handler would check placements.
    if not x_spec.mesh == y_spec.mesh:
        raise NotImplementedError("Tensors must be sharded on the same mesh")

    mesh = x_spec.mesh
    local_group = mesh.get_group(0)
    local_size = dist.get_world_size(group=local_group)
    mesh_rank = mesh.get_local_rank()

    ring_config = RingPassingConfig(
        mesh_dim=0,
        mesh_size=local_size,
        ring_direction="forward",
        communication_method="p2p",
    )

    local_x, local_y = x.to_local(), y.to_local()
    current_dists = None
    current_topk_y = None

    # The local shape of x on every rank: the receiver of a block must know its shape.
    x_sharding_shapes = x._spec.sharding_shapes()[0]

    for i in range(local_size):
        # At step i this rank holds the block of x that rank (mesh_rank - i) started with.
        source_rank = (mesh_rank - i) % local_size
        next_source_rank = (source_rank - 1) % local_size
        recv_shape = x_sharding_shapes[next_source_rank]
        if i != local_size - 1:
            next_local_x = perform_ring_iteration(
                local_x,
                mesh,
                ring_config,
                recv_shape=recv_shape,
            )

        # knn on plain local tensors runs its own body.
        local_x_results, local_distances = func(local_x, local_y, n)

        if current_dists is None:
            current_dists = local_distances
            current_topk_y = local_x_results
        else:
            # Merge with the best n so far.
            current_dists = torch.cat([current_dists, local_distances], dim=1)
            current_topk_y = torch.cat([current_topk_y, local_x_results], dim=1)
            current_dists, running_indexes = torch.topk(current_dists, k=n, dim=1, largest=False)
            current_topk_y = torch.gather(current_topk_y, 1,
                                          running_indexes.unsqueeze(-1).expand(-1, -1, 3))

        if i != local_size - 1:
            local_x = next_local_x

    # The results are laid out like the queries.
    topk_y = ShardTensor.from_local(
        current_topk_y,
        device_mesh=mesh,
        placements=y._spec.placements,
        sharding_shapes=y._spec.sharding_shapes(),
    )
    distances = ShardTensor.from_local(
        current_dists,
        device_mesh=mesh,
        placements=y._spec.placements,
        sharding_shapes=y._spec.sharding_shapes(),
    )
    return topk_y, distances


ShardTensor.register_function_handler(knn, knn_ring)

y_neighbors_to_x_sharded, neighbor_distances_sharded = knn(a_sharded, b_sharded, num_neighbors)

y_neighbors_to_x_sharded = y_neighbors_to_x_sharded.full_tensor()
neighbor_distances_sharded = neighbor_distances_sharded.full_tensor()

if dm.rank == 0:
    neighbors_ok = torch.allclose(y_neighbors_to_x, y_neighbors_to_x_sharded)
    distances_ok = torch.allclose(neighbor_distances, neighbor_distances_sharded)
    print(f"Neighbors agreement? {neighbors_ok}")
    print(f"Distances agreement? {distances_ok}")
    assert neighbors_ok and distances_ok, "the ring kNN differs from the single-device kNN"

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
