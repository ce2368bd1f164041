"""The model zoo's twenty-third set: graph neural networks from PyTorch Geometric (`torch_geometric`, the thirty-fifth
session) on a split node set -- the mesh-graph and point-cloud workloads of scientific machine learning, where the
nodes (mesh vertices, particles, surface points) are split across ranks by index range and the edges are a whole
`edge_index` every rank holds (node features gathered per edge by `x[edge_index[0]]`-style reads of split rows,
messages summed, averaged, maxed or soft-maxed into the split destination nodes by scatter reductions). Two graphs:
the 8-neighbour grid of a 12 x 10 structured mesh with nodes in row-major order (`torch_geometric.utils.grid`: a
range of nodes is a band of the mesh, most edges stay on their rank, a halo of neighbours crosses), and the 6 nearest
neighbours of 150 random points in the unit cube (a point cloud's k-NN graph, whose edges cross ranks freely).
PyG's own model classes, unmodified: GCN (symmetric degree normalisation with self-loops), GAT and GATv2 (attention
soft-maxed over each node's incoming edges), GraphSAGE, GIN, EdgeCNN (dynamic-free EdgeConv on the given graph), PNA
(mean / min / max / std aggregators with degree scalers) and a graph transformer layer (TransformerConv). Registered
like zoo_models.py's (zoo_models.py imports this module at its end)."""
import torch

from benchmarks.zoo.zoo_models import model

_F = 8


def _grid_edges():
    from torch_geometric.utils import grid
    edge_index, _ = grid(12, 10)
    return edge_index


def _knn_edges(n=150, k=6):
    g = torch.Generator().manual_seed(7)
    pos = torch.rand(n, 3, generator=g, dtype=torch.float64)
    d = torch.cdist(pos, pos)
    d.fill_diagonal_(float("inf"))
    nbr = d.topk(k, largest=False).indices                    # (n, k): each node's k nearest
    return torch.stack([nbr.reshape(-1), torch.arange(n).repeat_interleave(k)])  # source -> target


class _Conv(torch.nn.Module):
    """One PyG convolution layer as a model (a layer class has no models.* wrapper)."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x, edge_index):
        return self.conv(x, edge_index)


def _models():
    from torch_geometric.nn import models
    return models


_BUILDERS = {
    "GCN": (lambda: _models().GCN(_F, 16, 3, 4), "degree-normalised sums with self-loops"),
    "GAT": (lambda: _models().GAT(_F, 16, 3, 4, heads=2), "attention soft-maxed over incoming edges"),
    "GATv2": (lambda: _models().GAT(_F, 16, 3, 4, heads=2, v2=True), "GATv2's dynamic attention"),
    "GraphSAGE": (lambda: _models().GraphSAGE(_F, 16, 3, 4), "mean aggregation and a root weight"),
    "GIN": (lambda: _models().GIN(_F, 16, 3, 4), "sum aggregation, MLPs with batch norm over the nodes"),
    "EdgeCNN": (lambda: _models().EdgeCNN(_F, 16, 3, 4), "EdgeConv: an MLP of (x_i, x_j - x_i), max-aggregated"),
    "PNA": (lambda: _models().PNA(_F, 16, 3, 4, aggregators=["mean", "min", "max", "std"],
                                 scalers=["identity", "amplification", "attenuation"],
                                 deg=torch.tensor([0, 2, 4, 6, 4, 2])),
            "four aggregators, degree scalers"),
    "TransformerConv": (lambda: _Conv(__import__("torch_geometric.nn", fromlist=["TransformerConv"])
                                      .TransformerConv(_F, 8, heads=2)),
                        "graph transformer: scaled dot-product attention over incoming edges"),
}


def _register(graph, nodes, edges):
    for name, (build, note) in _BUILDERS.items():
        model("torch_geometric", f"pyg/{name}_{graph}", (nodes, _F), shard_dims=(0,), spatial=(0,),
              extra=lambda edges=edges: {"edge_index": edges()}, note=f"{note} ({graph} graph)")(build)


_register("grid", 120, _grid_edges)
_register("knn", 150, _knn_edges)
