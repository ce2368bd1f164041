#include <shardtensor/simulation.h>

#include <shardtensor/mesh.h>

#include <c10/util/Exception.h>

#include <atomic>

namespace shardtensor {

namespace {
std::atomic<bool>& flag() {
  static std::atomic<bool> on{false};
  return on;
}
std::atomic<uint64_t>& epoch() {
  static std::atomic<uint64_t> e{0};
  return e;
}
} // namespace

bool set_simulating(bool on) {
  const bool previous = flag().exchange(on);
  if (on && !previous) epoch().fetch_add(1);
  return previous;
}

uint64_t simulation_epoch() {
  return simulating() ? epoch().load() : 0;
}

void check_simulation_alive(const Mesh& mesh, const char* what) {
  if (mesh.simulation() == 0 || mesh.simulation() == simulation_epoch()) return;
  TORCH_CHECK_VALUE(false, what, ": this ShardTensor (or its mesh ", mesh.str(),
                    ") was made inside a shardtensor.simulate(...) block that has ended. Its process group was the "
                    "simulation's fake one, which moves no data, so anything computed with it now would be garbage. "
                    "Create and use simulated tensors inside the block, and real ones on a real process group.");
}

bool simulating() {
  return flag().load(std::memory_order_relaxed);
}

} // namespace shardtensor
