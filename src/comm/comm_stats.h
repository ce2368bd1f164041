#pragma once

#include <shardtensor/comm_stats.h>

namespace shardtensor::comm {
// Count one collective of `bytes` bytes issued by this rank.
void record_collective(const char* kind, int64_t bytes);
} // namespace shardtensor::comm
