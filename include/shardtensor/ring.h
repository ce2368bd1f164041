// A ring pass on plain local tensors, for handlers that stream blocks around a mesh dim (ring attention, a kNN
// over sharded points): every rank sends its tensors to one neighbour and receives its other neighbour's.
#pragma once

#include <shardtensor/mesh.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace shardtensor {

enum class RingDirection {
  Forward,  // send to coordinate (c + 1) % n, receive from (c - 1 + n) % n
  Backward, // send to (c - 1 + n) % n, receive from (c + 1) % n
};

// A collective over mesh dim `mesh_dim`: every rank of that dim's group calls it with the same number of tensors.
// Sends `tensors[i]` to the neighbour and returns the neighbour's `tensors[i]`, received into `recv_shapes[i]`
// (empty: the shape the sender sends) with the dtype and device of `tensors[i]`. Before any data moves the ranks of
// the ring agree on the shapes: one small fixed-size all-gather along the mesh dim (a second one when some rank gave
// no shapes or shapes its sender does not send); given shapes that differ from the sender's, different numbers,
// dtypes or directions of tensors, or a rank's invalid arguments raise ValueError on every rank of the ring. (Under
// simulation or tracing nothing is exchanged: the shapes are the given ones, else `tensors[i]`'s own.) Zero-element
// tensors travel as nothing; a mesh dim of size 1 returns copies of `tensors`. Tensors must be plain (pass a
// ShardTensor's to_local()).
//
// Differentiable: the gradient of each received tensor travels back to its sender by the reverse ring (gradients
// that are undefined on a rank travel as zeros, so every rank takes part in the backward pass alike).
std::vector<at::Tensor> ring_pass(const std::vector<at::Tensor>& tensors, const MeshPtr& mesh, int64_t mesh_dim,
                                  const std::vector<std::vector<int64_t>>& recv_shapes = {},
                                  RingDirection direction = RingDirection::Forward);

} // namespace shardtensor
