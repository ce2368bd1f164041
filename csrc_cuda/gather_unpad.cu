// CUDA kernel: unpack a padded all-gather buffer [n, max_extent, inner] into the concatenation of the
// per-rank extents [sum(extents), inner] in one launch (instead of n narrow+copy launches).
#include <cuda_runtime.h>

#include <cstdint>

namespace shardtensor::cuda {

template <typename T>
__global__ void gather_unpad_kernel(const T* __restrict__ padded, T* __restrict__ out, const int64_t* __restrict__ offsets,
                                    int64_t n, int64_t max_extent, int64_t outer, int64_t inner, int64_t total_rows) {
  // out is [outer, total_rows, inner]; padded is [n, outer, max_extent, inner].
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t count = outer * total_rows * inner;
  if (idx >= count) return;
  const int64_t i = idx % inner;
  const int64_t row = (idx / inner) % total_rows;
  const int64_t o = idx / (inner * total_rows);
  // Which rank holds this row: offsets is the exclusive prefix sum (n + 1 entries).
  int64_t r = 0;
  while (r + 1 < n && offsets[r + 1] <= row) ++r;
  const int64_t local_row = row - offsets[r];
  out[idx] = padded[((r * outer + o) * max_extent + local_row) * inner + i];
}

// Host launcher, element size in bytes selects the type (values are moved, not interpreted).
void gather_unpad(const void* padded, void* out, const int64_t* offsets_device, int64_t n, int64_t max_extent,
                  int64_t outer, int64_t inner, int64_t total_rows, int64_t element_size, cudaStream_t stream) {
  const int64_t count = outer * total_rows * inner;
  if (count == 0) return;
  const int threads = 256;
  const auto blocks = static_cast<unsigned>((count + threads - 1) / threads);
  switch (element_size) {
    case 1: gather_unpad_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint8_t*>(padded), static_cast<uint8_t*>(out), offsets_device, n, max_extent, outer, inner, total_rows); break;
    case 2: gather_unpad_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint16_t*>(padded), static_cast<uint16_t*>(out), offsets_device, n, max_extent, outer, inner, total_rows); break;
    case 4: gather_unpad_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint32_t*>(padded), static_cast<uint32_t*>(out), offsets_device, n, max_extent, outer, inner, total_rows); break;
    default: gather_unpad_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint64_t*>(padded), static_cast<uint64_t*>(out), offsets_device, n, max_extent, outer, inner, total_rows); break;
  }
}

} // namespace shardtensor::cuda
