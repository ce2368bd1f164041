// max_unpool2d (SegNet-style decoders: each pooled value back at the position its max came from, zeros elsewhere)
// with the pooled tensor split along its height.
//
// The output is split along its height too: in proportion to the pooled extents when the output height is a multiple
// of the pooled one (pooling by stride s: each rank's values then land in its own rows and nothing travels but the
// count exchange), else by the default split. Each value goes to the owner of its target row by element routing
// (ops/element_routing.h: the pair counts in one all-gather, values and slots in one all-to-all each), and each rank
// writes what it received into its zero block. The gradient reads the output gradient at those positions: each rank
// asks the owners for the elements its values went to and receives them (the same routing, there and back), so no
// rank holds a tensor of the output's size. Other layouts (the width split) decline to the fallback.
#include "comm/spec_holder.h"
#include "dispatch/args.h"
#include "ops/common.h"
#include "ops/element_routing.h"

#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The layouts of one call: the pooled tensor's (self's) split of the height on mesh dim `m`, the output's.
struct UnpoolLayout {
  int64_t m = -1, hdim = 0;
  SpecPtr self_spec, out_spec;
  int64_t H = 0, W = 0;
};

UnpoolLayout unpool_layout(const at::Tensor& self, at::IntArrayRef output_size) {
  UnpoolLayout l;
  l.self_spec = without_partial(shard_impl(self)->spec());
  const auto& spec = *l.self_spec;
  l.hdim = self.dim() - 2;
  l.H = output_size[0];
  l.W = output_size[1];
  for (size_t j = 0; j < spec.placements.size(); ++j) {
    const auto& p = spec.placements[j];
    if (!p.is_shard()) continue;
    if (p.dim == l.hdim) l.m = static_cast<int64_t>(j);
    else if (p.dim == self.dim() - 1)
      dispatch::not_implemented("max_unpool2d with the width sharded; redistribute it to Replicate() first");
  }
  auto shape = self.sizes().vec();
  shape[l.hdim] = l.H;
  shape[l.hdim + 1] = l.W;
  auto ext = spec.dim_extents();
  if (l.m >= 0) {
    const auto h = self.size(l.hdim);
    std::vector<int64_t> out_ext;
    if (h > 0 && l.H % h == 0)
      for (auto e : spec.extents[l.m]) out_ext.push_back(e * (l.H / h));
    else
      out_ext = default_split(l.H, spec.mesh->size(l.m));
    ext[l.hdim] = out_ext;
  }
  l.out_spec = ShardSpec::make_with_dim_extents(spec.mesh, spec.placements, shape, ext);
  return l;
}

// Per pooled element (flattened over this rank's block): the owner of its target and its flat slot in the owner's
// output block [..., e_owner, W]. Raises IndexError on every rank (through the routing) for an index outside H·W.
struct Targets {
  at::Tensor owner, slot;
  bool invalid = false;
};

Targets targets_of(const UnpoolLayout& l, const at::Tensor& indices_local) {
  Targets t;
  const auto sizes = indices_local.sizes();
  const auto slabs = c10::multiply_integers(sizes.begin(), sizes.end() - 2);  // (N, C) planes
  auto idx = indices_local.reshape({slabs, sizes[sizes.size() - 2] * sizes.back()}).to(at::kLong);
  const auto plane = l.H * l.W;
  t.invalid = idx.numel() > 0 && (idx.min().item<int64_t>() < 0 || idx.max().item<int64_t>() >= plane);
  if (t.invalid) idx = idx.clamp(0, std::max<int64_t>(plane - 1, 0));
  auto row = at::floor_divide(idx, l.W), col = idx - row * l.W;
  const auto dl = dim_layout(*l.out_spec, l.m, idx.device());
  t.owner = owner_of(dl, row);
  auto e_owner = dl.extents_t.index_select(0, t.owner.flatten()).view_as(t.owner);
  auto start = dl.starts_t.index_select(0, t.owner.flatten()).view_as(t.owner);
  auto slab = at::arange(idx.size(0), idx.options()).unsqueeze(1);  // the (N, C) slab of each element
  t.slot = (slab * e_owner + (row - start)) * l.W + col;
  return t;
}

std::string out_of_range(const UnpoolLayout& l) {
  return c10::str("max_unpool2d(): found an invalid max index (an index outside the ", l.H, " x ", l.W,
                  " output plane)");
}

at::Tensor unpool_forward(const at::Tensor& self_in, const at::Tensor& indices, at::IntArrayRef output_size) {
  auto self = resolve_partial(self_in);
  const auto l = unpool_layout(self, output_size);
  const auto& mesh = l.self_spec->mesh;
  auto local = shard_impl(self)->local();
  auto idx = local_as(dispatch::as_shard(indices, mesh), mesh, l.self_spec->placements, l.self_spec->dim_extents());
  if (l.m < 0) {
    // The height whole: the local op (a rank whose batch or channel shard is empty has nothing to place; the kernel
    // refuses empty input).
    auto out = local.numel() == 0 ? at::zeros(l.out_spec->local_shape, local.options())
                                  : at::max_unpool2d(local, idx, output_size);
    return make_shard_tensor(out, l.out_spec);
  }
  auto t = targets_of(l, idx);
  auto [vals, slots] = route_elements(local.reshape({-1}), t.slot.reshape({-1, 1}), t.owner.flatten(), *mesh, l.m,
                                      "max_unpool2d along a sharded height (counts)", t.invalid, out_of_range(l));
  auto out = at::zeros(l.out_spec->local_shape, local.options());
  out.view(-1).index_copy_(0, slots.select(1, 0), vals);
  return make_shard_tensor(out, l.out_spec);
}

// The output gradient at the positions the pooled values went to: each rank asks the owners and receives them.
at::Tensor unpool_backward(const at::Tensor& grad_in, const at::Tensor& indices, const UnpoolLayout& l) {
  const auto& mesh = l.self_spec->mesh;
  auto g = local_as(resolve_partial(dispatch::as_shard(grad_in, mesh)), mesh, l.out_spec->placements,
                    l.out_spec->dim_extents());
  auto idx = local_as(dispatch::as_shard(indices, mesh), mesh, l.self_spec->placements, l.self_spec->dim_extents());
  auto t = targets_of(l, idx);
  const auto k = t.slot.numel();
  const auto me = mesh->coordinate(l.m);
  auto requests =
      at::stack({t.slot.flatten(), at::arange(k, t.slot.options()), at::full({k}, me, t.slot.options())}, 1);
  auto [unused, asked] = route_elements({}, requests, t.owner.flatten(), *mesh, l.m,
                                        "max_unpool2d backward (requests)", t.invalid, out_of_range(l));
  auto found = g.reshape({-1}).index_select(0, asked.select(1, 0));
  auto [got, where] = route_elements(found, asked.select(1, 1).unsqueeze(1), asked.select(1, 2), *mesh, l.m,
                                     "max_unpool2d backward (replies)");
  auto out = at::empty({k}, g.options());
  out.index_copy_(0, where.select(1, 0), got);
  return make_shard_tensor(out.view(idx.sizes()), l.self_spec);
}

struct MaxUnpoolFn : torch::autograd::Function<MaxUnpoolFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& self, const at::Tensor& indices,
                            std::vector<int64_t> output_size) {
    at::NoGradGuard no_grad;
    ctx->saved_data["output_size"] = output_size;
    ctx->save_for_backward({self, indices});
    return unpool_forward(self, indices, output_size);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(3);
    if (!grads[0].defined()) return out;
    at::NoGradGuard no_grad;
    auto saved = ctx->get_saved_variables();
    const auto output_size = ctx->saved_data["output_size"].toIntVector();
    const auto l = unpool_layout(saved[0], output_size);
    out[0] = l.m < 0 ? at::Tensor() : unpool_backward(grads[0], saved[1], l);
    return out;
  }
};

// max_unpool2d(Tensor self, Tensor indices, SymInt[2] output_size)
at::Tensor max_unpool2d_rule(const at::Tensor& self, const at::Tensor& indices, c10::SymIntArrayRef output_size) {
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(self), "ShardTensor max_unpool2d: the pooled values must be the ShardTensor");
  return unpool_forward(self, indices, C10_AS_INTARRAYREF_SLOW(output_size));
}

// Its autograd rule, for a pooled tensor split along its height that requires grad (the derivative formula would
// gather the output gradient at indices the owners of the rows do not hold).
bool max_unpool2d_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!at::GradMode::is_enabled() || !shard_impl(self) || !self.requires_grad() || self.dim() < 3) return false;
  // A sharded width declines inside (dispatch::not_implemented): the op's own formula then runs, whose forward
  // declines to the fallback.
  if (shard_impl(self)->spec()->mesh_dim_of(self.dim() - 2) < 0) return false;
  auto output_size = C10_AS_INTARRAYREF_SLOW(args["output_size"].toSymIntVector()).vec();
  auto out = MaxUnpoolFn::apply(self, args.tensor("indices"), output_size);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(max_unpool) {
  dispatch::set_handler("aten::max_unpool2d", typed_handler(&max_unpool2d_rule));
  dispatch::set_autograd_handler("aten::max_unpool2d", &max_unpool2d_autograd);
}

} // namespace shardtensor::ops
