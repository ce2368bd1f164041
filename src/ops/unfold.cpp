// Tensor.unfold(dim, size, step): the windows of `size` rows every `step` rows of dim `dim`, as a new last dim.
//
// Along an unsharded dim it is the local view. Along a sharded dim it is a windowed read (HaloNet's blocked
// attention): a rank owns the windows centred in its rows (the halo planner's sliding-window rule for a kernel of
// `size`, stride `step`, no padding: the same rule as a convolution's outputs), gathers the rows they read (its
// own and a halo from its neighbours, any distance away) and unfolds them locally; the windows dim takes the
// shard. That result is a copy, not a view of the input, so an in-place write into it raises
// (dispatch/write_back.h), as for every re-laid-out view. Under autograd the sharded case runs above autograd with
// its own backward (the local unfold_backward of the window, then the halo gradients go home), since aten's
// unfold_backward would not know the input's extents.
#include "comm/halo_plan.h"
#include "comm/spec_holder.h"
#include "dispatch/args.h"
#include "dispatch/write_back.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct UnfoldPlan {
  comm::HaloPlan halo;
  std::vector<int64_t> out_extents; // windows per coordinate along the sharded dim
};

std::shared_ptr<const UnfoldPlan> unfold_plan(const ShardSpec& spec, int64_t dim, int64_t size, int64_t step,
                                              c10::Device device) {
  comm::PlanKey key;
  key.add_spec(spec).add_device(device).add(dim).add(size).add(step);
  return comm::cached_plan<UnfoldPlan>(key, [&] {
    const auto m = spec.mesh_dim_of(dim);
    const auto L = spec.global_shape[dim];
    comm::SlidingWindow w;
    w.kernel = size;
    w.stride = step;
    auto part = comm::sliding_window_partition(spec.extents[m], L, (L - size) / step + 1, w, comm::PadMode::None);
    UnfoldPlan plan;
    plan.out_extents = part.out_extents;
    plan.halo = comm::HaloPlan({comm::HaloDim{dim, m, spec.extents[m], std::move(part.want)}},
                               spec.mesh->coordinates(), device);
    return plan;
  });
}

void check_args(const at::Tensor& self, int64_t dim, int64_t size, int64_t step) {
  const auto L = self.dim() == 0 ? 1 : self.size(dim);
  TORCH_CHECK_VALUE(size <= L, "unfold: maximum size for tensor at dimension ", dim, " is ", L, " but size is ", size);
  TORCH_CHECK_VALUE(size >= 0, "unfold: size is ", size, " but must be >= 0");
  TORCH_CHECK_VALUE(step > 0, "unfold: step is ", step, " but must be > 0");
}

// The output layout: dim `dim` becomes the windows dim (the shard stays on it, with `windows` extents when it is
// sharded), and a new, unsharded last dim of `size`.
SpecPtr unfold_spec(const ShardSpec& spec, int64_t dim, int64_t size, int64_t step,
                    const std::vector<int64_t>* windows) {
  auto shape = spec.global_shape;
  auto ext = spec.dim_extents();
  if (!shape.empty()) shape[dim] = (shape[dim] - size) / step + 1;
  shape.push_back(size);
  if (windows) ext[dim] = *windows;
  return ShardSpec::make_with_dim_extents(spec.mesh, spec.placements, shape, ext);
}

// The windows of this rank along the sharded dim `dim` (a fresh tensor).
at::Tensor sharded_unfold(const at::Tensor& self, int64_t dim, int64_t size, int64_t step) {
  const auto& spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  auto plan = unfold_plan(*spec, dim, size, step, x.device());
  auto window = plan->halo.gather(x, *spec->mesh);
  const auto mine = plan->out_extents[spec->mesh->coordinate(spec->mesh_dim_of(dim))];
  at::Tensor out;
  if (mine > 0) {
    out = window.unfold(dim, size, step);
  } else {
    auto shape = x.sizes().vec();
    shape[dim] = 0;
    shape.push_back(size);
    out = at::empty(shape, x.options());
  }
  return make_shard_tensor(out, unfold_spec(*spec, dim, size, step, &plan->out_extents));
}

// Tensor.unfold is linear in its input: the backward is the adjoint (the windows' gradients summed home, their halo
// rows returned), whose own backward is the unfold again.
struct UnfoldMap : LinearMap {
  SpecPtr spec;  // the (completed) input's layout
  int64_t dim, size, step;
  UnfoldMap(SpecPtr s, int64_t d, int64_t sz, int64_t st) : spec(std::move(s)), dim(d), size(sz), step(st) {}
  at::Tensor apply(const at::Tensor& x) const override { return sharded_unfold(grad_to_spec(x, spec), dim, size, step); }
  at::Tensor adjoint(const at::Tensor& grad) const override {
    const auto& mesh = *spec->mesh;
    auto plan = unfold_plan(*spec, dim, size, step, grad.device());
    auto out_spec = unfold_spec(*spec, dim, size, step, &plan->out_extents);
    auto g = local_in(grad, spec->mesh, out_spec->placements, out_spec->dim_extents());
    auto window_shape = spec->local_shape;
    window_shape[dim] = plan->halo.window_rows(0);
    at::Tensor window_grad;
    if (g.size(dim) > 0) {
      window_grad = at::unfold_backward(g, window_shape, dim, size, step);
    } else {
      window_grad = at::zeros(window_shape, g.options());
    }
    return make_shard_tensor(plan->halo.scatter_add(window_grad, mesh, /*consume=*/true), spec);
  }
};

struct UnfoldFn : torch::autograd::Function<UnfoldFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& self_in, int64_t dim, int64_t size, int64_t step) {
    ctx->set_materialize_grads(false);
    auto self = resolve_partial(self_in);
    ctx->saved_data["map"] = map_ivalue(c10::make_intrusive<UnfoldMap>(shard_impl(self)->spec(), dim, size, step));
    return sharded_unfold(self, dim, size, step);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_map_backward(ctx, grads, 4);
  }
};

bool sharded_along(const at::Tensor& self, int64_t dim) {
  auto* impl = shard_impl(self);
  return impl && self.dim() > 0 && impl->spec()->mesh_dim_of(dim) >= 0;
}

// unfold(Tensor(a) self, int dimension, int size, int step) -> Tensor(a)
at::Tensor unfold_rule(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  const auto dim = self.dim() == 0 ? 0 : wrap_dim(dimension, self.dim());
  check_args(self, dim, size, step);
  if (!sharded_along(self, dim)) {
    const auto& spec = shard_impl(self)->spec();
    return make_shard_tensor(shard_impl(self)->local().unfold(dim, size, step),
                             unfold_spec(*spec, dim, size, step, nullptr));
  }
  auto out = sharded_unfold(resolve_partial(self), dim, size, step);
  dispatch::register_relaid_view(out, "aten::unfold along sharded dim " + std::to_string(dim));
  return out;
}

// With grad: the sharded case records UnfoldFn (aten's unfold_backward cannot place the window gradients).
bool unfold_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  const auto size = args["size"].toInt(), step = args["step"].toInt();
  if (!shard_impl(self) || !self.requires_grad()) return false;
  const auto dim = self.dim() == 0 ? 0 : wrap_dim(args["dimension"].toInt(), self.dim());
  if (!sharded_along(self, dim)) return false;
  check_args(self, dim, size, step);
  auto out = UnfoldFn::apply(self, dim, size, step);
  dispatch::register_relaid_view(out, "aten::unfold along sharded dim " + std::to_string(dim));
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

// The input rows whose unfold partition has `windows` per coordinate: each boundary at the centre row of the next
// coordinate's first window. Empty when the rule cannot produce them.
std::vector<int64_t> rows_for_windows(const std::vector<int64_t>& windows, int64_t L, int64_t size, int64_t step) {
  std::vector<int64_t> ext;
  int64_t prev = 0, count = 0;
  for (size_t c = 0; c + 1 < windows.size(); ++c) {
    count += windows[c];
    const auto a = std::clamp<int64_t>(count * step + (size - 1) / 2, prev, L);
    ext.push_back(a - prev);
    prev = a;
  }
  ext.push_back(L - prev);
  comm::SlidingWindow w;
  w.kernel = size;
  w.stride = step;
  auto part = comm::sliding_window_partition(ext, L, (L - size) / step + 1, w, comm::PadMode::None);
  return part.out_extents == windows ? ext : std::vector<int64_t>();
}

// unfold_backward(Tensor grad_in, SymInt[] input_sizes, int dim, int size, int step) -> Tensor: aten's derivative,
// reached for the local (unsharded-dim) unfold and under torch.compile or double backward. A gradient sharded along
// the windows dim goes to the input rows those windows come from (rows_for_windows; else the default split, the
// gradient's windows redistributed to match): the local unfold_backward of the window, then the halo rows home.
at::Tensor unfold_backward_rule(const at::Tensor& grad_in, c10::SymIntArrayRef input_sizes, int64_t dim, int64_t size,
                                int64_t step) {
  const auto sizes = concrete_ints(input_sizes);
  const auto d = sizes.empty() ? 0 : wrap_dim(dim, static_cast<int64_t>(sizes.size()));
  auto g = resolve_partial(grad_in);
  // A gradient split along the window dim (a later op's gradient laid out by its own default split) has that split
  // moved to another dim first (one all-to-all), the windows dim when it is the largest free one.
  if (!sizes.empty() && shard_impl(g)->spec()->mesh_dim_of(grad_in.dim() - 1) >= 0) {
    auto moved = split_moved_off(g, grad_in.dim() - 1);
    if (!moved) not_implemented("the gradient of an unfold is sharded along its window dim and no other dim can "
                                "take the split");
    g = std::move(*moved);
  }
  const auto& spec = shard_impl(g)->spec();
  auto ext = spec->dim_extents();
  ext.erase(grad_in.dim() - 1);
  const auto m = sizes.empty() ? -1 : spec->mesh_dim_of(d);
  if (m < 0) {
    auto local_sizes = sizes;
    for (const auto& [t, e] : ext) local_sizes[t] = shard_impl(g)->local().size(t);
    auto local = at::unfold_backward(shard_impl(g)->local(), local_sizes, d, size, step);
    return make_shard_tensor(local, ShardSpec::make_with_dim_extents(spec->mesh, spec->placements, sizes, ext));
  }
  auto rows = rows_for_windows(spec->extents[m], sizes[d], size, step);
  ext[d] = rows.empty() ? default_split(sizes[d], spec->mesh->size(m)) : rows;
  auto in_spec = ShardSpec::make_with_dim_extents(spec->mesh, spec->placements, sizes, ext);
  auto plan = unfold_plan(*in_spec, d, size, step, grad_in.device());
  auto out_spec = unfold_spec(*in_spec, d, size, step, &plan->out_extents);
  auto gl = local_as(g, spec->mesh, out_spec->placements, out_spec->dim_extents());
  auto window_shape = in_spec->local_shape;
  window_shape[d] = plan->halo.window_rows(0);
  auto window_grad = gl.size(d) > 0 ? at::unfold_backward(gl, window_shape, d, size, step)
                                    : at::zeros(window_shape, gl.options());
  return make_shard_tensor(plan->halo.scatter_add(window_grad, *spec->mesh, /*consume=*/true), in_spec);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(unfold) {
  dispatch::set_handler("aten::unfold", typed_handler(&unfold_rule));
  dispatch::set_autograd_handler("aten::unfold", unfold_autograd);
  dispatch::set_handler("aten::unfold_backward", typed_handler(&unfold_backward_rule));
}

} // namespace shardtensor::ops
