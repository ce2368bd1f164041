// Ops along one dim: softmax / log_softmax and their backward ops. Over an unsharded dim they are local; over a
// sharded dim they use the global max and sum of exponentials (one collective of (max, sum) pairs), and the
// backward a global sum of grad*output. glu and its backward: local along an unsharded dim (each rank's rows hold both halves);
// along a sharded dim the halves lie on different ranks, which the rule refuses (the fallback, or redistribute).
#include "comm/stat_reduce.h"
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// Sum `t` over the mesh dim of `spec` that shards `dim`.
at::Tensor sum_over(at::Tensor t, const ShardSpec& spec, int64_t dim) {
  auto m = spec.mesh_dim_of(dim);
  return m < 0 ? t : sum_over_mesh_dims(std::move(t), {m}, *spec.mesh);
}

enum class Softmax { plain, log, safe };

// softmax (or log_softmax, or _safe_softmax: rows whose every element is -inf give 0, not nan) of `self_arg` along
// `dim_arg`; `dtype`: _safe_softmax's conversion of the input first.
at::Tensor softmax_along(const at::Tensor& self_arg, int64_t dim_arg, bool half_to_float, Softmax kind,
                         std::optional<at::ScalarType> dtype = std::nullopt) {
  const bool log = kind == Softmax::log;
  auto self = resolve_partial(self_arg);
  const auto dim = wrap_dim(dim_arg, std::max<int64_t>(self.dim(), 1));
  auto spec = shard_impl(self)->spec();
  const auto& local = shard_impl(self)->local();
  at::Tensor out;
  if (spec->mesh_dim_of(dim) < 0) {
    out = kind == Softmax::safe ? at::_safe_softmax(local, dim, dtype)
          : log                 ? at::_log_softmax(local, dim, half_to_float)
                                : at::_softmax(local, dim, half_to_float);
  } else {
    const auto x = dtype ? local.to(*dtype) : local;
    // The local kernel refuses integral inputs; the sharded formula below (exp promotes) would not, so refuse as it.
    TORCH_CHECK_NOT_IMPLEMENTED(at::isFloatingType(x.scalar_type()), "\"", log ? "log_softmax" : "softmax",
                                "_lastdim_kernel_impl\" not implemented for '", c10::toString(x.scalar_type()), "'");
    auto xf = half_to_float ? x.to(at::kFloat) : x;
    // Each rank's (max, sum of exp relative to it) over its rows, combined in one collective (comm/stat_reduce.h);
    // a rank without rows, or whose rows are all -inf, adds nothing.
    comm::StatReduce r;
    const auto lse = r.log_sum_exp_over(xf, {dim});
    r.run(*spec->mesh, {spec->mesh_dim_of(dim)});
    auto shifted = xf - r.result(lse)[0];
    const auto& gsum = r.result(lse)[1];
    out = log ? shifted - gsum.log() : shifted.exp() / gsum;
    if (kind == Softmax::safe)  // the global max is -inf exactly where every element of the row is
      out = at::where(r.result(lse)[0] == -std::numeric_limits<double>::infinity(), at::zeros({}, out.options()), out);
  }
  return make_shard_tensor(out, ShardSpec::make(spec->mesh, spec->placements, spec->global_shape,
                                                spec->sharding_shapes()));
}

// _softmax(Tensor self, int dim, bool half_to_float)
at::Tensor softmax_rule(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return softmax_along(self, dim, half_to_float, Softmax::plain);
}

// _safe_softmax(Tensor self, int dim, ScalarType? dtype=None): scaled_dot_product_attention's math form (a fully
// masked row gives zeros); its backward is _softmax_backward_data's.
at::Tensor safe_softmax_rule(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  return softmax_along(self, dim, /*half_to_float=*/false, Softmax::safe, dtype);
}

// _log_softmax(Tensor self, int dim, bool half_to_float)
at::Tensor log_softmax_rule(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return softmax_along(self, dim, half_to_float, Softmax::log);
}

// The input gradient of softmax (or, with `log`, log_softmax) from its output; `op_name` names the op in errors.
at::Tensor softmax_backward_along(const char* op_name, const at::Tensor& grad_output, const at::Tensor& output_arg,
                                  int64_t dim_arg, at::ScalarType input_dtype, bool log) {
  auto output = resolve_partial(output_arg);
  auto mesh = dispatch::common_mesh(op_name, {grad_output, output_arg});
  auto spec = shard_impl(output)->spec();
  auto g = local_aligned(resolve_partial(grad_output), mesh, output.sizes(), spec->placements, spec->dim_extents());
  const auto dim = wrap_dim(dim_arg, std::max<int64_t>(output.dim(), 1));
  const auto& y = shard_impl(output)->local();
  at::Tensor gin;
  if (spec->mesh_dim_of(dim) < 0) {
    gin = log ? at::_log_softmax_backward_data(g, y, dim, input_dtype) : at::_softmax_backward_data(g, y, dim, input_dtype);
  } else if (log) {
    auto s = sum_over(g.sum(dim, true), *spec, dim);
    gin = (g - y.exp() * s).to(input_dtype);
  } else {
    auto s = sum_over((g * y).sum(dim, true), *spec, dim);
    gin = (y * (g - s)).to(input_dtype);
  }
  return make_shard_tensor(gin, spec);
}

// _softmax_backward_data(Tensor grad_output, Tensor output, int dim, ScalarType input_dtype)
at::Tensor softmax_backward_rule(const at::Tensor& grad_output, const at::Tensor& output, int64_t dim,
                                 at::ScalarType input_dtype) {
  return softmax_backward_along("aten::_softmax_backward_data", grad_output, output, dim, input_dtype, /*log=*/false);
}

// _log_softmax_backward_data(Tensor grad_output, Tensor output, int dim, ScalarType input_dtype)
at::Tensor log_softmax_backward_rule(const at::Tensor& grad_output, const at::Tensor& output, int64_t dim,
                                     at::ScalarType input_dtype) {
  return softmax_backward_along("aten::_log_softmax_backward_data", grad_output, output, dim, input_dtype,
                                /*log=*/true);
}

// The layout of glu's output: `self`'s, with `dim` halved (never sharded here).
SpecPtr glu_output_spec(const ShardSpec& spec, int64_t dim) {
  auto shape = spec.global_shape;
  shape[dim] /= 2;
  return ShardSpec::make(spec.mesh, spec.placements, shape, spec.sharding_shapes());
}

int64_t glu_dim(const char* op, const at::Tensor& self, const ShardSpec& spec, int64_t dim_arg) {
  const auto dim = wrap_dim(dim_arg, self.dim());
  if (spec.mesh_dim_of(dim) >= 0)
    dispatch::not_implemented(std::string(op) + " along dim " + std::to_string(dim) + ", which is sharded (" +
                              spec.str() + "): its two halves lie on different ranks; redistribute that dim to "
                              "Replicate() first");
  return dim;
}

// glu(Tensor self, int dim=-1)
at::Tensor glu_rule(const at::Tensor& self_arg, int64_t dim_arg) {
  auto self = resolve_partial(self_arg);
  const auto& spec = *shard_impl(self)->spec();
  const auto dim = glu_dim("glu", self, spec, dim_arg);
  return make_shard_tensor(at::glu(shard_impl(self)->local(), dim), glu_output_spec(spec, dim));
}

// glu_backward(Tensor grad_output, Tensor self, int dim)
at::Tensor glu_backward_rule(const at::Tensor& grad_output, const at::Tensor& self_arg, int64_t dim_arg) {
  auto self = resolve_partial(self_arg);
  auto spec = shard_impl(self)->spec();
  const auto dim = glu_dim("glu_backward", self, *spec, dim_arg);
  auto mesh = dispatch::common_mesh("aten::glu_backward", {grad_output, self_arg});
  auto out_spec = glu_output_spec(*spec, dim);
  auto g = local_aligned(resolve_partial(grad_output), mesh, out_spec->global_shape, spec->placements,
                         spec->dim_extents());
  return make_shard_tensor(at::glu_backward(g, shard_impl(self)->local(), dim), spec);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(softmax) {
  dispatch::set_handler("aten::glu", typed_handler(&glu_rule));
  dispatch::set_handler("aten::glu_backward", typed_handler(&glu_backward_rule));
  dispatch::set_handler("aten::_softmax", typed_handler(&softmax_rule));
  dispatch::set_handler("aten::_log_softmax", typed_handler(&log_softmax_rule));
  dispatch::set_handler("aten::_safe_softmax", typed_handler(&safe_softmax_rule));
  dispatch::set_handler("aten::_softmax_backward_data", typed_handler(&softmax_backward_rule));
  dispatch::set_handler("aten::_log_softmax_backward_data", typed_handler(&log_softmax_backward_rule));
}

} // namespace shardtensor::ops
