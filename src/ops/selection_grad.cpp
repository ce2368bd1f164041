// The gradient of a selection along a sharded dim: topk, and max / min with indices (PointNet's global max pool over
// the points, a top-k of scores over the tokens). Their derivative formula, value_selecting_reduction_backward,
// knows the input's global sizes but not its layout, so it builds a tensor whole along the dim on every rank and
// scatters the selected entries into it. These autograd rules keep the input's layout instead (saved in the
// forward): each rank scatters the entries whose global index falls in its own rows into a gradient of its shard,
// no communication and nothing larger than the shard. The forward is the op's own rule (sort_fft.cpp, reduction.cpp).
#include "comm/spec_holder.h"
#include "dispatch/args.h"
#include "ops/common.h"

#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum class Selection : int64_t { topk, max, min };

struct SelectionFn : torch::autograd::Function<SelectionFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& self, int64_t kind, int64_t dim, bool keepdim,
                               int64_t k, bool largest) {
    // Grad mode is off here: the op's own rule runs (its autograd rule declines).
    at::Tensor values, indices;
    switch (static_cast<Selection>(kind)) {
      case Selection::topk: std::tie(values, indices) = at::topk(self, k, dim, largest, true); break;
      case Selection::max: std::tie(values, indices) = at::max(self, dim, keepdim); break;
      case Selection::min: std::tie(values, indices) = at::min(self, dim, keepdim); break;
    }
    ctx->saved_data["spec"] = spec_ivalue(without_partial(shard_impl(self)->spec()));
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["keepdim"] = keepdim;
    ctx->save_for_backward({indices});
    ctx->mark_non_differentiable({indices});
    return {values, indices};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list none(6);  // one per forward argument
    const auto& g_in = grads[0];
    if (!g_in.defined()) return none;
    at::NoGradGuard no_grad;
    auto spec = spec_from_ivalue(ctx->saved_data["spec"]);
    const auto dim = ctx->saved_data["dim"].toInt();
    const bool keepdim = ctx->saved_data["keepdim"].toBool();
    const auto idx_st = ctx->get_saved_variables()[0];
    const auto& mesh = spec->mesh;
    const auto& ispec = *shard_impl(idx_st)->spec();
    auto g = local_as(resolve_partial(dispatch::as_shard(g_in, mesh)), mesh, ispec.placements, ispec.dim_extents());
    const auto m = spec->mesh_dim_of(dim);
    const auto coord = mesh->coordinate(m);
    const auto off = spec->offset_of(m, coord), n = spec->extents[m][coord];
    auto idx = shard_impl(idx_st)->local();
    if (!keepdim) {
      idx = idx.unsqueeze(dim);
      g = g.unsqueeze(dim);
    }
    idx = idx - off;
    auto local_grad = at::zeros(spec->local_shape, g.options());
    if (n > 0 && idx.numel() > 0) {
      // Entries from other ranks' rows add 0 at a clamped position (where(), not a product: an inf stays out).
      auto mine = idx.ge(0).logical_and(idx.lt(n));
      local_grad.scatter_add_(dim, idx.clamp(0, n - 1), at::where(mine, g, at::zeros({}, g.options())));
    }
    none[0] = make_shard_tensor(local_grad, spec);
    return none;
  }
};

// The autograd rule of topk / max.dim / min.dim: only for a ShardTensor that requires grad, selected along a
// sharded dim, with grad mode on; otherwise the op's own derivative formula (declining returns false).
bool selection_autograd(Selection kind, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!at::GradMode::is_enabled() || !shard_impl(self) || !self.requires_grad() || self.dim() == 0) return false;
  const auto dim = wrap_dim(args["dim"].toInt(), self.dim());
  if (shard_impl(self)->spec()->mesh_dim_of(dim) < 0) return false;
  const bool keepdim = kind == Selection::topk || args["keepdim"].toBool();
  const int64_t k = kind == Selection::topk ? args["k"].toSymInt().expect_int() : 1;
  const bool largest = kind == Selection::topk ? args["largest"].toBool() : true;
  auto out = SelectionFn::apply(self, static_cast<int64_t>(kind), dim, keepdim, k, largest);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out[0]), std::move(out[1]));
  return true;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(selection_grad) {
  for (auto [name, kind] : {std::pair{"aten::topk", Selection::topk}, std::pair{"aten::max.dim", Selection::max},
                            std::pair{"aten::min.dim", Selection::min}})
    dispatch::set_autograd_handler(name, [kind](const c10::OperatorHandle& op, torch::jit::Stack* s) {
      return selection_autograd(kind, op, s);
    });
}

} // namespace shardtensor::ops
