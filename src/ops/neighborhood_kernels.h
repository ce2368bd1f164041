// Local neighbourhood-attention kernels (CPU loops here, CUDA in csrc_cuda/), shared by the single-device op and
// the domain-parallel handler. They take the global geometry, so one kernel serves both: the local queries sit at
// global positions q_offset + i, the local keys/values (a window) start at global position k_offset, and each
// query's window is the K positions starting at clamp(g - K/2, 0, extent - K) along every spatial dim. With
// dilation d (NATTEN's rule), positions split into d interleaved groups (g mod d) and the same clamped window is
// taken inside the query's group: keys start + t*d, t < K.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <utility>

namespace shardtensor::ops::na {

struct Geometry {
  int64_t nd = 0; // spatial dims, 1..3
  std::array<int64_t, 3> kernel{1, 1, 1};
  std::array<int64_t, 3> dilation{1, 1, 1};
  std::array<int64_t, 3> q_offset{0, 0, 0};
  std::array<int64_t, 3> k_offset{0, 0, 0};
  std::array<int64_t, 3> extent{1, 1, 1}; // global spatial sizes
};

// First key (global) of the window of the query at global position g; the window's keys are start + t*dilation.
// Needs extent >= kernel * dilation (every group holds at least `kernel` positions).
inline int64_t window_start(int64_t g, int64_t kernel, int64_t extent, int64_t dilation = 1) {
  const auto r = g % dilation, ig = g / dilation;
  const auto len = (extent - r + dilation - 1) / dilation; // positions of g's group
  const auto s = ig - kernel / 2;
  return r + (s < 0 ? 0 : (s > len - kernel ? len - kernel : s)) * dilation;
}

// The global key rows [lo, hi) covering the windows of the queries at global positions [a, a + n), n > 0.
inline std::pair<int64_t, int64_t> window_union(int64_t a, int64_t n, int64_t kernel, int64_t extent,
                                                int64_t dilation) {
  if (dilation == 1) // window starts are monotone in the query position
    return {window_start(a, kernel, extent), window_start(a + n - 1, kernel, extent) + kernel};
  int64_t lo = extent, hi = 0;
  for (auto i = a; i < a + n; ++i) {
    const auto s = window_start(i, kernel, extent, dilation);
    lo = std::min(lo, s);
    hi = std::max(hi, s + (kernel - 1) * dilation + 1);
  }
  return {lo, hi};
}

// q [B, s..., H, D], k [B, t..., H, D], v [B, t..., H, Dv] (s, t: nd spatial sizes) -> out [B, s..., H, Dv] in
// q's dtype and lse [B, s..., H] in the accumulation type (double for double inputs, float otherwise).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const Geometry& g, double scale);

// Gradients of forward for the local queries: dq (like q) and dk/dv over the whole local key window (like k, v).
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                        const at::Tensor& lse, const Geometry& g, double scale);

} // namespace shardtensor::ops::na
