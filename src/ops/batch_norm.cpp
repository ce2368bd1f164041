// batch_norm, bound above autograd on both shard keys: on one device PyTorch picks cudnn or native kernels by
// `input.is_cuda()`, which would run on the wrapper. Training statistics are reduced over every sharded
// non-channel dim (two small all-reduces forward, one fused all-reduce backward); running statistics are
// updated from the global statistics, so they are identical on every rank and equal to single-device ones.
// A sharded channel dim is local (channels are independent); its statistics are gathered for the buffers.
#include "comm/collectives.h"
#include "ops/arg_checks.h"
#include "dispatch/promote.h"
#include "ops/common.h"
#include "ops/moments.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>
#include <ATen/ops/batch_norm_native.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct BnLayout {
  SpecPtr spec;
  std::vector<int64_t> reduce_mesh_dims; // shard a non-channel dim
  int64_t channel_mesh_dim = -1;
  std::vector<int64_t> reduce_dims;      // every dim but 1
  double count = 1;                      // global elements per channel
};

BnLayout bn_layout(const at::Tensor& x) {
  BnLayout l;
  l.spec = shard_impl(x)->spec();
  for (size_t m = 0; m < l.spec->placements.size(); ++m) {
    const auto& p = l.spec->placements[m];
    if (!p.is_shard()) continue;
    if (p.dim == 1) l.channel_mesh_dim = static_cast<int64_t>(m);
    else l.reduce_mesh_dims.push_back(static_cast<int64_t>(m));
  }
  for (int64_t d = 0; d < x.dim(); ++d)
    if (d != 1) {
      l.reduce_dims.push_back(d);
      l.count *= static_cast<double>(x.size(d));
    }
  return l;
}

at::Tensor sum_over(at::Tensor t, const BnLayout& l) {
  return sum_over_mesh_dims(std::move(t), l.reduce_mesh_dims, *l.spec->mesh);
}

// A per-channel plain tensor restricted to this rank's channels.
at::Tensor local_channels(const at::Tensor& t, const BnLayout& l) {
  if (!t.defined()) return t;
  // A ShardTensor parameter or statistic (Replicate as modules hold them; a split one is gathered: C values).
  auto plain = whole_value(t);
  if (l.channel_mesh_dim < 0) return plain;
  const auto m = l.channel_mesh_dim;
  return plain.narrow(0, l.spec->offset_of(m, l.spec->mesh->coordinate(m)), l.spec->extents[m][l.spec->mesh->coordinate(m)]);
}

// The full per-channel vector from this rank's channels.
at::Tensor all_channels(const at::Tensor& local, const BnLayout& l) {
  if (l.channel_mesh_dim < 0) return local;
  return comm::all_gather_v(local, 0, l.spec->extents[l.channel_mesh_dim], *l.spec->mesh, l.channel_mesh_dim);
}

// A parameter gradient in the parameter's own kind and layout (plain, or a ShardTensor laid out like it).
at::Tensor as_param_grad(const at::Tensor& full, const at::Tensor& param) {
  auto* i = shard_impl(param);
  if (!i) return full;
  auto rep = make_shard_tensor(full, dispatch::replicate_spec(i->spec()->mesh, full.sizes()));
  const auto& spec = i->spec();
  return spec->all_replicate() || spec->has_partial() ? rep : redistribute_to(rep, spec);
}

// A plain input with ShardTensor parameters or statistics: the input is whole on every rank of their mesh.
at::Tensor input_on_mesh(const char* op, const at::Tensor& input, at::ArrayRef<at::Tensor> others) {
  if (shard_impl(input)) return input;
  const auto mesh = dispatch::common_mesh(op, others);
  // differentiable when it must be: the plain input's gradient comes back plain
  return input.requires_grad() && at::GradMode::is_enabled() ? dispatch::promote_to_replicate(input, mesh)
                                                             : dispatch::as_shard(input, mesh);
}

// The buffer itself: a plain tensor, or the local (full) tensor of a Replicate ShardTensor buffer.
at::Tensor buffer_storage(const at::Tensor& buffer) {
  auto* i = shard_impl(buffer);
  return i ? i->local() : buffer;
}

// running <- (1 - momentum) * running + momentum * stat, in the buffer's dtype (bf16 buffers then round as on one
// device).
void update_running(const at::Tensor& running, const at::Tensor& stat, double momentum) {
  buffer_storage(running).mul_(1 - momentum).add_(stat.to(running.scalar_type()), momentum);
}

// create_graph=True with batch statistics (a physics-informed loss on du/dx through a BatchNorm or InstanceNorm in
// training mode): the input's gradient and the parameters' from recorded ShardTensor ops (the statistics recomputed
// from the input, so their dependence on it is part of the graph), so a second derivative sees them. (A third
// derivative through it is exact too; torch's own batch-norm double backward is not differentiable exactly once more,
// so on one device the third derivative differs.)
// In evaluation (`eval_stats`: the running mean and 1/sqrt(var + eps) of every channel, kept at the forward) the map
// is affine per channel: the input's gradient is the output's scaled, the weight's the scaled sum of g * xhat.
variable_list batch_norm_backward_recorded(const at::Tensor& g_in, const at::Tensor& x, const at::Tensor& weight,
                                           const at::Tensor& bias, bool want_x, bool want_w, bool want_b,
                                           double eps, const at::Tensor& eval_stats = {}) {
  auto g = resolve_partial_diff(g_in);
  std::vector<int64_t> dims, cshape(x.dim(), 1);
  for (int64_t d = 0; d < x.dim(); ++d)
    if (d != 1) dims.push_back(d);
  cshape[1] = x.size(1);
  at::Tensor xhat, invstd;
  if (eval_stats.defined()) {
    invstd = eval_stats[1].to(x.scalar_type()).reshape(cshape);
    if (want_w) xhat = (x - eval_stats[0].to(x.scalar_type()).reshape(cshape)) * invstd;
  } else {
    auto xc = x - x.mean(dims, /*keepdim=*/true);
    invstd = (xc.pow(2).mean(dims, /*keepdim=*/true) + eps).rsqrt();
    xhat = xc * invstd;
  }
  variable_list out(8);
  if (want_x) {
    auto scale = weight.defined() ? invstd * weight.reshape(cshape) : invstd;
    out[0] = eval_stats.defined() ? scale * g : scale * (g - g.mean(dims, true) - xhat * (g * xhat).mean(dims, true));
  }
  if (want_w) out[1] = recorded_param_grad((g * xhat).sum(dims), weight);
  if (want_b) out[2] = recorded_param_grad(g.sum(dims), bias);
  return out;
}

// The gradients of batch norm, not recorded: `mean` and `invstd` this rank's channels' statistics in the
// accumulation dtype (batch statistics when `batch_stats`, else the running ones), `want` the input's, the weight's
// and the bias's (the bias's also without a bias tensor: a plain per-channel sum, as torch's kernels give it).
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_grads(const at::Tensor& g_shard, const at::Tensor& x_shard,
                                                                const at::Tensor& weight, const at::Tensor& bias,
                                                                const at::Tensor& mean, const at::Tensor& invstd,
                                                                bool batch_stats, std::array<bool, 3> want) {
  auto l = bn_layout(x_shard);
  const auto& x = shard_impl(x_shard)->local();
  const auto acc = at::isReducedFloatingType(x.scalar_type()) ? at::kFloat : x.scalar_type();
  auto g = local_aligned(resolve_partial(dispatch::as_shard(g_shard, l.spec->mesh)), l.spec->mesh, x_shard.sizes(),
                         l.spec->placements, l.spec->dim_extents()).to(acc);
  const auto nd = x.dim();
  auto xhat = (x.to(acc) - channel_view(mean, nd)) * channel_view(invstd, nd);
  // One fused all-reduce: per channel, sum(g) and sum(g * xhat).
  auto sums = sum_over(at::stack({g.sum(l.reduce_dims), (g * xhat).sum(l.reduce_dims)}), l);
  auto sg = sums[0], sgx = sums[1];
  auto w = local_channels(weight, l);
  auto scale = channel_view(w.defined() ? invstd * w.to(acc) : invstd, nd);
  at::Tensor gi, gw, gb;
  if (want[0]) {
    auto gl = batch_stats ? scale * (g - channel_view(sg / l.count, nd) - xhat * channel_view(sgx / l.count, nd))
                          : scale * g;
    gi = make_shard_tensor(gl.to(x.scalar_type()), l.spec);
  }
  if (want[1] && weight.defined()) gw = as_param_grad(all_channels(sgx, l).to(weight.scalar_type()), weight);
  if (want[2]) {
    const auto dtype = bias.defined() ? bias.scalar_type() : x.scalar_type();
    gb = bias.defined() ? as_param_grad(all_channels(sg, l).to(dtype), bias) : all_channels(sg, l).to(dtype);
  }
  return {gi, gw, gb};
}

// Forward returns {output, mean, invstd}: the statistics are those of this rank's channels (the internal ops
// below return them, gathered over a sharded channel dim); they carry no gradient, as on one device.
struct BatchNormFn : torch::autograd::Function<BatchNormFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                            const std::optional<at::Tensor>& running_var, bool use_batch_stats, double momentum,
                            double eps) {
    ctx->set_materialize_grads(false);
    auto x_shard = resolve_partial(input);
    auto l = bn_layout(x_shard);
    const auto& x = shard_impl(x_shard)->local();
    const auto acc = at::isReducedFloatingType(x.scalar_type()) ? at::kFloat : x.scalar_type();
    auto xf = x.to(acc);
    at::Tensor mean, invstd;
    if (use_batch_stats) {
      std::vector<ShardedDim> sharded;
      for (auto m : l.reduce_mesh_dims) sharded.push_back({m, l.spec->placements[m].dim, l.spec->extents[m]});
      auto mom = global_moments(xf, l.reduce_dims, sharded, *l.spec->mesh);
      mean = mom.mean.flatten();
      auto var = mom.m2.flatten() / l.count;
      invstd = (var + eps).rsqrt();
      // An empty batch leaves the running statistics alone, as torch's batch_norm does (its unbiased variance
      // would be 0/0).
      if (running_mean && running_mean->defined() && l.count > 0) {
        at::NoGradGuard no_grad;
        auto full_mean = all_channels(mean, l);
        auto full_var = all_channels(var, l) * (l.count / std::max(l.count - 1, 1.0));
        update_running(*running_mean, full_mean, momentum);
        update_running(*running_var, full_var, momentum);
      }
    } else {
      // Every channel's statistics, once (a few numbers, in a tensor of their own: the buffers may change before the
      // backward): this rank's channels for the forward, all of them for a recorded backward.
      auto stats = at::stack({whole_value(*running_mean).to(acc), (whole_value(*running_var).to(acc) + eps).rsqrt()});
      mean = local_channels(stats[0], l);
      invstd = local_channels(stats[1], l);
      ctx->saved_data["eval_stats"] = stats;
    }
    auto xhat = (xf - channel_view(mean, x.dim())) * channel_view(invstd, x.dim());
    auto out = xhat;
    auto w = local_channels(weight.value_or(at::Tensor()), l), b = local_channels(bias.value_or(at::Tensor()), l);
    if (w.defined()) out = out * channel_view(w.to(acc), x.dim());
    if (b.defined()) out = out + channel_view(b.to(acc), x.dim());
    ctx->save_for_backward({x_shard, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), mean, invstd});
    ctx->saved_data["batch_stats"] = use_batch_stats;
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({mean, invstd});
    return {make_shard_tensor(out.to(x.scalar_type()), l.spec), mean, invstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool recording = at::GradMode::is_enabled();  // create_graph: read before any NoGradGuard
    auto s = ctx->get_saved_variables();
    const auto& x_shard = s[0];
    const auto& weight = s[1];
    const auto& bias = s[2];
    auto mean = s[3], invstd = s[4];
    const bool batch_stats = ctx->saved_data["batch_stats"].toBool();
    variable_list out(8);
    if (!grads[0].defined()) return out;
    // (Not for a Partial input: the completed value saved in the forward has no graph back to it.)
    // In evaluation the input's gradient does not depend on it: recorded unless the weight's would need a graph
    // back to a Partial input.
    const bool want_w = weight.defined() && ctx->needs_input_grad(1);
    if (recording && (x_shard.requires_grad() || (!batch_stats && !(want_w && ctx->needs_input_grad(0)))))
      return batch_norm_backward_recorded(grads[0], x_shard, weight, bias, ctx->needs_input_grad(0), want_w,
                                          bias.defined() && ctx->needs_input_grad(2), ctx->saved_data["eps"].toDouble(),
                                          batch_stats ? at::Tensor() : ctx->saved_data["eval_stats"].toTensor());
    at::NoGradGuard no_grad;
    // Asked of the graph, not of the saved tensor: a Partial input was completed into a new tensor in forward,
    // which does not itself require grad (the gradient of the completed value is that of every pending term).
    auto [gi, gw, gb] = batch_norm_grads(grads[0], x_shard, weight, bias, mean, invstd, batch_stats,
                                         {ctx->needs_input_grad(0), weight.defined() && ctx->needs_input_grad(1),
                                          bias.defined() && ctx->needs_input_grad(2)});
    out[0] = gi, out[1] = gw, out[2] = gb;
    return once_differentiable(std::move(out), "batch_norm (BatchNorm, InstanceNorm)", recording);
  }
};

// native_batch_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor? running_mean,
//                            Tensor? running_var, Tensor? save_mean, Tensor? save_invstd, bool train, float eps,
//                            bool[3] output_mask) -> (Tensor, Tensor, Tensor)
// batch_norm_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? running_mean, Tensor? running_var,
//                     Tensor? save_mean, Tensor? save_var, bool update, float eps, bool[3] output_mask,
//                     Tensor reserve) -> (Tensor, Tensor, Tensor)
// The internal ops' own derivative formulas call these where the rules above autograd do not run: inside functorch's
// transforms (torch.func.grad, vjp, jacrev over a BatchNorm in evaluation, or in training without running
// statistics). Training uses the saved batch statistics (the forward's Replicate per-channel tensors; save_var is
// 1 / sqrt(var + eps) on every device torch runs), evaluation the running ones.
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm_backward_rule(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& save_mean, const std::optional<at::Tensor>& save_invstd, bool train, double eps,
    std::array<bool, 3> output_mask) {
  const auto w = weight.value_or(at::Tensor());
  const auto input_s = input_on_mesh("native_batch_norm_backward", input,
                                     {grad_out, w, running_mean.value_or(at::Tensor()),
                                      running_var.value_or(at::Tensor())});
  const auto l = bn_layout(input_s);
  const auto acc = at::isReducedFloatingType(input.scalar_type()) ? at::kFloat : input.scalar_type();
  auto stat = [&](const std::optional<at::Tensor>& t, const char* name) {
    TORCH_CHECK_VALUE(t && t->defined() && t->numel() > 0, "native_batch_norm_backward: ", name, " is needed");
    return local_channels(t->to(acc), l);
  };
  at::Tensor mean, invstd;
  if (train) {
    mean = stat(save_mean, "save_mean");
    invstd = stat(save_invstd, "save_invstd");
  } else {
    mean = stat(running_mean, "running_mean");
    invstd = (stat(running_var, "running_var") + eps).rsqrt();
  }
  return batch_norm_grads(grad_out, resolve_partial(input_s), w, at::Tensor(), mean, invstd, train, output_mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_rule(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& save_mean, const std::optional<at::Tensor>& save_var, bool update, double eps,
    std::array<bool, 3> output_mask, const at::Tensor& /*reserve*/) {
  return native_batch_norm_backward_rule(grad_out, input, weight, running_mean, running_var, save_mean, save_var,
                                         update, eps, output_mask);
}

// batch_norm(input, weight?, bias?, running_mean?, running_var?, training, momentum, eps, cudnn_enabled)
at::Tensor batch_norm_entry(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                            const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
                            bool cudnn_enabled) {
  if (!shard_impl(input)) {
    return at::native::batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled);
  }
  check_batch_norm_args(input, weight, bias, running_mean, running_var);
  const bool has_running = running_mean && running_mean->defined() && running_var && running_var->defined();
  TORCH_CHECK_VALUE(training || has_running, "batch_norm: evaluation needs running_mean and running_var");
  auto replicated_or_plain = [](const at::Tensor& t) {
    auto* i = shard_impl(t);
    if (!i) return true;
    for (const auto& p : i->spec()->placements)
      if (!p.is_replicate()) return false;
    return true;
  };
  TORCH_CHECK_NOT_IMPLEMENTED(!has_running || (replicated_or_plain(*running_mean) && replicated_or_plain(*running_var)),
                              "ShardTensor batch_norm: running_mean/running_var must be plain tensors (module buffers) "
                              "or Replicate ShardTensors; redistribute them to Replicate()");
  return BatchNormFn::apply(input, weight, bias, running_mean, running_var, training || !has_running, momentum, eps)[0];
}

// The internal batch-norm ops torch's decompositions and torch.compile call (native_batch_norm,
// _native_batch_norm_legit with and without running statistics, _batch_norm_with_update/_no_update): the same
// computation, with the saved per-channel statistics as outputs -- Replicate over the mesh (all channels, as on one
// device) in training, empty tensors in evaluation as torch's CPU and CUDA kernels return them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_with_stats(
    const char* op, const at::Tensor& input_arg, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps) {
  const auto input = input_on_mesh(op, input_arg, {weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                                                    running_mean.value_or(at::Tensor()), running_var.value_or(at::Tensor())});
  check_batch_norm_args(input, weight, bias, running_mean, running_var);
  // torch's kernels refuse an empty input here (only the batch_norm entry above handles one): the same error
  TORCH_CHECK(input.sym_numel() != 0, "input tensor must have at least one element, but got input_sizes = ",
              input.sym_sizes());
  const bool has_running = running_mean && running_mean->defined() && running_var && running_var->defined();
  TORCH_CHECK_VALUE(training || has_running, op, ": evaluation needs running_mean and running_var");
  auto outs = BatchNormFn::apply(input, weight, bias, running_mean, running_var, training, momentum, eps);
  // Only the sharded dims matter here, which a pending sum does not change: no second resolve (a collective).
  const auto l = bn_layout(input);
  auto stat = [&](const at::Tensor& local) {
    if (!training) return at::empty({0}, local.options().dtype(input.scalar_type()));
    auto full = all_channels(local, l).to(input.scalar_type());
    return make_shard_tensor(full, dispatch::replicate_spec(l.spec->mesh, full.sizes()));
  };
  return {outs[0], stat(outs[1]), stat(outs[2])};
}

// native_batch_norm(input, weight?, bias?, running_mean?, running_var?, training, momentum, eps)
// _native_batch_norm_legit(input, weight?, bias?, running_mean(a!), running_var(a!), training, momentum, eps)
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm_rule(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps) {
  return batch_norm_with_stats("native_batch_norm", input, weight, bias, running_mean, running_var, training,
                               momentum, eps);
}

// _native_batch_norm_legit.no_stats(input, weight?, bias?, training, momentum, eps)
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm_no_stats_rule(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    bool training, double momentum, double eps) {
  TORCH_CHECK_VALUE(training, "_native_batch_norm_legit.no_stats: evaluation needs running statistics");
  return batch_norm_with_stats("_native_batch_norm_legit", input, weight, bias, std::nullopt, std::nullopt, true,
                               momentum, eps);
}

// _batch_norm_with_update(input, weight?, bias?, running_mean(a!), running_var(a!), momentum, eps)
// _batch_norm_no_update(input, weight?, bias?, running_mean?, running_var?, momentum, eps)
// -> (output, save_mean, save_invstd, reserve): reserve is cudnn's workspace, empty elsewhere (and here).
template <bool Training>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_update_rule(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, double momentum,
    double eps) {
  auto [out, mean, invstd] = batch_norm_with_stats(Training ? "_batch_norm_with_update" : "_batch_norm_no_update",
                                                   input, weight, bias, running_mean, running_var, Training,
                                                   momentum, eps);
  auto reserve = at::empty({0}, input.options().dtype(at::kByte));
  if (auto* i = shard_impl(input)) reserve = make_shard_tensor(reserve, dispatch::replicate_spec(i->spec()->mesh, {0}));
  return {out, mean, invstd, reserve};
}

} // namespace

SHARDTENSOR_RULE_FAMILY(batch_norm) {
  dispatch::set_handler("aten::batch_norm", typed_handler(&batch_norm_entry), dispatch::RuleLevel::above_autograd);
  const auto above = dispatch::RuleLevel::above_autograd;
  dispatch::set_handler("aten::native_batch_norm", typed_handler(&native_batch_norm_rule), above);
  dispatch::set_handler("aten::_native_batch_norm_legit", typed_handler(&native_batch_norm_rule), above);
  dispatch::set_handler("aten::_native_batch_norm_legit.no_stats", typed_handler(&native_batch_norm_no_stats_rule),
                        above);
  dispatch::set_handler("aten::_batch_norm_with_update", typed_handler(&batch_norm_update_rule<true>), above);
  dispatch::set_handler("aten::_batch_norm_no_update", typed_handler(&batch_norm_update_rule<false>), above);
  dispatch::set_handler("aten::native_batch_norm_backward", typed_handler(&native_batch_norm_backward_rule));
  dispatch::set_handler("aten::batch_norm_backward", typed_handler(&batch_norm_backward_rule));
}

} // namespace shardtensor::ops
