// Peak CPU memory of a region of code, without the profiler and without touching its state: while a tracker is
// active, c10's CPU allocator is wrapped (and restored when the last tracker stops); the wrapper counts every
// allocation made while tracking, on any thread of the process, and its free (whenever it happens). The tracker
// keeps the running total and its peak, both relative to the moment it started. Frees of memory allocated before
// the start are not counted (their sizes are unknown), so the peak is that of the region's own allocations on top
// of what was live before, as with the profiler's profile_memory. Several trackers may be active at once (each
// counts from its own start); the profiler, record_function and collectives are unaffected.
#pragma once

#include <cstdint>
#include <memory>

namespace shardtensor {

class CpuMemoryTracker {
 public:
  CpuMemoryTracker();   // starts tracking
  ~CpuMemoryTracker();  // stops
  CpuMemoryTracker(const CpuMemoryTracker&) = delete;
  CpuMemoryTracker& operator=(const CpuMemoryTracker&) = delete;

  int64_t peak_bytes() const;     // highest (allocated - freed) since the start; >= 0
  int64_t current_bytes() const;  // allocated - freed since the start (of the region's own allocations)

 private:
  struct State;
  std::unique_ptr<State> state_;
};

} // namespace shardtensor
