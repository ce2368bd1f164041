// See shard_random.h.
#include "dispatch/shard_random.h"

#include "comm/functional.h"

#include <shardtensor/shard_tensor.h>
#include <shardtensor/simulation.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <mutex>

namespace shardtensor::dispatch {

namespace {

// splitmix64's finalizer: spreads a combined value over all 64 bits.
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// FNV-1a, continued over `n` bytes.
uint64_t fnv(uint64_t h, const void* data, size_t n) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ bytes[i]) * 0x100000001b3ULL;
  return h;
}

constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ULL;

// The Mersenne twister's state, field by field (the struct's padding bytes are not part of it).
uint64_t engine_hash(const at::mt19937& engine) {
  const auto d = engine.data();
  uint64_t h = fnv(kFnvBasis, &d.seed_, sizeof d.seed_);
  h = fnv(h, &d.left_, sizeof d.left_);
  h = fnv(h, &d.seeded_, sizeof d.seeded_);
  h = fnv(h, &d.next_, sizeof d.next_);
  return fnv(h, d.state_.data(), d.state_.size() * sizeof(uint32_t));
}

} // namespace

ShardRandomGuard::ShardRandomGuard(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const auto base = stack->size() - args.size();
  const ShardTensorImpl* lead = nullptr;
  std::optional<at::Generator> given;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& v = (*stack)[base + i];
    if (!lead && v.isTensor() && v.toTensor().defined()) lead = shard_impl(v.toTensor());
    if (v.isGenerator()) given = v.toGenerator();
  }
  if (!lead) return;
  const auto& local = lead->local();
  const auto type = local.device().type();
  // Under st.simulate one process plays one rank: no peers to keep in step, and the saved state (5 KiB on the CPU)
  // would show in the rank's measured peak memory.
  if ((type != c10::kCPU && type != c10::kCUDA) || comm::tracing(local) || simulating()) return;
  device_ = local.device();
  gen_ = given ? *given : at::globalContext().defaultGenerator(device_);
  const auto& spec = lead->spec();
  uint64_t coord = 0;
  for (int64_t m = 0; m < spec->mesh->ndim(); ++m)
    if (!spec->placements[m].is_replicate())
      coord = mix(coord ^ static_cast<uint64_t>(spec->mesh->coordinate(m) + 1) ^ (static_cast<uint64_t>(m) << 32));
  std::lock_guard<std::mutex> lock(gen_->mutex());
  uint64_t hash = 0;
  if (device_.is_cpu()) {
    auto* cpu = gen_->get<at::CPUGeneratorImpl>();
    cpu_engine_ = cpu->engine();
    cpu_next_float_ = cpu->next_float_normal_sample();
    cpu_next_double_ = cpu->next_double_normal_sample();
    hash = engine_hash(*cpu_engine_);
  } else {
    state_ = gen_->get_state();
    hash = fnv(kFnvBasis, state_.data_ptr(), static_cast<size_t>(state_.numel()));
  }
  gen_->set_current_seed(mix(hash ^ coord));
}

ShardRandomGuard::~ShardRandomGuard() {
  if (!gen_) return;
  std::unique_lock<std::mutex> lock(gen_->mutex());
  if (cpu_engine_) {
    // Restored, then one draw, the same on every rank, so the next op does not reuse this op's seed.
    auto* cpu = gen_->get<at::CPUGeneratorImpl>();
    cpu->set_engine(*cpu_engine_);
    cpu->set_next_float_normal_sample(cpu_next_float_);
    cpu->set_next_double_normal_sample(cpu_next_double_);
    (void)cpu->random();
    return;
  }
  gen_->set_state(state_);
  lock.unlock(); // the draw below takes the generator's lock itself
  // Other devices' generators advance by an offset: a one-element draw moves it on, alike on every rank.
  try {
    at::empty({1}, at::TensorOptions().device(device_)).uniform_(0.0, 1.0, *gen_);
  } catch (...) { // NOLINT(bugprone-empty-catch): the state is restored; a failed advance repeats a seed at worst
  }
}

} // namespace shardtensor::dispatch
