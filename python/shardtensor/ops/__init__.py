"""Domain-parallel operators beyond ``torch``: neighbour searches over point clouds and similar ops that take
plain tensors or ShardTensors (any layout the op documents) and return single-device results."""
from .points import knn, radius_search
