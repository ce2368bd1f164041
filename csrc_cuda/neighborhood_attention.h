// CUDA kernels of neighbourhood attention (NATTEN semantics: each query attends to the K^d keys of its window,
// shifted inward at the global borders). Plain C++ declarations, so the C++ library needs no CUDA headers.
//
// Layout: q [B, X, Y, Z, H, D], k [B, Xk, Yk, Zk, H, D], v [B, Xk, Yk, Zk, H, Dv], all contiguous; fewer spatial
// dims are passed as extent 1 with kernel 1. The queries sit at global positions q_offset + i, the keys held
// here start at global position k_offset; `extent` is the global spatial size (the clamping range). Dilation d:
// the window is taken inside the query's group of positions (g mod d), keys start + t*d.
#pragma once

#include <cstdint>

namespace shardtensor::cuda {

struct NaShape {
  int64_t batch = 0, heads = 0, dim = 0, dim_v = 0;
  int64_t q_size[3] = {1, 1, 1};
  int64_t k_size[3] = {1, 1, 1};
  int64_t kernel[3] = {1, 1, 1};
  int64_t dilation[3] = {1, 1, 1};
  int64_t q_offset[3] = {0, 0, 0};
  int64_t k_offset[3] = {0, 0, 0};
  int64_t extent[3] = {1, 1, 1};
  double scale = 1.0;
};

// Element types of q/k/v/out (lse, dq, dk, dv use the accumulation type: double for kDouble, float otherwise).
enum class NaDtype : int { kFloat = 0, kDouble = 1, kHalf = 2, kBFloat16 = 3 };

// The largest head dims a warp handles (8 values per lane).
constexpr int64_t kNaMaxHeadDim = 256;

// One warp per (query, head): online softmax over the window; writes out [.., H, Dv] and lse [.., H].
void na_forward(const void* q, const void* k, const void* v, void* out, void* lse, const NaShape& s, NaDtype dtype,
                void* stream);

// One warp per (query, head): dq written, dk/dv accumulated with atomics (zero them first). dq/dk/dv are in the
// accumulation type.
void na_backward(const void* grad_out, const void* q, const void* k, const void* v, const void* out, const void* lse,
                 void* dq, void* dk, void* dv, const NaShape& s, NaDtype dtype, void* stream);

} // namespace shardtensor::cuda
