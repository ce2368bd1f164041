// The gradient of a selection along a sharded dim: topk, max / min with indices (PointNet's global max pool over
// the points, a top-k of scores over the tokens), kthvalue / median / nanmedian and the running cummax / cummin. Their derivative formulas
// (value_selecting_reduction_backward, cummaxmin_backward) know the input's global sizes but not its layout, so they
// build a tensor whole along the dim on every rank and scatter the selected entries into it (a scan's into the
// sharded input itself, which no rule can do for indices on other ranks). These autograd rules keep the input's
// layout instead (saved in the forward): each rank scatters the entries whose global index falls in its own rows
// into a gradient of its shard, no communication and nothing larger than the shard (a scan's outputs that took the
// lower ranks' carry send one sum per slice to the carry's row, in one collective). The forward is the op's own
// rule (sort_fft.cpp, reduction.cpp).
#include "comm/spec_holder.h"
#include "comm/stat_reduce.h"
#include "dispatch/args.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum class Selection : int64_t { topk, max, min, cummax, cummin, kthvalue, median, nanmedian };

// The gradient of the selected values, each added at its global index along `dim` where this rank holds that row
// (`idx_st`: the indices, laid out like the values; `spec`: the input's layout), and a scan's carried entries.
at::Tensor selection_adjoint(const at::Tensor& g_in, const at::Tensor& idx_st, const SpecPtr& spec, int64_t dim,
                             bool keepdim, bool scan) {
  const auto& mesh = spec->mesh;
  const auto& ispec = *shard_impl(idx_st)->spec();
  auto g = local_in(g_in, mesh, ispec.placements, ispec.dim_extents());
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
  const auto zero = at::zeros({}, g.options());
  // Adds `values` at local rows `rows` along `dim`; rows outside this rank's add 0 at a clamped position (where(),
  // not a product: an inf stays out).
  auto add_own_rows = [&](const at::Tensor& rows, const at::Tensor& values) {
    if (n == 0 || rows.numel() == 0) return;
    auto mine = rows.ge(0).logical_and(rows.lt(n));
    local_grad.scatter_add_(dim, rows.clamp(0, n - 1), at::where(mine, values, zero));
  };
  add_own_rows(idx, g);
  if (scan) {
    // A scan's outputs that took the lower ranks' carry all point at one row per slice (the carry's): their
    // gradients are summed here, and every rank's sums and carry rows travel in one collective to be added by
    // the rank that owns the row.
    auto carried = idx.lt(0);
    auto shape = idx.sizes().vec();
    shape[dim] = 1;
    at::Tensor sums = at::zeros(shape, g.options()), rows = at::full(shape, -1, idx.options());
    if (idx.size(dim) > 0) {
      sums = at::where(carried, g, zero).sum(dim, true);
      rows = at::where(carried, idx + off, at::full({}, -1, idx.options())).amax(dim, true);
    }
    comm::StatReduce r;
    const auto si = r.gathered(sums), ri = r.gathered(rows);
    r.run(*mesh, {m});
    for (int64_t j = 0; j < static_cast<int64_t>(spec->extents[m].size()); ++j)
      if (j != coord) add_own_rows(r.result(ri)[0].select(0, j) - off, r.result(si)[0].select(0, j));
  }
  return make_shard_tensor(local_grad, spec);
}

// A selection whose values are whole along the selected dim (every reduction, and top-k / kth value of a dim no mesh
// dim splits in the output): linear in the input, the indices fixed. Its adjoint above; the selection itself reads
// each value where its row lives -- this rank's own rows, zero elsewhere -- a pending sum over the split's mesh dim
// (completed when read), so a second derivative runs on rules.
struct SelectionMap : LinearMap {
  at::Tensor indices;
  SpecPtr spec;
  int64_t dim;
  bool keepdim;
  SelectionMap(at::Tensor i, SpecPtr s, int64_t d, bool k) : indices(std::move(i)), spec(std::move(s)), dim(d), keepdim(k) {}
  at::Tensor apply(const at::Tensor& x_in) const override {
    const auto x = shard_impl(grad_to_spec(x_in, spec))->local();
    const auto& ispec = *shard_impl(indices)->spec();
    const auto m = spec->mesh_dim_of(dim);
    const auto coord = spec->mesh->coordinate(m);
    const auto off = spec->offset_of(m, coord), n = spec->extents[m][coord];
    auto idx = shard_impl(indices)->local();
    if (!keepdim) idx = idx.unsqueeze(dim);
    idx = idx - off;
    at::Tensor picked = at::zeros(idx.sizes(), x.options());
    if (n > 0 && idx.numel() > 0) {
      auto mine = idx.ge(0).logical_and(idx.lt(n));
      picked = at::where(mine, x.gather(dim, idx.clamp(0, n - 1)), at::zeros({}, x.options()));
    }
    if (!keepdim) picked = picked.squeeze(dim);
    auto p = ispec.placements;
    p[m] = Placement::partial(ReduceOp::Sum);
    return make_shard_tensor(picked, ShardSpec::make_with_dim_extents(spec->mesh, p, indices.sizes().vec(),
                                                                      ispec.dim_extents()));
  }
  at::Tensor adjoint(const at::Tensor& g) const override {
    return selection_adjoint(g, indices, spec, dim, keepdim, /*scan=*/false);
  }
};

struct SelectionFn : torch::autograd::Function<SelectionFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& self, int64_t kind, int64_t dim, bool keepdim,
                               int64_t k, bool largest) {
    // Grad mode is off here: the op's own rule runs (its autograd rule declines).
    at::Tensor values, indices;
    switch (static_cast<Selection>(kind)) {
      case Selection::topk: std::tie(values, indices) = at::topk(self, k, dim, largest, true); break;
      case Selection::max: std::tie(values, indices) = at::max(self, dim, keepdim); break;
      case Selection::min: std::tie(values, indices) = at::min(self, dim, keepdim); break;
      case Selection::cummax: std::tie(values, indices) = at::cummax(self, dim); break;
      case Selection::cummin: std::tie(values, indices) = at::cummin(self, dim); break;
      case Selection::kthvalue: std::tie(values, indices) = at::kthvalue(self, k, dim, keepdim); break;
      case Selection::median: std::tie(values, indices) = at::median(self, dim, keepdim); break;
      case Selection::nanmedian: std::tie(values, indices) = at::nanmedian(self, dim, keepdim); break;
    }
    const bool scan = kind == static_cast<int64_t>(Selection::cummax) || kind == static_cast<int64_t>(Selection::cummin);
    auto spec = without_partial(shard_impl(self)->spec());
    // Values whole along the dim on its mesh dim (not a scan's): a linear map (recorded under create_graph).
    if (!scan && shard_impl(indices)->spec()->mesh_dim_of(dim) < 0)
      ctx->saved_data["map"] = map_ivalue(c10::make_intrusive<SelectionMap>(indices, spec, dim, keepdim));
    ctx->saved_data["scan"] = scan;
    ctx->saved_data["spec"] = spec_ivalue(spec);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["keepdim"] = keepdim;
    ctx->save_for_backward({indices});
    ctx->mark_non_differentiable({indices});
    return {values, indices};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool recording = at::GradMode::is_enabled();  // create_graph: read before any NoGradGuard
    variable_list none(6);  // one per forward argument
    if (!grads[0].defined()) return none;
    if (ctx->saved_data.count("map")) {
      none[0] = linear_backward(map_from_ivalue(ctx->saved_data["map"]), grads[0], recording);
      return none;
    }
    at::NoGradGuard no_grad;
    none[0] = selection_adjoint(grads[0], ctx->get_saved_variables()[0], spec_from_ivalue(ctx->saved_data["spec"]),
                                ctx->saved_data["dim"].toInt(), ctx->saved_data["keepdim"].toBool(),
                                ctx->saved_data["scan"].toBool());
    return once_differentiable(std::move(none), "a running selection along a sharded dim (cummax, cummin)", recording);
  }
};

// The autograd rule of topk / max.dim / min.dim / cummax / cummin: only for a ShardTensor that requires grad,
// selected along a sharded dim, with grad mode on; otherwise the op's own derivative formula (declining: false).
bool selection_autograd(Selection kind, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!at::GradMode::is_enabled() || !shard_impl(self) || !self.requires_grad() || self.dim() == 0) return false;
  const auto dim = wrap_dim(args["dim"].toInt(), self.dim());
  if (shard_impl(self)->spec()->mesh_dim_of(dim) < 0) return false;
  const bool scan = kind == Selection::cummax || kind == Selection::cummin;
  const bool keepdim = kind == Selection::topk || scan || args["keepdim"].toBool();
  const int64_t k =
      kind == Selection::topk || kind == Selection::kthvalue ? concrete_int(args["k"].toSymInt()) : 1;
  const bool largest = kind == Selection::topk ? args["largest"].toBool() : true;
  auto out = SelectionFn::apply(self, static_cast<int64_t>(kind), dim, keepdim, k, largest);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out[0]), std::move(out[1]));
  return true;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(selection_grad) {
  for (auto [name, kind] : {std::pair{"aten::topk", Selection::topk}, std::pair{"aten::max.dim", Selection::max},
                            std::pair{"aten::min.dim", Selection::min}, std::pair{"aten::cummax", Selection::cummax},
                            std::pair{"aten::cummin", Selection::cummin},
                            std::pair{"aten::kthvalue", Selection::kthvalue},
                            std::pair{"aten::median.dim", Selection::median},
                            std::pair{"aten::nanmedian.dim", Selection::nanmedian}})
    dispatch::set_autograd_handler(name, [kind](const c10::OperatorHandle& op, torch::jit::Stack* s) {
      return selection_autograd(kind, op, s);
    });
}

} // namespace shardtensor::ops
