// The ring executor (comm/ring_loop.h).
#include "comm/ring_loop.h"

#include "comm/collectives.h"

#include <c10/util/Exception.h>

namespace shardtensor::comm {

namespace {

// Tags of the two passes a step may have in flight together (Gloo matches messages by tag).
constexpr int kBlockTag = 0;
constexpr int kAccumulatorTag = 2;

// Posts `ts` one step on: they arrive holding the block of the coordinate before `owner`.
RingExchange pass_on(const Ring& ring, const std::vector<at::Tensor>& ts, int64_t owner, int tag) {
  const auto next_extent = ring.extents[(owner - 1 + ring.n) % ring.n];
  std::vector<std::vector<int64_t>> shapes;
  shapes.reserve(ts.size());
  for (const auto& t : ts) {
    auto s = t.sizes().vec();
    s[ring.dim] = next_extent;
    shapes.push_back(std::move(s));
  }
  return ring_pass_start(ts, shapes, *ring.mesh, ring.mesh_dim, tag);
}

} // namespace

Ring Ring::along(const Mesh& mesh, int64_t mesh_dim, int64_t dim, std::vector<int64_t> extents) {
  if (mesh_dim < 0) return local();
  Ring r;
  r.mesh = &mesh;
  r.mesh_dim = mesh_dim;
  r.n = mesh.size(mesh_dim);
  r.me = mesh.coordinate(mesh_dim);
  r.dim = dim;
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(extents.size()) == r.n, "ring of ", r.n, " ranks with ",
                        extents.size(), " block extents");
  r.extents = std::move(extents);
  return r;
}

Ring Ring::local() {
  return Ring{};
}

std::vector<at::Tensor> ring_loop(const Ring& ring, std::vector<at::Tensor> blocks,
                                  std::vector<at::Tensor> accumulators, const RingStep& step) {
  for (int64_t t = 0; t < ring.n; ++t) {
    const auto owner = ring.owner_at(t);
    const bool more = t < ring.n - 1;
    RingExchange next;
    if (more) next = pass_on(ring, blocks, owner, kBlockTag);
    step(t, owner, blocks, accumulators);
    if (ring.n > 1 && !accumulators.empty()) accumulators = pass_on(ring, accumulators, owner, kAccumulatorTag).wait();
    if (more) blocks = next.wait();
  }
  return accumulators;
}

} // namespace shardtensor::comm
