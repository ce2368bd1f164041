// Mean and variance over dims that may be sharded: local (count, mean, M2) combined with Chan's parallel
// formula (the statistics executor, comm/stat_reduce.h: one collective per mesh dim) — never E[x^2] - E[x]^2.
#pragma once

#include <shardtensor/mesh.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace shardtensor::ops {

// A reduced dim of the local tensor that a mesh dim shards.
struct ShardedDim {
  int64_t mesh_dim;
  int64_t dim;                        // index in the local tensor
  std::vector<int64_t> extents;       // per coordinate along mesh_dim
};

struct Moments {
  at::Tensor mean; // reduced dims kept as size 1
  at::Tensor m2;   // sum of squared deviations
  double count;    // global number of reduced elements
};

// `x` is in its accumulation dtype; `dims` are the reduced dims of `x`.
Moments global_moments(const at::Tensor& x, const std::vector<int64_t>& dims, const std::vector<ShardedDim>& sharded,
                       const Mesh& mesh);

} // namespace shardtensor::ops
