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
void record_collective(const char* kind, int64_t bytes) {
  std::lock_guard<std::mutex> lock(stats_mutex);
  stats.calls[kind] += 1;
  stats.bytes[kind] += bytes;
}
} // namespace comm

} // namespace shardtensor
