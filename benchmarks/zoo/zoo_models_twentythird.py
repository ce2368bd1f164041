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
(mean / min / max / std aggregators with degree scalers) and a graph transformer layer (TransformerConv); and on the
grid, graph-level readouts of three graphs in one batch (`global_add_pool` / `global_mean_pool` / `global_max_pool`
over a whole `batch` vector: scatters of split nodes into a few rows), edge features (GINEConv, GENConv's soft-max
aggregation with a learned temperature: `edge_attr` whole, one row per edge), GPS (a GIN layer beside multi-head
attention over each graph's nodes, `to_dense_batch`) and AttentiveFP (GRU updates, graph attention, a readout
GRU), and GraphUNet (top-k node pooling and unpooling, its adjacency squared as a sparse matrix built from edge
weights `x.new_ones(E)`: sparse tensors hold whole values). Registered like zoo_models.py's (zoo_models.py imports
this module at its end)."""
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


class _Layer(torch.nn.Module):
    """One PyG convolution layer as a model (a layer class has no models.* wrapper); the graph (`edge_index`, and
    `edge_attr` where the layer takes edge features) comes as the zoo's keyword arguments."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x, **graph):
        return self.conv(x, **graph)


def _models():
    from torch_geometric.nn import models
    return models


def _layers():
    import torch_geometric.nn
    return torch_geometric.nn


def _mlp(i, o):
    return torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o))


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
    "TransformerConv": (lambda: _Layer(_layers().TransformerConv(_F, 8, heads=2)),
                        "graph transformer: scaled dot-product attention over incoming edges"),
}


def _register(graph, nodes, edges):
    for name, (build, note) in _BUILDERS.items():
        model("torch_geometric", f"pyg/{name}_{graph}", (nodes, _F), shard_dims=(0,), spatial=(0,),
              extra=lambda edges=edges: {"edge_index": edges()}, note=f"{note} ({graph} graph)")(build)


_register("grid", 120, _grid_edges)
_register("knn", 150, _knn_edges)


# Graph-level readouts, edge features and models with a per-graph batch vector (the grid graph, three graphs of 40
# nodes each in one batch: contiguous node ranges, as PyG's DataLoader batches them).

def _batch(n=120, graphs=3):
    return torch.arange(n) * graphs // n


def _edge_features():
    g = torch.Generator().manual_seed(3)
    edges = _grid_edges()
    return {"edge_index": edges, "edge_attr": torch.randn(edges.shape[1], 4, generator=g, dtype=torch.float64)}


class _Readout(torch.nn.Module):
    """A node model, then one of PyG's global poolings over the batch vector: one row per graph."""

    def __init__(self, nodes, pool):
        super().__init__()
        self.nodes, self.pool = nodes, pool

    def forward(self, x, edge_index, batch):
        import torch_geometric.nn as gnn
        return getattr(gnn, self.pool)(self.nodes(x, edge_index), batch)


class _GPS(torch.nn.Module):
    """A linear lift, then one GPS layer: a GIN convolution beside multi-head attention within each graph."""

    def __init__(self):
        super().__init__()
        self.lift = torch.nn.Linear(_F, 16)
        self.gps = _layers().GPSConv(16, _layers().GINConv(_mlp(16, 16)), heads=2, norm=None)

    def forward(self, x, edge_index, batch):
        return self.gps(self.lift(x), edge_index, batch)


def _register_graph_level():
    def reg(name, build, extra, note, spatial_out=True):
        model("torch_geometric", f"pyg/{name}", (120, _F), shard_dims=(0,), spatial=(0,), extra=extra, note=note,
              spatial_out=spatial_out)(build)

    with_batch = lambda: {"edge_index": _grid_edges(), "batch": _batch()}  # noqa: E731
    reg("GIN_add_pool", lambda: _Readout(_models().GIN(_F, 16, 2, 4), "global_add_pool"), with_batch,
        "sum readout per graph", spatial_out=False)
    reg("GCN_mean_pool", lambda: _Readout(_models().GCN(_F, 16, 2, 4), "global_mean_pool"), with_batch,
        "mean readout per graph", spatial_out=False)
    reg("GAT_max_pool", lambda: _Readout(_models().GAT(_F, 16, 2, 4), "global_max_pool"), with_batch,
        "max readout per graph", spatial_out=False)
    reg("GINEConv", lambda: _Layer(_layers().GINEConv(_mlp(_F, 16), edge_dim=4)), _edge_features,
        "edge features added to the messages")
    reg("GENConv", lambda: _Layer(_layers().GENConv(_F, 16, aggr="softmax", t=1.0, learn_t=True, edge_dim=4)),
        _edge_features, "soft-max aggregation with a learned temperature, edge features")
    reg("GPSConv", _GPS, with_batch, "GIN beside multi-head attention within each graph (to_dense_batch)")
    reg("AttentiveFP", lambda: _models().AttentiveFP(_F, 16, 4, edge_dim=4, num_layers=2, num_timesteps=2),
        lambda: {**_edge_features(), "batch": _batch()}, "graph attention, GRU updates, a readout per graph",
        spatial_out=False)
    reg("GraphUNet", lambda: _models().GraphUNet(_F, 16, 4, depth=2, pool_ratios=0.5),
        lambda: {"edge_index": _grid_edges()}, "top-k pooling and unpooling, a sparse adjacency squared")


_register_graph_level()
