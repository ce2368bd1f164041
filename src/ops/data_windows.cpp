// Data-dependent windows (ops/data_windows.h).
#include "ops/data_windows.h"

#include "comm/collectives.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

namespace shardtensor::ops {

std::pair<int64_t, int64_t> rows_read(const at::Tensor& pixels, int64_t size, int64_t below, int64_t above,
                                      int64_t min_rows) {
  int64_t lo = 0, hi = 0;
  if (pixels.numel() > 0) {
    // Far-away points are clamped before the bounds (a huge coordinate must not overflow int64 below).
    auto f = at::floor(pixels).clamp(-4.0 * static_cast<double>(size) - 8, 4.0 * static_cast<double>(size) + 8);
    auto t_lo = f - static_cast<double>(below), t_hi = f + static_cast<double>(above);
    auto valid = at::isfinite(pixels).logical_and_(t_hi >= 0).logical_and_(t_lo <= static_cast<double>(size - 1));
    constexpr double big = 1e300;
    auto ends = at::stack({at::where(valid, t_lo, big).min(), at::where(valid, t_hi, -big).max()}).cpu();
    const auto a = ends[0].item<double>(), b = ends[1].item<double>();
    if (a <= b) {
      lo = std::max<int64_t>(0, static_cast<int64_t>(a));
      hi = std::min<int64_t>(size - 1, static_cast<int64_t>(b)) + 1;
    }
  }
  const auto least = std::min(min_rows, size);
  if (hi <= lo) return {0, least};
  while (hi - lo < least) {
    if (hi < size) ++hi;
    else --lo;
  }
  return {lo, hi};
}

DataWindows plan_data_windows(const std::vector<DataWindowDim>& dims, std::vector<std::pair<int64_t, int64_t>> ranges,
                              const Mesh& mesh, const c10::Device& device, const char* what,
                              const WindowRows& rows) {
  DataWindows w;
  std::vector<comm::HaloDim> halo;
  const std::string union_what = std::string(what) + " (window union)";
  for (size_t k = 0; k < dims.size(); ++k) {
    auto [lo, hi] = ranges.at(k);
    for (size_t j = k + 1; j < dims.size(); ++j) {
      for (const auto& r : comm::all_gather_ints({lo, hi}, mesh, dims[j].mesh_dim, union_what.c_str())) {
        if (r[1] <= r[0]) continue;
        lo = hi > lo ? std::min(lo, r[0]) : r[0];
        hi = std::max(hi, r[1]);
      }
    }
    const auto all = comm::all_gather_ints({lo, hi}, mesh, dims[k].mesh_dim, what);
    comm::RowRequests want(all.size());
    for (size_t c = 0; c < all.size(); ++c) {
      if (rows) {
        want[c] = rows(k, static_cast<int64_t>(c), all[c][0], all[c][1]);
      } else {
        for (int64_t r = all[c][0]; r < all[c][1]; ++r) want[c].push_back(r);
      }
    }
    halo.push_back({dims[k].dim, dims[k].mesh_dim, dims[k].extents, std::move(want)});
    w.range.emplace_back(lo, hi);
  }
  if (!halo.empty()) w.plan = comm::HaloPlan(halo, mesh.coordinates(), device);
  return w;
}

} // namespace shardtensor::ops
