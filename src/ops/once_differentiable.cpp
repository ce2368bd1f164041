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
          "on a gradient) is not supported on sharded inputs. Differentiable twice: convolutions, normalizations, "
          "pointwise ops, padding, max pooling, interpolation, unfold / fold, max_unpool, sorting, reads and "
          "top-k / max / median along a split dim, attention, FFTs; compute this op on "
          "to_local()/full_tensor() values if its second derivative is needed",
      static_cast<int64_t>(inputs.size()));
  auto wrapped = node->apply(std::move(inputs));
  for (size_t k = 0; k < where.size(); ++k) grads[where[k]] = std::move(wrapped[k]);
  return grads;
}

} // namespace shardtensor::ops

namespace shardtensor::ops {

namespace {

// One direction of a LinearMap (`adjoint` picks which), whose backward is the other direction.
struct LinearFn : torch::autograd::Function<LinearFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const LinearMapPtr& map,
                            bool adjoint) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["map"] = map_ivalue(map);
    ctx->saved_data["adjoint"] = adjoint;
    return adjoint ? map->adjoint(x) : map->apply(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    torch::autograd::variable_list out(3);
    if (!g[0].defined()) return out;
    auto map = map_from_ivalue(ctx->saved_data["map"]);
    // Recorded again only if this backward is (create_graph of a higher derivative): grad mode says which.
    out[0] = LinearFn::apply(g[0], map, !ctx->saved_data["adjoint"].toBool());
    return out;
  }
};

} // namespace

c10::IValue map_ivalue(LinearMapPtr map) {
  return c10::IValue::make_capsule(c10::static_intrusive_pointer_cast<torch::CustomClassHolder>(std::move(map)));
}

LinearMapPtr map_from_ivalue(const c10::IValue& v) {
  return c10::static_intrusive_pointer_cast<LinearMap>(v.toCapsule());
}

at::Tensor linear_backward(const LinearMapPtr& map, const at::Tensor& g, bool recording) {
  if (!recording) {
    at::NoGradGuard no_grad;
    return map->adjoint(g);
  }
  at::AutoGradMode record(true);
  return LinearFn::apply(g, map, /*adjoint=*/true);
}

torch::autograd::variable_list linear_map_backward(torch::autograd::AutogradContext* ctx,
                                                   const torch::autograd::variable_list& grads, size_t inputs) {
  const bool recording = at::GradMode::is_enabled();  // create_graph: grad mode at the backward's entry
  torch::autograd::variable_list out(inputs);
  if (grads[0].defined()) out[0] = linear_backward(map_from_ivalue(ctx->saved_data["map"]), grads[0], recording);
  return out;
}

} // namespace shardtensor::ops
