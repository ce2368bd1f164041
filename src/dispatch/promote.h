// Plain tensors mixed with ShardTensors are Replicate. When such a plain tensor requires grad, it is promoted
// above autograd through a differentiable op whose backward turns the ShardTensor gradient into the full plain
// gradient (reduced over the mesh exactly once), so plain parameters get single-device gradients.
#pragma once

#include <shardtensor/shard_tensor.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace shardtensor::dispatch {

// Replace plain arguments that require grad (not written ones) by promoted Replicate ShardTensors.
void promote_plain_args(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Differentiable: plain -> Replicate ShardTensor on `mesh`.
at::Tensor promote_to_replicate(const at::Tensor& plain, const MeshPtr& mesh);

} // namespace shardtensor::dispatch
