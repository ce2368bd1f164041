// Writes addressed by global element positions: masked_scatter(_) (the k-th selected element, in row-major order,
// takes source[k]), put(_) (flat row-major indices) and index_fill(_) (indices along one dim); and the reads of
// their backward formulas, take and masked_scatter_backward (a Partial sum of each rank's positions). They are the
// backward formulas of masked_select, take and trace (which run through the gather fallback) and user ops of their
// own. A rank writes the positions of its own block: the indices (or the mask's running count) are global and read
// whole, the values come from the whole source, and nothing is sent. Index and mask tensors that are sharded are
// gathered (integers and bools: what the single-device op reads too); a plain written tensor takes the full
// values. A Partial written tensor raises (a pending sum cannot take a write).
#include "comm/halo.h"
#include "comm/redistribute.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"

namespace shardtensor::ops {

namespace {

// The whole value of `t` (a ShardTensor gathered and completed; a plain tensor as it is).
at::Tensor whole(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  if (!impl) return t;
  return shard_impl(redistribute_to(t, dispatch::replicate_spec(impl->spec()->mesh, t.sizes())))->local();
}

// The written ShardTensor's local tensor and the range [begin, begin + extent) it holds of every dim.
struct Block {
  at::Tensor local;
  std::vector<int64_t> begin;
};

Block block_of(const at::Tensor& self, const char* op) {
  const auto& spec = *shard_impl(self)->spec();
  if (spec.has_partial())
    not_implemented(std::string(op) + " writes into a Partial (pending sum) tensor; complete it first "
                    "(redistribute to Replicate())");
  Block b{shard_impl(self)->local(), std::vector<int64_t>(self.dim(), 0)};
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_shard())
      b.begin[spec.placements[m].dim] = spec.offset_of(static_cast<int64_t>(m), spec.mesh->coordinate(static_cast<int64_t>(m)));
  return b;
}

// `full` (a tensor of the written tensor's global shape) restricted to this rank's block.
at::Tensor narrow_to(at::Tensor full, const Block& b) {
  for (int64_t d = 0; d < full.dim(); ++d)
    if (b.local.size(d) != full.size(d)) full = full.narrow(d, b.begin[d], b.local.size(d));
  return full;
}

// The functional forms: a copy of `self` (laid out as `self`, or Replicate when `self` is plain: then one of
// `a`, `b` is a ShardTensor), written in place.
at::Tensor fresh_copy(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b) {
  if (shard_impl(self)) return resolve_partial(self).clone();
  return dispatch::as_shard(self.clone(), shard_impl(shard_impl(a) ? a : b)->spec()->mesh);
}

// The source elements at this rank's positions (`take`, in its block's row-major order) routed from their owners,
// when the source is split along its leading dim by one mesh dim m and nothing else (a masked_select result kept
// split -- a field split on its batch, the selection each rank's block -- whose gradient masked_select's backward
// scatters back into zeros laid out like the field): every rank of an m group receives only the elements its block
// takes (one neighbour exchange; none leaves a rank whose block takes its own rows), not the whole source. The
// requests of every coordinate along m come from the whole mask and the specs, so every rank builds the same plan.
// nullopt for other layouts (the whole source is read).
std::optional<at::Tensor> routed_source(const at::Tensor& self, const at::Tensor& source, const at::Tensor& full_mask,
                                        const at::Tensor& pos) {
  auto* si = shard_impl(source);
  if (!si || source.dim() == 0) return std::nullopt;
  const auto& ss = *si->spec();
  const auto& spec = *shard_impl(self)->spec();
  if (ss.has_partial() || !ss.mesh->same_as(*spec.mesh)) return std::nullopt;
  int64_t m = -1;
  for (size_t k = 0; k < ss.placements.size(); ++k) {
    if (!ss.placements[k].is_shard()) continue;
    if (m >= 0 || !ss.placements[k].is_shard(0)) return std::nullopt;
    m = static_cast<int64_t>(k);
  }
  if (m < 0) return std::nullopt;
  const auto& mesh = *spec.mesh;
  const auto n = mesh.size(m);
  const int64_t inner = source.size(0) == 0 ? 0 : source.numel() / source.size(0);
  std::vector<int64_t> flat_extents(ss.extents[m].begin(), ss.extents[m].end());
  for (auto& e : flat_extents) e *= inner;
  comm::RowRequests want(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) {
    // The block of the rank at coordinate c along m (this rank's coordinates on the other mesh dims).
    auto block_mask = full_mask;
    auto block_pos = pos;
    for (size_t k = 0; k < spec.placements.size(); ++k) {
      if (!spec.placements[k].is_shard()) continue;
      const auto mk = static_cast<int64_t>(k);
      const auto coord = mk == m ? c : mesh.coordinate(mk);
      const auto d = spec.placements[k].dim;
      const auto begin = spec.offset_of(mk, coord), extent = spec.extents[k][coord];
      block_mask = block_mask.narrow(d, begin, extent);
      block_pos = block_pos.narrow(d, begin, extent);
    }
    auto taken = block_pos.masked_select(block_mask).contiguous();
    want[c].assign(taken.data_ptr<int64_t>(), taken.data_ptr<int64_t>() + taken.numel());
  }
  return comm::gather_rows(si->local().reshape({-1}), 0, flat_extents, want, mesh, m);
}

// masked_scatter_(Tensor(a!) self, Tensor mask, Tensor source) -> Tensor(a!)
at::Tensor& masked_scatter_rule(at::Tensor& self, const at::Tensor& mask_in, const at::Tensor& source_in) {
  auto mask = whole(mask_in);
  TORCH_CHECK_VALUE(mask.scalar_type() == at::kBool, "masked_scatter_ only supports boolean masks, but got mask "
                    "with dtype ", mask.scalar_type());
  if (!shard_impl(self)) return self.masked_scatter_(mask, whole(source_in));
  auto b = block_of(self, "masked_scatter_");
  auto full_mask = mask.expand(self.sizes());
  // The index into source of every selected element: the running count of the mask in row-major order.
  auto pos = full_mask.reshape({-1}).cumsum(0, at::kLong).sub_(1).view(self.sizes());
  const auto selected = self.numel() == 0 ? 0 : pos.reshape({-1})[-1].item<int64_t>() + 1;
  TORCH_CHECK_VALUE(source_in.numel() >= selected, "masked_scatter_: expected source to have at least ", selected,
                    " elements (the number of true mask entries), but got ", source_in.numel());
  auto local_mask = narrow_to(full_mask, b);
  if (auto routed = routed_source(self, source_in, full_mask, pos)) {
    b.local.masked_scatter_(local_mask, *routed);
    return self;
  }
  auto take = narrow_to(pos, b).masked_select(local_mask);
  b.local.masked_scatter_(local_mask, whole(source_in).reshape({-1}).index_select(0, take));
  return self;
}

// masked_scatter(Tensor self, Tensor mask, Tensor source) -> Tensor
at::Tensor masked_scatter_functional_rule(const at::Tensor& self, const at::Tensor& mask, const at::Tensor& source) {
  // The functional form broadcasts self and mask together (the in-place one only the mask to self).
  const auto shape = at::infer_size(self.sizes(), mask.sizes());
  auto out = fresh_copy(self.sizes() == c10::IntArrayRef(shape) ? self : self.expand(shape), mask, source);
  return masked_scatter_rule(out, mask, source);
}

// masked_scatter_backward(Tensor grad_output, Tensor mask, SymInt[] sizes) -> Tensor: the source's gradient, the
// selected gradient elements in row-major order (zeros after them). Each rank places its own block's selected
// elements at their running-count positions: a Partial(sum) over the mesh dims that shard the gradient.
at::Tensor masked_scatter_backward_rule(const at::Tensor& grad_output, const at::Tensor& mask_in,
                                        c10::SymIntArrayRef sizes_in) {
  const auto sizes = concrete_ints(sizes_in);
  auto grad = resolve_partial(grad_output);
  const auto& spec = *shard_impl(grad)->spec();
  auto b = block_of(grad, "masked_scatter_backward");
  auto full_mask = whole(mask_in).expand(grad.sizes());
  auto pos = full_mask.reshape({-1}).cumsum(0, at::kLong).sub_(1).view(grad.sizes());
  auto local_mask = narrow_to(full_mask, b);
  int64_t numel = 1;
  for (auto v : sizes) numel *= v;
  auto out = at::zeros({numel}, b.local.options());
  out.index_put_({narrow_to(pos, b).masked_select(local_mask)}, b.local.masked_select(local_mask));
  Placements pl(spec.placements.size(), Placement::replicate());
  for (size_t m = 0; m < pl.size(); ++m)
    if (spec.placements[m].is_shard()) pl[m] = Placement::partial(ReduceOp::Sum);
  return wrap(out.view(sizes), spec.mesh, pl, sizes, {});
}

// Flat global positions (negative counted from the end, checked in range): which lie in this rank's block, and
// their flat positions in the local tensor.
std::pair<at::Tensor, at::Tensor> local_positions(const at::Tensor& self, const Block& b, const at::Tensor& index) {
  const auto n = self.numel();
  if (index.numel() > 0) {
    const bool in_range = ((index >= -n) & (index < n)).all().item<bool>();
    TORCH_CHECK_INDEX(in_range, "index out of range for a tensor of ", n, " elements");
  }
  auto rest = at::where(index < 0, index + n, index);
  auto mine = at::ones_like(rest, rest.options().dtype(at::kBool));
  auto local_flat = at::zeros_like(rest);
  int64_t local_stride = 1;
  for (int64_t d = self.dim() - 1; d >= 0; --d) {
    const auto size = self.size(d);
    if (size == 0) break;
    auto coord = rest.remainder(size);
    rest = rest.div(size, "floor");
    const auto e = b.local.size(d);
    mine &= (coord >= b.begin[d]) & (coord < b.begin[d] + e);
    local_flat += (coord - b.begin[d]) * local_stride;
    local_stride *= e;
  }
  return {mine, local_flat};
}

// put_(Tensor(a!) self, Tensor index, Tensor source, bool accumulate=False) -> Tensor(a!)
at::Tensor& put_rule(at::Tensor& self, const at::Tensor& index_in, const at::Tensor& source_in, bool accumulate) {
  auto index = whole(index_in).reshape({-1});
  auto source = whole(source_in).reshape({-1});
  TORCH_CHECK_VALUE(index.scalar_type() == at::kLong, "put_(): Expected a long tensor for index, but got ",
                    index.scalar_type());
  TORCH_CHECK_VALUE(index.numel() == source.numel(), "put_(): Expected source and index to have the same number of "
                    "elements, but got source.numel() = ", source.numel(), ", index.numel() = ", index.numel());
  if (!shard_impl(self)) return self.put_(index, source, accumulate);
  auto b = block_of(self, "put_");
  auto [mine, local_flat] = local_positions(self, b, index);
  b.local.put_(local_flat.masked_select(mine), source.masked_select(mine), accumulate);
  return self;
}

// put(Tensor self, Tensor index, Tensor source, bool accumulate=False) -> Tensor
at::Tensor put_functional_rule(const at::Tensor& self, const at::Tensor& index, const at::Tensor& source,
                               bool accumulate) {
  auto out = fresh_copy(self, index, source);
  return put_rule(out, index, source, accumulate);
}

// take(Tensor self, Tensor index) -> Tensor (put's source gradient): each rank reads the positions in its block
// (zeros elsewhere), a Partial(sum) over the mesh dims that shard `self`, shaped like the index.
at::Tensor take_rule(const at::Tensor& self_in, const at::Tensor& index_in) {
  auto index = whole(index_in);
  TORCH_CHECK_VALUE(index.scalar_type() == at::kLong, "take(): Expected a long tensor for index, but got ",
                    index.scalar_type());
  auto self = resolve_partial(self_in);
  const auto& spec = *shard_impl(self)->spec();
  auto b = block_of(self, "take");
  auto flat = index.reshape({-1});
  auto [mine, local_flat] = local_positions(self, b, flat);
  auto values = b.local.numel() == 0
      ? at::zeros({flat.numel()}, b.local.options())
      : b.local.reshape({-1}).index_select(0, local_flat.masked_fill(~mine, 0)).masked_fill(~mine, 0);
  Placements pl(spec.placements.size(), Placement::replicate());
  for (size_t m = 0; m < pl.size(); ++m)
    if (spec.placements[m].is_shard()) pl[m] = Placement::partial(ReduceOp::Sum);
  return wrap(values.view(index.sizes()), spec.mesh, pl, index.sizes().vec(), {});
}

// index_fill_ along `dim` with `fill` (a Scalar, or a 0-d tensor already made whole).
template <typename Fill>
at::Tensor& index_fill_impl(at::Tensor& self, int64_t dim_in, const at::Tensor& index_in, const Fill& fill) {
  auto index = whole(index_in);
  if (!shard_impl(self)) return self.index_fill_(dim_in, index, fill);
  auto b = block_of(self, "index_fill_");
  const auto dim = self.dim() == 0 ? 0 : wrap_dim(dim_in, self.dim());
  const auto& spec = *shard_impl(self)->spec();
  if (self.dim() == 0 || spec.mesh_dim_of(dim) < 0) {
    b.local.index_fill_(dim, index, fill);
    return self;
  }
  const auto L = self.size(dim);
  auto idx = index.reshape({-1});
  if (idx.numel() > 0) {
    const bool in_range = ((idx >= -L) & (idx < L)).all().item<bool>();
    TORCH_CHECK_INDEX(in_range, "index_fill_(): index out of range for dimension ", dim, " of size ", L);
  }
  idx = at::where(idx < 0, idx + L, idx);
  auto sel = (idx >= b.begin[dim]) & (idx < b.begin[dim] + b.local.size(dim));
  b.local.index_fill_(dim, idx.masked_select(sel) - b.begin[dim], fill);
  return self;
}

// index_fill_.int_Tensor(Tensor(a!) self, int dim, Tensor index, Tensor value) -> Tensor(a!)
at::Tensor& index_fill_tensor_rule(at::Tensor& self, int64_t dim, const at::Tensor& index, const at::Tensor& value) {
  return index_fill_impl(self, dim, index, whole(value));
}

// index_fill_.int_Scalar(Tensor(a!) self, int dim, Tensor index, Scalar value) -> Tensor(a!)
at::Tensor& index_fill_scalar_rule(at::Tensor& self, int64_t dim, const at::Tensor& index, const at::Scalar& value) {
  return index_fill_impl(self, dim, index, value);
}

// index_fill.int_Tensor(Tensor self, int dim, Tensor index, Tensor value) -> Tensor
at::Tensor index_fill_tensor_functional_rule(const at::Tensor& self, int64_t dim, const at::Tensor& index,
                                             const at::Tensor& value) {
  auto out = fresh_copy(self, value, index);
  return index_fill_tensor_rule(out, dim, index, value);
}

// index_fill.int_Scalar(Tensor self, int dim, Tensor index, Scalar value) -> Tensor
at::Tensor index_fill_scalar_functional_rule(const at::Tensor& self, int64_t dim, const at::Tensor& index,
                                             const at::Scalar& value) {
  auto out = fresh_copy(self, index, index);
  return index_fill_scalar_rule(out, dim, index, value);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(position_writes) {
  dispatch::set_handler("aten::masked_scatter_", typed_handler(&masked_scatter_rule));
  dispatch::set_handler("aten::masked_scatter", typed_handler(&masked_scatter_functional_rule));
  dispatch::set_handler("aten::masked_scatter_backward", typed_handler(&masked_scatter_backward_rule));
  dispatch::set_handler("aten::put_", typed_handler(&put_rule));
  dispatch::set_handler("aten::put", typed_handler(&put_functional_rule));
  dispatch::set_handler("aten::take", typed_handler(&take_rule));
  dispatch::set_handler("aten::index_fill_.int_Tensor", typed_handler(&index_fill_tensor_rule));
  dispatch::set_handler("aten::index_fill_.int_Scalar", typed_handler(&index_fill_scalar_rule));
  dispatch::set_handler("aten::index_fill.int_Tensor", typed_handler(&index_fill_tensor_functional_rule));
  dispatch::set_handler("aten::index_fill.int_Scalar", typed_handler(&index_fill_scalar_functional_rule));
}

} // namespace shardtensor::ops
