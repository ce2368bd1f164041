// embedding_bag (`F.embedding_bag`, `nn.EmbeddingBag`: `_embedding_bag`, `_embedding_bag_forward_only` and the
// backward kernels `_embedding_bag_dense_backward`, `_embedding_bag_per_sample_weights_backward`) with the indices
// split into whole bags. F.embedding_bag flattens a 2-D [bags, L] input to 1-D with offsets every L, so a batch of
// bags split along its rows arrives as 1-D indices split at bag boundaries: each rank reduces its own bags (sum, mean,
// max, per-sample weights, padding_idx: aten's kernel on its indices with its offsets shifted to them) and the output
// rows are its bags -- no communication. The table replicated or split along its embedding dim (each rank its
// columns). The backward: each rank's table gradient from its own bags, a Partial(sum) over the mesh dim that splits
// the indices; the per-sample weights' gradient laid out like the indices. A bag that crosses a shard boundary, a
// table split along its rows, and the gradient options that need every index (scale_grad_by_freq, sparse) decline to
// the fallback.
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/describe.h"

namespace shardtensor::ops {

namespace {

// How the bags fall on the ranks: the offsets read whole (a few integers per bag), the indices' own split.
struct BagSplit {
  MeshPtr mesh;
  SpecPtr index_spec;                 // the indices' layout (1-D)
  int64_t index_mesh_dim = -1;        // the mesh dim that splits the indices, or -1
  std::vector<int64_t> bag_extents;   // bags per coordinate along index_mesh_dim
  int64_t first_bag = 0, bags = 0;    // this rank's bags: [first_bag, first_bag + bags)
  at::Tensor local_offsets;           // this rank's offsets, shifted to its indices
  int64_t total_bags = 0;
};

[[noreturn]] void decline(const char* op, const at::Tensor& weight, const at::Tensor& indices, const std::string& why) {
  dispatch::not_implemented(
      c10::str(op, " with weight ", describe_spec(weight), " and indices ", describe_spec(indices), ": ", why));
}

BagSplit split_bags(const char* op, const MeshPtr& mesh, const at::Tensor& weight, const at::Tensor& indices,
                    const at::Tensor& offsets, bool include_last_offset) {
  BagSplit s;
  s.mesh = mesh;
  auto idx = resolve_partial(dispatch::as_shard(indices, mesh));
  s.index_spec = shard_impl(idx)->spec();
  const auto& spec = *s.index_spec;
  if (spec.ndim() != 1) decline(op, weight, indices, "the indices must be 1-D (F.embedding_bag flattens 2-D ones)");
  s.index_mesh_dim = spec.mesh_dim_of(0);
  const int64_t n = spec.global_shape[0];
  auto whole = whole_value(offsets);
  TORCH_CHECK_VALUE(whole.dim() == 1, op, ": offsets has to be a 1D Tensor, got ", whole.sizes());
  auto off = whole.to(at::kCPU, at::kLong).contiguous();
  const auto* o = off.const_data_ptr<int64_t>();
  const int64_t count = off.numel();
  s.total_bags = include_last_offset ? std::max<int64_t>(count - 1, 0) : count;
  TORCH_CHECK_VALUE(count == 0 || o[0] == 0, op, ": offsets[0] has to be 0, i.e., the first sequence in the ",
                    "mini-batch has to start from position 0. However, got ", count ? o[0] : 0);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK_VALUE(o[i] <= n, op, ": offsets[", i, "] = ", o[i], " is beyond the input's length ", n);
    TORCH_CHECK_VALUE(i == 0 || o[i] >= o[i - 1], op, ": offsets must not decrease, got offsets[", i - 1, "] = ",
                      o[i - 1], " and offsets[", i, "] = ", o[i]);
  }
  // The end of bag b (its start's successor; the last bag without include_last_offset ends with the input).
  auto end_of = [&](int64_t b) { return b + 1 < count ? o[b + 1] : n; };
  const auto device = shard_impl(idx)->local().device();
  if (s.index_mesh_dim < 0) {
    s.bags = s.total_bags;
    s.local_offsets = whole.to(device);
    return s;
  }
  const auto& ext = spec.extents[s.index_mesh_dim];
  const auto coords = static_cast<int64_t>(ext.size());
  s.bag_extents.assign(coords, 0);
  // Bag b belongs to the rank whose indices hold its start (a bag starting at the input's end: the last rank); every
  // index of the bag must be there too.
  int64_t r = 0, start = 0;
  for (int64_t b = 0; b < s.total_bags; ++b) {
    while (r + 1 < coords && !(o[b] < start + ext[r])) start += ext[r++];
    if (end_of(b) > start + ext[r])
      decline(op, weight, indices,
              c10::str("bag ", b, " (indices ", o[b], " to ", end_of(b), ") crosses a shard boundary (at ",
                       start + ext[r], "); split the indices at bag boundaries (a 2-D input split along its bags "
                       "does), or redistribute them to Replicate()"));
    ++s.bag_extents[r];
  }
  const auto me = spec.mesh->coordinate(s.index_mesh_dim);
  for (int64_t c = 0; c < me; ++c) s.first_bag += s.bag_extents[c];
  s.bags = s.bag_extents[me];
  const auto my_start = spec.offset_of(s.index_mesh_dim, me);
  auto local = off.narrow(0, s.first_bag, s.bags + (include_last_offset && s.bags > 0 ? 1 : 0)).sub(my_start);
  s.local_offsets = local.to(whole.scalar_type()).to(device);
  return s;
}

// The table's layout: replicated, or split along its embedding dim by mesh dims that do not split the indices.
at::Tensor local_table(const char* op, const at::Tensor& weight, const at::Tensor& indices, const BagSplit& s,
                       Placements& column_pl, DimExtents& column_ext) {
  column_pl.assign(s.mesh->ndim(), Placement::replicate());
  if (!shard_impl(weight)) return weight;
  auto w = resolve_partial(weight);
  const auto& wspec = *shard_impl(w)->spec();
  for (int64_t m = 0; m < s.mesh->ndim(); ++m) {
    if (!wspec.placements[m].is_shard()) continue;
    if (wspec.placements[m].dim == 0)
      decline(op, weight, indices, "the table's rows are split (split its embedding dim, or redistribute it)");
    if (m == s.index_mesh_dim)
      decline(op, weight, indices,
              "one mesh dim splits both the table's columns and the indices (split them on different mesh dims, or "
              "redistribute one of them to Replicate())");
    column_pl[m] = Placement::shard(1);
    column_ext[1] = wspec.extents[m];
  }
  return shard_impl(w)->local();
}

// Placements of a per-bag result ([bags] or [bags, D]): Shard(0) where the indices are split, the table's column
// splits on dim 1 when `with_columns`.
std::pair<Placements, DimExtents> bag_layout(const BagSplit& s, const Placements& column_pl,
                                             const DimExtents& column_ext, bool with_columns) {
  Placements pl = with_columns ? column_pl : Placements(s.mesh->ndim(), Placement::replicate());
  DimExtents ext = with_columns ? column_ext : DimExtents{};
  if (s.index_mesh_dim >= 0) {
    pl[s.index_mesh_dim] = Placement::shard(0);
    ext[0] = s.bag_extents;
  }
  return {pl, ext};
}

using BagResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

BagResult bag_forward(const char* op, bool forward_only, const at::Tensor& weight, const at::Tensor& indices,
                      const at::Tensor& offsets, bool scale_grad_by_freq, int64_t mode, bool sparse,
                      const std::optional<at::Tensor>& per_sample_weights, bool include_last_offset,
                      int64_t padding_idx) {
  const auto psw = per_sample_weights.value_or(at::Tensor());
  auto mesh = dispatch::common_mesh(op, {weight, indices, offsets, psw});
  auto s = split_bags(op, mesh, weight, indices, offsets, include_last_offset);
  if (s.index_mesh_dim >= 0 && (scale_grad_by_freq || sparse))
    decline(op, weight, indices, "scale_grad_by_freq and sparse gradients count every index of the table");
  Placements column_pl;
  DimExtents column_ext;
  auto w = local_table(op, weight, indices, s, column_pl, column_ext);
  const auto& ispec = *s.index_spec;
  auto idx = local_in(indices, mesh, ispec.placements, ispec.dim_extents());
  std::optional<at::Tensor> psw_local;
  if (psw.defined()) psw_local = local_in(psw, mesh, ispec.placements, ispec.dim_extents());
  const auto index_type = at::promote_types(idx.scalar_type(), s.local_offsets.scalar_type());
  at::Tensor out, o2b, bag_size, max_indices;
  if (s.bags > 0) {
    auto r = forward_only ? at::_embedding_bag_forward_only(w, idx, s.local_offsets, scale_grad_by_freq, mode, sparse,
                                                            psw_local, include_last_offset, padding_idx)
                          : at::_embedding_bag(w, idx, s.local_offsets, scale_grad_by_freq, mode, sparse, psw_local,
                                               include_last_offset, padding_idx);
    std::tie(out, o2b, bag_size, max_indices) = r;
  } else {  // no bag here (more ranks than bags): aten's kernel refuses indices without offsets
    out = at::zeros({0, w.size(1)}, w.options());
    bag_size = at::zeros({0}, idx.options().dtype(index_type));
    max_indices = mode == 2 ? at::zeros({0, w.size(1)}, bag_size.options()) : bag_size.clone();
    o2b = at::zeros({idx.numel()}, bag_size.options());
  }
  // aten's CPU fast path (sum mode) leaves offset2bag empty; its backward then rebuilds it from the offsets. Here it
  // is always one bag id per index, in global bag numbers, laid out like the indices: the backward rules read it.
  if (o2b.numel() != idx.numel()) {
    auto positions = at::arange(idx.numel(), s.local_offsets.options().dtype(at::kLong));
    auto starts = include_last_offset ? s.local_offsets.narrow(0, 0, s.bags) : s.local_offsets;
    o2b = at::searchsorted(starts.to(at::kLong), positions, /*out_int32=*/false, /*right=*/true)
              .sub(1)
              .clamp_min(0)
              .to(index_type);
  }
  if (s.first_bag) o2b = o2b.add(s.first_bag);
  const auto d = weight.size(1);
  auto [rows_pl, rows_ext] = bag_layout(s, column_pl, column_ext, true);
  auto [bag_pl, bag_ext] = bag_layout(s, column_pl, column_ext, false);
  const auto b = s.total_bags;
  auto max_out = mode == 2 ? wrap(max_indices, mesh, rows_pl, {b, d}, rows_ext)
                           : wrap(max_indices, mesh, bag_pl, {b}, bag_ext);
  return {wrap(out, mesh, rows_pl, {b, d}, rows_ext),
          wrap(o2b, mesh, ispec.placements, {ispec.global_shape[0]}, ispec.dim_extents()),
          wrap(bag_size, mesh, bag_pl, {b}, bag_ext), max_out};
}

// _embedding_bag(Tensor weight, Tensor indices, Tensor offsets, bool scale_grad_by_freq=False, int mode=0,
//                bool sparse=False, Tensor? per_sample_weights=None, bool include_last_offset=False,
//                int padding_idx=-1) -> (Tensor, Tensor, Tensor, Tensor)
BagResult embedding_bag_rule(const at::Tensor& weight, const at::Tensor& indices, const at::Tensor& offsets,
                             bool scale_grad_by_freq, int64_t mode, bool sparse,
                             const std::optional<at::Tensor>& per_sample_weights, bool include_last_offset,
                             int64_t padding_idx) {
  return bag_forward("aten::_embedding_bag", false, weight, indices, offsets, scale_grad_by_freq, mode, sparse,
                     per_sample_weights, include_last_offset, padding_idx);
}

BagResult embedding_bag_forward_only_rule(const at::Tensor& weight, const at::Tensor& indices,
                                          const at::Tensor& offsets, bool scale_grad_by_freq, int64_t mode,
                                          bool sparse, const std::optional<at::Tensor>& per_sample_weights,
                                          bool include_last_offset, int64_t padding_idx) {
  return bag_forward("aten::_embedding_bag_forward_only", true, weight, indices, offsets, scale_grad_by_freq, mode,
                     sparse, per_sample_weights, include_last_offset, padding_idx);
}

// The bag layout of a backward call, from the forward's per-bag result (`bag_size`, laid out by bag_forward): its
// mesh dim splitting the bags and their extents. Plain (the forward ran on whole indices): nothing split.
struct BackwardBags {
  int64_t mesh_dim = -1;
  std::vector<int64_t> extents;
  int64_t first_bag = 0;
};

BackwardBags backward_bags(const char* op, const at::Tensor& bag_size, const SpecPtr& index_spec) {
  BackwardBags b;
  b.mesh_dim = index_spec->mesh_dim_of(0);
  if (b.mesh_dim < 0) return b;
  auto* bi = shard_impl(bag_size);
  // Not the forward rule's layout: its forward ran through the fallback (a bag across ranks), and so does this.
  if (!bi || bi->spec()->mesh_dim_of(0) != b.mesh_dim)
    dispatch::not_implemented(c10::str(op, ": the bag sizes ", describe_spec(bag_size),
                                       " are not split like the indices' bags ", index_spec->str()));
  b.extents = bi->spec()->extents[b.mesh_dim];
  const auto me = index_spec->mesh->coordinate(b.mesh_dim);
  for (int64_t c = 0; c < me; ++c) b.first_bag += b.extents[c];
  return b;
}

// _embedding_bag_dense_backward(Tensor grad, Tensor indices, Tensor offset2bag, Tensor bag_size,
//                               Tensor maximum_indices, SymInt num_weights, bool scale_grad_by_freq, int mode,
//                               Tensor? per_sample_weights, int padding_idx=-1) -> Tensor
// `offsets` (from _embedding_bag_backward; undefined from the dense op) rebuild an empty offset2bag -- aten's CPU
// fast path leaves it empty -- when the indices are whole (a forward that ran on whole indices or through the
// fallback); the forward rule fills it whenever it splits the bags.
at::Tensor dense_backward(const char* op, const at::Tensor& grad, const at::Tensor& indices, const at::Tensor& offsets,
                          const at::Tensor& offset2bag, const at::Tensor& bag_size, const at::Tensor& maximum_indices,
                          const c10::SymInt& num_weights_arg, bool scale_grad_by_freq, int64_t mode,
                          const std::optional<at::Tensor>& per_sample_weights, int64_t padding_idx) {
  const auto psw = per_sample_weights.value_or(at::Tensor());
  auto mesh = dispatch::common_mesh(op, {grad, indices, offset2bag, bag_size, maximum_indices, psw});
  auto idx_st = resolve_partial(dispatch::as_shard(indices, mesh));
  const auto& ispec = *shard_impl(idx_st)->spec();
  auto bags = backward_bags(op, bag_size, shard_impl(idx_st)->spec());
  if (bags.mesh_dim >= 0 && scale_grad_by_freq)
    dispatch::not_implemented("scale_grad_by_freq needs global index counts");
  // The gradient's rows follow the bags; its columns keep the table's column splits.
  auto g_st = resolve_partial(dispatch::as_shard(grad, mesh));
  const auto& gspec = *shard_impl(g_st)->spec();
  Placements rows_pl(mesh->ndim(), Placement::replicate()), bag_pl(mesh->ndim(), Placement::replicate());
  Placements out_pl(mesh->ndim(), Placement::replicate());
  DimExtents rows_ext, bag_ext, out_ext;
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    if (m != bags.mesh_dim && gspec.placements[m].is_shard(1)) {
      rows_pl[m] = Placement::shard(1);
      out_pl[m] = Placement::shard(1);
      rows_ext[1] = out_ext[1] = gspec.extents[m];
    }
  }
  if (bags.mesh_dim >= 0) {
    rows_pl[bags.mesh_dim] = bag_pl[bags.mesh_dim] = Placement::shard(0);
    rows_ext[0] = bag_ext[0] = bags.extents;
    out_pl[bags.mesh_dim] = Placement::partial(ReduceOp::Sum);
  }
  const auto num_weights = concrete_int(num_weights_arg);
  auto g = local_in(g_st, mesh, rows_pl, rows_ext);
  auto idx = shard_impl(idx_st)->local();
  auto o2b = local_in(offset2bag, mesh, ispec.placements, ispec.dim_extents());
  if (bags.first_bag) o2b = o2b.sub(bags.first_bag);
  auto bs = local_in(bag_size, mesh, bag_pl, bag_ext);
  auto mx = mode == 2 ? local_in(maximum_indices, mesh, rows_pl, rows_ext)
                      : local_in(maximum_indices, mesh, bag_pl, bag_ext);
  std::optional<at::Tensor> psw_local;
  if (psw.defined()) psw_local = local_in(psw, mesh, ispec.placements, ispec.dim_extents());
  const auto global = std::vector<int64_t>{num_weights, grad.size(1)};
  at::Tensor out;
  if (g.size(0) == 0) {  // no bag here: no gradient to add (aten's kernel would read bag 0)
    out = at::zeros({num_weights, g.size(1)}, g.options());
  } else if (o2b.numel() != idx.numel() && offsets.defined() && bags.mesh_dim < 0) {
    out = at::_embedding_bag_backward(g, idx, whole_value(offsets).to(idx.device()), o2b, bs, mx, num_weights,
                                      scale_grad_by_freq, mode, /*sparse=*/false, psw_local, padding_idx);
  } else {
    out = at::_embedding_bag_dense_backward(g, idx, o2b.contiguous(), bs, mx, num_weights, scale_grad_by_freq, mode,
                                            psw_local, padding_idx);
  }
  return wrap(out, mesh, out_pl, global, out_ext);
}

at::Tensor embedding_bag_dense_backward_rule(const at::Tensor& grad, const at::Tensor& indices,
                                             const at::Tensor& offset2bag, const at::Tensor& bag_size,
                                             const at::Tensor& maximum_indices, c10::SymInt num_weights,
                                             bool scale_grad_by_freq, int64_t mode,
                                             const std::optional<at::Tensor>& per_sample_weights,
                                             int64_t padding_idx) {
  return dense_backward("aten::_embedding_bag_dense_backward", grad, indices, at::Tensor(), offset2bag, bag_size,
                        maximum_indices, num_weights, scale_grad_by_freq, mode, per_sample_weights, padding_idx);
}

// _embedding_bag_backward(Tensor grad, Tensor indices, Tensor offsets, Tensor offset2bag, Tensor bag_size,
//                         Tensor maximum_indices, SymInt num_weights, bool scale_grad_by_freq, int mode, bool sparse,
//                         Tensor? per_sample_weights, int padding_idx=-1) -> Tensor
// The table gradient autograd asks for: the dense one as above; a sparse one (sparse=True) declines.
at::Tensor embedding_bag_backward_rule(const at::Tensor& grad, const at::Tensor& indices, const at::Tensor& offsets,
                                       const at::Tensor& offset2bag, const at::Tensor& bag_size,
                                       const at::Tensor& maximum_indices, c10::SymInt num_weights,
                                       bool scale_grad_by_freq, int64_t mode, bool sparse,
                                       const std::optional<at::Tensor>& per_sample_weights, int64_t padding_idx) {
  if (sparse)
    dispatch::not_implemented("a sparse table gradient (sparse=True), which a ShardTensor cannot hold; use "
                              "sparse=False");
  return dense_backward("aten::_embedding_bag_backward", grad, indices, offsets, offset2bag, bag_size,
                        maximum_indices, num_weights, scale_grad_by_freq, mode, per_sample_weights, padding_idx);
}

// _embedding_bag_per_sample_weights_backward(Tensor grad, Tensor weight, Tensor indices, Tensor offsets,
//                                            Tensor offset2bag, int mode, int padding_idx=-1) -> Tensor
// Each index's weight gradient is its bag's gradient dotted with its table row: laid out like the indices, and a
// Partial(sum) over mesh dims that split the table's columns (each rank's dot product covers its columns).
at::Tensor embedding_bag_psw_backward_rule(const at::Tensor& grad, const at::Tensor& weight, const at::Tensor& indices,
                                           const at::Tensor& offsets, const at::Tensor& offset2bag, int64_t mode,
                                           int64_t padding_idx) {
  constexpr const char* op = "aten::_embedding_bag_per_sample_weights_backward";
  auto mesh = dispatch::common_mesh(op, {grad, weight, indices, offsets, offset2bag});
  // The forward's offsets come back as they were: one more than the bags with include_last_offset.
  const bool include_last = offsets.numel() == grad.size(0) + 1;  // global sizes: nothing gathered for this
  auto s = split_bags(op, mesh, weight, indices, offsets, include_last);
  Placements column_pl;
  DimExtents column_ext;
  auto w = local_table(op, weight, indices, s, column_pl, column_ext);
  const auto& ispec = *s.index_spec;
  auto [rows_pl, rows_ext] = bag_layout(s, column_pl, column_ext, true);
  auto g = local_in(grad, mesh, rows_pl, rows_ext);
  auto idx = local_in(indices, mesh, ispec.placements, ispec.dim_extents());
  auto o2b = local_in(offset2bag, mesh, ispec.placements, ispec.dim_extents());
  if (s.first_bag) o2b = o2b.sub(s.first_bag);
  Placements out_pl = ispec.placements;
  for (int64_t m = 0; m < mesh->ndim(); ++m)
    if (column_pl[m].is_shard()) out_pl[m] = Placement::partial(ReduceOp::Sum);
  at::Tensor out = s.bags == 0 ? at::zeros({idx.numel()}, g.options())
                               : at::_embedding_bag_per_sample_weights_backward(g, w, idx, s.local_offsets,
                                                                                o2b.contiguous(), mode, padding_idx);
  return wrap(out, mesh, out_pl, {ispec.global_shape[0]}, ispec.dim_extents());
}

} // namespace

SHARDTENSOR_RULE_FAMILY(embedding_bag) {
  dispatch::set_handler("aten::_embedding_bag", typed_handler(&embedding_bag_rule));
  dispatch::set_handler("aten::_embedding_bag_forward_only", typed_handler(&embedding_bag_forward_only_rule));
  dispatch::set_handler("aten::_embedding_bag_backward", typed_handler(&embedding_bag_backward_rule));
  dispatch::set_handler("aten::_embedding_bag_dense_backward", typed_handler(&embedding_bag_dense_backward_rule));
  dispatch::set_handler("aten::_embedding_bag_per_sample_weights_backward",
                        typed_handler(&embedding_bag_psw_backward_rule));
}

} // namespace shardtensor::ops
