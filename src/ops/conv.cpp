// Convolutions over sharded spatial dims by halo exchange. The output partition follows the global output grid:
// coordinate c owns the outputs whose window centres lie in its input range, so any stride, dilation, kernel size
// (odd or even) and padding works, including offsets that are not multiples of the stride. Each rank reads
// exactly the input rows its outputs read (its own plus halos from any number of ranks away; zeros outside the
// tensor), and in backward sends the halo gradients home. With one sharded spatial dim the convolution runs
// without building the window where the layout allows (comm/halo_borders.h): the single-device call on the rank's
// own rows, and the halo rows' terms added to the border rows (forward; in the backward the border rows' gradients
// travel and the neighbours add their terms). Several sharded spatial dims: the forward runs the same way on the own
// block (multi_direct_forward: border slabs from region windows, corners through the later dims' exchanges) and so
// does the backward (multi_direct_backward: the own block's backward while the halo travels, the halo's terms from
// non-overlapping border slabs, their halo gradients home through the steps in reverse). Transposed over one
// sharded dim: the main call writes the rank's own output rows (a crop of its window), border calls the rows its
// neighbours own (transposed_direct_forward), over several dims too (transposed_multi_forward: the neighbours'
// rows as pieces home through the steps in reverse). Otherwise (offsets off the stride grid, crops that do not fit)
// the rank gathers its window and runs the local convolution with zero padding on sharded dims. Batch-sharded inputs are local; weight and bias gradients are per-rank terms summed by
// one fused all-reduce. The plan (comm/halo_plan) is cached: the backward reuses the forward's, and a pending-sum
// input is completed once, in the forward.
#include "comm/functional.h"
#include "comm/halo_borders.h"
#include "comm/halo_plan.h"
#include "ops/arg_checks.h"
#include "ops/concrete_ints.h"
#include "ops/common.h"

#include <c10/util/irange.h>
#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

// Whether torch's CPU bfloat16 3-D convolution weight gradient (oneDNN) is wrong for this call: with an input
// extent below the kernel's span along a spatial dim (a (1, 32, 2, 4, 4) input, kernel 3, padding 1: off by 1e30, or
// NaN; the input gradient and the forward are right) -- a shape a two-row shard, and a border slab of the window-free
// backward, have far more often than a whole tensor.
bool short_block_weight_grad(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef dilation, bool transposed,
                             std::array<bool, 3> mask) {
  if (transposed || !mask[1] || x.dim() != 5 || w.dim() != 5) return false;
  for (int64_t d = 0; d < 3; ++d)
    if (x.size(2 + d) < (w.size(2 + d) - 1) * dilation[d] + 1) return true;
  return false;
}

// at::convolution_backward on local blocks. torch's CPU half / bfloat16 transposed-convolution backward (oneDNN)
// returns a wrong input gradient for some of the odd shapes a rank's block has where the whole tensor's does not
// (a (1, 3, 3, 4, 1) input against a (1, 3, 7, 6, 3) gradient, stride 2: off by ~30 where the values are ~10; one
// thread or several), and its 3-D convolution a wrong weight gradient for short blocks (short_block_weight_grad):
// there the gradients are computed in float and rounded once.
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_conv_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, at::OptionalIntArrayRef bias_sizes,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
    at::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> mask) {
  if (!x.device().is_cpu() || !at::isReducedFloatingType(x.scalar_type()) ||
      !(transposed || short_block_weight_grad(x, w, dilation, transposed, mask)))
    return at::convolution_backward(g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                                    mask);
  auto [gi, gw, gb] = at::convolution_backward(g.to(at::kFloat), x.to(at::kFloat), w.to(at::kFloat), bias_sizes,
                                               stride, padding, dilation, transposed, output_padding, groups, mask);
  return {gi.defined() ? gi.to(x.scalar_type()) : gi, gw.defined() ? gw.to(w.scalar_type()) : gw,
          gb.defined() ? gb.to(g.scalar_type()) : gb};
}

// One sharded spatial dim.
struct ConvDim {
  int64_t dim;  // tensor dim
  int64_t mesh_dim;
  std::vector<int64_t> in_extents, out_extents;
  comm::SlidingWindow window;
};

// Everything a convolution and its backward need besides the data: a pure function of the (resolved) input
// layout, the weight's shape and the convolution's arguments, cached and shared by forward and backward.
struct ConvPlan {
  std::vector<ConvDim> dims;  // sharded spatial dims, in mesh-dim order
  // Convolution: gathers the input window (its scatter_add sends the window's gradient home). Transposed: the
  // output windows each rank's kernel produces, summed into their owners (its gather brings the gradient back).
  comm::HaloPlan halo;
  // One sharded spatial dim, not transposed: how this rank runs without its window (direct), when it can, and the
  // backward's exchange of border gradient rows (border_terms: the same on every rank).
  comm::BorderSplit split;
  bool border_terms = false;
  comm::BorderTerms terms;
  // The terms through the neighbours' rows are convolutions over the other dims of one input row with one tap of
  // the kernel along the split dim (`row_*`: their arguments; a 1-D convolution keeps a length-1 dim), each adding
  // to one output row: small kernels on whole rows, not convolutions of thin windows (which take CPU kernels many
  // times slower per output than the main call's). Forward of a direct split: output row `out` (local) gains the
  // term of the halo row at window position `pos` through tap `tap` (the main call read that row as zero).
  struct HaloTap {
    int64_t out, tap, pos;
  };
  std::vector<HaloTap> halo_taps;
  std::vector<int64_t> row_stride, row_padding, row_dilation, row_output_padding;
  bool row_unsqueeze = false;
  // Several sharded spatial dims, not transposed: the split of each (`dims` order); `multi_direct` when every one is
  // direct and a main call gives this rank's outputs (multi_direct_forward).
  std::vector<comm::BorderSplit> splits;
  bool multi_direct = false;
  std::vector<int64_t> local_padding;
  std::vector<int64_t> local_output_padding;
  bool transposed = false;
  // Transposed over one sharded dim, when this rank's kernel on its own inputs produces every output row it owns
  // (its window: produced rows [a*s - p, ...), `crop_left` of them before its own, `crop_right` after): the main
  // call crops them with padding crop_left and output padding crop_left - crop_right (within torch's bound), writing
  // exactly its own rows, bias included; the cropped rows that neighbours own come from border calls on the first
  // `left_inputs` / the inputs from `right_first` on (transposed_direct_forward).
  bool transposed_direct = false;
  int64_t crop_left = 0, crop_right = 0, left_inputs = 0, right_first = 0;
  // The same over several sharded dims (transposed_multi_forward): per plan dim, when every dim's crop fits.
  struct Crop {
    int64_t left = 0, right = 0, left_inputs = 0, right_first = 0;
  };
  std::vector<Crop> crops;
  bool transposed_multi = false;
  // Channel dim sharded (mesh dim `channel_mesh_dim`): groups == 1 contracts over the local channels (a Partial
  // sum); grouped convolutions whose shards align with whole groups run their local groups.
  int64_t channel_mesh_dim = -1;
  bool channel_partial = false;          // groups == 1
  int64_t channel_offset = 0, channel_extent = 0;
  int64_t local_groups = 1;
  int64_t weight_row_offset = 0, weight_rows = 0; // grouped: the local groups' rows of the weight's dim 0
  int64_t out_channel_offset = 0, out_channels = 0; // grouped: the local groups' output channels (bias entries)
  std::vector<int64_t> out_shape;
  Placements out_placements;
  DimExtents out_ext;
  std::vector<int64_t> local_out_shape;     // this rank's output
  std::vector<int64_t> local_kernel_shape;  // what its kernel produces (transposed: the output windows)
  bool no_outputs = false;                  // nothing for the local kernel to compute
  std::vector<int64_t> param_grad_mesh_dims;  // mesh dims over which parameter-gradient terms are summed
};

ConvPlan make_conv_plan(const ShardSpec& spec, at::IntArrayRef wsize, at::IntArrayRef stride, at::IntArrayRef padding,
                        at::IntArrayRef dilation, bool transposed, at::IntArrayRef output_padding, int64_t groups,
                        c10::Device device) {
  ConvPlan plan;
  const auto& in_shape = spec.global_shape;
  const auto spatial = spec.ndim() - 2;
  auto expand = [&](at::IntArrayRef v, int64_t i) { return v.size() == 1 ? v[0] : v[i]; };
  auto window_of = [&](int64_t i) {
    return comm::SlidingWindow{wsize[2 + i], expand(stride, i), expand(padding, i), expand(dilation, i)};
  };
  plan.transposed = transposed;
  plan.local_padding.assign(spatial, 0);
  plan.local_output_padding.assign(spatial, 0);
  for (int64_t i = 0; i < spatial; ++i) {
    plan.local_padding[i] = expand(padding, i);
    plan.local_output_padding[i] = output_padding.empty() ? 0 : expand(output_padding, i);
  }
  plan.out_shape = {in_shape[0], transposed ? wsize[1] * groups : wsize[0]};
  for (int64_t i = 0; i < spatial; ++i) {
    const auto L = in_shape[2 + i];
    const auto w = window_of(i);
    plan.out_shape.push_back(transposed ? (L - 1) * w.stride - 2 * w.padding + w.span() + expand(output_padding, i)
                                        : (L + 2 * w.padding - w.span()) / w.stride + 1);
  }
  plan.out_placements = spec.placements;
  std::vector<comm::HaloDim> halo_dims;
  for (size_t mi = 0; mi < spec.placements.size(); ++mi) {
    const auto& pl = spec.placements[mi];
    if (!pl.is_shard()) continue;
    const auto m = static_cast<int64_t>(mi);
    plan.param_grad_mesh_dims.push_back(m);
    if (pl.dim == 0) {
      plan.out_ext[0] = spec.extents[m];
      continue;
    }
    if (pl.dim == 1) {
      plan.param_grad_mesh_dims.pop_back();
      // Transposed weights are [in, out / groups, k...]: a group's input channels are rows of dim 0 there.
      const auto cin_g = in_shape[1] / groups, cout_g = transposed ? wsize[1] : wsize[0] / groups;
      const auto coord = spec.mesh->coordinate(m);
      plan.channel_mesh_dim = m;
      plan.channel_offset = spec.offset_of(m, coord);
      plan.channel_extent = spec.extents[m][coord];
      if (groups == 1) {
        plan.channel_partial = true;
        plan.out_placements[m] = Placement::partial(ReduceOp::Sum);
      } else {
        std::vector<int64_t> out_channels;
        for (auto e : spec.extents[m]) {
          if (e % cin_g != 0) {
            dispatch::not_implemented("grouped convolution whose channel shards split a group; align the channel "
                                      "extents with the groups (multiples of in_channels/groups)");
          }
          out_channels.push_back(e / cin_g * cout_g);
        }
        for (int64_t c = 0; c < static_cast<int64_t>(spec.extents[m].size()); ++c)
          if (spec.offset_of(m, c) % cin_g != 0)
            dispatch::not_implemented("grouped convolution whose channel shards split a group");
        plan.local_groups = plan.channel_extent / cin_g;
        plan.out_channel_offset = plan.channel_offset / cin_g * cout_g;
        plan.out_channels = plan.local_groups * cout_g;
        plan.weight_row_offset = transposed ? plan.channel_offset : plan.out_channel_offset;
        plan.weight_rows = transposed ? plan.channel_extent : plan.out_channels;
        plan.out_ext[1] = out_channels;
      }
      continue;
    }
    const auto i = pl.dim - 2;
    const auto w = window_of(i);
    const auto L = in_shape[pl.dim];
    const auto& in_ext = spec.extents[m];
    if (transposed) {
      auto part = comm::transposed_window_partition(in_ext, L, w, plan.local_output_padding[i]);
      plan.dims.push_back({pl.dim, m, in_ext, part.out_extents, w});
      halo_dims.push_back({pl.dim, m, part.out_extents, std::move(part.want)});
    } else {
      auto part = comm::sliding_window_partition(in_ext, L, comm::conv_output_size(L, w), w, comm::PadMode::Zeros);
      plan.dims.push_back({pl.dim, m, in_ext, part.out_extents, w});
      halo_dims.push_back({pl.dim, m, in_ext, std::move(part.want)});
    }
    plan.out_ext[pl.dim] = plan.dims.back().out_extents;
    plan.local_padding[i] = 0;
    plan.local_output_padding[i] = 0;
  }
  plan.halo = comm::HaloPlan(halo_dims, spec.mesh->coordinates(), device);
  if (!transposed && plan.dims.size() == 1 && plan.halo.runs(0)) {
    const auto& d = plan.dims[0];
    const auto coord = spec.mesh->coordinate(d.mesh_dim);
    plan.split = comm::border_split(d.in_extents, d.out_extents, coord, in_shape[d.dim], d.window);
    plan.border_terms = true;
    plan.terms = comm::border_terms(d.in_extents, d.out_extents, coord, in_shape[d.dim], d.window);
    for (int64_t i = 0; i < spatial; ++i) {
      if (i == d.dim - 2) continue;
      plan.row_stride.push_back(expand(stride, i));
      plan.row_padding.push_back(plan.local_padding[i]);
      plan.row_dilation.push_back(expand(dilation, i));
      plan.row_output_padding.push_back(0);
    }
    plan.row_unsqueeze = plan.row_stride.empty();
    if (plan.row_unsqueeze) plan.row_stride = plan.row_dilation = {1}, plan.row_padding = plan.row_output_padding = {0};
    if (plan.split.direct) {
      const auto a = spec.offset_of(d.mesh_dim, coord), e = d.in_extents[coord], L = in_shape[d.dim];
      const auto ws = a - plan.split.padding;  // global row of window position 0
      const auto& w = d.window;
      for (const auto& b : plan.split.borders)
        for (auto j = b.out_begin; j < b.out_begin + b.out_len; ++j)
          for (int64_t t = 0; t < w.kernel; ++t) {
            const auto pos = j * w.stride + t * w.dilation, q = ws + pos;
            if (q >= 0 && q < L && (q < a || q >= a + e)) plan.halo_taps.push_back({j, t, pos});
          }
    }
  }
  if (transposed && plan.dims.size() == 1 && plan.halo.runs(0)) {
    const auto& d = plan.dims[0];
    const auto coord = spec.mesh->coordinate(d.mesh_dim);
    const auto e = d.in_extents[coord];
    const auto [first_pos, first_row, count] = plan.halo.own_run(0);
    const auto W = plan.halo.window_rows(0);
    const auto& w = d.window;
    plan.crop_left = first_pos;
    plan.crop_right = W - first_pos - count;
    const auto extra = plan.crop_left - plan.crop_right;  // the main call's output padding
    plan.transposed_direct = e > 0 && count > 0 && count == d.out_extents[coord] && first_row == 0 && extra >= 0 &&
                             extra < std::max(w.stride, w.dilation) && w.span() >= w.stride;
    if (plan.transposed_direct) {
      // Produced row u (window position) of input j: u = j*s + tap*d, so rows before crop_left come from inputs
      // j <= (crop_left - 1) / s, rows from W - crop_right on from inputs j with j*s + span - 1 >= W - crop_right.
      if (plan.crop_left > 0) plan.left_inputs = std::min(e, (plan.crop_left - 1) / w.stride + 1);
      if (plan.crop_right > 0)
        plan.right_first = std::max<int64_t>(0, (W - plan.crop_right - w.span() + 1 + w.stride - 1) / w.stride);
    }
  }
  if (transposed && plan.dims.size() >= 2 && plan.halo.all_runs()) {
    plan.transposed_multi = true;
    for (size_t k = 0; k < plan.dims.size(); ++k) {
      const auto& d = plan.dims[k];
      const auto coord = spec.mesh->coordinate(d.mesh_dim);
      const auto e = d.in_extents[coord];
      const auto [first_pos, first_row, count] = plan.halo.own_run(k);
      const auto W = plan.halo.window_rows(k);
      const auto& w = d.window;
      ConvPlan::Crop c;
      c.left = first_pos;
      c.right = W - first_pos - count;
      const auto extra = c.left - c.right;
      plan.transposed_multi = plan.transposed_multi && e > 0 && count > 0 && count == d.out_extents[coord] &&
                              first_row == 0 && extra >= 0 && extra < std::max(w.stride, w.dilation) &&
                              w.span() >= w.stride;
      if (c.left > 0) c.left_inputs = std::min(e, (c.left - 1) / w.stride + 1);
      if (c.right > 0) c.right_first = std::max<int64_t>(0, (W - c.right - w.span() + 1 + w.stride - 1) / w.stride);
      plan.crops.push_back(c);
    }
  }
  if (!transposed && plan.dims.size() >= 2) {
    plan.multi_direct = true;
    for (size_t k = 0; k < plan.dims.size(); ++k) {
      const auto& d = plan.dims[k];
      plan.splits.push_back(comm::border_split(d.in_extents, d.out_extents, spec.mesh->coordinate(d.mesh_dim),
                                               in_shape[d.dim], d.window));
      const auto& sp = plan.splits.back();
      plan.multi_direct = plan.multi_direct && plan.halo.runs(k) && sp.direct && sp.main;
    }
  }
  plan.local_out_shape = plan.out_shape;
  for (size_t m = 0; m < plan.out_placements.size(); ++m)
    if (plan.out_placements[m].is_shard()) {
      const auto d = plan.out_placements[m].dim;
      plan.local_out_shape[d] = plan.out_ext.at(d)[spec.mesh->coordinate(static_cast<int64_t>(m))];
    }
  plan.local_kernel_shape = plan.local_out_shape;
  if (transposed)
    for (size_t k = 0; k < plan.dims.size(); ++k) plan.local_kernel_shape[plan.dims[k].dim] = plan.halo.window_rows(k);
  // A rank without channels of a groups == 1 contraction contributes nothing to the pending sum.
  plan.no_outputs = plan.channel_partial && plan.channel_extent == 0;
  for (auto s : plan.local_kernel_shape) plan.no_outputs = plan.no_outputs || s == 0;
  return plan;
}

// The plan of a convolution of an input laid out as `spec` (Partial placements already resolved), from the cache.
std::shared_ptr<const ConvPlan> conv_plan(const ShardSpec& spec, at::IntArrayRef wsize, at::IntArrayRef stride,
                                          at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                                          at::IntArrayRef output_padding, int64_t groups, c10::Device device) {
  comm::PlanKey key;
  key.add_spec(spec).add_ints(wsize).add_ints(stride).add_ints(padding).add_ints(dilation).add(transposed);
  key.add_ints(output_padding).add(groups).add_device(device);
  return comm::cached_plan<ConvPlan>(key, [&] {
    return make_conv_plan(spec, wsize, stride, padding, dilation, transposed, output_padding, groups, device);
  });
}

at::Tensor local_of_param(const at::Tensor& t, const MeshPtr& mesh) {
  if (!t.defined()) return t;
  auto* i = shard_impl(t);
  if (!i) return t;
  auto r = resolve_partial(t);
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(r)->spec()->all_replicate(), "ShardTensor convolution: sharded weights are "
                              "not supported; keep parameters replicated (plain)");
  return shard_impl(r)->local();
}

// The weight and bias this rank's channels use.
at::Tensor local_weight(const at::Tensor& w, const ConvPlan& plan) {
  if (plan.channel_mesh_dim < 0) return w;
  if (plan.channel_partial) return w.narrow(plan.transposed ? 0 : 1, plan.channel_offset, plan.channel_extent);
  return w.narrow(0, plan.weight_row_offset, plan.weight_rows);
}

std::optional<at::Tensor> local_bias(const std::optional<at::Tensor>& b, const ConvPlan& plan, const Mesh& mesh) {
  if (!b || plan.channel_mesh_dim < 0) return b;
  if (plan.channel_partial) {
    // The pending sum must count the bias once: only the first coordinate adds it.
    return mesh.coordinate(plan.channel_mesh_dim) == 0 ? b : std::optional<at::Tensor>(at::zeros_like(*b));
  }
  return b->narrow(0, plan.out_channel_offset, plan.out_channels);
}

// The halo exchange overlaps the main convolution (forward) and the main gradients (backward);
// SHARDTENSOR_HALO_OVERLAP=0 completes each exchange before the compute (to measure what the overlap gains).
bool overlap_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SHARDTENSOR_HALO_OVERLAP");
    return !(v && std::string(v) == "0");
  }();
  return enabled;
}

// The local padding with `pad` on the split dim.
std::vector<int64_t> padding_on_split_dim(const ConvPlan& plan, int64_t pad) {
  auto p = plan.local_padding;
  p[plan.dims[0].dim - 2] = pad;
  return p;
}

bool runs_direct(const ConvPlan& plan) {
  return plan.split.direct && !plan.no_outputs;
}

// Row `row` of `t` along the split dim, as an input (or output gradient) of the convolution over the other dims.
at::Tensor row_of(const ConvPlan& plan, const at::Tensor& t, int64_t row) {
  auto r = t.select(plan.dims[0].dim, row);
  return plan.row_unsqueeze ? r.unsqueeze(-1) : r;
}

// A result of the convolution over the other dims, shaped like one row of the full convolution's tensors.
at::Tensor as_row(const ConvPlan& plan, const at::Tensor& t) {
  return plan.row_unsqueeze ? t.squeeze(-1) : t;
}

// The forward of a direct split (comm/halo_borders.h): the single-device call on the rank's rows while the halo
// rows travel, then each border output row gains the terms of the halo rows it reads.
at::Tensor direct_forward(const ConvPlan& plan, const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& b, at::IntArrayRef stride, at::IntArrayRef dilation,
                          int64_t groups, const Mesh& mesh) {
  const auto dim = plan.dims[0].dim;
  const bool overlap = overlap_enabled();
  auto rows = plan.halo.post(0, x, mesh);
  std::vector<at::Tensor> received;
  if (!overlap) received = rows.wait();
  auto out = at::convolution(x, w, b, stride, padding_on_split_dim(plan, plan.split.padding), dilation, false,
                             plan.local_output_padding, groups);
  if (overlap) received = rows.wait();
  for (const auto& h : plan.halo_taps) {
    auto halo_row = plan.halo.window_slice(0, x, received, h.pos, 1);
    auto term = at::convolution(row_of(plan, halo_row, 0), row_of(plan, w, h.tap), std::nullopt, plan.row_stride,
                                plan.row_padding, plan.row_dilation, false, plan.row_output_padding, groups);
    out.select(dim, h.out).add_(as_row(plan, term));
  }
  return out;
}

// The transposed forward over one sharded dim without the output window (ConvPlan::transposed_direct): the rows
// this rank's inputs add to its neighbours' outputs are computed first, from the few inputs that reach them, and
// sent home (the messages of the window path's scatter_add); the main call writes this rank's own output rows,
// bias included, while they travel; the neighbours' terms are then added to its border rows.
at::Tensor transposed_direct_forward(const ConvPlan& plan, const at::Tensor& x, const at::Tensor& w,
                                     const std::optional<at::Tensor>& b, at::IntArrayRef stride,
                                     at::IntArrayRef dilation, int64_t groups, const Mesh& mesh) {
  const auto dim = plan.dims[0].dim;
  const auto e = x.size(dim), W = plan.halo.window_rows(0);
  const bool exchange = plan.halo.exchanges(0);
  comm::PeerExchange back;
  if (exchange) {
    auto border = [&](int64_t first, int64_t inputs) {
      return at::convolution(x.narrow(dim, first, inputs), w, std::nullopt, stride, plan.local_padding, dilation, true,
                             plan.local_output_padding, groups);
    };
    std::vector<std::pair<int64_t, at::Tensor>> slices;
    if (plan.crop_left > 0) slices.emplace_back(0, border(0, plan.left_inputs).narrow(dim, 0, plan.crop_left));
    if (plan.crop_right > 0) {
      auto t = border(plan.right_first, e - plan.right_first);
      slices.emplace_back(W - plan.crop_right, t.narrow(dim, t.size(dim) - plan.crop_right, plan.crop_right));
    }
    back = plan.halo.post_returns(0, slices, plan.local_out_shape, x, mesh);
  }
  auto padding = plan.local_padding;
  auto output_padding = plan.local_output_padding;
  padding[dim - 2] = plan.crop_left;
  output_padding[dim - 2] = plan.crop_left - plan.crop_right;
  auto out = at::convolution(x, w, b, stride, padding, dilation, true, output_padding, groups);
  TORCH_INTERNAL_ASSERT(out.size(dim) == plan.local_out_shape[dim], "transposed convolution main call: ",
                        out.size(dim), " rows for ", plan.local_out_shape[dim]);
  if (exchange) {
    auto pieces = back.wait();
    plan.halo.add_returns(0, out, pieces);
  }
  return out;
}

// Its backward: the main call's backward on this rank's own output rows while the gradient's halo travels (the
// window path's gather messages), then the terms through the cropped rows its neighbours own, from the border
// calls' inputs (their gradient rows zero-extended over the rows the main call covers). The bias gradient is the
// caller's (the sum over the own output rows).
std::pair<at::Tensor, at::Tensor> transposed_direct_backward(const ConvPlan& plan, const at::Tensor& g,
                                                             const at::Tensor& x, const at::Tensor& w,
                                                             at::IntArrayRef stride, at::IntArrayRef dilation,
                                                             int64_t groups, bool want_input, bool want_weight,
                                                             const Mesh& mesh) {
  const auto dim = plan.dims[0].dim;
  const auto e = x.size(dim), W = plan.halo.window_rows(0);
  const bool exchange = plan.halo.exchanges(0);
  comm::PeerExchange rows;
  if (exchange) rows = plan.halo.post(0, g, mesh);
  auto padding = plan.local_padding;
  auto output_padding = plan.local_output_padding;
  padding[dim - 2] = plan.crop_left;
  output_padding[dim - 2] = plan.crop_left - plan.crop_right;
  at::Tensor gi, gw;
  if (want_input || want_weight)
    std::tie(gi, gw, std::ignore) = local_conv_backward(g, x, w, std::nullopt, stride, padding, dilation, true,
                                                        output_padding, groups, {want_input, want_weight, false});
  if (!exchange) return {gi, gw};
  auto received = rows.wait();
  if (!want_input && !want_weight) return {gi, gw};
  // The gradient of a border call's rows: window positions [begin, begin + len) (halo rows and padding), zero over
  // the `before` / `after` rows of the call that the main call covers.
  auto border = [&](int64_t first, int64_t inputs, int64_t begin, int64_t len, int64_t before, int64_t after) {
    auto gt = plan.halo.window_slice(0, g, received, begin, len);
    std::vector<int64_t> pad(2 * (g.dim() - dim), 0);
    pad[2 * (g.dim() - 1 - dim)] = before;
    pad[2 * (g.dim() - 1 - dim) + 1] = after;
    gt = at::constant_pad_nd(gt, pad, 0);
    auto [bi, bw, unused2] = local_conv_backward(gt, x.narrow(dim, first, inputs), w, std::nullopt, stride,
                                                 plan.local_padding, dilation, true, plan.local_output_padding,
                                                 groups, {want_input, want_weight, false});
    if (want_input) gi.narrow(dim, first, inputs).add_(bi);
    if (want_weight) gw.add_(bw);
  };
  const auto& win = plan.dims[0].window;
  if (plan.crop_left > 0) {
    const auto produced = (plan.left_inputs - 1) * win.stride + win.span();
    border(0, plan.left_inputs, 0, plan.crop_left, 0, produced - plan.crop_left);
  }
  if (plan.crop_right > 0) {
    const auto produced = W - plan.right_first * win.stride;
    border(plan.right_first, e - plan.right_first, W - plan.crop_right, plan.crop_right, produced - plan.crop_right, 0);
  }
  return {gi, gw};
}

// Transposed over several sharded dims without the output window (ConvPlan::transposed_multi). The rows a rank's
// kernel produces split into its own output block (the main call, cropped along every dim) and, per dim k, region
// R_k: the rows cropped along k, own along the earlier dims, any along the later ones — disjoint, together every row
// its neighbours own. R_k's side along k comes from the few inputs that reach it, cropped along the earlier dims;
// its rows are gradient pieces (HaloPlan::add_region) that go home through the steps in reverse (scatter_add's
// messages), the last step while the main call runs. One side's call: its inputs and arguments.
struct TransposedRegion {
  size_t k = 0;
  bool left = true;
  int64_t first_input = 0, inputs = 0;   // along dim k
  std::vector<int64_t> padding, output_padding;
  std::vector<std::pair<int64_t, int64_t>> range;  // window positions per plan dim
  int64_t produced = 0;                            // rows the call produces along dim k
};

std::vector<TransposedRegion> transposed_regions(const ConvPlan& plan) {
  std::vector<TransposedRegion> out;
  const auto n = plan.dims.size();
  for (size_t k = 0; k < n; ++k) {
    const auto& c = plan.crops[k];
    const auto& win = plan.dims[k].window;
    const auto W = plan.halo.window_rows(k);
    for (bool left : {true, false}) {
      if ((left ? c.left : c.right) == 0) continue;
      TransposedRegion r;
      r.k = k;
      r.left = left;
      const auto e = (W - win.span()) / win.stride + 1;  // this rank's input rows along k: W = (e - 1) s + span
      r.first_input = left ? 0 : c.right_first;
      r.inputs = left ? c.left_inputs : e - c.right_first;
      r.produced = (r.inputs - 1) * win.stride + win.span();
      r.padding = plan.local_padding;
      r.output_padding = plan.local_output_padding;
      for (size_t j = 0; j < n; ++j) {
        const auto [pj, rj, cj] = plan.halo.own_run(j);
        if (j < k) {
          r.padding[plan.dims[j].dim - 2] = plan.crops[j].left;
          r.output_padding[plan.dims[j].dim - 2] = plan.crops[j].left - plan.crops[j].right;
          r.range.emplace_back(pj, cj);
        } else if (j == k) {
          r.range.emplace_back(left ? 0 : W - c.right, left ? c.left : c.right);
        } else {
          r.range.emplace_back(0, plan.halo.window_rows(j));
        }
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> main_crop(const ConvPlan& plan) {
  auto padding = plan.local_padding;
  auto output_padding = plan.local_output_padding;
  for (size_t j = 0; j < plan.dims.size(); ++j) {
    padding[plan.dims[j].dim - 2] = plan.crops[j].left;
    output_padding[plan.dims[j].dim - 2] = plan.crops[j].left - plan.crops[j].right;
  }
  return {padding, output_padding};
}

at::Tensor transposed_multi_forward(const ConvPlan& plan, const at::Tensor& x, const at::Tensor& w,
                                    const std::optional<at::Tensor>& b, at::IntArrayRef stride,
                                    at::IntArrayRef dilation, int64_t groups, const Mesh& mesh) {
  const auto n = plan.dims.size();
  auto pieces = plan.halo.zero_pieces(plan.local_out_shape, x.options());
  at::Tensor none;
  for (const auto& r : transposed_regions(plan)) {
    const auto dim = plan.dims[r.k].dim;
    auto y = at::convolution(x.narrow(dim, r.first_input, r.inputs), w, std::nullopt, stride, r.padding, dilation, true,
                             r.output_padding, groups);
    const auto len = r.range[r.k].second;
    y = r.left ? y.narrow(dim, 0, len) : y.narrow(dim, y.size(dim) - len, len);
    plan.halo.add_region(none, pieces, n, r.range, y, /*skip_own=*/true);
  }
  // The last step's pieces travel while the main call runs; each step's returns are added before the next one.
  auto returning = plan.halo.post_pieces(n - 1, plan.local_out_shape, x, pieces, mesh);
  const auto [padding, output_padding] = main_crop(plan);
  auto out = at::convolution(x, w, b, stride, padding, dilation, true, output_padding, groups);
  TORCH_INTERNAL_ASSERT(out.sizes() == at::IntArrayRef(plan.local_out_shape), "transposed convolution main call ",
                        out.sizes(), " for ", at::IntArrayRef(plan.local_out_shape));
  for (size_t k = n; k-- > 0;) {
    if (k + 1 < n) returning = plan.halo.post_pieces(k, out, pieces, mesh);
    if (plan.halo.exchanges(k)) plan.halo.add_piece_returns(k, out, pieces, returning.wait());
  }
  return out;
}

// A region of the window over every plan dim (HaloPlan::region: window positions along the dims before `stop`,
// local rows after; `zero_own`: the halo's terms alone).
struct Region {
  std::vector<std::pair<int64_t, int64_t>> range;  // per plan dim
  size_t stop = 0;
};

at::Tensor build_region(const ConvPlan& plan, const at::Tensor& x, const std::vector<std::vector<at::Tensor>>& received,
                        const Region& region, bool zero_own = false) {
  return plan.halo.region(x, received, region.range, region.stop, zero_own);
}

// Its backward: the gradient's halo (the window path's gather messages) travels while the main call's backward runs
// on the own output block; each region's call then takes its gradient rows, assembled from the received pieces and
// zero-extended along k over the rows its call produces that the main call covers.
std::pair<at::Tensor, at::Tensor> transposed_multi_backward(const ConvPlan& plan, const at::Tensor& g,
                                                           const at::Tensor& x, const at::Tensor& w,
                                                           at::IntArrayRef stride, at::IntArrayRef dilation,
                                                           int64_t groups, bool want_input, bool want_weight,
                                                           const Mesh& mesh) {
  const auto n = plan.dims.size();
  const auto [padding, output_padding] = main_crop(plan);
  at::Tensor gi, gw;
  auto received = plan.halo.exchange_all(g, mesh, [&] {
    if (want_input || want_weight)
      std::tie(gi, gw, std::ignore) = local_conv_backward(g, x, w, std::nullopt, stride, padding, dilation, true,
                                                          output_padding, groups, {want_input, want_weight, false});
  });
  if (!want_input && !want_weight) return {gi, gw};
  for (const auto& r : transposed_regions(plan)) {
    const auto dim = plan.dims[r.k].dim;
    Region region;
    region.stop = n;
    region.range = r.range;
    auto gr = build_region(plan, g, received, region);
    const auto len = r.range[r.k].second;
    std::vector<int64_t> pad(2 * (g.dim() - dim), 0);
    pad[2 * (g.dim() - 1 - dim) + (r.left ? 1 : 0)] = r.produced - len;
    gr = at::constant_pad_nd(gr, pad, 0);
    auto [bi, bw, unused] = local_conv_backward(gr, x.narrow(dim, r.first_input, r.inputs), w, std::nullopt, stride,
                                                r.padding, dilation, true, r.output_padding, groups,
                                                {want_input, want_weight, false});
    if (want_input) gi.narrow(dim, r.first_input, r.inputs).add_(bi);
    if (want_weight) gw.add_(bw);
  }
  return {gi, gw};
}

// The sliding window of each plan dim, in the halo's step order (the multi-dim border slabs' geometry).
std::vector<comm::SlidingWindow> dim_windows(const ConvPlan& plan) {
  std::vector<comm::SlidingWindow> windows;
  for (size_t k = 0; k < plan.dims.size(); ++k) {
    TORCH_INTERNAL_ASSERT(plan.dims[k].dim == plan.halo.dim(k).dim, "convolution: plan dims out of the halo's order");
    windows.push_back(plan.dims[k].window);
  }
  return windows;
}

// The forward over several sharded dims without the window (comm::multi_border_forward): the single-device call on
// the rank's own block with each dim's symmetric split padding while the halo travels, the border slabs written
// over its rows.
at::Tensor multi_direct_forward(const ConvPlan& plan, const at::Tensor& x, const at::Tensor& w,
                                const std::optional<at::Tensor>& b, at::IntArrayRef stride, at::IntArrayRef dilation,
                                int64_t groups, const Mesh& mesh) {
  auto kernel = [&](const at::Tensor& in, const std::vector<int64_t>& pad, const std::vector<int64_t>&) {
    auto padding = plan.local_padding;
    for (size_t k = 0; k < plan.dims.size(); ++k) padding[plan.dims[k].dim - 2] = pad[k];
    return std::vector<at::Tensor>{
        at::convolution(in, w, b, stride, padding, dilation, false, plan.local_output_padding, groups)};
  };
  return comm::multi_border_forward(plan.halo, plan.splits, dim_windows(plan), x, mesh, kernel, overlap_enabled())[0];
}

// The backward over several sharded dims without the window, the adjoint of multi_direct_forward. The
// single-device backward on the rank's own block with each dim's split padding (the halo read as zeros) runs while
// the input's halo travels: it gives the exact bias gradient, every term of this rank's outputs on its own rows
// (input gradient) and the terms of its outputs with its own rows (weight gradient). What it leaves out reads the
// halo: terms of outputs whose windows leave the own block, each taken once, from border slabs that do not
// overlap (dim k's borders over the outputs interior along dims before k and all along the later ones). A slab's
// backward on its region window with the own rows zeroed gives its weight-gradient terms through the halo, and its
// input gradient over the region, whose halo positions are gradient pieces that go home through the exchange's
// steps in reverse (HaloPlan::scatter_pieces: the messages of the window path's scatter_add). Nothing block-sized
// beyond the single-device backward's own tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> multi_direct_backward(const ConvPlan& plan, const at::Tensor& g,
                                                                     const at::Tensor& x, const at::Tensor& w,
                                                                     at::OptionalIntArrayRef bias_sizes,
                                                                     at::IntArrayRef stride, at::IntArrayRef dilation,
                                                                     int64_t groups, std::array<bool, 3> mask,
                                                                     const Mesh& mesh) {
  const auto n = plan.dims.size();
  auto padding = plan.local_padding;
  for (size_t k = 0; k < n; ++k) padding[plan.dims[k].dim - 2] = plan.splits[k].padding;
  at::Tensor gi, gw, gb;
  auto main_call = [&] {
    std::tie(gi, gw, gb) = local_conv_backward(g, x, w, bias_sizes, stride, padding, dilation, false,
                                               plan.local_output_padding, groups, mask);
  };
  // The input gradient reads no input values: without a weight gradient the halo does not travel (as on the window
  // path, whose window is then only a shape).
  std::vector<std::vector<at::Tensor>> received;
  if (mask[1]) received = plan.halo.exchange_all(x, mesh, main_call);
  else main_call();
  std::vector<std::vector<at::Tensor>> halo_grad;
  if (mask[0]) halo_grad = plan.halo.zero_pieces(x);
  const auto windows = dim_windows(plan);
  std::vector<int64_t> out_len;
  for (size_t k = 0; k < n; ++k) out_len.push_back(g.size(plan.dims[k].dim));
  // Dim k's slabs (comm::border_slab, as in the forward): their input gradients reach the halo of steps <= k only.
  auto slabs_of = [&](size_t k) {
    for (const auto& border : plan.splits[k].borders) {
      if (border.out_len == 0) continue;
      const auto geometry = comm::border_slab(plan.splits, windows, k, border, out_len);
      if (geometry.empty) continue;
      auto slab = g;
      for (size_t d = 0; d < n; ++d) {
        const auto [first, count] = geometry.outputs[d];
        slab = slab.narrow(plan.dims[d].dim, first, count);
      }
      at::Tensor halo_only;
      if (mask[1]) {
        halo_only = plan.halo.region(x, received, geometry.window, n, /*zero_own=*/true);
      } else {
        auto shape = x.sizes().vec();
        for (size_t d = 0; d < n; ++d) shape[plan.dims[d].dim] = geometry.window[d].second;
        halo_only = at::empty(shape, x.options());
      }
      auto [gri, grw, unused] =
          local_conv_backward(slab, halo_only, w, std::nullopt, stride, plan.local_padding, dilation, false,
                              plan.local_output_padding, groups, {mask[0], mask[1], false});
      if (mask[1]) gw.add_(grw);
      if (mask[0]) plan.halo.add_region(gi, halo_grad, n, geometry.window, gri, /*skip_own=*/true);
    }
  };
  // The last dim's slabs first: then the last step's pieces are complete and go home (scatter_add's messages, in its
  // order) while the earlier dims' slabs are computed; each step's returns are added before the next step is posted.
  comm::PeerExchange returning;
  int64_t in_flight = -1;  // the step whose pieces travel
  auto finish = [&] {
    if (in_flight < 0) return;
    plan.halo.add_piece_returns(static_cast<size_t>(in_flight), gi, halo_grad, returning.wait());
    in_flight = -1;
  };
  for (size_t k = n; k-- > 0;) {
    slabs_of(k);
    if (!mask[0]) continue;
    finish();
    if (!plan.halo.exchanges(k)) continue;
    returning = plan.halo.post_pieces(k, gi, halo_grad, mesh);
    in_flight = static_cast<int64_t>(k);
    if (!overlap_enabled()) finish();
  }
  finish();
  return {gi, gw, gb};
}

bool requires_grad(const std::optional<at::Tensor>& t) {
  return t && t->defined() && t->requires_grad();
}

// A groups == 1 convolution of an input split along its channels contracts the split into a pending sum of the
// whole output on every rank (an all-reduce or reduce-scatter of the output to complete it). Such inputs arise
// without anyone asking for channel parallelism: a spectral layer's output keeps the FFT's pencil layout (its split
// moved from space to the channels), and a sum takes its first operand's layout (xDeepONet's `spectral(x) + conv(x)`
// branch, whose next 1x1 convolution and U-Net then ran on pending sums and whole). When the input per rank is no
// larger than the output (in channels: C_in / P <= C_out), the split moves to the largest unsplit spatial dim instead
// (one all-to-all of the input, `split_moved_off`), and the convolution runs with a halo and a divided output.
// Decided from the spec and the weight's shape, so the forward and its backward (which recomputes it from the saved
// input) move alike on every rank.
at::Tensor channel_split_to_space(const at::Tensor& xs, at::IntArrayRef wsize, bool transposed, int64_t groups) {
  const auto& spec = *shard_impl(xs)->spec();
  const auto m = spec.mesh_dim_of(1);
  if (groups != 1 || m < 0 || xs.dim() < 3) return xs;
  const auto c_in = xs.size(1), c_out = transposed ? wsize[1] : wsize[0];
  if (c_in > c_out * spec.mesh->size(m)) return xs;  // a narrow output: its pending sum is the cheaper message
  auto moved = split_moved_off(xs, 1, [](int64_t d) { return d >= 2; });
  return moved ? *moved : xs;
}

// convolution(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, SymInt[] dilation,
//             bool transposed, SymInt[] output_padding, SymInt groups)
at::Tensor convolution_rule(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, c10::SymInt groups_arg) {
  auto mesh = dispatch::common_mesh("aten::convolution", {input, weight, bias.value_or(at::Tensor())});
  const auto groups = concrete_int(groups_arg);
  check_convolution_args(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups);
  // A plain input is Replicate (as_shard below): a forward-mode formula convolves the input's absent tangent (a plain
  // zero tensor) with a promoted weight, jvp over the parameters inside a torch.func transform.
  // A pending-sum input is completed once; when a backward may follow, the complete value stays with the input,
  // which autograd saves: the weight gradient reads it without a second all-reduce.
  const bool keep = at::GradMode::is_enabled() && (input.requires_grad() || weight.requires_grad() || requires_grad(bias));
  auto xs = channel_split_to_space(resolve_partial_once(dispatch::as_shard(input, mesh), keep), weight.sizes(),
                                   transposed, groups);
  const auto& spec = *shard_impl(xs)->spec();
  const auto& x = shard_impl(xs)->local();
  auto planp = conv_plan(spec, weight.sizes(), stride, padding, dilation, transposed, output_padding, groups, x.device());
  const auto& plan = *planp;
  auto w = local_weight(local_of_param(weight, mesh), plan);
  auto b = local_bias(bias && bias->defined() ? std::optional<at::Tensor>(local_of_param(*bias, mesh)) : std::nullopt,
                      plan, *mesh);
  const auto local_groups = plan.channel_mesh_dim >= 0 && !plan.channel_partial ? plan.local_groups : groups;
  // Every rank takes part in the halo exchange; a rank without outputs (zero extent) skips the local kernel.
  at::Tensor out;
  if (plan.transposed_direct && !plan.no_outputs) {
    out = transposed_direct_forward(plan, x, w, b, stride, dilation, groups, *mesh);
  } else if (plan.transposed_multi && !plan.no_outputs) {
    out = transposed_multi_forward(plan, x, w, b, stride, dilation, groups, *mesh);
  } else if (plan.transposed && !plan.dims.empty()) {
    // Each rank's kernel runs on its own inputs; the output windows are summed into their owners. Bias is added
    // after the scatter (once per output position).
    auto y = plan.no_outputs ? at::zeros(plan.local_kernel_shape, x.options())
                             : at::convolution(x, w, std::nullopt, stride, plan.local_padding, dilation, true,
                                               plan.local_output_padding, groups);
    // When every dim's window is exactly this rank's rows (kernel = stride, no padding: a U-Net's k2 s2), the
    // windows are the result (scatter_add hands back `y` itself, its exchanges empty); otherwise a fresh sum.
    bool whole = !plan.no_outputs;
    for (size_t k = 0; k < plan.halo.size() && whole; ++k) {
      const auto [pos, row, count] = plan.halo.own_run(k);
      whole = pos == 0 && row == 0 && count == plan.halo.window_rows(k) && !plan.halo.exchanges(k);
    }
    out = plan.halo.scatter_add(y, *mesh, /*consume=*/whole);
    if (b) out.add_(channel_view(*b, out.dim()));  // our own tensor either way
  } else if (plan.multi_direct && !plan.no_outputs) {
    out = multi_direct_forward(plan, x, w, b, stride, dilation, local_groups, *mesh);
  } else if (runs_direct(plan)) {
    out = direct_forward(plan, x, w, b, stride, dilation, local_groups, *mesh);
  } else {
    auto window = plan.halo.gather(x, *mesh);
    out = plan.no_outputs ? at::zeros(plan.local_out_shape, window.options())
                          : at::convolution(window, w, b, stride, plan.local_padding, dilation, transposed,
                                            plan.local_output_padding, local_groups);
    if (plan.no_outputs && plan.channel_partial && b && out.numel() > 0) {
      // A rank without channels still owns the bias term when it is the first coordinate.
      out = out + channel_view(*b, out.dim());
    }
  }
  return wrap(out, mesh, plan.out_placements, plan.out_shape, plan.out_ext);
}

std::vector<int64_t> with_extent(at::IntArrayRef shape, int64_t dim, int64_t n) {
  auto s = shape.vec();
  s[dim] = n;
  return s;
}

// This rank's window shape (a convolution's input window: every halo dim at its window length).
std::vector<int64_t> window_shape(const ConvPlan& plan, const at::Tensor& x) {
  auto shape = x.sizes().vec();
  for (size_t k = 0; k < plan.halo.size(); ++k) shape[plan.halo.dim(k).dim] = plan.halo.window_rows(k);
  return shape;
}

// The backward with one sharded spatial dim (comm/halo_borders.h, BorderTerms). This rank's main backward holds
// every term of its outputs that reads its own rows or padding: the single-device backward on its rows when its
// split is direct, else on its window with the neighbours' rows read as zeros. The gradient rows of its border
// outputs go to the neighbours whose rows they read, which add those terms on their rows (input gradient) and to
// their weight-gradient term; it adds the terms of the neighbours' outputs that read its rows. One exchange, in
// flight while the main backward runs; nothing window-sized on the direct path.
std::tuple<at::Tensor, at::Tensor, at::Tensor> border_backward(const ConvPlan& plan, const at::Tensor& g,
                                                               const at::Tensor& x, const at::Tensor& w,
                                                               at::OptionalIntArrayRef bias_sizes,
                                                               at::IntArrayRef stride, at::IntArrayRef dilation,
                                                               int64_t groups, std::array<bool, 3> mask,
                                                               const Mesh& mesh) {
  const auto& d = plan.dims[0];
  const auto dim = d.dim;
  const auto& terms = plan.terms;
  const bool overlap = overlap_enabled();
  // Whether this exchange happens is the same on every rank: the mask and the layout.
  const bool exchange = (mask[0] || mask[1]) && plan.halo.exchanges(0);
  comm::PeerExchange rows;
  std::vector<at::Tensor> received;
  if (exchange) {
    std::vector<at::Tensor> send;
    std::vector<std::vector<int64_t>> shapes;
    at::Tensor nothing;  // one empty piece for every peer this rank sends nothing (no tensor op per peer)
    for (size_t r = 0; r < terms.send.size(); ++r) {
      const auto& [first, count] = terms.send[r];
      if (count == 0 && !nothing.defined()) nothing = g.narrow(dim, 0, 0);
      send.push_back(count > 0 ? g.narrow(dim, first, count) : nothing);
      shapes.push_back(with_extent(g.sizes(), dim, terms.recv[r].outputs));
    }
    rows = comm::peer_exchange_start(send, shapes, g, mesh, d.mesh_dim);
    if (!overlap) received = rows.wait();
  }
  at::Tensor gi, gw, gb;
  if (plan.no_outputs) {
    if (mask[0]) gi = at::zeros_like(x);
    if (mask[1]) gw = at::zeros_like(w);
    if (mask[2] && bias_sizes) gb = at::zeros(*bias_sizes, w.options());
  } else if (plan.split.direct) {
    std::tie(gi, gw, gb) = local_conv_backward(g, x, w, bias_sizes, stride,
                                               padding_on_split_dim(plan, plan.split.padding), dilation, false,
                                               plan.local_output_padding, groups, mask);
  } else {
    auto window = plan.halo.window_slice(0, x, {}, 0, plan.halo.window_rows(0));  // the neighbours' rows zero
    std::tie(gi, gw, gb) = local_conv_backward(g, window, w, bias_sizes, stride, plan.local_padding, dilation,
                                               false, plan.local_output_padding, groups, mask);
    if (mask[0]) gi = plan.halo.own_sum(0, gi, /*reuse=*/true);
  }
  if (!exchange) return {gi, gw, gb};
  if (overlap) received = rows.wait();
  if (x.numel() == 0) return {gi, gw, gb};
  const auto& win = d.window;
  for (size_t r = 0; r < terms.recv.size(); ++r) {
    const auto& t = terms.recv[r];
    // Output i of the neighbour's block reads row row_begin + i*s + tap*d: the terms on this rank's rows.
    for (int64_t i = 0; i < t.outputs; ++i)
      for (int64_t tap = 0; tap < win.kernel; ++tap) {
        const auto q = t.row_begin + i * win.stride + tap * win.dilation - terms.own_begin;
        if (q < 0 || q >= terms.own_rows) continue;
        auto [gti, gtw, unused] = local_conv_backward(
            row_of(plan, received[r], i), row_of(plan, x, q), row_of(plan, w, tap), std::nullopt, plan.row_stride,
            plan.row_padding, plan.row_dilation, false, plan.row_output_padding, groups, {mask[0], mask[1], false});
        if (mask[0]) gi.select(dim, q).add_(as_row(plan, gti));
        if (mask[1]) gw.select(dim, tap).add_(as_row(plan, gtw));
      }
  }
  return {gi, gw, gb};
}

// convolution_backward(Tensor grad_output, Tensor input, Tensor weight, SymInt[]? bias_sizes, SymInt[] stride,
//                      SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups,
//                      bool[3] output_mask) -> (grad_input, grad_weight, grad_bias)
// functorch's per-sample input gradients (vmap of grad over a convolution: its convolution_backward batch rule)
// ask for the input gradient with a placeholder input, a 0-dim tensor expanded to the input's shape, whose values
// the input gradient never reads. Made from a split tensor by new_empty({}), the placeholder is Replicate, and the
// input gradient would be whole on every rank; when only the input gradient is asked and the output gradient is
// split along spatial dims, the placeholder takes those splits (the output gradient's extents where the input has
// the output's size, else the default split), so the work stays divided. A tensor with real strides keeps its layout.
at::Tensor placeholder_like_gradient(const at::Tensor& xs, const at::Tensor& grad_output, std::array<bool, 3> mask) {
  const auto* xi = shard_impl(xs);
  const auto* gi = shard_impl(grad_output);
  if (mask[1] || !xi || !gi || !xi->spec()->all_replicate() || xs.numel() == 0) return xs;
  const auto& x = xi->local();
  for (auto stride : x.strides())
    if (stride != 0) return xs;
  const auto& gspec = *gi->spec();
  Placements p(gspec.mesh->ndim(), Placement::replicate());
  std::map<int64_t, std::vector<int64_t>> ext;
  bool split = false;
  for (size_t m = 0; m < p.size(); ++m) {
    const auto& pl = gspec.placements[m];
    if (!pl.is_shard() || pl.dim < 2) continue;
    p[m] = pl;
    split = true;
    if (xs.size(pl.dim) == grad_output.size(pl.dim)) ext[pl.dim] = gspec.extents[m];
  }
  if (!split) return xs;
  auto spec = ShardSpec::make_with_dim_extents(gspec.mesh, p, xs.sizes().vec(), ext);
  return make_shard_tensor(x.as_strided(spec->local_shape, std::vector<int64_t>(spec->local_shape.size(), 0)), spec);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_rule(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalIntArrayRef bias_sizes_arg, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
    bool transposed, at::IntArrayRef output_padding, c10::SymInt groups_arg, std::array<bool, 3> mask) {
  auto mesh = dispatch::common_mesh("aten::convolution_backward", {grad_output, input, weight});
  auto bias_sizes = bias_sizes_arg ? std::optional<std::vector<int64_t>>(bias_sizes_arg->vec()) : std::nullopt;
  const auto groups = concrete_int(groups_arg);
  // The forward's complete value of a pending-sum input, and its plan: nothing is resolved or planned again.
  auto xs = placeholder_like_gradient(
      channel_split_to_space(resolve_partial_once(dispatch::as_shard(input, mesh), false), weight.sizes(), transposed,
                             groups),
      grad_output, mask);
  const auto& spec = shard_impl(xs)->spec();
  const auto& x = shard_impl(xs)->local();
  auto planp = conv_plan(*spec, weight.sizes(), stride, padding, dilation, transposed, output_padding, groups,
                         x.device());
  const auto& plan = *planp;
  auto g = local_aligned(resolve_partial(dispatch::as_shard(grad_output, mesh)), mesh, plan.out_shape,
                         plan.out_placements, plan.out_ext);
  at::Tensor g_bias_source = g;
  auto w = local_weight(local_of_param(weight, mesh), plan);
  const auto local_groups = plan.channel_mesh_dim >= 0 && !plan.channel_partial ? plan.local_groups : groups;
  const int64_t global_bias_numel = bias_sizes && !bias_sizes->empty() ? (*bias_sizes)[0] : 0;
  std::optional<std::vector<int64_t>> local_bias_sizes = bias_sizes;
  if (bias_sizes && plan.channel_mesh_dim >= 0 && !plan.channel_partial)
    local_bias_sizes = std::vector<int64_t>{plan.out_channels};
  if (local_bias_sizes) bias_sizes = local_bias_sizes;
  at::OptionalIntArrayRef bs = bias_sizes ? at::OptionalIntArrayRef(*bias_sizes) : at::OptionalIntArrayRef();
  at::Tensor gi, gw, gb;
  // Which of the two paths below runs is the same on every rank (the plan's dims); within the first, ranks may run
  // their main backward differently but exchange alike.
  if (plan.transposed_direct && !plan.no_outputs) {
    // The gradient's halo travels whatever the mask (as the window path gathers it).
    std::tie(gi, gw) = transposed_direct_backward(plan, g, x, w, stride, dilation, groups, mask[0], mask[1], *mesh);
  } else if (plan.transposed_multi && !plan.no_outputs) {
    std::tie(gi, gw) = transposed_multi_backward(plan, g, x, w, stride, dilation, groups, mask[0], mask[1], *mesh);
  } else if (plan.border_terms) {
    std::tie(gi, gw, gb) = border_backward(plan, g, x, w, bs, stride, dilation, local_groups, mask, *mesh);
  } else if (plan.multi_direct && !plan.no_outputs && (mask[0] || mask[1])) {
    std::tie(gi, gw, gb) = multi_direct_backward(plan, g, x, w, bs, stride, dilation, local_groups, mask, *mesh);
  } else if (!plan.transposed && plan.dims.size() >= 2 && plan.halo.all_runs() && mask[1] && !plan.no_outputs) {
    // Several sharded dims: the input and bias gradients read no input values, so they run while the input's
    // halo travels, on the window's buffer before it is written; the window (written once) then serves the weight
    // gradient alone.
    auto window = at::empty(window_shape(plan, x), x.options());
    auto received = plan.halo.exchange_all(x, *mesh, [&] {
      if (mask[0] || mask[2])
        std::tie(gi, std::ignore, gb) = local_conv_backward(g, window, w, bs, stride, plan.local_padding, dilation,
                                                            false, plan.local_output_padding, local_groups,
                                                            {mask[0], false, mask[2]});
    });
    {
      plan.halo.assemble(x, received, plan.halo.size(), 0, 0, window);
      gw = std::get<1>(local_conv_backward(g, window, w, std::nullopt, stride, plan.local_padding, dilation,
                                           false, plan.local_output_padding, local_groups, {false, true, false}));
      window = at::Tensor();
    }
    if (mask[0]) gi = plan.halo.scatter_add(gi, *mesh, /*consume=*/true);
  } else {
    if (plan.transposed && !plan.dims.empty()) g = plan.halo.gather(g, *mesh);
    // The input gradient reads no input values: without a weight gradient the window is only a shape.
    auto window = plan.transposed ? x : mask[1] || plan.halo.empty() ? plan.halo.gather(x, *mesh)
                                                                      : at::empty(window_shape(plan, x), x.options());
    if (plan.no_outputs) {
      gi = at::zeros_like(window);
      gw = at::zeros_like(w);
      if (bias_sizes) gb = at::zeros(*bias_sizes, w.options());
    } else {
      std::tie(gi, gw, gb) = local_conv_backward(g, window, w, bs, stride, plan.local_padding, dilation,
                                                 transposed, plan.local_output_padding, local_groups, mask);
    }
    // The gathered input window is dead now: freed before the window gradient goes home, so a backward holds at
    // most the window gradient and the local one (the saved input stays with autograd).
    window = at::Tensor();
    if (mask[0] && gi.defined() && !plan.transposed)
      gi = plan.halo.scatter_add(gi, *mesh, /*consume=*/true);  // gi: our own temporary
  }
  // Transposed over sharded dims: the bias gradient is the sum of this rank's own output rows (not the windows);
  // a groups == 1 contraction over sharded channels: every rank holds the whole grad_output.
  if (((plan.transposed && !plan.dims.empty()) || plan.channel_partial) && mask[2] && bias_sizes) {
    std::vector<int64_t> red{0};
    for (int64_t d = 2; d < g_bias_source.dim(); ++d) red.push_back(d);
    gb = g_bias_source.sum(red);
  }
  at::Tensor grad_input, grad_weight, grad_bias;
  // While torch.compile traces, the meta kernel may give the local input gradient strides that the CPU kernel does
  // not (channels-last where it returns contiguous, for an input whose strides fit both: diffusers' Wan VAE), and a
  // compiled backward that views the gradient with the traced strides fails at run time: a non-contiguous traced
  // result is made contiguous in the graph (a recorded copy; eager code is unchanged).
  if (mask[0] && gi.defined() && comm::tracing(gi)) gi = gi.contiguous();
  if (mask[0] && gi.defined()) grad_input = make_shard_tensor(gi, spec);
  // Parameter gradients: each rank's term over its outputs; pending sums over every sharding mesh dim.
  // Sharded channels: the weight gradient is sharded like the weight slice each rank used (dim 1 for groups == 1,
  // dim 0 for aligned groups); the bias gradient is complete (groups == 1: every rank holds the whole
  // grad_output) or sharded with the output channels.
  // Terms over batch/spatial shards are summed now, weight and bias in one fused all-reduce.
  // Left pending instead when the gradient buckets take them (dispatch/grad_buckets.h): one bucket fuses them.
  bool pending = false;
  {
    std::vector<at::Tensor> terms{mask[1] ? gw : at::Tensor(), mask[2] ? gb : at::Tensor()};
    // The bias itself is not an argument here: it follows the weight (its own promotion completes its sum either
    // way, deferred or at once).
    const auto w_arg = mask[1] && plan.channel_mesh_dim < 0 ? weight : at::Tensor();
    pending = sum_param_grads(terms, {w_arg, w_arg}, plan.param_grad_mesh_dims, *mesh);
    gw = terms[0];
    gb = terms[1];
  }
  Placements pw(mesh->ndim(), Placement::replicate()), pb(mesh->ndim(), Placement::replicate());
  if (pending)
    for (auto m : plan.param_grad_mesh_dims) pw[m] = pb[m] = Placement::partial();
  DimExtents ew, eb;
  if (plan.channel_mesh_dim >= 0) {
    const auto m = plan.channel_mesh_dim;
    // The weight's dim that holds the input channels: 1, or 0 for a transposed weight ([in, out / groups, k...]).
    const int64_t in_dim = plan.transposed ? 0 : 1;
    if (plan.channel_partial) {
      pw[m] = Placement::shard(in_dim);
      ew[in_dim] = spec->extents[m];
      pb[m] = Placement::replicate();
    } else {
      pw[m] = Placement::shard(0);
      ew[0] = plan.transposed ? spec->extents[m] : plan.out_ext.at(1);
      pb[m] = Placement::shard(0);
      eb[0] = plan.out_ext.at(1);
    }
  }
  if (mask[1] && gw.defined()) grad_weight = wrap(gw, mesh, pw, weight.sizes().vec(), ew);
  if (mask[2] && gb.defined()) grad_bias = wrap(gb, mesh, pb, {global_bias_numel}, eb);
  return {grad_input, grad_weight, grad_bias};
}

// The second derivative of a convolution (a physics-informed loss on du/dx, a gradient penalty), with the input
// or the incoming gradient sharded. aten's own formula (_convolution_double_backward) convolves the sharded input
// gradient with the sharded output gradient as if one were a weight, which no halo plan serves. The same three
// terms from the forward and backward rules, whose operands keep their roles (a convolution is bilinear in input
// and weight; its input gradient is the adjoint of the forward in the input, its weight gradient in the weight):
//   d/d grad_output = conv(ggI, W) + conv(x, ggW) + ggb (per channel)
//   d/d input       = convolution_backward(grad_output, x, ggW)'s input gradient
//   d/d weight      = convolution_backward(grad_output, ggI, W)'s weight gradient
// for plain and transposed convolutions alike (`convolution` takes the same parameters).
struct ConvParams {
  std::vector<int64_t> stride, padding, dilation, output_padding;
  bool transposed = false;
  int64_t groups = 1;
};

c10::IValue params_ivalue(const ConvParams& p) {
  return c10::ivalue::Tuple::create({p.stride, p.padding, p.dilation, p.output_padding, p.transposed, p.groups});
}

ConvParams params_from(const c10::IValue& v) {
  const auto& t = v.toTupleRef().elements();
  return {t[0].toIntVector(), t[1].toIntVector(), t[2].toIntVector(), t[3].toIntVector(), t[4].toBool(),
          t[5].toInt()};
}

at::Tensor conv_with(const ConvParams& p, const at::Tensor& x, const at::Tensor& w) {
  return at::convolution(x, w, std::nullopt, p.stride, p.padding, p.dilation, p.transposed, p.output_padding,
                         p.groups);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_backward_with(const ConvParams& p, const at::Tensor& go,
                                                                  const at::Tensor& x, const at::Tensor& w,
                                                                  std::array<bool, 3> mask) {
  return local_conv_backward(go, x, w, std::nullopt, p.stride, p.padding, p.dilation, p.transposed,
                             p.output_padding, p.groups, mask);
}

at::Tensor add_defined(const at::Tensor& a, const at::Tensor& b) {
  return !a.defined() ? b : !b.defined() ? a : at::add(a, b);
}

struct ConvBackwardFn : torch::autograd::Function<ConvBackwardFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& go,
                                                const at::Tensor& x, const at::Tensor& w,
                                                std::optional<std::vector<int64_t>> bias_sizes,
                                                const c10::IValue& params, std::vector<bool> mask) {
    const auto p = params_from(params);
    ctx->saved_data["params"] = params;
    ctx->saved_data["mask"] = c10::List<bool>({mask[0], mask[1], mask[2]});
    ctx->save_for_backward({go, x, w});
    auto [gi, gw, gb] = local_conv_backward(
        go, x, w, bias_sizes ? std::optional<at::IntArrayRef>(*bias_sizes) : std::nullopt, p.stride, p.padding,
        p.dilation, p.transposed, p.output_padding, p.groups, {mask[0], mask[1], mask[2]});
    // Only the asked gradients are outputs (a Function's outputs must be defined).
    torch::autograd::variable_list out;
    for (auto [asked, g] : {std::pair{mask[0], gi}, std::pair{mask[1], gw}, std::pair{mask[2], gb}})
      if (asked) out.push_back(g);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto p = params_from(ctx->saved_data["params"]);
    auto saved = ctx->get_saved_variables();
    const auto &go = saved[0], &x = saved[1], &w = saved[2];
    const auto mask = ctx->saved_data["mask"].toBoolList();
    at::Tensor gg[3];
    for (size_t i = 0, k = 0; i < 3; ++i)
      if (mask[i]) gg[i] = grads[k++];
    const auto &ggi = gg[0], &ggw = gg[1], &ggb = gg[2];
    at::Tensor d_go, d_x, d_w;
    if (ggi.defined()) d_go = conv_with(p, ggi, w);
    if (ggw.defined()) d_go = add_defined(d_go, conv_with(p, x, ggw));
    if (ggb.defined()) {
      std::vector<int64_t> shape(go.dim(), 1);
      shape[1] = ggb.numel();
      d_go = add_defined(d_go, ggb.reshape(shape).expand(go.sizes()));
    }
    if (ggw.defined() && x.requires_grad()) d_x = std::get<0>(conv_backward_with(p, go, x, ggw, {true, false, false}));
    if (ggi.defined() && w.requires_grad()) d_w = std::get<1>(conv_backward_with(p, go, ggi, w, {false, true, false}));
    return {d_go, d_x, d_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// convolution_backward with grad mode on (its graph recorded: create_graph=True) and a ShardTensor among its
// tensors: ConvBackwardFn; otherwise aten's own derivative formula.
bool convolution_backward_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!at::GradMode::is_enabled()) return false;
  dispatch::NamedArgs args(op, stack);
  const auto go = args.tensor("grad_output"), x = args.tensor("input"), w = args.tensor("weight");
  if (!shard_impl(go) && !shard_impl(x) && !shard_impl(w)) return false;
  if (!go.requires_grad() && !x.requires_grad() && !w.requires_grad()) return false;
  auto ints = [&](std::string_view name) {
    const auto v = args[name].toDimVector();
    return std::vector<int64_t>(v.begin(), v.end());
  };
  ConvParams p{ints("stride"), ints("padding"), ints("dilation"), ints("output_padding"), args["transposed"].toBool(),
               args["groups"].toInt()};
  std::optional<std::vector<int64_t>> bias_sizes;
  if (!args["bias_sizes"].isNone()) bias_sizes = ints("bias_sizes");
  const auto m = args["output_mask"].toBoolList();
  auto got = ConvBackwardFn::apply(go, x, w, bias_sizes, params_ivalue(p), std::vector<bool>{m[0], m[1], m[2]});
  at::Tensor out[3];
  for (size_t i = 0, k = 0; i < 3; ++i)
    if (m[i]) out[i] = got[k++];
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out[0]), std::move(out[1]), std::move(out[2]));
  return true;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(conv) {
  dispatch::set_handler("aten::convolution", typed_handler(&convolution_rule));
  dispatch::set_handler("aten::convolution_backward", typed_handler(&convolution_backward_rule));
  dispatch::set_autograd_handler("aten::convolution_backward", &convolution_backward_autograd);
}

} // namespace shardtensor::ops
