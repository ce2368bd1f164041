// Local neighbourhood-attention kernels (CPU loops here, CUDA in csrc_cuda/), shared by the single-device op and
// the domain-parallel handler. They take the global geometry, so one kernel serves both: the local queries sit at
// global positions q_offset + i, the local keys/values (a window) start at global position k_offset, and each
// query's window is the K positions starting at clamp(g - K/2, 0, extent - K) along every spatial dim.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <tuple>

namespace shardtensor::ops::na {

struct Geometry {
  int64_t nd = 0; // spatial dims, 1..3
  std::array<int64_t, 3> kernel{1, 1, 1};
  std::array<int64_t, 3> q_offset{0, 0, 0};
  std::array<int64_t, 3> k_offset{0, 0, 0};
  std::array<int64_t, 3> extent{1, 1, 1}; // global spatial sizes
};

// First key (global) of the window of the query at global position g.
inline int64_t window_start(int64_t g, int64_t kernel, int64_t extent) {
  const auto s = g - kernel / 2;
  return s < 0 ? 0 : (s > extent - kernel ? extent - kernel : s);
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
