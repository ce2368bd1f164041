// See shard_random.h.
#include "dispatch/shard_random.h"

#include "comm/functional.h"

#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <cstring>
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

// FNV-1a over the generator's state: equal on ranks whose generators are in step.
uint64_t state_hash(const at::Tensor& state) {
  const auto* bytes = state.data_ptr<uint8_t>();
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int64_t i = 0; i < state.numel(); ++i) h = (h ^ bytes[i]) * 0x100000001b3ULL;
  return h;
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
  if ((type != c10::kCPU && type != c10::kCUDA) || comm::tracing(local)) return;
  device_ = local.device();
  gen_ = given ? *given : at::globalContext().defaultGenerator(device_);
  const auto& spec = lead->spec();
  uint64_t coord = 0;
  for (int64_t m = 0; m < spec->mesh->ndim(); ++m)
    if (!spec->placements[m].is_replicate()) coord = mix(coord ^ static_cast<uint64_t>(spec->mesh->coordinate(m) + 1) ^ (static_cast<uint64_t>(m) << 32));
  std::lock_guard<std::mutex> lock(gen_->mutex());
  state_ = gen_->get_state();
  gen_->set_current_seed(mix(state_hash(state_) ^ coord));
}

ShardRandomGuard::~ShardRandomGuard() {
  if (!gen_) return;
  {
    std::lock_guard<std::mutex> lock(gen_->mutex());
    gen_->set_state(state_);
  }
  // One draw, the same on every rank, so the next op on this generator does not reuse this op's seed.
  try {
    at::empty({1}, at::TensorOptions().device(device_)).uniform_(0.0, 1.0, *gen_);
  } catch (...) { // NOLINT(bugprone-empty-catch): the state is restored; a failed advance repeats a seed at worst
  }
}

} // namespace shardtensor::dispatch
