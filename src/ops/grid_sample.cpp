// grid_sample (grid_sampler_2d/3d, cuDNN's cudnn_grid_sampler, and their backward) with the input, the grid or both
// split along any dims (RAFT's batch-sharded warps; VoxelMorph / spatial-transformer warps of a spatially split
// volume by a deformation field split alike).
//
// The output is laid out like the grid's points: batch shards as the batch, a grid split along an output position
// dim gives the output that split; a plain grid with a spatially split input is cut like the input (its extents when
// the sizes match, else the default split), so the work stays divided. Channel shards of the input stay local.
//
// A spatial shard of the input is a data-dependent window: each rank's grid points read input rows near where they
// point, so every rank finds the range of input rows its points' taps touch along each sharded input dim (a margin
// of one row each side covers the kernel's own rounding of the coordinates), the ranges are all-gathered (one
// small collective per sharded dim; a dim exchanged before another is widened to its group's union so the second
// exchange can carry the first's rows, the corners of a 2-D mesh), and the rows travel as a halo exchange
// (comm::HaloPlan: only between the ranks that hold them). The local kernel then runs on the window with the grid's
// coordinates along those dims re-normalized to the window (p' = p - window start; a point outside the input stays
// outside the window); the backward scales those components of the grid gradient by the window's d(y')/d(y) and
// sends the input gradient's window rows home (the plan's adjoint). A warp whose displacements are small moves a few
// rows; a grid that points anywhere moves what it reads, never more than the input.
//
// Padding `zeros` and `border` (its clamp is at the input's edge, which a window that needs an edge row contains)
// run on windows as they are; `reflection` mirrors about the input's edges, which a window does not have, so the
// grid is reflected here (in global pixels, torch's reflect-then-clip) and the kernel runs with border padding, the
// grid gradient carrying the reflection's sign. Bicubic sampling reflects each of its taps, not the point: with
// reflection padding over a split input it declines (the fallback; strict mode: NotImplementedError).
#include "ops/common.h"
#include "ops/data_windows.h"
#include "ops/describe.h"

#include <limits>
#include <memory>

namespace shardtensor::ops {

namespace {

constexpr int64_t kBilinear = 0, kNearest = 1, kBicubic = 2;
constexpr int64_t kZeros = 0, kBorder = 1, kReflection = 2;

// One sharded input dim and the grid component that addresses it.
struct WindowDim {
  int64_t dim = 0;        // input tensor dim (2 .. 2 + spatial - 1)
  int64_t mesh_dim = 0;
  int64_t component = 0;  // grid[..., component]: x addresses the last input dim
};

// The layouts of one call, decided from the specs alone.
struct GridLayout {
  MeshPtr mesh;
  int64_t spatial = 2;
  Placements in_pl, grid_pl, out_pl;
  DimExtents in_ext, grid_ext, out_ext;
  std::vector<WindowDim> windows;      // in input dim order
  std::vector<int64_t> partial_dims;   // mesh dims where the input is whole and the grid split: grad_input Partial
  std::vector<int64_t> channel_dims;   // mesh dims splitting the input's channels: grad_grid Partial (a sum over them)
  std::vector<int64_t> out_shape;
};

[[noreturn]] void decline(const std::string& op, const at::Tensor& input, const at::Tensor& grid,
                          const std::string& why) {
  dispatch::not_implemented(c10::str(op, " with input ", describe_spec(input), " and grid ", describe_spec(grid),
                                     ": ", why));
}

GridLayout grid_layout(const std::string& op, const at::Tensor& input, const at::Tensor& grid, int64_t interpolation_mode,
                       int64_t padding_mode) {
  GridLayout l;
  l.mesh = dispatch::common_mesh(op.c_str(), {input, grid});
  l.spatial = input.dim() - 2;
  const auto nm = l.mesh->ndim();
  const auto in_pl = placements_of(input, l.mesh), g_pl = placements_of(grid, l.mesh);
  const auto in_ext = shard_impl(input) ? shard_impl(input)->spec()->dim_extents() : DimExtents{};
  const auto g_ext = shard_impl(grid) ? shard_impl(grid)->spec()->dim_extents() : DimExtents{};
  l.in_pl = l.grid_pl = l.out_pl = Placements(nm, Placement::replicate());
  l.out_shape = {input.size(0), input.size(1)};
  for (int64_t d = 1; d <= l.spatial; ++d) l.out_shape.push_back(grid.size(d));
  for (int64_t m = 0; m < nm; ++m) {
    const auto& ip = in_pl[m];
    const auto& gp = g_pl[m];
    if (gp.is_shard(grid.dim() - 1)) decline(op, input, grid, "the grid's coordinate dim is sharded (redistribute it to Replicate())");
    if (ip.is_shard(0) || gp.is_shard(0)) {
      if ((ip.is_shard() && !ip.is_shard(0)) || (gp.is_shard() && !gp.is_shard(0)))
        decline(op, input, grid, "one mesh dim splits the batch of one and another dim of the other (shard both along the batch)");
      l.in_pl[m] = l.grid_pl[m] = l.out_pl[m] = Placement::shard(0);
      const auto& ext = ip.is_shard(0) ? in_ext.at(0) : g_ext.at(0);
      l.in_ext[0] = l.grid_ext[0] = l.out_ext[0] = ext;
      continue;
    }
    if (ip.is_shard(1)) {
      if (gp.is_shard()) decline(op, input, grid, "a mesh dim splits the input's channels and the grid (redistribute the grid to Replicate())");
      l.in_pl[m] = l.out_pl[m] = Placement::shard(1);
      l.in_ext[1] = l.out_ext[1] = in_ext.at(1);
      l.channel_dims.push_back(m);
      continue;
    }
    int64_t gd = gp.is_shard() ? gp.dim : -1;  // the grid's position dim on m
    if (ip.is_shard()) {
      if (padding_mode == kReflection && interpolation_mode == kBicubic)
        decline(op, input, grid, "bicubic sampling with reflection padding mirrors each tap about the input's edges, which a rank's window of a split input does not have (use bilinear, or padding_mode='zeros' or 'border', or redistribute the input)");
      const auto s = ip.dim;
      l.in_pl[m] = ip;
      l.in_ext[s] = in_ext.at(s);
      l.windows.push_back({s, m, l.spatial - 1 - (s - 2)});
      if (gd < 0) {
        // A grid whole on m: cut it like the input where the sizes match (a warp), else by the default split.
        // Whole on m but split along that dim by another mesh dim, every rank of m would compute the same points
        // and send the same input gradient home: declined.
        gd = s - 1;
        for (const auto& other : g_pl)
          if (other.is_shard(gd))
            decline(op, input, grid, "the input is split along a dim whose grid dim another mesh dim splits (shard the grid like the input)");
        l.grid_ext[gd] = grid.size(gd) == input.size(s) ? in_ext.at(s) : default_split(grid.size(gd), l.mesh->size(m));
      } else {
        l.grid_ext[gd] = g_ext.at(gd);
      }
    } else if (gd >= 0) {
      l.grid_ext[gd] = g_ext.at(gd);
      l.partial_dims.push_back(m);
    } else {
      continue;
    }
    l.grid_pl[m] = Placement::shard(gd);
    l.out_pl[m] = Placement::shard(gd + 1);
    l.out_ext[gd + 1] = l.grid_ext[gd];
  }
  std::sort(l.windows.begin(), l.windows.end(), [](const WindowDim& a, const WindowDim& b) { return a.dim < b.dim; });
  return l;
}

// Pixel coordinates of normalized grid coordinates along a dim of `size` rows, as the kernel unnormalizes them.
at::Tensor unnormalize(const at::Tensor& y, int64_t size, bool align_corners) {
  return align_corners ? (y + 1) / 2 * static_cast<double>(size - 1) : ((y + 1) * static_cast<double>(size) - 1) / 2;
}

// Reflection padding's coordinate (torch's reflect-then-clip, in pixels) and its derivative (+-1, 0 where clipped):
// mirrored about -0.5 and size - 0.5 (about 0 and size - 1 with align_corners).
std::pair<at::Tensor, at::Tensor> reflected(const at::Tensor& p, int64_t size, bool align_corners) {
  const double lo2 = align_corners ? 0.0 : -1.0, hi2 = align_corners ? 2.0 * (size - 1) : 2.0 * size - 1;
  if (lo2 == hi2) return {at::zeros_like(p), at::zeros_like(p)};
  const double min = lo2 / 2, span = (hi2 - lo2) / 2;
  auto shifted = p - min;
  auto sign = 1.0 - 2.0 * shifted.lt(0).to(p.scalar_type());  // in p's dtype (a where of two scalars is float32)
  auto in = shifted.abs();
  auto extra = at::fmod(in, span);
  auto flips = at::floor(in / span);
  auto odd = at::fmod(flips, 2).ne(0);
  auto r = at::where(odd, span - extra + min, extra + min);
  sign = at::where(odd, -sign, sign);
  auto clipped = r.clamp(0, static_cast<double>(size - 1));
  auto inside = r.gt(0).logical_and(r.lt(static_cast<double>(size - 1)));
  return {clipped, sign * inside.to(p.scalar_type())};
}

// One grid component's points in the input's pixels along its dim (double), as the kernel places them: unnormalized,
// and under reflection padding reflected (`sign`: the reflection's derivative; undefined otherwise). Computed once per
// call for the window ranges and the re-normalization.
struct Pixels {
  at::Tensor p, sign;
};

// Per grid component: its pixels where the call needs them (windowed dims; every dim under reflection padding),
// undefined elsewhere.
std::vector<Pixels> pixels_of(const GridLayout& l, const at::Tensor& input, const at::Tensor& grid_local,
                              int64_t padding_mode, bool align_corners) {
  std::vector<Pixels> px(l.spatial);
  for (int64_t c = 0; c < l.spatial; ++c) {
    const auto dim = 2 + (l.spatial - 1 - c);
    bool needed = padding_mode == kReflection;
    for (const auto& wd : l.windows) needed = needed || wd.dim == dim;
    if (!needed) continue;
    const auto size = input.size(dim);
    px[c].p = unnormalize(grid_local.select(-1, c).to(at::kDouble), size, align_corners);
    if (padding_mode == kReflection) std::tie(px[c].p, px[c].sign) = reflected(px[c].p, size, align_corners);
  }
  return px;
}

// The windows of this rank along the sharded input dims: their halo plan and each window's start and length.
using Windows = DataWindows;

Windows plan_windows(const GridLayout& l, const at::Tensor& input, const std::vector<Pixels>& px,
                     const c10::Device& device, int64_t interpolation_mode, int64_t padding_mode) {
  std::vector<DataWindowDim> dims;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  // Taps at floor(p) .. floor(p) + 1 (bicubic: - 1 .. + 2), a row of margin each side for the kernel's rounding; at
  // least two rows, so a window never has the degenerate one-row normalization.
  const int64_t below = interpolation_mode == kBicubic ? 2 : 1, above = interpolation_mode == kBicubic ? 3 : 2;
  for (const auto& wd : l.windows) {
    const auto size = input.size(wd.dim);
    auto p = px[wd.component].p;
    if (padding_mode == kBorder) p = p.clamp(0, static_cast<double>(size - 1));
    ranges.push_back(rows_read(p, size, below, above, 2));
    dims.push_back({wd.dim, wd.mesh_dim, l.in_ext.at(wd.dim)});
  }
  return plan_data_windows(dims, std::move(ranges), *l.mesh, device, "grid_sample over a split input (windows)");
}

// The windows of a call, reused by its backward (cached_windows: the same grid and input, not modified since).
std::shared_ptr<const Windows> windows_for(const GridLayout& l, const at::Tensor& input, const at::Tensor& grid,
                                           const std::vector<Pixels>& px, const c10::Device& device,
                                           int64_t interpolation_mode, int64_t padding_mode, bool align_corners) {
  return cached_windows<Windows>(grid, input, {interpolation_mode, padding_mode, align_corners ? 1 : 0}, [&] {
    return std::make_shared<const Windows>(plan_windows(l, input, px, device, interpolation_mode, padding_mode));
  });
}

// The grid with the components of windowed dims re-normalized to the windows (the grid itself when every window is
// the whole dim), and d(y')/d(y) of each component (undefined: 1). Reflection padding (bilinear, nearest) mirrors
// about the input's edges, which a window does not have: every component is reflected here, in global pixels, and
// the kernel then runs with border padding (the reflected points lie inside; its clamp is a no-op), the derivative
// carrying the reflection's sign (0 where clipped).
std::pair<at::Tensor, std::vector<at::Tensor>> window_grid(const GridLayout& l, const Windows& w,
                                                           const at::Tensor& input, const at::Tensor& grid_local,
                                                           const std::vector<Pixels>& px, int64_t padding_mode,
                                                           bool align_corners) {
  std::vector<at::Tensor> factor(l.spatial);
  at::Tensor g = grid_local;
  const bool reflect = padding_mode == kReflection;
  for (int64_t c = 0; c < l.spatial; ++c) {
    const auto dim = 2 + (l.spatial - 1 - c);
    const auto size = input.size(dim);
    int64_t lo = 0, hi = size;
    for (size_t k = 0; k < l.windows.size(); ++k)
      if (l.windows[k].dim == dim) std::tie(lo, hi) = w.range[k];
    const auto h = hi - lo;
    if (!reflect && lo == 0 && h == size) continue;
    if (g.is_same(grid_local)) g = grid_local.clone();  // the caller's grid is left as it is
    auto y = g.select(-1, c);
    const auto& sign = px[c].sign;
    auto p = px[c].p - static_cast<double>(lo);
    auto yw = align_corners ? (h > 1 ? p * (2.0 / static_cast<double>(h - 1)) - 1 : at::zeros_like(p))
                            : (p * 2 + 1) / static_cast<double>(h) - 1;
    y.copy_(yw);
    const double scale = align_corners ? (h > 1 ? static_cast<double>(size - 1) / static_cast<double>(h - 1) : 0.0)
                                       : static_cast<double>(size) / static_cast<double>(h);
    factor[c] = sign.defined() ? (sign * scale).to(grid_local.scalar_type())
                               : at::scalar_tensor(scale, grid_local.options());
  }
  return {g, factor};
}

// The local kernels of one op: the forward, and the backward as (grad_input, grad_grid).
using ForwardKernel = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& g, int64_t padding_mode)>;
using BackwardKernel = std::function<std::tuple<at::Tensor, at::Tensor>(const at::Tensor& go, const at::Tensor& x,
                                                                        const at::Tensor& g, int64_t padding_mode)>;

// The padding the local kernel runs with: reflection on windows has been applied to the grid (window_grid).
int64_t kernel_padding(const GridLayout& l, int64_t padding_mode) {
  return padding_mode == kReflection && !l.windows.empty() ? kBorder : padding_mode;
}

at::Tensor sampled(const std::string& op, const at::Tensor& input_in, const at::Tensor& grid_in,
                   int64_t interpolation_mode, int64_t padding_mode, bool align_corners, const ForwardKernel& kernel) {
  auto input = resolve_partial(input_in), grid = resolve_partial(grid_in);
  const auto l = grid_layout(op, input, grid, interpolation_mode, padding_mode);
  auto x = local_as(input, l.mesh, l.in_pl, l.in_ext);
  auto g = local_as(grid, l.mesh, l.grid_pl, l.grid_ext);
  if (!l.windows.empty()) {
    const auto px = pixels_of(l, input, g, padding_mode, align_corners);
    const auto w = windows_for(l, input_in, grid_in, px, g.device(), interpolation_mode, padding_mode, align_corners);
    x = w->plan.gather(x, *l.mesh);
    g = window_grid(l, *w, input, g, px, padding_mode, align_corners).first;
  }
  return wrap(kernel(x, g, kernel_padding(l, padding_mode)), l.mesh, l.out_pl, l.out_shape, l.out_ext);
}

std::tuple<at::Tensor, at::Tensor> sampled_backward(const std::string& op, const at::Tensor& grad_output,
                                                    const at::Tensor& input_in, const at::Tensor& grid_in,
                                                    int64_t interpolation_mode, int64_t padding_mode,
                                                    bool align_corners, bool want_grid_grad,
                                                    const BackwardKernel& kernel) {
  auto input = resolve_partial(input_in), grid = resolve_partial(grid_in);
  const auto l = grid_layout(op, input, grid, interpolation_mode, padding_mode);
  auto go = local_as(dispatch::as_shard(grad_output, l.mesh), l.mesh, l.out_pl, l.out_ext);
  auto x = local_as(input, l.mesh, l.in_pl, l.in_ext);
  auto g = local_as(grid, l.mesh, l.grid_pl, l.grid_ext);
  std::shared_ptr<const Windows> wp;
  std::vector<at::Tensor> factor(l.spatial);
  if (!l.windows.empty()) {
    const auto px = pixels_of(l, input, g, padding_mode, align_corners);
    wp = windows_for(l, input_in, grid_in, px, g.device(), interpolation_mode, padding_mode, align_corners);
    const auto& w = *wp;
    if (want_grid_grad) {
      x = w.plan.gather(x, *l.mesh);
    } else {
      // The input gradient reads only the grid: a window of the right shape, no rows moved.
      auto shape = x.sizes().vec();
      for (size_t k = 0; k < l.windows.size(); ++k) shape[l.windows[k].dim] = w.range[k].second - w.range[k].first;
      x = at::zeros(shape, x.options());
    }
    std::tie(g, factor) = window_grid(l, w, input, g, px, padding_mode, align_corners);
  }
  auto [gi, gg] = kernel(go, x, g, kernel_padding(l, padding_mode));
  if (gg.defined()) {
    for (int64_t c = 0; c < l.spatial; ++c)
      if (factor[c].defined()) gg.select(-1, c).mul_(factor[c]);
    auto pl = l.grid_pl;
    for (auto m : l.channel_dims) pl[m] = Placement::partial();
    gg = wrap(gg, l.mesh, pl, grid.sizes().vec(), l.grid_ext);
  }
  if (gi.defined()) {
    if (!l.windows.empty()) gi = wp->plan.scatter_add(gi, *l.mesh, /*consume=*/true);
    auto pl = l.in_pl;
    for (auto m : l.partial_dims) pl[m] = Placement::partial();
    gi = wrap(gi, l.mesh, pl, input.sizes().vec(), l.in_ext);
  }
  return {gi, gg};
}

template <bool ThreeD>
at::Tensor grid_sampler_rule(const at::Tensor& input, const at::Tensor& grid, int64_t interpolation_mode,
                             int64_t padding_mode, bool align_corners) {
  const char* op = ThreeD ? "aten::grid_sampler_3d" : "aten::grid_sampler_2d";
  return sampled(op, input, grid, interpolation_mode, padding_mode, align_corners,
                 [&](const at::Tensor& x, const at::Tensor& g, int64_t pad) {
                   return ThreeD ? at::grid_sampler_3d(x, g, interpolation_mode, pad, align_corners)
                                 : at::grid_sampler_2d(x, g, interpolation_mode, pad, align_corners);
                 });
}

template <bool ThreeD>
std::tuple<at::Tensor, at::Tensor> grid_sampler_backward_rule(const at::Tensor& grad_output, const at::Tensor& input,
                                                              const at::Tensor& grid, int64_t interpolation_mode,
                                                              int64_t padding_mode, bool align_corners,
                                                              std::array<bool, 2> output_mask) {
  const char* op = ThreeD ? "aten::grid_sampler_3d_backward" : "aten::grid_sampler_2d_backward";
  return sampled_backward(
      op, grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask[1],
      [&](const at::Tensor& go, const at::Tensor& x, const at::Tensor& g, int64_t pad) {
        return ThreeD ? at::grid_sampler_3d_backward(go, x, g, interpolation_mode, pad, align_corners, output_mask)
                      : at::grid_sampler_2d_backward(go, x, g, interpolation_mode, pad, align_corners, output_mask);
      });
}

// cuDNN's sampler (what F.grid_sample picks on CUDA for bilinear, zeros, align_corners=True, 4-D): the same
// layouts, its own kernels.
at::Tensor cudnn_grid_sampler_rule(const at::Tensor& input, const at::Tensor& grid) {
  return sampled("aten::cudnn_grid_sampler", input, grid, kBilinear, kZeros, true,
                 [](const at::Tensor& x, const at::Tensor& g, int64_t) { return at::cudnn_grid_sampler(x, g); });
}

std::tuple<at::Tensor, at::Tensor> cudnn_grid_sampler_backward_rule(const at::Tensor& input, const at::Tensor& grid,
                                                                    const at::Tensor& grad_output) {
  return sampled_backward("aten::cudnn_grid_sampler_backward", grad_output, input, grid, kBilinear, kZeros, true,
                          true, [](const at::Tensor& go, const at::Tensor& x, const at::Tensor& g, int64_t) {
                            return at::cudnn_grid_sampler_backward(x, g, go);
                          });
}

} // namespace

SHARDTENSOR_RULE_FAMILY(grid_sample) {
  dispatch::set_handler("aten::grid_sampler_2d", typed_handler(&grid_sampler_rule<false>));
  dispatch::set_handler("aten::grid_sampler_3d", typed_handler(&grid_sampler_rule<true>));
  dispatch::set_handler("aten::grid_sampler_2d_backward", typed_handler(&grid_sampler_backward_rule<false>));
  dispatch::set_handler("aten::grid_sampler_3d_backward", typed_handler(&grid_sampler_backward_rule<true>));
  dispatch::set_handler("aten::cudnn_grid_sampler", typed_handler(&cudnn_grid_sampler_rule));
  dispatch::set_handler("aten::cudnn_grid_sampler_backward", typed_handler(&cudnn_grid_sampler_backward_rule));
}

} // namespace shardtensor::ops
