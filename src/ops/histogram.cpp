// Histograms of a sharded field: histc, histogram (bin count or edges, weights, density), histogramdd (points split,
// per-coordinate ranges agreed in one collective) and bincount. A histogram
// is a sum of the ranks' histograms over the same bins, so each rank counts its own elements and the result is
// Partial(sum) over the mesh dims that shard the input (completed when it is read). What the bins depend on is
// agreed first in one small collective: the data's global min and max when no range is given (histc's min == max,
// histogram's range=None), bincount's global max. density normalizes the completed counts.
#include "comm/stat_reduce.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include <shardtensor/simulation.h>

#include <limits>

namespace shardtensor::ops {

namespace {

// The input with pending sums completed (its layout and local part), and the mesh dims that shard it (where the
// counts are partial).
struct Field {
  SpecPtr spec;
  at::Tensor local;
  MeshPtr mesh;
  std::vector<int64_t> sharded;
};

// `others`: the op's other tensor arguments; when only they are ShardTensors (bin edges or weights split, the
// values plain), the values are a replicated field on their mesh.
Field field_of(const at::Tensor& self, at::ArrayRef<at::Tensor> others = {}) {
  auto t = shard_impl(self) ? self : dispatch::as_shard(self, dispatch::common_mesh("aten::histogram", others));
  t = resolve_partial(t);
  const auto& spec = shard_impl(t)->spec();
  Field f{spec, shard_impl(t)->local(), spec->mesh, {}};
  for (size_t m = 0; m < spec->placements.size(); ++m)
    if (spec->placements[m].is_shard()) f.sharded.push_back(static_cast<int64_t>(m));
  return f;
}

// The global (min, max) of the field, agreed in one collective (a rank without elements adds +inf / -inf).
std::pair<double, double> global_range(const Field& f) {
  const auto inf = std::numeric_limits<double>::infinity();
  auto opts = f.local.options().dtype(at::kDouble);
  auto lo = f.local.numel() ? f.local.min().to(at::kDouble).reshape({1}) : at::full({1}, inf, opts);
  auto hi = f.local.numel() ? f.local.max().to(at::kDouble).reshape({1}) : at::full({1}, -inf, opts);
  if (f.sharded.empty()) return {lo.item<double>(), hi.item<double>()};
  comm::StatReduce r;
  const auto i = r.min(lo), j = r.max(hi);
  r.run(*f.mesh, f.sharded);
  return {r.result(i)[0].item<double>(), r.result(j)[0].item<double>()};
}

// Counts of this rank, Partial(sum) over the sharded mesh dims.
at::Tensor partial_counts(const at::Tensor& local, const Field& f) {
  Placements p(f.mesh->ndim(), Placement::replicate());
  for (auto m : f.sharded) p[m] = Placement::partial(ReduceOp::Sum);
  return wrap(local, f.mesh, p, local.sizes().vec(), {});
}

// histc(Tensor self, int bins=100, Scalar min=0, Scalar max=0)
at::Tensor histc_rule(const at::Tensor& self, int64_t bins, const at::Scalar& min_s, const at::Scalar& max_s) {
  TORCH_CHECK_VALUE(bins > 0, "torch.histc(): bins must be > 0, but got ", bins, " for dim 0");
  auto f = field_of(self);
  double lo = min_s.toDouble(), hi = max_s.toDouble();
  if (lo == hi && self.numel() > 0) std::tie(lo, hi) = global_range(f);
  // As torch does: an empty range widens by one on each side (so every rank bins alike, whatever its own data).
  if (lo == hi) lo -= 1, hi += 1;
  TORCH_CHECK_VALUE(std::isfinite(lo) && std::isfinite(hi), "torch.histc(): range of [", lo, ", ", hi,
                    "] is not finite");
  TORCH_CHECK_VALUE(lo < hi, "torch.histc(): max must be larger than min");
  return partial_counts(at::histc(f.local, bins, lo, hi), f);
}

// Local histograms over the agreed edges; density from the completed counts.
std::tuple<at::Tensor, at::Tensor> finish_histogram(at::Tensor hist, const at::Tensor& edges, const Field& f,
                                                    bool density) {
  auto counts = partial_counts(hist, f);
  auto edges_st = wrap(edges, f.mesh, Placements(f.mesh->ndim(), Placement::replicate()), edges.sizes().vec(), {});
  if (!density) return {counts, edges_st};
  auto total = resolve_partial(counts);
  const auto& c = shard_impl(total)->local();
  auto widths = edges.narrow(0, 1, edges.size(0) - 1) - edges.narrow(0, 0, edges.size(0) - 1);
  return {make_shard_tensor(c / (c.sum() * widths), shard_impl(total)->spec()), edges_st};
}

// The weights laid out like the field.
at::Tensor local_weight(const std::optional<at::Tensor>& weight, const Field& f) {
  if (!weight || !weight->defined()) return {};
  return local_as(resolve_partial(*weight), f.mesh, f.spec->placements, f.spec->dim_extents());
}

// histogram.bin_ct(Tensor self, int bins=100, *, float[]? range=None, Tensor? weight=None, bool density=False)
std::tuple<at::Tensor, at::Tensor> histogram_bins_rule(const at::Tensor& self, int64_t bins,
                                                       std::optional<at::ArrayRef<double>> range,
                                                       const std::optional<at::Tensor>& weight, bool density) {
  TORCH_CHECK_VALUE(bins > 0, "torch.histogram(): bins must be > 0, but got ", bins, " for dimension 0");
  auto f = field_of(self, {weight.value_or(at::Tensor())});
  double lo = 0, hi = 0;
  if (range && !range->empty()) {
    TORCH_CHECK_VALUE(range->size() == 2, "torch.histogram(): range should have 2 elements");
    lo = (*range)[0], hi = (*range)[1];
  } else if (self.numel() > 0) {
    std::tie(lo, hi) = global_range(f);
  }
  if (lo == hi) lo -= 0.5, hi += 0.5;  // torch.histogram widens an empty range by half a unit on each side
  TORCH_CHECK_VALUE(std::isfinite(lo) && std::isfinite(hi), "torch.histogram(): range of [", lo, ", ", hi,
                    "] is not finite");
  auto w = local_weight(weight, f);
  auto [hist, edges] = at::histogram(f.local, bins, std::vector<double>{lo, hi},
                                     w.defined() ? std::optional<at::Tensor>(w) : std::nullopt, false);
  return finish_histogram(hist, edges, f, density);
}

// histogram.bins_tensor(Tensor self, Tensor bins, *, Tensor? weight=None, bool density=False)
std::tuple<at::Tensor, at::Tensor> histogram_edges_rule(const at::Tensor& self, const at::Tensor& bins,
                                                        const std::optional<at::Tensor>& weight, bool density) {
  auto f = field_of(self, {bins, weight.value_or(at::Tensor())});
  auto edges = whole_value(bins);
  auto w = local_weight(weight, f);
  auto [hist, e] = at::histogram(f.local, edges, w.defined() ? std::optional<at::Tensor>(w) : std::nullopt, false);
  return finish_histogram(hist, e, f, density);
}


// ---- histogramdd: points (leading dims) split, the coordinate dim (last) whole ----

// The points' field. A split coordinate dim (a point's coordinates on different ranks) moves to the largest points
// dim first (one all-to-all); with none as large as the mesh dim it declines.
Field points_of(const at::Tensor& self, at::ArrayRef<at::Tensor> others) {
  auto t = self;
  const auto last = self.dim() - 1;
  if (shard_impl(t) && last > 0) {
    t = resolve_partial(t);
    if (shard_impl(t)->spec()->mesh_dim_of(last) >= 0) {
      auto moved = split_moved_off(t, last, [last](int64_t d) { return d < last; });
      if (!moved)
        dispatch::not_implemented("histogramdd with its coordinate (last) dim sharded and no points dim as large as "
                                  "the mesh dim to take the split; shard the points instead");
      t = *moved;
    }
  }
  auto f = field_of(t, others);
  for (auto m : f.sharded)
    if (f.spec->placements[m].is_shard(last))
      dispatch::not_implemented("histogramdd with its coordinate (last) dim sharded; shard the points instead");
  return f;
}

// Per coordinate, the outer bin edges: the given range, else the points' global min and max (one collective), an
// empty range widened by half a unit on each side as torch does.
std::vector<double> outer_edges(const Field& f, int64_t dims, std::optional<at::ArrayRef<double>> range) {
  std::vector<double> r(2 * dims);
  if (range && !range->empty()) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(range->size()) == 2 * dims, "torch.histogramdd(): for a ", dims,
                      "-dimensional histogram, range should have ", 2 * dims, " elements, but got ", range->size());
    std::copy(range->begin(), range->end(), r.begin());
  } else {
    const auto inf = std::numeric_limits<double>::infinity();
    auto pts = f.local.reshape({-1, dims}).to(at::kDouble);
    auto opts = pts.options();
    auto lo = pts.size(0) ? std::get<0>(pts.min(0)) : at::full({dims}, inf, opts);
    auto hi = pts.size(0) ? std::get<0>(pts.max(0)) : at::full({dims}, -inf, opts);
    if (!f.sharded.empty()) {
      comm::StatReduce red;
      const auto i = red.min(lo), j = red.max(hi);
      red.run(*f.mesh, f.sharded);
      lo = red.result(i)[0], hi = red.result(j)[0];
    }
    lo = lo.cpu(), hi = hi.cpu();
    for (int64_t d = 0; d < dims; ++d) {
      const auto a = lo[d].item<double>(), b = hi[d].item<double>();
      const bool empty = !std::isfinite(a) || !std::isfinite(b);  // no point on any rank
      r[2 * d] = empty ? 0.0 : a;
      r[2 * d + 1] = empty ? 0.0 : b;
    }
  }
  for (int64_t d = 0; d < dims; ++d)
    if (r[2 * d] == r[2 * d + 1]) r[2 * d] -= 0.5, r[2 * d + 1] += 0.5;
  return r;
}

// Counts over the edges, Partial(sum) over the mesh dims that split the points; density from the completed counts.
at::Tensor histogramdd_counts(const Field& f, at::TensorList edges, const std::optional<at::Tensor>& weight,
                              bool density) {
  auto w = local_weight(weight, f);
  auto local = at::_histogramdd_from_bin_tensors(f.local, edges, w.defined() ? std::optional<at::Tensor>(w)
                                                                             : std::nullopt, false);
  auto counts = partial_counts(local, f);
  if (!density) return counts;
  auto total = resolve_partial(counts);
  auto c = shard_impl(total)->local();
  auto norm = c / c.sum();
  for (size_t d = 0; d < edges.size(); ++d) {
    const auto& e = edges[d];
    std::vector<int64_t> shape(edges.size(), 1);
    shape[d] = e.size(0) - 1;
    norm = norm / (e.narrow(0, 1, e.size(0) - 1) - e.narrow(0, 0, e.size(0) - 1)).reshape(shape);
  }
  return make_shard_tensor(norm, shard_impl(total)->spec());
}

std::vector<at::Tensor> edges_for(const at::Tensor& self, const Field& f, at::IntArrayRef bins,
                                  std::optional<at::ArrayRef<double>> range) {
  const auto dims = self.size(-1);
  const auto r = outer_edges(f, dims, range);
  // torch's own edges for that range (the local points only fix the dtype and device)
  return at::_histogramdd_bin_edges(f.local, bins, r, std::nullopt, false);
}

// _histogramdd_bin_edges(Tensor self, int[] bins, *, float[]? range=None, Tensor? weight=None, bool density=False)
std::vector<at::Tensor> histogramdd_edges_rule(const at::Tensor& self, at::IntArrayRef bins,
                                               std::optional<at::ArrayRef<double>> range,
                                               const std::optional<at::Tensor>& weight, bool density) {
  auto f = points_of(self, {weight.value_or(at::Tensor())});
  std::vector<at::Tensor> out;
  for (auto& e : edges_for(self, f, bins, range))
    out.push_back(wrap(e, f.mesh, Placements(f.mesh->ndim(), Placement::replicate()), e.sizes().vec(), {}));
  return out;
}

// _histogramdd_from_bin_cts(Tensor self, int[] bins, *, float[]? range=None, Tensor? weight=None, bool density=False)
at::Tensor histogramdd_bin_cts_rule(const at::Tensor& self, at::IntArrayRef bins,
                                    std::optional<at::ArrayRef<double>> range, const std::optional<at::Tensor>& weight,
                                    bool density) {
  auto f = points_of(self, {weight.value_or(at::Tensor())});
  return histogramdd_counts(f, edges_for(self, f, bins, range), weight, density);
}

// _histogramdd_from_bin_tensors(Tensor self, Tensor[] bins, *, Tensor? weight=None, bool density=False)
at::Tensor histogramdd_bin_tensors_rule(const at::Tensor& self, at::TensorList bins,
                                        const std::optional<at::Tensor>& weight, bool density) {
  std::vector<at::Tensor> others(bins.begin(), bins.end());
  others.push_back(weight.value_or(at::Tensor()));
  auto f = points_of(self, others);
  std::vector<at::Tensor> edges;
  for (const auto& b : bins) edges.push_back(whole_value(b));
  return histogramdd_counts(f, edges, weight, density);
}

// bincount(Tensor self, Tensor? weights=None, SymInt minlength=0): the length follows the global max.
at::Tensor bincount_rule(const at::Tensor& self, const std::optional<at::Tensor>& weights, c10::SymInt minlength_s) {
  const auto minlength = concrete_int(minlength_s);
  TORCH_CHECK_VALUE(self.dim() == 1, "bincount only supports 1-d non-negative integral inputs.");
  TORCH_CHECK_VALUE(minlength >= 0, "minlength should be >= 0");
  // The result's length is the other ranks' max, which the fake process group of a simulation does not deliver.
  TORCH_CHECK_NOT_IMPLEMENTED(!simulating(), "torch.bincount on a ShardTensor under simulation "
                              "(shardtensor.simulate): its length depends on every rank's values");
  auto f = field_of(self, {weights.value_or(at::Tensor())});
  int64_t length = minlength;
  if (self.numel() > 0) {
    const auto [lo, hi] = global_range(f);  // exact in double for every count a tensor can hold
    TORCH_CHECK_VALUE(lo >= 0, "bincount only supports 1-d non-negative integral inputs.");
    length = std::max(minlength, static_cast<int64_t>(hi) + 1);
  }
  auto w = local_weight(weights, f);
  auto counts = at::bincount(f.local, w.defined() ? std::optional<at::Tensor>(w) : std::nullopt, length);
  if (w.defined() && f.local.numel() == 0) {
    // torch gives an empty input int64 counts even with weights: take the dtype a non-empty one gets, so every
    // rank's part (and the pending sum) has one dtype.
    const auto dtype = at::bincount(at::zeros({1}, f.local.options()), at::zeros({1}, w.options()), 1).scalar_type();
    counts = counts.to(dtype);
  }
  return partial_counts(counts, f);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(histogram) {
  dispatch::set_handler("aten::histc", typed_handler(&histc_rule));
  dispatch::set_handler("aten::histogram.bin_ct", typed_handler(&histogram_bins_rule));
  dispatch::set_handler("aten::histogram.bins_tensor", typed_handler(&histogram_edges_rule));
  dispatch::set_handler("aten::bincount", typed_handler(&bincount_rule));
  dispatch::set_handler("aten::_histogramdd_bin_edges", typed_handler(&histogramdd_edges_rule));
  dispatch::set_handler("aten::_histogramdd_from_bin_cts", typed_handler(&histogramdd_bin_cts_rule));
  dispatch::set_handler("aten::_histogramdd_from_bin_tensors", typed_handler(&histogramdd_bin_tensors_rule));
}

} // namespace shardtensor::ops
