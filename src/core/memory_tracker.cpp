#include <shardtensor/memory_tracker.h>

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <mutex>

namespace shardtensor {

namespace {

// Receives the allocator's reports (the same hook the profiler's profile_memory uses).
struct Reporter : c10::MemoryReportingInfoBase {
  mutable std::mutex mu;
  int64_t current = 0, peak = 0;

  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/, size_t /*total_reserved*/,
                         c10::Device device) override {
    if (!device.is_cpu()) return;
    std::lock_guard<std::mutex> lock(mu);  // intra-op threads report too
    current += alloc_size;
    peak = std::max(peak, current);
  }
  bool memoryProfilingEnabled() const override { return true; }
};

} // namespace

struct CpuMemoryTracker::State {
  std::shared_ptr<Reporter> reporter = std::make_shared<Reporter>();
  c10::DebugInfoGuard guard{c10::DebugInfoKind::PROFILER_STATE, reporter};
};

CpuMemoryTracker::CpuMemoryTracker() : state_(std::make_unique<State>()) {}
CpuMemoryTracker::~CpuMemoryTracker() = default;

int64_t CpuMemoryTracker::peak_bytes() const {
  std::lock_guard<std::mutex> lock(state_->reporter->mu);
  return state_->reporter->peak;
}

int64_t CpuMemoryTracker::current_bytes() const {
  std::lock_guard<std::mutex> lock(state_->reporter->mu);
  return state_->reporter->current;
}

} // namespace shardtensor
