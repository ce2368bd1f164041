#include "ops/moments.h"

#include "comm/collectives.h"
#include "comm/functional.h"
#include "comm/host_metadata.h"

#include <ATen/ATen.h>

namespace shardtensor::ops {

Moments global_moments(const at::Tensor& x, const std::vector<int64_t>& dims, const std::vector<ShardedDim>& sharded,
                       const Mesh& mesh) {
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
  for (const auto& s : sharded) {
    const auto n = mesh.size(s.mesh_dim);
    // Element counts of every coordinate: this dim's extent there, the other dims as combined so far.
    std::vector<double> counts;
    for (int64_t r = 0; r < n; ++r) {
      double c = 1;
      for (auto d : dims) c *= static_cast<double>(d == s.dim ? s.extents[r] : cur[d]);
      counts.push_back(c);
    }
    int64_t total_extent = 0;
    for (auto e : s.extents) total_extent += e;
    cur[s.dim] = total_extent;
    auto both = comm::all_gather_v(at::stack({mean, m2}).unsqueeze(0), 0, std::vector<int64_t>(n, 1), mesh, s.mesh_dim);
    auto all_mean = both.select(1, 0), all_m2 = both.select(1, 1);
    std::vector<int64_t> cshape(all_mean.dim(), 1);
    cshape[0] = n;
    at::Tensor nk;
    {
      comm::HostMetadataGuard host; // host-side index/weight tensors stay real (comm/host_metadata.h)
      nk = at::tensor(counts, at::TensorOptions().dtype(x.scalar_type())).view(cshape);
    }
    nk = comm::plan_constant(nk, x);
    auto total = nk.sum();
    auto new_mean = (nk * all_mean).sum(0) / total.clamp_min(1);
    m2 = all_m2.sum(0) + (nk * (all_mean - new_mean.unsqueeze(0)).square()).sum(0);
    mean = new_mean;
  }
  count = 1;
  for (auto d : dims) count *= static_cast<double>(cur[d]);
  return {mean, m2, count};
}

} // namespace shardtensor::ops
