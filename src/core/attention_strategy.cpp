// The attention strategy setting: a process-wide default and a per-thread override (read by the SDPA rule once per
// call; the ring's backward reuses the forward's decision).
#include <shardtensor/attention.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <optional>

namespace shardtensor {

namespace {
std::atomic<AttentionStrategy> g_strategy{AttentionStrategy::Auto};
// A block's setting (`use_attention_strategy`) must not reach attention running on another thread at the same
// time: a rank's threads interleave differently on every rank, so a process-wide change made by one thread would
// send the ranks down different collectives.
thread_local std::optional<AttentionStrategy> t_override;
} // namespace

AttentionStrategy set_attention_strategy(AttentionStrategy strategy) {
  return g_strategy.exchange(strategy);
}

std::optional<AttentionStrategy> set_thread_attention_strategy(std::optional<AttentionStrategy> strategy) {
  auto previous = t_override;
  t_override = strategy;
  return previous;
}

std::optional<AttentionStrategy> thread_attention_strategy() {
  return t_override;
}

AttentionStrategy attention_strategy() {
  return t_override ? *t_override : g_strategy.load();
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
