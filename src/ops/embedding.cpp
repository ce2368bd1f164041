// embedding with sharded indices and a replicated table: a local lookup. Its backward gives each rank the
// table gradient of its own indices: a Partial(sum) over the mesh dims that shard the indices.
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, bool sparse=False)
at::Tensor embedding_rule(const at::Tensor& weight, const at::Tensor& indices, c10::SymInt padding_idx,
                          bool scale_grad_by_freq, bool sparse) {
  auto mesh = dispatch::common_mesh("aten::embedding", {weight, indices});
  auto* wi = shard_impl(weight);
  if (wi && !without_partial(wi->spec())->all_replicate()) {
    dispatch::not_implemented("the embedding table must be replicated");
  }
  auto w_local = wi ? shard_impl(resolve_partial(weight))->local() : weight;
  auto idx = dispatch::as_shard(resolve_partial(dispatch::as_shard(indices, mesh)), mesh);
  auto ispec = shard_impl(idx)->spec();
  auto out = at::embedding(w_local, shard_impl(idx)->local(), padding_idx.expect_int(), scale_grad_by_freq, sparse);
  auto shape = indices.sizes().vec();
  shape.push_back(weight.size(1));
  return wrap(out, mesh, ispec->placements, shape, ispec->dim_extents());
}

// embedding_dense_backward(Tensor grad_output, Tensor indices, SymInt num_weights, SymInt padding_idx,
//                          bool scale_grad_by_freq)
at::Tensor embedding_backward_rule(const at::Tensor& grad_output, const at::Tensor& indices_arg,
                                   c10::SymInt num_weights_arg, c10::SymInt padding_idx, bool scale) {
  auto mesh = dispatch::common_mesh("aten::embedding_dense_backward", {grad_output, indices_arg});
  auto indices = resolve_partial(dispatch::as_shard(indices_arg, mesh));
  auto ispec = shard_impl(indices)->spec();
  if (scale && ispec->has_shard()) {
    dispatch::not_implemented("scale_grad_by_freq needs global index counts");
  }
  auto g_shape = grad_output.sizes();
  auto g = local_aligned(resolve_partial(grad_output), mesh, g_shape, ispec->placements, ispec->dim_extents());
  const auto num_weights = num_weights_arg.expect_int();
  auto out =
      at::embedding_dense_backward(g, shard_impl(indices)->local(), num_weights, padding_idx.expect_int(), scale);
  Placements placements(mesh->ndim(), Placement::replicate());
  for (size_t m = 0; m < placements.size(); ++m)
    if (ispec->placements[m].is_shard()) placements[m] = Placement::partial(ReduceOp::Sum);
  return wrap(out, mesh, placements, {num_weights, g_shape.back()}, {});
}

} // namespace

SHARDTENSOR_RULE_FAMILY(embedding) {
  dispatch::set_handler("aten::embedding", typed_handler(&embedding_rule));
  dispatch::set_handler("aten::embedding_dense_backward", typed_handler(&embedding_backward_rule));
}

} // namespace shardtensor::ops
