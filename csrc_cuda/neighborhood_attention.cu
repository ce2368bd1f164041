// Neighbourhood attention on CUDA: one warp per (query, head). Each lane holds up to 8 of the head-dim values;
// dot products are reduced across the warp with shuffles. Forward: online softmax (running max and sum), so no
// score buffer at all. Backward: probabilities recomputed from the saved log-sum-exp; dq accumulates in
// registers, dk/dv are scattered with atomicAdd in the accumulation type (several queries share a key).
// Not yet run on a GPU (none was available when it was written); CPU results are the reference.
#include "neighborhood_attention.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

namespace shardtensor::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kPerLane = static_cast<int>(kNaMaxHeadDim / kWarp);
constexpr int kThreads = 128;

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <typename A> __device__ inline A load(const float* p) { return static_cast<A>(*p); }
template <typename A> __device__ inline A load(const double* p) { return static_cast<A>(*p); }
template <typename A> __device__ inline A load(const __half* p) { return static_cast<A>(__half2float(*p)); }
template <typename A> __device__ inline A load(const __nv_bfloat16* p) { return static_cast<A>(__bfloat162float(*p)); }

template <typename A> __device__ inline void store(float* p, A x) { *p = static_cast<float>(x); }
template <typename A> __device__ inline void store(double* p, A x) { *p = static_cast<double>(x); }
template <typename A> __device__ inline void store(__half* p, A x) { *p = __float2half(static_cast<float>(x)); }
template <typename A> __device__ inline void store(__nv_bfloat16* p, A x) {
  *p = __float2bfloat16(static_cast<float>(x));
}

template <typename A> __device__ inline A warp_sum(A x) {
  for (int off = kWarp / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ inline double exp_of(double x) { return exp(x); }
__device__ inline float exp_of(float x) { return expf(x); }
__device__ inline double log_of(double x) { return log(x); }
__device__ inline float log_of(float x) { return logf(x); }

// Passed by value to the kernels (plain ints: the shape struct's layout is the same on host and device).
struct Geo {
  long long batch, heads, dim, dim_v;
  long long qn[3], kn[3], K[3], dil[3], qo[3], ko[3], L[3];
  double scale;
};

__device__ inline long long window_start(long long g, long long K, long long L, long long dil) {
  const long long r = g % dil, len = (L - r + dil - 1) / dil;
  long long s = g / dil - K / 2;
  if (s < 0) s = 0;
  if (s > len - K) s = len - K;
  return r + s * dil;
}

// Decompose a warp's (query, head) index; returns the local key-window start per dim and the flat query row.
struct QueryPos {
  long long b, h, row; // row: flat index of (b, x, y, z) among the queries
  long long ws[3];
};

__device__ inline QueryPos locate(long long w, const Geo& g) {
  QueryPos p;
  p.h = w % g.heads;
  long long r = w / g.heads;
  p.row = r;
  long long pos[3];
  for (int d = 2; d >= 0; --d) {
    pos[d] = r % g.qn[d];
    r /= g.qn[d];
  }
  p.b = r;
  for (int d = 0; d < 3; ++d) p.ws[d] = window_start(g.qo[d] + pos[d], g.K[d], g.L[d], g.dil[d]) - g.ko[d];
  return p;
}

__device__ inline long long key_row(const QueryPos& p, const Geo& g, long long a, long long b, long long c) {
  return ((p.b * g.kn[0] + p.ws[0] + a * g.dil[0]) * g.kn[1] + p.ws[1] + b * g.dil[1]) * g.kn[2] + p.ws[2] +
      c * g.dil[2];
}

template <typename T>
__global__ void forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                               T* __restrict__ out, typename AccOf<T>::type* __restrict__ lse, Geo g, long long nq) {
  using A = typename AccOf<T>::type;
  const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (w >= nq) return; // the whole warp leaves together
  const QueryPos p = locate(w, g);
  const A scale = static_cast<A>(g.scale);
  A qr[kPerLane], acc[kPerLane];
  const T* qp = q + w * g.dim;
  for (int i = 0; i < kPerLane; ++i) {
    const long long d = lane + i * kWarp;
    qr[i] = d < g.dim ? load<A>(qp + d) : A(0);
    acc[i] = A(0);
  }
  A m = -INFINITY, l = A(0);
  for (long long a = 0; a < g.K[0]; ++a)
    for (long long b = 0; b < g.K[1]; ++b)
      for (long long c = 0; c < g.K[2]; ++c) {
        const long long kr = key_row(p, g, a, b, c) * g.heads + p.h;
        const T* kp = k + kr * g.dim;
        A s = A(0);
        for (int i = 0; i < kPerLane; ++i) {
          const long long d = lane + i * kWarp;
          if (d < g.dim) s += qr[i] * load<A>(kp + d);
        }
        s = warp_sum(s) * scale;
        const A mn = s > m ? s : m;
        const A corr = exp_of(m - mn);
        const A e = exp_of(s - mn);
        l = l * corr + e;
        const T* vp = v + kr * g.dim_v;
        for (int i = 0; i < kPerLane; ++i) {
          const long long d = lane + i * kWarp;
          if (d < g.dim_v) acc[i] = acc[i] * corr + e * load<A>(vp + d);
        }
        m = mn;
      }
  T* op = out + w * g.dim_v;
  for (int i = 0; i < kPerLane; ++i) {
    const long long d = lane + i * kWarp;
    if (d < g.dim_v) store(op + d, acc[i] / l);
  }
  if (lane == 0) lse[w] = m + log_of(l);
}

template <typename T>
__global__ void backward_kernel(const T* __restrict__ go, const T* __restrict__ q, const T* __restrict__ k,
                                const T* __restrict__ v, const T* __restrict__ out,
                                const typename AccOf<T>::type* __restrict__ lse, typename AccOf<T>::type* dq,
                                typename AccOf<T>::type* dk, typename AccOf<T>::type* dv, Geo g, long long nq) {
  using A = typename AccOf<T>::type;
  const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (w >= nq) return;
  const QueryPos p = locate(w, g);
  const A scale = static_cast<A>(g.scale);
  A qr[kPerLane], gr[kPerLane], dqr[kPerLane];
  A delta = A(0);
  for (int i = 0; i < kPerLane; ++i) {
    const long long d = lane + i * kWarp;
    qr[i] = d < g.dim ? load<A>(q + w * g.dim + d) : A(0);
    gr[i] = d < g.dim_v ? load<A>(go + w * g.dim_v + d) : A(0);
    if (d < g.dim_v) delta += gr[i] * load<A>(out + w * g.dim_v + d);
    dqr[i] = A(0);
  }
  delta = warp_sum(delta);
  const A lq = lse[w];
  for (long long a = 0; a < g.K[0]; ++a)
    for (long long b = 0; b < g.K[1]; ++b)
      for (long long c = 0; c < g.K[2]; ++c) {
        const long long kr = key_row(p, g, a, b, c) * g.heads + p.h;
        const T* kp = k + kr * g.dim;
        const T* vp = v + kr * g.dim_v;
        A s = A(0), dp = A(0);
        for (int i = 0; i < kPerLane; ++i) {
          const long long d = lane + i * kWarp;
          if (d < g.dim) s += qr[i] * load<A>(kp + d);
          if (d < g.dim_v) dp += gr[i] * load<A>(vp + d);
        }
        s = warp_sum(s) * scale;
        dp = warp_sum(dp);
        const A pr = exp_of(s - lq);
        const A ds = pr * (dp - delta) * scale;
        for (int i = 0; i < kPerLane; ++i) {
          const long long d = lane + i * kWarp;
          if (d < g.dim) {
            dqr[i] += ds * load<A>(kp + d);
            atomicAdd(dk + kr * g.dim + d, ds * qr[i]);
          }
          if (d < g.dim_v) atomicAdd(dv + kr * g.dim_v + d, pr * gr[i]);
        }
      }
  for (int i = 0; i < kPerLane; ++i) {
    const long long d = lane + i * kWarp;
    if (d < g.dim) dq[w * g.dim + d] = dqr[i];
  }
}

Geo geo_of(const NaShape& s) {
  Geo g{};
  g.batch = s.batch;
  g.heads = s.heads;
  g.dim = s.dim;
  g.dim_v = s.dim_v;
  for (int d = 0; d < 3; ++d) {
    g.qn[d] = s.q_size[d];
    g.kn[d] = s.k_size[d];
    g.K[d] = s.kernel[d];
    g.dil[d] = s.dilation[d];
    g.qo[d] = s.q_offset[d];
    g.ko[d] = s.k_offset[d];
    g.L[d] = s.extent[d];
  }
  g.scale = s.scale;
  return g;
}

long long queries_of(const NaShape& s) {
  return static_cast<long long>(s.batch) * s.q_size[0] * s.q_size[1] * s.q_size[2] * s.heads;
}

unsigned blocks_for(long long nq) {
  return static_cast<unsigned>((nq * kWarp + kThreads - 1) / kThreads);
}

template <typename T>
void launch_forward(const void* q, const void* k, const void* v, void* out, void* lse, const NaShape& s,
                    cudaStream_t st) {
  using A = typename AccOf<T>::type;
  const auto nq = queries_of(s);
  if (nq == 0) return;
  forward_kernel<T><<<blocks_for(nq), kThreads, 0, st>>>(static_cast<const T*>(q), static_cast<const T*>(k),
                                                         static_cast<const T*>(v), static_cast<T*>(out),
                                                         static_cast<A*>(lse), geo_of(s), nq);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_backward(const void* go, const void* q, const void* k, const void* v, const void* out, const void* lse,
                     void* dq, void* dk, void* dv, const NaShape& s, cudaStream_t st) {
  using A = typename AccOf<T>::type;
  const auto nq = queries_of(s);
  if (nq == 0) return;
  backward_kernel<T><<<blocks_for(nq), kThreads, 0, st>>>(
      static_cast<const T*>(go), static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
      static_cast<const T*>(out), static_cast<const A*>(lse), static_cast<A*>(dq), static_cast<A*>(dk),
      static_cast<A*>(dv), geo_of(s), nq);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace

void na_forward(const void* q, const void* k, const void* v, void* out, void* lse, const NaShape& s, NaDtype dtype,
                void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case NaDtype::kFloat: return launch_forward<float>(q, k, v, out, lse, s, st);
    case NaDtype::kDouble: return launch_forward<double>(q, k, v, out, lse, s, st);
    case NaDtype::kHalf: return launch_forward<__half>(q, k, v, out, lse, s, st);
    case NaDtype::kBFloat16: return launch_forward<__nv_bfloat16>(q, k, v, out, lse, s, st);
  }
}

void na_backward(const void* grad_out, const void* q, const void* k, const void* v, const void* out, const void* lse,
                 void* dq, void* dk, void* dv, const NaShape& s, NaDtype dtype, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case NaDtype::kFloat: return launch_backward<float>(grad_out, q, k, v, out, lse, dq, dk, dv, s, st);
    case NaDtype::kDouble: return launch_backward<double>(grad_out, q, k, v, out, lse, dq, dk, dv, s, st);
    case NaDtype::kHalf: return launch_backward<__half>(grad_out, q, k, v, out, lse, dq, dk, dv, s, st);
    case NaDtype::kBFloat16: return launch_backward<__nv_bfloat16>(grad_out, q, k, v, out, lse, dq, dk, dv, s, st);
  }
}

} // namespace shardtensor::cuda
