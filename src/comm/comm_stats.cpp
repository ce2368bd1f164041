#include "comm/comm_stats.h"

#include <mutex>

namespace shardtensor {

namespace {
std::mutex stats_mutex;
CommStats stats;
} // namespace

int64_t CommStats::total_calls() const {
  int64_t n = 0;
  for (const auto& [k, v] : calls) n += v;
  return n;
}

int64_t CommStats::total_bytes() const {
  int64_t n = 0;
  for (const auto& [k, v] : bytes) n += v;
  return n;
}

CommStats comm_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex);
  return stats;
}

void reset_comm_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex);
  stats = CommStats{};
}

namespace comm {

namespace {
thread_local CollectiveScope* active_scope = nullptr;
} // namespace

CollectiveScope::CollectiveScope(std::string prefix) : prefix_(std::move(prefix)), outer_(active_scope) {
  active_scope = this;
}

CollectiveScope::~CollectiveScope() {
  active_scope = outer_;
}

void record_collective(const char* kind, int64_t bytes, int64_t messages) {
  std::string name = kind;
  if (active_scope) {
    name = active_scope->prefix_ + name;
    for (auto* s = active_scope; s; s = s->outer_) s->bytes_ += bytes;
  }
  std::lock_guard<std::mutex> lock(stats_mutex);
  stats.calls[name] += 1;
  stats.bytes[name] += bytes;
  if (messages > 0) stats.messages[name] += messages;
}

void record_replication(const std::string& op, int64_t bytes) {
  std::lock_guard<std::mutex> lock(stats_mutex);
  stats.replications[op] += 1;
  stats.replicated_bytes[op] += bytes;
}
} // namespace comm

} // namespace shardtensor
