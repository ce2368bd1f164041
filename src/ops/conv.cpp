// Convolutions over sharded spatial dims by halo exchange. The output partition follows the global output grid:
// coordinate c owns the outputs whose window centres lie in its input range, so any stride, dilation, kernel size
// (odd or even) and padding works, including offsets that are not multiples of the stride. Each rank gathers
// exactly the input rows its outputs read (its own plus halos from any number of ranks away; zeros outside the
// tensor), runs the local convolution with zero padding on sharded dims, and in backward sends the halo
// gradients home. Batch-sharded inputs are local; weight and bias gradients are Partial sums reduced once by the
// parameters' promotion.
#include "comm/halo.h"
#include "ops/common.h"

#include <c10/util/irange.h>

namespace shardtensor::ops {

namespace {

using dispatch::op_args;

struct DimPlan {
  int64_t dim;       // tensor dim
  int64_t mesh_dim;
  std::vector<int64_t> in_extents;
  std::vector<int64_t> out_extents;
  comm::RowRequests want;
  int64_t padding = 0;
};

// Output extents and input windows along one sharded spatial dim of a (non-transposed) convolution.
DimPlan plan_dim(int64_t dim, int64_t mesh_dim, const std::vector<int64_t>& in_extents, int64_t L, int64_t k,
                 int64_t s, int64_t p, int64_t dil) {
  DimPlan plan{dim, mesh_dim, in_extents, {}, {}, p};
  const auto n = static_cast<int64_t>(in_extents.size());
  const auto span = dil * (k - 1) + 1;
  const auto lout = std::max<int64_t>((L + 2 * p - span) / s + 1, 0);
  std::vector<int64_t> bounds(n + 1, 0);
  bounds[n] = lout;
  int64_t a = 0;
  for (int64_t c = 1; c < n; ++c) {
    a += in_extents[c - 1];
    const auto first = first_output_centred_at(a, s, p, span);
    bounds[c] = std::clamp<int64_t>(first, bounds[c - 1], lout);
  }
  for (int64_t c = 0; c < n; ++c) {
    plan.out_extents.push_back(bounds[c + 1] - bounds[c]);
    std::vector<int64_t> rows;
    if (bounds[c + 1] > bounds[c]) {
      const auto start = bounds[c] * s - p;
      const auto end = (bounds[c + 1] - 1) * s - p + span;
      for (auto pos = start; pos < end; ++pos) rows.push_back(comm::padded_index(pos, L, "zeros"));
    }
    plan.want.push_back(std::move(rows));
  }
  return plan;
}

// Transposed convolution along one sharded spatial dim: each rank runs the local transposed convolution of its
// own inputs (padding 0) and produces a window of outputs starting at global position a_c*s - p; the window's
// rows are summed into their owners (default split of the output) — the adjoint of the convolution halo.
DimPlan plan_dim_transposed(int64_t dim, int64_t mesh_dim, const std::vector<int64_t>& in_extents, int64_t L, int64_t k,
                            int64_t s, int64_t p, int64_t dil, int64_t output_padding) {
  DimPlan plan{dim, mesh_dim, in_extents, {}, {}};
  const auto lout = (L - 1) * s - 2 * p + dil * (k - 1) + output_padding + 1;
  plan.out_extents = default_split(lout, static_cast<int64_t>(in_extents.size()));
  int64_t a = 0;
  for (auto e : in_extents) {
    std::vector<int64_t> rows;
    const auto width = e > 0 ? (e - 1) * s + dil * (k - 1) + 1 : 0;
    for (int64_t u = 0; u < width; ++u) {
      const auto j = a * s - p + u;
      rows.push_back(j >= 0 && j < lout ? j : -1);
    }
    plan.want.push_back(std::move(rows));
    a += e;
  }
  return plan;
}

struct ConvPlan {
  at::Tensor x;                 // resolved input ShardTensor
  SpecPtr spec;
  std::vector<DimPlan> dims;    // sharded spatial dims, in mesh-dim order
  std::vector<int64_t> local_padding;
  std::vector<int64_t> local_output_padding;
  bool transposed = false;
  // Channel dim sharded (mesh dim `channel_mesh_dim`): groups == 1 contracts over the local channels (a Partial
  // sum); grouped convolutions whose shards align with whole groups run their local groups.
  int64_t channel_mesh_dim = -1;
  bool channel_partial = false;          // groups == 1
  int64_t channel_offset = 0, channel_extent = 0;
  int64_t local_groups = 1;
  int64_t weight_row_offset = 0, weight_rows = 0; // grouped: the local groups' output channels
  std::vector<int64_t> out_shape;
  Placements out_placements;
  DimExtents out_ext;
};

ConvPlan plan_conv(const c10::OperatorHandle& op, const torch::jit::Stack* stack, const at::Tensor& input,
                   const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                   bool transposed, at::IntArrayRef output_padding, int64_t groups, const MeshPtr& mesh) {
  ConvPlan plan;
  plan.x = resolve_partial(dispatch::as_shard(input, mesh));
  plan.spec = shard_impl(plan.x)->spec();
  const auto nd = input.dim();
  const auto spatial = nd - 2;
  auto expand = [&](at::IntArrayRef v, int64_t i) { return v.size() == 1 ? v[0] : v[i]; };
  plan.transposed = transposed;
  plan.local_padding.assign(spatial, 0);
  plan.local_output_padding.assign(spatial, 0);
  for (int64_t i = 0; i < spatial; ++i) {
    plan.local_padding[i] = expand(padding, i);
    plan.local_output_padding[i] = output_padding.empty() ? 0 : expand(output_padding, i);
  }
  plan.out_shape = {input.size(0), transposed ? weight.size(1) * groups : weight.size(0)};
  for (int64_t i = 0; i < spatial; ++i) {
    const auto L = input.size(2 + i), k = weight.size(2 + i);
    const auto s = expand(stride, i), p = expand(padding, i), dil = expand(dilation, i);
    plan.out_shape.push_back(transposed ? (L - 1) * s - 2 * p + dil * (k - 1) + expand(output_padding, i) + 1
                                        : (L + 2 * p - dil * (k - 1) - 1) / s + 1);
  }
  plan.out_placements = plan.spec->placements;
  for (size_t mi = 0; mi < plan.spec->placements.size(); ++mi) {
    const auto& pl = plan.spec->placements[mi];
    if (!pl.is_shard()) continue;
    const auto m = static_cast<int64_t>(mi);
    if (pl.dim == 0) {
      plan.out_ext[0] = plan.spec->extents[m];
      continue;
    }
    if (pl.dim == 1) {
      if (transposed) dispatch::not_implemented(op, stack, "transposed convolution with the channel dim sharded");
      const auto cin_g = input.size(1) / groups, cout_g = weight.size(0) / groups;
      const auto coord = plan.spec->mesh->coordinate(m);
      plan.channel_mesh_dim = m;
      plan.channel_offset = plan.spec->offset_of(m, coord);
      plan.channel_extent = plan.spec->extents[m][coord];
      if (groups == 1) {
        plan.channel_partial = true;
        plan.out_placements[m] = Placement::partial(ReduceOp::Sum);
      } else {
        std::vector<int64_t> out_channels;
        for (auto e : plan.spec->extents[m]) {
          if (e % cin_g != 0) {
            dispatch::not_implemented(op, stack, "grouped convolution whose channel shards split a group; align the "
                                                 "channel extents with the groups (multiples of in_channels/groups)");
          }
          out_channels.push_back(e / cin_g * cout_g);
        }
        for (int64_t c = 0; c < static_cast<int64_t>(plan.spec->extents[m].size()); ++c)
          if (plan.spec->offset_of(m, c) % cin_g != 0)
            dispatch::not_implemented(op, stack, "grouped convolution whose channel shards split a group");
        plan.local_groups = plan.channel_extent / cin_g;
        plan.weight_row_offset = plan.channel_offset / cin_g * cout_g;
        plan.weight_rows = plan.local_groups * cout_g;
        plan.out_ext[1] = out_channels;
      }
      continue;
    }
    const auto i = pl.dim - 2;
    auto dp = transposed
        ? plan_dim_transposed(pl.dim, m, plan.spec->extents[m], input.size(pl.dim), weight.size(pl.dim), expand(stride, i),
                              expand(padding, i), expand(dilation, i), plan.local_output_padding[i])
        : plan_dim(pl.dim, m, plan.spec->extents[m], input.size(pl.dim), weight.size(pl.dim), expand(stride, i),
                   expand(padding, i), expand(dilation, i));
    plan.out_ext[pl.dim] = dp.out_extents;
    plan.local_padding[i] = 0;
    plan.local_output_padding[i] = 0;
    plan.dims.push_back(std::move(dp));
  }
  return plan;
}

// This rank's local output shape.
std::vector<int64_t> local_out_shape(const ConvPlan& plan) {
  auto shape = plan.out_shape;
  const auto& mesh = *plan.spec->mesh;
  for (size_t m = 0; m < plan.out_placements.size(); ++m)
    if (plan.out_placements[m].is_shard()) {
      const auto d = plan.out_placements[m].dim;
      shape[d] = plan.out_ext.at(d)[mesh.coordinate(static_cast<int64_t>(m))];
    }
  return shape;
}

// The shape the local kernel produces: for transposed convolutions the output windows along sharded dims.
std::vector<int64_t> local_kernel_shape(const ConvPlan& plan) {
  auto shape = local_out_shape(plan);
  if (!plan.transposed) return shape;
  const auto me = [&](int64_t m) { return plan.spec->mesh->coordinate(m); };
  for (const auto& d : plan.dims) shape[d.dim] = static_cast<int64_t>(d.want[me(d.mesh_dim)].size());
  return shape;
}

bool has_no_outputs(const ConvPlan& plan) {
  // A rank without channels of a groups == 1 contraction contributes nothing to the pending sum.
  if (plan.channel_partial && plan.channel_extent == 0) return true;
  for (auto s : local_kernel_shape(plan))
    if (s == 0) return true;
  return false;
}

// The input window this rank's outputs read (halos gathered along every sharded spatial dim in turn, so corners
// of 2-D meshes come along). Transposed convolutions read only their own inputs.
at::Tensor gather_window(const ConvPlan& plan) {
  auto x = shard_impl(plan.x)->local();
  if (plan.transposed) return x;
  for (const auto& d : plan.dims) x = comm::gather_rows(x, d.dim, d.in_extents, d.want, *plan.spec->mesh, d.mesh_dim);
  return x;
}

// Transposed: sum each output window row into its owner, dim by dim.
at::Tensor scatter_outputs(at::Tensor y, const ConvPlan& plan) {
  for (const auto& d : plan.dims) y = comm::scatter_add_rows(y, d.dim, d.out_extents, d.want, *plan.spec->mesh, d.mesh_dim);
  return y;
}

// Transposed backward: the output-window gradient this rank's kernel produced (the adjoint of scatter_outputs).
at::Tensor gather_output_grad(at::Tensor g, const ConvPlan& plan) {
  for (auto it = plan.dims.rbegin(); it != plan.dims.rend(); ++it)
    g = comm::gather_rows(g, it->dim, it->out_extents, it->want, *plan.spec->mesh, it->mesh_dim);
  return g;
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
  if (plan.channel_partial) return w.narrow(1, plan.channel_offset, plan.channel_extent);
  return w.narrow(0, plan.weight_row_offset, plan.weight_rows);
}

std::optional<at::Tensor> local_bias(const std::optional<at::Tensor>& b, const ConvPlan& plan) {
  if (!b || plan.channel_mesh_dim < 0) return b;
  if (plan.channel_partial) {
    // The pending sum must count the bias once: only the first coordinate adds it.
    return plan.spec->mesh->coordinate(plan.channel_mesh_dim) == 0 ? b : std::optional<at::Tensor>(at::zeros_like(*b));
  }
  return b->narrow(0, plan.weight_row_offset, plan.weight_rows);
}

// Forward with the halo exchange overlapped: post the exchange, convolve the outputs whose windows lie in this
// rank's own rows, then the border outputs from the completed window. One sharded spatial dim, not transposed.
// Returns an undefined tensor when there is no interior to overlap with (the caller then runs the plain path).
bool overlap_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SHARDTENSOR_HALO_OVERLAP");
    return !(v && std::string(v) == "0");
  }();
  return enabled;
}

at::Tensor overlapped_forward(const ConvPlan& plan, const at::Tensor& w, const std::optional<at::Tensor>& b,
                              at::IntArrayRef stride, at::IntArrayRef dilation, int64_t groups, const at::Tensor& weight) {
  if (!overlap_enabled() || plan.transposed || plan.dims.size() != 1 || has_no_outputs(plan)) return {};
  const auto& d = plan.dims[0];
  const auto& mesh = *plan.spec->mesh;
  const auto me = mesh.coordinate(d.mesh_dim);
  const auto i = d.dim - 2;
  auto pick = [&](at::IntArrayRef v) { return v.size() == 1 ? v[0] : v[i]; };
  const auto s = pick(stride), dil = pick(dilation), k = weight.size(d.dim);
  const auto span = dil * (k - 1) + 1;
  int64_t a = 0;
  for (int64_t c = 0; c < me; ++c) a += d.in_extents[c];
  const auto e = d.in_extents[me];
  int64_t b0 = 0;
  for (int64_t c = 0; c < me; ++c) b0 += d.out_extents[c];
  const auto b1 = b0 + d.out_extents[me];
  // The window starts at global row b0*s - p; interior outputs read only rows in [a, a + e).
  const auto pv = d.padding;
  const auto j_lo = std::max<int64_t>(b0, (a + pv + s - 1) / s);
  const auto j_hi = std::min<int64_t>(b1, (a + e + pv - span) >= 0 ? (a + e + pv - span) / s + 1 : 0);
  if (j_hi <= j_lo) return {};
  auto pending = comm::gather_rows_start(shard_impl(plan.x)->local(), d.dim, d.in_extents, d.want, mesh, d.mesh_dim);
  const auto& x = shard_impl(plan.x)->local();
  auto interior = at::convolution(x.narrow(d.dim, j_lo * s - pv - a, (j_hi - 1 - j_lo) * s + span), w, b, stride,
                                  plan.local_padding, dilation, false, plan.local_output_padding, groups);
  auto window = comm::gather_rows_finish(pending);
  std::vector<at::Tensor> parts;
  if (j_lo > b0)
    parts.push_back(at::convolution(window.narrow(d.dim, 0, (j_lo - 1 - b0) * s + span), w, b, stride,
                                    plan.local_padding, dilation, false, plan.local_output_padding, groups));
  parts.push_back(interior);
  if (b1 > j_hi)
    parts.push_back(at::convolution(window.narrow(d.dim, (j_hi - b0) * s, (b1 - 1 - j_hi) * s + span), w, b, stride,
                                    plan.local_padding, dilation, false, plan.local_output_padding, groups));
  return parts.size() == 1 ? parts[0] : at::cat(parts, d.dim);
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
void convolution_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto mesh = dispatch::common_mesh(op, stack);
  auto input = args[0].toTensor();
  auto weight = args[1].toTensor();
  auto bias = args[2].toOptional<at::Tensor>();
  auto stride = args[3].toDimVector(), padding = args[4].toDimVector(), dilation = args[5].toDimVector();
  const bool transposed = args[6].toBool();
  auto output_padding = args[7].toDimVector();
  const auto groups = args[8].toInt();
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(input), "ShardTensor convolution: the input must be the ShardTensor");
  auto plan = plan_conv(op, stack, input, weight, stride, padding, dilation, transposed, output_padding, groups, mesh);
  auto w = local_weight(local_of_param(weight, mesh), plan);
  auto b = local_bias(bias && bias->defined() ? std::optional<at::Tensor>(local_of_param(*bias, mesh)) : std::nullopt, plan);
  const auto local_groups = plan.channel_mesh_dim >= 0 && !plan.channel_partial ? plan.local_groups : groups;
  // Every rank takes part in the halo exchange; a rank without outputs (zero extent) skips the local kernel.
  at::Tensor out;
  if (plan.transposed && !plan.dims.empty()) {
    auto window = gather_window(plan);
    // Bias is added after the scatter (once per output position).
    auto y = has_no_outputs(plan) ? at::zeros(local_kernel_shape(plan), window.options())
                                  : at::convolution(window, w, std::nullopt, stride, plan.local_padding, dilation, true,
                                                    plan.local_output_padding, groups);
    out = scatter_outputs(y, plan);
    if (b) {
      out = out + channel_view(*b, out.dim());
    }
  } else if (auto overlapped = overlapped_forward(plan, w, b, stride, dilation, local_groups, weight); overlapped.defined()) {
    out = overlapped;
  } else {
    auto window = gather_window(plan);
    out = has_no_outputs(plan) ? at::zeros(local_out_shape(plan), window.options())
                               : at::convolution(window, w, b, stride, plan.local_padding, dilation, transposed,
                                                 plan.local_output_padding, local_groups);
    if (has_no_outputs(plan) && plan.channel_partial && b && out.numel() > 0) {
      // A rank without channels still owns the bias term when it is the first coordinate.
      out = out + channel_view(*b, out.dim());
    }
  }
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, wrap(out, mesh, plan.out_placements, plan.out_shape, plan.out_ext));
}

// convolution_backward(grad_output, input, weight, bias_sizes?, stride, padding, dilation, transposed,
//                      output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)
void convolution_backward_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto mesh = dispatch::common_mesh(op, stack);
  auto input = args[1].toTensor();
  auto weight = args[2].toTensor();
  auto bias_sizes = args[3].isNone() ? std::optional<std::vector<int64_t>>() : std::optional<std::vector<int64_t>>(args[3].toIntVector());
  auto stride = args[4].toDimVector(), padding = args[5].toDimVector(), dilation = args[6].toDimVector();
  const bool transposed = args[7].toBool();
  auto output_padding = args[8].toDimVector();
  const auto groups = args[9].toInt();
  auto mask = args[10].to<std::array<bool, 3>>();
  auto plan = plan_conv(op, stack, input, weight, stride, padding, dilation, transposed, output_padding, groups, mesh);
  auto g = local_aligned(resolve_partial(dispatch::as_shard(args[0].toTensor(), mesh)), mesh, plan.out_shape,
                         plan.out_placements, plan.out_ext);
  at::Tensor g_bias_source = g;
  if (plan.transposed && !plan.dims.empty()) g = gather_output_grad(g, plan);
  auto window = gather_window(plan);
  auto w = local_weight(local_of_param(weight, mesh), plan);
  const auto local_groups = plan.channel_mesh_dim >= 0 && !plan.channel_partial ? plan.local_groups : groups;
  const int64_t global_bias_numel = bias_sizes && !bias_sizes->empty() ? (*bias_sizes)[0] : 0;
  std::optional<std::vector<int64_t>> local_bias_sizes = bias_sizes;
  if (bias_sizes && plan.channel_mesh_dim >= 0 && !plan.channel_partial) local_bias_sizes = std::vector<int64_t>{plan.weight_rows};
  if (local_bias_sizes) bias_sizes = local_bias_sizes;
  at::OptionalIntArrayRef bs = bias_sizes ? at::OptionalIntArrayRef(*bias_sizes) : at::OptionalIntArrayRef();
  at::Tensor gi, gw, gb;
  if (has_no_outputs(plan)) {
    gi = at::zeros_like(window);
    gw = at::zeros_like(w);
    if (bias_sizes) gb = at::zeros(*bias_sizes, w.options());
  } else {
    std::tie(gi, gw, gb) = at::convolution_backward(g, window, w, bs, stride, plan.local_padding, dilation, transposed,
                                                    plan.local_output_padding, local_groups, mask);
  }
  // Transposed over sharded dims: the bias gradient is the sum of this rank's own output rows (not the windows);
  // a groups == 1 contraction over sharded channels: every rank holds the whole grad_output.
  if (((plan.transposed && !plan.dims.empty()) || plan.channel_partial) && mask[2] && bias_sizes) {
    std::vector<int64_t> red{0};
    for (int64_t d = 2; d < g_bias_source.dim(); ++d) red.push_back(d);
    gb = g_bias_source.sum(red);
  }
  at::Tensor grad_input, grad_weight, grad_bias;
  if (mask[0] && gi.defined()) {
    if (!plan.transposed)
      for (auto it = plan.dims.rbegin(); it != plan.dims.rend(); ++it)
        gi = comm::scatter_add_rows(gi, it->dim, it->in_extents, it->want, *mesh, it->mesh_dim);
    grad_input = make_shard_tensor(gi, plan.spec);
  }
  // Parameter gradients: each rank's term over its outputs; pending sums over every sharding mesh dim.
  // Sharded channels: the weight gradient is sharded like the weight slice each rank used (dim 1 for groups == 1,
  // dim 0 for aligned groups); the bias gradient is complete (groups == 1: every rank holds the whole
  // grad_output) or sharded with the output channels.
  // Terms over batch/spatial shards are summed now, weight and bias in one fused all-reduce.
  std::vector<int64_t> summed;
  for (size_t m = 0; m < plan.spec->placements.size(); ++m)
    if (plan.spec->placements[m].is_shard() && static_cast<int64_t>(m) != plan.channel_mesh_dim)
      summed.push_back(static_cast<int64_t>(m));
  {
    auto sums = fused_sum({mask[1] ? gw : at::Tensor(), mask[2] ? gb : at::Tensor()}, summed, *mesh);
    gw = sums[0];
    gb = sums[1];
  }
  Placements pw(mesh->ndim(), Placement::replicate()), pb(mesh->ndim(), Placement::replicate());
  DimExtents ew, eb;
  if (plan.channel_mesh_dim >= 0) {
    const auto m = plan.channel_mesh_dim;
    if (plan.channel_partial) {
      pw[m] = Placement::shard(1);
      ew[1] = plan.spec->extents[m];
      pb[m] = Placement::replicate();
    } else {
      pw[m] = Placement::shard(0);
      ew[0] = plan.out_ext.at(1);
      pb[m] = Placement::shard(0);
      eb[0] = plan.out_ext.at(1);
    }
  }
  if (mask[1] && gw.defined()) grad_weight = wrap(gw, mesh, pw, weight.sizes().vec(), ew);
  if (mask[2] && gb.defined()) grad_bias = wrap(gb, mesh, pb, {global_bias_numel}, eb);
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, grad_input);
  torch::jit::push(*stack, grad_weight);
  torch::jit::push(*stack, grad_bias);
}

} // namespace

void register_conv() {
  dispatch::set_handler("aten::convolution", convolution_handler);
  dispatch::set_handler("aten::convolution_backward", convolution_backward_handler);
}

} // namespace shardtensor::ops
