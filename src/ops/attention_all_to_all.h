// Head-parallel attention: sequence shards -> head shards (an all-to-all each for q, k, v), local attention on
// whole sequences, back.
#pragma once

#include "ops/attention_seq.h"
#include "ops/common.h"

#include <functional>
#include <optional>

namespace shardtensor::ops::attention {

// The canonical inputs of sharded SDPA (after Partial resolution and layout targeting) with their targets.
struct CanonicalQkv {
  at::Tensor q, k, v;  // in the target layouts below
  Placements tq, tk;   // target placements of q and of k/v
  DimExtents xq, xk;   // target extents
  int64_t gqa = 1;
};

// Decided from specs, sizes and the strategy (the same on every rank). `refuse_heads_sharded` is called when the
// all-to-all strategy is forced but a heads dim is sharded.
bool use_all_to_all(const Layout& l, const CanonicalQkv& in, bool is_causal, const std::function<void()>& refuse_heads_sharded);

// The head-parallel computation; the output is in q's target layout.
at::Tensor all_to_all_attention(const Layout& l, const CanonicalQkv& in, const std::optional<at::Tensor>& mask,
                                bool is_causal, double scale, bool enable_gqa);

} // namespace shardtensor::ops::attention
