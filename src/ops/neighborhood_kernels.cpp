// CPU neighbourhood-attention kernels and the device switch. Inputs are viewed as [B, X, Y, Z, H, D] (missing
// spatial dims have extent 1 and kernel 1), computed in float (double for double inputs: gradcheck).
// Forward: one task per (query, head), two passes over its window with a K^d score buffer per thread (exact
// softmax, no online rescaling error). Backward: one task per (batch, head), so the dk/dv rows a task adds into
// belong to it alone (no atomics, deterministic); with fewer (batch, head) pairs than threads, a two-pass form
// (dq per query, then dk/dv per key) instead.
#include "ops/neighborhood_kernels.h"

#ifdef SHARDTENSOR_HAVE_CUDA
#include "neighborhood_attention.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace shardtensor::ops::na {

namespace {

struct Dims {
  int64_t batch = 0, heads = 0, dim = 0, dim_v = 0;
  std::array<int64_t, 3> qn{1, 1, 1}, kn{1, 1, 1};
  Geometry g;
};

at::ScalarType acc_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

Dims dims_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Geometry& g) {
  const auto nd = g.nd;
  TORCH_CHECK_VALUE(nd >= 1 && nd <= 3, "neighborhood_attention: 1 to 3 spatial dims, got ", nd);
  TORCH_CHECK_VALUE(q.dim() == nd + 3 && k.dim() == nd + 3 && v.dim() == nd + 3,
                    "neighborhood_attention: with ", nd, " spatial dims, query, key and value must have ", nd + 3,
                    " dims [B, spatial..., heads, head_dim], got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && k.size(0) == v.size(0) && q.size(nd + 1) == k.size(nd + 1) &&
                        k.size(nd + 1) == v.size(nd + 1) && q.size(nd + 2) == k.size(nd + 2),
                    "neighborhood_attention: batch, heads and head_dim of query and key (and batch, heads of value) "
                    "must match, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  for (int64_t d = 0; d < nd; ++d)
    TORCH_CHECK_VALUE(k.size(1 + d) == v.size(1 + d), "neighborhood_attention: key and value spatial sizes differ: ",
                      k.sizes(), " vs ", v.sizes());
  TORCH_CHECK_VALUE(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
                    "neighborhood_attention: query, key and value must have one dtype, got ", q.scalar_type(), ", ",
                    k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK_VALUE(q.device() == k.device() && k.device() == v.device(),
                    "neighborhood_attention: query, key and value must be on one device");
  Dims s;
  s.batch = q.size(0);
  s.heads = q.size(nd + 1);
  s.dim = q.size(nd + 2);
  s.dim_v = v.size(nd + 2);
  s.g = g;
  for (int64_t d = 0; d < nd; ++d) {
    s.qn[d] = q.size(1 + d);
    s.kn[d] = k.size(1 + d);
    const auto K = g.kernel[d], L = g.extent[d], dil = g.dilation[d];
    TORCH_CHECK_VALUE(K >= 1 && K % 2 == 1, "neighborhood_attention: kernel sizes must be odd and positive, got ", K);
    TORCH_CHECK_VALUE(dil >= 1, "neighborhood_attention: dilation must be positive, got ", dil);
    TORCH_CHECK_VALUE(L >= K * dil, "neighborhood_attention: spatial dim ", d, " has extent ", L,
                      " smaller than the kernel size ", K, " times the dilation ", dil,
                      "; use kernel_size * dilation <= the extent");
    if (s.qn[d] == 0) continue;
    TORCH_CHECK_VALUE(g.q_offset[d] >= 0 && g.q_offset[d] + s.qn[d] <= L,
                      "neighborhood_attention: local queries outside the global extent along spatial dim ", d);
    const auto [lo_g, hi_g] = window_union(g.q_offset[d], s.qn[d], K, L, dil);
    const auto lo = lo_g - g.k_offset[d], hi = hi_g - g.k_offset[d];
    TORCH_CHECK_VALUE(lo >= 0 && hi <= s.kn[d],
                      "neighborhood_attention: the local keys along spatial dim ", d, " (global rows [",
                      g.k_offset[d], ", ", g.k_offset[d] + s.kn[d], ")) do not cover the windows of the local "
                      "queries (global rows [", g.q_offset[d], ", ", g.q_offset[d] + s.qn[d], "))");
  }
  for (int64_t d = nd; d < 3; ++d)
    s.g.kernel[d] = 1, s.g.dilation[d] = 1, s.g.extent[d] = 1, s.g.q_offset[d] = 0, s.g.k_offset[d] = 0;
  return s;
}

// The position of task w = flat (b, x, y, z, h) and its local window start per dim.
struct Query {
  int64_t b, h;
  std::array<int64_t, 3> ws;
};

inline Query locate(int64_t w, const Dims& s) {
  Query p;
  p.h = w % s.heads;
  int64_t r = w / s.heads;
  std::array<int64_t, 3> pos{};
  for (int d = 2; d >= 0; --d) {
    pos[d] = r % s.qn[d];
    r /= s.qn[d];
  }
  p.b = r;
  for (int d = 0; d < 3; ++d)
    p.ws[d] = window_start(s.g.q_offset[d] + pos[d], s.g.kernel[d], s.g.extent[d], s.g.dilation[d]) - s.g.k_offset[d];
  return p;
}

// Flat (b, key position, h) row of window element (a, b, c).
inline int64_t key_row(const Query& p, const Dims& s, int64_t a, int64_t b, int64_t c) {
  const auto& dl = s.g.dilation;
  return (((p.b * s.kn[0] + p.ws[0] + a * dl[0]) * s.kn[1] + p.ws[1] + b * dl[1]) * s.kn[2] + p.ws[2] + c * dl[2]) *
      s.heads + p.h;
}

template <typename T>
inline T dot(const T* x, const T* y, int64_t n) {
  T acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * y[i];
  return acc;
}

template <typename T>
void cpu_forward(const T* q, const T* k, const T* v, T* out, T* lse, const Dims& s, T scale) {
  const int64_t nq = s.batch * s.qn[0] * s.qn[1] * s.qn[2] * s.heads;
  const auto& K = s.g.kernel;
  const int64_t window = K[0] * K[1] * K[2];
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, window * (s.dim + s.dim_v)));
  at::parallel_for(0, nq, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> score(window), acc(s.dim_v);
    for (int64_t w = begin; w < end; ++w) {
      const auto p = locate(w, s);
      const T* qp = q + w * s.dim;
      T m = -std::numeric_limits<T>::infinity();
      int64_t j = 0;
      for (int64_t a = 0; a < K[0]; ++a)
        for (int64_t b = 0; b < K[1]; ++b)
          for (int64_t c = 0; c < K[2]; ++c, ++j) {
            score[j] = dot(qp, k + key_row(p, s, a, b, c) * s.dim, s.dim) * scale;
            m = std::max(m, score[j]);
          }
      std::fill(acc.begin(), acc.end(), T(0));
      T sum = 0;
      j = 0;
      for (int64_t a = 0; a < K[0]; ++a)
        for (int64_t b = 0; b < K[1]; ++b)
          for (int64_t c = 0; c < K[2]; ++c, ++j) {
            const T e = std::exp(score[j] - m);
            sum += e;
            const T* vp = v + key_row(p, s, a, b, c) * s.dim_v;
            for (int64_t d = 0; d < s.dim_v; ++d) acc[d] += e * vp[d];
          }
      T* op = out + w * s.dim_v;
      for (int64_t d = 0; d < s.dim_v; ++d) op[d] = acc[d] / sum;
      lse[w] = m + std::log(sum);
    }
  });
}

template <typename T>
void cpu_backward(const T* go, const T* q, const T* k, const T* v, const T* out, const T* lse, T* dq, T* dk, T* dv,
                  const Dims& s, T scale) {
  const auto& K = s.g.kernel;
  const int64_t positions = s.qn[0] * s.qn[1] * s.qn[2];
  at::parallel_for(0, s.batch * s.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> dqa(s.dim);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      for (int64_t i = 0; i < positions; ++i) {
        const int64_t w = (b * positions + i) * s.heads + h;
        const auto p = locate(w, s);
        const T* qp = q + w * s.dim;
        const T* gp = go + w * s.dim_v;
        const T delta = dot(gp, out + w * s.dim_v, s.dim_v);
        std::fill(dqa.begin(), dqa.end(), T(0));
        for (int64_t a = 0; a < K[0]; ++a)
          for (int64_t bb = 0; bb < K[1]; ++bb)
            for (int64_t c = 0; c < K[2]; ++c) {
              const auto kr = key_row(p, s, a, bb, c);
              const T* kp = k + kr * s.dim;
              const T* vp = v + kr * s.dim_v;
              const T pr = std::exp(dot(qp, kp, s.dim) * scale - lse[w]);
              const T ds = pr * (dot(gp, vp, s.dim_v) - delta) * scale;
              T* dkp = dk + kr * s.dim;
              T* dvp = dv + kr * s.dim_v;
              for (int64_t d = 0; d < s.dim; ++d) {
                dqa[d] += ds * kp[d];
                dkp[d] += ds * qp[d];
              }
              for (int64_t d = 0; d < s.dim_v; ++d) dvp[d] += pr * gp[d];
            }
        std::copy(dqa.begin(), dqa.end(), dq + w * s.dim);
      }
    }
  });
}

// Per spatial dim, CSR lists: for each local key index, the local query indices whose windows contain it.
struct Inverse {
  std::vector<int64_t> start; // kn + 1 entries
  std::vector<int64_t> query;
};

Inverse inverse_of(const Dims& s, int d) {
  const auto& g = s.g;
  std::vector<std::vector<int64_t>> per(s.kn[d]);
  for (int64_t i = 0; i < s.qn[d]; ++i) {
    const auto ws = window_start(g.q_offset[d] + i, g.kernel[d], g.extent[d], g.dilation[d]) - g.k_offset[d];
    for (int64_t t = 0; t < g.kernel[d]; ++t) per[ws + t * g.dilation[d]].push_back(i);
  }
  Inverse inv;
  inv.start.push_back(0);
  for (const auto& l : per) {
    inv.query.insert(inv.query.end(), l.begin(), l.end());
    inv.start.push_back(static_cast<int64_t>(inv.query.size()));
  }
  return inv;
}

// Backward in two passes when (batch, head) pairs are fewer than the threads: dq per (query, head), then dk/dv per
// (key, head) over the queries whose windows contain the key (recomputing the probabilities). Twice the arithmetic
// of cpu_backward, but every task writes only its own rows, so all threads work and the result is deterministic.
template <typename T>
void cpu_backward_two_pass(const T* go, const T* q, const T* k, const T* v, const T* out, const T* lse, T* dq, T* dk,
                           T* dv, const Dims& s, T scale) {
  const auto& K = s.g.kernel;
  const int64_t nq = s.batch * s.qn[0] * s.qn[1] * s.qn[2] * s.heads;
  const int64_t nk = s.batch * s.kn[0] * s.kn[1] * s.kn[2] * s.heads;
  const int64_t window = K[0] * K[1] * K[2];
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, window * (s.dim + s.dim_v)));
  std::vector<T> delta(nq);
  at::parallel_for(0, nq, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> dqa(s.dim);
    for (int64_t w = begin; w < end; ++w) {
      const auto p = locate(w, s);
      const T* qp = q + w * s.dim;
      const T* gp = go + w * s.dim_v;
      const T dl = dot(gp, out + w * s.dim_v, s.dim_v);
      delta[w] = dl;
      std::fill(dqa.begin(), dqa.end(), T(0));
      for (int64_t a = 0; a < K[0]; ++a)
        for (int64_t b = 0; b < K[1]; ++b)
          for (int64_t c = 0; c < K[2]; ++c) {
            const auto kr = key_row(p, s, a, b, c);
            const T* kp = k + kr * s.dim;
            const T pr = std::exp(dot(qp, kp, s.dim) * scale - lse[w]);
            const T ds = pr * (dot(gp, v + kr * s.dim_v, s.dim_v) - dl) * scale;
            for (int64_t d = 0; d < s.dim; ++d) dqa[d] += ds * kp[d];
          }
      std::copy(dqa.begin(), dqa.end(), dq + w * s.dim);
    }
  });
  const std::array<Inverse, 3> inv{inverse_of(s, 0), inverse_of(s, 1), inverse_of(s, 2)};
  at::parallel_for(0, nk, grain, [&](int64_t begin, int64_t end) {
    for (int64_t kr = begin; kr < end; ++kr) {
      const int64_t h = kr % s.heads;
      int64_t r = kr / s.heads;
      std::array<int64_t, 3> pos{};
      for (int d = 2; d >= 0; --d) {
        pos[d] = r % s.kn[d];
        r /= s.kn[d];
      }
      const int64_t b = r;
      const T* kp = k + kr * s.dim;
      const T* vp = v + kr * s.dim_v;
      T* dkp = dk + kr * s.dim;
      T* dvp = dv + kr * s.dim_v;
      for (auto i0 = inv[0].start[pos[0]]; i0 < inv[0].start[pos[0] + 1]; ++i0)
        for (auto i1 = inv[1].start[pos[1]]; i1 < inv[1].start[pos[1] + 1]; ++i1)
          for (auto i2 = inv[2].start[pos[2]]; i2 < inv[2].start[pos[2] + 1]; ++i2) {
            const int64_t w =
                (((b * s.qn[0] + inv[0].query[i0]) * s.qn[1] + inv[1].query[i1]) * s.qn[2] + inv[2].query[i2]) *
                    s.heads + h;
            const T* qp = q + w * s.dim;
            const T* gp = go + w * s.dim_v;
            const T pr = std::exp(dot(qp, kp, s.dim) * scale - lse[w]);
            const T ds = pr * (dot(gp, vp, s.dim_v) - delta[w]) * scale;
            for (int64_t d = 0; d < s.dim; ++d) dkp[d] += ds * qp[d];
            for (int64_t d = 0; d < s.dim_v; ++d) dvp[d] += pr * gp[d];
          }
    }
  });
}

std::vector<int64_t> lse_shape(const at::Tensor& q, int64_t nd) {
  auto r = q.sizes().vec();
  r.pop_back();
  return r;
}

#ifdef SHARDTENSOR_HAVE_CUDA
cuda::NaShape cuda_shape(const Dims& s, double scale) {
  cuda::NaShape c;
  c.batch = s.batch;
  c.heads = s.heads;
  c.dim = s.dim;
  c.dim_v = s.dim_v;
  for (int d = 0; d < 3; ++d) {
    c.q_size[d] = s.qn[d];
    c.k_size[d] = s.kn[d];
    c.kernel[d] = s.g.kernel[d];
    c.dilation[d] = s.g.dilation[d];
    c.q_offset[d] = s.g.q_offset[d];
    c.k_offset[d] = s.g.k_offset[d];
    c.extent[d] = s.g.extent[d];
  }
  c.scale = scale;
  return c;
}

cuda::NaDtype cuda_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::NaDtype::kFloat;
    case at::kDouble: return cuda::NaDtype::kDouble;
    case at::kHalf: return cuda::NaDtype::kHalf;
    case at::kBFloat16: return cuda::NaDtype::kBFloat16;
    default: TORCH_CHECK_VALUE(false, "neighborhood_attention: unsupported dtype ", t);
  }
}

void check_cuda_dims(const Dims& s) {
  TORCH_CHECK_NOT_IMPLEMENTED(s.dim <= cuda::kNaMaxHeadDim && s.dim_v <= cuda::kNaMaxHeadDim,
                              "neighborhood_attention on CUDA: head dims up to ", cuda::kNaMaxHeadDim,
                              " are supported, got ", s.dim, " and ", s.dim_v, "; split the heads further");
}
#endif

void check_device(const at::Tensor& q) {
  TORCH_CHECK_NOT_IMPLEMENTED(q.device().is_cpu() || q.device().is_cuda(),
                              "neighborhood_attention: CPU and CUDA tensors are supported, got ", q.device());
#ifndef SHARDTENSOR_HAVE_CUDA
  TORCH_CHECK_NOT_IMPLEMENTED(!q.device().is_cuda(),
                              "neighborhood_attention: this ShardTensor build has no CUDA kernels (built without a "
                              "CUDA toolkit); rebuild with CUDA or run on CPU tensors");
#endif
}

} // namespace

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const Geometry& g, double scale) {
  const auto s = dims_of(q, k, v, g);
  check_device(q);
  const auto nd = g.nd;
  const auto acc = acc_type(q.scalar_type());
  auto out_shape = q.sizes().vec();
  out_shape.back() = s.dim_v;
  auto lse = at::empty(lse_shape(q, nd), q.options().dtype(acc));
#ifdef SHARDTENSOR_HAVE_CUDA
  if (q.is_cuda()) {
    check_cuda_dims(s);
    c10::cuda::CUDAGuard guard(q.device());
    auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    auto out = at::empty(out_shape, q.options());
    cuda::na_forward(qc.const_data_ptr(), kc.const_data_ptr(), vc.const_data_ptr(), out.data_ptr(), lse.data_ptr(),
                     cuda_shape(s, scale), cuda_dtype(q.scalar_type()),
                     c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
    return {out, lse};
  }
#endif
  auto qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
  auto out = at::empty(out_shape, q.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "neighborhood_attention_forward", [&] {
    cpu_forward<scalar_t>(qc.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(), vc.const_data_ptr<scalar_t>(),
                          out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), s, static_cast<scalar_t>(scale));
  });
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                        const at::Tensor& lse, const Geometry& g, double scale) {
  const auto s = dims_of(q, k, v, g);
  check_device(q);
  auto out_shape = q.sizes().vec();
  out_shape.back() = s.dim_v;
  TORCH_CHECK_VALUE(grad_out.sizes() == at::IntArrayRef(out_shape) && out.sizes() == at::IntArrayRef(out_shape),
                    "neighborhood_attention backward: grad_out and out must have shape ", at::IntArrayRef(out_shape),
                    ", got ", grad_out.sizes(), " and ", out.sizes());
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef(lse_shape(q, g.nd)),
                    "neighborhood_attention backward: lse must have shape ", at::IntArrayRef(lse_shape(q, g.nd)),
                    ", got ", lse.sizes());
  const auto acc = acc_type(q.scalar_type());
  auto dq = at::zeros(q.sizes(), q.options().dtype(acc));
  auto dk = at::zeros(k.sizes(), k.options().dtype(acc));
  auto dv = at::zeros(v.sizes(), v.options().dtype(acc));
#ifdef SHARDTENSOR_HAVE_CUDA
  if (q.is_cuda()) {
    check_cuda_dims(s);
    c10::cuda::CUDAGuard guard(q.device());
    const auto t = q.scalar_type();
    auto gc = grad_out.to(t).contiguous(), qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(),
         oc = out.to(t).contiguous(), lc = lse.to(acc).contiguous();
    cuda::na_backward(gc.const_data_ptr(), qc.const_data_ptr(), kc.const_data_ptr(), vc.const_data_ptr(),
                      oc.const_data_ptr(), lc.const_data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                      cuda_shape(s, scale), cuda_dtype(t),
                      c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
    return {dq.to(t), dk.to(t), dv.to(t)};
  }
#endif
  auto gc = grad_out.to(acc).contiguous(), qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(),
       vc = v.to(acc).contiguous(), oc = out.to(acc).contiguous(), lc = lse.to(acc).contiguous();
  AT_DISPATCH_FLOATING_TYPES(acc, "neighborhood_attention_backward", [&] {
    // Few (batch, head) pairs for the threads: the two-pass form keeps every thread busy.
    auto* fn = s.batch * s.heads >= at::get_num_threads() ? &cpu_backward<scalar_t> : &cpu_backward_two_pass<scalar_t>;
    fn(gc.const_data_ptr<scalar_t>(), qc.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(),
       vc.const_data_ptr<scalar_t>(), oc.const_data_ptr<scalar_t>(), lc.const_data_ptr<scalar_t>(),
       dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), s, static_cast<scalar_t>(scale));
  });
  const auto t = q.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t)};
}

} // namespace shardtensor::ops::na
