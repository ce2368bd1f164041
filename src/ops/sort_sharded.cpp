// sort along a sharded dim (torch.sort, argsort and msort through it; Point Transformer V3's argsort of the points'
// space-filling-curve codes with the points split across ranks), and its gradient.
//
// Nothing whole along the dim on any rank. Each rank sorts its own rows by a key that orders as torch does (floats
// by their bits with NaN last and -0.0 = 0.0; a descending sort by the complemented key) and ties by original
// position (a stable sort). The global position of an element is the number of elements before it: those of its
// own block before it, plus, for every other block, those with a smaller key (and equal keys of lower ranks, whose
// original positions come first). The sorted blocks travel round the ring (the ring executor, comm/ring_loop.h: one
// block in flight at a time, never the whole dim) and each rank counts with a binary search into each block. The
// output keeps the input's layout (rank c holds sorted positions [off_c, off_c + e_c)), so each element then goes
// to the owner of its position: the counts of each pair of ranks in one small all-gather, the values and the
// (position, original index) pairs in one all-to-all each. The gradient is the inverse permutation: each
// gradient element goes home to the owner of its original index the same way.
//
// Also here: the order statistics (kthvalue, median.dim, nanmedian.dim) through that sort, and mode, which re-lays
// its input out with the dim whole instead (see mode_rule).
#include "ops/sort_sharded.h"
#include "ops/concrete_ints.h"

#include "comm/collectives.h"
#include "comm/ring_loop.h"
#include "comm/stat_reduce.h"
#include "comm/spec_holder.h"
#include "dispatch/args.h"
#include "ops/common.h"
#include "ops/element_routing.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>

#include <limits>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// int64 keys whose order is torch's sort order of `x` (ascending; complemented for a descending sort).
at::Tensor sort_keys(const at::Tensor& x, bool descending) {
  at::Tensor key;
  const auto t = x.scalar_type();
  if (at::isFloatingType(t)) {
    // Every float type converts to double exactly. NaNs become one positive NaN (above +inf, as torch sorts every
    // NaN), -0.0 becomes 0.0 (torch's sort ties them); then the bits of a negative double are flipped (but the sign)
    // so that int64 order is float order.
    auto d = x.to(at::kDouble);
    d = at::where(at::isnan(d), at::full({}, std::numeric_limits<double>::quiet_NaN(), d.options()), d).add_(0.0);
    auto bits = d.view(at::kLong);
    key = at::where(bits.lt(0), bits.bitwise_xor(std::numeric_limits<int64_t>::max()), bits);
  } else if (t == at::kBool || (at::isIntegralType(t, /*includeBool=*/false) && t != at::kUInt64)) {
    key = x.to(at::kLong);
  } else {
    dispatch::not_implemented(std::string("sort along a sharded dim of a ") + c10::toString(t) +
                              " tensor; redistribute that dim to Replicate() first");
  }
  return descending ? key.bitwise_not() : key;
}

// The owner of global positions `pos` along the dim and their flat position in its [B, e_owner] block (row b).
std::pair<at::Tensor, at::Tensor> owner_and_slot(const DimLayout& l, const at::Tensor& pos) {
  auto owner = owner_of(l, pos);
  auto row = at::arange(pos.size(0), pos.options()).unsqueeze(1);
  auto slot = row * l.extents_t.index_select(0, owner.flatten()).view_as(owner) + pos -
              l.starts_t.index_select(0, owner.flatten()).view_as(owner);
  return {owner, slot};
}

// `local` with `dim` moved last and the other dims flattened: [B, e].
struct Rows {
  at::Tensor x;
  std::vector<int64_t> moved_shape;
};

Rows rows_of(const at::Tensor& local, int64_t dim) {
  Rows r;
  auto moved = local.movedim(dim, -1).contiguous();
  r.moved_shape = moved.sizes().vec();
  const auto e = r.moved_shape.back();
  const auto B = c10::multiply_integers(r.moved_shape.begin(), r.moved_shape.end() - 1);
  r.x = moved.reshape({B, e});
  return r;
}

// `flat` back in the shape of `like` and in its strides, as torch's sort lays its outputs (and its gradient) out
// like its input: a view when they already agree (the dim last), else one copy. A moved-dim view would leave the
// ranks holding rows of the dim with other strides than a rank holding none, and a later local kernel that insists
// on contiguity (nll_loss2d's backward) would raise on some ranks only.
at::Tensor unrows(const at::Tensor& flat, const Rows& r, int64_t dim, const at::Tensor& like) {
  auto v = flat.reshape(r.moved_shape).movedim(-1, dim);
  if (v.strides() == like.strides()) return v;
  auto out = at::empty_like(like, flat.options(), c10::MemoryFormat::Preserve);
  out.copy_(v);
  return out;
}

// The gradient of the sorted values: each element back at its original index (the inverse permutation).
at::Tensor unsort(const at::Tensor& grad_local, const at::Tensor& indices_local, const ShardSpec& spec, int64_t dim) {
  const auto& mesh = *spec.mesh;
  const auto m = spec.mesh_dim_of(dim);
  auto g = rows_of(grad_local, dim);
  auto idx = rows_of(indices_local, dim).x;
  const auto l = dim_layout(spec, m, idx.device());
  auto [owner, slot] = owner_and_slot(l, idx);
  auto [vals, ints] = route_elements(g.x.flatten(), slot.reshape({-1, 1}), owner.flatten(), mesh, m,
                                     "the gradient of sort along a sharded dim (element counts)");
  auto out = at::empty({g.x.numel()}, g.x.options());
  out.index_copy_(0, ints.select(1, 0), vals);
  return unrows(out, g, dim, grad_local);
}

// The sorted values are linear in the input (the permutation fixed): the backward is the adjoint (each gradient
// back at its original index), whose own backward is the permutation's read again (a gather along the dim).
struct SortMap : LinearMap {
  SpecPtr spec;
  int64_t dim;
  at::Tensor indices;
  SortMap(SpecPtr s, int64_t d, at::Tensor i) : spec(std::move(s)), dim(d), indices(std::move(i)) {}
  at::Tensor apply(const at::Tensor& x) const override { return at::gather(grad_to_spec(x, spec), dim, indices); }
  at::Tensor adjoint(const at::Tensor& grad) const override {
    auto g = local_in(grad, spec->mesh, spec->placements, spec->dim_extents());
    return make_shard_tensor(unsort(g, shard_impl(indices)->local(), *spec, dim), spec);
  }
};

struct SortFn : torch::autograd::Function<SortFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& self, int64_t dim, bool descending) {
    auto [values, indices] = sort_sharded(self, dim, descending);
    ctx->saved_data["map"] =
        map_ivalue(c10::make_intrusive<SortMap>(without_partial(shard_impl(self)->spec()), dim, indices));
    ctx->mark_non_differentiable({indices});
    return {values, indices};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_map_backward(ctx, grads, 3);
  }
};

// The autograd rule of sort / sort.stable along a sharded dim (a ShardTensor that requires grad, grad mode on);
// otherwise the op's own derivative formula, whose scatter into a tensor whole along the dim this replaces.
bool sort_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!at::GradMode::is_enabled() || !shard_impl(self) || !self.requires_grad() || self.dim() == 0) return false;
  const auto dim = wrap_dim(args["dim"].toInt(), self.dim());
  if (shard_impl(self)->spec()->mesh_dim_of(dim) < 0) return false;
  auto out = SortFn::apply(self, dim, args["descending"].toBool());
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out[0]), std::move(out[1]));
  return true;
}

} // namespace

std::tuple<at::Tensor, at::Tensor> sort_sharded(const at::Tensor& self_in, int64_t dim, bool descending) {
  auto self = resolve_partial(self_in);
  auto spec = shard_impl(self)->spec();
  const auto& mesh = *spec->mesh;
  const auto m = spec->mesh_dim_of(dim);
  TORCH_INTERNAL_ASSERT(m >= 0, "sort_sharded along unsharded dim ", dim);
  const auto me = mesh.coordinate(m);
  const auto off = spec->offset_of(m, me);
  auto r = rows_of(shard_impl(self)->local(), dim);
  const auto B = r.x.size(0), e = r.x.size(1);
  auto keys = sort_keys(r.x, descending);
  auto [sorted_keys, perm] = keys.sort(/*stable=*/true, /*dim=*/1, /*descending=*/false);
  // Global positions: own elements before each (its rank in the block), then each visiting block's count.
  auto pos = at::arange(e, keys.options()).expand({B, e}).contiguous();
  comm::ring_loop(comm::Ring::along(mesh, m, 1, spec->extents[m]), {sorted_keys}, {},
                  [&](int64_t, int64_t owner, const std::vector<at::Tensor>& blocks, std::vector<at::Tensor>&) {
                    if (owner == me || B == 0 || e == 0 || blocks[0].size(1) == 0) return;
                    // Equal keys of lower ranks come first (their original positions are smaller).
                    pos.add_(at::searchsorted(blocks[0], sorted_keys, /*out_int32=*/false, /*right=*/owner < me));
                  });
  const auto l = dim_layout(*spec, m, pos.device());
  auto [owner, slot] = owner_and_slot(l, pos);
  auto values = r.x.gather(1, perm);
  auto ints = at::stack({slot.flatten(), perm.add(off).flatten()}, 1);
  auto [got_v, got_i] =
      route_elements(values.flatten(), ints, owner.flatten(), mesh, m, "sort along a sharded dim (element counts)");
  auto out_v = at::empty({B * e}, r.x.options());
  auto out_i = at::empty({B * e}, keys.options());
  out_v.index_copy_(0, got_i.select(1, 0), got_v);
  out_i.index_copy_(0, got_i.select(1, 0), got_i.select(1, 1));
  const auto& local = shard_impl(self)->local();
  return {make_shard_tensor(unrows(out_v, r, dim, local), spec), make_shard_tensor(unrows(out_i, r, dim, local), spec)};
}

namespace {

// ---- order statistics along a dim: kthvalue, median.dim, nanmedian.dim ----
// Along an unsharded dim: the local op on each rank's block. Along a sharded dim: the distributed sort above, then
// the element at each slice's target position (kthvalue: k - 1; median: the lower median, or the first NaN when the
// slice has one; nanmedian: the lower median of the non-NaN values, the first NaN when all are) is read by its owner
// and every rank's picks travel in one gathered collective (the NaN counts in one all-reduce first); each rank
// keeps its owner's. The result is whole along the mesh dim that sharded `dim`. Indices of NaNs and of tied values
// may differ from one device's (torch's selection does not define them); the gradient is selection_grad.cpp's.
enum class Order { kth, median, nanmedian };

// The layout of a reduction along `dim` that returns one value per slice: the input's, `dim` dropped (or kept as
// size 1) and whole.
struct ReducedLayout {
  Placements placements;
  DimExtents extents;
  std::vector<int64_t> shape;
};
ReducedLayout reduced_layout(const ShardSpec& spec, const at::Tensor& self, int64_t dim, bool keepdim) {
  ReducedLayout out{spec.placements, {}, self.sizes().vec()};
  for (size_t m = 0; m < out.placements.size(); ++m) {
    if (!out.placements[m].is_shard()) continue;
    const auto d = out.placements[m].dim;
    if (d == dim) {
      out.placements[m] = Placement::replicate();
      continue;
    }
    const auto od = keepdim || d < dim ? d : d - 1;
    out.placements[m] = Placement::shard(od);
    out.extents[od] = spec.extents[m];
  }
  if (self.dim() > 0) {
    if (keepdim) out.shape[dim] = 1;
    else out.shape.erase(out.shape.begin() + dim);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> order_statistic(Order kind, const at::Tensor& self_in, int64_t k, int64_t dim_arg,
                                                   bool keepdim) {
  auto self = resolve_partial(self_in);
  auto spec = shard_impl(self)->spec();
  const auto& mesh = *spec->mesh;
  const auto ndim = std::max<int64_t>(self.dim(), 1);
  const auto dim = wrap_dim(dim_arg, ndim);
  const auto L = self.dim() == 0 ? 1 : self.size(dim);
  const char* name = kind == Order::kth ? "kthvalue" : kind == Order::median ? "median" : "nanmedian";
  if (kind == Order::kth) {
    TORCH_CHECK_INDEX(k >= 1 && k <= L, "kthvalue(): selected number k out of range for dimension ", dim);
  } else {
    TORCH_CHECK_INDEX(L > 0, name, "(): Expected reduction dim ", dim, " to have non-zero size.");
  }
  const auto [out_p, out_ext, out_shape] = reduced_layout(*spec, self, dim, keepdim);
  const auto m = self.dim() == 0 ? -1 : spec->mesh_dim_of(dim);
  const auto& local = shard_impl(self)->local();
  if (m < 0) {
    std::tuple<at::Tensor, at::Tensor> r;
    switch (kind) {
      case Order::kth: r = at::kthvalue(local, k, dim, keepdim); break;
      case Order::median: r = at::median(local, dim, keepdim); break;
      case Order::nanmedian: r = at::nanmedian(local, dim, keepdim); break;
    }
    return {wrap(std::get<0>(r), spec->mesh, out_p, out_shape, out_ext),
            wrap(std::get<1>(r), spec->mesh, out_p, out_shape, out_ext)};
  }
  // Each slice's target position along the dim.
  auto slice_shape = local.sizes().vec();
  slice_shape[dim] = 1;
  at::Tensor pos;
  if (kind == Order::kth) {
    pos = at::full(slice_shape, k - 1, local.options().dtype(at::kLong));
  } else {
    auto nans = at::isnan(local).sum(dim, /*keepdim=*/true).to(at::kLong);
    nans = comm::all_reduce(nans, ReduceOp::Sum, mesh, m);
    auto valid = L - nans;
    pos = kind == Order::median ? at::where(nans > 0, valid, at::floor_divide(valid - 1, 2))
                                : at::where(valid > 0, at::floor_divide(valid - 1, 2), at::zeros_like(valid));
  }
  auto [values, indices] = sort_sharded(self, dim, /*descending=*/false);
  const auto me = mesh.coordinate(m), off = spec->offset_of(m, me), e = spec->extents[m][me];
  auto at_pos = (pos - off).clamp(0, std::max<int64_t>(e - 1, 0));
  at::Tensor pv, pi;
  if (e > 0) {
    pv = shard_impl(values)->local().gather(dim, at_pos);
    pi = shard_impl(indices)->local().gather(dim, at_pos);
  } else {
    pv = at::zeros(slice_shape, local.options());
    pi = at::zeros(slice_shape, local.options().dtype(at::kLong));
  }
  comm::StatReduce r;
  const auto gv = r.gathered(pv), gi = r.gathered(pi);
  r.run(mesh, {m});
  // Each slice's owner: the coordinate whose range holds its position.
  const auto l = dim_layout(*spec, m, pos.device());
  auto owner = owner_of(l, pos).unsqueeze(0);
  auto v = r.result(gv)[0].gather(0, owner).squeeze(0), i = r.result(gi)[0].gather(0, owner).squeeze(0);
  if (!keepdim) {
    v = v.squeeze(dim);
    i = i.squeeze(dim);
  }
  return {wrap(v, spec->mesh, out_p, out_shape, out_ext), wrap(i, spec->mesh, out_p, out_shape, out_ext)};
}

// kthvalue(Tensor self, SymInt k, int dim=-1, bool keepdim=False)
std::tuple<at::Tensor, at::Tensor> kthvalue_rule(const at::Tensor& self, c10::SymInt k, int64_t dim, bool keepdim) {
  return order_statistic(Order::kth, self, concrete_int(k), dim, keepdim);
}
// median.dim(Tensor self, int dim, bool keepdim=False)
std::tuple<at::Tensor, at::Tensor> median_dim_rule(const at::Tensor& self, int64_t dim, bool keepdim) {
  return order_statistic(Order::median, self, 0, dim, keepdim);
}
// nanmedian.dim(Tensor self, int dim, bool keepdim=False)
std::tuple<at::Tensor, at::Tensor> nanmedian_dim_rule(const at::Tensor& self, int64_t dim, bool keepdim) {
  return order_statistic(Order::nanmedian, self, 0, dim, keepdim);
}

// mode(Tensor self, int dim=-1, bool keepdim=False): the most frequent value of each slice along `dim` and an index of
// it. Along an unsharded dim: the local op on each rank's block. Along a sharded dim the counts need whole slices:
// the input is re-laid out so that `dim` is whole and the largest other unsharded dim (at least as large as that mesh
// dim) takes its split — one all-to-all of the input's size, not a gather —, then the local op; the result is split
// along that dim. With no such dim (a 1-D input) it declines.
std::tuple<at::Tensor, at::Tensor> mode_rule(const at::Tensor& self_in, int64_t dim_arg, bool keepdim) {
  auto self = resolve_partial(self_in);
  auto spec = shard_impl(self)->spec();
  const auto dim = wrap_dim(dim_arg, std::max<int64_t>(self.dim(), 1));
  if (self.dim() > 0 && spec->mesh_dim_of(dim) >= 0) {
    auto moved = split_moved_off(self, dim);
    if (!moved)
      dispatch::not_implemented(c10::str("mode along sharded dim ", dim, " with no other unsharded dim of at least ",
                                         spec->mesh->size(spec->mesh_dim_of(dim)), " elements to take its split; "
                                         "redistribute dim ", dim, " to Replicate()"));
    self = *moved;
    spec = shard_impl(self)->spec();
  }
  const auto [out_p, out_ext, out_shape] = reduced_layout(*spec, self, dim, keepdim);
  auto [values, indices] = at::mode(shard_impl(self)->local(), dim, keepdim);
  return {wrap(values, spec->mesh, out_p, out_shape, out_ext), wrap(indices, spec->mesh, out_p, out_shape, out_ext)};
}

// median(Tensor self) / nanmedian(Tensor self): over every element, the dim form over the flattened tensor (the
// view rules lay it out; an empty tensor, whose median is NaN, declines to the fallback).
at::Tensor median_all(const at::Tensor& self, bool ignore_nan) {
  if (self.numel() == 0) dispatch::not_implemented("the median of an empty tensor");
  auto flat = at::reshape(self, {-1});
  return std::get<0>(ignore_nan ? at::nanmedian(flat, 0) : at::median(flat, 0));
}
at::Tensor median_rule(const at::Tensor& self) {
  return median_all(self, false);
}
at::Tensor nanmedian_rule(const at::Tensor& self) {
  return median_all(self, true);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(sort_sharded) {
  dispatch::set_handler("aten::median", typed_handler(&median_rule));
  dispatch::set_handler("aten::nanmedian", typed_handler(&nanmedian_rule));
  for (const char* name : {"aten::sort", "aten::sort.stable"}) dispatch::set_autograd_handler(name, &sort_autograd);
  dispatch::set_handler("aten::kthvalue", typed_handler(&kthvalue_rule));
  dispatch::set_handler("aten::median.dim", typed_handler(&median_dim_rule));
  dispatch::set_handler("aten::nanmedian.dim", typed_handler(&nanmedian_dim_rule));
  dispatch::set_handler("aten::mode", typed_handler(&mode_rule));
}

} // namespace shardtensor::ops
