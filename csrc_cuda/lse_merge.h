// CUDA kernel of the ring attention merge: combine a block's partial attention output with the running one by
// their log-sum-exps, in place. Plain C++ declarations: no CUDA headers needed.
#pragma once

#include <cstdint>

namespace shardtensor::cuda {

// For each of `rows` rows (contiguous fp32): m = logaddexp(acc_lse, lse);
// acc = acc * exp(acc_lse - m) + o * exp(lse - m); acc_lse = m. Rows where both are -inf (no visible key yet)
// stay zero with lse -inf. acc and o are [rows, dv], acc_lse and lse [rows].
void lse_merge(float* acc, float* acc_lse, const float* o, const float* lse, int64_t rows, int64_t dv, void* stream);

} // namespace shardtensor::cuda
