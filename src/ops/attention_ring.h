// Ring attention: q against K/V blocks passed around the ring of the mesh dim that shards the sequence.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <utility>

namespace shardtensor::ops::attention {

// q, k, v: ShardTensors without Partial in the canonical layout (leading dims sharded alike, the sequence dim -2
// sharded on at most one mesh dim). Differentiable (its own backward, the ring again). `gqa`: query heads per
// key/value head.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double scale, bool causal, int64_t gqa);

// The attention written as ops with rules on ShardTensors -- scores q k^T * scale (keys and values repeated for
// grouped heads), the causal mask (top-left aligned, as torch's is_causal) and `mask` (boolean: where to attend;
// else added), softmax over the keys, times v -- recorded by autograd like any composition of ops: a learned bias
// gets its gradient, and a gradient of it can be differentiated again. With the key sequence sharded the score
// contraction gathers the keys (the matmul rule): memory grows with the full key length on each rank.
at::Tensor attention_by_rules(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                              bool causal, double scale, int64_t gqa);

// The same forward without autograd, with the log-sum-exp of every query over all keys (q's dims but the head dim,
// q's layout there; the accumulate dtype): what the fused attention kernels return (their backward takes it).
std::pair<at::Tensor, at::Tensor> ring_attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const std::optional<at::Tensor>& mask, double scale,
                                                          bool causal, int64_t gqa);

} // namespace shardtensor::ops::attention
