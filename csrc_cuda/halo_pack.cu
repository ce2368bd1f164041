#include "halo_pack.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

namespace shardtensor::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void pack_rows_kernel(const T* __restrict__ src, T* __restrict__ dst, const int64_t* __restrict__ rows,
                                 int64_t n_rows, int64_t dim_size, int64_t inner, int64_t total) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % inner;
    const int64_t r = (idx / inner) % n_rows;
    const int64_t o = idx / (inner * n_rows);
    dst[idx] = src[(o * dim_size + rows[r]) * inner + i];
  }
}

template <typename T>
__global__ void add_rows_kernel(const T* __restrict__ src, T* __restrict__ dst, const int64_t* __restrict__ rows,
                                int64_t n_rows, int64_t dim_size, int64_t inner, int64_t total) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % inner;
    const int64_t r = (idx / inner) % n_rows;
    const int64_t o = idx / (inner * n_rows);
    atomicAdd(dst + (o * dim_size + rows[r]) * inner + i, src[idx]);
  }
}

unsigned blocks_for(int64_t total) {
  const int64_t b = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? b : 65535);
}

} // namespace

void pack_rows(const void* src, void* dst, const int64_t* rows, int64_t n_rows, int64_t outer, int64_t dim_size,
               int64_t inner, int64_t element_size, void* stream) {
  const int64_t total = outer * n_rows * inner;
  if (total == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const auto b = blocks_for(total);
  switch (element_size) {
    case 1: pack_rows_kernel<<<b, kThreads, 0, s>>>(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), rows, n_rows, dim_size, inner, total); break;
    case 2: pack_rows_kernel<<<b, kThreads, 0, s>>>(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, n_rows, dim_size, inner, total); break;
    case 4: pack_rows_kernel<<<b, kThreads, 0, s>>>(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), rows, n_rows, dim_size, inner, total); break;
    default: pack_rows_kernel<<<b, kThreads, 0, s>>>(static_cast<const uint64_t*>(src), static_cast<uint64_t*>(dst), rows, n_rows, dim_size, inner, total); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void add_rows(const void* src, void* dst, const int64_t* rows, int64_t n_rows, int64_t outer, int64_t dim_size,
              int64_t inner, bool is_double, void* stream) {
  const int64_t total = outer * n_rows * inner;
  if (total == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const auto b = blocks_for(total);
  if (is_double) {
    add_rows_kernel<<<b, kThreads, 0, s>>>(static_cast<const double*>(src), static_cast<double*>(dst), rows, n_rows, dim_size, inner, total);
  } else {
    add_rows_kernel<<<b, kThreads, 0, s>>>(static_cast<const float*>(src), static_cast<float*>(dst), rows, n_rows, dim_size, inner, total);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace shardtensor::cuda
