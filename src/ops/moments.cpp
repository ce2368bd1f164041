#include "ops/moments.h"

#include "comm/stat_reduce.h"

#include <ATen/ATen.h>

namespace shardtensor::ops {

Moments global_moments(const at::Tensor& x, const std::vector<int64_t>& dims, const std::vector<ShardedDim>& sharded,
                       const Mesh& mesh) {
  if (x.is_complex()) {
    // E|x - mean|^2 is the real and imaginary parts' variances added: their moments travel as two real channels (a
    // real M2 on every rank, also on one without elements), the mean is their pair.
    auto parts = global_moments(at::view_as_real(x), dims, sharded, mesh);
    return {at::view_as_complex(parts.mean.contiguous()), parts.m2.sum(-1), parts.count};
  }
  std::vector<int64_t> cur(x.dim());
  for (int64_t d = 0; d < x.dim(); ++d) cur[d] = x.size(d);
  double count = 1;
  for (auto d : dims) count *= static_cast<double>(cur[d]);
  at::Tensor mean, m2;
  if (count == 0) {
    auto shape = x.sizes().vec();
    for (auto d : dims) shape[d] = 1;
    mean = at::zeros(shape, x.options());
    m2 = at::zeros(shape, x.options());
  } else {
    // One fused pass (Welford), no centred or squared copy of x.
    auto [var, m] = at::var_mean(x, dims, /*correction=*/0, /*keepdim=*/true);
    mean = m;
    m2 = var * count;
  }
  if (!sharded.empty()) {
    // Every rank's (count, mean, M2) combined by the statistics executor: one collective per mesh dim.
    comm::StatReduce r;
    std::vector<int64_t> mesh_dims;
    for (const auto& s : sharded) {
      mesh_dims.push_back(s.mesh_dim);
      int64_t total_extent = 0;
      for (auto e : s.extents) total_extent += e;
      cur[s.dim] = total_extent;
    }
    const auto i = r.moments(at::scalar_tensor(count, mean.options()), mean, m2);
    r.run(mesh, mesh_dims);
    mean = r.result(i)[1];
    m2 = r.result(i)[2];
  }
  count = 1;
  for (auto d : dims) count *= static_cast<double>(cur[d]);
  return {mean, m2, count};
}

} // namespace shardtensor::ops
