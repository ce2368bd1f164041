// PhysicsNeMo's neighbour searches (`physicsnemo.nn.functional.radius_search` / `knn`, the ball query of
// `physicsnemo.nn.BQWarp` that DoMINO's geometry encodings use): their torch.library custom ops, bound when
// PhysicsNeMo defines them (dispatch::set_handler_when_defined; the library may be imported before or after
// shardtensor, or never).
//
// The layout these rules take is the one a domain-parallel point model runs in: the queries (volume or surface
// points) split along their rows, the searched points (a geometry grid, an STL's vertices) whole on every rank.
// Each query's neighbours then depend on that query and the whole point set only, so every rank runs PhysicsNeMo's
// own kernel on its query rows and gets exactly the rows one device computes (same neighbours in the same order:
// no communication, nothing gathered); the outputs are laid out like the queries. The gradient of the returned
// neighbour points (radius search's `apply_grad_to_points`) scatters each rank's rows into a whole-size gradient
// of the points: a pending sum over the mesh dims that split the queries.
//
// Declined (the gather fallback; strict mode: NotImplementedError): split points (a ring would return other
// neighbours than the op's hash-grid order when more than max_points lie in the radius; shardtensor.ops.radius_search
// and knn search split points exactly, nearest first), queries split along their batch or coordinates, and
// radius search without max_points (a flat list whose length each rank's queries decide).
#include "dispatch/args.h"
#include "dispatch/registry.h"
#include "dispatch/rule_family.h"
#include "ops/common.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace shardtensor::ops {

namespace {

// The queries' layout: split along their rows (dim -2) only. `placements` / `extents`: the row split alone (a
// pending sum of the queries completed, so Replicate there), what every row-laid tensor of the op takes.
struct RowLayout {
  MeshPtr mesh;
  SpecPtr spec;
  int64_t row_dim = 0;
  Placements placements;
  DimExtents extents;
};

RowLayout query_rows(const c10::OperatorHandle& op, torch::jit::Stack* stack, const at::Tensor& queries) {
  auto* q = shard_impl(queries);
  if (!q)
    dispatch::not_implemented(op, stack, "the queries are whole and the points split; split the queries along their "
                                         "rows, or search split points with shardtensor.ops.radius_search / knn");
  RowLayout rows{q->spec()->mesh, q->spec(), queries.dim() - 2};
  for (const auto& p : rows.spec->placements)
    if (p.is_shard() && p.dim != rows.row_dim)
      dispatch::not_implemented(op, stack, "the queries are split along a dim other than their rows (dim -2); "
                                           "redistribute that dim to Replicate()");
  rows.placements.assign(rows.mesh->ndim(), Placement::replicate());
  for (size_t m = 0; m < rows.placements.size(); ++m)
    if (rows.spec->placements[m].is_shard()) rows.placements[m] = rows.spec->placements[m];
  if (auto ext = rows.spec->dim_extents(); ext.count(rows.row_dim)) rows.extents[rows.row_dim] = ext.at(rows.row_dim);
  return rows;
}

// The points whole on every rank: a plain tensor, or a ShardTensor with no split (a pending sum completed).
at::Tensor whole_points(const c10::OperatorHandle& op, torch::jit::Stack* stack, const at::Tensor& points) {
  auto* p = shard_impl(points);
  if (!p) return points;
  for (const auto& pl : p->spec()->placements)
    if (pl.is_shard())
      dispatch::not_implemented(op, stack, "the searched points are split; their neighbours in the op's own "
                                           "order need every point on one rank (shardtensor.ops.radius_search and "
                                           "knn search split points exactly, nearest first)");
  return shard_impl(resolve_partial(points))->local();
}

// The local query rows of `queries`, a pending sum completed first.
at::Tensor local_rows(const at::Tensor& queries) {
  auto q = shard_impl(queries)->spec()->has_partial() ? resolve_partial(queries) : queries;
  return shard_impl(q)->local();
}

// Wrap the op's local outputs: the row-laid ones (`rows[i]`) like the queries, the rest (PhysicsNeMo's empty
// placeholders for outputs not asked for) whole. Decided from the arguments, alike on every rank.
void wrap_rows(const c10::OperatorHandle& op, torch::jit::Stack* stack, const RowLayout& layout,
               const std::vector<bool>& rows) {
  const auto nret = op.schema().returns().size();
  TORCH_INTERNAL_ASSERT(rows.size() == nret, dispatch::qualified_name(op), ": ", nret, " outputs");
  const auto global_rows = layout.spec->global_shape[layout.row_dim];
  auto it = stack->end() - static_cast<std::ptrdiff_t>(nret);
  for (size_t i = 0; i < nret; ++i, ++it) {
    const auto local = it->toTensor();
    auto shape = local.sizes().vec();
    if (!rows[i]) {
      *it = wrap(local, layout.mesh, Placements(layout.mesh->ndim(), Placement::replicate()), std::move(shape), {});
      continue;
    }
    TORCH_INTERNAL_ASSERT(local.dim() > layout.row_dim, dispatch::qualified_name(op), ": output ", i,
                          " has no query rows");
    shape[layout.row_dim] = global_rows;
    *it = wrap(local, layout.mesh, layout.placements, std::move(shape), layout.extents);
  }
}

// radius_search_warp(Tensor points, Tensor queries, float radius, SymInt? max_points, bool return_dists,
//                    bool return_points) -> (Tensor indices, Tensor points, Tensor distances, Tensor num_neighbors)
// knn_scipy / knn_cuml(Tensor points, Tensor queries, SymInt k) -> (Tensor indices, Tensor distances)
void search_rows_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto nargs = op.schema().arguments().size();
  auto first = stack->end() - static_cast<std::ptrdiff_t>(nargs);
  const bool radius = op.schema().returns().size() == 4;
  if (radius && first[3].isNone())
    dispatch::not_implemented(op, stack, "max_points=None returns one flat list whose length each rank's queries "
                                         "decide; pass max_points");
  const auto points = first[0].toTensor(), queries = first[1].toTensor();
  const auto layout = query_rows(op, stack, queries);
  (void)dispatch::common_mesh(dispatch::qualified_name(op).c_str(), {points, queries}); // one mesh, or it raises
  auto whole = whole_points(op, stack, points);
  auto local = local_rows(queries);
  const std::vector<bool> rows = radius ? std::vector<bool>{true, first[5].toBool(), first[4].toBool(), true}
                                        : std::vector<bool>{true, true};
  first[0] = whole;
  first[1] = local;
  op.callBoxed(stack);
  wrap_rows(op, stack, layout, rows);
}

// radius_search_apply_grad_to_points(Tensor indexes, Tensor num_neighbors, Tensor grad_points_out,
//                                    int[] points_shape, SymInt? max_points) -> Tensor
// Each rank scatters its query rows' gradients into a gradient of the whole points: Partial(sum) over the mesh dims
// that split the queries.
void apply_grad_rows_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto nargs = op.schema().arguments().size();
  auto first = stack->end() - static_cast<std::ptrdiff_t>(nargs);
  if (first[4].isNone())
    dispatch::not_implemented(op, stack, "max_points=None (one flat list of neighbours); pass max_points");
  const auto indexes = first[0].toTensor();
  const auto layout = query_rows(op, stack, indexes);
  // The counts and the incoming gradient laid out like the indexes (the gradient may arrive pending or whole).
  for (int i : {0, 1, 2})
    first[i] = local_in(first[i].toTensor(), layout.mesh,
                        layout.placements, layout.extents);
  const auto points_shape = first[3].toIntVector();
  op.callBoxed(stack);
  auto& out = stack->back();
  Placements pl(layout.mesh->ndim(), Placement::replicate());
  for (size_t m = 0; m < pl.size(); ++m)
    if (layout.placements[m].is_shard()) pl[m] = Placement::partial(ReduceOp::Sum);
  out = wrap(out.toTensor(), layout.mesh, std::move(pl), points_shape, {});
}

} // namespace

SHARDTENSOR_RULE_FAMILY(physicsnemo_neighbors) {
  dispatch::set_handler_when_defined("physicsnemo::radius_search_warp", &search_rows_handler);
  dispatch::set_handler_when_defined("physicsnemo::knn_scipy", &search_rows_handler);
  dispatch::set_handler_when_defined("physicsnemo::knn_cuml", &search_rows_handler);
  dispatch::set_handler_when_defined("physicsnemo::radius_search_apply_grad_to_points", &apply_grad_rows_handler);
}

} // namespace shardtensor::ops
