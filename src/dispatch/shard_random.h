// Random draws on ShardTensors (dropout masks, rand_like / randn_like noise, bernoulli_ / normal_ / uniform_ fills:
// every op tagged nondeterministic_seeded that has a rule).
//
// A rank draws only its own elements, from the generator the op would use (its Generator argument, else the
// device's default). Left alone, that had two faults: ranks seeded alike (the usual recipe, and what keeps plain
// random draws equal on every rank) drew the same numbers for their first elements, so the shards' dropout masks and
// noise repeated each other; and ranks of uneven extents advanced the generator by different amounts, so a later
// plain draw (a masked autoencoder's token order, dropout of a replicated tensor) differed between ranks and the
// "replicated" values silently diverged.
//
// While a rule of such an op runs, ShardRandomGuard gives the generator a seed derived from its current state and
// this rank's coordinates on the mesh dims that split the op's first ShardTensor argument (ranks of a replicated
// mesh dim share it), then restores the state and advances it by one draw, alike on every rank. The shards'
// streams are distinct and independent of the extents; a draw does not equal one device's (that would need every
// rank to draw the whole tensor). A first argument that no mesh dim splits (Replicate, or a pending sum whose fresh
// result is Replicate) is drawn whole on every rank, as one device draws it: no guard. Nor is there one where the
// call draws nothing on one device (attention with dropout_p 0, native_dropout or rrelu out of training): the
// generator stays where one device leaves it. Not applied while tracing (fake or
// functional locals: torch.compile handles its own RNG), under st.simulate (one process plays one rank) or to devices
// without a default generator (meta).
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace shardtensor::dispatch {

class ShardRandomGuard {
 public:
  ShardRandomGuard(const c10::OperatorHandle& op, const torch::jit::Stack* stack);
  ~ShardRandomGuard();
  ShardRandomGuard(const ShardRandomGuard&) = delete;
  ShardRandomGuard& operator=(const ShardRandomGuard&) = delete;

 private:
  std::optional<at::Generator> gen_;
  // The CPU generator's state, kept without allocating a tensor (a rank's measured memory must not change); other
  // devices' generators save theirs as their state tensor.
  std::optional<at::mt19937> cpu_engine_;
  std::optional<float> cpu_next_float_;
  std::optional<double> cpu_next_double_;
  at::Tensor state_;
  c10::Device device_{c10::kCPU};
};

} // namespace shardtensor::dispatch
