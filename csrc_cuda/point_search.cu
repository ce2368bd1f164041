// One thread per query; the points stream through shared memory in tiles that every thread of the block reads.
// Each thread keeps its best k candidates sorted in its own output row (global memory, which stays in L1/L2 for
// small k): an insertion step per accepted candidate. Candidates are visited in ascending point index and only a
// strictly smaller squared distance displaces an entry, so equal distances keep the lower index first (the tie
// rule of the CPU kernel).
#include "point_search.h"

#include <cuda_runtime.h>

#include <cmath>
#include <limits>

namespace shardtensor::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int64_t kSharedBytes = 48 * 1024;
constexpr int64_t kMinTileRows = 4;

template <typename T>
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
    T* drow = distances + (b * m + (active ? qi : 0)) * k;  // holds squared distances until the end
    int64_t count = 0;
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
        if (d2 != d2) continue;  // NaN coordinates never match
        if (bounded && (d2 > radius2_slack || sqrt(d2) > radius)) continue;
        if (count == k && !(d2 < drow[k - 1])) continue;
        int64_t pos = count < k ? count++ : k - 1;
        while (pos > 0 && drow[pos - 1] > d2) {
          drow[pos] = drow[pos - 1];
          irow[pos] = irow[pos - 1];
          --pos;
        }
        drow[pos] = d2;
        irow[pos] = t0 + j;
      }
    }
    if (active) {
      for (int64_t s = 0; s < count; ++s) drow[s] = sqrt(drow[s]);
      for (int64_t s = count; s < k; ++s) {
        drow[s] = static_cast<T>(INFINITY);
        irow[s] = -1;
      }
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
  point_search_kernel<T><<<dim3(gx, gy), kThreads, shared, stream>>>(
      static_cast<const T*>(points), static_cast<const T*>(queries), indices, static_cast<T*>(distances), batch, n, m,
      channels, k, static_cast<T>(bounded ? radius : 0.0), static_cast<T>(r2), bounded, tile_rows);
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
