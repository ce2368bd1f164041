// Neighbourhood attention (NATTEN semantics) as custom ops in namespace `shardtensor`, for plain tensors and
// ShardTensors.
//
// Ops (schemas in src/library.cpp):
//  - neighborhood_attention(q, k, v, kernel_size, dilation?, scale?): q, k [B, spatial..., H, D],
//    v [B, spatial..., H, Dv], len(kernel_size) spatial dims (1..3). Query i attends to the K keys starting at
//    clamp(i - K/2, 0, L - K) per dim (the window shifts inward at the borders, so every query sees exactly K^d
//    keys); with dilation d the same rule applies inside the query's group of positions i mod d.
//  - neighborhood_attention_forward / _backward: the local kernels with explicit global geometry (query offsets,
//    key-window offsets, global extents), so a shard's queries can run against a gathered key window.
// Plain tensors: CPU/CUDA kernels, differentiable through an autograd::Function bound at the Autograd key.
//
// ShardTensors (bound at both shard keys, above autograd): q, k, v share q's layout (k/v are redistributed,
// differentiably, when they differ). Batch and heads shards are local. Each sharded spatial dim (any number of
// mesh dims, one mesh dim per spatial dim) reads, from specs alone, the global key rows the local queries'
// windows cover -- one contiguous range: K/2 rows each side, more next to the global borders where windows are
// clamped inward, from several ranks away when shards are narrower than that, and with dilation the other
// groups' rows in between -- moved by a comm::HaloPlan (cached per layout and window; the backward reuses it).
// k and v travel together: one message per peer. Zero-extent ranks take part in every collective.
//
// One sharded spatial dim: no window is built (comm/halo_borders.h, na_border_forward below). The main call runs
// every local query against the rank's own keys while the halo travels; the border queries run again against
// small border windows and are written over their rows. The backward is the adjoint: the main call's dk/dv are
// the own rows' (the border queries' terms masked out), the border calls add theirs, and only the halo rows'
// dk/dv go home. Several sharded spatial dims, no window either when every dim has an interior (na_multi_forward):
// the main call on the own block, the border queries in disjoint slabs against key regions built from the halo
// pieces (corners travel as a second hop), their dk/dv's halo parts home as pieces. Otherwise (a rank with too few
// rows along some dim) the key window is gathered dim by dim and its dk/dv go home with the plan's scatter_add; the
// messages are the same either way, so ranks on different paths match.
#include "comm/halo_borders.h"
#include "comm/halo_plan.h"
#include "dispatch/promote.h"
#include "ops/common.h"
#include "ops/describe.h"
#include "ops/neighborhood_kernels.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <cstdlib>
#include <optional>
#include <sstream>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- argument checks shared by both paths (global shapes) ----

std::vector<int64_t> dilation_of(at::IntArrayRef kernel, at::OptionalIntArrayRef dilation) {
  if (!dilation.has_value() || dilation->empty()) return std::vector<int64_t>(kernel.size(), 1);
  TORCH_CHECK_VALUE(dilation->size() == kernel.size(), "neighborhood_attention: dilation ", *dilation,
                    " must have one entry per spatial dim, like kernel_size ", kernel);
  return dilation->vec();
}

na::Geometry plain_geometry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef kernel,
                            at::IntArrayRef dilation) {
  const auto nd = static_cast<int64_t>(kernel.size());
  TORCH_CHECK_VALUE(nd >= 1 && nd <= 3, "neighborhood_attention: kernel_size must name 1 to 3 spatial dims, got ",
                    kernel);
  TORCH_CHECK_VALUE(q.dim() == nd + 3 && k.dim() == nd + 3 && v.dim() == nd + 3,
                    "neighborhood_attention: with ", nd, " spatial dims (kernel_size ", kernel, "), query, key and "
                    "value must have ", nd + 3, " dims [B, spatial..., heads, head_dim], got ", q.sizes(), ", ",
                    k.sizes(), ", ", v.sizes());
  for (int64_t d = 0; d < nd + 2; ++d)
    TORCH_CHECK_VALUE(q.size(d) == k.size(d) && k.size(d) == v.size(d),
                      "neighborhood_attention: query, key and value must agree on batch, spatial and head dims, got ",
                      q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK_VALUE(q.size(-1) == k.size(-1), "neighborhood_attention: query and key head_dim differ: ", q.sizes(),
                    " vs ", k.sizes());
  na::Geometry g;
  g.nd = nd;
  for (int64_t d = 0; d < nd; ++d) {
    g.kernel[d] = kernel[d];
    g.dilation[d] = dilation[d];
    g.extent[d] = q.size(1 + d);
    TORCH_CHECK_VALUE(kernel[d] >= 1 && kernel[d] % 2 == 1,
                      "neighborhood_attention: kernel sizes must be odd and positive, got ", kernel);
    TORCH_CHECK_VALUE(dilation[d] >= 1, "neighborhood_attention: dilation must be positive, got ", dilation);
    TORCH_CHECK_VALUE(q.size(1 + d) >= kernel[d] * dilation[d], "neighborhood_attention: spatial dim ", 1 + d,
                      " has extent ", q.size(1 + d), " smaller than the kernel size ", kernel[d],
                      dilation[d] > 1 ? " times the dilation" : "",
                      " (every query needs K keys); use kernel_size * dilation <= the extent");
  }
  return g;
}

double scale_of(const at::Tensor& q, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

na::Geometry geometry_from(at::IntArrayRef kernel, at::IntArrayRef dilation, at::IntArrayRef q_offset,
                           at::IntArrayRef k_offset, at::IntArrayRef extent) {
  const auto nd = static_cast<int64_t>(kernel.size());
  TORCH_CHECK_VALUE(nd >= 1 && nd <= 3 && dilation.size() == kernel.size() && q_offset.size() == kernel.size() &&
                        k_offset.size() == kernel.size() && extent.size() == kernel.size(),
                    "neighborhood_attention_forward/backward: kernel_size, dilation, query_offset, key_offset and "
                    "extent must have one entry per spatial dim (1 to 3)");
  na::Geometry g;
  g.nd = nd;
  for (int64_t d = 0; d < nd; ++d) {
    g.kernel[d] = kernel[d];
    g.dilation[d] = dilation[d];
    g.q_offset[d] = q_offset[d];
    g.k_offset[d] = k_offset[d];
    g.extent[d] = extent[d];
  }
  return g;
}

// ---- plain tensors ----

std::tuple<at::Tensor, at::Tensor> forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              at::IntArrayRef kernel, at::IntArrayRef dilation,
                                              at::IntArrayRef q_offset, at::IntArrayRef k_offset,
                                              at::IntArrayRef extent, double scale) {
  return na::forward(q, k, v, geometry_from(kernel, dilation, q_offset, k_offset, extent), scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_op(const at::Tensor& grad_out, const at::Tensor& q,
                                                           const at::Tensor& k, const at::Tensor& v,
                                                           const at::Tensor& out, const at::Tensor& lse,
                                                           at::IntArrayRef kernel, at::IntArrayRef dilation,
                                                           at::IntArrayRef q_offset, at::IntArrayRef k_offset,
                                                           at::IntArrayRef extent, double scale) {
  return na::backward(grad_out, q, k, v, out, lse, geometry_from(kernel, dilation, q_offset, k_offset, extent),
                      scale);
}

// Below autograd (inference mode, or after the autograd kernel): forward only.
at::Tensor na_backend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef kernel,
                      at::OptionalIntArrayRef dilation, std::optional<double> scale) {
  return std::get<0>(
      na::forward(q, k, v, plain_geometry(q, k, v, kernel, dilation_of(kernel, dilation)), scale_of(q, scale)));
}

na::Geometry unpack(const std::vector<int64_t>& kernel, const std::vector<int64_t>& dilation) {
  na::Geometry g;
  g.nd = static_cast<int64_t>(kernel.size());
  for (int64_t d = 0; d < g.nd; ++d) {
    g.kernel[d] = kernel[d];
    g.dilation[d] = dilation[d];
  }
  return g;
}

// Shapes only (FakeTensors: torch.compile traces the autograd function with them).
std::vector<int64_t> out_shape_of(const at::Tensor& q, const at::Tensor& v) {
  auto s = q.sizes().vec();
  s.back() = v.size(-1);
  return s;
}

std::tuple<at::Tensor, at::Tensor> forward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                                at::IntArrayRef, double) {
  auto lse_shape = q.sizes().vec();
  lse_shape.pop_back();
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {at::empty(out_shape_of(q, v), q.options()), at::empty(lse_shape, q.options().dtype(acc))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(const at::Tensor&, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                                             at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                                             at::IntArrayRef, double) {
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

at::Tensor na_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef kernel,
                   at::OptionalIntArrayRef dilation, std::optional<double>) {
  plain_geometry(q, k, v, kernel, dilation_of(kernel, dilation));
  return at::empty(out_shape_of(q, v), q.options());
}

// The plain autograd function calls the geometry ops through the dispatcher, below autograd: the CPU/CUDA kernels
// for real tensors, the Meta kernels for fake ones.
std::vector<int64_t> zeros_for(at::IntArrayRef kernel) {
  return std::vector<int64_t>(kernel.size(), 0);
}

std::vector<int64_t> extents_of(const at::Tensor& q, at::IntArrayRef kernel) {
  std::vector<int64_t> e;
  for (size_t d = 0; d < kernel.size(); ++d) e.push_back(q.size(1 + static_cast<int64_t>(d)));
  return e;
}

std::tuple<at::Tensor, at::Tensor> dispatch_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    at::IntArrayRef kernel, at::IntArrayRef dilation, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardtensor::neighborhood_attention_forward", "")
                       .typed<decltype(forward_meta)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto zeros = zeros_for(kernel);
  return op.call(q, k, v, kernel, dilation, zeros, zeros, extents_of(q, kernel), scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                 const at::Tensor& k, const at::Tensor& v,
                                                                 const at::Tensor& out, const at::Tensor& lse,
                                                                 at::IntArrayRef kernel, at::IntArrayRef dilation,
                                                                 double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardtensor::neighborhood_attention_backward", "")
                       .typed<decltype(backward_meta)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto zeros = zeros_for(kernel);
  return op.call(grad_out, q, k, v, out, lse, kernel, dilation, zeros, zeros, extents_of(q, kernel), scale);
}

// The sharded rule's local kernels go through the dispatcher too (the geometry ops with this rank's offsets), so
// dispatch modes around the library see them: FLOP counting, and the meta simulation's fake tensors (Meta kernels).
std::vector<int64_t> first(const std::array<int64_t, 3>& a, int64_t nd) {
  return std::vector<int64_t>(a.begin(), a.begin() + nd);
}

std::tuple<at::Tensor, at::Tensor> local_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const na::Geometry& g, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardtensor::neighborhood_attention_forward", "")
                       .typed<decltype(forward_meta)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, first(g.kernel, g.nd), first(g.dilation, g.nd), first(g.q_offset, g.nd),
                 first(g.k_offset, g.nd), first(g.extent, g.nd), scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> local_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse,
                                                              const na::Geometry& g, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardtensor::neighborhood_attention_backward", "")
                       .typed<decltype(backward_meta)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(grad_out, q, k, v, out, lse, first(g.kernel, g.nd), first(g.dilation, g.nd),
                 first(g.q_offset, g.nd), first(g.k_offset, g.nd), first(g.extent, g.nd), scale);
}

struct PlainFn : torch::autograd::Function<PlainFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& kernel, const std::vector<int64_t>& dilation, double scale) {
    ctx->set_materialize_grads(false);
    plain_geometry(q, k, v, kernel, dilation);
    auto [out, lse] = dispatch_forward(q, k, v, kernel, dilation, scale);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["kernel"] = kernel;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool recording = at::GradMode::is_enabled();  // create_graph: read before any NoGradGuard
    variable_list res(6);
    if (!grads[0].defined()) return res;
    auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] =
        dispatch_backward(grads[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["kernel"].toIntVector(),
                          ctx->saved_data["dilation"].toIntVector(), ctx->saved_data["scale"].toDouble());
    if (ctx->needs_input_grad(0)) res[0] = dq;
    if (ctx->needs_input_grad(1)) res[1] = dk;
    if (ctx->needs_input_grad(2)) res[2] = dv;
    return once_differentiable(std::move(res), "neighbourhood attention", recording);
  }
};

at::Tensor na_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef kernel,
                       at::OptionalIntArrayRef dilation, std::optional<double> scale) {
  return PlainFn::apply(q, k, v, kernel.vec(), dilation_of(kernel, dilation), scale_of(q, scale));
}

// ---- ShardTensors ----

[[noreturn]] void refuse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& why,
                         const std::string& remedy) {
  std::ostringstream os;
  os << "ShardTensor neighborhood_attention (query: " << describe(q) << ", key: " << describe(k)
     << ", value: " << describe(v) << "): " << why << ". Remedy: " << remedy;
  TORCH_CHECK_NOT_IMPLEMENTED(false, os.str());
}

// The key windows of q's layout: for each sharded spatial dim (mesh-dim order) the global key rows every
// coordinate's queries read, and this rank's local geometry. Specs only, cached, shared by forward and backward.
// With one sharded spatial dim, also the border split of this rank's queries (na_split).
// With several sharded spatial dims, the border queries are computed in slabs (na_multi_forward).
struct NaSlab {
  size_t step = 0;                                   // the plan dim whose border it is
  std::vector<std::pair<int64_t, int64_t>> queries;  // per plan dim: local rows
  std::vector<std::pair<int64_t, int64_t>> keys;     // per plan dim: window positions their windows cover
};

struct NaPlan {
  comm::HaloPlan halo;
  na::Geometry geometry;       // the rank's queries against its key window (k_offset: the window's first row)
  na::Geometry main_geometry;  // the main call: the rank's rows as a tensor of their own along the split dims
  comm::BorderSplit split;     // one sharded dim; direct: the copy-free execution applies
  bool multi_direct = false;   // several sharded dims, each with an interior: the copy-free execution applies
  std::vector<NaSlab> slabs;   // its border slabs, in plan-dim order
};

// Border queries read a key row of another rank, or get another window when the rank's rows are taken as a whole
// tensor (the main call's geometry clamps windows inward at the rank's edges, the true one at the tensor's). The
// others (the interior) get their true window from the main call. The window start is monotone in the query
// within a dilation group, so the interior is one range; it is checked query by query all the same, and a rank
// whose interior is not one range, or whose rows are too few for a window (e < K * dilation, the main call's
// geometry would be invalid), computes every query from its window, which is then a few rows.
comm::BorderSplit na_split(const na::Geometry& g, const na::Geometry& main, int64_t i, int64_t e,
                           int64_t window_rows) {
  comm::BorderSplit split;
  split.direct = true;
  const auto K = g.kernel[i], dil = g.dilation[i], L = g.extent[i], a = g.q_offset[i], k0 = g.k_offset[i];
  auto all_border = [&] {
    split.main = false;
    split.borders = {{0, e, 0, window_rows}};
    return split;
  };
  if (e < K * dil) return all_border();
  auto interior = [&](int64_t j) {
    const auto ws = na::window_start(a + j, K, L, dil);
    return ws >= a && ws + (K - 1) * dil < a + e &&
        na::window_start(j, K, main.extent[i], dil) + a == ws;
  };
  int64_t first = -1, last = -1;
  for (int64_t j = 0; j < e; ++j)
    if (interior(j)) {
      if (first < 0) first = j;
      last = j;
    }
  if (first < 0) return all_border();
  for (auto j = first; j <= last; ++j)
    if (!interior(j)) return all_border();
  auto border = [&](int64_t begin, int64_t n) {
    const auto [lo, hi] = na::window_union(a + begin, n, K, L, dil);
    split.borders.push_back({begin, n, lo - k0, hi - lo});
  };
  if (first > 0) border(0, first);
  if (last + 1 < e) border(last + 1, e - last - 1);
  return split;
}

// Several sharded spatial dims without the window (na_multi_forward): the main call takes the rank's block as a
// tensor of its own along every split dim, and the queries that are border queries along some dim (na_split's,
// per dim: the windows are products of per-dim windows) are computed again in disjoint slabs: step k's slab holds
// its border queries along k, every query along the earlier dims and the interior ones along the later dims (whose
// windows are own rows), so it reads the halo of steps <= k only. Together the slabs cover every border query once.
// Applies when every dim has an interior (split.main); otherwise the rank gathers its window (a few rows then).
void plan_slabs(NaPlan& plan, const ShardSpec& spec) {
  const auto n = plan.halo.size();
  std::vector<comm::BorderSplit> splits;
  std::vector<std::pair<int64_t, int64_t>> interior;  // per plan dim: local rows [lo, hi)
  for (size_t k = 0; k < n; ++k) {
    const auto i = plan.halo.dim(k).dim - 1;
    const auto e = spec.local_shape[1 + i];
    plan.main_geometry.q_offset[i] = 0;
    plan.main_geometry.k_offset[i] = 0;
    plan.main_geometry.extent[i] = e;
    splits.push_back(na_split(plan.geometry, plan.main_geometry, i, e, plan.halo.window_rows(k)));
    if (!splits.back().direct || !splits.back().main) return;
    int64_t lo = 0, hi = e;
    for (const auto& b : splits.back().borders) {
      if (b.out_begin == lo) lo = b.out_begin + b.out_len;
      else hi = std::min(hi, b.out_begin);
    }
    interior.emplace_back(lo, std::max(lo, hi));
  }
  const auto& g = plan.geometry;
  for (size_t k = 0; k < n; ++k)
    for (const auto& b : splits[k].borders) {
      NaSlab slab;
      slab.step = k;
      bool empty = false;
      for (size_t d = 0; d < n; ++d) {
        const auto i = plan.halo.dim(d).dim - 1;
        const auto rows = d == k  ? std::make_pair(b.out_begin, b.out_len)
                          : d < k ? std::make_pair(int64_t{0}, spec.local_shape[1 + i])
                                  : std::make_pair(interior[d].first, interior[d].second - interior[d].first);
        empty = empty || rows.second == 0;
        slab.queries.push_back(rows);
        if (rows.second == 0) {
          slab.keys.emplace_back(0, 0);
          continue;
        }
        const auto [lo, hi] =
            na::window_union(g.q_offset[i] + rows.first, rows.second, g.kernel[i], g.extent[i], g.dilation[i]);
        slab.keys.emplace_back(lo - g.k_offset[i], hi - lo);
      }
      if (empty) continue;
      TORCH_INTERNAL_ASSERT(slab.keys[k] == std::make_pair(b.win_begin, b.win_len),
                            "neighborhood_attention: border slab keys [", slab.keys[k].first, ", +",
                            slab.keys[k].second, ") for [", b.win_begin, ", +", b.win_len, ")");
      plan.slabs.push_back(std::move(slab));
    }
  plan.multi_direct = true;
}

NaPlan make_na_plan(const ShardSpec& spec, const std::vector<int64_t>& kernel, const std::vector<int64_t>& dilation,
                    c10::Device device) {
  auto g = unpack(kernel, dilation);
  const auto nd = g.nd;
  for (int64_t d = 0; d < nd; ++d) {
    g.extent[d] = spec.global_shape[1 + d];
    g.q_offset[d] = spec.local_offset(1 + d);
  }
  std::vector<comm::HaloDim> dims;
  for (int64_t m = 0; m < spec.mesh->ndim(); ++m) {
    const auto& p = spec.placements[m];
    if (!p.is_shard() || p.dim < 1 || p.dim > nd) continue;
    comm::HaloDim hd{p.dim, m, spec.extents[m], {}};
    const auto i = p.dim - 1;
    for (int64_t c = 0; c < static_cast<int64_t>(hd.extents.size()); ++c) {
      std::vector<int64_t> rows;
      const auto e = hd.extents[c];
      if (e > 0) {
        const auto [lo, hi] = na::window_union(spec.offset_of(m, c), e, g.kernel[i], g.extent[i], g.dilation[i]);
        for (auto r = lo; r < hi; ++r) rows.push_back(r);
      }
      hd.want.push_back(std::move(rows));
    }
    const auto& mine = hd.want[spec.mesh->coordinate(m)];
    g.k_offset[i] = mine.empty() ? 0 : mine.front();
    dims.push_back(std::move(hd));
  }
  NaPlan plan{comm::HaloPlan(dims, spec.mesh->coordinates(), device), g, g, {}};
  if (plan.halo.size() == 1 && plan.halo.runs(0)) {
    const auto i = plan.halo.dim(0).dim - 1;
    const auto e = spec.local_shape[1 + i];
    plan.main_geometry.q_offset[i] = 0;
    plan.main_geometry.k_offset[i] = 0;
    plan.main_geometry.extent[i] = e;
    plan.split = na_split(g, plan.main_geometry, i, e, plan.halo.window_rows(0));
  }
  if (plan.halo.size() >= 2 && plan.halo.all_runs()) plan_slabs(plan, spec);
  return plan;
}

std::shared_ptr<const NaPlan> na_plan(const ShardSpec& spec, const std::vector<int64_t>& kernel,
                                      const std::vector<int64_t>& dilation, c10::Device device) {
  comm::PlanKey key;
  key.add_spec(spec).add_ints(kernel).add_ints(dilation).add_device(device);
  return comm::cached_plan<NaPlan>(key, [&] { return make_na_plan(spec, kernel, dilation, device); });
}

// SHARDTENSOR_HALO_OVERLAP=0 completes the exchange before the main call (to measure what the overlap gains).
bool overlap_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SHARDTENSOR_HALO_OVERLAP");
    return !(v && std::string(v) == "0");
  }();
  return enabled;
}

std::vector<at::Tensor> as_list(std::tuple<at::Tensor, at::Tensor> t) {
  return {std::get<0>(t), std::get<1>(t)};
}

std::vector<at::Tensor> as_list(std::tuple<at::Tensor, at::Tensor, at::Tensor> t) {
  return {std::get<0>(t), std::get<1>(t), std::get<2>(t)};
}

// Saved halo pieces: peers that sent nothing hold an empty tensor (a list of tensors holds no undefined one).
std::vector<at::Tensor> defined_pieces(std::vector<at::Tensor> pieces) {
  for (auto& p : pieces)
    if (!p.defined()) p = at::empty({0});
  return pieces;
}

// The border execution (comm/halo_borders.h) along the one sharded spatial dim: the main call runs every local
// query against the rank's own keys as a tensor of their own (right for the interior queries), while the halo
// rows travel; the border queries run against border windows (the halo rows and the few own rows they read) and
// are written over the main call's rows. Their log-sum-exps are kept aside for the backward and the main call's
// rows of them set to +inf, so that the backward's main call gives the border queries zero probabilities: no
// term of theirs (the border calls add those). Memory traffic beyond the single-device op: border rows only.
struct BorderForwardResult {
  at::Tensor out, lse;                       // lse: border rows +inf when there is a main call
  std::vector<at::Tensor> border_lse;        // by border
  std::vector<std::vector<at::Tensor>> received;
};

BorderForwardResult na_border_forward(const NaPlan& plan, const at::Tensor& ql, const at::Tensor& kl,
                                      const at::Tensor& vl, const Mesh& mesh, double scale) {
  const auto dim = plan.halo.dim(0).dim, i = dim - 1;
  auto kernel = [&](const std::vector<at::Tensor>& kv, const comm::BorderCall& c) {
    if (c.main) return as_list(local_forward(ql, kv[0], kv[1], plan.main_geometry, scale));
    auto g = plan.geometry;
    g.q_offset[i] += c.out_begin;
    g.k_offset[i] += c.first;
    return as_list(local_forward(ql.narrow(dim, c.out_begin, c.out_len), kv[0], kv[1], g, scale));
  };
  auto fw = comm::border_forward(plan.halo, plan.split, {kl, vl}, mesh, kernel, overlap_enabled());
  BorderForwardResult r{fw.outputs[0], fw.outputs[1], {}, {}};
  for (auto& pieces : fw.received) r.received.push_back(defined_pieces(std::move(pieces)));
  if (!plan.split.main) {
    r.border_lse.push_back(r.lse);
    return r;
  }
  for (const auto& b : plan.split.borders) {
    auto rows = r.lse.narrow(dim, b.out_begin, b.out_len);
    r.border_lse.push_back(rows.clone());
    rows.fill_(std::numeric_limits<double>::infinity());
  }
  return r;
}

std::vector<at::Tensor> na_border_backward(const NaPlan& plan, const at::Tensor& go, const at::Tensor& ql,
                                           const at::Tensor& kl, const at::Tensor& vl, const at::Tensor& out,
                                           const at::Tensor& lse, const std::vector<at::Tensor>& border_lse,
                                           const std::vector<std::vector<at::Tensor>>& received, const Mesh& mesh,
                                           double scale) {
  const auto dim = plan.halo.dim(0).dim, i = dim - 1;
  auto kernel = [&](const std::vector<at::Tensor>& kv, const comm::BorderCall& c) {
    if (c.main) return as_list(local_backward(go, ql, kv[0], kv[1], out, lse, plan.main_geometry, scale));
    size_t j = 0;
    while (plan.split.borders[j].out_begin != c.out_begin) ++j;
    auto g = plan.geometry;
    g.q_offset[i] += c.out_begin;
    g.k_offset[i] += c.first;
    auto rows = [&](const at::Tensor& t) { return t.narrow(dim, c.out_begin, c.out_len); };
    return as_list(local_backward(rows(go), rows(ql), kv[0], kv[1], rows(out), border_lse[j], g, scale));
  };
  return comm::border_backward(plan.halo, plan.split, {kl, vl}, received, 1, mesh, kernel);
}

// ---- several sharded spatial dims without the window ----

at::Tensor narrow_rows(at::Tensor t, const NaPlan& plan, const std::vector<std::pair<int64_t, int64_t>>& rows) {
  for (size_t d = 0; d < rows.size(); ++d) t = t.narrow(plan.halo.dim(d).dim, rows[d].first, rows[d].second);
  return t;
}

na::Geometry slab_geometry(const NaPlan& plan, const NaSlab& slab) {
  auto g = plan.geometry;
  for (size_t d = 0; d < slab.queries.size(); ++d) {
    const auto i = plan.halo.dim(d).dim - 1;
    g.q_offset[i] += slab.queries[d].first;
    g.k_offset[i] += slab.keys[d].first;
  }
  return g;
}

// k and v travel together, concatenated on the last dim: one message per peer and step (the gather path's
// messages). The key's or the value's part of the received pieces (views).
std::vector<std::vector<at::Tensor>> part_of(const std::vector<std::vector<at::Tensor>>& received, int64_t begin,
                                             int64_t len) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& step : received) {
    out.emplace_back();
    for (const auto& p : step)
      out.back().push_back(p.defined() && p.dim() > 1 ? p.narrow(-1, begin, len) : at::Tensor());
  }
  return out;
}

struct MultiForwardResult {
  at::Tensor out, lse;                             // lse: the slabs' rows +inf
  std::vector<at::Tensor> border_lse;              // by slab
  std::vector<std::vector<at::Tensor>> received;   // [step][peer]: k and v's halo, for the backward's slabs
};

// The forward over several sharded dims (NaPlan::slabs): the main call on the rank's own block while the first
// dim's halo travels; each further step sends the earlier dims' windows of its rows (the corners travel as a
// second hop, the gather path's messages), posted before the previous step's slabs are computed so it travels
// meanwhile. Each slab runs its queries against a region of the key window (halo-sized along its dim) and is
// written over the main call's rows; its log-sum-exps are kept aside and the main call's set to +inf, so the
// backward's main call gives those queries no terms. Memory traffic beyond the single-device op: the slabs.
MultiForwardResult na_multi_forward(const NaPlan& plan, const at::Tensor& ql, const at::Tensor& kl,
                                    const at::Tensor& vl, const Mesh& mesh, double scale) {
  const auto& halo = plan.halo;
  const auto n = halo.size();
  const bool overlap = overlap_enabled();
  const auto dk = kl.size(-1), dv = vl.size(-1);
  MultiForwardResult r;
  r.received.resize(n);
  // k's and v's parts of what has arrived (steps < s): what step s sends and step s - 1's slabs read.
  using Parts = std::vector<std::vector<at::Tensor>>;
  auto post = [&](size_t s, const Parts& rk, const Parts& rv) {
    auto shape = kl.sizes().vec();
    for (size_t j = 0; j < s; ++j) shape[halo.dim(j).dim] = halo.window_rows(j);
    shape.back() = dk + dv;
    return halo.post_rows(
        s,
        [&](int64_t first, int64_t count) {
          return at::cat({halo.assemble(kl, rk, s, first, count), halo.assemble(vl, rv, s, first, count)}, -1);
        },
        shape, kl, mesh);
  };
  auto first = post(0, {}, {});
  if (!overlap) r.received[0] = first.wait();
  std::tie(r.out, r.lse) = local_forward(ql, kl, vl, plan.main_geometry, scale);
  if (overlap) r.received[0] = first.wait();
  for (size_t s = 0; s < n; ++s) {
    const auto rk = part_of(r.received, 0, dk), rv = part_of(r.received, dk, dv);
    comm::PeerExchange next;
    if (s + 1 < n) {
      next = post(s + 1, rk, rv);
      if (!overlap) r.received[s + 1] = next.wait();
    }
    for (const auto& slab : plan.slabs) {
      if (slab.step != s) continue;
      auto [o, l] = local_forward(narrow_rows(ql, plan, slab.queries), halo.region(kl, rk, slab.keys, n),
                                  halo.region(vl, rv, slab.keys, n), slab_geometry(plan, slab), scale);
      narrow_rows(r.out, plan, slab.queries).copy_(o);
      narrow_rows(r.lse, plan, slab.queries).fill_(std::numeric_limits<double>::infinity());
      r.border_lse.push_back(l);
    }
    if (s + 1 < n && overlap) r.received[s + 1] = next.wait();
  }
  return r;
}

// Its backward: each slab's backward on its key region (the forward's halo, saved: nothing travels twice) gives its
// queries' dq and its dk/dv over the region, whose halo positions are gradient pieces that go home through the
// steps in reverse (HaloPlan::post_pieces, the gather path's scatter_add messages, k and v together); the last
// step's pieces travel while the main call's backward runs on the own block (the slabs' queries have no terms
// there: their lse is +inf). The slabs' dq are written over the main call's, their own rows' dk/dv added.
std::vector<at::Tensor> na_multi_backward(const NaPlan& plan, const at::Tensor& go, const at::Tensor& ql,
                                          const at::Tensor& kl, const at::Tensor& vl, const at::Tensor& out,
                                          const at::Tensor& lse, const std::vector<at::Tensor>& border_lse,
                                          const std::vector<std::vector<at::Tensor>>& received, const Mesh& mesh,
                                          double scale) {
  const auto& halo = plan.halo;
  const auto n = halo.size();
  const auto dk_len = kl.size(-1), dv_len = vl.size(-1);
  const auto rk = part_of(received, 0, dk_len), rv = part_of(received, dk_len, dv_len);
  auto dk_halo = halo.zero_pieces(kl), dv_halo = halo.zero_pieces(vl);
  std::vector<std::array<at::Tensor, 3>> slab_grads;
  at::Tensor none;
  for (size_t j = 0; j < plan.slabs.size(); ++j) {
    const auto& slab = plan.slabs[j];
    auto rows = [&](const at::Tensor& t) { return narrow_rows(t, plan, slab.queries); };
    auto [dq, dkr, dvr] = local_backward(rows(go), rows(ql), halo.region(kl, rk, slab.keys, n),
                                         halo.region(vl, rv, slab.keys, n), rows(out), border_lse.at(j),
                                         slab_geometry(plan, slab), scale);
    halo.add_region(none, dk_halo, n, slab.keys, dkr, /*skip_own=*/true);
    halo.add_region(none, dv_halo, n, slab.keys, dvr, /*skip_own=*/true);
    slab_grads.push_back({dq, dkr, dvr});
  }
  auto own_shape = kl.sizes().vec();
  own_shape.back() = dk_len + dv_len;
  auto post = [&](size_t s) {
    std::vector<std::vector<at::Tensor>> pieces(n);
    for (size_t p = 0; p < dk_halo[s].size(); ++p) pieces[s].push_back(at::cat({dk_halo[s][p], dv_halo[s][p]}, -1));
    return halo.post_pieces(s, own_shape, kl, pieces, mesh);
  };
  auto back = post(n - 1);
  auto [dq, dk, dv] = local_backward(go, ql, kl, vl, out, lse, plan.main_geometry, scale);
  for (size_t j = 0; j < plan.slabs.size(); ++j) {
    const auto& slab = plan.slabs[j];
    narrow_rows(dq, plan, slab.queries).copy_(slab_grads[j][0]);
    halo.add_region(dk, dk_halo, n, slab.keys, slab_grads[j][1], /*skip_own=*/false, /*skip_halo=*/true);
    halo.add_region(dv, dv_halo, n, slab.keys, slab_grads[j][2], /*skip_own=*/false, /*skip_halo=*/true);
  }
  for (size_t s = n; s-- > 0;) {
    if (s + 1 < n) back = post(s);
    std::vector<at::Tensor> bk, bv;
    for (const auto& b : back.wait()) {
      const bool rows = b.defined() && b.dim() > 1;
      bk.push_back(rows ? b.narrow(-1, 0, dk_len) : b);
      bv.push_back(rows ? b.narrow(-1, dk_len, dv_len) : b);
    }
    halo.add_piece_returns(s, dk, dk_halo, bk);
    halo.add_piece_returns(s, dv, dv_halo, bv);
  }
  return {dq, dk, dv};
}

// Saved pieces: a list of tensors holds no undefined one, and the steps' peer counts are kept to split it again.
std::vector<at::Tensor> flat_pieces(const std::vector<std::vector<at::Tensor>>& received) {
  std::vector<at::Tensor> out;
  for (const auto& step : received) {
    auto defined = defined_pieces(step);
    out.insert(out.end(), defined.begin(), defined.end());
  }
  return out;
}

std::vector<std::vector<at::Tensor>> unflat_pieces(const std::vector<at::Tensor>& flat, const NaPlan& plan,
                                                   const std::vector<int64_t>& counts) {
  std::vector<std::vector<at::Tensor>> out;
  size_t at = 0;
  for (auto c : counts) {
    out.emplace_back(flat.begin() + static_cast<int64_t>(at), flat.begin() + static_cast<int64_t>(at + c));
    at += c;
  }
  TORCH_INTERNAL_ASSERT(at == flat.size() && out.size() == plan.halo.size(), "neighborhood_attention: saved halo");
  return out;
}

// The general path (several sharded spatial dims, some without an interior): this rank's key window, gathered dim
// by dim (corners come along), k and v together (concatenated on the feature dim: one exchange per sharded dim).
std::pair<at::Tensor, at::Tensor> gather_kv(const NaPlan& plan, const at::Tensor& kl, const at::Tensor& vl,
                                            const Mesh& mesh) {
  auto kv = plan.halo.gather(at::cat({kl, vl}, -1), mesh);
  return {kv.narrow(-1, 0, kl.size(-1)), kv.narrow(-1, kl.size(-1), vl.size(-1))};
}

struct ShardFn : torch::autograd::Function<ShardFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& kernel, const std::vector<int64_t>& dilation, double scale) {
    ctx->set_materialize_grads(false);
    at::NoGradGuard no_grad;
    const auto qspec = shard_impl(q)->spec();
    const auto& mesh = *qspec->mesh;
    const auto &ql = shard_impl(q)->local(), &kl = shard_impl(k)->local(), &vl = shard_impl(v)->local();
    auto planp = na_plan(*qspec, kernel, dilation, ql.device());
    const auto& plan = *planp;
    at::Tensor out, lse;
    if (plan.halo.empty()) {
      std::tie(out, lse) = local_forward(ql, kl, vl, plan.geometry, scale);
    } else if (plan.split.direct) {
      auto r = na_border_forward(plan, ql, kl, vl, mesh, scale);
      out = r.out;
      lse = r.lse;
      ctx->saved_data["border_lse"] = r.border_lse;
      ctx->saved_data["k_halo"] = r.received[0];
      ctx->saved_data["v_halo"] = r.received[1];
    } else if (plan.multi_direct) {
      auto r = na_multi_forward(plan, ql, kl, vl, mesh, scale);
      out = r.out;
      lse = r.lse;
      ctx->saved_data["border_lse"] = r.border_lse;
      ctx->saved_data["kv_halo"] = flat_pieces(r.received);
      std::vector<int64_t> counts;
      for (const auto& step : r.received) counts.push_back(static_cast<int64_t>(step.size()));
      ctx->saved_data["kv_halo_counts"] = counts;
    } else {
      auto [kw, vw] = gather_kv(plan, kl, vl, mesh);
      std::tie(out, lse) = local_forward(ql, kw, vw, plan.geometry, scale);
      ctx->saved_data["kw"] = kw;
      ctx->saved_data["vw"] = vw;
    }
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["out"] = out;
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["kernel"] = kernel;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["scale"] = scale;
    auto out_shape = q.sizes().vec();
    out_shape.back() = v.size(-1);
    return make_shard_tensor(out, ShardSpec::make_with_dim_extents(qspec->mesh, qspec->placements, out_shape,
                                                                   qspec->dim_extents()));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool recording = at::GradMode::is_enabled();  // create_graph: read before any NoGradGuard
    variable_list res(6);
    if (!grads[0].defined()) return res;
    at::NoGradGuard no_grad;
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    const auto qspec = shard_impl(q)->spec();
    const auto& mesh = qspec->mesh;
    const auto &ql = shard_impl(q)->local(), &kl = shard_impl(k)->local(), &vl = shard_impl(v)->local();
    // The forward's plan (cached): nothing is planned again.
    auto planp = na_plan(*qspec, ctx->saved_data["kernel"].toIntVector(), ctx->saved_data["dilation"].toIntVector(),
                         ql.device());
    const auto& plan = *planp;
    const auto scale = ctx->saved_data["scale"].toDouble();
    auto out = ctx->saved_data["out"].toTensor();
    auto lse = ctx->saved_data["lse"].toTensor();
    auto out_shape = q.sizes().vec();
    out_shape.back() = v.size(-1);
    auto go = local_aligned(resolve_partial(dispatch::as_shard(grads[0], mesh)), mesh, out_shape, qspec->placements,
                            qspec->dim_extents());
    at::Tensor dq, dk, dv;
    if (plan.halo.empty()) {
      std::tie(dq, dk, dv) = local_backward(go, ql, kl, vl, out, lse, plan.geometry, scale);
    } else if (plan.split.direct) {
      auto g = na_border_backward(plan, go, ql, kl, vl, out, lse, ctx->saved_data["border_lse"].toTensorVector(),
                                  {ctx->saved_data["k_halo"].toTensorVector(),
                                   ctx->saved_data["v_halo"].toTensorVector()},
                                  *mesh, scale);
      dq = g[0];
      dk = g[1];
      dv = g[2];
    } else if (plan.multi_direct) {
      auto g = na_multi_backward(plan, go, ql, kl, vl, out, lse, ctx->saved_data["border_lse"].toTensorVector(),
                                 unflat_pieces(ctx->saved_data["kv_halo"].toTensorVector(), plan,
                                               ctx->saved_data["kv_halo_counts"].toIntVector()),
                                 *mesh, scale);
      dq = g[0];
      dk = g[1];
      dv = g[2];
    } else {
      at::Tensor dkw, dvw;
      std::tie(dq, dkw, dvw) = local_backward(go, ql, ctx->saved_data["kw"].toTensor(),
                                              ctx->saved_data["vw"].toTensor(), out, lse, plan.geometry, scale);
      // Window rows go home (summed where windows overlap), in reverse order of the gathers.
      auto dkv = plan.halo.scatter_add(at::cat({dkw, dvw}, -1), *mesh, /*consume=*/true);
      dk = dkv.narrow(-1, 0, k.size(-1)).contiguous();
      dv = dkv.narrow(-1, k.size(-1), v.size(-1)).contiguous();
    }
    if (ctx->needs_input_grad(0)) res[0] = make_shard_tensor(dq, qspec);
    if (ctx->needs_input_grad(1)) res[1] = make_shard_tensor(dk, shard_impl(k)->spec());
    if (ctx->needs_input_grad(2)) res[2] = make_shard_tensor(dv, shard_impl(v)->spec());
    return once_differentiable(std::move(res), "neighbourhood attention", recording);
  }
};

at::Tensor na_shard(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::IntArrayRef kernel,
                    at::OptionalIntArrayRef dilation_arg, std::optional<double> scale) {
  MeshPtr mesh;
  for (const auto* t : {&query, &key, &value}) {
    auto* i = shard_impl(*t);
    if (!i) continue;
    if (!mesh) mesh = i->spec()->mesh;
    else if (!mesh->same_as(*i->spec()->mesh))
      refuse(query, key, value, "the arguments live on different meshes",
             "redistribute them onto one mesh (full_tensor() then distribute_tensor)");
  }
  TORCH_INTERNAL_ASSERT(mesh, "neighborhood_attention: no ShardTensor argument");
  const auto dilation = dilation_of(kernel, dilation_arg);
  plain_geometry(query, key, value, kernel, dilation); // global shape checks, identical on every rank
  TORCH_CHECK_VALUE(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
                    "neighborhood_attention: query, key and value must have one dtype, got ", query.scalar_type(),
                    ", ", key.scalar_type(), ", ", value.scalar_type());
  const auto nd = static_cast<int64_t>(kernel.size());
  auto q = resolve_partial_diff(as_shard_input(query, mesh));
  const auto& qs = *shard_impl(q)->spec();
  std::vector<int> shards_of_dim(nd + 3, 0);
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    const auto& p = qs.placements[m];
    if (!p.is_shard()) continue;
    if (p.dim == nd + 2)
      refuse(query, key, value, "the head_dim (last dim) is sharded; each query-key dot product needs all of it",
             "redistribute query, key and value so the last dim is Replicate (shard a spatial, batch or heads dim "
             "instead)");
    if (++shards_of_dim[p.dim] > 1)
      refuse(query, key, value, "dim " + std::to_string(p.dim) + " is sharded on more than one mesh dim",
             "shard each tensor dim on at most one mesh dim (e.g. height on one mesh dim, width on another)");
  }
  // k and v follow q's layout (a no-op when they already share it).
  auto k = to_layout(resolve_partial_diff(as_shard_input(key, mesh)), qs.placements, qs.dim_extents());
  auto v = to_layout(resolve_partial_diff(as_shard_input(value, mesh)), qs.placements, qs.dim_extents());
  return ShardFn::apply(q, k, v, kernel.vec(), dilation, scale_of(query, scale));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(neighborhood_attention) {
  dispatch::set_handler("shardtensor::neighborhood_attention", typed_handler(&na_shard), dispatch::RuleLevel::above_autograd);
}

} // namespace shardtensor::ops

// The schemas are in src/library.cpp.

TORCH_LIBRARY_IMPL(shardtensor, CPU, m) {
  m.impl("neighborhood_attention", TORCH_FN(shardtensor::ops::na_backend));
  m.impl("neighborhood_attention_forward", TORCH_FN(shardtensor::ops::forward_op));
  m.impl("neighborhood_attention_backward", TORCH_FN(shardtensor::ops::backward_op));
}

TORCH_LIBRARY_IMPL(shardtensor, CUDA, m) {
  m.impl("neighborhood_attention", TORCH_FN(shardtensor::ops::na_backend));
  m.impl("neighborhood_attention_forward", TORCH_FN(shardtensor::ops::forward_op));
  m.impl("neighborhood_attention_backward", TORCH_FN(shardtensor::ops::backward_op));
}

TORCH_LIBRARY_IMPL(shardtensor, Meta, m) {
  m.impl("neighborhood_attention", TORCH_FN(shardtensor::ops::na_meta));
  m.impl("neighborhood_attention_forward", TORCH_FN(shardtensor::ops::forward_meta));
  m.impl("neighborhood_attention_backward", TORCH_FN(shardtensor::ops::backward_meta));
}

TORCH_LIBRARY_IMPL(shardtensor, Autograd, m) {
  m.impl("neighborhood_attention", TORCH_FN(shardtensor::ops::na_autograd));
}
