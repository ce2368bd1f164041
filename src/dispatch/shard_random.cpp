// See shard_random.h.
#include "dispatch/shard_random.h"

#include "comm/agreement.h"
#include "comm/functional.h"

#include <shardtensor/shard_tensor.h>
#include <shardtensor/simulation.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <mutex>
#include <vector>

namespace shardtensor::dispatch {

namespace {

// The Mersenne twister's state, field by field (the struct's padding bytes are not part of it).
void append_engine_state(std::vector<int64_t>& values, const at::mt19937& engine) {
  const auto d = engine.data();
  values.insert(values.end(), {static_cast<int64_t>(d.seed_), d.left_, d.seeded_, d.next_});
  values.insert(values.end(), d.state_.begin(), d.state_.end());
}

// Whether this call draws from a generator on one device. The tag marks ops that may draw; some draw nothing for
// some arguments, and there the guard must not advance the generator either, or every later draw of the program
// (a VAE's posterior noise after a self-attention block) would differ from one device's. Of the tagged ops with
// rules: attention with dropout_p 0 (the rules refuse any other), native_dropout and rrelu_with_noise out of training
// (native_dropout draws even at p 0 while training, as on one device). The dropout composites (dropout,
// feature_dropout, ...) and the recurrent ops (lstm, gru, ...) have no rules of their own: they decompose into ops
// that do, and draw nothing where one device draws nothing (dropout at p 0 or 1 never reaches a random op).
bool draws_on_one_device(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const auto base = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& arg = args[i].name();
    const auto& v = (*stack)[base + i];
    if ((arg == "train" || arg == "training") && v.isBool() && !v.toBool()) return false;
    if (arg == "dropout_p" && v.isDouble() && v.toDouble() == 0.0) return false;
  }
  return true;
}

} // namespace

ShardRandomGuard::ShardRandomGuard(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  if (!draws_on_one_device(op, stack)) return;
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
  // A lead no mesh dim splits is drawn whole on every rank: the single-device draw, which keeps every rank's
  // generator in step by itself (a VAE's noise for a replicated latent equals one device's).
  if (!lead->spec()->has_shard()) return;
  const auto& local = lead->local();
  const auto type = local.device().type();
  // Under st.simulate one process plays one rank: no peers to keep in step, and the saved state (5 KiB on the CPU)
  // would show in the rank's measured peak memory.
  if ((type != c10::kCPU && type != c10::kCUDA) || comm::tracing(local) || simulating()) return;
  device_ = local.device();
  gen_ = given ? *given : at::globalContext().defaultGenerator(device_);
  // The stream's seed: a digest (comm/agreement.h) of the generator's state and of this rank's coordinates on the
  // mesh dims that split the lead (not on replicated or pending ones, whose ranks must draw alike).
  std::vector<int64_t> seed_of;
  std::lock_guard<std::mutex> lock(gen_->mutex());
  if (device_.is_cpu()) {
    auto* cpu = gen_->get<at::CPUGeneratorImpl>();
    cpu_engine_ = cpu->engine();
    cpu_next_float_ = cpu->next_float_normal_sample();
    cpu_next_double_ = cpu->next_double_normal_sample();
    append_engine_state(seed_of, *cpu_engine_);
  } else {
    state_ = gen_->get_state();
    const auto* bytes = state_.data_ptr<uint8_t>();
    seed_of.assign(bytes, bytes + state_.numel());
  }
  const auto& spec = lead->spec();
  for (int64_t m = 0; m < spec->mesh->ndim(); ++m)
    if (spec->placements[m].is_shard()) seed_of.insert(seed_of.end(), {m, spec->mesh->coordinate(m)});
  gen_->set_current_seed(static_cast<uint64_t>(comm::digest(seed_of)));
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
