// How a rule's error messages name an argument's layout (one wording across the rules that decline).
#pragma once

#include <shardtensor/shard_tensor.h>

#include <ATen/core/Tensor.h>

#include <sstream>
#include <string>

namespace shardtensor::ops {

// "(Shard(2)) [4, 8, 3]": the placements and the (global) sizes; "plain [..]" for a plain tensor, "None" for none.
inline std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "None";
  std::ostringstream os;
  if (auto* i = shard_impl(t)) os << to_string(i->spec()->placements);
  else os << "plain";
  os << " " << t.sizes();
  return os.str();
}

// The whole layout (placements, global shape, extents) of a ShardTensor; "plain" otherwise.
inline std::string describe_spec(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  return impl ? impl->spec()->str() : std::string("plain");
}

} // namespace shardtensor::ops
