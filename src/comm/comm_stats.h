#pragma once

#include <shardtensor/comm_stats.h>

#include <string>

namespace shardtensor::comm {
// Count one collective of `bytes` bytes issued by this rank, made of `messages` point-to-point messages it sends
// (include/shardtensor/comm_stats.h says which kinds count them).
void record_collective(const char* kind, int64_t bytes, int64_t messages = 0);

// Count one replication by `op` of a tensor of `bytes` bytes (see CommStats::replications).
void record_replication(const std::string& op, int64_t bytes);

// While alive, the collectives this thread records are counted as "<prefix><kind>" (e.g. "fallback_all_gather")
// and their bytes summed here, so a caller can attribute and report what a step of its own moved. Scopes nest; the
// innermost one names the kind.
class CollectiveScope {
 public:
  explicit CollectiveScope(std::string prefix);
  ~CollectiveScope();
  CollectiveScope(const CollectiveScope&) = delete;
  CollectiveScope& operator=(const CollectiveScope&) = delete;
  int64_t bytes() const {
    return bytes_;
  }

 private:
  friend void record_collective(const char* kind, int64_t bytes, int64_t messages);
  std::string prefix_;
  int64_t bytes_ = 0;
  CollectiveScope* outer_;
};
} // namespace shardtensor::comm
