// Host-side metadata tensors (agreement values, shape exchanges, halo index lists, interpolation weights) are built
// with Python dispatch excluded: a TorchDispatchMode active around the library (the FLOP counter, the meta
// simulation's fake tensors) must neither count them as compute nor turn them into fake tensors whose values the
// library then could not read.
#pragma once

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace shardtensor::comm {

struct HostMetadataGuard {
  c10::impl::ExcludeDispatchKeyGuard guard{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot})};
};

} // namespace shardtensor::comm
