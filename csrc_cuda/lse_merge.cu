#include "lse_merge.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cmath>

namespace shardtensor::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

// One warp per row: every lane reads both log-sum-exps before lane 0 overwrites the running one, so the row's
// weights are computed once from consistent values and no second pass is needed.
__global__ void lse_merge_kernel(float* __restrict__ acc, float* __restrict__ acc_lse, const float* __restrict__ o,
                                 const float* __restrict__ lse, int64_t rows, int64_t dv) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float a = acc_lse[row], b = lse[row];
  const float m = fmaxf(a, b);
  float wa = 0.f, wb = 0.f, merged = -INFINITY;
  if (m != -INFINITY) {
    wa = __expf(a - m);  // exp(-inf) = 0 for a missing side
    wb = __expf(b - m);
    merged = m + __logf(wa + wb);
    const float s = wa + wb;
    wa /= s;
    wb /= s;
    // Normalising by s keeps acc the softmax-weighted average (acc is normalised by exp(acc_lse) already).
  }
  __syncwarp();
  float* acc_row = acc + row * dv;
  const float* o_row = o + row * dv;
  for (int64_t i = lane; i < dv; i += 32) acc_row[i] = m == -INFINITY ? acc_row[i] : acc_row[i] * wa + o_row[i] * wb;
  if (lane == 0) acc_lse[row] = merged;
}

} // namespace

void lse_merge(float* acc, float* acc_lse, const float* o, const float* lse, int64_t rows, int64_t dv, void* stream) {
  if (rows == 0) return;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  lse_merge_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      acc, acc_lse, o, lse, rows, dv);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace shardtensor::cuda
