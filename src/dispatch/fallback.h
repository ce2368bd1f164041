// The gather-compute fallback (public setting: include/shardtensor/fallback.h): an op without a domain-parallel
// rule, or whose rule declines, runs on the full tensors on every rank when its schema says it is functional.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>

namespace shardtensor::dispatch {

// Whether `op` may run through the fallback, from its schema and tags alone (so every rank decides alike): no
// argument or return carries an alias annotation (views, in-place and out= ops write or share a caller's tensor,
// which a gathered copy cannot), the schema is not mutable, the op is not random (nondeterministic_seeded: each
// rank's generator would draw different values), and it is not one of the few ops whose schema hides a write or
// that answers about a tensor's storage rather than its values.
bool fallback_allowed(const c10::OperatorHandle& op);

// Gathers every ShardTensor argument (Partial completed, shards all-gathered) to Replicate, runs the op on the
// plain full tensors, and leaves its returns on the stack, each tensor wrapped as a ShardTensor: laid out like the
// first sharded argument of the same global shape (a local slice: no communication), else Replicate. `why` is
// the rule's reason when a rule declined (empty: no rule); the op's first fallback in this process warns once.
// First of all it agrees with the other ranks of the mesh on strict mode and the size guard (see
// include/shardtensor/fallback.h), raising NotImplementedError on every rank when a rank is strict or the gather
// would exceed the budget.
void run_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why);

// A strict-mode rank's side of that agreement, called where it refuses an op the fallback could serve: its peers
// that are not strict are in run_fallback's round at the same point. Raises NotImplementedError with the same
// message as those peers when strict mode differs across ranks; returns when every rank is strict (the caller then
// raises its usual refusal).
void agree_before_strict_refusal(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why);

} // namespace shardtensor::dispatch
