// sort along a sharded dim (sort_sharded.cpp): the rule sort_fft.cpp runs when the sorted dim is sharded.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace shardtensor::ops {

// (values, indices) of a stable sort of ShardTensor `self` along `dim`, which a mesh dim shards; both keep `self`'s
// layout (rank c holds the sorted positions of its own rows' range). Ties keep their original order (a stable sort;
// torch's unstable one may order them differently); NaN sorts last ascending, first descending, as torch does.
std::tuple<at::Tensor, at::Tensor> sort_sharded(const at::Tensor& self, int64_t dim, bool descending);

} // namespace shardtensor::ops
