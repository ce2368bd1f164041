// Views of ShardTensors are recorded for autograd with the view op that made them (view replay).
//
// Autograd rebuilds a view from its base in two places: the backward of an in-place op on a view (CopySlices: the
// base's gradient is restrided to the view's geometry, the in-place op's backward runs on that slice, the result is
// written back) and the history of a view whose base was written after the view was taken. It does so with the
// view's recorded view function when there is one, else with `as_strided` on the base using the view's global
// sizes, strides and storage offset. A ShardTensor has no global storage: its strides are dense strides in the
// local tensor's order, so `as_strided` with them could only be honoured as the identity, and a slice, transpose
// or select of the base (along a sharded dim or not) is not one. The generated ADInplaceOrView kernels record the
// view function when the base does not support as_strided or when view replay is on; support_as_strided() reads
// the device, which for a ShardTensor is the local tensor's (true), so view ops of ShardTensors turn view replay
// on while autograd records them. Then every view, and every view of a view (the chain replays each op), is
// rebuilt by ops that have rules, whatever the layout.
#pragma once

#include <ATen/core/function_schema.h>
#include <c10/core/AutogradState.h>

namespace shardtensor::dispatch {

// The op returns an alias of an argument (`Tensor(a)`, not a written `Tensor(a!)`): a view op.
inline bool returns_view(const c10::FunctionSchema& schema) {
  for (const auto& r : schema.returns())
    if (r.alias_info() && !r.alias_info()->isWrite()) return true;
  return false;
}

// Turns view replay on (thread-local) for the scope when `on`; restores the previous setting.
class ViewReplayGuard {
 public:
  explicit ViewReplayGuard(bool on) : on_(on) {
    if (!on_) return;
    auto& tls = c10::AutogradState::get_tls_state();
    saved_ = tls.get_view_replay_enabled();
    tls.set_view_replay_enabled(true);
  }
  ~ViewReplayGuard() {
    if (on_) c10::AutogradState::get_tls_state().set_view_replay_enabled(saved_);
  }
  ViewReplayGuard(const ViewReplayGuard&) = delete;
  ViewReplayGuard& operator=(const ViewReplayGuard&) = delete;

 private:
  bool on_;
  bool saved_ = false;
};

} // namespace shardtensor::dispatch
