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
  auto run = [&](const std::vector<at::Tensor>& in, const BorderCall& c) {
    return kernel(in[0], c.padding, c.main ? c.padding : c.first);
  };
  return border_forward(plan, split, std::vector<at::Tensor>{local}, mesh, run, overlap).outputs;
}

namespace {
std::vector<int64_t> last_dims(const std::vector<at::Tensor>& ts) {
  std::vector<int64_t> out;
  for (const auto& t : ts) out.push_back(t.size(-1));
  return out;
}

std::vector<at::Tensor> border_windows(const HaloPlan& plan, const std::vector<at::Tensor>& locals,
                                       const std::vector<std::vector<at::Tensor>>& received,
                                       const BorderSplit::Border& b) {
  std::vector<at::Tensor> windows;
  for (size_t k = 0; k < locals.size(); ++k)
    windows.push_back(plan.window_slice(0, locals[k], received[k], b.win_begin, b.win_len));
  return windows;
}

BorderCall call_of(const BorderSplit::Border& b) {
  BorderCall c;
  c.first = b.win_begin;
  c.out_begin = b.out_begin;
  c.out_len = b.out_len;
  return c;
}
} // namespace

BorderForward border_forward(const HaloPlan& plan, const BorderSplit& split, const std::vector<at::Tensor>& locals,
                             const Mesh& mesh, const BorderKernel& kernel, bool overlap) {
  TORCH_INTERNAL_ASSERT(split.direct && plan.size() == 1 && plan.runs(0), "border_forward: not a direct split");
  TORCH_INTERNAL_ASSERT(split.main || split.borders.size() == 1, "border_forward: no main call and ",
                        split.borders.size(), " borders");
  const auto dim = plan.dim(0).dim;
  auto exchange = plan.post(0, locals, mesh);
  BorderForward r;
  auto arrive = [&] { r.received = HaloPlan::split_parts(exchange.wait(), last_dims(locals)); };
  if (!overlap || !split.main) arrive();
  if (!split.main) {
    r.outputs = kernel(border_windows(plan, locals, r.received, split.borders[0]), call_of(split.borders[0]));
    return r;
  }
  BorderCall main;
  main.main = true;
  main.padding = split.padding;
  main.out_len = -1;  // every output
  r.outputs = kernel(locals, main);
  if (overlap) arrive();
  for (const auto& b : split.borders) {
    auto part = kernel(border_windows(plan, locals, r.received, b), call_of(b));
    for (size_t k = 0; k < r.outputs.size(); ++k) r.outputs[k].narrow(dim, b.out_begin, b.out_len).copy_(part[k]);
  }
  return r;
}

namespace {
// The outputs of `out_len` that no border of `split` holds, as (first, count); with a main call the borders sit at
// the ends.
std::pair<int64_t, int64_t> interior_outputs(const BorderSplit& split, int64_t out_len) {
  int64_t lo = 0, hi = out_len;
  for (const auto& b : split.borders) {
    if (b.out_len == 0) continue;
    if (b.out_begin == lo) lo = b.out_begin + b.out_len;
    else hi = std::min(hi, b.out_begin);
  }
  return {lo, std::max(lo, hi) - lo};
}
} // namespace

BorderSlab border_slab(const std::vector<BorderSplit>& splits, const std::vector<SlidingWindow>& windows, size_t k,
                       const BorderSplit::Border& border, const std::vector<int64_t>& out_len) {
  BorderSlab slab;
  for (size_t d = 0; d < splits.size(); ++d) {
    const auto o = d == k  ? std::make_pair(border.out_begin, border.out_len)
                   : d < k ? std::make_pair<int64_t, int64_t>(0, int64_t{out_len[d]})
                           : interior_outputs(splits[d], out_len[d]);
    slab.empty = slab.empty || o.second == 0;
    slab.outputs.push_back(o);
    const auto& w = windows[d];
    slab.window.push_back(o.second > 0 ? std::make_pair(o.first * w.stride, (o.second - 1) * w.stride + w.span())
                                       : std::make_pair<int64_t, int64_t>(0, 0));
  }
  TORCH_INTERNAL_ASSERT(slab.empty || slab.window[k] == std::make_pair(border.win_begin, border.win_len),
                        "border slab: window [", slab.window[k].first, ", +", slab.window[k].second,
                        ") for the border's [", border.win_begin, ", +", border.win_len, ")");
  return slab;
}

bool multi_border_applies(const HaloPlan& plan, const std::vector<BorderSplit>& splits) {
  if (plan.size() < 2 || splits.size() != plan.size()) return false;
  for (size_t k = 0; k < plan.size(); ++k)
    if (!plan.runs(k) || !splits[k].direct || !splits[k].main) return false;
  return true;
}

std::vector<at::Tensor> multi_border_forward(const HaloPlan& plan, const std::vector<BorderSplit>& splits,
                                             const std::vector<SlidingWindow>& windows, const at::Tensor& local,
                                             const Mesh& mesh, const MultiWindowKernel& kernel, bool overlap) {
  TORCH_INTERNAL_ASSERT(multi_border_applies(plan, splits) && windows.size() == plan.size(),
                        "multi_border_forward: not a direct split over several dims");
  const auto n = plan.size();
  using Range = std::pair<int64_t, int64_t>;
  std::vector<std::vector<at::Tensor>> received(n);
  // Step k sends rows of the window along the dims of steps < k with the local rows of the later ones.
  auto post = [&](size_t k) {
    auto shape = local.sizes().vec();
    for (size_t d = 0; d < k; ++d) shape[plan.dim(d).dim] = plan.window_rows(d);
    return plan.post_rows(
        k,
        [&](int64_t first, int64_t count) {
          std::vector<Range> ranges;
          for (size_t d = 0; d < n; ++d)
            ranges.push_back(d < k    ? Range{0, plan.window_rows(d)}
                             : d == k ? Range{first, count}
                                      : Range{0, local.size(plan.dim(d).dim)});
          return plan.region(local, received, ranges, k);
        },
        shape, local, mesh);
  };
  auto first_step = post(0);
  if (!overlap) received[0] = first_step.wait();
  std::vector<int64_t> padding;
  for (const auto& s : splits) padding.push_back(s.padding);
  auto outs = kernel(local, padding, padding);
  TORCH_INTERNAL_ASSERT(!outs.empty(), "multi_border_forward: the kernel gave no output");
  if (overlap) received[0] = first_step.wait();
  const std::vector<int64_t> no_padding(n, 0);
  std::vector<int64_t> out_len;
  for (size_t d = 0; d < n; ++d) out_len.push_back(outs[0].size(plan.dim(d).dim));
  for (size_t k = 0; k < n; ++k) {
    PeerExchange next;
    if (k + 1 < n) {
      next = post(k + 1);
      if (!overlap) received[k + 1] = next.wait();
    }
    for (const auto& border : splits[k].borders) {
      if (border.out_len == 0) continue;
      const auto geometry = border_slab(splits, windows, k, border, out_len);
      if (geometry.empty) continue;
      std::vector<at::Tensor> dst;
      for (const auto& out : outs) {
        auto t = out;
        for (size_t d = 0; d < n; ++d) {
          const auto [first, count] = geometry.outputs[d];
          t = t.narrow(plan.dim(d).dim, first, count);
        }
        dst.push_back(t);
      }
      if (dst[0].numel() == 0) continue;  // an empty dim outside the plan (a batch): nothing to compute
      std::vector<int64_t> firsts;
      for (const auto& r : geometry.window) firsts.push_back(r.first);
      auto slab = kernel(plan.region(local, received, geometry.window, n), no_padding, firsts);
      TORCH_INTERNAL_ASSERT(slab.size() == outs.size(), "multi_border_forward: ", slab.size(), " slab outputs for ",
                            outs.size());
      for (size_t i = 0; i < outs.size(); ++i) {
        TORCH_INTERNAL_ASSERT(slab[i].sizes() == dst[i].sizes(), "multi_border_forward: slab ", slab[i].sizes(),
                              " for ", dst[i].sizes());
        dst[i].copy_(slab[i]);
      }
    }
    if (k + 1 < n && overlap) received[k + 1] = next.wait();
  }
  return outs;
}

namespace {
// border_backward's body: `windows(b)` gives border b's input windows (none for a linear op), `shapes` the local
// inputs' shapes (their gradients').
std::vector<at::Tensor> backward_of(const HaloPlan& plan, const BorderSplit& split,
                                    const std::vector<std::vector<int64_t>>& shapes, const at::TensorOptions& options,
                                    const std::function<std::vector<at::Tensor>(const BorderSplit::Border&)>& windows,
                                    const std::function<std::vector<at::Tensor>()>& own, size_t row_outputs,
                                    const Mesh& mesh, const BorderKernel& kernel) {
  TORCH_INTERNAL_ASSERT(split.direct && plan.size() == 1 && plan.runs(0), "border_backward: not a direct split");
  const auto dim = plan.dim(0).dim;
  const auto n_in = shapes.size();
  // The border calls first: their halo rows' gradients travel while the main call runs.
  std::vector<std::vector<at::Tensor>> parts;
  std::vector<std::pair<int64_t, at::Tensor>> slices;
  for (const auto& b : split.borders) {
    parts.push_back(kernel(windows(b), call_of(b)));
    const auto& p = parts.back();
    TORCH_INTERNAL_ASSERT(p.size() == row_outputs + n_in, "border_backward: the kernel gave ", p.size(), " tensors");
    std::vector<at::Tensor> grads(p.begin() + row_outputs, p.end());
    slices.emplace_back(b.win_begin, n_in == 1 ? grads[0] : at::cat(grads, -1));
  }
  auto packed_shape = shapes[0];
  std::vector<int64_t> last;
  packed_shape.back() = 0;
  for (const auto& s : shapes) {
    packed_shape.back() += s.back();
    last.push_back(s.back());
  }
  auto back = plan.post_returns(0, slices, packed_shape, at::empty({0}, options), mesh);
  const auto [own_pos, own_row, own_len] = plan.own_run(0);
  std::vector<at::Tensor> out;
  if (split.main) {
    BorderCall main;
    main.main = true;
    main.padding = split.padding;
    main.out_len = -1;  // every output
    out = kernel(own(), main);
    TORCH_INTERNAL_ASSERT(out.size() == row_outputs + n_in, "border_backward: the kernel gave ", out.size(),
                          " tensors");
    for (size_t j = 0; j < split.borders.size(); ++j) {
      const auto& b = split.borders[j];
      for (size_t k = 0; k < row_outputs; ++k)
        out[k].narrow(dim, b.out_begin, b.out_len).copy_(parts[j][k]);
      // The border window's own rows: their gradient adds to the main call's.
      const auto lo = std::max(b.win_begin, own_pos), hi = std::min(b.win_begin + b.win_len, own_pos + own_len);
      if (hi <= lo) continue;
      for (size_t k = 0; k < n_in; ++k)
        out[row_outputs + k]
            .narrow(dim, own_row + lo - own_pos, hi - lo)
            .add_(parts[j][row_outputs + k].narrow(dim, lo - b.win_begin, hi - lo));
    }
  } else {
    // One border covers every output: the gradient over the own rows is that window's part (a few rows).
    TORCH_INTERNAL_ASSERT(split.borders.size() == 1, "border_backward: no main call and ", split.borders.size(),
                          " borders");
    const auto& b = split.borders[0];
    out.assign(parts[0].begin(), parts[0].begin() + row_outputs);
    for (size_t k = 0; k < n_in; ++k) {
      auto g = at::zeros(shapes[k], parts[0][row_outputs + k].options());
      const auto lo = std::max(b.win_begin, own_pos), hi = std::min(b.win_begin + b.win_len, own_pos + own_len);
      if (hi > lo)
        g.narrow(dim, own_row + lo - own_pos, hi - lo)
            .copy_(parts[0][row_outputs + k].narrow(dim, lo - b.win_begin, hi - lo));
      out.push_back(g);
    }
  }
  auto pieces = HaloPlan::split_parts(back.wait(), last);
  for (size_t k = 0; k < n_in; ++k) plan.add_returns(0, out[row_outputs + k], pieces[k]);
  return out;
}
} // namespace

std::vector<at::Tensor> border_backward(const HaloPlan& plan, const BorderSplit& split,
                                        const std::vector<at::Tensor>& locals,
                                        const std::vector<std::vector<at::Tensor>>& received, size_t row_outputs,
                                        const Mesh& mesh, const BorderKernel& kernel) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : locals) shapes.push_back(t.sizes().vec());
  return backward_of(
      plan, split, shapes, locals[0].options(),
      [&](const BorderSplit::Border& b) { return border_windows(plan, locals, received, b); },
      [&] { return locals; }, row_outputs, mesh, kernel);
}

std::vector<at::Tensor> border_backward(const HaloPlan& plan, const BorderSplit& split, at::IntArrayRef shape,
                                        const at::TensorOptions& options, size_t row_outputs, const Mesh& mesh,
                                        const BorderKernel& kernel) {
  return backward_of(
      plan, split, {shape.vec()}, options, [](const BorderSplit::Border&) { return std::vector<at::Tensor>{}; },
      [] { return std::vector<at::Tensor>{}; }, row_outputs, mesh, kernel);
}

} // namespace shardtensor::comm
