"""Extra operators with domain-parallel rules, usable on plain tensors and on ShardTensors.

Each is a custom op in ``torch.ops.shardtensor`` (C++ kernels, autograd for plain tensors, and a handler for
ShardTensors bound above autograd); these modules are thin, documented Python wrappers.
"""
from .neighborhood import neighborhood_attention, neighborhood_attention1d, neighborhood_attention2d, neighborhood_attention3d
from .points import knn, radius_search
