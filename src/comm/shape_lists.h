// Lists of tensor shapes saved in an autograd context as one int list (ndim, sizes..., ndim, sizes...): the
// differentiable ring pass and peer exchange keep their send shapes this way for the backward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardtensor::comm {

inline std::vector<int64_t> flatten_shapes(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<int64_t> flat;
  for (const auto& s : shapes) {
    flat.push_back(static_cast<int64_t>(s.size()));
    flat.insert(flat.end(), s.begin(), s.end());
  }
  return flat;
}

inline std::vector<std::vector<int64_t>> unflatten_shapes(const std::vector<int64_t>& flat) {
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < flat.size();) {
    const auto n = static_cast<size_t>(flat[i++]);
    out.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(i), flat.begin() + static_cast<std::ptrdiff_t>(i + n));
    i += n;
  }
  return out;
}

} // namespace shardtensor::comm
