// A stand-in for a local shard that is empty along a sharded dim, for kernels that refuse empty input one device
// never passes them (MKL's FFT, sort): the rule runs the kernel on one row there and keeps none of the result.
#pragma once

#include <shardtensor/spec.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace shardtensor::ops {

struct EmptyShardStandIn {
  at::Tensor local;             // what the kernel runs on
  std::vector<int64_t> emptied; // the sharded dims given one row (empty when `local` is the shard itself)

  // The kernel's result without the stand-in rows (sharded dims precede the dims a kernel adds or drops).
  at::Tensor trim(at::Tensor out) const {
    for (auto d : emptied) out = out.narrow(d, 0, 0);
    return out;
  }
};

// Decided from the layout, not the local's sizes: a traced local's may be symbolic (torch.compile with a dim made
// dynamic), which numel() refuses; the layout's local shape is the local's, concretely.
inline EmptyShardStandIn stand_in_for_empty_shard(const at::Tensor& local, const ShardSpec& spec) {
  EmptyShardStandIn s{local, {}};
  for (const auto& [d, e] : spec.dim_extents())
    if (spec.local_shape[d] == 0) s.emptied.push_back(d);
  if (s.emptied.empty()) return s;
  auto shape = spec.local_shape;
  for (auto d : s.emptied) shape[d] = 1;
  if (std::all_of(shape.begin(), shape.end(), [](int64_t n) { return n > 0; }))
    s.local = at::zeros(shape, local.options());
  else
    s.emptied.clear();  // empty along an unsharded dim too: the kernel sees what one device would
  return s;
}

} // namespace shardtensor::ops
