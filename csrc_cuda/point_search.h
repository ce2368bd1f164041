// CUDA kernel for the exact (brute-force) neighbour search of shardtensor::knn / radius_search on CUDA tensors.
// Plain C++ declarations: no CUDA headers needed by the callers.
#pragma once

#include <cstdint>

namespace shardtensor::cuda {

// Largest coordinate count the kernel accepts: one tile of points (at least a few rows of `channels` values)
// must fit the 48 KiB of static shared memory every device has.
int64_t point_search_max_channels(bool is_double);

// points [batch, n, channels], queries [batch, m, channels] contiguous, float (is_double = false) or double.
// For every query: up to `k` points with distance <= radius (radius = +inf: no bound), ordered by (distance, point
// index); indices [batch, m, k] (int64, -1 for unused slots) and distances [batch, m, k] (+inf for unused slots).
void point_search(const void* points, const void* queries, int64_t* indices, void* distances, int64_t batch, int64_t n,
                  int64_t m, int64_t channels, int64_t k, double radius, bool is_double, void* stream);

} // namespace shardtensor::cuda
