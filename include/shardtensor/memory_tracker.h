// Peak CPU memory of a region of code, from c10's allocator reports (no profiler): while a tracker is active on
// a thread, c10's CPU allocator reports every allocation and free made under it (the thread's debug-info slot
// that the profiler also uses; intra-op worker threads inherit it), and the tracker keeps the running total and
// its peak, both relative to the moment it started. Frees of memory allocated before the start are not reported
// by c10 (it reports frees only of allocations it saw while reporting was on), so the peak is that of the
// region's own allocations on top of what was live before, as with the profiler's profile_memory.
#pragma once

#include <cstdint>
#include <memory>

namespace shardtensor {

class CpuMemoryTracker {
 public:
  CpuMemoryTracker();   // starts tracking on this thread
  ~CpuMemoryTracker();  // stops (must be destroyed on the thread that created it)
  CpuMemoryTracker(const CpuMemoryTracker&) = delete;
  CpuMemoryTracker& operator=(const CpuMemoryTracker&) = delete;

  int64_t peak_bytes() const;     // highest (allocated - freed) since the start; >= 0
  int64_t current_bytes() const;  // allocated - freed since the start (of the region's own allocations)

 private:
  struct State;
  std::unique_ptr<State> state_;
};

} // namespace shardtensor
