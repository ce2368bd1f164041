// _trilinear: sum over `sumdim` of i1 * i2 * i3, each unsqueezed at its `expand` dims — what F.bilinear / nn.Bilinear
// run (and their backward, through _trilinear again).
//
// Every input's dims map into one index space (the dims of the unsqueezed product). A dim sharded on a mesh dim is
// read alike by every input that has it (an input without it is broadcast there, whole): a kept dim stays sharded in
// the output, a summed one leaves each rank a partial sum (Partial(sum), completed when read). Inputs whole along a
// sharded dim are cut to its extents; pending sums are completed first (the product is not linear in two of them).
// One mesh dim splitting two different dims of the index space declines (the fallback; strict mode:
// NotImplementedError).
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// The index-space dim of each of an input's dims (every dim not in `expand`, in order).
std::vector<int64_t> space_dims(int64_t total, at::IntArrayRef expand) {
  std::vector<bool> expanded(total, false);
  for (auto e : expand) expanded[wrap_dim(e, total)] = true;
  std::vector<int64_t> out;
  for (int64_t f = 0; f < total; ++f)
    if (!expanded[f]) out.push_back(f);
  return out;
}

// _trilinear(Tensor i1, Tensor i2, Tensor i3, int[] expand1, int[] expand2, int[] expand3, int[] sumdim,
//            int unroll_dim=1) -> Tensor
at::Tensor trilinear_rule(const at::Tensor& i1_in, const at::Tensor& i2_in, const at::Tensor& i3_in,
                          at::IntArrayRef expand1, at::IntArrayRef expand2, at::IntArrayRef expand3,
                          at::IntArrayRef sumdim, int64_t unroll_dim) {
  std::array<at::Tensor, 3> in{i1_in, i2_in, i3_in};
  auto mesh = dispatch::common_mesh("aten::_trilinear", {i1_in, i2_in, i3_in});
  const auto total = i1_in.dim() + static_cast<int64_t>(expand1.size());
  const std::array<std::vector<int64_t>, 3> space{space_dims(total, expand1), space_dims(total, expand2),
                                                   space_dims(total, expand3)};
  std::vector<int64_t> size(total, 1);
  for (int k = 0; k < 3; ++k) {
    in[k] = resolve_partial(dispatch::as_shard(in[k], mesh));
    // Broadcast sizes: a size-1 dim yields to any other size, 0 included (an empty batch stays empty).
    for (int64_t d = 0; d < in[k].dim(); ++d)
      if (in[k].size(d) != 1) size[space[k][d]] = in[k].size(d);
  }
  // The index-space dim each mesh dim splits, and its extents.
  std::vector<int64_t> split(mesh->ndim(), -1);
  std::map<int64_t, std::vector<int64_t>> ext;
  for (int k = 0; k < 3; ++k) {
    const auto& spec = *shard_impl(in[k])->spec();
    for (int64_t m = 0; m < mesh->ndim(); ++m) {
      const auto& p = spec.placements[m];
      if (!p.is_shard()) continue;
      const auto f = space[k][p.dim];
      if (split[m] >= 0 && split[m] != f)
        dispatch::not_implemented("one mesh dim splits two different dims of the product; redistribute one input");
      if (split[m] < 0) {
        split[m] = f;
        ext[f] = spec.extents[m];
      }
    }
  }
  std::vector<at::Tensor> locals;
  for (int k = 0; k < 3; ++k) {
    Placements pl(mesh->ndim(), Placement::replicate());
    DimExtents e;
    for (int64_t m = 0; m < mesh->ndim(); ++m) {
      if (split[m] < 0) continue;
      const auto it = std::find(space[k].begin(), space[k].end(), split[m]);
      if (it == space[k].end()) continue;
      const auto d = it - space[k].begin();
      if (in[k].size(d) == 1 && size[split[m]] != 1) continue;  // broadcast along it
      pl[m] = Placement::shard(d);
      e[d] = ext.at(split[m]);
    }
    locals.push_back(local_as(in[k], mesh, pl, e));
  }
  auto out = at::_trilinear(locals[0], locals[1], locals[2], expand1, expand2, expand3, sumdim, unroll_dim);
  // Output dims: the index space without `sumdim`.
  std::vector<bool> summed(total, false);
  for (auto s : sumdim) summed[wrap_dim(s, total)] = true;
  std::vector<int64_t> out_pos(total, -1), shape;
  for (int64_t f = 0; f < total; ++f)
    if (!summed[f]) {
      out_pos[f] = static_cast<int64_t>(shape.size());
      shape.push_back(size[f]);
    }
  Placements pl(mesh->ndim(), Placement::replicate());
  DimExtents e;
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    if (split[m] < 0) continue;
    if (summed[split[m]]) {
      pl[m] = Placement::partial(ReduceOp::Sum);
    } else {
      pl[m] = Placement::shard(out_pos[split[m]]);
      e[out_pos[split[m]]] = ext.at(split[m]);
    }
  }
  return wrap(out, mesh, pl, shape, e);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(trilinear) {
  dispatch::set_handler("aten::_trilinear", typed_handler(&trilinear_rule));
}

} // namespace shardtensor::ops
