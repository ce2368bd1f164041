#include "dispatch/promote.h"

#include <shardtensor/shard_tensor.h>

#include "comm/collectives.h"
#include "comm/redistribute.h"
#include "dispatch/args.h"
#include "dispatch/grad_buckets.h"
#include "dispatch/grad_layout.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

namespace shardtensor::dispatch {

namespace {

using torch::autograd::variable_list;

// The backward of a promotion: completes the gradient (Partial terms summed, shards gathered) and hands the plain
// tensor its full gradient. A pending sum whose target is a parameter's accumulator goes to the gradient buckets
// instead (dispatch/grad_buckets.h) and reaches `.grad` by the end of the backward. A Node of its own (not an
// autograd::Function) because that decision needs the edge to the parameter.
struct PromoteBackward final : torch::autograd::Node {
  std::string name() const override { return "shardtensor::PromoteBackward"; }

  variable_list apply(variable_list&& grads) override {
    const auto& g = grads[0];
    if (!g.defined() || !is_shard_tensor(g)) return {g};
    // A gradient with a graph of its own (create_graph=True: a gradient penalty on a parameter's gradient) is
    // completed by the differentiable full_tensor, so its graph reaches the plain tensor's gradient. Nothing is
    // deferred then (the buckets never defer under create_graph).
    if (at::GradMode::is_enabled() && g.requires_grad()) return {full_tensor(g)};
    const auto& spec = shard_impl(g)->spec();
    if (auto dims = pending_sum_dims(*spec); !dims.empty()) {
      auto term = shard_impl(g)->local();
      if (defer_grad_reduction(next_edge(0), term, spec->mesh, dims)) return {at::Tensor()};
      // A sum left to complete: all-reduces (the redistribute planner may route Partial -> Replicate otherwise).
      for (auto m : dims) term = comm::all_reduce(term, ReduceOp::Sum, *spec->mesh, m);
      return {term};
    }
    auto full = redistribute_to(g, replicate_spec(spec->mesh, g.sizes()));
    return {shard_impl(full)->local()};
  }

  // The mesh dims of a pending sum that leaves a replicated value (no shards, no other reduction); empty otherwise.
  static std::vector<int64_t> pending_sum_dims(const ShardSpec& spec) {
    std::vector<int64_t> dims;
    for (size_t m = 0; m < spec.placements.size(); ++m) {
      const auto& p = spec.placements[m];
      if (p.is_shard() || (p.is_partial() && p.op != ReduceOp::Sum)) return {};
      if (p.is_partial()) dims.push_back(static_cast<int64_t>(m));
    }
    return dims;
  }
};


} // namespace

bool promotable(const at::Tensor& t) {
  return t.defined() && t.requires_grad() && !shard_impl(t) && !t.unsafeGetTensorImpl()->is_wrapped_number();
}

at::Tensor promote_to_replicate(const at::Tensor& plain, const MeshPtr& mesh) {
  auto out = make_shard_tensor(plain.detach(), replicate_spec(mesh, plain.sizes()));
  if (!plain.requires_grad() || !at::GradMode::is_enabled()) return out;
  auto node = std::shared_ptr<PromoteBackward>(new PromoteBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(plain));
  torch::autograd::set_history(out, node);
  return out;
}

namespace {
torch::autograd::Edge leaf_edge(const at::Tensor& t) {
  if (!t.defined() || shard_impl(t) || !t.is_leaf() || !t.requires_grad()) return {};
  auto acc = torch::autograd::impl::try_get_grad_accumulator(t);
  return acc ? torch::autograd::Edge(std::move(acc), 0) : torch::autograd::Edge();
}
} // namespace

bool param_grad_deferrable(const at::Tensor& t) {
  if (!t.defined()) return false;
  if (!shard_impl(t)) return grad_edge_deferrable(leaf_edge(t));
  auto* node = dynamic_cast<PromoteBackward*>(t.grad_fn().get());
  return node && grad_edge_deferrable(node->next_edge(0));
}

bool defer_leaf_grad(const at::Tensor& param, const at::Tensor& term, const MeshPtr& mesh,
                     const std::vector<int64_t>& mesh_dims) {
  return defer_grad_reduction(leaf_edge(param), term, mesh, mesh_dims);
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
