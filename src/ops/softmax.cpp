// softmax / log_softmax and their backward ops. Over an unsharded dim they are local; over a sharded dim they
// use the global max and the global sum of exponentials (two small all-reduces), and the backward a global
// sum of grad*output.
#include "comm/collectives.h"
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

using dispatch::op_args;

// All-reduce `t` over the mesh dims of `spec` that shard `dim`.
at::Tensor reduce_over(at::Tensor t, const ShardSpec& spec, int64_t dim, ReduceOp op) {
  auto m = spec.mesh_dim_of(dim);
  return m < 0 ? t : comm::all_reduce(t, op, *spec.mesh, m);
}

// _softmax(self, dim, half_to_float) / _log_softmax
void softmax_handler(bool log, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto self = resolve_partial(args[0].toTensor());
  const auto dim = wrap_dim(args[1].toInt(), std::max<int64_t>(self.dim(), 1));
  const bool half_to_float = args[2].toBool();
  auto spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  at::Tensor out;
  if (spec->mesh_dim_of(dim) < 0) {
    out = log ? at::_log_softmax(x, dim, half_to_float) : at::_softmax(x, dim, half_to_float);
  } else {
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
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, make_shard_tensor(out, ShardSpec::make(spec->mesh, spec->placements, spec->global_shape,
                                                                  spec->sharding_shapes())));
}

// _softmax_backward_data(grad_output, output, dim, input_dtype) / _log_softmax_backward_data
void softmax_backward_handler(bool log, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto output = resolve_partial(args[1].toTensor());
  auto mesh = dispatch::common_mesh(op, stack);
  auto spec = shard_impl(output)->spec();
  auto g = local_aligned(resolve_partial(args[0].toTensor()), mesh, output.sizes(), spec->placements, spec->dim_extents());
  const auto dim = wrap_dim(args[2].toInt(), std::max<int64_t>(output.dim(), 1));
  const auto input_dtype = static_cast<at::ScalarType>(args[3].toInt());
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
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, make_shard_tensor(gin, spec));
}

} // namespace

void register_softmax() {
  dispatch::set_handler("aten::_softmax", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { softmax_handler(false, op, s); });
  dispatch::set_handler("aten::_log_softmax", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { softmax_handler(true, op, s); });
  dispatch::set_handler("aten::_softmax_backward_data",
                        [](const c10::OperatorHandle& op, torch::jit::Stack* s) { softmax_backward_handler(false, op, s); });
  dispatch::set_handler("aten::_log_softmax_backward_data",
                        [](const c10::OperatorHandle& op, torch::jit::Stack* s) { softmax_backward_handler(true, op, s); });
}

} // namespace shardtensor::ops
