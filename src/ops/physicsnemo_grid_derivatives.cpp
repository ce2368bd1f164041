// PhysicsNeMo's finite differences on a uniform periodic grid (`physicsnemo.nn.functional.uniform_grid_gradient`:
// custom ops `physicsnemo::uniform_grid_gradient_warp_impl` and `uniform_grid_derivatives_order2_fused_warp_impl`,
// Warp kernels), bound when PhysicsNeMo defines them: the derivatives of a physics-informed loss on a grid field.
//
// A central difference of accuracy order `order` reads order / 2 rows on each side, wrapped around at the edges.
// Along each sharded dim a rank therefore needs its own rows and order / 2 rows of each neighbour (the last rank's
// rows for the first rank: periodic), the window a circular convolution of kernel order + 1 reads
// (comm::sliding_window_partition, PadMode::Circular; shards narrower than the halo read further away). PhysicsNeMo's
// own kernel runs on that window (its wrap-around inside the window only touches the rows cropped away), and the
// rank keeps the derivatives of its own rows: the output (derivatives, *field) is laid out like the field, nothing
// gathered. Unsharded dims stay whole, so the kernel's own periodic wrap is right there.
//
// Bound above autograd: the op's registered backward runs Warp on its gradient, which must be a plain tensor. The
// backward here runs that backward on the window (the local call's own graph) and sends the halo rows' gradients
// home (the plan's adjoint), so the field's gradient keeps its layout.
#include "comm/halo_plan.h"
#include "dispatch/args.h"
#include "dispatch/registry.h"
#include "dispatch/rule_family.h"
#include "ops/common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The periodic windows along every sharded dim of `spec`, `halo` rows on each side.
comm::HaloPlan periodic_plan(const ShardSpec& spec, int64_t halo, c10::Device device) {
  std::vector<comm::HaloDim> dims;
  comm::SlidingWindow w;
  w.kernel = 2 * halo + 1;
  w.padding = halo;
  for (int64_t m = 0; m < spec.mesh->ndim(); ++m) {
    const auto& p = spec.placements[m];
    if (!p.is_shard()) continue;
    const auto L = spec.global_shape[p.dim];
    auto part = comm::sliding_window_partition(spec.extents[m], L, L, w, comm::PadMode::Circular);
    TORCH_INTERNAL_ASSERT(part.out_extents == spec.extents[m], "a 'same' window keeps the extents");
    dims.push_back(comm::HaloDim{p.dim, m, spec.extents[m], std::move(part.want)});
  }
  return comm::HaloPlan(dims, spec.mesh->coordinates(), device);
}

// The op's window output cut to this rank's own rows: along each sharded dim (output dim d + 1), `halo` rows on
// each side come off.
at::Tensor own_rows(at::Tensor out, const ShardSpec& spec, const at::Tensor& local, int64_t halo) {
  for (const auto& p : spec.placements)
    if (p.is_shard()) out = out.narrow(p.dim + 1, halo, local.size(p.dim));
  return out;
}

// The output's layout: the field's, behind the leading derivatives dim.
std::pair<Placements, DimExtents> output_layout(const ShardSpec& spec) {
  Placements pl;
  DimExtents ext;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const auto& p = spec.placements[m];
    pl.push_back(p.is_shard() ? Placement::shard(p.dim + 1) : p);
    if (p.is_shard()) ext[p.dim + 1] = spec.extents[m];
  }
  return {pl, ext};
}

struct GridDerivativeFn : torch::autograd::Function<GridDerivativeFn> {
  // `args`: the op's arguments (the field first); `halo`: rows read on each side; `count`: derivatives returned.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& field, const c10::OperatorHandle& op,
                            std::vector<c10::IValue> args, int64_t halo, int64_t count) {
    const auto& spec = *shard_impl(field)->spec();
    const auto& local = shard_impl(field)->local();
    auto plan = periodic_plan(spec, halo, local.device());
    auto window = plan.gather(local, *spec.mesh).detach();
    const bool grad = field.requires_grad();
    auto local_shape = local.sizes().vec();
    local_shape.insert(local_shape.begin(), count);
    at::Tensor out_local, out_w;
    if (window.numel() == 0) {
      // A rank without rows keeps none, but still calls the kernel (on one row per empty dim) so that PhysicsNeMo's
      // argument checks raise here as on the ranks with rows, instead of leaving those in the next collective.
      auto dummy_shape = window.sizes().vec();
      for (auto& n : dummy_shape) n = std::max<int64_t>(n, 1);
      auto dummy_args = args;
      dummy_args[0] = at::zeros(dummy_shape, local.options());
      torch::jit::Stack stack(dummy_args.begin(), dummy_args.end());
      op.callBoxed(&stack);
      out_local = at::zeros(local_shape, local.options());
    } else {
      at::AutoGradMode local_graph(grad); // the local call's own graph is the backward's
      if (grad) window.requires_grad_();
      args[0] = window;
      torch::jit::Stack stack(args.begin(), args.end());
      op.callBoxed(&stack);
      out_w = stack.back().toTensor();
      TORCH_INTERNAL_ASSERT(out_w.size(0) == count, dispatch::qualified_name(op), ": ", out_w.size(0),
                            " derivatives, expected ", count);
      out_local = own_rows(out_w, spec, local, halo).detach().contiguous();
    }
    ctx->saved_data["field"] = field;
    ctx->saved_data["halo"] = halo;
    ctx->saved_data["window"] = window;
    if (out_w.defined() && grad) ctx->saved_data["out_w"] = out_w;
    auto [pl, ext] = output_layout(spec);
    std::vector<int64_t> shape{count};
    shape.insert(shape.end(), spec.global_shape.begin(), spec.global_shape.end());
    return wrap(out_local, spec.mesh, pl, shape, ext);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto field = ctx->saved_data["field"].toTensor();
    const auto halo = ctx->saved_data["halo"].toInt();
    const auto& spec = *shard_impl(field)->spec();
    const auto& local = shard_impl(field)->local();
    auto plan = periodic_plan(spec, halo, local.device());
    auto window = ctx->saved_data["window"].toTensor();
    auto [pl, ext] = output_layout(spec);
    auto g = local_in(grads[0], spec.mesh, pl, ext);
    // The window's gradient through the local call's own backward (PhysicsNeMo's, on plain tensors): the incoming
    // rows in place, zero on the halo rows the forward cut off. A rank without rows has none (zeros).
    at::Tensor grad_window = at::zeros(window.sizes(), local.options());
    if (ctx->saved_data.count("out_w")) {
      auto out_w = ctx->saved_data["out_w"].toTensor();
      auto g_w = at::zeros_like(out_w);
      own_rows(g_w, spec, local, halo).copy_(g);
      at::AutoGradMode local_graph(true);
      grad_window = torch::autograd::grad({out_w}, {window}, {g_w})[0];
    }
    // Halo rows' gradients home, summed into their owners' rows (every rank: a collective).
    auto grad_local = plan.empty() ? grad_window : plan.scatter_add(grad_window, *spec.mesh, /*consume=*/true);
    return {wrap(grad_local, spec.mesh, spec.placements, spec.global_shape, spec.dim_extents()), {}, {}, {}, {}};
  }
};

// uniform_grid_gradient_warp_impl(Tensor field, Tensor spacing_meta, int order, int derivative_order,
//                                 bool include_mixed) -> Tensor
// uniform_grid_derivatives_order2_fused_warp_impl(Tensor field, Tensor spacing_meta, bool include_mixed) -> Tensor
void grid_derivative_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto nargs = op.schema().arguments().size();
  auto first = stack->end() - static_cast<std::ptrdiff_t>(nargs);
  const auto field_in = first[0].toTensor();
  if (!shard_impl(field_in))
    dispatch::not_implemented(op, stack, "only the field may be a ShardTensor (the spacing is host metadata)");
  for (auto it = first + 1; it != stack->end(); ++it)
    if (it->isTensor() && shard_impl(it->toTensor()))
      dispatch::not_implemented(op, stack, "the spacing is a ShardTensor; pass it as a plain tensor");
  const bool fused = nargs == 3;
  const int64_t order = fused ? 2 : first[2].toInt();
  TORCH_CHECK_VALUE(order == 2 || order == 4, dispatch::qualified_name(op), ": order must be 2 or 4, got ", order);
  // The derivatives returned (the ops' fake kernels): first or pure second derivatives, one per axis; the fused op
  // both and, with include_mixed, the mixed pairs.
  const auto nd = field_in.dim();
  const bool mixed = first[fused ? 2 : 4].toBool();
  const int64_t count = fused ? 2 * nd + (mixed ? nd * (nd - 1) / 2 : 0) : nd;
  auto field = shard_impl(field_in)->spec()->has_partial() ? resolve_partial_diff(field_in) : field_in;
  std::vector<c10::IValue> args(first, stack->end());
  stack->erase(first, stack->end());
  stack->emplace_back(GridDerivativeFn::apply(field, op, std::move(args), order / 2, count));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(physicsnemo_grid_derivatives) {
  for (const char* name : {"physicsnemo::uniform_grid_gradient_warp_impl",
                           "physicsnemo::uniform_grid_derivatives_order2_fused_warp_impl"})
    dispatch::set_handler_when_defined(name, &grid_derivative_handler, dispatch::RuleLevel::above_autograd);
}

} // namespace shardtensor::ops
