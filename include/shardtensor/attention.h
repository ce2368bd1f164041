// Attention over sharded sequences: the strategy policy of F.scaled_dot_product_attention on ShardTensors.
#pragma once

#include <string>

namespace shardtensor {

// "ring": K/V blocks travel around the ring of the mesh dim that shards the sequence (log-sum-exp merge); causal
// self-attention runs in the zigzag layout (rank c computes sequence chunks c and 2n-1-c of 2n: balanced work).
// "ring_contiguous": the ring on the contiguous shards (no zigzag permutation; unbalanced when causal).
// "all_to_all": sequence shards -> head shards (all-to-all), local attention on full sequences, back.
// "auto" (default): all-to-all when the key/value heads divide evenly by the mesh dim size and the attention is
// causal or it moves no more bytes than the ring, else the ring. Process-wide; returns the previous setting. Every rank of a mesh
// must use the same setting (the choice decides which collectives run).
std::string set_attention_strategy(const std::string& strategy);
std::string attention_strategy();

} // namespace shardtensor
