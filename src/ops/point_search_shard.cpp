// shardtensor::knn / radius_search on ShardTensors (point clouds sharded along the point dim), bound above
// autograd on both shard keys like scaled_dot_product_attention.
//
// Layout rules (decided from specs only, so every rank issues the same collectives):
//  - Partial inputs are resolved first; plain inputs are Replicate (plain inputs that require grad are promoted).
//  - The coordinate dim (-1) may not be sharded (a spec shards each tensor dim on at most one mesh dim).
//  - Batched inputs: a mesh dim sharding the batch of either input shards both (the other is redistributed);
//    batches are then local.
//  - Points sharded along the point dim on mesh dim r: a ring over r (below). Queries keep their own layout:
//    sharded on r (each rank searches for its queries), sharded on another mesh dim, or replicated (every rank of
//    the ring computes the same rows). Points replicated: the search is local.
//  - The outputs (indices, distances) are laid out like the queries (coordinate dim -> the k neighbours).
//
// Ring (forward): at step t a rank searches its queries in the point block of coordinate (c - t) mod n (global
// offset from the spec) and merges the block's best candidates into the running top-k by (distance, global
// index); the next block is in flight meanwhile. Every rank sends n-1 point blocks.
// Backward: the point blocks travel the same ring again; dq accumulates locally, dp in a buffer that travels with
// its block and reaches the owner after the last step (queries replicated over the ring: the owner computes its
// block's dp alone at step 0). Where the queries are sharded but the points replicated, each rank holds a term of
// dp: summed over that mesh dim.
#include "comm/functional.h"
#include "comm/redistribute.h"
#include "comm/ring_loop.h"
#include "dispatch/args.h"
#include "dispatch/promote.h"
#include "ops/common.h"
#include "ops/describe.h"
#include "ops/point_search_kernels.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>

#include <limits>
#include <sstream>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using SearchResult = std::tuple<at::Tensor, at::Tensor>;

[[noreturn]] void refuse(const char* op, const at::Tensor& points, const at::Tensor& queries, const std::string& why,
                         const std::string& remedy) {
  std::ostringstream os;
  os << "ShardTensor " << op << " (points: " << describe(points) << ", queries: " << describe(queries) << "): " << why
     << ". Remedy: " << remedy;
  TORCH_CHECK_NOT_IMPLEMENTED(false, os.str());
}

at::Tensor batched(const at::Tensor& t) {
  return t.dim() == 3 ? t : t.unsqueeze(0);
}

at::Tensor unbatched(const at::Tensor& t, int64_t nd) {
  return nd == 3 ? t : t.squeeze(0);
}

std::vector<int64_t> with_last(at::IntArrayRef shape, int64_t v) {
  auto s = shape.vec();
  s.back() = v;
  return s;
}

// The ring the point blocks travel: the mesh dim sharding the points' dim (nd - 2; dim 1 of the batched blocks).
comm::Ring ring_of(const ShardSpec& ps, int64_t nd) {
  const auto ring = ps.mesh_dim_of(nd - 2);
  return ring >= 0 ? comm::Ring::along(*ps.mesh, ring, 1, ps.extents[ring]) : comm::Ring::local();
}

// The global index of the first point of coordinate `owner`'s block.
int64_t offset_of(const ShardSpec& ps, int64_t nd, int64_t owner) {
  const auto ring = ps.mesh_dim_of(nd - 2);
  return ring >= 0 ? ps.offset_of(ring, owner) : 0;
}

struct ShardSearchFn : torch::autograd::Function<ShardSearchFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& p, const at::Tensor& q, int64_t k,
                               double radius) {
    ctx->set_materialize_grads(false);
    at::NoGradGuard no_grad;
    const auto& ps = *shard_impl(p)->spec();
    const auto& qs = *shard_impl(q)->spec();
    const int64_t nd = p.dim();
    auto ql = batched(shard_impl(q)->local());
    auto idx = at::full({ql.size(0), ql.size(1), k}, -1, ql.options().dtype(at::kLong));
    auto dist = at::full({ql.size(0), ql.size(1), k}, std::numeric_limits<double>::infinity(), ql.options());
    comm::ring_loop(ring_of(ps, nd), {batched(shard_impl(p)->local())}, {},
                    [&](int64_t, int64_t owner, const auto& blocks, auto&) {
                      const auto& pb = blocks[0];
                      if (ql.size(1) == 0 || pb.size(1) == 0) return;
                      auto [bi, bd] = points::search(pb, ql, std::min<int64_t>(k, pb.size(1)), radius);
                      bi = at::where(bi >= 0, bi + offset_of(ps, nd, owner), bi);
                      std::tie(idx, dist) = points::merge(idx, dist, bi, bd, k);
                    });
    ctx->save_for_backward({p, q});
    ctx->saved_data["idx"] = idx;
    ctx->saved_data["points_grad"] = p.requires_grad();
    auto out_shape = with_last(q.sizes(), k);
    auto spec = ShardSpec::make_with_dim_extents(qs.mesh, qs.placements, out_shape, qs.dim_extents());
    auto idx_out = make_shard_tensor(unbatched(idx, nd), spec);
    auto dist_out = make_shard_tensor(unbatched(dist, nd), spec);
    ctx->mark_non_differentiable({idx_out});
    return {idx_out, dist_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool recording = at::GradMode::is_enabled();  // create_graph: read before any NoGradGuard
    variable_list res(4);
    if (grads.size() < 2 || !grads[1].defined()) return res;
    at::NoGradGuard no_grad;
    auto saved = ctx->get_saved_variables();
    const auto &p = saved[0], &q = saved[1];
    const auto& ps = *shard_impl(p)->spec();
    const auto& qs = *shard_impl(q)->spec();
    const auto& mesh = *ps.mesh;
    const int64_t nd = p.dim();
    auto idx = ctx->saved_data["idx"].toTensor();
    const bool points_grad = ctx->saved_data["points_grad"].toBool();
    const auto& gd = grads[1];
    auto out_spec = ShardSpec::make_with_dim_extents(qs.mesh, qs.placements, gd.sizes().vec(), qs.dim_extents());
    auto g = batched(local_aligned(resolve_partial(gd), qs.mesh, gd.sizes(), out_spec->placements,
                                   out_spec->dim_extents()));
    auto ql = batched(shard_impl(q)->local());
    auto pb = batched(shard_impl(p)->local());
    auto dq = at::zeros_like(ql, at::MemoryFormat::Contiguous);
    auto dp = points_grad ? at::zeros_like(pb, at::MemoryFormat::Contiguous) : at::Tensor();
    const auto ring = ps.mesh_dim_of(nd - 2);
    // Queries sharded along the ring: each rank adds its queries' term to the travelling dp buffer. Queries
    // replicated over the ring: every rank sees all queries, so the owner computes its block's whole dp at step 0
    // and nothing travels (adding on every rank would count each query n times).
    const bool q_on_ring = ring >= 0 && qs.placements[ring].is_shard(nd - 2);
    // The block's gradient travels with it (queries on the ring); after the last step it is at the block's owner.
    std::vector<at::Tensor> travelling;
    if (points_grad && q_on_ring) travelling.push_back(dp);
    travelling = comm::ring_loop(ring_of(ps, nd), {pb}, travelling,
                                 [&](int64_t t, int64_t owner, const auto& blocks, auto& acc) {
                                   const bool add_dp = points_grad && (q_on_ring || t == 0);
                                   at::Tensor* into = !add_dp ? nullptr : q_on_ring ? &acc[0] : &dp;
                                   points::distance_backward(g, idx, ql, blocks[0], offset_of(ps, nd, owner), dq, into);
                                 });
    if (points_grad && q_on_ring) dp = travelling[0];
    if (points_grad) {
      // Queries sharded where the points are whole: each rank's dp holds only its queries' term.
      std::vector<int64_t> sum_dims;
      for (int64_t m = 0; m < mesh.ndim(); ++m)
        if (qs.placements[m].is_shard(nd - 2) && !ps.placements[m].is_shard()) sum_dims.push_back(m);
      dp = sum_over_mesh_dims(dp, sum_dims, mesh);
      res[0] = make_shard_tensor(unbatched(dp, nd).to(p.scalar_type()), shard_impl(p)->spec());
    }
    if (q.requires_grad()) res[1] = make_shard_tensor(unbatched(dq, nd).to(q.scalar_type()), shard_impl(q)->spec());
    return once_differentiable(std::move(res), "knn / radius_search", recording);
  }
};

// ---- entry ----

std::vector<int64_t> mesh_dims_sharding(const Placements& pl, int64_t d) {
  std::vector<int64_t> out;
  for (size_t m = 0; m < pl.size(); ++m)
    if (pl[m].is_shard(d)) out.push_back(static_cast<int64_t>(m));
  return out;
}

SearchResult shard_search(const char* op, const at::Tensor& points, const at::Tensor& queries, int64_t k,
                          double radius) {
  MeshPtr mesh;
  for (const auto* t : {&points, &queries}) {
    auto* i = shard_impl(*t);
    if (!i) continue;
    if (!mesh) mesh = i->spec()->mesh;
    else if (!mesh->same_as(*i->spec()->mesh))
      refuse(op, points, queries, "points and queries live on different meshes",
             "redistribute them onto one mesh (full_tensor() then distribute_tensor)");
  }
  TORCH_INTERNAL_ASSERT(mesh, op, ": no ShardTensor argument");
  const int64_t nd = points.dim();
  auto p = resolve_partial_diff(as_shard_input(points, mesh));
  auto q = resolve_partial_diff(as_shard_input(queries, mesh));
  const auto pp = shard_impl(p)->spec()->placements, qp = shard_impl(q)->spec()->placements;
  auto xp = shard_impl(p)->spec()->dim_extents(), xq = shard_impl(q)->spec()->dim_extents();
  for (int64_t m = 0; m < mesh->ndim(); ++m)
    if (pp[m].is_shard(nd - 1) || qp[m].is_shard(nd - 1))
      refuse(op, points, queries, "the coordinate dim -1 is sharded",
             "redistribute points and queries so dim -1 is Replicate (shard the point dim -2 instead)");
  auto tp = pp, tq = qp;
  bool q_changed = false;
  if (nd == 3) {
    const auto bp = mesh_dims_sharding(pp, 0), bq = mesh_dims_sharding(qp, 0);
    // (A spec shards a tensor dim on at most one mesh dim.)
    if (!bp.empty() && !bq.empty() && bp != bq)
      refuse(op, points, queries, "points and queries shard the batch dim 0 on different mesh dims",
             "shard the batch of points and queries on the same mesh dim (redistribute one of them)");
    if (!bp.empty() || !bq.empty()) {
      const auto m = bp.empty() ? bq[0] : bp[0];
      const auto ext = bp.empty() ? xq.at(0) : xp.at(0);
      // Both inputs shard the batch on m (their batch rows must meet on one rank); the batch is then local.
      if (tp[m].is_shard(nd - 2)) xp.erase(nd - 2);
      if (tq[m].is_shard(nd - 2)) xq.erase(nd - 2);
      tp[m] = Placement::shard(0);
      q_changed = !(tq[m] == Placement::shard(0)) || (xq.count(0) && xq.at(0) != ext);
      tq[m] = Placement::shard(0);
      xp[0] = ext;
      xq[0] = ext;
    }
  }
  auto pc = to_layout(p, tp, xp);
  auto qc = to_layout(q, tq, xq);
  auto out = ShardSearchFn::apply(pc, qc, k, radius);
  if (q_changed) {
    // Back to the queries' own layout.
    const auto& qspec = *shard_impl(q)->spec();
    return {to_layout(out[0], qspec.placements, qspec.dim_extents()),
            to_layout(out[1], qspec.placements, qspec.dim_extents())};
  }
  return {out[0], out[1]};
}

// The sharded search runs host kernels on the local points and sizes its exchanges from the candidates found: it
// cannot be traced. Decided from the tensors' kind alone, alike on every rank.
void refuse_while_tracing(const char* what, const at::Tensor& points, const at::Tensor& queries) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      !comm::tracing(dispatch::local_or_self(points)) && !comm::tracing(dispatch::local_or_self(queries)), "ShardTensor: ",
      what, " on ShardTensors inside a torch.compile'd region is not supported yet (its kernels run on the host and "
      "its exchanges are sized by the candidates found). Call it outside the compiled region: decorate a helper with "
      "@torch.compiler.disable, or compile the model parts around it.");
}

SearchResult knn_entry(const at::Tensor& points, const at::Tensor& queries, int64_t k) {
  refuse_while_tracing("shardtensor.ops.knn", points, queries);
  points::check_knn_args(points, queries, k);
  return shard_search("shardtensor.ops.knn", points, queries, k, std::numeric_limits<double>::infinity());
}

SearchResult radius_entry(const at::Tensor& points, const at::Tensor& queries, double radius, int64_t max_neighbors) {
  refuse_while_tracing("shardtensor.ops.radius_search", points, queries);
  points::check_radius_args(points, queries, radius, max_neighbors);
  return shard_search("shardtensor.ops.radius_search", points, queries, max_neighbors, radius);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(point_search) {
  dispatch::set_handler("shardtensor::knn", typed_handler(&knn_entry), dispatch::RuleLevel::above_autograd);
  dispatch::set_handler("shardtensor::radius_search", typed_handler(&radius_entry), dispatch::RuleLevel::above_autograd);
}

} // namespace shardtensor::ops
