// grid_sample (grid_sampler_2d/3d and their backward) with the batch dim the only sharded dim (RAFT's flow
// warping of a batch-sharded pair): every output point samples its own batch element's input, so the op is local.
// A grid plain or replicated along the batch is sliced to the input's batch extents; an input replicated along
// the batch follows a batch-sharded grid. Any spatial shard of the input or the grid declines: the op then runs
// through the gather fallback (each rank gathers the whole input and grid; see docs/supported-ops.md).
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// The batch layout shared by input and grid: every placement Shard(0) or Replicate (Partial completed first);
// nullopt when some other dim is sharded.
struct BatchLayout {
  MeshPtr mesh;
  Placements placements;
  DimExtents extents;
};

std::optional<BatchLayout> batch_layout(const at::Tensor& input, const at::Tensor& grid) {
  auto mesh = dispatch::common_mesh("aten::grid_sampler", {input, grid});
  BatchLayout l{mesh, Placements(mesh->ndim(), Placement::replicate()), {}};
  for (const auto* t : {&input, &grid}) {
    auto* impl = shard_impl(*t);
    if (!impl) continue;
    const auto& spec = *impl->spec();
    for (size_t m = 0; m < spec.placements.size(); ++m) {
      const auto& p = spec.placements[m];
      if (!p.is_shard()) continue;
      if (p.dim != 0) return std::nullopt;
      if (l.placements[m].is_shard()) continue; // the first sharded argument sets the extents
      l.placements[m] = p;
      l.extents[0] = spec.extents[m];
    }
  }
  return l;
}

at::Tensor local_of(const at::Tensor& t, const BatchLayout& l) {
  return local_as(resolve_partial(t), l.mesh, l.placements, l.extents);
}

// A local result as a ShardTensor of global batch size `batch`, laid out like the batch.
at::Tensor wrap_batch(const at::Tensor& local, const BatchLayout& l, int64_t batch) {
  if (!local.defined()) return local;
  auto shape = local.sizes().vec();
  shape[0] = batch;
  return wrap(local, l.mesh, l.placements, shape, l.extents);
}

template <bool ThreeD>
at::Tensor grid_sampler_rule(const at::Tensor& input, const at::Tensor& grid, int64_t interpolation_mode,
                             int64_t padding_mode, bool align_corners) {
  auto l = batch_layout(input, grid);
  if (!l) not_implemented("the input or the grid is sharded along a dim other than the batch");
  auto x = local_of(input, *l), g = local_of(grid, *l);
  auto out = ThreeD ? at::grid_sampler_3d(x, g, interpolation_mode, padding_mode, align_corners)
                    : at::grid_sampler_2d(x, g, interpolation_mode, padding_mode, align_corners);
  return wrap_batch(out, *l, input.size(0));
}

template <bool ThreeD>
std::tuple<at::Tensor, at::Tensor> grid_sampler_backward_rule(const at::Tensor& grad_output, const at::Tensor& input,
                                                              const at::Tensor& grid, int64_t interpolation_mode,
                                                              int64_t padding_mode, bool align_corners,
                                                              std::array<bool, 2> output_mask) {
  auto l = batch_layout(input, grid);
  if (!l) not_implemented("the input or the grid is sharded along a dim other than the batch");
  auto go = local_of(shard_impl(grad_output) ? grad_output : dispatch::as_shard(grad_output, l->mesh), *l);
  auto x = local_of(input, *l), g = local_of(grid, *l);
  auto [gi, gg] = ThreeD ? at::grid_sampler_3d_backward(go, x, g, interpolation_mode, padding_mode, align_corners,
                                                         output_mask)
                         : at::grid_sampler_2d_backward(go, x, g, interpolation_mode, padding_mode, align_corners,
                                                         output_mask);
  return {wrap_batch(gi, *l, input.size(0)), wrap_batch(gg, *l, grid.size(0))};
}

} // namespace

SHARDTENSOR_RULE_FAMILY(grid_sample) {
  dispatch::set_handler("aten::grid_sampler_2d", typed_handler(&grid_sampler_rule<false>));
  dispatch::set_handler("aten::grid_sampler_3d", typed_handler(&grid_sampler_rule<true>));
  dispatch::set_handler("aten::grid_sampler_2d_backward", typed_handler(&grid_sampler_backward_rule<false>));
  dispatch::set_handler("aten::grid_sampler_3d_backward", typed_handler(&grid_sampler_backward_rule<true>));
}

} // namespace shardtensor::ops
