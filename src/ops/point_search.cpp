// shardtensor::knn and shardtensor::radius_search: exact neighbour search over point clouds with their kernels on
// plain tensors (CPU, CUDA) and the autograd function of the distances. ShardTensor inputs are handled above
// autograd by ops/point_search_shard.cpp.
//
// knn(points, queries, k): the k nearest points of every query by Euclidean distance.
// radius_search(points, queries, radius, max_neighbors): up to max_neighbors points with distance <= radius, the
// nearest first; unused slots hold index -1 and distance +inf (count per query: (indices >= 0).sum(-1)).
// Both order by ascending distance, ties by ascending point index (deterministic, comparable across layouts).
// The indices are integers (no gradient); the distances are differentiable w.r.t. points and queries.
#include "ops/point_search_kernels.h"
#include "ops/once_differentiable.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace shardtensor::ops::points {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using SearchResult = std::tuple<at::Tensor, at::Tensor>;

void check_knn(const at::Tensor& points, const at::Tensor& queries, int64_t k) {
  check_inputs("shardtensor.ops.knn", points, queries);
  TORCH_CHECK_VALUE(k >= 1, "shardtensor.ops.knn: k must be >= 1, got ", k);
  TORCH_CHECK_VALUE(k <= points.size(-2), "shardtensor.ops.knn: k = ", k, " exceeds the number of points (",
                    points.size(-2), "); pass k <= N or use radius_search, which pads missing neighbours");
}

void check_radius(const at::Tensor& points, const at::Tensor& queries, double radius, int64_t max_neighbors) {
  check_inputs("shardtensor.ops.radius_search", points, queries);
  TORCH_CHECK_VALUE(max_neighbors >= 1, "shardtensor.ops.radius_search: max_neighbors must be >= 1, got ",
                    max_neighbors);
  TORCH_CHECK_VALUE(!std::isnan(radius) && radius >= 0, "shardtensor.ops.radius_search: radius must be >= 0, got ",
                    radius);
}

SearchResult run_local(const at::Tensor& points, const at::Tensor& queries, int64_t k, double radius) {
  TORCH_CHECK_VALUE(points.device() == queries.device(), "knn/radius_search: points on ", points.device(),
                    " but queries on ", queries.device());
  const bool batched = points.dim() == 3;
  auto [idx, dist] = search(batched ? points : points.unsqueeze(0), batched ? queries : queries.unsqueeze(0), k,
                            radius);
  if (!batched) return {idx.squeeze(0), dist.squeeze(0)};
  return {idx, dist};
}

// Backend kernels (CPU and CUDA keys).
SearchResult knn_kernel(const at::Tensor& points, const at::Tensor& queries, int64_t k) {
  check_knn(points, queries, k);
  return run_local(points, queries, k, std::numeric_limits<double>::infinity());
}

SearchResult radius_kernel(const at::Tensor& points, const at::Tensor& queries, double radius, int64_t max_neighbors) {
  check_radius(points, queries, radius, max_neighbors);
  return run_local(points, queries, max_neighbors, radius);
}

// Shapes only (meta tensors, FakeTensor tracing under torch.compile).
SearchResult meta_result(const at::Tensor& queries, int64_t k) {
  auto shape = queries.sizes().vec();
  shape.back() = k;
  return {at::empty(shape, queries.options().dtype(at::kLong)), at::empty(shape, queries.options())};
}

SearchResult knn_meta(const at::Tensor& points, const at::Tensor& queries, int64_t k) {
  check_knn(points, queries, k);
  return meta_result(queries, k);
}

SearchResult radius_meta(const at::Tensor& points, const at::Tensor& queries, double radius, int64_t max_neighbors) {
  check_radius(points, queries, radius, max_neighbors);
  return meta_result(queries, max_neighbors);
}

// ---- autograd for plain tensors ----

SearchResult call_below_autograd(const at::Tensor& points, const at::Tensor& queries, int64_t k, double radius,
                                 bool is_knn) {
  at::AutoDispatchBelowADInplaceOrView guard;
  if (is_knn) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("shardtensor::knn", "")
                         .typed<SearchResult(const at::Tensor&, const at::Tensor&, int64_t)>();
    return op.call(points, queries, k);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardtensor::radius_search", "")
                       .typed<SearchResult(const at::Tensor&, const at::Tensor&, double, int64_t)>();
  return op.call(points, queries, radius, k);
}

struct PointSearchFn : torch::autograd::Function<PointSearchFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& points, const at::Tensor& queries, int64_t k,
                               double radius, bool is_knn) {
    ctx->set_materialize_grads(false);
    auto [idx, dist] = call_below_autograd(points, queries, k, radius, is_knn);
    ctx->save_for_backward({points, queries, idx});
    ctx->mark_non_differentiable({idx});
    return {idx, dist};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool recording = at::GradMode::is_enabled();  // create_graph: read before any NoGradGuard
    variable_list res(5);
    if (grads.size() < 2 || !grads[1].defined()) return res;
    auto saved = ctx->get_saved_variables();
    const auto &points = saved[0], &queries = saved[1], &idx = saved[2];
    const bool batched = points.dim() == 3;
    auto p = batched ? points : points.unsqueeze(0);
    auto q = batched ? queries : queries.unsqueeze(0);
    auto i = batched ? idx : idx.unsqueeze(0);
    auto g = batched ? grads[1] : grads[1].unsqueeze(0);
    auto dq = at::zeros_like(q);
    auto dp = at::zeros_like(p, at::MemoryFormat::Contiguous);
    distance_backward(g, i, q, p, 0, dq, points.requires_grad() ? &dp : nullptr);
    if (points.requires_grad()) res[0] = batched ? dp : dp.squeeze(0);
    if (queries.requires_grad()) res[1] = batched ? dq : dq.squeeze(0);
    return once_differentiable(std::move(res), "knn / radius_search", recording);
  }
};

SearchResult knn_autograd(const at::Tensor& points, const at::Tensor& queries, int64_t k) {
  auto out = PointSearchFn::apply(points, queries, k, std::numeric_limits<double>::infinity(), true);
  return {out[0], out[1]};
}

SearchResult radius_autograd(const at::Tensor& points, const at::Tensor& queries, double radius,
                             int64_t max_neighbors) {
  auto out = PointSearchFn::apply(points, queries, max_neighbors, radius, false);
  return {out[0], out[1]};
}

} // namespace

void check_knn_args(const at::Tensor& points, const at::Tensor& queries, int64_t k) {
  check_knn(points, queries, k);
}

void check_radius_args(const at::Tensor& points, const at::Tensor& queries, double radius, int64_t max_neighbors) {
  check_radius(points, queries, radius, max_neighbors);
}

} // namespace shardtensor::ops::points

// The schemas are in src/library.cpp.
TORCH_LIBRARY_IMPL(shardtensor, CPU, m) {
  m.impl("knn", TORCH_FN(shardtensor::ops::points::knn_kernel));
  m.impl("radius_search", TORCH_FN(shardtensor::ops::points::radius_kernel));
}

TORCH_LIBRARY_IMPL(shardtensor, CUDA, m) {
  m.impl("knn", TORCH_FN(shardtensor::ops::points::knn_kernel));
  m.impl("radius_search", TORCH_FN(shardtensor::ops::points::radius_kernel));
}

TORCH_LIBRARY_IMPL(shardtensor, Meta, m) {
  m.impl("knn", TORCH_FN(shardtensor::ops::points::knn_meta));
  m.impl("radius_search", TORCH_FN(shardtensor::ops::points::radius_meta));
}

TORCH_LIBRARY_IMPL(shardtensor, Autograd, m) {
  m.impl("knn", TORCH_FN(shardtensor::ops::points::knn_autograd));
  m.impl("radius_search", TORCH_FN(shardtensor::ops::points::radius_autograd));
}
