// Per-query candidate selection of the CUDA point search kernel, as host/device functions so the host C++ tests
// (tests/cpp/test_point_search_topk.cpp) check the exact logic the kernel runs. Order: ascending squared
// distance; candidates arrive in ascending point index and only a strictly smaller distance displaces an entry, so
// equal distances keep the lower index first (the tie rule of shardtensor::knn).
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define ST_HOST_DEVICE __host__ __device__ __forceinline__
#define ST_UNROLL _Pragma("unroll")
#else
#define ST_HOST_DEVICE inline
#define ST_UNROLL
#endif

namespace shardtensor::cuda::topk {

// Does a candidate at squared distance d2 qualify? NaN never does; with a bound the returned (rounded) distance
// sqrt(d2) is compared with the radius, after a cheap squared prefilter with slack.
template <typename T>
ST_HOST_DEVICE bool accept(T d2, bool bounded, T radius, T radius2_slack) {
  using std::sqrt;
  if (d2 != d2) return false;
  return !bounded || (d2 <= radius2_slack && sqrt(d2) <= radius);
}

// The KMAX best candidates in registers (fixed capacity, fully unrolled: no dynamic indexing, so the arrays are not
// spilled to local memory). Callers needing k < KMAX read the first k slots. Empty slots: +inf / -1.
template <typename T, int KMAX>
struct RegisterList {
  T d[KMAX];
  int64_t i[KMAX];

  ST_HOST_DEVICE void init() {
    ST_UNROLL
    for (int s = 0; s < KMAX; ++s) {
      d[s] = static_cast<T>(INFINITY);
      i[s] = -1;
    }
  }

  ST_HOST_DEVICE void insert(T d2, int64_t j) {
    if (!(d2 < d[KMAX - 1])) return;
    // From the top down: slots above the insertion point take their lower neighbour, the slot where the
    // neighbour is <= d2 takes the candidate; d[s - 1] is still the old value when slot s reads it.
    ST_UNROLL
    for (int s = KMAX - 1; s >= 0; --s) {
      if (d[s] > d2) {
        if (s > 0 && d[s - 1] > d2) {
          d[s] = d[s - 1];
          i[s] = i[s - 1];
        } else {
          d[s] = d2;
          i[s] = j;
        }
      }
    }
  }
};

// Any k: a sorted list kept in the caller's output row (global memory on the device).
template <typename T>
struct RowList {
  T* d;
  int64_t* i;
  int64_t k;
  int64_t count = 0;

  ST_HOST_DEVICE void insert(T d2, int64_t j) {
    if (count == k && !(d2 < d[k - 1])) return;
    int64_t pos = count < k ? count++ : k - 1;
    while (pos > 0 && d[pos - 1] > d2) {
      d[pos] = d[pos - 1];
      i[pos] = i[pos - 1];
      --pos;
    }
    d[pos] = d2;
    i[pos] = j;
  }

  // Squared distances -> distances; empty slots -> +inf / -1.
  ST_HOST_DEVICE void finish() {
    using std::sqrt;
    for (int64_t s = 0; s < count; ++s) d[s] = sqrt(d[s]);
    for (int64_t s = count; s < k; ++s) {
      d[s] = static_cast<T>(INFINITY);
      i[s] = -1;
    }
  }
};

} // namespace shardtensor::cuda::topk
