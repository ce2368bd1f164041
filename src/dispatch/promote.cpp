#include "dispatch/promote.h"

#include "comm/redistribute.h"
#include "dispatch/args.h"
#include "dispatch/grad_layout.h"

#include <torch/autograd.h>

namespace shardtensor::dispatch {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct PromoteFn : torch::autograd::Function<PromoteFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& plain, MeshPtr mesh) {
    ctx->set_materialize_grads(false);
    return make_shard_tensor(plain.detach(), replicate_spec(mesh, plain.sizes()));
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    const auto& g = grads[0];
    if (!g.defined() || !is_shard_tensor(g)) return {g, at::Tensor()};
    // Complete the gradient on every rank: Partial terms are summed, shards gathered.
    auto& impl = *shard_impl(g);
    auto full = redistribute_to(g, replicate_spec(impl.spec()->mesh, g.sizes()));
    return {shard_impl(full)->local(), at::Tensor()};
  }
};

bool promotable(const at::Tensor& t) {
  return t.defined() && t.requires_grad() && !shard_impl(t) && !t.unsafeGetTensorImpl()->is_wrapped_number();
}

} // namespace

at::Tensor promote_to_replicate(const at::Tensor& plain, const MeshPtr& mesh) {
  return PromoteFn::apply(plain, mesh);
}

std::vector<std::shared_ptr<torch::autograd::Node>> prepare_autograd_args(const c10::OperatorHandle& op,
                                                                          torch::jit::Stack* stack) {
  std::vector<std::shared_ptr<torch::autograd::Node>> keep;
  auto hook = [&](const at::Tensor& t) {
    if (auto acc = ensure_grad_layout_hook(t)) keep.push_back(std::move(acc));
  };
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  const auto base = stack->size() - n;
  MeshPtr mesh;
  for (size_t i = 0; i < n && !mesh; ++i) {
    for_each_tensor((*stack)[base + i], [&](const at::Tensor& t) {
      if (!mesh)
        if (auto* impl = shard_impl(t)) mesh = impl->spec()->mesh;
    });
  }
  if (!mesh) return keep;
  for (size_t i = 0; i < n; ++i) {
    const auto& arg = schema.arguments()[i];
    if (arg.alias_info() && arg.alias_info()->isWrite()) continue;
    auto& v = (*stack)[base + i];
    if (v.isTensor()) {
      if (promotable(v.toTensor())) v = promote_to_replicate(v.toTensor(), mesh);
      else hook(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      bool changed = false;
      for (size_t j = 0; j < list.size(); ++j) {
        at::Tensor t = list.get(j);
        hook(t);
        if (promotable(t)) {
          list.set(j, promote_to_replicate(t, mesh));
          changed = true;
        }
      }
      if (changed) v = list;
    } else if (v.isList()) {
      auto list = v.toList();
      for (size_t j = 0; j < list.size(); ++j) {
        c10::IValue e = list.get(j);
        if (!e.isTensor()) continue;
        if (promotable(e.toTensor())) list.set(j, promote_to_replicate(e.toTensor(), mesh));
        else hook(e.toTensor());
      }
    }
  }
  return keep;
}

} // namespace shardtensor::dispatch
