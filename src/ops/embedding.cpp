// embedding with sharded indices and a replicated table: a local lookup. Its backward gives each rank the
// table gradient of its own indices: a Partial(sum) over the mesh dims that shard the indices.
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

using dispatch::op_args;

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
void embedding_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto weight = args[0].toTensor();
  auto indices = args[1].toTensor();
  auto mesh = dispatch::common_mesh(op, stack);
  auto* wi = shard_impl(weight);
  if (wi && !without_partial(wi->spec())->all_replicate()) {
    dispatch::not_implemented(op, stack, "the embedding table must be replicated");
  }
  auto w_local = wi ? shard_impl(resolve_partial(weight))->local() : weight;
  auto idx = dispatch::as_shard(resolve_partial(dispatch::as_shard(indices, mesh)), mesh);
  auto ispec = shard_impl(idx)->spec();
  auto out = at::embedding(w_local, shard_impl(idx)->local(), args[2].toInt(), args[3].toBool(), args[4].toBool());
  auto shape = indices.sizes().vec();
  shape.push_back(weight.size(1));
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, wrap(out, mesh, ispec->placements, shape, ispec->dim_extents()));
}

// embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
void embedding_backward_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto mesh = dispatch::common_mesh(op, stack);
  auto indices = resolve_partial(dispatch::as_shard(args[1].toTensor(), mesh));
  auto ispec = shard_impl(indices)->spec();
  const bool scale = args[4].toBool();
  if (scale && ispec->has_shard()) {
    dispatch::not_implemented(op, stack, "scale_grad_by_freq needs global index counts");
  }
  auto g_shape = args[0].toTensor().sizes();
  auto g = local_aligned(resolve_partial(args[0].toTensor()), mesh, g_shape, ispec->placements, ispec->dim_extents());
  const auto num_weights = args[2].toInt();
  auto out = at::embedding_dense_backward(g, shard_impl(indices)->local(), num_weights, args[3].toInt(), scale);
  Placements placements(mesh->ndim(), Placement::replicate());
  for (size_t m = 0; m < placements.size(); ++m)
    if (ispec->placements[m].is_shard()) placements[m] = Placement::partial(ReduceOp::Sum);
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, wrap(out, mesh, placements, {num_weights, g_shape.back()}, {}));
}

} // namespace

void register_embedding() {
  dispatch::set_handler("aten::embedding", embedding_handler);
  dispatch::set_handler("aten::embedding_dense_backward", embedding_backward_handler);
}

} // namespace shardtensor::ops
