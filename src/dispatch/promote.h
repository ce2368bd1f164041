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

// Differentiable: plain -> Replicate ShardTensor on `mesh`.
at::Tensor promote_to_replicate(const at::Tensor& plain, const MeshPtr& mesh);

} // namespace shardtensor::dispatch
