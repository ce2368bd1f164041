// Plain tensors mixed with ShardTensors are Replicate. When such a plain tensor requires grad, it is promoted
// above autograd through a differentiable op whose backward turns the ShardTensor gradient into the full plain
// gradient (reduced over the mesh exactly once), so plain parameters get single-device gradients.
#pragma once

#include <shardtensor/shard_tensor.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace shardtensor::dispatch {

// Before an op's autograd kernel runs (grad mode on): replace plain arguments that require grad (not written
// ones) by promoted Replicate ShardTensors, and give ShardTensor leaves that require grad their gradient-layout
// hook (dispatch/grad_layout.h).
// Returns the leaves' gradient accumulators, which the caller keeps alive until the op has run.
std::vector<std::shared_ptr<torch::autograd::Node>> prepare_autograd_args(const c10::OperatorHandle& op,
                                                                          torch::jit::Stack* stack);

// Inside a torch.func transform or under forward-mode AD (where the op's own derivative formula runs): replace plain
// arguments that require grad at this transform level by `shardtensor::promote_plain` on the mesh of the op's
// ShardTensors, whose autograd node gives them plain gradients (functorch records it at every level).
void promote_plain_args_in_transform(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Registers shardtensor::promote_plain / full_plain / mesh_of's kernels; called once by the library's installer.
void register_transform_promotion_kernels();

// A plain tensor (not a wrapped number) that requires grad: what an op mixing it with ShardTensors promotes.
bool promotable(const at::Tensor& t);

// Differentiable: plain -> Replicate ShardTensor on `mesh`. Its backward completes a pending gradient, deferring
// the sum into the gradient buckets where it may (dispatch/grad_buckets.h).
at::Tensor promote_to_replicate(const at::Tensor& plain, const MeshPtr& mesh);

// Whether the gradient of parameter `t`, sent as a pending sum now, would be deferred into the gradient buckets: `t`
// as a rule received it, a promoted parameter (its promotion defers) or a plain leaf (the rule defers it itself,
// `defer_leaf_grad`). A rule that would sum several parameter gradients in one fused all-reduce leaves them pending
// instead when this holds for each (the buckets fuse them), and sums them itself otherwise.
bool param_grad_deferrable(const at::Tensor& t);

// For a rule whose autograd Function takes the plain leaf `param` itself: defers the sum of `term` over `mesh_dims`
// into the gradient buckets; the rule then returns no gradient for it. False when it cannot (reduce it now).
bool defer_leaf_grad(const at::Tensor& param, const at::Tensor& term, const MeshPtr& mesh,
                     const std::vector<int64_t>& mesh_dims);

} // namespace shardtensor::dispatch
