// One thread per query; the points stream through shared memory in tiles that every thread of the block reads.
// Each thread keeps its best k candidates sorted: in registers for k <= 32 (point_search_topk.cuh RegisterList,
// capacity 8, 16 or 32), otherwise in its own output row (global memory, which stays in L1/L2 for moderate k).
// Selection and tie rule: point_search_topk.cuh.
#include "point_search.h"
#include "point_search_topk.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <type_traits>

namespace shardtensor::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int64_t kSharedBytes = 48 * 1024;
constexpr int64_t kMinTileRows = 4;

// KMAX > 0: register list of that capacity (k <= KMAX); KMAX == 0: the list lives in the output row.
template <typename T, int KMAX>
__global__ void point_search_kernel(const T* __restrict__ points, const T* __restrict__ queries,
                                    int64_t* __restrict__ indices, T* __restrict__ distances, int64_t batch, int64_t n,
                                    int64_t m, int64_t channels, int64_t k, T radius, T radius2_slack, bool bounded,
                                    int64_t tile_rows) {
  extern __shared__ unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);
  const int64_t qi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = qi < m;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const T* q = queries + (b * m + (active ? qi : 0)) * channels;
    int64_t* irow = indices + (b * m + (active ? qi : 0)) * k;
    T* drow = distances + (b * m + (active ? qi : 0)) * k;
    topk::RegisterList<T, (KMAX > 0 ? KMAX : 1)> reg;
    topk::RowList<T> row{drow, irow, k};
    if constexpr (KMAX > 0) reg.init();
    for (int64_t t0 = 0; t0 < n; t0 += tile_rows) {
      const int64_t rows = n - t0 < tile_rows ? n - t0 : tile_rows;
      __syncthreads();  // the previous tile is no longer read
      const T* src = points + (b * n + t0) * channels;
      for (int64_t e = threadIdx.x; e < rows * channels; e += blockDim.x) tile[e] = src[e];
      __syncthreads();
      if (!active) continue;
      for (int64_t j = 0; j < rows; ++j) {
        T d2 = 0;
        for (int64_t c = 0; c < channels; ++c) {
          const T diff = q[c] - tile[j * channels + c];
          d2 += diff * diff;
        }
        if (!topk::accept(d2, bounded, radius, radius2_slack)) continue;
        if constexpr (KMAX > 0) reg.insert(d2, t0 + j);
        else row.insert(d2, t0 + j);
      }
    }
    if (!active) continue;
    if constexpr (KMAX > 0) {
#pragma unroll
      for (int s = 0; s < KMAX; ++s) {
        if (s < k) {
          drow[s] = sqrt(reg.d[s]);  // empty slots: sqrt(+inf) = +inf, index -1
          irow[s] = reg.i[s];
        }
      }
    } else {
      row.finish();
    }
  }
}

template <typename T>
void launch(const void* points, const void* queries, int64_t* indices, void* distances, int64_t batch, int64_t n,
            int64_t m, int64_t channels, int64_t k, double radius, cudaStream_t stream) {
  if (batch == 0 || m == 0 || k == 0) return;
  const bool bounded = std::isfinite(radius);
  // The squared-distance prefilter has slack so that the boundary is decided on the returned (rounded) distance.
  const double r2 = bounded ? radius * radius * (1.0 + 1e-4) + 1e-30 : 0.0;
  int64_t tile_rows = channels > 0 ? kSharedBytes / (channels * static_cast<int64_t>(sizeof(T))) : 1024;
  if (tile_rows > 1024) tile_rows = 1024;
  if (tile_rows < 1) tile_rows = 1;
  const size_t shared = static_cast<size_t>(tile_rows * channels) * sizeof(T);
  const unsigned gx = static_cast<unsigned>((m + kThreads - 1) / kThreads);
  const unsigned gy = static_cast<unsigned>(batch < 65535 ? batch : 65535);
  auto run = [&](auto kmax) {
    point_search_kernel<T, decltype(kmax)::value><<<dim3(gx, gy), kThreads, shared, stream>>>(
        static_cast<const T*>(points), static_cast<const T*>(queries), indices, static_cast<T*>(distances), batch, n,
        m, channels, k, static_cast<T>(bounded ? radius : 0.0), static_cast<T>(r2), bounded, tile_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (k <= 8) run(std::integral_constant<int, 8>{});
  else if (k <= 16) run(std::integral_constant<int, 16>{});
  else if (k <= 32) run(std::integral_constant<int, 32>{});
  else run(std::integral_constant<int, 0>{});
}

} // namespace

int64_t point_search_max_channels(bool is_double) {
  return kSharedBytes / (kMinTileRows * (is_double ? 8 : 4));
}

void point_search(const void* points, const void* queries, int64_t* indices, void* distances, int64_t batch, int64_t n,
                  int64_t m, int64_t channels, int64_t k, double radius, bool is_double, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (is_double)
    launch<double>(points, queries, indices, distances, batch, n, m, channels, k, radius, s);
  else
    launch<float>(points, queries, indices, distances, batch, n, m, channels, k, radius, s);
}

} // namespace shardtensor::cuda
