// sum and mean above autograd, so their gradient is expanded straight into the input's layout.
//
// Their derivative formula is `grad.expand(input_sizes)` (divided by the count for mean). The gradient of a
// reduction is usually replicated (a loss), so that expansion is Replicate at the input's global size, and
// mean's division then materialises it on every rank: the whole backward of a model would start from a
// global-size tensor. Here the expanded gradient (a stride-0 view, no memory) is sliced to the input's layout
// first, locally, and only the shard is divided.
#include "comm/redistribute.h"
#include "comm/spec_holder.h"
#include "dispatch/args.h"
#include "ops/common.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ReductionSettings {
  bool mean = false;
  bool all_dims = true; // the overload without `dim`, or dim=None / []
  std::vector<int64_t> dims;
  bool keepdim = false;
  std::optional<at::ScalarType> dtype;
};

at::Tensor run_reduction(const at::Tensor& self, const ReductionSettings& r) {
  if (r.all_dims && !r.keepdim) return r.mean ? at::mean(self, r.dtype) : at::sum(self, r.dtype);
  at::OptionalIntArrayRef dims = r.all_dims ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(r.dims);
  return r.mean ? at::mean(self, dims, r.keepdim, r.dtype) : at::sum(self, dims, r.keepdim, r.dtype);
}

struct SumMeanFn : torch::autograd::Function<SumMeanFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& self, ReductionSettings r) {
    ctx->set_materialize_grads(false);
    const auto& spec = shard_impl(self)->spec();
    std::vector<int64_t> dims = r.dims;
    if (r.all_dims) {
      dims.resize(self.dim());
      for (int64_t d = 0; d < self.dim(); ++d) dims[d] = d;
    }
    for (auto& d : dims) d = wrap_dim(d, self.dim());
    std::sort(dims.begin(), dims.end());
    dims.erase(std::unique(dims.begin(), dims.end()), dims.end());
    int64_t count = 1;
    for (auto d : dims) count *= self.size(d);
    ctx->saved_data["spec"] = spec_ivalue(spec);
    ctx->saved_data["dims"] = dims;
    ctx->saved_data["keepdim"] = r.keepdim;
    ctx->saved_data["count"] = r.mean ? count : int64_t(0);
    ctx->saved_data["dtype"] = static_cast<int64_t>(self.scalar_type());
    return run_reduction(self, r);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor()};
    auto spec = spec_from_ivalue(ctx->saved_data["spec"]);
    auto dims = ctx->saved_data["dims"].toIntVector();
    const auto count = ctx->saved_data["count"].toInt();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    // A plain gradient with a graph of its own (a third derivative: the second's gradient is plain) is promoted
    // differentiably, so the graph reaches it; as_shard would cut it and drop that order's terms silently.
    g = as_shard_input(g, spec->mesh);
    // mean divides the reduced gradient (small) before it is expanded: the expansion stays a stride-0 view of it,
    // sliced into the input's layout without a copy, so no input-sized pass precedes the next op's own.
    if (count > 0) g = g / static_cast<double>(count);
    if (!ctx->saved_data["keepdim"].toBool())
      for (auto d : dims) g = g.unsqueeze(d); // ascending, so each index is final
    g = g.expand(spec->global_shape);
    auto target = without_partial(spec);
    g = at::GradMode::is_enabled() ? redistribute(g, target->placements, target->sharding_shapes())
                                   : redistribute_to(g, target);
    if (g.scalar_type() != dtype) g = g.to(dtype);
    return {g, at::Tensor()};
  }
};

// The autograd rule for sum / sum.dim_IntList / mean / mean.dim, which differ in their arguments (sum(self, dtype?)
// vs sum.dim_IntList(self, dim?, keepdim, dtype?)): read by name.
bool sum_mean_autograd(bool mean, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!shard_impl(self) || !self.requires_grad()) return false;
  ReductionSettings r;
  r.mean = mean;
  if (args.has("dim")) {
    r.dims = args.get_or<std::vector<int64_t>>("dim", {});
    r.all_dims = r.dims.empty();
    r.keepdim = args.get_or<bool>("keepdim", false);
  }
  r.dtype = args.dtype();
  auto out = SumMeanFn::apply(self, std::move(r));
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(reduction_grad) {
  for (const char* name : {"aten::sum", "aten::sum.dim_IntList"})
    dispatch::set_autograd_handler(name, [](const c10::OperatorHandle& op, torch::jit::Stack* s) {
      return sum_mean_autograd(false, op, s);
    });
  for (const char* name : {"aten::mean", "aten::mean.dim"})
    dispatch::set_autograd_handler(name, [](const c10::OperatorHandle& op, torch::jit::Stack* s) {
      return sum_mean_autograd(true, op, s);
    });
}

} // namespace shardtensor::ops
