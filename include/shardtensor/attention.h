// Attention over sharded sequences: the strategy policy of F.scaled_dot_product_attention on ShardTensors.
#pragma once

#include <optional>
#include <string>

namespace shardtensor {

// How scaled_dot_product_attention computes when queries and keys/values are sequence-sharded on one mesh dim.
enum class AttentionStrategy {
  // All-to-all when the key/value heads divide evenly by the mesh dim size and the attention is causal or it
  // moves no more bytes than the ring, else the ring (the default).
  Auto,
  // K/V blocks travel around the ring of the mesh dim that shards the sequence (log-sum-exp merge); causal
  // self-attention runs in the zigzag layout (rank c computes sequence chunks c and 2n-1-c of 2n: balanced work).
  Ring,
  // The ring on the contiguous shards (no zigzag permutation; unbalanced when causal).
  RingContiguous,
  // Sequence shards -> head shards (all-to-all), local attention on full sequences, back.
  AllToAll,
};

// The process-wide default; returns the previous one. Every rank of a mesh must use the same setting (the choice
// decides which collectives run): set it before threads that run attention start, or use the thread's setting.
AttentionStrategy set_attention_strategy(AttentionStrategy strategy);
// This thread's own setting, which wins over the default on this thread only (std::nullopt: follow the default);
// returns the previous one. Another thread running attention meanwhile is not affected.
std::optional<AttentionStrategy> set_thread_attention_strategy(std::optional<AttentionStrategy> strategy);
std::optional<AttentionStrategy> thread_attention_strategy();
// The strategy in effect on this thread. Read once per attention call: the backward reuses the forward's choice.
AttentionStrategy attention_strategy();

// "auto", "ring", "ring_contiguous", "all_to_all" (the Python names); parsing raises ValueError otherwise.
std::string to_string(AttentionStrategy strategy);
AttentionStrategy parse_attention_strategy(const std::string& name);

} // namespace shardtensor
