// In-place view ops: squeeze_, unsqueeze_, transpose_, t_ (swapdims_/swapaxes_ decompose into transpose_). torch's
// own decompositions use them on intermediate results: matmul of a 1-D vector squeezes the (Partial) product in
// place, quantile unsqueezes, transposes and squeezes its sorted values. The out-of-place view's rule gives the new
// layout and a view of the same local tensor; the ShardTensor then takes both in place (Partial and shards kept as
// the view keeps them). A view that would have to re-lay the input out first (squeezing a sharded size-1 dim)
// raises: the tensor would stop sharing its local tensor with its other views.
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

at::Tensor& take_view(at::Tensor& self, const at::Tensor& view) {
  auto* impl = shard_impl(self);
  auto* v = shard_impl(view);
  TORCH_INTERNAL_ASSERT(impl && v);
  if (!v->local().is_alias_of(impl->local()) && v->local().numel() > 0)
    not_implemented("the view would re-lay the tensor out (a sharded size-1 dim is replicated first), so the "
                    "tensor could not keep sharing its local data in place; use the out-of-place view");
  impl->set_local_and_spec(v->local(), v->spec());
  return self;
}

// squeeze_(Tensor(a!) self) -> Tensor(a!)
at::Tensor& squeeze_rule(at::Tensor& self) {
  return take_view(self, at::squeeze(self));
}

// squeeze_.dim(Tensor(a!) self, int dim) -> Tensor(a!)
at::Tensor& squeeze_dim_rule(at::Tensor& self, int64_t dim) {
  return take_view(self, at::squeeze(self, dim));
}

// squeeze_.dims(Tensor(a!) self, int[] dim) -> Tensor(a!)
at::Tensor& squeeze_dims_rule(at::Tensor& self, at::IntArrayRef dim) {
  return take_view(self, at::squeeze(self, dim));
}

// unsqueeze_(Tensor(a!) self, int dim) -> Tensor(a!)
at::Tensor& unsqueeze_rule(at::Tensor& self, int64_t dim) {
  return take_view(self, at::unsqueeze(self, dim));
}

// transpose_(Tensor(a!) self, int dim0, int dim1) -> Tensor(a!)
at::Tensor& transpose_rule(at::Tensor& self, int64_t dim0, int64_t dim1) {
  return take_view(self, at::transpose(self, dim0, dim1));
}

// t_(Tensor(a!) self) -> Tensor(a!)
at::Tensor& t_rule(at::Tensor& self) {
  return take_view(self, at::t(self));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(view_inplace) {
  dispatch::set_handler("aten::squeeze_", typed_handler(&squeeze_rule));
  dispatch::set_handler("aten::squeeze_.dim", typed_handler(&squeeze_dim_rule));
  dispatch::set_handler("aten::squeeze_.dims", typed_handler(&squeeze_dims_rule));
  dispatch::set_handler("aten::unsqueeze_", typed_handler(&unsqueeze_rule));
  dispatch::set_handler("aten::transpose_", typed_handler(&transpose_rule));
  dispatch::set_handler("aten::t_", typed_handler(&t_rule));
}

} // namespace shardtensor::ops
