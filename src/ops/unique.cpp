// torch.unique (sorted, no dim: `_unique2`, the legacy `_unique`) and torch.unique_consecutive (no dim) of a split
// tensor (point-cloud pooling: the distinct voxel / serialization codes of the points, their counts and each point's
// cluster).
//
// The distinct values are data: each rank takes its own (values with counts, sorted), and they are merged mesh dim
// by mesh dim (the sizes in one small all-gather, then the values and counts in one all-gather each; never the
// elements themselves). The values and counts are Replicate, as one device returns them; the inverse (each element's
// index into the values) is computed where the element lives and keeps the input's layout. unique_consecutive needs
// the row-major order, so it takes a tensor split on its leading dim (one split along a later dim is re-laid out there
// first, one all-to-all): the ranks' groups are concatenated in rank
// order and a group cut by a shard boundary is joined again.
//
// `sorted=False` gives the sorted result, as aten's CPU and CUDA kernels do. Declined (the fallback; strict mode:
// NotImplementedError): an inverse of
// a floating tensor holding NaN (one device maps each NaN to its own entry; agreed with the sizes, so every rank
// declines alike), unique_consecutive of other layouts, unique_dim with another dim split.
#include "comm/collectives.h"
#include "ops/common.h"

#include <shardtensor/simulation.h>

namespace shardtensor::ops {

namespace {

// c10d moves no bool tensors through every backend: they travel as bytes.
at::Tensor gathered_v(const at::Tensor& t, const std::vector<int64_t>& extents, const Mesh& mesh, int64_t m,
                      int64_t dim = 0) {
  if (t.scalar_type() != at::kBool) return comm::all_gather_v(t, dim, extents, mesh, m);
  return comm::all_gather_v(t.to(at::kByte), dim, extents, mesh, m).to(at::kBool);
}

// Every rank's part along mesh dim m, in coordinate order: its `values` (slices along `dim`) and their `counts`. The
// slice counts and a flag travel in one small all-gather, then the values and the counts in one all-gather each.
struct Gathered {
  at::Tensor values, counts;
  std::vector<int64_t> sizes;  // slices per coordinate
  bool any_flag = false;       // some rank raised its flag
};

Gathered gather_parts(const at::Tensor& values, const at::Tensor& counts, int64_t dim, bool flag, const Mesh& mesh,
                      int64_t m, const char* what) {
  Gathered g;
  for (const auto& r : comm::all_gather_ints({values.size(dim), flag ? 1 : 0}, mesh, m, what)) {
    g.sizes.push_back(r[0]);
    g.any_flag = g.any_flag || r[1] != 0;
  }
  g.values = gathered_v(values, g.sizes, mesh, m, dim);
  g.counts = comm::all_gather_v(counts, 0, g.sizes, mesh, m);
  return g;
}

bool holds_nan(const at::Tensor& t) {
  return (t.is_floating_point() || t.is_complex()) && t.isnan().any().item<bool>();
}

struct Distinct {
  at::Tensor values, counts;  // sorted distinct values of the whole tensor, their counts (int64)
  bool any_nan = false;       // some rank's part holds a NaN
};

// The distinct values of the whole tensor with their counts, from each rank's `local` part; `spec` says which mesh
// dims split it (Replicate dims hold copies and are not merged).
Distinct global_distinct(const at::Tensor& local, const ShardSpec& spec, const char* what) {
  Distinct d;
  auto [v, unused, c] = at::_unique2(local.reshape({-1}), /*sorted=*/true, /*return_inverse=*/false,
                                     /*return_counts=*/true);
  bool nan = holds_nan(local);
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    if (!spec.placements[m].is_shard()) continue;
    auto all = gather_parts(v, c, 0, nan, *spec.mesh, static_cast<int64_t>(m), what);
    nan = nan || all.any_flag;
    auto [u, inv, unused2] = at::_unique2(all.values, true, true, false);
    c = at::zeros({u.numel()}, all.counts.options()).index_add_(0, inv.reshape({-1}), all.counts);
    v = u;
  }
  d.values = v;
  d.counts = c;
  d.any_nan = nan;
  return d;
}

at::Tensor replicated(const at::Tensor& local, const MeshPtr& mesh) {
  return wrap(local, mesh, Placements(mesh->ndim(), Placement::replicate()), local.sizes().vec(), {});
}

at::Tensor empty_long(const at::Tensor& like, const MeshPtr& mesh) {
  return replicated(at::empty({0}, like.options().dtype(at::kLong)), mesh);
}

// _unique2(Tensor self, bool sorted=True, bool return_inverse=False, bool return_counts=False)
std::tuple<at::Tensor, at::Tensor, at::Tensor> unique2_rule(const at::Tensor& self_in, bool sorted,
                                                            bool return_inverse, bool return_counts) {
  // sorted=False leaves the order to the kernel; aten's CPU and CUDA kernels sort either way (the CPU one since its
  // hash path was dropped for speed), so the sorted merge is one device's result for both.
  (void)sorted;
  TORCH_CHECK_NOT_IMPLEMENTED(!simulating(), "torch.unique of a ShardTensor under simulation (shardtensor.simulate): "
                              "the result's size is the data");
  auto self = resolve_partial(self_in);
  const auto& spec = *shard_impl(self)->spec();
  const auto& local = shard_impl(self)->local();
  const auto& mesh = spec.mesh;
  if (!spec.has_shard()) {
    auto [v, inv, c] = at::_unique2(local, true, return_inverse, return_counts);
    return {replicated(v, mesh), return_inverse ? make_shard_tensor(inv, shard_impl(self)->spec()) : replicated(inv, mesh),
            replicated(c, mesh)};
  }
  auto d = global_distinct(local, spec, "torch.unique of a split tensor (sizes)");
  if (return_inverse && d.any_nan)
    dispatch::not_implemented("an inverse of a tensor holding NaN (each NaN is its own value on one device)");
  at::Tensor inverse = empty_long(local, mesh);
  if (return_inverse) {
    // Each element's index into the sorted values (bool has no searchsorted kernel: as bytes, the same order).
    const bool b = local.scalar_type() == at::kBool;
    auto idx = at::searchsorted(b ? d.values.to(at::kByte) : d.values, b ? local.to(at::kByte) : local.contiguous());
    inverse = make_shard_tensor(idx, without_partial(shard_impl(self)->spec()));
  }
  return {replicated(d.values, mesh), inverse, return_counts ? replicated(d.counts, mesh) : empty_long(local, mesh)};
}

// _unique(Tensor self, bool sorted=True, bool return_inverse=False)
std::tuple<at::Tensor, at::Tensor> unique_legacy_rule(const at::Tensor& self, bool sorted, bool return_inverse) {
  auto [v, inv, c] = unique2_rule(self, sorted, return_inverse, false);
  return {v, inv};
}

// unique_consecutive(Tensor self, bool return_inverse=False, bool return_counts=False, int? dim=None)
std::tuple<at::Tensor, at::Tensor, at::Tensor> unique_consecutive_rule(const at::Tensor& self_in, bool return_inverse,
                                                                       bool return_counts, std::optional<int64_t> dim) {
  if (dim.has_value())
    dispatch::not_implemented("unique_consecutive along a dim (slices compared whole); redistribute to Replicate()");
  auto self = resolve_partial(self_in);
  const auto& spec = *shard_impl(self)->spec();
  const auto m = leading_split(spec);
  if (spec.has_shard() && m < 0) {
    // Split along a later dim the row-major order interleaves the ranks: re-laid out on the leading dim (one
    // all-to-all), the inverse comes back in that layout; split by several mesh dims, the leading dim's keeps it
    // and the others are gathered (one_split_on_leading_dim).
    auto relaid = split_on_leading_dim(self);
    if (!relaid) relaid = one_split_on_leading_dim(self);
    if (!relaid)
      dispatch::not_implemented("unique_consecutive of a tensor split by two mesh dims, not only on its leading dim "
                                "(the row-major order interleaves the ranks); redistribute to Shard() of the first "
                                "dim larger than 1 on one mesh dim");
    return unique_consecutive_rule(*relaid, return_inverse, return_counts, dim);
  }
  const auto& local = shard_impl(self)->local();
  const auto& mesh = spec.mesh;
  if (m < 0) {
    auto [v, inv, c] = at::unique_consecutive(local, return_inverse, return_counts, std::nullopt);
    return {replicated(v, mesh), return_inverse ? make_shard_tensor(inv, shard_impl(self)->spec()) : empty_long(local, mesh),
            replicated(c, mesh)};
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!simulating(), "torch.unique_consecutive of a ShardTensor under simulation "
                              "(shardtensor.simulate): the result's size is the data");
  auto [v, inv, c] = at::unique_consecutive(local.reshape({-1}), true, true, std::nullopt);
  auto all = gather_parts(v, c, 0, false, *mesh, m, "torch.unique_consecutive of a split tensor (sizes)");
  int64_t before = 0;
  for (int64_t r = 0; r < mesh->coordinate(m); ++r) before += all.sizes[r];
  // Groups cut by a shard boundary are equal neighbours in rank order: joined again.
  auto [u, group_of, unused] = at::unique_consecutive(all.values, true, false, std::nullopt);
  auto counts = at::zeros({u.numel()}, all.counts.options()).index_add_(0, group_of, all.counts);
  at::Tensor inverse = empty_long(local, mesh);
  if (return_inverse)
    inverse = make_shard_tensor(group_of.index_select(0, inv.reshape({-1}) + before).view(local.sizes()),
                                without_partial(shard_impl(self)->spec()));
  return {replicated(u, mesh), inverse, return_counts ? replicated(counts, mesh) : empty_long(local, mesh)};
}


// unique_dim(Tensor self, int dim, bool sorted=True, bool return_inverse=False, bool return_counts=False): the
// distinct slices along `dim` (the distinct points of a point set split by points: voxel coordinates). With `dim` the
// only split dim, each rank's distinct slices and counts are merged as above (the slices, never the elements); the
// inverse of each local slice is its position among the merged ones (a unique of the merged and the local slices
// together, which adds none). Values and counts Replicate, the inverse split like the slices. Another dim split:
// the slices are made whole first (below).
std::tuple<at::Tensor, at::Tensor, at::Tensor> unique_dim_rule(const at::Tensor& self_in, int64_t dim, bool sorted,
                                                               bool return_inverse, bool return_counts) {
  auto self = resolve_partial(self_in);
  const auto& spec = *shard_impl(self)->spec();
  const auto& local = shard_impl(self)->local();
  const auto& mesh = spec.mesh;
  const auto d = wrap_dim(dim, self.dim());
  if (!spec.has_shard()) {
    auto [v, inv, c] = at::unique_dim(local, d, sorted, return_inverse, return_counts);
    return {replicated(v, mesh), replicated(inv, mesh), replicated(c, mesh)};
  }
  int64_t m = -1;
  bool other_split = false;
  for (size_t j = 0; j < spec.placements.size(); ++j) {
    if (!spec.placements[j].is_shard()) continue;
    if (!spec.placements[j].is_shard(d)) other_split = true;
    else m = static_cast<int64_t>(j);
  }
  if (other_split) {
    // Another dim split cuts every slice across ranks: the slices are made whole first -- the mesh dim that splits
    // `dim` keeps it, or the first split moves onto `dim` (one all-to-all of the input, each rank then holding whole
    // slices), any other split is gathered -- and the distinct slices merged as below (no gather of the tensor).
    auto whole_slices = one_split_on(self, d);
    TORCH_INTERNAL_ASSERT(whole_slices, "unique_dim: another dim's split left the layout unchanged");
    return unique_dim_rule(*whole_slices, dim, sorted, return_inverse, return_counts);
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!simulating(), "torch.unique(dim=...) of a ShardTensor under simulation "
                              "(shardtensor.simulate): the result's size is the data");
  auto [v, unused, c] = at::unique_dim(local, d, true, false, true);
  auto all = gather_parts(v, c, d, holds_nan(local), *mesh, m, "torch.unique(dim=...) (sizes)");
  if (return_inverse && all.any_flag)
    dispatch::not_implemented("an inverse of slices holding NaN (each such slice is its own value on one device)");
  auto [u, inv, unused2] = at::unique_dim(all.values, d, true, true, false);
  auto counts = at::zeros({u.size(d)}, all.counts.options()).index_add_(0, inv.reshape({-1}), all.counts);
  at::Tensor inverse = empty_long(local, mesh);
  if (return_inverse) {
    auto [u2, inv2, unused3] = at::unique_dim(at::cat({u, local}, d), d, true, true, false);
    TORCH_INTERNAL_ASSERT(u2.size(d) == u.size(d), "unique_dim: a local slice missing from the merged slices");
    auto mine = inv2.narrow(0, u.size(d), local.size(d)).contiguous();
    Placements pl(mesh->ndim(), Placement::replicate());
    pl[m] = Placement::shard(0);
    inverse = wrap(mine, mesh, pl, {self.size(d)}, {{0, spec.extents[m]}});
  }
  return {replicated(u, mesh), inverse, return_counts ? replicated(counts, mesh) : empty_long(local, mesh)};
}

} // namespace

SHARDTENSOR_RULE_FAMILY(unique) {
  dispatch::set_handler("aten::_unique2", typed_handler(&unique2_rule));
  dispatch::set_handler("aten::_unique", typed_handler(&unique_legacy_rule));
  dispatch::set_handler("aten::unique_consecutive", typed_handler(&unique_consecutive_rule));
  dispatch::set_handler("aten::unique_dim", typed_handler(&unique_dim_rule));
}

} // namespace shardtensor::ops
