// Pooling over sharded spatial dims by halo exchange: max_pool 2-3d (1-d through 2-d) with global indices,
// avg_pool 2-3d (any padding, ceil_mode, count_include_pad, divisor_override), adaptive avg/max pool 2-3d.
//
// Windowed pools follow the convolution plan: along a sharded spatial dim the output partition follows the global
// output grid (coordinate c owns the outputs whose window centres lie in its input range, as for convolutions;
// ceil_mode's extra window starts inside the input, so it has an owner too). Each rank gathers exactly the rows its windows read (-inf fill
// for max, zeros for avg) and runs the local kernel with padding 0 on sharded dims (the window is exact, so the local
// kernel yields exactly the owned outputs in either ceil_mode) and the original padding on the others.
//  - max: local window indices become flat indices over the global spatial plane; backward scatters the gradient
//    into the window at the window-local index and sends halo rows home.
//  - avg: the local kernel sums (divisor_override=1) and the sum is divided by the global divisor, which is a
//    product of per-dim factors computed from the spec (PyTorch's clip rules), so every count_include_pad /
//    ceil_mode / divisor_override combination is exact. When one divisor serves every output (divisor_override,
//    count_include_pad without overhanging windows, no padding) the kernels divide by it themselves, as on one
//    device: no pass over the output after them.
// Adaptive pools: output cell i reads rows [floor(i*L/n), ceil((i+1)*L/n)); a cell belongs to the rank that owns its
// first row; each rank gathers the rows of its cells and computes them with per-dim index ranges. An adaptive avg
// pool to size 1 along a sharded dim gives a Partial(sum) of local sums (no halo).
// Plans (comm/halo_plan) are cached per layout and arguments: the backward reuses the forward's and reads none of
// the input's data, so a pending-sum input is completed once, in the forward.
#include "comm/collectives.h"
#include "comm/functional.h"
#include "comm/halo_borders.h"
#include "comm/halo_plan.h"
#include "comm/host_metadata.h"
#include "comm/redistribute.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include <c10/util/irange.h>

#include <limits>

namespace shardtensor::ops {

namespace {

enum class PoolKind : int64_t { Max, Avg, AdaptiveAvg, AdaptiveMax };

// The arguments a pooling plan depends on (per spatial dim).
struct PoolArgs {
  PoolKind kind = PoolKind::Max;
  std::vector<int64_t> k, s, p, dil;  // windowed
  bool ceil = false, count_include_pad = true;
  std::optional<int64_t> divisor_override;
  std::vector<int64_t> out_size;      // adaptive
};

// One spatial dim's plan.
struct SpDim {
  int64_t dim = 0;         // tensor dim
  int64_t mesh_dim = -1;   // -1: not sharded
  int64_t L = 0, Lout = 0;
  std::vector<int64_t> in_ext, out_ext;
  comm::RowRequests want;  // sharded dims only
  int64_t o0 = 0, n = 0;   // this rank's first output cell and count
  int64_t ws = 0, W = 0;   // this rank's window: global start of row 0 (may be negative) and length
  bool partial = false;    // adaptive avg to size 1: Partial(sum) of local sums
  bool reduce = false;     // adaptive max to size 1: local max over own rows, then combined across the mesh dim
  // Adaptive pooling along a split dim: the cells this rank's rows touch, [t0, t0 + tn) (its own cells among them),
  // and by coordinate the cells whose partial sums travel: those this rank touches and the peer owns (sent), and
  // those it owns and the peer touches (received), as (first cell, count).
  int64_t t0 = 0, tn = 0;
  std::vector<std::pair<int64_t, int64_t>> send_cells, recv_cells;
};

// A pooling's plan: a pure function of the (resolved) input layout and the arguments, cached and shared by the
// forward and the backward. Its tensors (divisors, averaging matrices, cell rows) live on the input's device.
struct PoolPlan {
  int64_t nsp = 0;
  std::vector<SpDim> sp;       // spatial dims in order
  comm::HaloPlan halo;         // the gathered sharded dims, in mesh-dim order
  // Windowed pools with one gathered dim (spatial dim `split_sp`): how this rank runs without its window, when it
  // can (comm/halo_borders.h).
  comm::BorderSplit split;
  int64_t split_sp = -1;
  // Windowed pools with several gathered dims: each step's split, window and spatial dim, and whether this rank runs
  // without the window over them (comm::multi_border_forward).
  std::vector<comm::BorderSplit> splits;
  std::vector<comm::SlidingWindow> step_windows;
  std::vector<int64_t> step_sp;
  bool multi_direct = false;
  std::vector<int64_t> out_shape;
  Placements out_placements;
  DimExtents out_ext;
  bool no_outputs = false;
  std::vector<int64_t> local_out_shape, window_shape;
  at::Tensor divisor;                      // avg without divisor_override: this rank's global divisors (double)
  int64_t kernel_divisor = 1;              // avg: the divisor the local kernels apply (the divisor, when one for all)
  bool divides = false;                    // avg: the kernels' divisor is the global one (no division after them)
  std::vector<at::Tensor> avg_matrices;    // adaptive avg: per dim (n, W), double
  std::vector<at::Tensor> cell_rows;       // adaptive max: per dim (n, K) window rows of each cell
  std::vector<int64_t> cell_k;
  std::vector<int64_t> cell_n, cell_ws;            // adaptive max: per dim the table's cells and its window's row 0
  std::vector<std::vector<std::pair<int64_t, int64_t>>> cell_spans;  // adaptive max: per dim (first window row, rows)
};

int64_t expand(at::IntArrayRef v, int64_t i, int64_t dflt) {
  if (v.empty()) return dflt;
  return v.size() == 1 ? v[0] : v[i];
}

std::vector<int64_t> offsets(const std::vector<int64_t>& ext) {
  std::vector<int64_t> off(ext.size() + 1, 0);
  for (size_t i = 0; i < ext.size(); ++i) off[i + 1] = off[i] + ext[i];
  return off;
}

comm::SlidingWindow window_of(const PoolArgs& a, int64_t i) {
  return {a.k[i], a.s[i], a.p[i], a.dil.empty() ? 1 : a.dil[i], a.ceil};
}

// Windowed pooling along one spatial dim.
void plan_window_dim(SpDim& d, const Mesh& mesh, const comm::SlidingWindow& w) {
  d.Lout = comm::pool_output_size(d.L, w);
  if (d.mesh_dim < 0) {
    d.o0 = 0;
    d.n = d.Lout;
    d.ws = 0;
    d.W = d.L;
    return;
  }
  // Ceil mode's extra window starts inside the input, so it has an owner too; positions outside are filled.
  auto part = comm::sliding_window_partition(d.in_ext, d.L, d.Lout, w, comm::PadMode::Zeros);
  const auto me = mesh.coordinate(d.mesh_dim);
  d.out_ext = part.out_extents;
  d.o0 = part.out_begin(me);
  d.n = d.out_ext[me];
  d.ws = d.o0 * w.stride - w.padding;
  d.want = std::move(part.want);
  d.W = static_cast<int64_t>(d.want[me].size());
}

int64_t ad_start(int64_t i, int64_t L, int64_t n) { return (i * L) / n; }
int64_t ad_end(int64_t i, int64_t L, int64_t n) { return ((i + 1) * L + n - 1) / n; }

// Adaptive pooling along one spatial dim: output cell i reads rows [start(i), end(i)) and belongs to the rank
// owning row start(i).
void plan_adaptive_dim(SpDim& d, const Mesh& mesh, int64_t lout, bool allow_partial) {
  d.Lout = lout;
  if (d.mesh_dim < 0) {
    d.o0 = 0;
    d.n = lout;
    d.ws = 0;
    d.W = d.L;
    return;
  }
  const auto me = mesh.coordinate(d.mesh_dim);
  const auto off = offsets(d.in_ext);
  if (lout == 1) {
    // Each rank pools its own rows; avg: the output is a pending sum; max: combined across the mesh dim.
    (allow_partial ? d.partial : d.reduce) = true;
    d.o0 = 0;
    d.n = 1;
    d.ws = off[me];
    d.W = d.in_ext[me];
    return;
  }
  std::vector<int64_t> first(lout), last(lout);
  for (int64_t i = 0; i < lout; ++i) {
    first[i] = ad_start(i, d.L, lout);
    last[i] = ad_end(i, d.L, lout) - 1;
  }
  auto part = comm::primary_row_partition(d.in_ext, first, first, last);
  d.out_ext = part.out_extents;
  d.o0 = part.out_begin(me);
  d.n = d.out_ext[me];
  d.ws = d.n > 0 ? ad_start(d.o0, d.L, lout) : 0;
  d.want = std::move(part.want);
  d.W = static_cast<int64_t>(d.want[me].size());
  // The cells each coordinate's rows touch (a cell may straddle shards; cells overlap when they outnumber the rows).
  const auto coords = static_cast<int64_t>(d.in_ext.size());
  const auto out_off = offsets(d.out_ext);
  std::vector<std::pair<int64_t, int64_t>> touch(coords, {0, 0});
  for (int64_t c = 0; c < coords; ++c) {
    if (d.in_ext[c] == 0) continue;
    int64_t lo = 0;
    while (last[lo] < off[c]) ++lo;
    auto hi = lo;
    while (hi < lout && first[hi] < off[c + 1]) ++hi;
    touch[c] = {lo, hi};
  }
  auto overlap = [](std::pair<int64_t, int64_t> a, int64_t b0, int64_t b1) -> std::pair<int64_t, int64_t> {
    const auto lo = std::max(a.first, b0), hi = std::min(a.second, b1);
    return hi > lo ? std::make_pair(lo, hi - lo) : std::make_pair(int64_t{0}, int64_t{0});
  };
  d.t0 = touch[me].first;
  d.tn = touch[me].second - touch[me].first;
  TORCH_INTERNAL_ASSERT(d.n == 0 || (d.o0 >= d.t0 && d.o0 + d.n <= d.t0 + d.tn),
                        "adaptive pooling: a rank's cells start in its own rows");
  d.send_cells.assign(coords, {0, 0});
  d.recv_cells.assign(coords, {0, 0});
  for (int64_t q = 0; q < coords; ++q) {
    if (q == me) continue;
    d.send_cells[q] = overlap(touch[me], out_off[q], out_off[q + 1]);
    d.recv_cells[q] = overlap(touch[q], out_off[me], out_off[me + 1]);
  }
}

// Whether every coordinate of a split dim wants exactly its own rows, in order (no halo along it). The same answer on
// every rank: it reads every coordinate's requests.
bool reads_own_rows_only(const SpDim& d) {
  const auto off = offsets(d.in_ext);
  for (size_t c = 0; c < d.want.size(); ++c) {
    const auto& w = d.want[c];
    if (static_cast<int64_t>(w.size()) != d.in_ext[c]) return false;
    for (size_t j = 0; j < w.size(); ++j)
      if (w[j] != off[c] + static_cast<int64_t>(j)) return false;
  }
  return true;
}

const char* name_of(PoolKind kind) {
  switch (kind) {
    case PoolKind::Max: return "max_pool";
    case PoolKind::Avg: return "avg_pool";
    case PoolKind::AdaptiveAvg: return "adaptive_avg_pool";
    case PoolKind::AdaptiveMax: return "adaptive_max_pool";
  }
  return "pool";
}

void check_args(const PoolArgs& a, int64_t nsp) {
  if (a.kind == PoolKind::Avg)
    TORCH_CHECK(!a.divisor_override || *a.divisor_override != 0, "avg_pool: divisor must be not zero");
  if (a.kind == PoolKind::AdaptiveAvg || a.kind == PoolKind::AdaptiveMax)
    TORCH_CHECK(static_cast<int64_t>(a.out_size.size()) == nsp, name_of(a.kind), ": output_size must have ", nsp,
                " elements");
  for (int64_t i = 0; i < nsp; ++i) {
    if (a.kind == PoolKind::Max) {
      TORCH_CHECK(a.k[i] > 0 && a.s[i] > 0 && a.dil[i] > 0, "max_pool: kernel size, stride and dilation must be positive");
      TORCH_CHECK(a.p[i] >= 0 && a.p[i] <= ((a.k[i] - 1) * a.dil[i] + 1) / 2,
                  "max_pool: pad should be at most half of effective kernel size, but got pad=", a.p[i],
                  ", kernel_size=", a.k[i], " and dilation=", a.dil[i]);
    } else if (a.kind == PoolKind::Avg) {
      TORCH_CHECK(a.k[i] > 0 && a.s[i] > 0, "avg_pool: kernel size and stride must be positive");
      TORCH_CHECK(a.p[i] >= 0 && a.p[i] <= a.k[i] / 2, "avg_pool: pad should be at most half of kernel size, but got pad=",
                  a.p[i], " and kernel_size=", a.k[i]);
    } else {
      TORCH_CHECK(a.out_size[i] >= 0, name_of(a.kind), ": output size must be non-negative");
    }
  }
}

// Avg pooling: the global divisor of this rank's outputs (PyTorch's clip rules), a product of per-dim factors.
at::Tensor avg_divisor(const PoolPlan& plan, const PoolArgs& a, int64_t ndim) {
  at::Tensor div;
  for (int64_t i = 0; i < plan.nsp; ++i) {
    const auto& d = plan.sp[i];
    std::vector<double> f;
    for (int64_t o = d.o0; o < d.o0 + d.n; ++o) {
      const auto hs = o * a.s[i] - a.p[i];
      const auto he = std::min(hs + a.k[i], d.L + a.p[i]);
      const auto pool = he - hs;
      const auto cnt = std::min(he, d.L) - std::max<int64_t>(hs, 0);
      f.push_back(static_cast<double>(a.count_include_pad ? pool : cnt));
    }
    std::vector<int64_t> shape(ndim, 1);
    shape[d.dim] = d.n;
    auto t = at::tensor(f, at::TensorOptions().dtype(at::kDouble)).view(shape);
    div = div.defined() ? div * t : t;
  }
  return div;
}

// Adaptive avg pooling: averaging matrix of one dim, (n, W); row j averages the window rows of cell o0 + j.
at::Tensor avg_matrix(const SpDim& d) {
  auto m = at::zeros({d.n, d.W}, at::TensorOptions().dtype(at::kDouble));
  auto acc = m.accessor<double, 2>();
  for (int64_t j = 0; j < d.n; ++j) {
    const auto o = d.o0 + j;
    const auto s = d.partial ? 0 : ad_start(o, d.L, d.Lout) - d.ws;
    const auto e = d.partial ? d.W : ad_end(o, d.L, d.Lout) - d.ws;
    const auto len = d.partial ? d.L : e - s;
    for (auto r = s; r < e; ++r) acc[j][r] = 1.0 / static_cast<double>(len);
  }
  return m;
}

// Adaptive avg pooling along a split dim, from the own rows: (tn, own rows); row j holds the weights of the own rows in
// cell t0 + j (the cell's average restricted to them: a partial sum of the average).
at::Tensor touch_matrix(const SpDim& d, int64_t own_first, int64_t own_rows) {
  auto m = at::zeros({d.tn, own_rows}, at::TensorOptions().dtype(at::kDouble));
  auto acc = m.accessor<double, 2>();
  for (int64_t j = 0; j < d.tn; ++j) {
    const auto s = ad_start(d.t0 + j, d.L, d.Lout), e = ad_end(d.t0 + j, d.L, d.Lout);
    for (auto r = std::max(s, own_first); r < std::min(e, own_first + own_rows); ++r)
      acc[j][r - own_first] = 1.0 / static_cast<double>(e - s);
  }
  return m;
}

// Adaptive max pooling: (count, K) window rows of cells [first, first + count) of one dim, over a window whose row 0
// is global row `ws` and which holds `W` rows (a cell's rows clipped to it), a shorter cell padded with its last row
// again: a repeat of the last row can neither win a tie (the first maximum wins, and the real row comes first) nor
// name another row as the last NaN, so no mask is needed. A reduced dim (pooled to one cell across its mesh dim) takes
// the whole window.
at::Tensor cell_rows(const SpDim& d, int64_t first, int64_t count, int64_t ws, int64_t W, int64_t& kmax,
                     std::vector<std::pair<int64_t, int64_t>>& spans) {
  auto cell_start = [&](int64_t j) {
    return d.reduce ? 0 : std::max(ad_start(first + j, d.L, d.Lout) - ws, int64_t{0});
  };
  auto cell_end = [&](int64_t j) { return d.reduce ? W : std::min(ad_end(first + j, d.L, d.Lout) - ws, W); };
  kmax = 1;
  for (int64_t j = 0; j < count; ++j) kmax = std::max(kmax, cell_end(j) - cell_start(j));
  std::vector<int64_t> r(count * kmax);
  spans.clear();
  for (int64_t j = 0; j < count; ++j) {
    const auto s = cell_start(j), e = cell_end(j);
    spans.emplace_back(s, e - s);
    for (int64_t q = 0; q < kmax; ++q) r[j * kmax + q] = s + q < e ? s + q : e - 1;
  }
  return at::tensor(r, at::TensorOptions().dtype(at::kLong)).view({count, kmax});
}

PoolPlan make_pool_plan(const ShardSpec& spec, int64_t nsp, const PoolArgs& a, c10::Device device) {
  const auto what = name_of(a.kind);
  const auto nd = spec.ndim();
  TORCH_CHECK(nd == nsp + 1 || nd == nsp + 2, what, ": expected a ", nsp + 1, "-D or ", nsp + 2, "-D input, got ", nd, "-D");
  // As on one device: only a batch dim may be empty (an unbatched input has none).
  for (int64_t d = nd == nsp + 2 ? 1 : 0; d < nd; ++d)
    TORCH_CHECK(spec.global_shape[d] > 0, what, ": expected the input's non-batch dimensions to have positive length, "
                "but the input has a shape of ", at::IntArrayRef(spec.global_shape));
  check_args(a, nsp);
  const auto& mesh = *spec.mesh;
  PoolPlan plan;
  plan.nsp = nsp;
  plan.out_placements = spec.placements;
  plan.out_shape.assign(spec.global_shape.begin(), spec.global_shape.end() - nsp);
  for (size_t mi = 0; mi < spec.placements.size(); ++mi) {
    const auto& pl = spec.placements[mi];
    if (pl.is_shard() && pl.dim < nd - nsp) plan.out_ext[pl.dim] = spec.extents[mi];
  }
  const bool adaptive = a.kind == PoolKind::AdaptiveAvg || a.kind == PoolKind::AdaptiveMax;
  for (int64_t i = 0; i < nsp; ++i) {
    SpDim d;
    d.dim = nd - nsp + i;
    d.mesh_dim = spec.mesh_dim_of(d.dim);
    d.L = spec.global_shape[d.dim];
    if (d.mesh_dim >= 0) d.in_ext = spec.extents[d.mesh_dim];
    if (adaptive) {
      TORCH_CHECK(d.L > 0, what, ": input spatial sizes must be positive");
      plan_adaptive_dim(d, mesh, a.out_size[i], a.kind == PoolKind::AdaptiveAvg);
    } else {
      plan_window_dim(d, mesh, window_of(a, i));
      TORCH_CHECK(d.Lout >= 1, what, ": output size is too small (input ", d.L, ")");
    }
    plan.sp.push_back(std::move(d));
  }
  // Output layout and the gathered dims, in mesh-dim order.
  std::vector<std::pair<int64_t, int64_t>> by_mesh;
  for (size_t i = 0; i < plan.sp.size(); ++i) {
    auto& d = plan.sp[i];
    plan.out_shape.push_back(d.Lout);
    if (d.mesh_dim < 0) continue;
    if (d.partial) {
      plan.out_placements[d.mesh_dim] = Placement::partial(ReduceOp::Sum);
      continue;
    }
    if (d.reduce) {
      plan.out_placements[d.mesh_dim] = Placement::replicate();
      continue;
    }
    plan.out_ext[d.dim] = d.out_ext;
    // A dim whose every rank reads exactly its own rows exchanges nothing: the local rows are its window (windows
    // aligned with the shards -- a UNet's k2 s2 pooling of even extents --, an adaptive pass's kept dim, one row
    // per cell). Over two split dims one of them aligned, the other runs the one-dim window-free path.
    if (reads_own_rows_only(d)) continue;
    by_mesh.push_back({d.mesh_dim, static_cast<int64_t>(i)});
  }
  std::sort(by_mesh.begin(), by_mesh.end());
  std::vector<comm::HaloDim> halo_dims;
  for (auto& [m, i] : by_mesh) {
    const auto& d = plan.sp[i];
    halo_dims.push_back({d.dim, d.mesh_dim, d.in_ext, d.want});
  }
  // Max pooling fills outside rows with -inf (never selected); averages see zeros (their divisors are exact).
  const auto fill = comm::fill_value(a.kind == PoolKind::Max ? comm::PadMode::NegInf : comm::PadMode::Zeros);
  plan.halo = comm::HaloPlan(halo_dims, mesh.coordinates(), device, fill);
  // PyTorch's pooling kernels take at most half the kernel size as padding (dilation aside). avg_pool3d refuses an
  // input (before padding) shorter than its kernel: a main call on fewer own rows than the kernel builds the window
  // instead (it holds the padding rows).
  auto split_of = [&](int64_t i) {
    const auto& d = plan.sp[i];
    const auto w = window_of(a, i);
    auto split = comm::border_split(d.in_ext, d.out_ext, mesh.coordinate(d.mesh_dim), d.L, w, w.kernel / 2);
    if (a.kind == PoolKind::Avg && nsp == 3 && split.main && d.in_ext[mesh.coordinate(d.mesh_dim)] < w.kernel)
      split.direct = false;
    return split;
  };
  if (!adaptive && by_mesh.size() == 1 && plan.halo.runs(0)) {
    plan.split = split_of(by_mesh[0].second);
    plan.split_sp = by_mesh[0].second;
  }
  if (!adaptive && by_mesh.size() >= 2) {
    for (const auto& [m, i] : by_mesh) {
      plan.splits.push_back(split_of(i));
      plan.step_windows.push_back(window_of(a, i));
      plan.step_sp.push_back(i);
    }
    plan.multi_direct = comm::multi_border_applies(plan.halo, plan.splits);
  }
  plan.local_out_shape.assign(spec.local_shape.begin(), spec.local_shape.end() - nsp);
  plan.window_shape = plan.local_out_shape;
  for (int64_t d = 0; d < nd - nsp; ++d) plan.no_outputs = plan.no_outputs || spec.local_shape[d] == 0;
  for (const auto& d : plan.sp) {
    plan.local_out_shape.push_back(d.n);
    plan.window_shape.push_back(d.W);
    plan.no_outputs = plan.no_outputs || d.n == 0;
  }
  // What the kernels need besides the window, built once and kept on the device: host-side tensors that stay real
  // even while tracing (comm/host_metadata.h; the kernels take them through comm::plan_constant).
  comm::HostMetadataGuard host;
  if (a.kind == PoolKind::Avg && a.divisor_override) {
    plan.kernel_divisor = *a.divisor_override;
    plan.divides = true;
  }
  if (a.kind == PoolKind::Avg && !a.divisor_override && !plan.no_outputs) {
    auto div = avg_divisor(plan, a, nd);
    // One divisor for every output (count_include_pad without overhanging ceil windows, or no padding): the local
    // kernels divide, as the single-device kernel does, instead of a pass over the output after them.
    const auto lo = div.min().item<double>(), hi = div.max().item<double>();
    if (lo == hi && lo >= 1 && lo == static_cast<double>(static_cast<int64_t>(lo))) {
      plan.kernel_divisor = static_cast<int64_t>(lo);
      plan.divides = true;
    } else {
      plan.divisor = div.to(device);
    }
  }
  if (a.kind == PoolKind::AdaptiveAvg) {
    // The exchanged dim of a one-dim exchange pools the own rows into partial cells (cell_partials); a rank without
    // cells of its own may still hold rows of its neighbours' cells.
    for (const auto& d : plan.sp) {
      if (plan.halo.size() == 1 && d.dim == plan.halo.dim(0).dim)
        plan.avg_matrices.push_back(
            touch_matrix(d, spec.local_offset(d.dim), spec.local_shape[d.dim]).to(device));
      else
        plan.avg_matrices.push_back(avg_matrix(d).to(device));
    }
  }
  if (a.kind == PoolKind::AdaptiveMax) {
    // An exchanged dim takes the max over the own rows of every cell they touch (cell_partials); the other dims
    // their cells over their window.
    for (const auto& d : plan.sp) {
      bool touched = false;
      for (size_t h = 0; h < plan.halo.size(); ++h) touched = touched || d.dim == plan.halo.dim(h).dim;
      const auto first = touched ? d.t0 : d.o0, count = touched ? d.tn : d.n;
      const auto ws = touched ? spec.local_offset(d.dim) : d.ws, W = touched ? spec.local_shape[d.dim] : d.W;
      int64_t k;
      std::vector<std::pair<int64_t, int64_t>> spans;
      plan.cell_rows.push_back(cell_rows(d, first, count, ws, W, k, spans).to(device));
      plan.cell_spans.push_back(std::move(spans));
      plan.cell_k.push_back(k);
      plan.cell_n.push_back(count);
      plan.cell_ws.push_back(ws);
    }
  }
  return plan;
}

// The plan of pooling an input laid out as `spec` (Partial placements resolved), from the cache.
std::shared_ptr<const PoolPlan> pool_plan(const ShardSpec& spec, int64_t nsp, const PoolArgs& a, c10::Device device) {
  comm::PlanKey key;
  key.add(static_cast<int64_t>(a.kind)).add(nsp).add_spec(spec).add_ints(a.k).add_ints(a.s).add_ints(a.p);
  key.add_ints(a.dil).add(a.ceil).add(a.count_include_pad).add(a.divisor_override.value_or(0));
  key.add(a.divisor_override.has_value()).add_ints(a.out_size).add_device(device);
  return comm::cached_plan<PoolPlan>(key, [&] { return make_pool_plan(spec, nsp, a, device); });
}

void check_input(const at::Tensor& input, PoolKind kind) {
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(input), "ShardTensor ", name_of(kind), ": the input must be the ShardTensor");
}

// Forward: the input with pending sums completed, and its plan.
std::pair<at::Tensor, std::shared_ptr<const PoolPlan>> forward_plan(const at::Tensor& input, int64_t nsp,
                                                                     const PoolArgs& a) {
  check_input(input, a.kind);
  auto x = resolve_partial_once(input, false);
  auto plan = pool_plan(*shard_impl(x)->spec(), nsp, a, x.device());
  return {x, plan};
}

// Backward: the plan from the input's layout alone (the gradient needs none of its data, so a pending-sum input is
// not resolved again), and the spec of the gradient. `op_name` and `args`: the backward op and its tensor
// arguments, which must share the input's mesh.
std::pair<SpecPtr, std::shared_ptr<const PoolPlan>> backward_plan(std::string_view op_name,
                                                                  at::ArrayRef<at::Tensor> args,
                                                                  const at::Tensor& input, int64_t nsp,
                                                                  const PoolArgs& a) {
  check_input(input, a.kind);
  dispatch::common_mesh(op_name, args);
  auto spec = without_partial(shard_impl(input)->spec());
  return {spec, pool_plan(*spec, nsp, a, input.device())};
}

at::Tensor gather_window(const PoolPlan& plan, const at::Tensor& x) {
  return plan.halo.gather(shard_impl(x)->local(), *shard_impl(x)->spec()->mesh);
}

at::Tensor grad_local(const PoolPlan& plan, const at::Tensor& grad, const MeshPtr& mesh) {
  return local_aligned(resolve_partial(dispatch::as_shard(grad, mesh)), mesh, plan.out_shape, plan.out_placements,
                       plan.out_ext);
}

at::Tensor wrap_out(const PoolPlan& plan, const MeshPtr& mesh, const at::Tensor& local) {
  return wrap(local, mesh, plan.out_placements, plan.out_shape, plan.out_ext);
}

// Flat window index <-> flat global index over the spatial plane, in few passes over the indices (they are as many as
// the outputs; integer division is the costly pass). With window coordinates c_i (window sizes W_i, window starts
// s_i, global sizes L_i), w = sum_i c_i V_i and g = sum_i (s_i + c_i) G_i, V and G the row-major strides of W and L:
//   g = w + sum_i s_i G_i + sum_{i < n-1} (w div V_i) (L_{i+1} - W_{i+1}) G_{i+1}
// (the window's prefixes telescope); a term vanishes where the next dim's window is the whole dim, so a split of the
// first spatial dim costs one addition and a split of two dims one division. `parts`, by spatial dim (empty: none):
// the kernel's input held `rows` rows from window position `first` on along that dim (first -1: the whole window).
struct WindowPart {
  int64_t first = -1, rows = -1;
};

struct PlaneStrides {
  std::vector<int64_t> L, W, start, G, V;
  int64_t base = 0;
};

PlaneStrides plane_strides(const PoolPlan& plan, const std::vector<WindowPart>& parts = {}) {
  PlaneStrides p;
  const auto n = static_cast<size_t>(plan.nsp);
  for (size_t i = 0; i < n; ++i) {
    const auto& d = plan.sp[i];
    const bool part = i < parts.size() && parts[i].first >= 0;
    p.L.push_back(d.L);
    p.W.push_back(part ? parts[i].rows : d.W);
    p.start.push_back(part ? d.ws + parts[i].first : d.ws);
  }
  p.G.assign(n, 1);
  p.V.assign(n, 1);
  for (size_t i = n - 1; i-- > 0;) {
    p.G[i] = p.G[i + 1] * p.L[i + 1];
    p.V[i] = p.V[i + 1] * p.W[i + 1];
  }
  for (size_t i = 0; i < n; ++i) p.base += p.start[i] * p.G[i];
  return p;
}

// `idx` is the kernel's own index tensor: converted in place (the quotients are taken before it changes).
at::Tensor window_to_global_(const PoolPlan& plan, at::Tensor idx, const std::vector<WindowPart>& parts = {}) {
  const auto p = plane_strides(plan, parts);
  std::vector<std::pair<at::Tensor, int64_t>> terms;
  for (size_t i = 0; i + 1 < p.L.size(); ++i) {
    const auto coef = (p.L[i + 1] - p.W[i + 1]) * p.G[i + 1];
    if (coef != 0) terms.emplace_back(idx.div(p.V[i], "floor"), coef);
  }
  idx.add_(p.base);
  for (const auto& [q, coef] : terms) idx.add_(q, coef);
  return idx;
}

// The inverse: the global digits' prefixes P_i = g div G_i give the window coordinates c_i = P_i - P_{i-1} L_i - s_i,
// and w = g - sum_i s_i G_i - sum_{i < n-1} c_i (G_i - V_i).
at::Tensor global_to_window(const PoolPlan& plan, const at::Tensor& idx) {
  const auto p = plane_strides(plan);
  auto out = idx.sub(p.base);
  int64_t last = -1;  // the last dim whose term is not zero (prefixes are needed up to it)
  for (size_t i = 0; i + 1 < p.L.size(); ++i)
    if (p.G[i] != p.V[i]) last = static_cast<int64_t>(i);
  at::Tensor prev;
  for (int64_t i = 0; i <= last; ++i) {
    auto prefix = idx.div(p.G[i], "floor");
    const auto coef = p.G[i] - p.V[i];
    if (coef != 0) {
      auto c = i == 0 ? prefix.sub(p.start[0]) : prefix.sub(prev, p.L[i]).sub_(p.start[i]);
      out.sub_(c, coef);
    }
    prev = std::move(prefix);
  }
  return out;
}

// Scatter-add `g` (local output layout) into a window of the plan at window-flat indices, then send halos home.
// Padding 0 on sharded dims: the window is exact there, so the local kernel yields exactly the owned outputs.
std::vector<int64_t> local_padding(const PoolPlan& plan, const std::vector<int64_t>& p) {
  auto out = p;
  for (size_t i = 0; i < plan.sp.size(); ++i)
    if (plan.sp[i].mesh_dim >= 0) out[i] = 0;
  return out;
}

// `windowed`: a max pooling's arguments (kernel, stride, padding, ...): the window gradient comes from aten's own
// max-pooling backward kernel over the window-local indices (one vectorized pass) instead of a flat scatter_add;
// null for adaptive pooling, whose cells are no sliding window.
at::Tensor max_backward_common(const PoolPlan& plan, const at::Tensor& g, const at::Tensor& global_idx,
                               const Mesh& mesh, const PoolArgs* windowed = nullptr) {
  const auto& wshape = plan.window_shape;
  std::vector<int64_t> flat(wshape.begin(), wshape.end() - plan.nsp);
  int64_t wn = 1;
  for (const auto& d : plan.sp) wn *= d.W;
  flat.push_back(wn);
  if (plan.no_outputs || wn == 0) return plan.halo.scatter_add(at::zeros(wshape, g.options()), mesh, true);
  auto widx = global_to_window(plan, global_idx);
  if (windowed) {  // a sliding window reduces no dim to one cell: nothing to mask
    const auto& a = *windowed;
    auto like = at::zeros({}, g.options()).expand(wshape);  // only its shape is read
    const auto lp = local_padding(plan, a.p);
    auto gw = plan.nsp == 2 ? at::max_pool2d_with_indices_backward(g, like, a.k, a.s, lp, a.dil, a.ceil, widx)
                            : at::max_pool3d_with_indices_backward(g, like, a.k, a.s, lp, a.dil, a.ceil, widx);
    return plan.halo.scatter_add(gw, mesh, /*consume=*/true);  // gw: our own temporary
  }
  // Reduced dims: only the rank holding the selected row takes the gradient.
  auto gg = g;
  bool masked = false;
  for (const auto& d : plan.sp) masked = masked || d.reduce;
  if (masked) {  // the coordinates along every dim (only when some dim is reduced: divisions are costly)
    auto keep = at::ones_like(global_idx, global_idx.options().dtype(at::kBool));
    auto rem = global_idx;
    for (int64_t i = plan.nsp - 1; i >= 0; --i) {
      const auto& d = plan.sp[i];
      auto coord = rem.remainder(d.L);
      rem = rem.div(d.L, "floor");
      if (d.reduce) keep = keep.logical_and(coord.ge(d.ws)).logical_and(coord.lt(d.ws + d.W));
    }
    gg = at::where(keep, g, at::zeros({}, g.options()));
    widx = at::where(keep, widx, at::zeros({}, widx.options()));
  }
  const auto lead = g.dim() - plan.nsp;
  auto gi = at::zeros(flat, g.options()).scatter_add_(lead, widx.flatten(lead), gg.flatten(lead));
  return plan.halo.scatter_add(gi.view(wshape), mesh, /*consume=*/true);  // gi: our own temporary
}

// ---- max_pool{2,3}d_with_indices ----------------------------------------------------------------------------

PoolArgs max_args(int64_t nsp, at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef padding,
                  at::IntArrayRef dilation, bool ceil) {
  PoolArgs a;
  a.kind = PoolKind::Max;
  a.ceil = ceil;
  for (int64_t i = 0; i < nsp; ++i) {
    a.k.push_back(expand(kernel, i, 1));
    a.s.push_back(expand(stride, i, a.k.back()));
    a.p.push_back(expand(padding, i, 0));
    a.dil.push_back(expand(dilation, i, 1));
  }
  return a;
}

// The local max pooling of `in` with padding `lp` by spatial dim (window indices over `in`, converted by the caller).
std::tuple<at::Tensor, at::Tensor> local_max_pool(int64_t nsp, const at::Tensor& in, const PoolArgs& a,
                                                  at::IntArrayRef lp) {
  return nsp == 2 ? at::max_pool2d_with_indices(in, a.k, a.s, lp, a.dil, a.ceil)
                  : at::max_pool3d_with_indices(in, a.k, a.s, lp, a.dil, a.ceil);
}

std::tuple<at::Tensor, at::Tensor> max_pool(int64_t nsp, const at::Tensor& self, const PoolArgs& a) {
  auto [x, planp] = forward_plan(self, nsp, a);
  const auto& plan = *planp;
  const auto& mesh = shard_impl(x)->spec()->mesh;
  if (plan.split.direct && !plan.no_outputs) {
    const auto dim = plan.sp[plan.split_sp].dim;
    auto kernel = [&](const at::Tensor& in, int64_t pad, int64_t first) -> std::vector<at::Tensor> {
      auto lp = local_padding(plan, a.p);
      lp[plan.split_sp] = pad;
      auto [o, i] = local_max_pool(nsp, in, a, lp);
      // Indices name rows of the kernel's input: the main call's starts at window position `pad`, a border
      // window's at its first position.
      std::vector<WindowPart> parts(nsp);
      parts[plan.split_sp] = {first, in.size(dim)};
      return {o, window_to_global_(plan, i, parts)};
    };
    auto outs = comm::border_forward(plan.halo, plan.split, shard_impl(x)->local(), *mesh, kernel);
    return {wrap_out(plan, mesh, outs[0]), wrap_out(plan, mesh, outs[1])};
  }
  if (plan.multi_direct && !plan.no_outputs) {
    auto kernel = [&](const at::Tensor& in, const std::vector<int64_t>& pad, const std::vector<int64_t>& first) {
      auto lp = local_padding(plan, a.p);
      std::vector<WindowPart> parts(nsp);
      for (size_t k = 0; k < plan.step_sp.size(); ++k) {
        const auto sp = plan.step_sp[k];
        lp[sp] = pad[k];
        parts[sp] = {first[k], in.size(plan.sp[sp].dim)};
      }
      auto [o, i] = local_max_pool(nsp, in, a, lp);
      return std::vector<at::Tensor>{o, window_to_global_(plan, i, parts)};
    };
    auto outs = comm::multi_border_forward(plan.halo, plan.splits, plan.step_windows, shard_impl(x)->local(), *mesh,
                                           kernel);
    return {wrap_out(plan, mesh, outs[0]), wrap_out(plan, mesh, outs[1])};
  }
  auto window = gather_window(plan, x);
  at::Tensor out, idx;
  if (plan.no_outputs) {
    out = at::zeros(plan.local_out_shape, window.options());
    idx = at::zeros(plan.local_out_shape, window.options().dtype(at::kLong));
  } else {
    std::tie(out, idx) = local_max_pool(nsp, window, a, local_padding(plan, a.p));
    idx = window_to_global_(plan, idx);
  }
  return {wrap_out(plan, mesh, out), wrap_out(plan, mesh, idx)};
}

at::Tensor max_pool_backward(std::string_view op_name, int64_t nsp, const at::Tensor& grad_output,
                             const at::Tensor& self, const PoolArgs& a, const at::Tensor& indices) {
  auto [spec, planp] = backward_plan(op_name, {grad_output, self, indices}, self, nsp, a);
  const auto& plan = *planp;
  const auto& mesh = spec->mesh;
  auto g = grad_local(plan, grad_output, mesh);
  auto idx = local_aligned(dispatch::as_shard(indices, mesh), mesh, plan.out_shape, plan.out_placements, plan.out_ext);
  return make_shard_tensor(max_backward_common(plan, g, idx, *mesh, &a), spec);
}

// max_pool2d_with_indices(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, int[2] dilation=1,
//                         bool ceil_mode=False) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> max_pool2d_rule(const at::Tensor& self, at::IntArrayRef kernel_size,
                                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                                   at::IntArrayRef dilation, bool ceil_mode) {
  return max_pool(2, self, max_args(2, kernel_size, stride, padding, dilation, ceil_mode));
}

// max_pool3d_with_indices(Tensor self, int[3] kernel_size, int[3] stride=[], int[3] padding=0, int[3] dilation=1,
//                         bool ceil_mode=False) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> max_pool3d_rule(const at::Tensor& self, at::IntArrayRef kernel_size,
                                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                                   at::IntArrayRef dilation, bool ceil_mode) {
  return max_pool(3, self, max_args(3, kernel_size, stride, padding, dilation, ceil_mode));
}

// max_pool2d_with_indices_backward(Tensor grad_output, Tensor self, int[2] kernel_size, int[2] stride,
//                                  int[2] padding, int[2] dilation, bool ceil_mode, Tensor indices) -> Tensor
at::Tensor max_pool2d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                    bool ceil_mode, const at::Tensor& indices) {
  return max_pool_backward("aten::max_pool2d_with_indices_backward", 2, grad_output, self,
                           max_args(2, kernel_size, stride, padding, dilation, ceil_mode), indices);
}

// max_pool3d_with_indices_backward(Tensor grad_output, Tensor self, int[3] kernel_size, int[3] stride,
//                                  int[3] padding, int[3] dilation, bool ceil_mode, Tensor indices) -> Tensor
at::Tensor max_pool3d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                    bool ceil_mode, const at::Tensor& indices) {
  return max_pool_backward("aten::max_pool3d_with_indices_backward", 3, grad_output, self,
                           max_args(3, kernel_size, stride, padding, dilation, ceil_mode), indices);
}

// ---- avg_pool{2,3}d -------------------------------------------------------------------------------------------

PoolArgs avg_args(int64_t nsp, at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef padding, bool ceil,
                  bool count_include_pad, std::optional<int64_t> divisor_override) {
  PoolArgs a;
  a.kind = PoolKind::Avg;
  for (int64_t i = 0; i < nsp; ++i) {
    a.k.push_back(expand(kernel, i, 1));
    a.s.push_back(expand(stride, i, a.k.back()));
    a.p.push_back(expand(padding, i, 0));
  }
  a.ceil = ceil;
  a.count_include_pad = count_include_pad;
  a.divisor_override = divisor_override;
  return a;
}

// The global divisor of this rank's outputs (broadcastable to the local output), when the kernels do not divide.
at::Tensor divisor_of(const PoolPlan& plan, const PoolArgs& a, const at::Tensor& like) {
  TORCH_INTERNAL_ASSERT(!plan.divides, "avg_pool: the kernels divide already");
  return comm::plan_constant(plan.divisor, like).to(like.options());
}

// The kernels' sum, divided by the global divisor (by the kernels themselves when it is one for all outputs).
at::Tensor averaged(const PoolPlan& plan, const PoolArgs& a, const at::Tensor& sum) {
  return plan.divides ? sum : sum.div(divisor_of(plan, a, sum));
}

bool low_precision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

// The local kernels' sum (or average, when plan.divides) of `in` with padding `lp` by spatial dim; half-precision
// inputs pooled in float (rounded once by the caller).
at::Tensor local_avg_pool(const PoolPlan& plan, const at::Tensor& in, const PoolArgs& a, at::IntArrayRef lp) {
  auto w = low_precision(in) ? in.to(at::kFloat) : in;
  return plan.nsp == 2 ? at::avg_pool2d(w, a.k, a.s, lp, a.ceil, true, plan.kernel_divisor)
                       : at::avg_pool3d(w, a.k, a.s, lp, a.ceil, true, plan.kernel_divisor);
}

at::Tensor avg_pool(int64_t nsp, const at::Tensor& self, const PoolArgs& a) {
  auto [x, planp] = forward_plan(self, nsp, a);
  const auto& plan = *planp;
  const auto& local = shard_impl(x)->local();
  const auto& mesh = shard_impl(x)->spec()->mesh;
  if (plan.split.direct && !plan.no_outputs) {
    auto kernel = [&](const at::Tensor& in, int64_t pad, int64_t) -> std::vector<at::Tensor> {
      auto lp = local_padding(plan, a.p);
      lp[plan.split_sp] = pad;
      return {local_avg_pool(plan, in, a, lp)};
    };
    auto sum = comm::border_forward(plan.halo, plan.split, local, *mesh, kernel)[0];
    return wrap_out(plan, mesh, averaged(plan, a, sum).to(local.scalar_type()));
  }
  if (plan.multi_direct && !plan.no_outputs) {
    auto kernel = [&](const at::Tensor& in, const std::vector<int64_t>& pad, const std::vector<int64_t>&) {
      auto lp = local_padding(plan, a.p);
      for (size_t k = 0; k < plan.step_sp.size(); ++k) lp[plan.step_sp[k]] = pad[k];
      return std::vector<at::Tensor>{local_avg_pool(plan, in, a, lp)};
    };
    auto sum = comm::multi_border_forward(plan.halo, plan.splits, plan.step_windows, local, *mesh, kernel)[0];
    return wrap_out(plan, mesh, averaged(plan, a, sum).to(local.scalar_type()));
  }
  auto window = gather_window(plan, x);
  at::Tensor out;
  if (plan.no_outputs) {
    out = at::zeros(plan.local_out_shape, window.options());
  } else {
    out = averaged(plan, a, local_avg_pool(plan, window, a, local_padding(plan, a.p))).to(window.scalar_type());
  }
  return wrap_out(plan, mesh, out);
}

at::Tensor avg_pool_backward(std::string_view op_name, int64_t nsp, const at::Tensor& grad_output,
                             const at::Tensor& self, const PoolArgs& a) {
  auto [spec, planp] = backward_plan(op_name, {grad_output, self}, self, nsp, a);
  const auto& plan = *planp;
  auto g = grad_local(plan, grad_output, spec->mesh);
  at::Tensor gi;
  if (plan.no_outputs) {
    gi = at::zeros(plan.window_shape, g.options());
  } else {
    auto gf = low_precision(g) ? g.to(at::kFloat) : g;
    gf = averaged(plan, a, gf);
    auto like = at::empty(plan.window_shape, gf.options());
    auto lp = local_padding(plan, a.p);
    gi = nsp == 2 ? at::avg_pool2d_backward(gf, like, a.k, a.s, lp, a.ceil, true, plan.kernel_divisor)
                  : at::avg_pool3d_backward(gf, like, a.k, a.s, lp, a.ceil, true, plan.kernel_divisor);
    gi = gi.to(g.scalar_type());
  }
  return make_shard_tensor(plan.halo.scatter_add(gi, *spec->mesh, /*consume=*/true), spec);  // gi: our temporary
}

// avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, bool ceil_mode=False,
//            bool count_include_pad=True, int? divisor_override=None) -> Tensor
at::Tensor avg_pool2d_rule(const at::Tensor& self, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                           at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
                           std::optional<int64_t> divisor_override) {
  return avg_pool(2, self, avg_args(2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override));
}

// avg_pool3d(Tensor self, int[3] kernel_size, int[3] stride=[], int[3] padding=0, bool ceil_mode=False,
//            bool count_include_pad=True, int? divisor_override=None) -> Tensor
at::Tensor avg_pool3d_rule(const at::Tensor& self, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                           at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
                           std::optional<int64_t> divisor_override) {
  return avg_pool(3, self, avg_args(3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override));
}

// avg_pool2d_backward(Tensor grad_output, Tensor self, int[2] kernel_size, int[2] stride, int[2] padding,
//                     bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor
at::Tensor avg_pool2d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                    at::IntArrayRef stride, at::IntArrayRef padding, bool ceil_mode,
                                    bool count_include_pad, std::optional<int64_t> divisor_override) {
  return avg_pool_backward("aten::avg_pool2d_backward", 2, grad_output, self,
                           avg_args(2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override));
}

// avg_pool3d_backward(Tensor grad_output, Tensor self, int[3] kernel_size, int[3] stride, int[3] padding,
//                     bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor
at::Tensor avg_pool3d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                    at::IntArrayRef stride, at::IntArrayRef padding, bool ceil_mode,
                                    bool count_include_pad, std::optional<int64_t> divisor_override) {
  return avg_pool_backward("aten::avg_pool3d_backward", 3, grad_output, self,
                           avg_args(3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override));
}

// ---- adaptive pools -------------------------------------------------------------------------------------------

PoolArgs adaptive_args(PoolKind kind, at::IntArrayRef out_size) {
  PoolArgs a;
  a.kind = kind;
  a.out_size = out_size.vec();
  return a;
}

// Apply `mat` (rows x cols) along tensor dim `dim` (size cols -> rows): `t` viewed as [before, cols, after] (a view
// for a contiguous tensor and for rows of one, which the window-free pools pass), one matrix product per leading
// index, the result laid out as `t` is. No transposed copy of `t`.
at::Tensor apply_along(const at::Tensor& t, int64_t dim, const at::Tensor& mat) {
  auto sizes = t.sizes().vec();
  int64_t before = 1, after = 1;
  for (int64_t i = 0; i < dim; ++i) before *= sizes[i];
  for (int64_t i = dim + 1; i < t.dim(); ++i) after *= sizes[i];
  auto t3 = t.reshape({before, sizes[dim], after});
  auto out = at::bmm(mat.unsqueeze(0).expand({before, mat.size(0), mat.size(1)}), t3);
  sizes[dim] = mat.size(0);
  return out.view(sizes);
}

// Adaptive pooling of cells that straddle shards, from partial cells: each rank pools its own rows into every cell
// they touch and sends the partial result of a cell its neighbour owns to that neighbour, which combines it with its
// own (averages add their partial sums, maxima keep the winner) -- a few output rows travel instead of the input rows
// of every straddling cell (a cell of 509 rows pooled to 2 starts on the first rank's last row: that rank read and
// pooled the whole dim alone), and every rank pools only its own rows. No window, no halo of input rows. Averages take
// one exchanged dim at a time (several: the separable passes of first_pass_sizes); maxima combine over several
// exchanged dims one mesh dim after the other (the combination is associative), since indices do not pass through a
// second pooling.
bool cell_partials(const PoolPlan& plan) { return plan.halo.size() >= 1; }

// The spatial dim of the plan's h-th exchanged dim.
size_t exchanged_sp(const PoolPlan& plan, size_t h) {
  for (size_t i = 0; i < plan.sp.size(); ++i)
    if (plan.sp[i].dim == plan.halo.dim(h).dim) return i;
  TORCH_INTERNAL_ASSERT(false, "adaptive pooling: the halo's dim is not spatial");
}

// Rows of cell sums along d's split dim: `rows`' rows are cells [first, ...); by coordinate, `send` names the cells
// (first, count) that go to that peer and `recv` those that come from it. The received rows, by coordinate.
std::vector<at::Tensor> cell_exchange(const at::Tensor& rows, const SpDim& d,
                                      const std::vector<std::pair<int64_t, int64_t>>& send, int64_t first,
                                      const std::vector<std::pair<int64_t, int64_t>>& recv, const Mesh& mesh) {
  std::vector<at::Tensor> out;
  std::vector<std::vector<int64_t>> shapes;
  for (size_t q = 0; q < send.size(); ++q) {
    out.push_back(rows.narrow(d.dim, send[q].second > 0 ? send[q].first - first : 0, send[q].second));
    auto shape = rows.sizes().vec();
    shape[d.dim] = recv[q].second;
    shapes.push_back(std::move(shape));
  }
  return comm::peer_exchange_start(out, shapes, rows, mesh, d.mesh_dim).wait();
}

at::Tensor acc_type(const at::Tensor& t) { return low_precision(t) ? t.to(at::kFloat) : t; }

// A spatial dim the pooling keeps as it is (one cell per row, the window its rows): its averaging matrix is the
// identity, and applying it would cost a matrix product for nothing.
bool keeps_dim(const SpDim& d) { return d.Lout == d.L && d.n == d.W; }

// Averaging matrix i applied along its dim (or transposed, for the gradient), unless the pooling keeps that dim.
at::Tensor average_along(const PoolPlan& plan, size_t i, const at::Tensor& y, bool transposed) {
  if (keeps_dim(plan.sp[i])) return y;
  auto A = comm::plan_constant(plan.avg_matrices[i], y).to(y.options());
  return apply_along(y, plan.sp[i].dim, transposed ? A.t() : A);
}

// Adaptive average pooling over several dims whose halos all travel (a 2-D mesh splitting H and W) runs as passes
// of one exchanged dim each -- it is separable: pooling the first such dim (and the unsplit dims) while the others
// keep their sizes, then the rest -- so each pass runs without a window (a window over two split dims is a copy of
// the block with its halos and corners). The output sizes of the first pass, or nullopt for one exchanged dim.
// From the layout alone (not this rank's output count): every rank takes the same passes and exchanges.
std::optional<std::vector<int64_t>> first_pass_sizes(const PoolPlan& plan) {
  if (plan.halo.size() < 2) return std::nullopt;
  const auto first_dim = plan.halo.dim(0).dim;
  std::vector<int64_t> sizes;
  for (const auto& d : plan.sp) sizes.push_back(d.mesh_dim >= 0 && d.dim != first_dim ? d.L : d.Lout);
  return sizes;
}

// An adaptive pooling whose every spatial size is a multiple of its output size is a plain pooling with kernel =
// stride = L / O (the same cells, the same indices): the windowed pools run it without a window, through the
// single-device kernel (an averaging matrix would cost O times the FLOPs, a cell table several passes). Not when a
// sharded dim pools to one cell: that is a reduction (a Partial sum, a combined max), a few bytes on the wire.
// Decided from global sizes: forward and backward, and every rank, route alike.
std::optional<std::vector<int64_t>> uniform_cells(const at::Tensor& self, int64_t nsp, at::IntArrayRef out_size) {
  if (self.dim() < nsp || static_cast<int64_t>(out_size.size()) != nsp) return std::nullopt;
  const auto* impl = shard_impl(self);
  std::vector<int64_t> k;
  for (int64_t i = 0; i < nsp; ++i) {
    const auto d = self.dim() - nsp + i;
    const auto L = self.size(d), O = out_size[i];
    if (O <= 0 || L <= 0 || L % O != 0) return std::nullopt;
    if (O == 1 && impl && impl->spec()->mesh_dim_of(d) >= 0) return std::nullopt;
    k.push_back(L / O);
  }
  return k;
}

at::Tensor adaptive_avg_pool(int64_t nsp, const at::Tensor& self, c10::SymIntArrayRef output_size) {
  if (auto k = uniform_cells(self, nsp, c10::IntArrayRef(concrete_ints(output_size))))
    return avg_pool(nsp, self, avg_args(nsp, *k, *k, {0}, false, true, std::nullopt));
  auto a = adaptive_args(PoolKind::AdaptiveAvg, c10::IntArrayRef(concrete_ints(output_size)));
  auto [x, planp] = forward_plan(self, nsp, a);
  const auto& plan = *planp;
  if (plan.halo.size() == 1) {  // cell_partials, one exchanged dim
    const auto& local = shard_impl(x)->local();
    const auto& mesh = *shard_impl(x)->spec()->mesh;
    const auto k = exchanged_sp(plan, 0);
    const auto& d = plan.sp[k];
    auto xa = acc_type(local);
    // The touched cells' partial sums along the split dim, then the other dims' averages on the small result.
    auto y = apply_along(xa, d.dim, comm::plan_constant(plan.avg_matrices[k], xa).to(xa.options()));
    for (size_t i = 0; i < plan.sp.size(); ++i)
      if (i != k) y = average_along(plan, i, y, false);
    auto received = cell_exchange(y, d, d.send_cells, d.t0, d.recv_cells, mesh);
    auto out = y.narrow(d.dim, d.n > 0 ? d.o0 - d.t0 : 0, d.n);
    for (size_t q = 0; q < received.size(); ++q) {
      const auto [first, count] = d.recv_cells[q];
      if (count > 0) out.narrow(d.dim, first - d.o0, count).add_(received[q]);
    }
    return wrap_out(plan, shard_impl(x)->spec()->mesh, out.to(local.scalar_type()).contiguous());
  }
  if (auto sizes = first_pass_sizes(plan)) {
    auto once = adaptive_avg_pool(nsp, x, c10::fromIntArrayRefSlow(*sizes));
    return adaptive_avg_pool(nsp, once, output_size);
  }
  auto window = gather_window(plan, x);
  at::Tensor out;
  if (plan.no_outputs) {
    out = at::zeros(plan.local_out_shape, window.options());
  } else {
    auto y = acc_type(window);
    for (size_t i = 0; i < plan.sp.size(); ++i) y = average_along(plan, i, y, false);
    out = y.to(window.scalar_type()).contiguous();
  }
  return wrap_out(plan, shard_impl(x)->spec()->mesh, out);
}

// The output size of an adaptive pool: the last `nsp` (global) sizes of its gradient.
std::vector<int64_t> adaptive_out_size(const at::Tensor& grad_output, int64_t nsp) {
  return std::vector<int64_t>(grad_output.sizes().end() - nsp, grad_output.sizes().end());
}

at::Tensor adaptive_avg_pool_backward(std::string_view op_name, int64_t nsp, const at::Tensor& grad_output,
                                      const at::Tensor& self) {
  const auto out_size = adaptive_out_size(grad_output, nsp);
  if (auto k = uniform_cells(self, nsp, out_size))
    return avg_pool_backward(op_name, nsp, grad_output, self, avg_args(nsp, *k, *k, {0}, false, true, std::nullopt));
  auto a = adaptive_args(PoolKind::AdaptiveAvg, out_size);
  auto [spec, planp] = backward_plan(op_name, {grad_output, self}, self, nsp, a);
  const auto& plan = *planp;
  if (auto sizes = first_pass_sizes(plan)) {
    // The passes' gradients in reverse: the second's against the first's output layout (only its layout is read:
    // a broadcast zero stands for its values), then the first's.
    const auto& first = *pool_plan(*spec, nsp, adaptive_args(PoolKind::AdaptiveAvg, *sizes), self.device());
    auto once = wrap_out(first, spec->mesh, at::zeros({}, grad_output.options()).expand(first.local_out_shape));
    auto g_once = adaptive_avg_pool_backward(op_name, nsp, grad_output, once);
    return adaptive_avg_pool_backward(op_name, nsp, g_once, self);
  }
  auto g = grad_local(plan, grad_output, spec->mesh);
  if (plan.halo.size() == 1) {  // cell_partials, one exchanged dim
    // The adjoint: each owner sends the gradient of its cells to the ranks whose rows they touch, then every rank
    // spreads the touched cells' gradient over its own rows.
    const auto k = exchanged_sp(plan, 0);
    const auto& d = plan.sp[k];
    auto y = acc_type(g);
    auto received = cell_exchange(y, d, d.recv_cells, d.o0, d.send_cells, *spec->mesh);
    std::vector<std::pair<int64_t, at::Tensor>> pieces{{d.o0, y}};  // by first cell: the touched cells in order
    for (size_t q = 0; q < received.size(); ++q)
      if (d.send_cells[q].second > 0) pieces.emplace_back(d.send_cells[q].first, received[q]);
    std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<at::Tensor> rows;
    for (auto& [first, t] : pieces)
      if (t.size(d.dim) > 0) rows.push_back(t);
    auto touched = rows.empty() ? y : rows.size() == 1 ? rows[0] : at::cat(rows, d.dim);  // empty: no cells here
    TORCH_INTERNAL_ASSERT(touched.size(d.dim) == d.tn, "adaptive pooling: the touched cells' gradient");
    for (size_t i = 0; i < plan.sp.size(); ++i)
      if (i != k) touched = average_along(plan, i, touched, true);
    auto A = comm::plan_constant(plan.avg_matrices[k], touched).to(touched.options());
    auto gi = apply_along(touched, d.dim, A.t()).to(g.scalar_type()).contiguous();
    return make_shard_tensor(gi, spec);
  }
  at::Tensor gi;
  if (plan.no_outputs) {
    gi = at::zeros(plan.window_shape, g.options());
  } else {
    auto y = acc_type(g);
    for (size_t i = 0; i < plan.sp.size(); ++i) y = average_along(plan, i, y, true);
    gi = y.to(g.scalar_type()).contiguous();
  }
  return make_shard_tensor(plan.halo.scatter_add(gi, *spec->mesh), spec);
}

// Adaptive max pooling's cell table over `window` (its rows of dim i start at global row plan.cell_ws[i]): the max
// over each cell's rows and its global flat index over the spatial plane, for plan.cell_n[i] cells of dim i; ties go
// to the first element in row-major order and NaN to the last, as on one device.
// Up to this many cells along the first spatial dim, the table's first pass reduces each cell's rows as a view.
constexpr int64_t kCellsByView = 64;

std::pair<at::Tensor, at::Tensor> cell_max(const PoolPlan& plan, const at::Tensor& window) {
  // One spatial dim at a time from the first, each pass over the cells' rows side by side (the first pass reduces
  // each cell's rows where they lie, or with many cells copies the rows once, whole rows: one block copy each; the
  // later ones read the far smaller pooled result).
  // The first pass keeps, per position of the later dims, the first row holding the maximum (the last NaN). A later
  // pass picks among its candidates by their row-major order over the dims pooled so far -- the smallest global
  // flat key among the maxima, the largest among NaN -- which is the first (last NaN) in row-major order of the whole
  // cell, as aten's kernels pick; each pass carries its winners' coordinates along the dims already pooled.
  const auto nsp = plan.nsp;
  const auto lead = window.dim() - nsp;
  const bool floating = at::isFloatingType(window.scalar_type());
  auto vals = window;
  std::vector<at::Tensor> coord(nsp);  // global coordinates of the winners along the dims pooled so far
  for (int64_t i = 0; i < nsp; ++i) {
    const auto d = lead + i;
    const auto n = plan.cell_n[i], kmax = plan.cell_k[i];
    if (i == 0 && n > 0 && n <= kCellsByView) {
      // Few cells: each cell's rows are a view of the window, reduced where they lie (no copy of the rows; max(dim)
      // keeps the first maximum, as aten's kernels do).
      std::vector<at::Tensor> vs, ks;
      for (const auto& [first, len] : plan.cell_spans[0]) {
        auto rows_of_cell = vals.narrow(d, first, len);
        auto [v, k] = rows_of_cell.max(d);
        if (floating) {
          const auto nan = v.isnan();
          if (!window.device().is_cpu() || nan.any().item<bool>())
            k = at::where(nan, (len - 1) - rows_of_cell.isnan().flip(d).to(at::kByte).argmax(d), k);
        }
        vs.push_back(v);
        ks.push_back(k.add_(first + plan.cell_ws[0]));
      }
      vals = at::stack(vs, d);
      coord[0] = at::stack(ks, d);
      continue;
    }
    const auto rows = comm::plan_constant(plan.cell_rows[i], window);  // (n, K) window rows
    auto sizes = vals.sizes().vec();
    sizes[d] = kmax;
    sizes.insert(sizes.begin() + d, n);
    auto G = vals.index_select(d, rows.flatten()).view(sizes);  // (..., n, K, ...)
    std::vector<int64_t> rshape(G.dim(), 1);
    rshape[d] = n;
    rshape[d + 1] = kmax;
    at::Tensor v, k;
    if (i == 0) {
      std::tie(v, k) = G.max(d + 1);
      if (floating) {
        // max(dim) stops at the first NaN; aten's pooling kernels keep the last: its position from the back. On the
        // CPU only when a NaN won somewhere (the check costs nothing there); on a GPU always (no host sync).
        const auto nan = v.isnan();
        if (!window.device().is_cpu() || nan.any().item<bool>())
          k = at::where(nan, (kmax - 1) - G.isnan().flip(d + 1).to(at::kByte).argmax(d + 1), k);
      }
    } else {
      // The candidates' row-major keys over the dims pooled so far (this dim's global row the last digit); the
      // earlier dims' coordinates laid out like G.
      for (int64_t j = 0; j < i; ++j) coord[j] = coord[j].index_select(d, rows.flatten()).view(sizes);
      auto key = (rows + plan.cell_ws[i]).view(rshape);
      int64_t stride = plan.sp[i].L;
      for (int64_t j = i - 1; j >= 0; --j) {
        key = key + coord[j] * stride;
        stride *= plan.sp[j].L;
      }
      v = std::get<0>(G.max(d + 1));
      const auto big = std::numeric_limits<int64_t>::max();
      k = at::where(G.eq(v.unsqueeze(d + 1)), key, big).argmin(d + 1);
      if (floating) {
        const auto nan = v.isnan();
        k = at::where(nan, at::where(G.isnan(), key, -1).argmax(d + 1), k);
      }
    }
    // The winners' coordinates: the earlier dims' at the picked slices, this dim's from its cell's rows.
    auto pick = k.unsqueeze(d + 1);
    for (int64_t j = 0; j < i; ++j) coord[j] = coord[j].gather(d + 1, pick).squeeze(d + 1);
    coord[i] = (rows + plan.cell_ws[i]).view(rshape).expand(sizes).gather(d + 1, pick).squeeze(d + 1);
    vals = v;
  }
  auto idx = coord[0].clone();
  for (int64_t i = 1; i < nsp; ++i) idx.mul_(plan.sp[i].L).add_(coord[i]);
  return {vals.contiguous(), idx};
}

// Combines `other`'s (max, global index) of the same cells into (v, i), in place: the larger value wins, ties go to
// the smaller index (the first in row-major order) and NaN wins with the larger index (aten's kernels keep the last
// NaN they meet). A rank without rows offers -inf with an index no real one exceeds, which never wins.
void merge_max_(at::Tensor& v, at::Tensor& i, const at::Tensor& ov, const at::Tensor& oi) {
  const auto vn = v.isnan(), on = ov.isnan();
  const auto nan_wins = on.logical_and(vn.logical_not().logical_or(oi.gt(i)));
  const auto larger = vn.logical_or(on).logical_not().logical_and(ov.gt(v).logical_or(ov.eq(v).logical_and(oi.lt(i))));
  const auto take = nan_wins.logical_or(larger);
  v.copy_(at::where(take, ov, v));
  i.copy_(at::where(take, oi, i));
}

// Adaptive max pooling: (values, global indices).
std::tuple<at::Tensor, at::Tensor> adaptive_max_pool(int64_t nsp, const at::Tensor& self, at::IntArrayRef output_size) {
  if (auto k = uniform_cells(self, nsp, output_size)) return max_pool(nsp, self, max_args(nsp, *k, *k, {0}, {1}, false));
  auto a = adaptive_args(PoolKind::AdaptiveMax, output_size);
  auto [x, planp] = forward_plan(self, nsp, a);
  const auto& plan = *planp;
  const auto& mesh = shard_impl(x)->spec()->mesh;
  // Cells straddling shards (cell_partials): each rank takes the max over its own rows of every cell they touch and
  // the owners combine the partial maxima -- no window.
  const bool partials = cell_partials(plan);
  auto window = partials ? shard_impl(x)->local() : gather_window(plan, x);
  std::vector<int64_t> table_shape(window.sizes().begin(), window.sizes().end() - nsp);
  for (auto n : plan.cell_n) table_shape.push_back(n);
  at::Tensor out, idx;
  bool empty_local = false;
  for (const auto& d : plan.sp) empty_local = empty_local || (d.reduce && d.W == 0);
  if ((plan.no_outputs && !partials) || empty_local || c10::multiply_integers(table_shape) == 0 ||
      window.numel() == 0) {
    // No outputs, or nothing of a reduced dim here: -inf with a sentinel index that never wins a combine.
    out = at::full(table_shape, empty_local ? -std::numeric_limits<double>::infinity() : 0.0, window.options());
    idx = at::full(table_shape, empty_local ? std::numeric_limits<int64_t>::max() : 0,
                   window.options().dtype(at::kLong));
  } else {
    std::tie(out, idx) = cell_max(plan, window);
  }
  for (size_t h = 0; partials && h < plan.halo.size(); ++h) {
    // The partial maxima of the cells other ranks own along this dim go to them; this rank combines what it receives
    // into its own cells (then the next exchanged dim, over the cells this dim's combination left here).
    const auto& d = plan.sp[exchanged_sp(plan, h)];
    auto vals = cell_exchange(out, d, d.send_cells, d.t0, d.recv_cells, *mesh);
    auto idxs = cell_exchange(idx, d, d.send_cells, d.t0, d.recv_cells, *mesh);
    const auto own = d.n > 0 ? d.o0 - d.t0 : 0;
    out = out.narrow(d.dim, own, d.n);
    idx = idx.narrow(d.dim, own, d.n);
    for (size_t q = 0; q < vals.size(); ++q) {
      const auto [first, count] = d.recv_cells[q];
      if (count == 0) continue;
      auto v = out.narrow(d.dim, first - d.o0, count), i = idx.narrow(d.dim, first - d.o0, count);
      merge_max_(v, i, vals[q], idxs[q]);
    }
  }
  if (partials) {
    out = out.contiguous();
    idx = idx.contiguous();
  }
  // Reduced dims (size 1): every rank's (value, global index) along the mesh dim, combined in rank order.
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    for (const auto& d : plan.sp) {
      if (!d.reduce || d.mesh_dim != m) continue;
      const auto n = mesh->size(m);
      std::vector<int64_t> ones(n, 1);
      auto vals = comm::all_gather_v(out.unsqueeze(0), 0, ones, *mesh, m);
      auto idxs = comm::all_gather_v(idx.unsqueeze(0), 0, ones, *mesh, m);
      out = vals[0].clone();
      idx = idxs[0].clone();
      for (int64_t r = 1; r < n; ++r) merge_max_(out, idx, vals[r], idxs[r]);
    }
  }
  return {wrap_out(plan, mesh, out), wrap_out(plan, mesh, idx)};
}

at::Tensor adaptive_max_pool_backward(std::string_view op_name, int64_t nsp, const at::Tensor& grad_output,
                                      const at::Tensor& self, const at::Tensor& indices) {
  const auto out_size = adaptive_out_size(grad_output, nsp);
  if (auto k = uniform_cells(self, nsp, out_size))
    return max_pool_backward(op_name, nsp, grad_output, self, max_args(nsp, *k, *k, {0}, {1}, false), indices);
  auto a = adaptive_args(PoolKind::AdaptiveMax, out_size);
  auto [spec, planp] = backward_plan(op_name, {grad_output, self, indices}, self, nsp, a);
  const auto& plan = *planp;
  const auto& mesh = spec->mesh;
  auto g = grad_local(plan, grad_output, mesh);
  auto idx = local_aligned(dispatch::as_shard(indices, mesh), mesh, plan.out_shape, plan.out_placements, plan.out_ext);
  if (cell_partials(plan)) {
    // Each owner sends its cells' gradients and indices to the ranks whose rows the cells touch; every rank adds
    // those whose element lies in its own rows into its gradient (the outputs are few: per-element divisions are
    // cheap here). No window.
    // Several exchanged dims: the forward's combination reversed, the last dim's first; along a dim already
    // exchanged a rank then holds the touched cells in an order of its own, which travels whole (each gradient
    // keeps its index beside it) and matches its peers' (they share its coordinate on that mesh dim).
    auto gt = g, it = idx;
    for (size_t h = plan.halo.size(); h-- > 0;) {
      const auto& d = plan.sp[exchanged_sp(plan, h)];
      auto gs = cell_exchange(gt, d, d.recv_cells, d.o0, d.send_cells, *mesh);
      auto is = cell_exchange(it, d, d.recv_cells, d.o0, d.send_cells, *mesh);
      gs.push_back(gt);
      is.push_back(it);
      gt = at::cat(gs, d.dim);
      it = at::cat(is, d.dim);
    }
    const auto lead = gt.dim() - plan.nsp;
    auto keep = at::ones_like(it, it.options().dtype(at::kBool));
    auto flat = at::zeros_like(it);
    auto rem = it;
    int64_t local_stride = 1;
    for (int64_t i = plan.nsp - 1; i >= 0; --i) {
      const auto& sd = plan.sp[i];
      auto coord = rem.remainder(sd.L);
      rem = rem.div(sd.L, "floor");
      const auto first = spec->local_offset(sd.dim), rows = spec->local_shape[sd.dim];
      if (sd.mesh_dim >= 0) keep = keep.logical_and(coord.ge(first)).logical_and(coord.lt(first + rows));
      flat.add_((coord - first) * local_stride);
      local_stride *= rows;
    }
    auto gk = at::where(keep, gt, at::zeros({}, gt.options()));
    flat = at::where(keep, flat, at::zeros({}, flat.options()));
    std::vector<int64_t> flat_shape(spec->local_shape.begin(), spec->local_shape.begin() + lead);
    flat_shape.push_back(local_stride);
    auto gi = at::zeros(flat_shape, g.options());
    if (gi.numel() > 0 && gk.numel() > 0) gi.scatter_add_(lead, flat.flatten(lead), gk.flatten(lead));
    return make_shard_tensor(gi.view(spec->local_shape), spec);
  }
  return make_shard_tensor(max_backward_common(plan, g, idx, *mesh), spec);
}

// _adaptive_avg_pool2d(Tensor self, SymInt[2] output_size) -> Tensor
at::Tensor adaptive_avg_pool2d_rule(const at::Tensor& self, c10::SymIntArrayRef output_size) {
  return adaptive_avg_pool(2, self, output_size);
}

// _adaptive_avg_pool3d(Tensor self, SymInt[3] output_size) -> Tensor
at::Tensor adaptive_avg_pool3d_rule(const at::Tensor& self, c10::SymIntArrayRef output_size) {
  return adaptive_avg_pool(3, self, output_size);
}

// _adaptive_avg_pool2d_backward(Tensor grad_output, Tensor self) -> Tensor
at::Tensor adaptive_avg_pool2d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self) {
  return adaptive_avg_pool_backward("aten::_adaptive_avg_pool2d_backward", 2, grad_output, self);
}

// _adaptive_avg_pool3d_backward(Tensor grad_output, Tensor self) -> Tensor
at::Tensor adaptive_avg_pool3d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self) {
  return adaptive_avg_pool_backward("aten::_adaptive_avg_pool3d_backward", 3, grad_output, self);
}

// adaptive_max_pool2d(Tensor self, int[2] output_size) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> adaptive_max_pool2d_rule(const at::Tensor& self, at::IntArrayRef output_size) {
  return adaptive_max_pool(2, self, output_size);
}

// adaptive_max_pool3d(Tensor self, int[3] output_size) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> adaptive_max_pool3d_rule(const at::Tensor& self, at::IntArrayRef output_size) {
  return adaptive_max_pool(3, self, output_size);
}

// adaptive_max_pool2d_backward(Tensor grad_output, Tensor self, Tensor indices) -> Tensor
at::Tensor adaptive_max_pool2d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self,
                                             const at::Tensor& indices) {
  return adaptive_max_pool_backward("aten::adaptive_max_pool2d_backward", 2, grad_output, self, indices);
}

// adaptive_max_pool3d_backward(Tensor grad_output, Tensor self, Tensor indices) -> Tensor
at::Tensor adaptive_max_pool3d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self,
                                             const at::Tensor& indices) {
  return adaptive_max_pool_backward("aten::adaptive_max_pool3d_backward", 3, grad_output, self, indices);
}

// max_pool1d is composite-implicit, but on CPU without autograd it runs a kernel that reads the storage directly:
// bound above autograd (and below, for inference mode) to its decomposition through max_pool2d_with_indices.
at::Tensor max_pool1d_entry(const at::Tensor& self, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  return std::get<0>(at::max_pool1d_with_indices(self, kernel, stride, padding, dilation, ceil_mode));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(pool) {
  dispatch::set_handler("aten::max_pool1d", typed_handler(&max_pool1d_entry), dispatch::RuleLevel::above_autograd);
  dispatch::set_handler("aten::max_pool2d_with_indices", typed_handler(&max_pool2d_rule));
  dispatch::set_handler("aten::max_pool3d_with_indices", typed_handler(&max_pool3d_rule));
  dispatch::set_handler("aten::max_pool2d_with_indices_backward", typed_handler(&max_pool2d_backward_rule));
  dispatch::set_handler("aten::max_pool3d_with_indices_backward", typed_handler(&max_pool3d_backward_rule));
  dispatch::set_handler("aten::avg_pool2d", typed_handler(&avg_pool2d_rule));
  dispatch::set_handler("aten::avg_pool3d", typed_handler(&avg_pool3d_rule));
  dispatch::set_handler("aten::avg_pool2d_backward", typed_handler(&avg_pool2d_backward_rule));
  dispatch::set_handler("aten::avg_pool3d_backward", typed_handler(&avg_pool3d_backward_rule));
  dispatch::set_handler("aten::_adaptive_avg_pool2d", typed_handler(&adaptive_avg_pool2d_rule));
  dispatch::set_handler("aten::_adaptive_avg_pool3d", typed_handler(&adaptive_avg_pool3d_rule));
  dispatch::set_handler("aten::_adaptive_avg_pool2d_backward", typed_handler(&adaptive_avg_pool2d_backward_rule));
  dispatch::set_handler("aten::_adaptive_avg_pool3d_backward", typed_handler(&adaptive_avg_pool3d_backward_rule));
  dispatch::set_handler("aten::adaptive_max_pool2d", typed_handler(&adaptive_max_pool2d_rule));
  dispatch::set_handler("aten::adaptive_max_pool3d", typed_handler(&adaptive_max_pool3d_rule));
  dispatch::set_handler("aten::adaptive_max_pool2d_backward", typed_handler(&adaptive_max_pool2d_backward_rule));
  dispatch::set_handler("aten::adaptive_max_pool3d_backward", typed_handler(&adaptive_max_pool3d_backward_rule));
}

} // namespace shardtensor::ops
