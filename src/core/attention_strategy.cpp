// The process-wide attention strategy setting (read by the SDPA rule on every call).
#include <shardtensor/attention.h>

#include <c10/util/Exception.h>

#include <atomic>

namespace shardtensor {

namespace {
std::atomic<AttentionStrategy> g_strategy{AttentionStrategy::Auto};
} // namespace

AttentionStrategy set_attention_strategy(AttentionStrategy strategy) {
  return g_strategy.exchange(strategy);
}

AttentionStrategy attention_strategy() {
  return g_strategy.load();
}

std::string to_string(AttentionStrategy strategy) {
  switch (strategy) {
    case AttentionStrategy::Auto: return "auto";
    case AttentionStrategy::Ring: return "ring";
    case AttentionStrategy::RingContiguous: return "ring_contiguous";
    case AttentionStrategy::AllToAll: return "all_to_all";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown AttentionStrategy");
}

AttentionStrategy parse_attention_strategy(const std::string& name) {
  for (auto s : {AttentionStrategy::Auto, AttentionStrategy::Ring, AttentionStrategy::RingContiguous,
                 AttentionStrategy::AllToAll})
    if (to_string(s) == name) return s;
  TORCH_CHECK_VALUE(false, "set_attention_strategy: expected 'auto', 'ring', 'ring_contiguous' or 'all_to_all', got '",
                    name, "'");
}

} // namespace shardtensor
