// A differentiable peer exchange of plain tensors, for routed Python code (shardtensor/integrations) whose message
// shapes follow from layouts every rank knows: the HEALPix padding's strips, each read from the rank that owns it.
#pragma once

#include <shardtensor/mesh.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace shardtensor::comm {

// Sends send[j] to coordinate j of mesh dim `mesh_dim` and returns, by coordinate, the tensors of recv_shapes[j]
// received from it (send[me] and recv_shapes[me] are empty; dtype and device of `like`). Nothing is agreed first:
// the caller guarantees that send[j] on this rank has the shape coordinate j passes as recv_shapes[me] (shapes
// derived from specs and global shapes). Point-to-point messages only between the pairs that move something
// (comm::peer_exchange_start, counted as a halo). Differentiable: each received tensor's gradient goes back to its
// sender by the same exchange the other way (zeros where a rank has none, so every rank takes part alike).
std::vector<at::Tensor> differentiable_peer_exchange(const std::vector<at::Tensor>& send,
                                                     const std::vector<std::vector<int64_t>>& recv_shapes,
                                                     const at::Tensor& like, const MeshPtr& mesh, int64_t mesh_dim);

} // namespace shardtensor::comm
