#include <shardtensor/simulation.h>

#include <atomic>

namespace shardtensor {

namespace {
std::atomic<bool>& flag() {
  static std::atomic<bool> on{false};
  return on;
}
} // namespace

bool set_simulating(bool on) {
  return flag().exchange(on);
}

bool simulating() {
  return flag().load(std::memory_order_relaxed);
}

} // namespace shardtensor
