# Port of the PhysicsNeMo ShardTensor tutorial "vector dot product" (ShardTensorExamples 2_vector_dot_product,
# vector_dot_sharded.py) to shardtensor: a custom handler for torch.dot, registered with PhysicsNeMo's
# ShardTensor.register_function_handler and its (func, types, args, kwargs) signature.
#
#   torchrun --standalone --nproc-per-node 2 examples/physicsnemo/vector_dot_sharded.py
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Replicate, Shard

from shardtensor.compat.physicsnemo import DistributedManager, ShardTensor, scatter_tensor


def sharded_dot_product(func: callable, types: tuple, args: tuple, kwargs: dict):
    """torch.dot of two vectors sharded alike: a local dot product per rank, then a sum over the mesh.

    A teaching handler: it supports only identically sharded 1-D inputs. ``func`` is the function that was
    intercepted (torch.dot), ``types`` the tensor types involved, ``args``/``kwargs`` its arguments.
    """

    def extract_args(x, y, *args, **kwargs):
        return x, y

    x, y = extract_args(*args, **kwargs)

    # The layout of each argument: placements, mesh, extents.
    x_spec = x._spec
    y_spec = y._spec

    if not x_spec.placements == y_spec.placements:
        raise NotImplementedError("Tensors must be sharded on the same device")
    if not x_spec.mesh == y_spec.mesh:
        raise NotImplementedError("Tensors must be sharded on the same mesh")

    mesh = x_spec.mesh

    # This rank's pieces, and their dot product.
    local_x = x.to_local()
    local_y = y.to_local()
    local_dot_product = torch.dot(local_x, local_y)

    # Sum the per-rank terms: afterwards every rank holds the whole value.
    dist.all_reduce(local_dot_product, op=dist.ReduceOp.SUM, group=mesh.get_group())

    # Every rank holds the complete scalar: a Replicate ShardTensor on the same mesh.
    output = ShardTensor.from_local(
        local_tensor=local_dot_product,
        device_mesh=mesh,
        placements=(Replicate(),),
    )
    return output


ShardTensor.register_function_handler(torch.dot, sharded_dot_product)

# The tutorial uses 10^9 elements on GPUs; a float32 dot of that many terms on a CPU would also need a looser
# tolerance than allclose's default.
N = 20_011

DistributedManager.initialize()
dm = DistributedManager()

device = dm.device

a = torch.randn(N, device=device)
b = torch.randn(N, device=device)


def f(x, y):
    return torch.dot(x, y)


c_baseline = f(a, b)

mesh = dm.initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
placements = (Shard(0),)
a_sharded = scatter_tensor(tensor=a, global_src=0, mesh=mesh, placements=placements)
b_sharded = scatter_tensor(tensor=b, global_src=0, mesh=mesh, placements=placements)

c_sharded = f(a_sharded, b_sharded)
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
    agree = torch.allclose(c_baseline, c_sharded)
    print(f"Rank {dm.rank}, Tensor agreement? {agree}")
    print(f"Execution time for 10 runs: {elapsed_time:.4f} seconds")
    assert agree, f"sharded dot {c_sharded.item()} != single-device dot {c_baseline.item()}"
