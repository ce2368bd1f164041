#include "comm/halo_borders.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace shardtensor::comm {

BorderSplit border_split(const std::vector<int64_t>& in_extents, const std::vector<int64_t>& out_extents, int64_t coord,
                         int64_t L, const SlidingWindow& w, int64_t max_padding) {
  BorderSplit split;
  int64_t a = 0, b0 = 0;
  for (int64_t c = 0; c < coord; ++c) {
    a += in_extents[c];
    b0 += out_extents[c];
  }
  const auto e = in_extents[coord], n = out_extents[coord];
  const auto s = w.stride, span = w.span();
  if (n == 0 || e == 0) return split;
  // Window position 0 (this rank's first output's first tap) is global row ws; the main call starts its first
  // window P rows before the rank's first row, so P = a - ws lines the two up.
  const auto ws = b0 * s - w.padding;
  const auto P = a - ws;
  if (P < 0 || (max_padding >= 0 && P > max_padding)) return split;
  if (e + 2 * P < span || (e + 2 * P - span) / s + 1 != n) return split;
  // Outputs reading a row of another rank: below `a` only while the window starts below it, at or above a + e only
  // once it ends there, so two short scans find them (with dilation a window can skip the halo, hence per tap).
  auto reads = [&](int64_t j, auto&& outside) {
    for (int64_t t = 0; t < w.kernel; ++t) {
      const auto q = ws + j * s + t * w.dilation;
      if (q >= 0 && q < L && outside(q)) return true;
    }
    return false;
  };
  int64_t top = 0;  // outputs [0, top) read rows below a
  for (int64_t j = 0; j < n && ws + j * s < a; ++j)
    if (reads(j, [&](int64_t q) { return q < a; })) top = j + 1;
  int64_t bottom = n;  // outputs [bottom, n) read rows at or above a + e
  for (int64_t j = n - 1; j >= 0 && ws + j * s + span > a + e; --j)
    if (reads(j, [&](int64_t q) { return q >= a + e; })) bottom = j;
  if (top >= bottom) return split;  // no interior: the window is all border
  split.direct = true;
  split.padding = P;
  if (top > 0) split.borders.push_back({0, top, 0, (top - 1) * s + span});
  if (bottom < n) split.borders.push_back({bottom, n - bottom, bottom * s, (n - 1 - bottom) * s + span});
  return split;
}

at::Tensor border_forward(const HaloPlan& plan, const BorderSplit& split, const at::Tensor& local, const Mesh& mesh,
                          const WindowKernel& kernel, bool overlap) {
  TORCH_INTERNAL_ASSERT(split.direct && plan.size() == 1 && plan.runs(0), "border_forward: not a direct split");
  const auto dim = plan.dim(0).dim;
  auto exchange = plan.post(0, local, mesh);
  std::vector<at::Tensor> received;
  if (!overlap) received = exchange.wait();
  auto out = kernel(local, split.padding);
  if (overlap) received = exchange.wait();
  for (const auto& b : split.borders) {
    auto window = plan.window_slice(0, local, received, b.win_begin, b.win_len);
    out.narrow(dim, b.out_begin, b.out_len).copy_(kernel(window, 0));
  }
  return out;
}

} // namespace shardtensor::comm
