#include "ops/attention_all_to_all.h"

#include <shardtensor/attention.h>

namespace shardtensor::ops::attention {

bool use_all_to_all(const Layout& l, const CanonicalQkv& in, bool is_causal,
                    const std::function<void()>& refuse_heads_sharded) {
  if (l.seq_mesh_dim < 0 || !l.q_seq || !l.kv_ring) return false;
  const auto strategy = attention_strategy();
  if (strategy == AttentionStrategy::Ring || strategy == AttentionStrategy::RingContiguous) return false;
  const auto nd = l.nd;
  bool heads_free = nd >= 3;
  for (int64_t m = 0; m < l.mesh->ndim() && heads_free; ++m)
    heads_free = !in.tq[m].is_shard(nd - 3) && !in.tk[m].is_shard(nd - 3);
  if (strategy == AttentionStrategy::AllToAll) {
    if (!heads_free) refuse_heads_sharded();
    return true;
  }
  if (!heads_free) return false;
  const auto n = l.mesh->size(l.seq_mesh_dim);
  const auto hq = in.q.size(nd - 3), hk = in.k.size(nd - 3);
  if (hk % n != 0) return false;
  // Bytes per rank (leading dims and n-1 factors cancel): ring moves n-1 K/V shards, the all-to-all moves
  // (n-1)/n of q, k, v and the output.
  const double sq = static_cast<double>(in.q.size(nd - 2)), skv = static_cast<double>(in.k.size(nd - 2));
  const double d = static_cast<double>(in.q.size(nd - 1)), dv = static_cast<double>(in.v.size(nd - 1));
  const double ring = skv * hk * (d + dv);
  const double a2a = (sq * hq * (d + dv) + skv * hk * (d + dv)) / static_cast<double>(n);
  // Causal self-attention: the all-to-all gives every rank whole sequences of its heads (balanced work) and moves
  // less than the ring, which, even balanced by the zigzag layout, passes K/V n-1 times plus two permutations.
  if (is_causal) return true;
  return a2a <= ring;
}

at::Tensor all_to_all_attention(const Layout& l, const CanonicalQkv& in, const std::optional<at::Tensor>& mask,
                                bool is_causal, double scale, bool enable_gqa) {
  const auto nd = l.nd;
  const auto sm = l.seq_mesh_dim, n = l.mesh->size(sm);
  auto hp_q = in.tq, hp_k = in.tk;
  hp_q[sm] = Placement::shard(nd - 3);
  hp_k[sm] = Placement::shard(nd - 3);
  auto hk_ext = default_split(in.k.size(nd - 3), n);
  auto hq_ext = hk_ext;
  for (auto& x : hq_ext) x *= in.gqa;
  auto xq_h = in.xq, xk_h = in.xk;
  xq_h.erase(nd - 2);
  xk_h.erase(nd - 2);
  xq_h[nd - 3] = hq_ext;
  xk_h[nd - 3] = hk_ext;
  auto qh = to_layout(in.q, hp_q, xq_h), kh = to_layout(in.k, hp_k, xk_h), vh = to_layout(in.v, hp_k, xk_h);
  at::Tensor oh;
  if (!mask || !mask->defined()) {
    // Whole sequences are local now: run PyTorch's own kernel (flash on CPU, with its own backward) on the local
    // tensors through differentiable to_local/from_local, rather than the ring's one-block math path.
    auto ql = to_local(qh), kl = to_local(kh), vl = to_local(vh);
    at::Tensor ol;
    if (ql.numel() == 0 || kl.numel() == 0) {
      // No local heads (uneven head split): an empty output that stays connected to the graph, so every rank runs
      // the same backward (and the same collectives).
      auto shape = ql.sizes().vec();
      shape.back() = vl.size(-1);
      ol = at::zeros(shape, ql.options()) + (ql.sum() + kl.sum() + vl.sum()) * 0;
    } else {
      ol = at::scaled_dot_product_attention(ql, kl, vl, std::nullopt, 0.0, is_causal, scale, enable_gqa);
    }
    const auto& qspec = *shard_impl(qh)->spec();
    oh = from_local(ol, qspec.mesh, qspec.placements, ShapeInference::Explicit, qspec.sharding_shapes());
  } else {
    // The heads-sharded call runs the ring rule with whole local sequences (one block).
    oh = at::scaled_dot_product_attention(qh, kh, vh, mask, 0.0, is_causal, scale, enable_gqa);
  }
  return to_layout(oh, in.tq, in.xq);
}

} // namespace shardtensor::ops::attention
