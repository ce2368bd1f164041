// The ring executor: the loop that ring attention and the sharded point search run.
//
// Blocks sharded along a dim travel round the ring of a mesh dim: at step t coordinate c holds the block of
// coordinate (c - t) mod n (its "owner"), so after n steps every rank has seen every block. The executor owns the
// buffers and the overlap: the pass of the next block is posted before the step computes on the current one, and
// gradients that accumulate per block (dK / dV, a point block's gradient) travel with their block after each step,
// so after the last step they are at their owner. A rule supplies what its step computes on a block; it never posts
// a collective itself, so every rank issues the same passes in the same order whatever its step does.
//
// The accumulators' pass is waited before the next step: their next owner's terms are added to them there. Posting
// it and computing on a fresh accumulator meanwhile was measured (docs/attention.md): 1.36x one device's peak
// memory for no time gained.
#pragma once

#include <shardtensor/mesh.h>

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace shardtensor::comm {

// The ring along `mesh_dim` (n ranks, this one at `me`; n == 1: one local block, nothing travels). Blocks and
// accumulators are sharded along tensor dim `dim` with extent extents[owner] for coordinate `owner`'s block.
struct Ring {
  const Mesh* mesh = nullptr;
  int64_t mesh_dim = -1;
  int64_t n = 1, me = 0;
  int64_t dim = 0;
  std::vector<int64_t> extents;

  // The ring of `mesh_dim` for tensors sharded along `dim` (mesh_dim < 0: no ring).
  static Ring along(const Mesh& mesh, int64_t mesh_dim, int64_t dim, std::vector<int64_t> extents);
  // A one-step ring: the local block only.
  static Ring local();

  int64_t owner_at(int64_t step) const { return (me - step + n) % n; }
};

// What a step computes: `owner` is the block's coordinate; `blocks` the block tensors as they arrived (read-only);
// `accumulators` the block's travelling sums, added into in place.
using RingStep = std::function<void(int64_t step, int64_t owner, const std::vector<at::Tensor>& blocks,
                                    std::vector<at::Tensor>& accumulators)>;

// Runs the n steps over this rank's `blocks` and `accumulators` (its own block's, usually zeros); returns the
// accumulators of this rank's block after they went round the ring (with n == 1 the ones passed in).
std::vector<at::Tensor> ring_loop(const Ring& ring, std::vector<at::Tensor> blocks,
                                  std::vector<at::Tensor> accumulators, const RingStep& step);

} // namespace shardtensor::comm
