// Opt-in debugging check (SHARDTENSOR_CHECK_CONSISTENCY=1): before every op handled by a ShardTensor slot, the ranks
// of the op's mesh verify that they run the same op with the same argument layouts (placements, global shapes,
// sharding shapes, dtypes) and the same non-tensor arguments: one small all-reduce per mesh dim per op. A mismatch
// raises ValueError on every rank, naming the op, instead of a wrong number or a hang.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace shardtensor::dispatch {

bool consistency_check_enabled();
// Returns the previous setting (the environment variable gives the initial one).
bool set_consistency_check(bool enabled);

void check_op_consistency(const c10::OperatorHandle& op, const torch::jit::Stack* stack);

} // namespace shardtensor::dispatch
