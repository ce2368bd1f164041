// Local building blocks of shardtensor::knn / radius_search on plain tensors (CPU or CUDA): the exact search, the
// merge of two candidate lists, and the distance gradient. Used by the single-device ops and by the ring over
// point shards.
//
// Order of results (the tie rule): ascending distance, equal distances by ascending point index. Unused slots
// (fewer than k candidates) hold index -1 and distance +inf, so every row stays sorted.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>

namespace shardtensor::ops::points {

// Argument checks shared by every entry point (TORCH_CHECK_VALUE naming `op`): points [N, C] or [B, N, C], queries
// [M, C] or [B, M, C] with the same batch and C, one floating dtype (float or double).
void check_inputs(const std::string& op, const at::Tensor& points, const at::Tensor& queries);

// points [B, N, C], queries [B, M, C]: for each query the best `k` points with distance <= radius (radius = +inf:
// knn). Returns (indices int64 [B, M, k], distances [B, M, k]).
std::tuple<at::Tensor, at::Tensor> search(const at::Tensor& points, const at::Tensor& queries, int64_t k,
                                          double radius);

// The best `k` of two candidate lists [B, M, ka] and [B, M, kb] (rows sorted or not), by (distance, index) with
// index -1 last.
std::tuple<at::Tensor, at::Tensor> merge(const at::Tensor& idx_a, const at::Tensor& dist_a, const at::Tensor& idx_b,
                                         const at::Tensor& dist_b, int64_t k);

// Gradient of the distances d(q, p) = |q - p| (zero where the distance is 0) for the entries of `idx` [B, M, k]
// that fall into the point block `points` [B, Nb, C] starting at global index `offset`: adds the query gradient
// into `dq` [B, M, C] and, when `dp` is defined, the point gradient into `dp` [B, Nb, C].
void distance_backward(const at::Tensor& grad, const at::Tensor& idx, const at::Tensor& queries,
                       const at::Tensor& points, int64_t offset, at::Tensor& dq, at::Tensor* dp);

} // namespace shardtensor::ops::points

namespace shardtensor::ops::points {
// The op-level argument checks (TORCH_CHECK_VALUE), on global shapes: every rank raises alike.
void check_knn_args(const at::Tensor& points, const at::Tensor& queries, int64_t k);
void check_radius_args(const at::Tensor& points, const at::Tensor& queries, double radius, int64_t max_neighbors);
} // namespace shardtensor::ops::points
