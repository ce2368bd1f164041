// Ops along one dim: softmax / log_softmax and their backward ops. Over an unsharded dim they are local; over a
// sharded dim they use the global max and the global sum of exponentials (two small all-reduces), and the backward a
// global sum of grad*output. glu and its backward: local along an unsharded dim (each rank's rows hold both halves);
// along a sharded dim the halves lie on different ranks, which the rule refuses (the fallback, or redistribute).
#include "comm/collectives.h"
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// All-reduce `t` over the mesh dims of `spec` that shard `dim`.
at::Tensor reduce_over(at::Tensor t, const ShardSpec& spec, int64_t dim, ReduceOp op) {
  auto m = spec.mesh_dim_of(dim);
  return m < 0 ? t : comm::all_reduce(t, op, *spec.mesh, m);
}

// softmax (or, with `log`, log_softmax) of `self_arg` along `dim_arg`.
at::Tensor softmax_along(const at::Tensor& self_arg, int64_t dim_arg, bool half_to_float, bool log) {
  auto self = resolve_partial(self_arg);
  const auto dim = wrap_dim(dim_arg, std::max<int64_t>(self.dim(), 1));
  auto spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  at::Tensor out;
  if (spec->mesh_dim_of(dim) < 0) {
    out = log ? at::_log_softmax(x, dim, half_to_float) : at::_softmax(x, dim, half_to_float);
  } else {
    // The local kernel refuses integral inputs; the sharded formula below (exp promotes) would not, so refuse as it.
    TORCH_CHECK_NOT_IMPLEMENTED(at::isFloatingType(x.scalar_type()), "\"", log ? "log_softmax" : "softmax",
                                "_lastdim_kernel_impl\" not implemented for '", c10::toString(x.scalar_type()), "'");
    auto xf = half_to_float ? x.to(at::kFloat) : x;
    at::Tensor local_max;
    if (x.size(dim) == 0) {
      auto shape = xf.sizes().vec();
      shape[dim] = 1;
      local_max = at::full(shape, -std::numeric_limits<double>::infinity(), xf.options());
    } else {
      local_max = xf.amax(dim, true);
    }
    auto gmax = reduce_over(local_max, *spec, dim, ReduceOp::Max);
    auto shifted = xf - gmax;
    auto gsum = reduce_over(shifted.exp().sum(dim, true), *spec, dim, ReduceOp::Sum);
    out = log ? shifted - gsum.log() : shifted.exp() / gsum;
  }
  return make_shard_tensor(out, ShardSpec::make(spec->mesh, spec->placements, spec->global_shape,
                                                spec->sharding_shapes()));
}

// _softmax(Tensor self, int dim, bool half_to_float)
at::Tensor softmax_rule(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return softmax_along(self, dim, half_to_float, /*log=*/false);
}

// _log_softmax(Tensor self, int dim, bool half_to_float)
at::Tensor log_softmax_rule(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return softmax_along(self, dim, half_to_float, /*log=*/true);
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
    auto s = reduce_over(g.sum(dim, true), *spec, dim, ReduceOp::Sum);
    gin = (g - y.exp() * s).to(input_dtype);
  } else {
    auto s = reduce_over((g * y).sum(dim, true), *spec, dim, ReduceOp::Sum);
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
  dispatch::set_handler("aten::_softmax_backward_data", typed_handler(&softmax_backward_rule));
  dispatch::set_handler("aten::_log_softmax_backward_data", typed_handler(&log_softmax_backward_rule));
}

} // namespace shardtensor::ops
