// Gradients accumulated into a ShardTensor leaf have exactly the leaf's layout (placements and extents).
//
// Backward formulas build gradients from whatever layout their inputs have: the gradient of a sum is the
// expansion of a replicated value, a select's gradient follows the selected slice, and so on. Accumulated as
// they come, a sharded leaf's .grad could be Replicate at the full global size on every rank, which defeats the
// memory point of domain parallelism. A pre-hook on each ShardTensor leaf's gradient accumulator node (not on
// the tensor, whose hook list a user's first Python hook replaces; it runs after the tensor's hooks) brings the
// incoming gradient to the leaf's layout first: Partial -> Shard by reduce-scatter, Replicate -> Shard by a local
// slice, other shards by all-to-all (the plan depends only on the two specs, so every rank communicates alike).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

namespace torch::autograd {
struct Node;
}

namespace shardtensor::dispatch {

// When `t` is a ShardTensor leaf that requires grad: its gradient accumulator, with the layout hook installed
// (once per accumulator). The caller keeps the returned node alive until the op has recorded its graph edges:
// the tensor holds its accumulator only weakly, and a dropped one would be rebuilt without the hook. nullptr
// for any other tensor.
std::shared_ptr<torch::autograd::Node> ensure_grad_layout_hook(const at::Tensor& t);

// `grad` in the layout of a leaf with spec `leaf`, its local tensor dense with the leaf local's strides (so the
// accumulator steals it and later in-place accumulation works). Differentiable when grad mode is on
// (create_graph backward).
at::Tensor grad_in_leaf_layout(const at::Tensor& grad, const at::Tensor& leaf);

} // namespace shardtensor::dispatch
