#include "comm/halo_borders.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace shardtensor::comm {

namespace {
// The first input row output `o` reads.
int64_t o_start(int64_t o, int64_t stride, int64_t padding) {
  return o * stride - padding;
}
} // namespace

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
  // The main call's output count (pooling's ceil mode as PyTorch counts it; a convolution floors).
  if (pool_output_size(e, SlidingWindow{w.kernel, s, P, w.dilation, w.ceil_mode}) != n) return split;
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

BorderTerms border_terms(const std::vector<int64_t>& in_extents, const std::vector<int64_t>& out_extents,
                         int64_t coord, int64_t L, const SlidingWindow& w) {
  const auto n = static_cast<int64_t>(in_extents.size());
  std::vector<int64_t> in_off(n + 1, 0), out_off(n + 1, 0);
  for (int64_t c = 0; c < n; ++c) {
    in_off[c + 1] = in_off[c] + in_extents[c];
    out_off[c + 1] = out_off[c] + out_extents[c];
  }
  auto owner = [&](int64_t q) {
    return static_cast<int64_t>(std::upper_bound(in_off.begin() + 1, in_off.end(), q) - in_off.begin()) - 1;
  };
  const auto s = w.stride, span = w.span();
  // reads[c][r]: the range [first, last] of c's outputs (global) reading a row of r; only this rank's pairs are kept.
  std::vector<std::pair<int64_t, int64_t>> mine_read(n, {-1, -2}), read_mine(n, {-1, -2});
  auto note = [](std::pair<int64_t, int64_t>& range, int64_t o) {
    if (range.second < range.first) range = {o, o};
    else range = {std::min(range.first, o), std::max(range.second, o)};
  };
  for (int64_t c = 0; c < n; ++c) {
    const auto a = in_off[c], e = in_extents[c], b0 = out_off[c], nc = out_extents[c];
    auto scan = [&](int64_t j) {
      const auto o = b0 + j;
      for (int64_t t = 0; t < w.kernel; ++t) {
        const auto q = o * s - w.padding + t * w.dilation;
        if (q < 0 || q >= L || (q >= a && q < a + e)) continue;
        const auto r = owner(q);
        if (c == coord) note(mine_read[r], o);
        if (r == coord) note(read_mine[c], o);
      }
    };
    // Only outputs whose window leaves the rank's rows read another's: a few at each end.
    int64_t j = 0;
    for (; j < nc && o_start(b0 + j, s, w.padding) < a; ++j) scan(j);
    for (int64_t k = nc - 1; k >= j && o_start(b0 + k, s, w.padding) + span > a + e; --k) scan(k);
  }
  BorderTerms terms;
  terms.own_begin = in_off[coord];
  terms.own_rows = in_extents[coord];
  terms.send.assign(n, {0, 0});
  terms.recv.assign(n, {});
  for (int64_t r = 0; r < n; ++r) {
    if (r == coord) continue;
    const auto& [f, l] = mine_read[r];
    if (l >= f) terms.send[r] = {f - out_off[coord], l - f + 1};
    const auto& [f2, l2] = read_mine[r];
    if (l2 >= f2) terms.recv[r] = {l2 - f2 + 1, o_start(f2, s, w.padding), (l2 - f2) * s + span};
  }
  return terms;
}

std::vector<at::Tensor> border_forward(const HaloPlan& plan, const BorderSplit& split, const at::Tensor& local,
                                       const Mesh& mesh, const WindowKernel& kernel, bool overlap) {
  TORCH_INTERNAL_ASSERT(split.direct && plan.size() == 1 && plan.runs(0), "border_forward: not a direct split");
  const auto dim = plan.dim(0).dim;
  auto exchange = plan.post(0, local, mesh);
  std::vector<at::Tensor> received;
  if (!overlap) received = exchange.wait();
  auto out = kernel(local, split.padding, split.padding);
  if (overlap) received = exchange.wait();
  for (const auto& b : split.borders) {
    auto window = plan.window_slice(0, local, received, b.win_begin, b.win_len);
    auto part = kernel(window, 0, b.win_begin);
    for (size_t k = 0; k < out.size(); ++k) out[k].narrow(dim, b.out_begin, b.out_len).copy_(part[k]);
  }
  return out;
}

} // namespace shardtensor::comm
