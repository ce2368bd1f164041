// linalg_cross (torch.cross, torch.linalg.cross): the 3-vector cross product along one dim, batched and broadcast
// over the others. Sharded batch dims stay sharded and each rank crosses its own vectors, no communication; a
// sharded vector dim (its 3 components on different ranks) moves to the largest free batch dim first (one all-to-all
// per operand), or, with none as large as the mesh dim, is declined: the fallback, or NotImplementedError in strict
// mode.
#include "ops/arg_checks.h"
#include "ops/common.h"

#include <ATen/ExpandUtils.h>

namespace shardtensor::ops {

namespace {

// linalg_cross(Tensor self, Tensor other, *, int dim=-1)
at::Tensor linalg_cross_rule(const at::Tensor& self_in, const at::Tensor& other_in, int64_t dim) {
  check_cross_args(self_in, other_in, dim);
  auto mesh = dispatch::common_mesh("aten::linalg_cross", {self_in, other_in});
  const auto out_shape = at::infer_size(self_in.sizes(), other_in.sizes());
  const auto nd = static_cast<int64_t>(out_shape.size());
  const auto cross_dim = wrap_dim(dim, nd);
  // The layout: per mesh dim, the first operand's shard of a dim that is not broadcast.
  Placements target(static_cast<size_t>(mesh->ndim()), Placement::replicate());
  DimExtents ext;
  for (size_t m = 0; m < target.size(); ++m) {
    for (const auto* t : {&self_in, &other_in}) {
      auto* impl = shard_impl(*t);
      if (!impl) continue;
      const auto& p = impl->spec()->placements[m];
      if (!p.is_shard() || t->size(p.dim) != out_shape[p.dim] || ext.count(p.dim)) continue;
      if (p.dim == cross_dim) {
        // The vector dim split (its 3 components on different ranks): the split moves to the largest batch dim that
        // is free and as large as the mesh dim (the operands re-laid out there: one all-to-all each).
        const auto P = mesh->size(static_cast<int64_t>(m));
        const auto other =
            largest_dim_for_split(out_shape, P, [&](int64_t d) { return d != cross_dim && !ext.count(d); });
        if (other < 0)
          dispatch::not_implemented("the vector dim (dim " + std::to_string(cross_dim) +
                                    ") is sharded and no batch dim as large as the mesh dim can take the split: its "
                                    "3 components lie on different ranks; redistribute that dim to Replicate() first");
        target[m] = Placement::shard(other);
        ext[other] = default_split(out_shape[other], P);
        break;
      }
      target[m] = Placement::shard(p.dim);
      ext[p.dim] = impl->spec()->extents[m];
      break;
    }
  }
  auto a = local_aligned(resolve_partial(self_in), mesh, out_shape, target, ext);
  auto b = local_aligned(resolve_partial(other_in), mesh, out_shape, target, ext);
  return wrap(at::linalg_cross(a, b, cross_dim), mesh, target, out_shape, ext);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(cross) {
  dispatch::set_handler("aten::linalg_cross", typed_handler(&linalg_cross_rule));
}

} // namespace shardtensor::ops
