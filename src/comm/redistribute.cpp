#include "comm/redistribute.h"

#include "comm/collectives.h"

#include <ATen/ATen.h>

#include <atomic>

namespace shardtensor {

SpecPtr redistribute_target_spec(const ShardSpec& src, const Placements& placements,
                                 const ShardingShapes& sharding_shapes) {
  ShardingShapes shapes = sharding_shapes;
  const auto ndim = src.ndim();
  for (size_t m = 0; m < placements.size() && m < src.placements.size(); ++m) {
    const auto mi = static_cast<int64_t>(m);
    if (shapes.count(mi) || !placements[m].is_shard()) continue;
    auto d = placements[m].dim < 0 ? placements[m].dim + ndim : placements[m].dim;
    if (src.placements[m].is_shard(d)) shapes[mi] = src.extents[m];
  }
  return ShardSpec::make(src.mesh, placements, src.global_shape, shapes);
}

SpecPtr without_partial(const SpecPtr& spec) {
  if (!spec->has_partial()) return spec;
  auto placements = spec->placements;
  for (auto& p : placements)
    if (p.is_partial()) p = Placement::replicate();
  return ShardSpec::make(spec->mesh, std::move(placements), spec->global_shape, spec->sharding_shapes());
}

at::Tensor grad_to_spec(const at::Tensor& grad, const SpecPtr& spec) {
  auto target = without_partial(spec);
  if (is_shard_tensor(grad)) return redistribute_to(grad, target);
  auto full_spec = ShardSpec::make(spec->mesh, Placements(spec->mesh->ndim(), Placement::replicate()),
                                   spec->global_shape);
  return redistribute_to(make_shard_tensor(grad, full_spec), target);
}

namespace {

bool sharded_elsewhere(const Placements& cur, int64_t tensor_dim, size_t except_mesh_dim) {
  for (size_t m = 0; m < cur.size(); ++m)
    if (m != except_mesh_dim && cur[m].is_shard(tensor_dim)) return true;
  return false;
}

std::atomic<ReplicationObserver> replication_observer{nullptr};

} // namespace

void set_replication_observer(ReplicationObserver observer) {
  replication_observer.store(observer);
}

at::Tensor redistribute_local(const at::Tensor& local, const ShardSpec& src, const ShardSpec& dst) {
  TORCH_CHECK_VALUE(src.mesh->same_as(*dst.mesh), "redistribute: source and target meshes differ (",
                    src.mesh->str(), " vs ", dst.mesh->str(), "); cross-mesh redistribution is not supported");
  TORCH_INTERNAL_ASSERT(src.global_shape == dst.global_shape);
  const auto& mesh = *src.mesh;
  auto cur = src.placements;
  auto cur_ext = src.extents;
  at::Tensor t = local;

  // 1. Resolve pending reductions that the target does not keep.
  for (size_t m = 0; m < cur.size(); ++m) {
    const auto mi = static_cast<int64_t>(m);
    if (!cur[m].is_partial() || cur[m] == dst.placements[m]) continue;
    const auto& target = dst.placements[m];
    if (target.is_shard() && !sharded_elsewhere(cur, target.dim, m) &&
        !sharded_elsewhere(cur, target.dim, cur.size())) {
      t = comm::reduce_scatter_v(t, cur[m].op, target.dim, dst.extents[m], mesh, mi);
      cur[m] = target;
      cur_ext[m] = dst.extents[m];
    } else {
      t = comm::all_reduce(t, cur[m].op, mesh, mi);
      cur[m] = Placement::replicate();
    }
  }
  // 2. Move or gather shards that change.
  for (size_t m = 0; m < cur.size(); ++m) {
    const auto mi = static_cast<int64_t>(m);
    if (!cur[m].is_shard()) continue;
    const auto& target = dst.placements[m];
    if (cur[m] == target && cur_ext[m] == dst.extents[m]) continue;
    const auto a = cur[m].dim;
    if (target.is_shard() && (target.dim == a || !sharded_elsewhere(cur, target.dim, m))) {
      t = comm::all_to_all_v(t, a, cur_ext[m], target.dim, dst.extents[m], mesh, mi);
      cur[m] = target;
      cur_ext[m] = dst.extents[m];
    } else {
      if (target.is_replicate())
        if (auto observer = replication_observer.load()) observer(src, mi, a, static_cast<int64_t>(t.element_size()));
      t = comm::all_gather_v(t, a, cur_ext[m], mesh, mi);
      cur[m] = Placement::replicate();
      cur_ext[m].clear();
    }
  }
  // 3. Replicate -> Shard is a local slice; Replicate -> Partial keeps one term.
  for (size_t m = 0; m < cur.size(); ++m) {
    const auto mi = static_cast<int64_t>(m);
    if (!cur[m].is_replicate()) continue;
    const auto& target = dst.placements[m];
    if (target.is_shard()) {
      const auto off = dst.offset_of(mi, mesh.coordinate(mi));
      // Copy when the slice would keep a larger replicated buffer alive; a slice of a smaller one (a gradient
      // expanded from a scalar: stride 0, less memory than it covers) stays a view. A slice covering its whole buffer
      // (a mesh dim of size 1) is copied too: it would alias the source, which a user may write to afterwards.
      auto slice = t.narrow(target.dim, off, dst.extents[m][mesh.coordinate(mi)]);
      // (A traced tensor's storage may have a symbolic size, which nbytes() refuses: copied then, as a tracer's
      // storage is no memory anyway.)
      const auto needed = static_cast<size_t>(slice.numel()) * slice.element_size();
      const bool keep_view = slice.has_storage() && !slice.storage().sym_nbytes().is_heap_allocated() &&
                             slice.storage().nbytes() < needed;
      t = keep_view ? slice : slice.clone();
      cur[m] = target;
      cur_ext[m] = dst.extents[m];
    } else if (target.is_partial()) {
      if (target.op == ReduceOp::Sum && mesh.coordinate(mi) != 0) t = at::zeros_like(t);
      cur[m] = target;
    }
  }
  TORCH_INTERNAL_ASSERT(cur == dst.placements, "redistribute: plan did not reach ", to_string(dst.placements),
                        " from ", to_string(src.placements));
  return t;
}

at::Tensor redistribute_to(const at::Tensor& shard, const SpecPtr& dst) {
  auto& impl = checked_shard_impl(shard, "redistribute");
  if (impl.spec().get() == dst.get() || impl.spec()->same_layout(*dst)) return shard;
  return make_shard_tensor(redistribute_local(impl.local(), *impl.spec(), *dst), dst);
}

} // namespace shardtensor
