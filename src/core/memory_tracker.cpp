// The CPU allocator wrapper behind CpuMemoryTracker. It replaces c10's CPU allocator only while a tracker is active
// and never the profiler's thread-local state (the slot c10 reports memory to), which the profiler, record_function
// and c10d's profiling read as their own.
#include <shardtensor/memory_tracker.h>

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace shardtensor {

namespace {

struct Counts {
  int64_t current = 0, peak = 0;
  uint64_t start = 0; // allocations numbered from here on are this tracker's
};

struct Registry {
  std::mutex mu;
  c10::Allocator* inner = nullptr;                                          // the allocator that was installed
  struct Allocation {
    int64_t size;
    c10::DeleterFnPtr deleter;
    uint64_t number;
  };
  std::unordered_map<void*, Allocation> live; // tracked allocations
  std::vector<Counts*> active;
  uint64_t next_number = 0;
};

Registry& registry() {
  static auto* r = new Registry(); // never destroyed: tracked memory may be freed during shutdown
  return *r;
}

void tracked_delete(void* ctx) {
  auto& r = registry();
  c10::DeleterFnPtr del = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.live.find(ctx);
    if (it != r.live.end()) {
      // Only trackers that saw the allocation count its free.
      for (auto* s : r.active)
        if (s->start <= it->second.number) s->current -= it->second.size;
      del = it->second.deleter;
      r.live.erase(it);
    } else if (r.inner) {
      del = r.inner->raw_deleter(); // raw_deallocate of memory this wrapper did not follow
    }
  }
  if (del) del(ctx);
}

struct TrackingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto& r = registry();
    auto dp = r.inner->allocate(n);
    const auto del = dp.get_deleter();
    // Only plain allocations (context == data, a plain deleter) can have their free followed.
    if (n == 0 || !dp.get() || dp.get() != dp.get_context() || !del) return dp;
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.active.empty() || !dp.compare_exchange_deleter(del, &tracked_delete)) return dp;
    r.live[dp.get()] = {static_cast<int64_t>(n), del, r.next_number++};
    for (auto* s : r.active) {
      s->current += static_cast<int64_t>(n);
      s->peak = std::max(s->peak, s->current);
    }
    return dp;
  }
  c10::DeleterFnPtr raw_deleter() const override {
    auto* inner = registry().inner;
    return inner && inner->raw_deleter() ? &tracked_delete : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    registry().inner->copy_data(dest, src, count);
  }
};

TrackingAllocator& wrapper() {
  static auto* w = new TrackingAllocator(); // storages made while tracking keep pointing at it
  return *w;
}

} // namespace

struct CpuMemoryTracker::State {
  Counts counts;
};

CpuMemoryTracker::CpuMemoryTracker() : state_(std::make_unique<State>()) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.active.empty()) {
    auto* current = c10::GetAllocator(c10::DeviceType::CPU);
    if (current != &wrapper()) {
      r.inner = current;
      c10::SetAllocator(c10::DeviceType::CPU, &wrapper());
      TORCH_CHECK(c10::GetAllocator(c10::DeviceType::CPU) == &wrapper(),
                  "CpuMemoryTracker: a CPU allocator registered with a priority above 0 is installed; the tracker "
                  "cannot wrap it");
    }
  }
  state_->counts.start = r.next_number;
  r.active.push_back(&state_->counts);
}

CpuMemoryTracker::~CpuMemoryTracker() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.active.erase(std::remove(r.active.begin(), r.active.end(), &state_->counts), r.active.end());
  // The last tracker restores the allocator (unless someone installed another on top meanwhile).
  if (r.active.empty() && c10::GetAllocator(c10::DeviceType::CPU) == &wrapper())
    c10::SetAllocator(c10::DeviceType::CPU, r.inner);
}

int64_t CpuMemoryTracker::peak_bytes() const {
  std::lock_guard<std::mutex> lock(registry().mu);
  return state_->counts.peak;
}

int64_t CpuMemoryTracker::current_bytes() const {
  std::lock_guard<std::mutex> lock(registry().mu);
  return state_->counts.current;
}

} // namespace shardtensor
