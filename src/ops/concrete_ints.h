// Symbolic sizes and integers reach the rules while torch.compile traces: a view rule when Dynamo fakeifies an input
// that is a view of a traced shard (it replays the view on the fake base with symbolic sizes once it has made a dim
// dynamic), any rule taking sizes or integers (interpolation sizes, padding, groups, k, ...) when they were computed
// from a value Dynamo made symbolic (a float scale on a recompile). The rules compute plans from concrete values, so
// each is specialized (a guard on its value: a recompile if it changes, as the layout's global shape already
// implies); outside tracing these are plain ints and nothing is guarded.
#pragma once

#include <c10/core/SymInt.h>
#include <c10/core/SymIntArrayRef.h>

#include <cstdint>
#include <vector>

namespace shardtensor::ops {

inline int64_t concrete_int(const c10::SymInt& v) {
  return v.guard_int(__FILE__, __LINE__);
}

inline std::vector<int64_t> concrete_ints(c10::SymIntArrayRef values) {
  std::vector<int64_t> out;
  out.reserve(values.size());
  for (const auto& v : values) out.push_back(concrete_int(v));
  return out;
}

} // namespace shardtensor::ops
