// The attention of local queries against one block of keys/values: visibility, bias, forward with its
// log-sum-exp, backward given the global output and log-sum-exp, and the log-sum-exp merge of block outputs.
// Purely local (no communication); the ring and the all-to-all strategies build on it.
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <utility>

namespace shardtensor::ops::attention {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct BlockCfg {
  double scale = 1.0;
  bool causal = false;
  int64_t gqa = 1;   // query heads per key/value head
  int64_t qo = 0;    // global offset of the local queries (set per query segment)
  at::Tensor mask;   // additive (accumulate dtype), ndim = q.dim(), last dim the full key length (or 1); undefined if none
  int64_t nd = 4;
  int64_t keys = 0;  // the global key length (a block of all of them is the whole softmax row)
};

enum class Visibility { None, Full, Partial };

// The dtype block outputs, log-sum-exps and gradients accumulate in: fp64 for fp64 inputs, else fp32.
inline at::ScalarType accumulate_type(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// How much of a block of `nk` keys at global offset `ko` the `nq` queries at c.qo may see.
Visibility visibility(const BlockCfg& c, int64_t nq, int64_t ko, int64_t nk);

// `t` with a unit-stride head dim (last): itself when it has one, else a contiguous copy. The fused kernels read
// the head dim with unit stride without checking; a transposed/permuted q/k/v view must be made dense first.
at::Tensor unit_stride_head(const at::Tensor& t);

// One block's rows and columns: queries [q_start, q_start + nq) of the local sequence (global c.qo), keys
// [k_start, k_start + nk) of the block (global ko).
struct BlockRange {
  int64_t q_start = 0, nq = 0, ko = 0, nk = 0;
};

// (out, lse) in the accumulate dtype of the local queries `q` against the block `kb`/`vb` (already narrowed to the range).
std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                                                const BlockCfg& c, Visibility vis, const BlockRange& r);

// Saved forward results and the incoming gradient, narrowed to one block's query rows.
struct BlockGradInputs {
  at::Tensor q, k, v;      // the block's queries, keys and values (input dtype)
  at::Tensor qf;           // q in the accumulate dtype
  at::Tensor g, out, lse;  // output gradient (accumulate dtype), global output and log-sum-exp of these rows
  at::Tensor lse_safe;     // lse with -inf rows set to 0, unsqueezed (B, H, nq, 1)
  at::Tensor dsum;         // sum(g * out, -1, keepdim)
};

// Adds the block's contributions to dq (query rows) and dk, dv (block rows), accumulators in the accumulate dtype.
void block_backward(const BlockGradInputs& in, const BlockCfg& c, Visibility vis, const BlockRange& r,
                    at::Tensor dq, at::Tensor dk, at::Tensor dv);

// acc/acc_lse <- the log-sum-exp merge of (acc, acc_lse) and (o, lse), in place (views of the accumulators: the rows
// a block's queries own).
void merge(const at::Tensor& acc, const at::Tensor& acc_lse, const at::Tensor& o, const at::Tensor& lse);

} // namespace shardtensor::ops::attention
