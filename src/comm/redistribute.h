// Placement transitions on local tensors (below autograd). The plan depends only on the two specs, so
// every rank issues the same collectives in the same order.
#pragma once

#include <shardtensor/shard_tensor.h>

namespace shardtensor {

// The spec a tensor with spec `src` has after redistribution to `placements`: explicit sharding shapes
// win, a Shard(d) kept on the same mesh dim keeps its extents, anything else uses the default split.
SpecPtr redistribute_target_spec(const ShardSpec& src, const Placements& placements,
                                 const ShardingShapes& sharding_shapes = {});

// Move a local tensor from layout `src` to layout `dst` (same mesh, same global shape).
at::Tensor redistribute_local(const at::Tensor& local, const ShardSpec& src, const ShardSpec& dst);

// ShardTensor -> ShardTensor with spec `dst`; no autograd graph (used inside kernels and backward).
at::Tensor redistribute_to(const at::Tensor& shard, const SpecPtr& dst);

// `spec` with every Partial replaced by Replicate (the placement of a gradient of a Partial value).
SpecPtr without_partial(const SpecPtr& spec);

// A gradient arriving for a ShardTensor with spec `spec`, brought to that layout (no autograd graph): ShardTensors
// are redistributed to the spec with Partial read as Replicate (a pending-sum gradient is reduce-scattered into
// the shards); a plain gradient is taken as the full replicated value and sliced locally.
at::Tensor grad_to_spec(const at::Tensor& grad, const SpecPtr& spec);

// grad_to_spec recorded by autograd (comm/api.cpp's transition Functions): for a backward under create_graph, whose
// gradient has a graph of its own that a higher derivative must see.
at::Tensor recorded_grad_to_spec(const at::Tensor& grad, const SpecPtr& spec);

// Told before a shard is gathered to Replicate (`src`: the layout being moved; `mesh_dim`: the mesh dim whose shard
// of tensor dim `dim` is gathered; `element_size`: bytes per element), so the dispatch layer can count, warn or refuse (src/dispatch/replication.h)
// before anything moves. It decides from the spec alone, so every rank decides alike.
using ReplicationObserver = void (*)(const ShardSpec& src, int64_t mesh_dim, int64_t dim, int64_t element_size);
void set_replication_observer(ReplicationObserver observer);

} // namespace shardtensor
