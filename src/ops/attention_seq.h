// Where the sequence of sharded attention lives: which mesh dim shards it, the per-coordinate segments of the
// layout the ring computes in (contiguous shards, or the zigzag layout for balanced causal attention), and the
// permutations between the two. Decided from specs and the strategy only, so every rank communicates alike.
#pragma once

#include "comm/halo.h"

#include <shardtensor/spec.h>

#include <ATen/ATen.h>

#include <vector>

namespace shardtensor::ops::attention {

// The canonical layout of q against k/v (both ShardTensors without Partial).
struct Layout {
  MeshPtr mesh;
  int64_t nd = 0;
  int64_t seq_mesh_dim = -1;  // the mesh dim sharding the sequence of q and/or k/v
  bool kv_ring = false;       // k/v sequence-sharded on seq_mesh_dim
  bool q_seq = false;         // q sequence-sharded on seq_mesh_dim
};

Layout layout_of(const at::Tensor& q, const at::Tensor& k);

// `shape` with dim `d` set to `v`.
std::vector<int64_t> with_dim(at::IntArrayRef shape, int64_t d, int64_t v);

// A run of consecutive global positions held at [start, start + len) of a local sequence.
struct Segment {
  int64_t start = 0, len = 0, global = 0;
};

// The sequence layout the ring computes in. Contiguous: coordinate c holds its shard, one segment. Zigzag (causal
// self-attention): the sequence is cut into 2n chunks and coordinate c holds chunks c and 2n-1-c, so every rank
// owns an early and a late chunk and the visible (lower-triangular) work is the same on every rank.
struct SeqLayout {
  bool zigzag = false;
  std::vector<int64_t> ext;                    // local sequence length per coordinate in this layout
  std::vector<std::vector<Segment>> segments;  // per coordinate
  comm::RowRequests to_zigzag, to_contiguous;  // gather_rows requests between the layouts (zigzag only)
  std::vector<int64_t> contiguous_ext;
};

// Causal self-attention over a ring whose queries and keys share one sequence layout, without a user mask (its
// rows would need the same permutation), unless the strategy asks for the contiguous ring.
bool use_zigzag(const Layout& l, const ShardSpec& qs, const ShardSpec& ks, bool causal, bool has_mask);

SeqLayout seq_layout(const Layout& l, const ShardSpec& ks, bool zigzag);

// Contiguous -> zigzag (and back) along the sequence dim: one gather_rows exchange per dtype for all of `ts`
// (q, k and v; or dO, q, k, v; or dQ, dK, dV travel together). Returns views into the received buffers.
std::vector<at::Tensor> to_zigzag(const std::vector<at::Tensor>& ts, const SeqLayout& s, const Layout& l);
std::vector<at::Tensor> to_contiguous(const std::vector<at::Tensor>& ts, const SeqLayout& s, const Layout& l);

} // namespace shardtensor::ops::attention
