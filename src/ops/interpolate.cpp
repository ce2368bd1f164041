// Interpolation (F.interpolate / nn.Upsample) over sharded spatial dims: nearest, nearest-exact, linear,
// bilinear, trilinear, bicubic, align_corners both ways, sizes or scale factors.
//
// Interpolation is separable: along each spatial dim, output position o is a weighted sum of at most K source
// rows (nearest 1, linear 2, cubic 4, clamped to [0, L-1]) whose indices and weights follow PyTorch's CPU
// kernels exactly (coordinates in the op's math type: float for fp32/bf16/fp16, double for fp64; nearest
// scales in float). Each dim is resampled in turn, as an index_select + weighted sum. Along a sharded dim the
// output position o belongs to the rank owning its primary source row (nearest: its row; linear/cubic: the
// floor of its source coordinate), so outputs follow their data and zero-extent ranks get no outputs; each rank
// receives exactly the source rows its outputs read (any distance) and the backward sends the gradient rows home.
// No window is built (comm/halo_borders.h): the interior outputs are resampled from the own rows, the few outputs
// that read another rank's rows from border windows, written over their rows; the backward likewise (only the
// halo rows' gradient travels). A rank whose every output reads another's rows (shards of a row or two) resamples
// its window, which is then a few rows. With one sharded spatial dim, where a rank's outputs line up with its rows
// (native_row: scale 2 up, and down at even offsets), the main call is PyTorch's fused kernel on the own rows — the
// single-device op, every dim in one pass — and only the border outputs are resampled tap by tap.
// The plan (comm/halo_plan: partition, exchange, taps and weights on the device) is cached per layout, sizes and
// mode, for both directions, so the backward reuses the forward's.
//
// F.interpolate reaches the composite-implicit `.vec` overloads; they are bound above autograd (both shard
// keys) with their own torch::autograd::Function, which keeps the input's layout for the backward. The
// non-`.vec` ops and their *_backward ops get below-autograd handlers too (the backward ops only know the
// input's global size: their gradient uses the default split along sharded spatial dims).
//
// PyTorch CPU quirks reproduced (so results match one device bit-for-bit in the indices):
// - nearest: the 2-D forward kernel and every nearest backward kernel special-case output == input
//   (identity) and output == 2 * input (o >> 1) whatever the scale; the 1-D and 3-D forward kernels do not.
// - linear: output == input along a dim is the identity whatever the scale (forward and backward).
// - bicubic: the backward is the identity when output == input in both dims; the forward never special-cases.
#include "comm/functional.h"
#include "comm/halo_borders.h"
#include "comm/halo_plan.h"
#include "comm/host_metadata.h"
#include "comm/spec_holder.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>

#include <algorithm>
#include <limits>
#include <cmath>

namespace shardtensor::ops {

namespace {

enum class Mode : int64_t { Nearest = 0, NearestExact = 1, Linear = 2, Cubic = 3 };

struct OpInfo {
  Mode mode;
  int64_t nd;    // spatial dims
  bool has_align;
};

// Per dim: K taps per output position (global source indices and weights).
struct Taps {
  int64_t K = 1;
  std::vector<int64_t> idx; // O * K
  std::vector<double> w;    // O * K
  std::vector<int64_t> primary; // O: the row that decides the output's owner
};

template <typename T>
T scales_value(double scale, int64_t L, int64_t O) {
  return scale > 0. ? static_cast<T>(1.0 / scale) : static_cast<T>(L) / O;
}

template <typename T>
T area_scale(int64_t L, int64_t O, bool ac, double scale) {
  if (ac) return O > 1 ? static_cast<T>(L - 1) / (O - 1) : static_cast<T>(0);
  return scales_value<T>(scale, L, O);
}

template <typename T>
T source_index(T scale, int64_t o, bool ac, bool cubic) {
  if (ac) return scale * o;
  T src = scale * (o + static_cast<T>(0.5)) - static_cast<T>(0.5);
  return (!cubic && src < static_cast<T>(0)) ? T(0) : src;
}

template <typename T>
T cubic1(T x, T A) {
  return ((A + 2) * x - (A + 3)) * x * x + 1;
}
template <typename T>
T cubic2(T x, T A) {
  return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A;
}

// `shortcut`: the kernel's identity / o >> 1 special cases (see the file comment).
template <typename T>
Taps make_taps(Mode mode, int64_t L, int64_t O, bool ac, double scale, bool shortcut) {
  Taps t;
  t.primary.resize(O);
  if (mode == Mode::Nearest || mode == Mode::NearestExact) {
    t.K = 1;
    const float s = scales_value<float>(scale, L, O);
    for (int64_t o = 0; o < O; ++o) {
      int64_t i;
      if (mode == Mode::Nearest && shortcut && O == L) {
        i = o;
      } else if (mode == Mode::Nearest && shortcut && O == 2 * L) {
        i = o >> 1;
      } else if (mode == Mode::Nearest) {
        i = std::min(static_cast<int64_t>(floorf(o * s)), L - 1);
      } else {
        i = std::min(static_cast<int64_t>(floorf((o + 0.5) * s)), L - 1);
      }
      t.idx.push_back(i);
      t.w.push_back(1.0);
      t.primary[o] = i;
    }
    return t;
  }
  const T r = area_scale<T>(L, O, ac, scale);
  if (mode == Mode::Linear) {
    t.K = 2;
    for (int64_t o = 0; o < O; ++o) {
      int64_t i0, i1;
      T l0, l1;
      if (O == L) { // the kernels' copy special case
        i0 = i1 = o;
        l0 = 1;
        l1 = 0;
      } else {
        const T real = source_index<T>(r, o, ac, false);
        i0 = std::min(static_cast<int64_t>(floorf(real)), L - 1);
        l1 = std::min(std::max(real - static_cast<T>(i0), static_cast<T>(0)), static_cast<T>(1));
        i1 = i0 + (i0 < L - 1 ? 1 : 0);
        l0 = static_cast<T>(1) - l1;
      }
      t.idx.insert(t.idx.end(), {i0, i1});
      t.w.insert(t.w.end(), {static_cast<double>(l0), static_cast<double>(l1)});
      // The owner: the row nearest the source coordinate (the heavier tap), so a scale-2 upsampling's outputs
      // 2a, 2a + 1 follow row a and a rank's first output maps onto its first row (the single-device kernel then
      // serves the main call, native_row).
      t.primary[o] = l1 > static_cast<T>(0.5) ? i1 : i0;
    }
    return t;
  }
  // Cubic.
  if (shortcut) { // backward identity (output size == input size in every dim)
    t.K = 1;
    for (int64_t o = 0; o < O; ++o) {
      t.idx.push_back(o);
      t.w.push_back(1.0);
      t.primary[o] = o;
    }
    return t;
  }
  t.K = 4;
  const T A = static_cast<T>(-0.75);
  for (int64_t o = 0; o < O; ++o) {
    const T real = source_index<T>(r, o, ac, true);
    const int64_t i0 = std::min(static_cast<int64_t>(floorf(real)), L - 1);
    const T x = std::min(std::max(real - static_cast<T>(i0), static_cast<T>(0)), static_cast<T>(1));
    const T c[4] = {cubic2<T>(x + 1, A), cubic1<T>(x, A), cubic1<T>(1 - x, A), cubic2<T>(1 - x + 1, A)};
    for (int64_t k = 0; k < 4; ++k) {
      t.idx.push_back(std::clamp<int64_t>(i0 - 1 + k, 0, L - 1));
      t.w.push_back(static_cast<double>(c[k]));
    }
    t.primary[o] = std::clamp<int64_t>(x > static_cast<T>(0.5) ? i0 + 1 : i0, 0, L - 1);
  }
  return t;
}

Taps taps_for(at::ScalarType dtype, Mode mode, int64_t L, int64_t O, bool ac, double scale, bool shortcut) {
  return dtype == at::kDouble ? make_taps<double>(mode, L, O, ac, scale, shortcut)
                              : make_taps<float>(mode, L, O, ac, scale, shortcut);
}

// One spatial dim, one direction (the forward's or the backward kernels' taps).
struct DimPlan {
  int64_t dim = 0;
  int64_t mesh_dim = -1; // -1: not sharded
  int64_t K = 1;
  int64_t window_rows = 0;  // this rank's window (unsharded: the whole dim)
  comm::HaloPlan halo;      // sharded: gathers the rows this rank's outputs read
  at::Tensor idx, w;        // [K, n]: window-relative taps and weights of this rank's outputs, on the device
  // Sharded, direct split: no window (comm/halo_borders.h). The main call resamples the own rows with taps
  // relative to them (border outputs' taps clamped into them: those outputs are recomputed); each border's
  // outputs come from a border window with taps relative to it. [top, bottom): the interior outputs.
  comm::BorderSplit split;
  int64_t own_rows = 0, top = 0, bottom = 0;
  at::Tensor main_idx, main_w;
  std::vector<std::pair<at::Tensor, at::Tensor>> border_taps;
  // This rank's first output and first own row (global), its output count.
  int64_t first_out = 0, first_row = 0, outputs = 0;
  // The main call through the single-device kernel (every spatial dim at once, one pass), when that kernel's own
  // index arithmetic on the own rows from `native_row` on, given `native_scale` for this dim, reproduces the taps of
  // every interior output (plan_native checks it; the weights may differ in the last bits). The border outputs it
  // computes with clamped taps are recomputed; `native_border_taps` (per border, relative to its first row) are its
  // taps for them, whose terms the backward takes out of the main call's gradient. -1: resample tap by tap.
  int64_t native_row = -1;
  double native_scale = 0;
  std::vector<std::pair<at::Tensor, at::Tensor>> native_border_taps;
  std::vector<std::pair<int64_t, int64_t>> native_border_rows;  // per border: (first row, rows) its taps name
};

// Interpolation's plan: a pure function of the input layout, the sizes and the mode, cached; it holds both
// directions (the backward kernels' taps differ in their special cases), so the backward reuses it.
struct InterpPlan {
  std::vector<DimPlan> fwd, bwd;  // spatial dims, in tensor-dim order
  std::vector<int64_t> out_shape;
  DimExtents out_ext;
};

// `bounds_taps`: the forward's taps (they decide the output partition); `taps`: this direction's taps.
DimPlan plan_dim(int64_t dim, int64_t mesh_dim, const std::vector<int64_t>& in_extents, int64_t L, int64_t O,
                 const Taps& bounds_taps, const Taps& taps, const std::vector<int64_t>& coordinates,
                 const at::TensorOptions& opts, std::vector<int64_t>& out_extents) {
  DimPlan p;
  p.dim = dim;
  p.mesh_dim = mesh_dim;
  p.K = taps.K;
  const auto K = taps.K;
  int64_t b = 0, n = O, win_lo = 0;
  if (mesh_dim < 0) {
    out_extents = {O};
    p.window_rows = L;  // the window is the whole local dim
  } else {
    std::vector<int64_t> first(O), last(O);
    for (int64_t o = 0; o < O; ++o) {
      first[o] = *std::min_element(taps.idx.begin() + o * K, taps.idx.begin() + (o + 1) * K);
      last[o] = *std::max_element(taps.idx.begin() + o * K, taps.idx.begin() + (o + 1) * K);
    }
    auto part = comm::primary_row_partition(in_extents, bounds_taps.primary, first, last);
    const auto c = coordinates.at(mesh_dim);
    out_extents = part.out_extents;
    b = part.out_begin(c);
    n = part.out_extents[c];
    win_lo = part.want[c].empty() ? 0 : part.want[c].front();
    p.window_rows = static_cast<int64_t>(part.want[c].size());
    p.halo = comm::HaloPlan({comm::HaloDim{dim, mesh_dim, in_extents, std::move(part.want)}}, coordinates,
                            opts.device());
  }
  // Taps of outputs [from, from + len) relative to row `base`, clamped to [0, rows).
  auto taps_of = [&](int64_t from, int64_t len, int64_t base, int64_t rows) {
    std::vector<int64_t> idx(K * len);
    std::vector<double> w(K * len);
    for (int64_t q = 0; q < len; ++q)
      for (int64_t k = 0; k < K; ++k) {
        idx[k * len + q] = std::clamp<int64_t>(taps.idx[(b + from + q) * K + k] - base, 0, std::max<int64_t>(rows - 1, 0));
        w[k * len + q] = taps.w[(b + from + q) * K + k];
      }
    comm::HostMetadataGuard host; // host-side index/weight tensors stay real (comm/host_metadata.h)
    return std::make_pair(at::tensor(idx, at::TensorOptions().dtype(at::kLong)).view({K, len}).to(opts.device()),
                          at::tensor(w, at::TensorOptions().dtype(at::kDouble)).view({K, len}).to(opts));
  };
  std::tie(p.idx, p.w) = taps_of(0, n, win_lo, p.window_rows);
  if (mesh_dim >= 0 && p.halo.runs(0)) {
    // The border split: outputs reading a row of another rank sit at the ends (taps follow the output position).
    const auto c = coordinates.at(mesh_dim);
    int64_t a = 0;
    for (int64_t r = 0; r < c; ++r) a += in_extents[r];
    const auto e = in_extents[c];
    p.first_out = b;
    p.first_row = a;
    p.outputs = n;
    auto reads = [&](int64_t q, bool below) {
      for (int64_t k = 0; k < K; ++k) {
        const auto t = taps.idx[(b + q) * K + k];
        if (below ? t < a : t >= a + e) return true;
      }
      return false;
    };
    int64_t top = 0, bottom = n;
    for (int64_t q = 0; q < n; ++q)
      if (reads(q, true)) top = q + 1;
    for (int64_t q = n; q-- > 0;)
      if (reads(q, false)) bottom = q;
    p.own_rows = e;
    p.split.direct = true;
    auto window_of = [&](int64_t from, int64_t len) {
      int64_t lo = win_lo + p.window_rows, hi = win_lo;
      for (int64_t q = from; q < from + len; ++q)
        for (int64_t k = 0; k < K; ++k) {
          lo = std::min(lo, taps.idx[(b + q) * K + k]);
          hi = std::max(hi, taps.idx[(b + q) * K + k] + 1);
        }
      p.split.borders.push_back({from, len, lo - win_lo, hi - lo});
      p.border_taps.push_back(taps_of(from, len, lo, hi - lo));
    };
    if (top < bottom && e > 0) {
      p.top = top;
      p.bottom = bottom;
      std::tie(p.main_idx, p.main_w) = taps_of(0, n, a, e);
      if (top > 0) window_of(0, top);
      if (bottom < n) window_of(bottom, n - bottom);
    } else {
      // No interior: the outputs come from the window (a few rows: every output reads another rank's).
      p.split.main = false;
      p.split.borders.push_back({0, n, 0, p.window_rows});
      p.border_taps.emplace_back(p.idx, p.w);
    }
  }
  return p;
}

// Whether the single-device kernel can run the main call of sharded dim plan `p` (see DimPlan::native_row): it
// computes source coordinates from its own output index, so a rank's outputs line up with its rows when its first
// output's coordinate falls on one of them (scale 2 up: output 2a on row a; scale 2 down: output a/2 on row a for
// even a). The kernel's taps on those rows, emulated by make_taps with the scale it is given, must name the same rows
// as `taps` for every interior output; align_corners (whose kernels ignore a given scale) never qualifies.
template <typename T>
void plan_native(DimPlan& p, const Taps& taps, Mode mode, int64_t L, int64_t O, bool ac, double scale, bool shortcut,
                 const at::TensorOptions& opts) {
  if (p.mesh_dim < 0 || !p.split.direct || !p.split.main || p.own_rows == 0 || p.top >= p.bottom) return;
  const bool nearest = mode == Mode::Nearest || mode == Mode::NearestExact;
  if (ac && !nearest) return;
  const auto b = p.first_out, a = p.first_row, e = p.own_rows, n = p.outputs;
  const double sigma = nearest ? static_cast<double>(scales_value<float>(scale, L, O))
                               : static_cast<double>(area_scale<T>(L, O, false, scale));
  const auto r0 = static_cast<int64_t>(std::llround(sigma * static_cast<double>(b)));
  if (r0 < a || r0 >= a + e) return;
  const double s_native = scale > 0. ? scale : static_cast<double>(O) / static_cast<double>(L);
  // Cubic's shortcut is the backward's identity when output == input in every dim: on the main call's rows the
  // kernel takes it only when they equal its outputs (the other dims are equal when the op's are).
  const bool local_shortcut = mode == Mode::Cubic ? shortcut && n == a + e - r0 : shortcut;
  const auto local = make_taps<T>(mode, a + e - r0, n, false, s_native, local_shortcut);
  const auto K = taps.K;
  if (local.K != K) return;
  for (int64_t q = p.top; q < p.bottom; ++q)
    for (int64_t k = 0; k < K; ++k) {
      const auto i = q * K + k, g = (b + q) * K + k;
      if (local.idx[i] + r0 != taps.idx[g]) return;
      if (std::abs(local.w[i] - taps.w[g]) > 1e-5 * (1.0 + std::abs(taps.w[g]))) return;
    }
  p.native_row = r0 - a;
  p.native_scale = s_native;
  comm::HostMetadataGuard host; // host-side index/weight tensors stay real (comm/host_metadata.h)
  for (const auto& border : p.split.borders) {
    // Relative to the first row they name: the backward takes their terms out of those rows alone.
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (int64_t q = 0; q < border.out_len; ++q)
      for (int64_t k = 0; k < K; ++k) {
        lo = std::min(lo, local.idx[(border.out_begin + q) * K + k]);
        hi = std::max(hi, local.idx[(border.out_begin + q) * K + k] + 1);
      }
    if (border.out_len == 0) lo = hi = 0;
    p.native_border_rows.emplace_back(lo, hi - lo);
    std::vector<int64_t> idx(K * border.out_len);
    std::vector<double> w(K * border.out_len);
    for (int64_t q = 0; q < border.out_len; ++q)
      for (int64_t k = 0; k < K; ++k) {
        idx[k * border.out_len + q] = local.idx[(border.out_begin + q) * K + k] - lo;
        w[k * border.out_len + q] = local.w[(border.out_begin + q) * K + k];
      }
    p.native_border_taps.emplace_back(
        at::tensor(idx, at::TensorOptions().dtype(at::kLong)).view({K, border.out_len}).to(opts.device()),
        at::tensor(w, at::TensorOptions().dtype(at::kDouble)).view({K, border.out_len}).to(opts));
  }
}

at::Tensor weight_view(const at::Tensor& w, int64_t dim, int64_t ndim) {
  std::vector<int64_t> shape(ndim, 1);
  shape[dim] = w.numel();
  return w.view(shape);
}

// Resample `src` along `dim` with taps `idx_t`/`w_t` ([K, n], relative to src's rows).
at::Tensor resample_with(const at::Tensor& src, int64_t dim, int64_t K, const at::Tensor& idx_t,
                         const at::Tensor& w_t) {
  at::Tensor out;
  const auto idx = comm::plan_constant(idx_t, src);
  const auto w = K == 1 ? at::Tensor() : comm::plan_constant(w_t, src);
  for (int64_t k = 0; k < K; ++k) {
    auto rows = src.index_select(dim, idx[k]);
    if (K == 1) return rows; // nearest and identity taps have weight 1
    // The first tap's rows become the result, scaled in place; the others are added in place.
    if (!out.defined()) out = rows.mul_(weight_view(w[k], dim, src.dim()));
    else out.addcmul_(rows, weight_view(w[k], dim, src.dim()));
  }
  return out;
}

// Resample the window along p.dim to this rank's outputs.
at::Tensor resample(const at::Tensor& window, const DimPlan& p) {
  return resample_with(window, p.dim, p.K, p.idx, p.w);
}

// Adjoint of resample_with for outputs [from, from + len) of g, whose taps are columns [tap_from, tap_from + len)
// of idx_t/w_t: the gradient of `rows` source rows.
at::Tensor resample_backward_with(const at::Tensor& g, int64_t dim, int64_t K, const at::Tensor& idx_t,
                                  const at::Tensor& w_t, int64_t rows, int64_t from, int64_t len, int64_t tap_from) {
  auto shape = g.sizes().vec();
  shape[dim] = rows;
  auto out = at::zeros(shape, g.options());
  if (len == 0) return out;
  const auto idx = comm::plan_constant(idx_t, g).narrow(1, tap_from, len);
  const auto w = K == 1 ? at::Tensor() : comm::plan_constant(w_t, g).narrow(1, tap_from, len);
  const auto gs = g.narrow(dim, from, len);
  at::Tensor term;  // one buffer for every tap's weighted gradient
  for (int64_t k = 0; k < K; ++k) {
    if (K == 1) {
      out.index_add_(dim, idx[k], gs);
      break;
    }
    term = term.defined() ? at::mul_out(term, gs, weight_view(w[k], dim, g.dim()))
                          : gs * weight_view(w[k], dim, g.dim());
    out.index_add_(dim, idx[k], term);
  }
  return out;
}

// Adjoint of resample: the gradient of the window from the gradient of this rank's outputs.
at::Tensor resample_backward(const at::Tensor& g, const DimPlan& p) {
  return resample_backward_with(g, p.dim, p.K, p.idx, p.w, p.window_rows, 0, g.size(p.dim), 0);
}

// One sharded dim without the window (comm/halo_borders.h): the main call resamples the own rows while the halo
// travels; the border outputs are recomputed from border windows and written over their rows.
at::Tensor resample_sharded(const at::Tensor& local, const DimPlan& p, const Mesh& mesh) {
  if (!p.split.direct) return resample(p.halo.gather(local, mesh), p);
  auto kernel = [&](const std::vector<at::Tensor>& in, const comm::BorderCall& c) -> std::vector<at::Tensor> {
    if (c.main) return {resample_with(in[0], p.dim, p.K, p.main_idx, p.main_w)};
    size_t j = 0;
    while (p.split.borders[j].out_begin != c.out_begin) ++j;
    return {resample_with(in[0], p.dim, p.K, p.border_taps[j].first, p.border_taps[j].second)};
  };
  return comm::border_forward(p.halo, p.split, {local}, mesh, kernel).outputs[0];
}

// Its adjoint: the own rows' gradient from the interior outputs, the border outputs' from their windows (their own
// rows added, their halo rows sent home), and the rows peers send home added.
at::Tensor resample_sharded_backward(const at::Tensor& g, const DimPlan& p, const Mesh& mesh) {
  if (!p.split.direct) return p.halo.scatter_add(resample_backward(g, p), mesh, /*consume=*/true);
  auto shape = g.sizes().vec();
  shape[p.dim] = p.own_rows;
  auto kernel = [&](const std::vector<at::Tensor>&, const comm::BorderCall& c) -> std::vector<at::Tensor> {
    if (c.main)
      return {resample_backward_with(g, p.dim, p.K, p.main_idx, p.main_w, p.own_rows, p.top, p.bottom - p.top,
                                     p.top)};
    size_t j = 0;
    while (p.split.borders[j].out_begin != c.out_begin) ++j;
    const auto& b = p.split.borders[j];
    // A border's taps are its own outputs' (all outputs' when no main call: then out_begin is 0).
    return {resample_backward_with(g, p.dim, p.K, p.border_taps[j].first, p.border_taps[j].second, b.win_len,
                                   b.out_begin, b.out_len, 0)};
  };
  return comm::border_backward(p.halo, p.split, shape, g.options(), 0, mesh, kernel)[0];
}

// The single-device kernel of a mode and rank: every spatial dim at once, `sizes` the output's spatial sizes,
// `scales` per dim (nullopt: the kernel's own size ratio).
using Scales = std::vector<std::optional<double>>;

at::Tensor native_forward(const OpInfo& info, const at::Tensor& x, at::IntArrayRef sizes, bool ac, const Scales& sc) {
  // No batch rows or no channels here (a rank whose block along another mesh dim is empty, e.g. a batch or channel
  // extent 0): torch's kernels accept an empty batch only, so the empty result is made here.
  if (x.size(0) * x.size(1) == 0) {
    std::vector<int64_t> shape{x.size(0), x.size(1)};
    shape.insert(shape.end(), sizes.begin(), sizes.end());
    return at::empty(shape, x.options());
  }
  switch (info.mode) {
    case Mode::Nearest:
      if (info.nd == 1) return at::upsample_nearest1d(x, sizes, sc[0]);
      if (info.nd == 2) return at::upsample_nearest2d(x, sizes, sc[0], sc[1]);
      return at::upsample_nearest3d(x, sizes, sc[0], sc[1], sc[2]);
    case Mode::NearestExact:
      if (info.nd == 1) return at::_upsample_nearest_exact1d(x, sizes, sc[0]);
      if (info.nd == 2) return at::_upsample_nearest_exact2d(x, sizes, sc[0], sc[1]);
      return at::_upsample_nearest_exact3d(x, sizes, sc[0], sc[1], sc[2]);
    case Mode::Linear:
      if (info.nd == 1) return at::upsample_linear1d(x, sizes, ac, sc[0]);
      if (info.nd == 2) return at::upsample_bilinear2d(x, sizes, ac, sc[0], sc[1]);
      return at::upsample_trilinear3d(x, sizes, ac, sc[0], sc[1], sc[2]);
    case Mode::Cubic:
      return at::upsample_bicubic2d(x, sizes, ac, sc[0], sc[1]);
  }
  TORCH_INTERNAL_ASSERT(false, "interpolate: unknown mode");
}

// Its backward: the gradient of an input of `in_sizes` (all dims) from `g`.
at::Tensor native_backward(const OpInfo& info, const at::Tensor& g, at::IntArrayRef in_sizes, bool ac,
                           const Scales& sc) {
  const auto out = g.sizes().slice(2);
  if (g.size(0) * g.size(1) == 0) return at::zeros(in_sizes, g.options());  // as native_forward: nothing to resample
  switch (info.mode) {
    case Mode::Nearest:
      if (info.nd == 1) return at::upsample_nearest1d_backward(g, out, in_sizes, sc[0]);
      if (info.nd == 2) return at::upsample_nearest2d_backward(g, out, in_sizes, sc[0], sc[1]);
      return at::upsample_nearest3d_backward(g, out, in_sizes, sc[0], sc[1], sc[2]);
    case Mode::NearestExact:
      if (info.nd == 1) return at::_upsample_nearest_exact1d_backward(g, out, in_sizes, sc[0]);
      if (info.nd == 2) return at::_upsample_nearest_exact2d_backward(g, out, in_sizes, sc[0], sc[1]);
      return at::_upsample_nearest_exact3d_backward(g, out, in_sizes, sc[0], sc[1], sc[2]);
    case Mode::Linear:
      if (info.nd == 1) return at::upsample_linear1d_backward(g, out, in_sizes, ac, sc[0]);
      if (info.nd == 2) return at::upsample_bilinear2d_backward(g, out, in_sizes, ac, sc[0], sc[1]);
      return at::upsample_trilinear3d_backward(g, out, in_sizes, ac, sc[0], sc[1], sc[2]);
    case Mode::Cubic:
      return at::upsample_bicubic2d_backward(g, out, in_sizes, ac, sc[0], sc[1]);
  }
  TORCH_INTERNAL_ASSERT(false, "interpolate: unknown mode");
}

// The one sharded spatial dim's plan when the single-device kernel serves its main call (else null).
const DimPlan* native_dim(const std::vector<DimPlan>& dims) {
  const DimPlan* found = nullptr;
  for (const auto& p : dims) {
    if (p.mesh_dim < 0) continue;
    if (found) return nullptr;
    found = &p;
  }
  return found && found->native_row >= 0 ? found : nullptr;
}

// The scales the main call's kernel is given: the sharded dim's native_scale, the op's own elsewhere.
Scales native_scales(const std::vector<DimPlan>& dims, const DimPlan& sharded, const std::vector<double>& scales) {
  Scales sc;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (&dims[i] == &sharded) sc.emplace_back(sharded.native_scale);
    else sc.push_back(scales[i] > 0. ? std::optional<double>(scales[i]) : std::nullopt);
  }
  return sc;
}

// The forward through the single-device kernel (DimPlan::native_row): its main call on the own rows writes every
// output of this rank in one pass while the halo travels; the border outputs are resampled from their border
// windows along the sharded dim, then along the others, and written over their rows.
at::Tensor native_sharded_forward(const at::Tensor& t, const InterpPlan& plan, const DimPlan& p, const OpInfo& info,
                                  bool ac, const std::vector<double>& scales, const Mesh& mesh) {
  std::vector<int64_t> sizes(plan.out_shape.end() - info.nd, plan.out_shape.end());
  sizes[p.dim - 2] = p.outputs;
  const auto sc = native_scales(plan.fwd, p, scales);
  auto kernel = [&](const std::vector<at::Tensor>& in, const comm::BorderCall& c) -> std::vector<at::Tensor> {
    if (c.main)
      return {native_forward(info, in[0].narrow(p.dim, p.native_row, p.own_rows - p.native_row), sizes, ac, sc)};
    size_t j = 0;
    while (p.split.borders[j].out_begin != c.out_begin) ++j;
    auto r = resample_with(in[0], p.dim, p.K, p.border_taps[j].first, p.border_taps[j].second);
    for (const auto& q : plan.fwd)
      if (q.mesh_dim < 0) r = resample(r, q);
    return {r};
  };
  return comm::border_forward(p.halo, p.split, {t}, mesh, kernel).outputs[0];
}

// Its backward: the main call's single-device backward on the whole local gradient, less the border outputs' terms
// through its (clamped) taps; each border's gradient resampled back along the other dims, then onto its window.
at::Tensor native_sharded_backward(const at::Tensor& g, const InterpPlan& plan, const DimPlan& p,
                                   const std::vector<int64_t>& in_shape, const OpInfo& info, bool ac,
                                   const std::vector<double>& scales, const Mesh& mesh) {
  const auto sc = native_scales(plan.bwd, p, scales);
  // A border slab's gradient back along the unsharded dims (their full input sizes).
  auto other_dims_back = [&](at::Tensor r) {
    for (auto it = plan.bwd.rbegin(); it != plan.bwd.rend(); ++it)
      if (it->mesh_dim < 0) r = resample_backward(r, *it);
    return r;
  };
  auto kernel = [&](const std::vector<at::Tensor>&, const comm::BorderCall& c) -> std::vector<at::Tensor> {
    if (c.main) {
      auto main_shape = in_shape;
      main_shape[p.dim] = p.own_rows - p.native_row;
      auto gi = native_backward(info, g, main_shape, ac, sc);
      for (size_t j = 0; j < p.split.borders.size(); ++j) {
        const auto& b = p.split.borders[j];
        if (b.out_len == 0) continue;
        auto slab = other_dims_back(g.narrow(p.dim, b.out_begin, b.out_len));
        const auto [lo, rows] = p.native_border_rows[j];
        gi.narrow(p.dim, lo, rows)
            .sub_(resample_backward_with(slab, p.dim, p.K, p.native_border_taps[j].first,
                                         p.native_border_taps[j].second, rows, 0, b.out_len, 0));
      }
      if (p.native_row == 0) return {gi};
      // Rows before the main call's first (an odd offset of a downsampling) get only border terms: zero here.
      auto full = at::empty(in_shape, g.options());
      full.narrow(p.dim, 0, p.native_row).zero_();
      full.narrow(p.dim, p.native_row, main_shape[p.dim]).copy_(gi);
      return {full};
    }
    size_t j = 0;
    while (p.split.borders[j].out_begin != c.out_begin) ++j;
    const auto& b = p.split.borders[j];
    auto slab = other_dims_back(g.narrow(p.dim, b.out_begin, b.out_len));
    return {resample_backward_with(slab, p.dim, p.K, p.border_taps[j].first, p.border_taps[j].second, b.win_len, 0,
                                   b.out_len, 0)};
  };
  return comm::border_backward(p.halo, p.split, in_shape, g.options(), 0, mesh, kernel)[0];
}

// An unsharded dim resampled by the single-device kernel, every other spatial dim kept (their output size is their
// input size, which every kernel maps to the identity: weight 1 on the row itself and 0 elsewhere): one pass
// instead of K gathers, products and sums. `i`: the spatial dim's index.
at::Tensor native_along(const OpInfo& info, const at::Tensor& t, size_t i, int64_t size, bool ac,
                        const std::vector<double>& scales) {
  std::vector<int64_t> sizes(t.sizes().end() - info.nd, t.sizes().end());
  sizes[i] = size;
  Scales sc(info.nd, std::nullopt);
  if (scales[i] > 0.) sc[i] = scales[i];
  return native_forward(info, t, sizes, ac, sc);
}

// Its backward: the gradient of `t`'s dim i back to `size` rows.
at::Tensor native_along_backward(const OpInfo& info, const at::Tensor& g, size_t i, int64_t size, bool ac,
                                 const std::vector<double>& scales) {
  auto in_sizes = g.sizes().vec();
  in_sizes[2 + i] = size;
  Scales sc(info.nd, std::nullopt);
  if (scales[i] > 0.) sc[i] = scales[i];
  return native_backward(info, g, in_sizes, ac, sc);
}

bool fwd_shortcut(Mode mode, int64_t nd) {
  return (mode == Mode::Nearest && nd == 2) || mode == Mode::Linear;
}

at::ScalarType math_type(at::ScalarType t) {
  return at::isReducedFloatingType(t) ? at::kFloat : t;
}

// Plans every spatial dim, both directions: the forward's taps decide the output partition; the backward gathers
// and scatters with the backward kernels' taps. `dtype`: the math type (taps in double for fp64, else float).
InterpPlan make_plan(const ShardSpec& spec, const OpInfo& info, const std::vector<int64_t>& osize, bool ac,
                     const std::vector<double>& scales, at::ScalarType dtype, c10::Device device) {
  InterpPlan plan;
  const auto ndim = spec.ndim();
  plan.out_shape = spec.global_shape;
  for (int64_t i = 0; i < info.nd; ++i) plan.out_shape[2 + i] = osize[i];
  bool all_equal = true;
  for (int64_t i = 0; i < info.nd; ++i) all_equal = all_equal && osize[i] == spec.global_shape[2 + i];
  plan.out_ext = spec.dim_extents();
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  const auto& coordinates = spec.mesh->coordinates();
  for (int64_t i = 0; i < info.nd; ++i) {
    const auto d = ndim - info.nd + i;
    const auto L = spec.global_shape[d], O = osize[i];
    const auto m = spec.mesh_dim_of(d);
    const auto& in_ext = m >= 0 ? spec.extents[m] : std::vector<int64_t>{};
    auto fwd = taps_for(dtype, info.mode, L, O, ac, scales[i], fwd_shortcut(info.mode, info.nd));
    const bool bsc = info.mode == Mode::Nearest || info.mode == Mode::Linear || (info.mode == Mode::Cubic && all_equal);
    auto bwd = taps_for(dtype, info.mode, L, O, ac, scales[i], bsc);
    std::vector<int64_t> out_extents;
    plan.fwd.push_back(plan_dim(d, m, in_ext, L, O, fwd, fwd, coordinates, opts, out_extents));
    plan.bwd.push_back(plan_dim(d, m, in_ext, L, O, fwd, bwd, coordinates, opts, out_extents));
    if (dtype == at::kDouble) {
      plan_native<double>(plan.fwd.back(), fwd, info.mode, L, O, ac, scales[i], fwd_shortcut(info.mode, info.nd), opts);
      plan_native<double>(plan.bwd.back(), bwd, info.mode, L, O, ac, scales[i], bsc, opts);
    } else {
      plan_native<float>(plan.fwd.back(), fwd, info.mode, L, O, ac, scales[i], fwd_shortcut(info.mode, info.nd), opts);
      plan_native<float>(plan.bwd.back(), bwd, info.mode, L, O, ac, scales[i], bsc, opts);
    }
    if (m >= 0) plan.out_ext[d] = out_extents;
  }
  // The single-device main call exchanges the input's halo rows as they are; a rank resampling dim by dim exchanges
  // them resampled along the earlier dims (forward) or with the earlier dims still at the output's sizes (backward).
  // Both send the same messages only when no earlier dim changes size, a fact of the op's sizes (the same on every
  // rank, whichever path each takes); otherwise no rank takes the single-device main call.
  for (int64_t i = 0; i < info.nd; ++i) {
    if (plan.fwd[i].mesh_dim < 0) continue;
    for (int64_t j = 0; j < i; ++j)
      if (osize[j] != spec.global_shape[ndim - info.nd + j]) plan.fwd[i].native_row = plan.bwd[i].native_row = -1;
  }
  return plan;
}

std::shared_ptr<const InterpPlan> interp_plan(const ShardSpec& spec, const OpInfo& info,
                                              const std::vector<int64_t>& osize, bool ac,
                                              const std::vector<double>& scales, at::ScalarType dtype,
                                              c10::Device device) {
  const auto math = math_type(dtype);
  comm::PlanKey key;
  key.add_spec(spec).add(static_cast<int64_t>(info.mode)).add(info.nd).add_ints(osize).add(ac);
  for (auto s : scales) key.add_double(s);
  key.add(static_cast<int64_t>(math)).add_device(device);
  return comm::cached_plan<InterpPlan>(key, [&] { return make_plan(spec, info, osize, ac, scales, math, device); });
}

void check_input(const at::Tensor& x, const OpInfo& info) {
  TORCH_CHECK_VALUE(x.dim() == info.nd + 2, "ShardTensor interpolate: expected a ", info.nd + 2,
                    "-D input, got ", x.dim(), "-D");
  TORCH_CHECK_NOT_IMPLEMENTED(at::isFloatingType(x.scalar_type()),
                              "ShardTensor interpolate: only floating inputs are supported, got ", x.scalar_type());
  for (int64_t d = 2; d < x.dim(); ++d)
    TORCH_CHECK_VALUE(x.size(d) > 0, "ShardTensor interpolate: input spatial sizes must be > 0");
}

at::Tensor interp_forward(const at::Tensor& self_in, const OpInfo& info, const std::vector<int64_t>& osize, bool ac,
                          const std::vector<double>& scales) {
  auto self = resolve_partial_once(self_in, false);
  check_input(self, info);
  for (auto o : osize) TORCH_CHECK_VALUE(o > 0, "ShardTensor interpolate: output sizes must be > 0");
  const auto& spec = shard_impl(self)->spec();
  const auto dtype = self.scalar_type();
  auto plan = interp_plan(*spec, info, osize, ac, scales, dtype, self.device());
  auto t = shard_impl(self)->local().to(math_type(dtype));
  if (const auto* p = native_dim(plan->fwd)) {
    t = native_sharded_forward(t, *plan, *p, info, ac, scales, *spec->mesh);
  } else {
    for (size_t i = 0; i < plan->fwd.size(); ++i) {
      const auto& p = plan->fwd[i];
      // (The kernels refuse empty inputs: a rank without rows or outputs along a sharded dim resamples by taps.)
      t = p.mesh_dim >= 0 ? resample_sharded(t, p, *spec->mesh)
          : t.numel() == 0 ? resample(t, p)
                           : native_along(info, t, i, plan->out_shape[p.dim], ac, scales);
    }
  }
  return wrap(t.to(dtype).contiguous(), spec->mesh, spec->placements, plan->out_shape, plan->out_ext);
}

// The gradient of the input (laid out as `in_spec`) from the gradient of the output.
at::Tensor interp_backward(const at::Tensor& grad, const SpecPtr& in_spec, const OpInfo& info,
                           const std::vector<int64_t>& osize, bool ac, const std::vector<double>& scales) {
  const auto dtype = grad.scalar_type();
  auto plan = interp_plan(*in_spec, info, osize, ac, scales, dtype, grad.device());
  const auto& mesh = in_spec->mesh;
  auto g = local_aligned(resolve_partial(dispatch::as_shard(grad, mesh)), mesh, plan->out_shape, in_spec->placements,
                         plan->out_ext)
               .to(math_type(dtype));
  if (const auto* p = native_dim(plan->bwd)) {
    g = native_sharded_backward(g, *plan, *p, in_spec->local_shape, info, ac, scales, *mesh);
  } else {
    for (size_t i = plan->bwd.size(); i-- > 0;) {
      const auto& p = plan->bwd[i];
      g = p.mesh_dim >= 0 ? resample_sharded_backward(g, p, *mesh)
          : g.numel() == 0 ? resample_backward(g, p)
                           : native_along_backward(info, g, i, in_spec->global_shape[p.dim], ac, scales);
    }
  }
  return make_shard_tensor(g.to(dtype).contiguous(), in_spec);
}

OpInfo info_from(int64_t mode, int64_t nd) {
  return {static_cast<Mode>(mode), nd, mode == static_cast<int64_t>(Mode::Linear) || mode == static_cast<int64_t>(Mode::Cubic)};
}

// Interpolation is linear in its input: its backward is the adjoint (interp_backward), and that adjoint's own
// backward is the interpolation again (a second derivative through an upsampling U-Net).
struct InterpMap : LinearMap {
  SpecPtr in_spec;
  OpInfo info;
  std::vector<int64_t> osize;
  bool ac;
  std::vector<double> scales;
  InterpMap(SpecPtr s, OpInfo i, std::vector<int64_t> o, bool a, std::vector<double> sc)
      : in_spec(std::move(s)), info(i), osize(std::move(o)), ac(a), scales(std::move(sc)) {}
  at::Tensor apply(const at::Tensor& x) const override {
    return interp_forward(grad_to_spec(x, in_spec), info, osize, ac, scales);
  }
  at::Tensor adjoint(const at::Tensor& g) const override { return interp_backward(g, in_spec, info, osize, ac, scales); }
};

struct InterpFn : torch::autograd::Function<InterpFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& self, int64_t mode, int64_t nd,
                            std::vector<int64_t> osize, bool ac, std::vector<double> scales) {
    ctx->set_materialize_grads(false);
    auto x = resolve_partial_once(self, false);
    const auto info = info_from(mode, nd);
    auto out = interp_forward(x, info, osize, ac, scales);
    ctx->saved_data["map"] =
        map_ivalue(c10::make_intrusive<InterpMap>(shard_impl(x)->spec(), info, std::move(osize), ac, std::move(scales)));
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    return linear_map_backward(ctx, g, 6);
  }
};

// A non-.vec op's optional scales: 0 where not given.
std::vector<double> scales_of(std::initializer_list<std::optional<double>> scales) {
  std::vector<double> out;
  for (const auto& s : scales) out.push_back(s.value_or(0.0));
  return out;
}

// .vec overloads (input, output_size?, [align_corners,] scale_factors?): composite-implicit; bound above autograd
// on both shard keys.
at::Tensor vec_entry(const OpInfo& info, const at::Tensor& input, at::OptionalSymIntArrayRef output_size, bool ac,
                     std::optional<at::ArrayRef<double>> scale_factors) {
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(input), "ShardTensor interpolate: the input must be the ShardTensor");
  TORCH_CHECK_VALUE(input.dim() == info.nd + 2, "ShardTensor interpolate: expected a ", info.nd + 2, "-D input");
  const bool has_size = output_size.has_value();
  TORCH_CHECK_VALUE(has_size != scale_factors.has_value(), "Must specify exactly one of output_size and scale_factors");
  std::vector<int64_t> osize;
  std::vector<double> scales(info.nd, 0.0);
  if (has_size) {
    osize = concrete_ints(*output_size);
    TORCH_CHECK_VALUE(static_cast<int64_t>(osize.size()) == info.nd, "output_size must have ", info.nd, " entries");
  } else {
    const auto& f = *scale_factors;
    TORCH_CHECK_VALUE(static_cast<int64_t>(f.size()) == info.nd, "scale_factors must have ", info.nd, " entries");
    for (int64_t i = 0; i < info.nd; ++i) {
      osize.push_back(static_cast<int64_t>(input.size(2 + i) * f[i]));
      scales[i] = f[i];
    }
  }
  return InterpFn::apply(input, static_cast<int64_t>(info.mode), info.nd, osize, ac, scales);
}

// upsample_nearest{1,2,3}d.vec(Tensor input, SymInt[]? output_size, float[]? scale_factors),
// _upsample_nearest_exact{1,2,3}d.vec likewise
template <Mode M, int64_t ND>
at::Tensor upsample_vec_rule(const at::Tensor& input, at::OptionalSymIntArrayRef output_size,
                             std::optional<at::ArrayRef<double>> scale_factors) {
  return vec_entry({M, ND, false}, input, output_size, false, scale_factors);
}

// upsample_linear1d.vec(Tensor input, SymInt[]? output_size, bool align_corners, float[]? scale_factors),
// upsample_bilinear2d.vec, upsample_bicubic2d.vec, upsample_trilinear3d.vec likewise
template <Mode M, int64_t ND>
at::Tensor upsample_vec_align_rule(const at::Tensor& input, at::OptionalSymIntArrayRef output_size, bool align_corners,
                                   std::optional<at::ArrayRef<double>> scale_factors) {
  return vec_entry({M, ND, true}, input, output_size, align_corners, scale_factors);
}

// Non-.vec forward ops below autograd.
at::Tensor forward_entry(const OpInfo& info, const at::Tensor& self, c10::SymIntArrayRef output_size, bool ac,
                         const std::vector<double>& scales) {
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(self), "ShardTensor interpolate: the input must be the ShardTensor");
  return interp_forward(self, info, concrete_ints(output_size), ac, scales);
}

// upsample_nearest1d(Tensor self, SymInt[1] output_size, float? scales=None), _upsample_nearest_exact1d likewise
template <Mode M>
at::Tensor upsample1d_rule(const at::Tensor& self, c10::SymIntArrayRef output_size, std::optional<double> scales) {
  return forward_entry({M, 1, false}, self, output_size, false, scales_of({scales}));
}

// upsample_nearest2d(Tensor self, SymInt[2] output_size, float? scales_h=None, float? scales_w=None),
// _upsample_nearest_exact2d likewise
template <Mode M>
at::Tensor upsample2d_rule(const at::Tensor& self, c10::SymIntArrayRef output_size, std::optional<double> scales_h,
                           std::optional<double> scales_w) {
  return forward_entry({M, 2, false}, self, output_size, false, scales_of({scales_h, scales_w}));
}

// upsample_nearest3d(Tensor self, SymInt[3] output_size, float? scales_d=None, float? scales_h=None,
//                    float? scales_w=None), _upsample_nearest_exact3d likewise
template <Mode M>
at::Tensor upsample3d_rule(const at::Tensor& self, c10::SymIntArrayRef output_size, std::optional<double> scales_d,
                           std::optional<double> scales_h, std::optional<double> scales_w) {
  return forward_entry({M, 3, false}, self, output_size, false, scales_of({scales_d, scales_h, scales_w}));
}

// upsample_linear1d(Tensor self, SymInt[1] output_size, bool align_corners, float? scales=None)
at::Tensor upsample_linear1d_rule(const at::Tensor& self, c10::SymIntArrayRef output_size, bool align_corners,
                                  std::optional<double> scales) {
  return forward_entry({Mode::Linear, 1, true}, self, output_size, align_corners, scales_of({scales}));
}

// upsample_bilinear2d(Tensor self, SymInt[2] output_size, bool align_corners, float? scales_h=None,
//                     float? scales_w=None), upsample_bicubic2d likewise
template <Mode M>
at::Tensor upsample2d_align_rule(const at::Tensor& self, c10::SymIntArrayRef output_size, bool align_corners,
                                 std::optional<double> scales_h, std::optional<double> scales_w) {
  return forward_entry({M, 2, true}, self, output_size, align_corners, scales_of({scales_h, scales_w}));
}

// upsample_trilinear3d(Tensor self, SymInt[3] output_size, bool align_corners, float? scales_d=None,
//                      float? scales_h=None, float? scales_w=None)
at::Tensor upsample_trilinear3d_rule(const at::Tensor& self, c10::SymIntArrayRef output_size, bool align_corners,
                                     std::optional<double> scales_d, std::optional<double> scales_h,
                                     std::optional<double> scales_w) {
  return forward_entry({Mode::Linear, 3, true}, self, output_size, align_corners,
                       scales_of({scales_d, scales_h, scales_w}));
}

// *_backward ops below autograd. The input's layout is not known here: the gradient keeps grad_output's
// non-spatial layout and uses the default split along sharded spatial dims.
at::Tensor backward_entry(const OpInfo& info, const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                          c10::SymIntArrayRef input_size, bool ac, const std::vector<double>& scales) {
  // grad_output is the ops' only tensor argument, so the ShardTensor that dispatched here.
  TORCH_INTERNAL_ASSERT(shard_impl(grad_output), "ShardTensor interpolate backward: grad_output is not a ShardTensor");
  const auto mesh = shard_impl(grad_output)->spec()->mesh;
  auto grad = resolve_partial(grad_output);
  auto gspec = shard_impl(grad)->spec();
  DimExtents ext;
  for (size_t m = 0; m < gspec->placements.size(); ++m)
    if (gspec->placements[m].is_shard() && gspec->placements[m].dim < 2)
      ext[gspec->placements[m].dim] = gspec->extents[m];
  auto in_spec =
      ShardSpec::make_with_dim_extents(mesh, gspec->placements, concrete_ints(input_size), ext);
  return interp_backward(grad, in_spec, info, concrete_ints(output_size), ac, scales);
}

// upsample_nearest1d_backward(Tensor grad_output, SymInt[1] output_size, SymInt[3] input_size, float? scales=None),
// _upsample_nearest_exact1d_backward likewise
template <Mode M>
at::Tensor upsample1d_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                                    c10::SymIntArrayRef input_size, std::optional<double> scales) {
  return backward_entry({M, 1, false}, grad_output, output_size, input_size, false, scales_of({scales}));
}

// upsample_nearest2d_backward(Tensor grad_output, SymInt[2] output_size, SymInt[4] input_size,
//                             float? scales_h=None, float? scales_w=None), _upsample_nearest_exact2d_backward likewise
template <Mode M>
at::Tensor upsample2d_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                                    c10::SymIntArrayRef input_size, std::optional<double> scales_h,
                                    std::optional<double> scales_w) {
  return backward_entry({M, 2, false}, grad_output, output_size, input_size, false, scales_of({scales_h, scales_w}));
}

// upsample_nearest3d_backward(Tensor grad_output, SymInt[3] output_size, SymInt[5] input_size,
//                             float? scales_d=None, float? scales_h=None, float? scales_w=None),
// _upsample_nearest_exact3d_backward likewise
template <Mode M>
at::Tensor upsample3d_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                                    c10::SymIntArrayRef input_size, std::optional<double> scales_d,
                                    std::optional<double> scales_h, std::optional<double> scales_w) {
  return backward_entry({M, 3, false}, grad_output, output_size, input_size, false,
                        scales_of({scales_d, scales_h, scales_w}));
}

// upsample_linear1d_backward(Tensor grad_output, SymInt[1] output_size, SymInt[3] input_size, bool align_corners,
//                            float? scales=None)
at::Tensor upsample_linear1d_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                                           c10::SymIntArrayRef input_size, bool align_corners,
                                           std::optional<double> scales) {
  return backward_entry({Mode::Linear, 1, true}, grad_output, output_size, input_size, align_corners,
                        scales_of({scales}));
}

// upsample_bilinear2d_backward(Tensor grad_output, SymInt[2] output_size, SymInt[4] input_size, bool align_corners,
//                              float? scales_h=None, float? scales_w=None), upsample_bicubic2d_backward likewise
template <Mode M>
at::Tensor upsample2d_align_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                                          c10::SymIntArrayRef input_size, bool align_corners,
                                          std::optional<double> scales_h, std::optional<double> scales_w) {
  return backward_entry({M, 2, true}, grad_output, output_size, input_size, align_corners,
                        scales_of({scales_h, scales_w}));
}

// upsample_trilinear3d_backward(Tensor grad_output, SymInt[3] output_size, SymInt[5] input_size, bool align_corners,
//                               float? scales_d=None, float? scales_h=None, float? scales_w=None)
at::Tensor upsample_trilinear3d_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                                              c10::SymIntArrayRef input_size, bool align_corners,
                                              std::optional<double> scales_d, std::optional<double> scales_h,
                                              std::optional<double> scales_w) {
  return backward_entry({Mode::Linear, 3, true}, grad_output, output_size, input_size, align_corners,
                        scales_of({scales_d, scales_h, scales_w}));
}

// Antialiased bilinear/bicubic run locally when no spatial dim is sharded (batch/channel shards). A split spatial dim
// (the filter's support grows with the downscale, so no fixed halo serves it) moves to the batch or the channel dim
// first, the larger that is free and as large as the mesh dim (one all-to-all).
// When neither can take it (a single field: batch and channels smaller than the mesh dim), the separable filter runs
// in two stages with the split moved between them, as the multi-dim FFT does (aa_staged_*); with both spatial dims
// split, one may move to the batch or channels and the other stages. Both staying (a single-channel field on a 2x2
// mesh) is refused.
// The op's tensor (the input, or the gradient of the output) with pending sums completed and the spatial splits moved
// to the batch or channel dim where one can take them; `all_moved` says whether every spatial split moved. Two split
// spatial dims (a 2x2 mesh) with one image of a few channels: one split moves to the channels and the other stays
// for the staged passes. Decided from the layout and the global sizes alone.
at::Tensor aa_tensor(const at::Tensor& x_in, bool& all_moved) {
  auto x = x_in;
  all_moved = true;
  for (int64_t d = 2; d < x.dim(); ++d) {
    if (shard_impl(x)->spec()->mesh_dim_of(d) < 0) continue;
    auto moved = split_moved_off(x, d, [](int64_t other) { return other < 2; });
    if (moved) x = *moved;
    else all_moved = false;
  }
  return x;
}

[[noreturn]] void aa_refuse() {
  dispatch::not_implemented("antialiased interpolation of a spatially sharded input whose split neither the batch or "
                            "channel dim nor the other spatial dim can take (both spatial dims sharded, or the other "
                            "one shorter than the mesh dim); use antialias=False or redistribute the spatial dims "
                            "first");
}

// `x` (its only sharded spatial dim `from`) with that split moved to spatial dim `to`, the default split; nullopt when
// `to` is sharded too or has fewer rows than the mesh dim has ranks.
std::optional<at::Tensor> aa_split_moved(const at::Tensor& x, int64_t from, int64_t to) {
  return split_moved_off(x, from, [to](int64_t d) { return d == to; });
}

// The spatial dim (2 = H or 3 = W) a mesh dim shards in `x`, or -1 when none; aa_refuse() when both are.
int64_t aa_split_dim(const at::Tensor& x) {
  const auto& spec = *shard_impl(x)->spec();
  const bool h = spec.mesh_dim_of(2) >= 0, w = spec.mesh_dim_of(3) >= 0;
  if (h && w) aa_refuse();
  return h ? 2 : w ? 3 : -1;
}

// aa_one_column: torch's CPU antialiased kernels resize H wrongly when the block is one column wide (every output row
// takes one input row's value); the same pass as a W pass of the transposed block is exact, and a staged rank's block
// can be one column wide, so the H passes of such blocks run transposed.
// One stage on the local tensor: sizes (out_h, out_w) with the scale of the resized dim given and the other dim kept
// (its rows map onto themselves: weights 1 and 0, so that pass is exact). A rank whose block has no elements makes an
// empty (forward) or zero (backward) result of the stage's shape.
at::Tensor aa_local_stage(const std::function<at::Tensor(const at::Tensor&)>& op, const at::Tensor& local,
                          std::vector<int64_t> out_shape, bool backward) {
  if (local.numel() == 0) return backward ? at::zeros(out_shape, local.options()) : at::empty(out_shape, local.options());
  return op(local);
}

// The local block of `x` wrapped back with `x`'s placements and extents and global shape `shape`.
at::Tensor aa_rewrap(const at::Tensor& out, const at::Tensor& x, std::vector<int64_t> shape) {
  const auto& spec = shard_impl(x)->spec();
  DimExtents ext;
  for (size_t m = 0; m < spec->placements.size(); ++m)
    if (spec->placements[m].is_shard()) ext[spec->placements[m].dim] = spec->extents[m];
  return wrap(out, spec->mesh, spec->placements, shape, ext);
}

// The op's local result `out` as a ShardTensor: `x`'s layout (batch/channel shards only), global batch and channel
// sizes `lead`, whole spatial dims.
at::Tensor aa_wrap(const at::Tensor& out, const at::Tensor& x, at::IntArrayRef lead) {
  auto shape = out.sizes().vec();
  for (int64_t d = 0; d < 2; ++d) shape[d] = lead[d];
  return aa_rewrap(out, x, shape);
}

// A backward's input_size on this rank: output sizes and spatial input sizes are global (the spatial dims are whole
// here); batch and channel are the local gradient's.
std::vector<c10::SymInt> aa_local_input_size(c10::SymIntArrayRef input_size, const at::Tensor& local_grad) {
  auto isize = input_size.vec();
  isize[0] = local_grad.size(0);
  isize[1] = local_grad.size(1);
  return isize;
}

// _upsample_bilinear2d_aa / _upsample_bicubic2d_aa(Tensor self, SymInt[2] output_size, bool align_corners,
//                                                  float? scales_h=None, float? scales_w=None)
// The two schemas are alike; `local_op` is the at:: function run on the local tensor (its type picks the overload).
using AaOp = at::Tensor (*)(const at::Tensor&, c10::SymIntArrayRef, bool, std::optional<double>, std::optional<double>);
// The forward in two stages, W first then H, as torch's separable kernel runs them (bit-exact with one device): the
// split on H (moved there first if it is on W), the W stage on each rank's rows, the split moved to the output's W
// (one all-to-all), the H stage on each rank's columns; the output is split along W.
template <AaOp local_op>
at::Tensor upsample_aa_staged(const at::Tensor& self, c10::SymIntArrayRef output_size, bool align_corners,
                              std::optional<double> scales_h, std::optional<double> scales_w) {
  const int64_t out_h = concrete_int(output_size[0]), out_w = concrete_int(output_size[1]);
  auto x = self;
  const auto split = aa_split_dim(x);
  // The output's W takes the split between the passes: too few columns refuse before anything moves.
  const auto& spec = *shard_impl(x)->spec();
  if (split >= 0 && out_w < spec.mesh->size(spec.mesh_dim_of(split))) aa_refuse();
  if (split == 3) {
    auto moved = aa_split_moved(x, 3, 2);
    if (!moved) aa_refuse();
    x = *moved;
  }
  const auto& l1 = shard_impl(x)->local();
  auto w_stage = aa_local_stage(
      [&](const at::Tensor& l) {
        return local_op(l, c10::SymIntArrayRef({c10::SymInt(l.size(2)), c10::SymInt(out_w)}), align_corners,
                        std::nullopt, scales_w);
      },
      l1, {l1.size(0), l1.size(1), l1.size(2), out_w}, false);
  auto y = aa_rewrap(w_stage, x, {x.size(0), x.size(1), x.size(2), out_w});
  auto moved = aa_split_moved(y, 2, 3);
  if (!moved) aa_refuse();
  y = *moved;
  const auto& l2 = shard_impl(y)->local();
  auto h_stage = aa_local_stage(
      [&](const at::Tensor& l) {
        if (l.size(3) == 1)  // one column: the H pass as a W pass of the transposed block (see aa_one_column)
          return local_op(l.transpose(2, 3).contiguous(), c10::SymIntArrayRef({c10::SymInt(1), c10::SymInt(out_h)}),
                          align_corners, std::nullopt, scales_h)
              .transpose(2, 3);
        return local_op(l, c10::SymIntArrayRef({c10::SymInt(out_h), c10::SymInt(l.size(3))}), align_corners, scales_h,
                        std::nullopt);
      },
      l2, {l2.size(0), l2.size(1), out_h, l2.size(3)}, false);
  return aa_rewrap(h_stage, y, {y.size(0), y.size(1), out_h, out_w});
}

template <AaOp local_op>
at::Tensor upsample_aa_rule(const at::Tensor& self, c10::SymIntArrayRef output_size, bool align_corners,
                            std::optional<double> scales_h, std::optional<double> scales_w) {
  bool all_moved = false;
  auto x = aa_tensor(resolve_partial(self), all_moved);
  if (!all_moved) return upsample_aa_staged<local_op>(x, output_size, align_corners, scales_h, scales_w);
  const auto& local = shard_impl(x)->local();
  // torch's kernels accept an empty batch only: a rank without batch rows or channels makes its empty result.
  auto out = local.size(0) * local.size(1) == 0
      ? at::empty({local.size(0), local.size(1), concrete_int(output_size[0]), concrete_int(output_size[1])},
                  local.options())
      : local_op(local, output_size, align_corners, scales_h, scales_w);
  return aa_wrap(out, x, x.sizes());
}

// _upsample_bilinear2d_aa_backward / _upsample_bicubic2d_aa_backward(Tensor grad_output, SymInt[2] output_size,
//     SymInt[4] input_size, bool align_corners, float? scales_h=None, float? scales_w=None)
using AaBackwardOp = at::Tensor (*)(const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef, bool,
                                    std::optional<double>, std::optional<double>);
// The backward in two stages: the unsplit spatial dim's pass first on each rank's block, the split moved to the other
// dim's input size (one all-to-all), then that dim's pass (rounding differs from one device's by an ulp or so: its
// backward kernel accumulates in its own order).
template <AaBackwardOp local_op>
at::Tensor upsample_aa_backward_staged(const at::Tensor& grad, c10::SymIntArrayRef output_size,
                                       c10::SymIntArrayRef input_size, bool align_corners,
                                       std::optional<double> scales_h, std::optional<double> scales_w) {
  const int64_t in_h = concrete_int(input_size[2]), in_w = concrete_int(input_size[3]);
  const int64_t split = aa_split_dim(grad);
  TORCH_INTERNAL_ASSERT(split >= 0, "antialiased interpolation backward: staged without a spatial split");
  const int64_t first = split == 2 ? 3 : 2;  // the unsplit dim's pass runs first
  auto stage = [&](const at::Tensor& g, int64_t dim) {
    // the pass along `dim`: its output size to its input size, the other spatial dim kept
    const auto& l = shard_impl(g)->local();
    std::vector<int64_t> isize{l.size(0), l.size(1), l.size(2), l.size(3)};
    isize[dim] = dim == 2 ? in_h : in_w;
    auto out = aa_local_stage(
        [&](const at::Tensor& lg) {
          if (dim == 2 && lg.size(3) == 1)  // one column: as a W pass of the transposed block (aa_one_column)
            return local_op(lg.transpose(2, 3).contiguous(),
                            c10::SymIntArrayRef({c10::SymInt(1), c10::SymInt(lg.size(2))}),
                            c10::SymIntArrayRef({c10::SymInt(isize[0]), c10::SymInt(isize[1]), c10::SymInt(1),
                                                 c10::SymInt(in_h)}),
                            align_corners, std::nullopt, scales_h)
                .transpose(2, 3);
          return local_op(lg, c10::SymIntArrayRef({c10::SymInt(lg.size(2)), c10::SymInt(lg.size(3))}),
                          c10::SymIntArrayRef({c10::SymInt(isize[0]), c10::SymInt(isize[1]), c10::SymInt(isize[2]),
                                               c10::SymInt(isize[3])}),
                          align_corners, dim == 2 ? scales_h : std::nullopt, dim == 3 ? scales_w : std::nullopt);
        },
        l, isize, true);
    auto shape = g.sizes().vec();
    shape[dim] = isize[dim];
    return aa_rewrap(out, g, shape);
  };
  auto g = stage(grad, first);
  auto moved = aa_split_moved(g, split, first);
  if (!moved) aa_refuse();
  return stage(*moved, split);
}

template <AaBackwardOp local_op>
at::Tensor upsample_aa_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                                     c10::SymIntArrayRef input_size, bool align_corners,
                                     std::optional<double> scales_h, std::optional<double> scales_w) {
  bool all_moved = false;
  auto x = aa_tensor(resolve_partial(grad_output), all_moved);
  if (!all_moved)
    return upsample_aa_backward_staged<local_op>(x, output_size, input_size, align_corners, scales_h, scales_w);
  const auto& g = shard_impl(x)->local();
  const auto isize = aa_local_input_size(input_size, g);
  auto out = g.size(0) * g.size(1) == 0
      ? at::zeros(c10::IntArrayRef(concrete_ints(isize)), g.options())
      : local_op(g, output_size, isize, align_corners, scales_h, scales_w);
  return aa_wrap(out, x, c10::IntArrayRef(concrete_ints(input_size)));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(interpolate) {
  const auto above = dispatch::RuleLevel::above_autograd;
  dispatch::set_handler("aten::upsample_nearest1d.vec", typed_handler(&upsample_vec_rule<Mode::Nearest, 1>), above);
  dispatch::set_handler("aten::upsample_nearest2d.vec", typed_handler(&upsample_vec_rule<Mode::Nearest, 2>), above);
  dispatch::set_handler("aten::upsample_nearest3d.vec", typed_handler(&upsample_vec_rule<Mode::Nearest, 3>), above);
  dispatch::set_handler("aten::_upsample_nearest_exact1d.vec",
                        typed_handler(&upsample_vec_rule<Mode::NearestExact, 1>), above);
  dispatch::set_handler("aten::_upsample_nearest_exact2d.vec",
                        typed_handler(&upsample_vec_rule<Mode::NearestExact, 2>), above);
  dispatch::set_handler("aten::_upsample_nearest_exact3d.vec",
                        typed_handler(&upsample_vec_rule<Mode::NearestExact, 3>), above);
  dispatch::set_handler("aten::upsample_linear1d.vec", typed_handler(&upsample_vec_align_rule<Mode::Linear, 1>), above);
  dispatch::set_handler("aten::upsample_bilinear2d.vec", typed_handler(&upsample_vec_align_rule<Mode::Linear, 2>),
                        above);
  dispatch::set_handler("aten::upsample_trilinear3d.vec", typed_handler(&upsample_vec_align_rule<Mode::Linear, 3>),
                        above);
  dispatch::set_handler("aten::upsample_bicubic2d.vec", typed_handler(&upsample_vec_align_rule<Mode::Cubic, 2>), above);

  dispatch::set_handler("aten::upsample_nearest1d", typed_handler(&upsample1d_rule<Mode::Nearest>));
  dispatch::set_handler("aten::upsample_nearest2d", typed_handler(&upsample2d_rule<Mode::Nearest>));
  dispatch::set_handler("aten::upsample_nearest3d", typed_handler(&upsample3d_rule<Mode::Nearest>));
  dispatch::set_handler("aten::_upsample_nearest_exact1d", typed_handler(&upsample1d_rule<Mode::NearestExact>));
  dispatch::set_handler("aten::_upsample_nearest_exact2d", typed_handler(&upsample2d_rule<Mode::NearestExact>));
  dispatch::set_handler("aten::_upsample_nearest_exact3d", typed_handler(&upsample3d_rule<Mode::NearestExact>));
  dispatch::set_handler("aten::upsample_linear1d", typed_handler(&upsample_linear1d_rule));
  dispatch::set_handler("aten::upsample_bilinear2d", typed_handler(&upsample2d_align_rule<Mode::Linear>));
  dispatch::set_handler("aten::upsample_trilinear3d", typed_handler(&upsample_trilinear3d_rule));
  dispatch::set_handler("aten::upsample_bicubic2d", typed_handler(&upsample2d_align_rule<Mode::Cubic>));

  dispatch::set_handler("aten::upsample_nearest1d_backward", typed_handler(&upsample1d_backward_rule<Mode::Nearest>));
  dispatch::set_handler("aten::upsample_nearest2d_backward", typed_handler(&upsample2d_backward_rule<Mode::Nearest>));
  dispatch::set_handler("aten::upsample_nearest3d_backward", typed_handler(&upsample3d_backward_rule<Mode::Nearest>));
  dispatch::set_handler("aten::_upsample_nearest_exact1d_backward",
                        typed_handler(&upsample1d_backward_rule<Mode::NearestExact>));
  dispatch::set_handler("aten::_upsample_nearest_exact2d_backward",
                        typed_handler(&upsample2d_backward_rule<Mode::NearestExact>));
  dispatch::set_handler("aten::_upsample_nearest_exact3d_backward",
                        typed_handler(&upsample3d_backward_rule<Mode::NearestExact>));
  dispatch::set_handler("aten::upsample_linear1d_backward", typed_handler(&upsample_linear1d_backward_rule));
  dispatch::set_handler("aten::upsample_bilinear2d_backward",
                        typed_handler(&upsample2d_align_backward_rule<Mode::Linear>));
  dispatch::set_handler("aten::upsample_trilinear3d_backward", typed_handler(&upsample_trilinear3d_backward_rule));
  dispatch::set_handler("aten::upsample_bicubic2d_backward",
                        typed_handler(&upsample2d_align_backward_rule<Mode::Cubic>));

  dispatch::set_handler("aten::_upsample_bilinear2d_aa",
                        typed_handler(&upsample_aa_rule<&at::_upsample_bilinear2d_aa_symint>));
  dispatch::set_handler("aten::_upsample_bicubic2d_aa",
                        typed_handler(&upsample_aa_rule<&at::_upsample_bicubic2d_aa_symint>));
  dispatch::set_handler("aten::_upsample_bilinear2d_aa_backward",
                        typed_handler(&upsample_aa_backward_rule<&at::_upsample_bilinear2d_aa_backward_symint>));
  dispatch::set_handler("aten::_upsample_bicubic2d_aa_backward",
                        typed_handler(&upsample_aa_backward_rule<&at::_upsample_bicubic2d_aa_backward_symint>));
}

} // namespace shardtensor::ops
