// Small readers of operator schemas and names, for the rules that bind many ops by walking the dispatcher's op list
// (pointwise.cpp, foreach.cpp).
#pragma once

#include <ATen/core/function_schema.h>

#include <string>

namespace shardtensor::ops {

// The argument is written by the op (`Tensor(a!)`, `Tensor(a!)[]`).
inline bool is_written(const c10::Argument& a) {
  return a.alias_info() && a.alias_info()->isWrite();
}

inline bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

} // namespace shardtensor::ops
