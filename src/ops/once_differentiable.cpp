#include "ops/once_differentiable.h"

#include <torch/csrc/autograd/functions/basic_ops.h>

#include <string>

namespace shardtensor::ops {

torch::autograd::variable_list once_differentiable(torch::autograd::variable_list grads, const char* op,
                                                   bool recording) {
  if (!recording) return grads;
  at::AutoGradMode record(true);  // the error node is history: recorded even under the backward's NoGradGuard
  // Aliases that require grad, so the error node becomes their history (as torch's once_differentiable does).
  torch::autograd::variable_list inputs;
  std::vector<size_t> where;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    if (!g.defined() || !(at::isFloatingType(g.scalar_type()) || at::isComplexType(g.scalar_type()))) continue;
    auto alias = g.detach();
    alias.set_requires_grad(true);
    inputs.push_back(std::move(alias));
    where.push_back(i);
  }
  if (inputs.empty()) return grads;
  auto node = std::make_shared<torch::autograd::DelayedError>(
      std::string("ShardTensor: the gradient of ") + op +
          " on ShardTensors is not differentiable: a second derivative through it (create_graph=True, e.g. a loss "
          "on a gradient) is not supported on sharded inputs. Differentiable twice: convolutions, normalizations "
          "other than batch/instance norm, pointwise ops, padding, max pooling, FFTs; compute this op on "
          "to_local()/full_tensor() values if its second derivative is needed",
      static_cast<int64_t>(inputs.size()));
  auto wrapped = node->apply(std::move(inputs));
  for (size_t k = 0; k < where.size(); ++k) grads[where[k]] = std::move(wrapped[k]);
  return grads;
}

} // namespace shardtensor::ops
