// The extreme values of a dtype, for fills that must never win a max / min: an empty shard's term of a pending
// max / min (ops/reduction.cpp), max pooling's padding rows of an integer tensor (comm/halo_plan.cpp).
#pragma once

#include <c10/core/Scalar.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <limits>

namespace shardtensor::comm {

// The identity of max (lowest) and min (highest) in dtype `t`: an empty shard's term of a pending max/min. It must be
// representable in `t` (at::full refuses an int64 bound for an int16 tensor, on that rank only).
template <typename T>
inline c10::Scalar integral_limit(bool low) {
  return low ? c10::Scalar(std::numeric_limits<T>::lowest()) : c10::Scalar(std::numeric_limits<T>::max());
}
inline c10::Scalar dtype_limit(c10::ScalarType t, bool low) {
  if (c10::isFloatingType(t)) return (low ? -1 : 1) * std::numeric_limits<double>::infinity();
  switch (t) {
    case c10::kBool: return !low;
    case c10::kByte: return integral_limit<uint8_t>(low);
    case c10::kChar: return integral_limit<int8_t>(low);
    case c10::kShort: return integral_limit<int16_t>(low);
    case c10::kInt: return integral_limit<int32_t>(low);
    case c10::kUInt16: return integral_limit<uint16_t>(low);
    case c10::kUInt32: return integral_limit<uint32_t>(low);
    case c10::kUInt64: return integral_limit<uint64_t>(low);
    default: return integral_limit<int64_t>(low);
  }
}

} // namespace shardtensor::comm
