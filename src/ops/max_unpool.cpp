// max_unpool2d / max_unpool3d (SegNet-style decoders, QuickNAT: each pooled value back at the position its max came
// from, zeros elsewhere) with the pooled tensor split along any of its spatial dims, on 1-D and 2-D meshes.
//
// The output is split along the same dims: in proportion to the pooled extents when an output size is a multiple of
// the pooled one (pooling by stride s: each rank's values then land in its own block and nothing travels but the
// count exchange), else by the default split. Each value goes to the owner of its target position by element
// routing (ops/element_routing.h: the pair counts in one all-gather, values and positions in one all-to-all each),
// one routing per split dim (a 2-D mesh splitting the height and the width moves a value along the height's mesh dim
// first, then along the width's), and each rank writes what it received into its zero block. The gradient reads the
// output gradient at those positions: each rank asks the owners for the elements its values went to (the same
// routing, carrying the way back) and receives them, so no rank holds a tensor of the output's size. Batch and
// channel shards stay local.
#include "comm/collectives.h"
#include "dispatch/args.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/element_routing.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One routing step: spatial dim j (0 = the first spatial dim) split by mesh dim m.
struct Route {
  int64_t j = 0, m = 0;
};

// The layouts of one call: the pooled tensor's (self's) and the output's, the output's spatial sizes, the routes.
struct UnpoolLayout {
  int64_t spatial = 2;
  std::vector<int64_t> size;  // output spatial sizes
  std::vector<Route> routes;  // in spatial-dim order
  SpecPtr self_spec, out_spec;
};

UnpoolLayout unpool_layout(const at::Tensor& self, at::IntArrayRef output_size) {
  UnpoolLayout l;
  l.spatial = static_cast<int64_t>(output_size.size());
  l.size = output_size.vec();
  l.self_spec = without_partial(shard_impl(self)->spec());
  const auto& spec = *l.self_spec;
  const auto first = self.dim() - l.spatial;
  auto shape = self.sizes().vec();
  auto ext = spec.dim_extents();
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const auto& p = spec.placements[m];
    if (!p.is_shard() || p.dim < first) continue;
    const auto j = p.dim - first;
    l.routes.push_back({j, static_cast<int64_t>(m)});
    const auto h = self.size(p.dim), n = l.size[j];
    std::vector<int64_t> out_ext;
    if (h > 0 && n % h == 0)
      for (auto e : spec.extents[m]) out_ext.push_back(e * (n / h));
    else
      out_ext = default_split(n, spec.mesh->size(static_cast<int64_t>(m)));
    ext[p.dim] = out_ext;
  }
  std::sort(l.routes.begin(), l.routes.end(), [](const Route& a, const Route& b) { return a.j < b.j; });
  for (int64_t j = 0; j < l.spatial; ++j) shape[first + j] = l.size[j];
  l.out_spec = ShardSpec::make_with_dim_extents(spec.mesh, spec.placements, shape, ext);
  return l;
}

std::string out_of_range(const UnpoolLayout& l) {
  return c10::str("max_unpool", l.spatial, "d(): found an invalid max index (an index outside the ",
                  c10::IntArrayRef(l.size), " output)");
}

// Per pooled element (flattened over this rank's block): [slab, c_0, ..., c_{spatial-1}] — its (N, C) plane in the
// local block and its target's global coordinates. `invalid`: an index outside the output (clamped here).
std::pair<at::Tensor, bool> targets_of(const UnpoolLayout& l, const at::Tensor& indices_local) {
  const auto sizes = indices_local.sizes();
  const auto slabs = c10::multiply_integers(sizes.begin(), sizes.end() - l.spatial);
  const auto per_slab = c10::multiply_integers(sizes.end() - l.spatial, sizes.end());
  auto idx = indices_local.reshape({slabs, per_slab}).to(at::kLong);
  const auto volume = c10::multiply_integers(l.size);
  const bool invalid = idx.numel() > 0 && (idx.min().item<int64_t>() < 0 || idx.max().item<int64_t>() >= volume);
  if (invalid) idx = idx.clamp(0, std::max<int64_t>(volume - 1, 0));
  std::vector<at::Tensor> cols{at::arange(slabs, idx.options()).unsqueeze(1).expand_as(idx).reshape({-1})};
  auto rest = idx.reshape({-1});
  std::vector<at::Tensor> coords(l.spatial);
  for (int64_t j = l.spatial - 1; j >= 0; --j) {
    coords[j] = at::remainder(rest, l.size[j]);
    rest = at::floor_divide(rest, l.size[j]);
  }
  for (auto& c : coords) cols.push_back(c);
  return {at::stack(cols, 1), invalid};
}

// Flat positions in this rank's output block of targets [slab, c_0, ...] it owns.
at::Tensor local_slots(const UnpoolLayout& l, const at::Tensor& targets) {
  const auto& spec = *l.out_spec;
  const auto first = static_cast<int64_t>(spec.global_shape.size()) - l.spatial;
  auto slot = targets.select(1, 0).clone();
  for (int64_t j = 0; j < l.spatial; ++j) {
    const auto d = first + j;
    const auto e = spec.local_shape[d];
    const auto start = spec.local_offset(d);
    slot = slot * e + (targets.select(1, 1 + j) - start);
  }
  return slot;
}

// An index out of range found by any rank raises on every rank before anything moves (with one route the routing's
// own count exchange agrees it; with several, ranks of other groups would wait in a later step).
void agree_invalid(const UnpoolLayout& l, bool invalid) {
  if (l.routes.size() < 2) return;
  const auto ok = comm::all_reduce_min_ints({invalid ? 0 : 1}, *l.self_spec->mesh);
  if (ok[0] == 0) throw c10::IndexError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, out_of_range(l));
}

at::Tensor local_unpool(const at::Tensor& x, const at::Tensor& idx, const UnpoolLayout& l, at::IntArrayRef stride,
                        at::IntArrayRef padding) {
  // A rank whose batch or channel shard is empty has nothing to place (the kernel refuses empty input).
  if (x.numel() == 0) return at::zeros(l.out_spec->local_shape, x.options());
  return l.spatial == 2 ? at::max_unpool2d(x, idx, l.size) : at::max_unpool3d(x, idx, l.size, stride, padding);
}

at::Tensor unpool_forward(const at::Tensor& self_in, const at::Tensor& indices, at::IntArrayRef output_size,
                          at::IntArrayRef stride, at::IntArrayRef padding) {
  auto self = resolve_partial(self_in);
  const auto l = unpool_layout(self, output_size);
  const auto& mesh = l.self_spec->mesh;
  auto local = shard_impl(self)->local();
  auto idx = local_as(dispatch::as_shard(indices, mesh), mesh, l.self_spec->placements, l.self_spec->dim_extents());
  if (l.routes.empty()) return make_shard_tensor(local_unpool(local, idx, l, stride, padding), l.out_spec);
  auto [targets, invalid] = targets_of(l, idx);
  agree_invalid(l, invalid);
  auto vals = local.reshape({-1});
  for (const auto& r : l.routes) {
    const auto dl = dim_layout(*l.out_spec, r.m, targets.device());
    std::tie(vals, targets) = route_elements(vals, targets, owner_of(dl, targets.select(1, 1 + r.j)), *mesh, r.m,
                                             "max_unpool along a sharded dim (counts)", invalid, out_of_range(l));
  }
  auto out = at::zeros(l.out_spec->local_shape, local.options());
  out.view(-1).index_copy_(0, local_slots(l, targets), vals);
  return make_shard_tensor(out, l.out_spec);
}

// The output gradient at the positions the pooled values went to: each rank asks the owners (the forward's routes,
// recording each step's coordinate to return to) and the answers come back the same way in reverse.
at::Tensor unpool_backward(const at::Tensor& grad_in, const at::Tensor& indices, const UnpoolLayout& l) {
  const auto& mesh = l.self_spec->mesh;
  auto g = local_in(grad_in, mesh, l.out_spec->placements,
                    l.out_spec->dim_extents());
  auto idx = local_as(dispatch::as_shard(indices, mesh), mesh, l.self_spec->placements, l.self_spec->dim_extents());
  auto [targets, invalid] = targets_of(l, idx);
  agree_invalid(l, invalid);
  const auto k = targets.size(0);
  const auto ncoord = 1 + l.spatial;
  // Requests: [slab, c_0.., c_{s-1}, k, back_0, back_1, ...]; back_i is the coordinate on route i's mesh dim to
  // return to, appended as the request leaves along it.
  auto req = at::cat({targets, at::arange(k, targets.options()).unsqueeze(1)}, 1);
  for (const auto& r : l.routes) {
    req = at::cat({req, at::full({req.size(0), 1}, mesh->coordinate(r.m), req.options())}, 1);
    const auto dl = dim_layout(*l.out_spec, r.m, req.device());
    req = route_elements({}, req, owner_of(dl, req.select(1, 1 + r.j)), *mesh, r.m,
                         "max_unpool backward (requests)", invalid, out_of_range(l))
              .second;
  }
  auto found = g.reshape({-1}).index_select(0, local_slots(l, req.narrow(1, 0, ncoord)));
  auto back = req.narrow(1, ncoord, req.size(1) - ncoord);  // [k, back_0, ...]
  for (int64_t i = static_cast<int64_t>(l.routes.size()) - 1; i >= 0; --i)
    std::tie(found, back) = route_elements(found, back, back.select(1, 1 + i), *mesh, l.routes[i].m,
                                           "max_unpool backward (replies)");
  auto out = at::empty({k}, g.options());
  out.index_copy_(0, back.select(1, 0), found);
  return make_shard_tensor(out.view(idx.sizes()), l.self_spec);
}

// max_unpool is linear in the pooled values (the indices fixed): the backward is the adjoint (each value's gradient
// fetched from where it went), whose own backward is the unpooling again.
struct MaxUnpoolMap : LinearMap {
  at::Tensor indices;
  std::vector<int64_t> output_size, stride, padding;
  UnpoolLayout l;
  MaxUnpoolMap(const at::Tensor& self, at::Tensor idx, std::vector<int64_t> os, std::vector<int64_t> st,
               std::vector<int64_t> pd)
      : indices(std::move(idx)), output_size(std::move(os)), stride(std::move(st)), padding(std::move(pd)),
        l(unpool_layout(self, output_size)) {}
  at::Tensor apply(const at::Tensor& x) const override {
    return unpool_forward(grad_to_spec(x, l.self_spec), indices, output_size, stride, padding);
  }
  at::Tensor adjoint(const at::Tensor& g) const override { return unpool_backward(g, indices, l); }
};

struct MaxUnpoolFn : torch::autograd::Function<MaxUnpoolFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& self, const at::Tensor& indices,
                            std::vector<int64_t> output_size, std::vector<int64_t> stride,
                            std::vector<int64_t> padding) {
    at::NoGradGuard no_grad;
    ctx->saved_data["map"] = map_ivalue(c10::make_intrusive<MaxUnpoolMap>(self, indices, output_size, stride, padding));
    return unpool_forward(self, indices, output_size, stride, padding);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_map_backward(ctx, grads, 5);
  }
};

at::Tensor pooled_shard(const at::Tensor& self) {
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(self), "ShardTensor max_unpool: the pooled values must be the ShardTensor");
  return self;
}

// max_unpool2d(Tensor self, Tensor indices, SymInt[2] output_size)
at::Tensor max_unpool2d_rule(const at::Tensor& self, const at::Tensor& indices, c10::SymIntArrayRef output_size) {
  return unpool_forward(pooled_shard(self), indices, c10::IntArrayRef(concrete_ints(output_size)), {}, {});
}

// max_unpool3d(Tensor self, Tensor indices, SymInt[3] output_size, int[3] stride, int[3] padding)
at::Tensor max_unpool3d_rule(const at::Tensor& self, const at::Tensor& indices, c10::SymIntArrayRef output_size,
                             at::IntArrayRef stride, at::IntArrayRef padding) {
  return unpool_forward(pooled_shard(self), indices, c10::IntArrayRef(concrete_ints(output_size)), stride, padding);
}

// The autograd rule, for a pooled tensor split along a spatial dim that requires grad (the derivative formula would
// gather the output gradient at indices the owners of the positions do not hold).
bool max_unpool_autograd(int64_t spatial, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!at::GradMode::is_enabled() || !shard_impl(self) || !self.requires_grad() || self.dim() <= spatial) return false;
  bool split = false;
  for (int64_t d = self.dim() - spatial; d < self.dim(); ++d)
    split = split || shard_impl(self)->spec()->mesh_dim_of(d) >= 0;
  if (!split) return false;
  auto output_size = concrete_ints(args["output_size"].toSymIntVector());
  std::vector<int64_t> stride, padding;
  if (spatial == 3) {
    stride = args["stride"].toIntVector();
    padding = args["padding"].toIntVector();
  }
  auto out = MaxUnpoolFn::apply(self, args.tensor("indices"), output_size, stride, padding);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(max_unpool) {
  dispatch::set_handler("aten::max_unpool2d", typed_handler(&max_unpool2d_rule));
  dispatch::set_handler("aten::max_unpool3d", typed_handler(&max_unpool3d_rule));
  dispatch::set_autograd_handler("aten::max_unpool2d", [](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    return max_unpool_autograd(2, op, stack);
  });
  dispatch::set_autograd_handler("aten::max_unpool3d", [](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    return max_unpool_autograd(3, op, stack);
  });
}

} // namespace shardtensor::ops
