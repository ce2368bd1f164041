// Small readers of operator schemas and names, for the rules that bind many ops by walking the dispatcher's op list
// (pointwise.cpp, foreach.cpp) and the dispatcher's out= handling (dispatch/registry.cpp).
#pragma once

#include <ATen/core/function_schema.h>

#include <string>

namespace shardtensor::ops {

// The argument is written by the op (`Tensor(a!)`, `Tensor(a!)[]`).
inline bool is_written(const c10::Argument& a) {
  return a.alias_info() && a.alias_info()->isWrite();
}

// The arguments of `variant` other than those `skip` selects have the names and types of `functional`'s, in order.
template <typename Skip>
inline bool same_arguments(const c10::FunctionSchema& variant, const c10::FunctionSchema& functional, Skip skip) {
  size_t j = 0;
  for (const auto& a : variant.arguments()) {
    if (skip(a)) continue;
    if (j >= functional.arguments().size()) return false;
    const auto& b = functional.arguments()[j++];
    if (a.name() != b.name() || *a.type() != *b.type()) return false;
  }
  return j == functional.arguments().size();
}

// Every return of `s` is an alias of a written argument (the in-place / out= contract: the op returns what it wrote).
inline bool returns_written(const c10::FunctionSchema& s) {
  if (s.returns().empty()) return false;
  for (const auto& r : s.returns())
    if (!r.alias_info() || !r.alias_info()->isWrite()) return false;
  return true;
}

inline bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

} // namespace shardtensor::ops
