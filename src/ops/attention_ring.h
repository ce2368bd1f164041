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

// The same forward without autograd, with the log-sum-exp of every query over all keys (q's dims but the head dim,
// q's layout there; the accumulate dtype): what the fused attention kernels return (their backward takes it).
std::pair<at::Tensor, at::Tensor> ring_attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const std::optional<at::Tensor>& mask, double scale,
                                                          bool causal, int64_t gqa);

} // namespace shardtensor::ops::attention
