// The dispatch side of include/shardtensor/replication.h: judges every gather to Replicate that comm's
// redistribution announces (set_replication_observer), naming the op whose rule is running.
#pragma once

#include <string>

namespace shardtensor::dispatch {

// While alive, gathers to Replicate on this thread belong to the gather-compute fallback of `op`: they are counted
// under `op`, and neither warn nor raise here (the fallback warns once per op and has its own strict-mode refusal).
class FallbackReplicationScope {
 public:
  explicit FallbackReplicationScope(std::string op);
  ~FallbackReplicationScope();
  FallbackReplicationScope(const FallbackReplicationScope&) = delete;
  FallbackReplicationScope& operator=(const FallbackReplicationScope&) = delete;
  const std::string& op() const {
    return op_;
  }

 private:
  std::string op_;
  const FallbackReplicationScope* outer_;
};

} // namespace shardtensor::dispatch
