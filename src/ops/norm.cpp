// Normalization layers. layer_norm: over unsharded normalized dims it is local (leading dims may be sharded
// anyhow); over sharded normalized dims the mean and variance are global (two-pass, all-reduced sums) and
// the backward all-reduces the two sums it needs. Affine gradients are Partial(sum) over the mesh dims that
// shard the leading dims, reduced once by the parameter's promotion.
#include "comm/collectives.h"
#include "ops/arg_checks.h"
#include "ops/concrete_ints.h"
#include "ops/common.h"
#include "ops/moments.h"

namespace shardtensor::ops {

namespace {

struct LayerNormLayout {
  at::Tensor x;                  // resolved input
  SpecPtr spec;
  int64_t axis;                  // first normalized dim
  std::vector<int64_t> norm_dims;
  std::vector<int64_t> norm_mesh_dims; // mesh dims that shard a normalized dim
  std::vector<int64_t> lead_mesh_dims; // mesh dims that shard a leading dim
  int64_t count = 1;             // global number of normalized elements
};

LayerNormLayout layer_norm_layout(const at::Tensor& input, const MeshPtr& mesh, int64_t k) {
  LayerNormLayout l;
  l.x = resolve_partial(dispatch::as_shard(input, mesh));
  l.spec = shard_impl(l.x)->spec();
  l.axis = input.dim() - k;
  for (int64_t d = l.axis; d < input.dim(); ++d) {
    l.norm_dims.push_back(d);
    l.count *= input.size(d);
  }
  for (size_t m = 0; m < l.spec->placements.size(); ++m) {
    const auto& p = l.spec->placements[m];
    if (!p.is_shard()) continue;
    (p.dim >= l.axis ? l.norm_mesh_dims : l.lead_mesh_dims).push_back(static_cast<int64_t>(m));
  }
  return l;
}


// Stats (mean/rstd) shape [leading..., 1...]: leading shards kept, normalized mesh dims replicated.
at::Tensor wrap_stats(const at::Tensor& local, const LayerNormLayout& l, const at::Tensor& input) {
  auto shape = input.sizes().vec();
  for (auto d : l.norm_dims) shape[d] = 1;
  Placements p = l.spec->placements;
  DimExtents ext;
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_shard()) continue;
    if (p[m].dim >= l.axis) p[m] = Placement::replicate();
    else ext[p[m].dim] = l.spec->extents[m];
  }
  return wrap(local, l.spec->mesh, p, shape, ext);
}

// The affine parameter's local part for the normalized dims of this rank.
at::Tensor local_param(const std::optional<at::Tensor>& param, const LayerNormLayout& l, const at::Tensor& input) {
  if (!param || !param->defined()) return at::Tensor();
  const auto& mesh = l.spec->mesh;
  Placements want(mesh->ndim(), Placement::replicate());
  DimExtents ext;
  for (auto m : l.norm_mesh_dims) {
    const auto d = l.spec->placements[m].dim;
    want[m] = Placement::shard(d - l.axis);
    ext[d - l.axis] = l.spec->extents[m];
  }
  return local_in(*param, mesh, want, ext);
}

// native_layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps)
//   -> (out, mean, rstd)
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_rule(const at::Tensor& input,
                                                               c10::SymIntArrayRef normalized_shape,
                                                               const std::optional<at::Tensor>& weight,
                                                               const std::optional<at::Tensor>& bias, double eps) {
  auto mesh = dispatch::common_mesh("aten::native_layer_norm",
                                    {input, weight.value_or(at::Tensor()), bias.value_or(at::Tensor())});
  check_layer_norm_args(input, normalized_shape, weight, bias);
  const auto k = static_cast<int64_t>(normalized_shape.size());
  auto l = layer_norm_layout(input, mesh, k);
  const auto& x = shard_impl(l.x)->local();
  auto w = local_param(weight, l, input), b = local_param(bias, l, input);
  at::Tensor out, mean, rstd;
  if (l.norm_mesh_dims.empty()) {
    auto local_norm = x.sizes().slice(l.axis).vec();
    std::tie(out, mean, rstd) = at::native_layer_norm(x, local_norm, w.defined() ? std::optional<at::Tensor>(w) : std::nullopt,
                                                      b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, eps);
    auto shape = x.sizes().vec();
    for (auto d : l.norm_dims) shape[d] = 1;
    mean = mean.view(shape);
    rstd = rstd.view(shape);
  } else {
    const auto acc = at::isReducedFloatingType(x.scalar_type()) ? at::kFloat : x.scalar_type();
    auto xf = x.to(acc);
    std::vector<ShardedDim> sharded;
    for (auto m : l.norm_mesh_dims) sharded.push_back({m, l.spec->placements[m].dim, l.spec->extents[m]});
    auto mom = global_moments(xf, l.norm_dims, sharded, *mesh);
    mean = mom.mean;
    auto var = mom.m2 / mom.count;
    rstd = (var + eps).rsqrt();
    out = xf - mean;  // the one activation-sized buffer; the rest in place
    out.mul_(rstd);
    if (w.defined()) out.mul_(w);
    if (b.defined()) out.add_(b);
    out = out.to(x.scalar_type());
    // The statistics in the dtype the device's kernel returns: the input's on CPU, the accumulation type on CUDA
    // (half / bfloat16 inputs).
    if (x.device().is_cpu()) {
      mean = mean.to(x.scalar_type());
      rstd = rstd.to(x.scalar_type());
    }
  }
  return {make_shard_tensor(out, l.spec), wrap_stats(mean, l, input), wrap_stats(rstd, l, input)};
}

// Gradient of an affine parameter: the per-rank sum over local leading elements is Partial(sum) over the mesh
// dims that shard leading dims; its normalized dims keep their shards.
// `local` is already summed over the leading mesh dims (fused_sum), so only the normalized dims' shards remain.
// `pending`: the leading mesh dims' sums are left to the gradient buckets (sum_param_grads): Partial(sum) there.
at::Tensor wrap_param_grad(const at::Tensor& local, const LayerNormLayout& l, const at::Tensor& param, bool pending) {
  Placements p(l.spec->mesh->ndim(), Placement::replicate());
  if (pending)
    for (auto m : l.lead_mesh_dims) p[m] = Placement::partial();
  DimExtents ext;
  for (auto m : l.norm_mesh_dims) {
    const auto d = l.spec->placements[m].dim - l.axis;
    p[m] = Placement::shard(d);
    ext[d] = l.spec->extents[m];
  }
  return wrap(local, l.spec->mesh, p, param.sizes().vec(), ext);
}

// native_layer_norm_backward(Tensor grad_out, Tensor input, SymInt[] normalized_shape, Tensor mean, Tensor rstd,
//                            Tensor? weight, Tensor? bias, bool[3] output_mask) -> (grad_input, grad_weight, grad_bias)
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_rule(
    const at::Tensor& grad_out, const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
    const at::Tensor& mean_arg, const at::Tensor& rstd_arg, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> mask) {
  auto mesh = dispatch::common_mesh("aten::native_layer_norm_backward", {grad_out, input, mean_arg, rstd_arg,
                                                                         weight.value_or(at::Tensor()),
                                                                         bias.value_or(at::Tensor())});
  const auto k = static_cast<int64_t>(normalized_shape.size());
  auto l = layer_norm_layout(input, mesh, k);
  const auto& x = shard_impl(l.x)->local();
  auto g = local_aligned(resolve_partial(grad_out), mesh, input.sizes(), l.spec->placements, l.spec->dim_extents());
  auto mean = local_aligned(mean_arg, mesh, input.sizes().vec(), l.spec->placements, l.spec->dim_extents());
  auto rstd = local_aligned(rstd_arg, mesh, input.sizes().vec(), l.spec->placements, l.spec->dim_extents());
  auto w = local_param(weight, l, input);
  at::Tensor gi, gw, gb;
  std::vector<int64_t> lead_dims;
  for (int64_t d = 0; d < l.axis; ++d) lead_dims.push_back(d);
  if (l.norm_mesh_dims.empty()) {
    auto local_norm = x.sizes().slice(l.axis).vec();
    auto flat_shape = x.sizes().slice(0, l.axis).vec();
    std::tie(gi, gw, gb) = at::native_layer_norm_backward(
        g, x, local_norm, mean.reshape(flat_shape), rstd.reshape(flat_shape),
        w.defined() ? std::optional<at::Tensor>(w) : std::nullopt,
        bias && bias->defined() ? std::optional<at::Tensor>(local_param(bias, l, input)) : std::nullopt, mask);
    // The kernels return a contiguous input gradient, but torch.compile's tracer gives it the input's strides (a
    // permuted input: a channels-first LayerNorm, PVT, FocalNet, HuBERT): the traced graph then views it as if it
    // had those strides and fails at runtime. Contiguous makes both agree (eagerly a no-op).
    if (gi.defined()) gi = gi.contiguous();
  } else {
    const auto acc = at::isReducedFloatingType(x.scalar_type()) ? at::kFloat : x.scalar_type();
    auto xf = x.to(acc), gf = g.to(acc);
    auto xhat = (xf - mean) * rstd;
    if (mask[0]) {
      auto gw_ = w.defined() ? gf * w : gf;
      // One fused all-reduce of both sums.
      auto sums = sum_over_mesh_dims(at::stack({gw_.sum(l.norm_dims, true), (gw_ * xhat).sum(l.norm_dims, true)}),
                                  l.norm_mesh_dims, *mesh) / static_cast<double>(l.count);
      auto s1 = sums[0], s2 = sums[1];
      gi = (rstd * (gw_ - s1 - xhat * s2)).to(x.scalar_type());
    }
    if (mask[1] && w.defined()) gw = lead_dims.empty() ? gf * xhat : (gf * xhat).sum(lead_dims).to(x.scalar_type());
    if (mask[2] && bias && bias->defined()) gb = lead_dims.empty() ? gf : gf.sum(lead_dims).to(x.scalar_type());
  }
  auto grad_input = gi.defined() ? make_shard_tensor(gi, l.spec) : at::Tensor();
  // Weight and bias gradients: one all-reduce for both over the mesh dims that shard leading dims, or left pending
  // for the gradient buckets (normalized dims unsharded: the buckets take replicated sums only).
  std::vector<at::Tensor> sums{gw, gb};
  const bool pending = sum_param_grads(
      sums, l.norm_mesh_dims.empty() ? std::vector<at::Tensor>{weight.value_or(at::Tensor()), bias.value_or(at::Tensor())}
                                     : std::vector<at::Tensor>{},
      l.lead_mesh_dims, *mesh);
  gw = sums[0];
  gb = sums[1];
  return {grad_input, gw.defined() ? wrap_param_grad(gw, l, *weight, pending) : at::Tensor(),
          gb.defined() ? wrap_param_grad(gb, l, *bias, pending) : at::Tensor()};
}

} // namespace

SHARDTENSOR_RULE_FAMILY(norm) {
  dispatch::set_handler("aten::native_layer_norm", typed_handler(&layer_norm_rule));
  dispatch::set_handler("aten::native_layer_norm_backward", typed_handler(&layer_norm_backward_rule));
}

} // namespace shardtensor::ops

// ---------------------------------------------------------------------------------------------------------
// group_norm: statistics per (sample, group) over the group's channels and all spatial positions. Spatial and
// batch dims may be sharded (uneven); the channel dim too when every shard holds whole groups (each rank normalizes
// its own groups: no communication for them; the statistics and parameter gradients are sharded with the groups).
// Channel shards that split a group (extents not multiples of C / groups: GroupNorm(4, 6) over 4 ranks, a (N, C)
// input split along C) combine each group's per-rank parts: one small all-reduce of per-(sample, group) sums, one of
// the centred squares about the group means (the same in the backward); the statistics are then whole over the
// channel mesh dim (Replicate), every rank holding all groups.
namespace shardtensor::ops {
namespace {

struct GroupNormLayout {
  at::Tensor x;
  SpecPtr spec;
  std::vector<int64_t> spatial_mesh_dims; // mesh dims sharding a spatial dim (statistics are all-reduced)
  std::vector<int64_t> batch_mesh_dims;   // mesh dims sharding dim 0
  int64_t channel_mesh_dim = -1;          // the mesh dim sharding the channels, or -1
  int64_t channel_offset = 0, channels = 0, groups = 0; // this rank's channels and groups (split_groups: all G)
  int64_t per_group = 0;                                // channels per group (C / groups)
  bool split_groups = false;  // a channel shard cuts a group: groups combined over channel_mesh_dim (see above)
  at::Tensor channel_group;   // split_groups: the global group of each of this rank's channels (int64, [channels])
};

GroupNormLayout group_norm_layout(const at::Tensor& input, const MeshPtr& mesh, int64_t C, int64_t G) {
  GroupNormLayout l;
  l.x = resolve_partial(dispatch::as_shard(input, mesh));
  l.spec = shard_impl(l.x)->spec();
  l.channels = C;
  l.groups = G;
  l.per_group = C / G;
  const auto per_group = l.per_group;
  for (size_t m = 0; m < l.spec->placements.size(); ++m) {
    const auto& p = l.spec->placements[m];
    if (!p.is_shard()) continue;
    if (p.dim == 1) {
      const auto mi = static_cast<int64_t>(m);
      const auto coord = l.spec->mesh->coordinate(mi);
      l.channel_mesh_dim = mi;
      l.channel_offset = l.spec->offset_of(mi, coord);
      l.channels = l.spec->extents[m][coord];
      for (auto e : l.spec->extents[m]) l.split_groups = l.split_groups || e % per_group != 0;
      if (l.split_groups) {
        l.channel_group = at::arange(l.channel_offset, l.channel_offset + l.channels, at::kLong)
                              .div(per_group, "floor").to(input.device());
      } else {
        l.groups = l.channels / per_group;
      }
      continue;
    }
    (p.dim == 0 ? l.batch_mesh_dims : l.spatial_mesh_dims).push_back(static_cast<int64_t>(m));
  }
  return l;
}

// [N, G] statistics: batch shards kept, channel shards as shards of the groups.
at::Tensor wrap_group_stats(const at::Tensor& local, const GroupNormLayout& l, int64_t n, int64_t g) {
  Placements p(l.spec->mesh->ndim(), Placement::replicate());
  DimExtents ext;
  for (auto m : l.batch_mesh_dims) {
    p[m] = Placement::shard(0);
    ext[0] = l.spec->extents[m];
  }
  if (l.channel_mesh_dim >= 0 && !l.split_groups) {
    p[l.channel_mesh_dim] = Placement::shard(1);
    for (auto e : l.spec->extents[l.channel_mesh_dim]) ext[1].push_back(e / l.per_group);
  }
  return wrap(local, l.spec->mesh, p, {n, g}, ext);
}

// Per (sample, channel) values of this rank's channels from per-(sample, group) [n, G, 1] values: the groups are
// consecutive runs of per_group channels, or (split_groups) looked up by each channel's global group.
at::Tensor group_to_channels(const at::Tensor& ng1, const GroupNormLayout& l, int64_t n) {
  if (l.split_groups) return ng1.reshape({n, l.groups}).index_select(1, l.channel_group);
  return ng1.expand({n, l.groups, l.per_group}).reshape({n, l.groups * l.per_group});
}

// Per (sample, group) sums [n, G, 1] of per-(sample, channel) values [n, channels] of this rank's channels.
at::Tensor channels_to_groups(const at::Tensor& nc, const GroupNormLayout& l, int64_t n) {
  if (l.split_groups)
    return at::zeros({n, l.groups}, nc.options()).index_add_(1, l.channel_group, nc).reshape({n, l.groups, 1});
  return nc.reshape({n, l.groups, l.per_group}).sum(2, true);
}

// The mesh dims a per-(sample, group) sum is completed over: the spatial ones, and the channel one when it cuts
// groups.
std::vector<int64_t> group_sum_mesh_dims(const GroupNormLayout& l) {
  auto dims = l.spatial_mesh_dims;
  if (l.split_groups) dims.push_back(l.channel_mesh_dim);
  return dims;
}

// split_groups: per-(sample, group) mean and biased variance [n, G, 1] of every group, this rank's parts combined
// with the other ranks' over the channel and spatial mesh dims: the group sums, then the centred
// squares about the group means (each channel's own centred squares plus its count times its mean's distance from
// the group's, Chan's combination: no cancellation of large sums of squares).
std::pair<at::Tensor, at::Tensor> split_group_moments(const at::Tensor& xa, const GroupNormLayout& l, int64_t n,
                                                      double count, const Mesh& mesh) {
  const auto positions = n * l.channels == 0 ? 0 : xa.numel() / (n * l.channels);
  // each channel's own mean and centred squares over this rank's positions, in one pass (a Welford reduction: no
  // temporary of the activation's size); none without positions
  auto channel_mean = at::zeros({n, l.channels}, xa.options()), channel_m2 = at::zeros_like(channel_mean);
  if (positions > 0) {
    auto [var, m] = at::var_mean(xa.reshape({n, l.channels, positions}), {2}, /*correction=*/0, /*keepdim=*/false);
    channel_mean = m;
    channel_m2 = var * static_cast<double>(positions);
  }
  auto dims = group_sum_mesh_dims(l);
  auto mean = sum_over_mesh_dims(channels_to_groups(channel_mean * static_cast<double>(positions), l, n), dims, mesh) /
              count;
  auto offset = channel_mean - group_to_channels(mean, l, n);
  auto m2 = sum_over_mesh_dims(channels_to_groups(channel_m2 + offset * offset * static_cast<double>(positions), l, n),
                               dims, mesh);
  return {mean, m2 / count};
}

// This rank's channels of a per-channel parameter (plain or replicated), in `dtype`.
at::Tensor local_channels(const at::Tensor& t, const GroupNormLayout& l, const MeshPtr& mesh, at::ScalarType dtype) {
  auto v = shard_impl(resolve_partial(dispatch::as_shard(t, mesh)))->local().to(dtype);
  return l.channel_mesh_dim >= 0 ? v.narrow(0, l.channel_offset, l.channels) : v;
}

// [n, C] as [n, C, 1, ...] against an ndim-d activation.
at::Tensor against(const at::Tensor& nc, int64_t ndim) {
  auto shape = nc.sizes().vec();
  shape.resize(ndim, 1);
  return nc.view(shape);
}

// Both rules keep at most one activation-sized temporary (the result): out = x * scale + shift and
// grad_input = grad * a + x * b + c with per-(sample, channel) coefficients, and the backward's sums over positions
// come from per-channel dot products, never a centred, normalised or product copy of the activation (those held
// two to four extra activations at the peak of a U-Net training step).
// native_group_norm(Tensor input, Tensor? weight, Tensor? bias, SymInt N, SymInt C, SymInt HxW, int group,
//                   float eps) -> (out, mean, rstd)
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_rule(const at::Tensor& input,
                                                               const std::optional<at::Tensor>& weight,
                                                               const std::optional<at::Tensor>& bias, c10::SymInt N_arg,
                                                               c10::SymInt C_arg, c10::SymInt HxW_arg, int64_t G,
                                                               double eps) {
  auto mesh = dispatch::common_mesh("aten::native_group_norm",
                                    {input, weight.value_or(at::Tensor()), bias.value_or(at::Tensor())});
  const auto N = concrete_int(N_arg), C_all = concrete_int(C_arg), G_all = G;
  auto l = group_norm_layout(input, mesh, C_all, G_all);
  const auto C = l.channels;  // this rank's channels and groups (all of them unless the channels are sharded)
  G = l.groups;
  const auto& x = shard_impl(l.x)->local();
  const auto acc = at::isReducedFloatingType(x.scalar_type()) ? at::kFloat : x.scalar_type();
  const auto n_local = x.size(0);
  at::Tensor mean, var;
  if (l.split_groups) {
    const double count = static_cast<double>(l.per_group) * static_cast<double>(concrete_int(HxW_arg));
    std::tie(mean, var) = split_group_moments(x.to(acc), l, n_local, count, *mesh);
  } else {
    // Moments over the group's channels and every spatial position: view as [n, G, C/G, spatial...].
    auto shape = std::vector<int64_t>{n_local, G, l.per_group};
    for (int64_t d = 2; d < x.dim(); ++d) shape.push_back(x.size(d));
    std::vector<int64_t> dims;
    for (int64_t d = 2; d < static_cast<int64_t>(shape.size()); ++d) dims.push_back(d);
    std::vector<ShardedDim> sharded;
    for (auto m : l.spatial_mesh_dims) sharded.push_back({m, l.spec->placements[m].dim + 1, l.spec->extents[m]});
    auto mom = global_moments(x.to(acc).reshape(shape), dims, sharded, *mesh);
    mean = mom.mean.reshape({n_local, G, 1});
    var = mom.m2.reshape({n_local, G, 1}) / mom.count;
  }
  auto rstd = (var + eps).rsqrt();
  auto scale = group_to_channels(rstd, l, n_local);
  if (weight && weight->defined()) scale = scale * local_channels(*weight, l, mesh, acc).view({1, C});
  auto shift = -group_to_channels(mean, l, n_local) * scale;
  if (bias && bias->defined()) shift = shift + local_channels(*bias, l, mesh, acc).view({1, C});
  auto out = at::addcmul(against(shift, x.dim()), x.to(acc), against(scale, x.dim()));  // one pass, one buffer
  return {make_shard_tensor(out.to(x.scalar_type()), l.spec),
          wrap_group_stats(mean.reshape({n_local, G}).to(x.scalar_type()), l, N, G_all),
          wrap_group_stats(rstd.reshape({n_local, G}).to(x.scalar_type()), l, N, G_all)};
}

// native_group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, SymInt N,
//                            SymInt C, SymInt HxW, int group, bool[3] output_mask)
//   -> (grad_input, grad_weight, grad_bias)
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_rule(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean_arg, const at::Tensor& rstd_arg,
    const std::optional<at::Tensor>& weight, c10::SymInt N_arg, c10::SymInt C_arg, c10::SymInt HxW_arg, int64_t G,
    std::array<bool, 3> mask) {
  auto mesh = dispatch::common_mesh("aten::native_group_norm_backward",
                                    {grad_out, input, mean_arg, rstd_arg, weight.value_or(at::Tensor())});
  const auto N = concrete_int(N_arg), C_all = concrete_int(C_arg), HxW = concrete_int(HxW_arg), G_all = G;
  auto l = group_norm_layout(input, mesh, C_all, G_all);
  const auto C = l.channels;  // this rank's channels and groups
  G = l.groups;
  const auto& x = shard_impl(l.x)->local();
  const auto acc = at::isReducedFloatingType(x.scalar_type()) ? at::kFloat : x.scalar_type();
  const auto n_local = x.size(0);
  auto g = local_aligned(resolve_partial(grad_out), mesh, input.sizes(), l.spec->placements,
                         l.spec->dim_extents()).to(acc);
  auto stats_layout = shard_impl(wrap_group_stats(at::zeros({n_local, G}), l, N, G_all))->spec();
  auto mean = local_as(mean_arg, mesh, stats_layout->placements, stats_layout->dim_extents()).to(acc).reshape({n_local, G, 1});
  auto rstd = local_as(rstd_arg, mesh, stats_layout->placements, stats_layout->dim_extents()).to(acc).reshape({n_local, G, 1});
  auto xa = x.to(acc);
  // Per (sample, channel) over this rank's positions: sum of grad, and sum of grad * x as a batched dot product.
  const auto positions = n_local * C == 0 ? 0 : xa.numel() / (n_local * C);
  auto g3 = g.reshape({n_local * C, 1, positions});
  auto gs = g3.sum(2).reshape({n_local, C});
  auto gx = at::bmm(g3, xa.reshape({n_local * C, positions, 1})).reshape({n_local, C});
  at::Tensor w;
  if (weight && weight->defined()) w = local_channels(*weight, l, mesh, acc).view({1, C});
  auto mean_c = group_to_channels(mean, l, n_local), rstd_c = group_to_channels(rstd, l, n_local);
  at::Tensor gi, gw, gb;
  if (mask[0]) {
    // Per (sample, group): sum of grad*w and of grad*w*xhat, where xhat = (x - mean) * rstd; one fused all-reduce.
    auto gws = channels_to_groups(w.defined() ? gs * w : gs, l, n_local);
    auto gwx = channels_to_groups(w.defined() ? gx * w : gx, l, n_local);
    auto sums = sum_over_mesh_dims(at::cat({gws, rstd * (gwx - mean * gws)}, 2), group_sum_mesh_dims(l), *mesh);
    const double count = static_cast<double>(l.per_group) * static_cast<double>(HxW);
    auto s1 = sums.narrow(2, 0, 1) / count, s2 = sums.narrow(2, 1, 1) / count;
    // grad_input = rstd * (grad*w - s1 - xhat*s2) = grad * a + x * b + c.
    auto a = w.defined() ? rstd_c * w : rstd_c;
    auto b = group_to_channels(-rstd * rstd * s2, l, n_local);
    auto c = group_to_channels(rstd * rstd * s2 * mean - rstd * s1, l, n_local);
    gi = g * against(a, x.dim());
    gi.addcmul_(xa, against(b, x.dim()));
    gi.add_(against(c, x.dim()));
    gi = gi.to(x.scalar_type());
  }
  // Weight and bias gradients, complete after one fused all-reduce over every sharding mesh dim:
  // sum of grad * xhat per channel = sum over samples of rstd * (sum grad*x - mean * sum grad).
  std::vector<int64_t> reduce_dims = l.spatial_mesh_dims;
  reduce_dims.insert(reduce_dims.end(), l.batch_mesh_dims.begin(), l.batch_mesh_dims.end());
  // Or left pending for the gradient buckets (sum_param_grads); the bias is no argument here and follows the weight.
  std::vector<at::Tensor> sums{mask[1] && w.defined() ? (rstd_c * (gx - mean_c * gs)).sum(0) : at::Tensor(),
                               mask[2] ? gs.sum(0) : at::Tensor()};
  const auto w_arg = mask[1] && weight && l.channel_mesh_dim < 0 ? *weight : at::Tensor();  // as convolutions do
  const bool pending = sum_param_grads(sums, {w_arg, w_arg}, reduce_dims, *mesh);
  Placements param_placements(mesh->ndim(), Placement::replicate());
  if (pending)
    for (auto m : reduce_dims) param_placements[m] = Placement::partial();
  DimExtents param_ext;
  if (l.channel_mesh_dim >= 0) {  // sharded with the channels
    param_placements[l.channel_mesh_dim] = Placement::shard(0);
    param_ext[0] = l.spec->extents[l.channel_mesh_dim];
  }
  auto wrap_param = [&](const at::Tensor& local) {
    return wrap(local.to(x.scalar_type()), mesh, param_placements, {C_all}, param_ext);
  };
  if (sums[0].defined()) gw = wrap_param(sums[0]);
  if (sums[1].defined()) gb = wrap_param(sums[1]);
  return {gi.defined() ? make_shard_tensor(gi, l.spec) : at::Tensor(), gw, gb};
}

} // namespace

SHARDTENSOR_RULE_FAMILY(group_norm) {
  dispatch::set_handler("aten::native_group_norm", typed_handler(&group_norm_rule));
  dispatch::set_handler("aten::native_group_norm_backward", typed_handler(&group_norm_backward_rule));
}

} // namespace shardtensor::ops
