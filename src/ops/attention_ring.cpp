// Ring attention. Forward: step t computes the local queries against the K/V block of coordinate (c - t) mod n
// while the next block is in flight (send to c+1, receive from c-1), and merges block outputs with their
// log-sum-exp. Backward: the same ring; dQ accumulates locally, dK/dV accumulate in buffers that travel with
// their block and are passed home after the last step. With only q sequence-sharded (k/v whole) the "ring" is one
// local block and dK/dV are all-reduced over the query shards.
#include "ops/attention_ring.h"

#include "comm/halo.h"
#include "comm/ring_loop.h"
#include "ops/attention_block.h"
#include "ops/attention_seq.h"
#include "ops/common.h"

#include <torch/autograd.h>

namespace shardtensor::ops::attention {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Everything the forward and the backward derive alike from the specs and the settings: the sequence layout
// (zigzag or contiguous), this rank's coordinate on the ring and its query segments.
struct RingSetup {
  Layout l;
  BlockCfg c;
  bool zigzag = false;
  SeqLayout sl;
  int64_t sm = -1, n = 1, me = 0;
  std::vector<Segment> qseg;  // the local queries' segments in the computing layout
};

// `zigzag`: the forward's decision when the backward sets up (the strategy may have changed since).
RingSetup ring_setup(const at::Tensor& q, const at::Tensor& k, BlockCfg c, std::optional<bool> zigzag = std::nullopt) {
  RingSetup s;
  s.l = layout_of(q, k);
  const auto& qs = *shard_impl(q)->spec();
  const auto& ks = *shard_impl(k)->spec();
  c.nd = s.l.nd;
  c.keys = k.size(s.l.nd - 2);
  s.c = std::move(c);
  s.zigzag = zigzag ? *zigzag : use_zigzag(s.l, qs, ks, s.c.causal, s.c.mask.defined());
  s.sl = seq_layout(s.l, ks, s.zigzag);
  s.sm = s.l.seq_mesh_dim;
  s.n = s.l.kv_ring ? s.l.mesh->size(s.sm) : 1;
  s.me = s.l.kv_ring ? s.l.mesh->coordinate(s.sm) : 0;
  s.qseg = s.zigzag ? s.sl.segments[s.me]
                    : std::vector<Segment>{Segment{0, qs.local_shape[s.l.nd - 2], qs.local_offset(s.l.nd - 2)}};
  return s;
}

// The ring the K/V blocks travel (one local block when k and v are whole).
comm::Ring ring_of(const RingSetup& s) {
  return s.n > 1 ? comm::Ring::along(*s.l.mesh, s.sm, s.l.nd - 2, s.sl.ext) : comm::Ring::local();
}

// The user mask aligned to the local queries as an additive bias (accumulate dtype) with q's number of dims.
at::Tensor local_mask_bias(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k, const Layout& l) {
  const auto& qs = *shard_impl(q)->spec();
  auto attn_shape = q.sizes().vec();
  attn_shape.back() = k.size(l.nd - 2);
  auto ml = local_aligned(resolve_partial(mask), l.mesh, attn_shape, qs.placements, qs.dim_extents());
  ml = ml.scalar_type() == at::kBool
           ? at::zeros(ml.sizes(), ml.options().dtype(accumulate_type(q))).masked_fill_(ml.logical_not(), kNegInf)
           : ml.to(accumulate_type(q));
  while (ml.dim() < l.nd) ml = ml.unsqueeze(0);
  return ml;
}

// The forward ring without autograd: the merged output and log-sum-exp of the local queries in the accumulate dtype
// and the computing layout (zigzag when used), and the setup that derived it.
struct RingForward {
  RingSetup s;
  at::Tensor acc, lse;
};

RingForward ring_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double scale, bool causal, int64_t gqa) {
  at::NoGradGuard no_grad;
  BlockCfg cfg;
  cfg.scale = scale;
  cfg.causal = causal;
  cfg.gqa = gqa;
  if (mask && mask->defined()) cfg.mask = local_mask_bias(*mask, q, k, layout_of(q, k));
  RingForward f{ring_setup(q, k, std::move(cfg)), {}, {}};
  auto& s = f.s;
  const auto nd = s.l.nd;
  // One dense copy of a strided local up front (the fused block kernels need a unit-stride head dim), not one
  // per block and step.
  at::Tensor ql = unit_stride_head(shard_impl(q)->local()), kb = unit_stride_head(shard_impl(k)->local()),
             vb = unit_stride_head(shard_impl(v)->local());
  if (s.zigzag) {
    auto z = to_zigzag({ql, kb, vb}, s.sl, s.l);
    ql = z[0];
    kb = z[1];
    vb = z[2];
  }
  const auto acc_type = accumulate_type(ql);
  f.acc = at::zeros(with_dim(ql.sizes(), nd - 1, v.size(nd - 1)), ql.options().dtype(acc_type));
  f.lse = at::full(with_dim(ql.sizes(), nd - 1, 1), kNegInf, ql.options().dtype(acc_type)).squeeze(-1);
  comm::ring_loop(ring_of(s), {kb, vb}, {}, [&](int64_t, int64_t owner, const auto& kv, auto&) {
    // No batch rows or heads here (an empty block along another mesh dim): the blocks still travel, nothing to
    // compute (the fused CPU kernel divides by the head count).
    if (ql.numel() == 0 || kv[0].numel() == 0) return;
    for (const auto& qg : s.qseg)
      for (const auto& kg : s.sl.segments[owner]) {
        s.c.qo = qg.global;
        auto vis = visibility(s.c, qg.len, kg.global, kg.len);
        if (vis == Visibility::None) continue;
        const BlockRange r{qg.start, qg.len, kg.global, kg.len};
        auto [o, lse] = block_forward(ql.narrow(nd - 2, qg.start, qg.len), kv[0].narrow(nd - 2, kg.start, kg.len),
                                      kv[1].narrow(nd - 2, kg.start, kg.len), s.c, vis, r);
        merge(f.acc.narrow(nd - 2, qg.start, qg.len), f.lse.narrow(nd - 2, qg.start, qg.len), o, lse);
      }
  });
  return f;
}

// The output ShardTensor (q's layout, q's dtype) from the forward's accumulator.
at::Tensor ring_output(const RingForward& f, const at::Tensor& q, const at::Tensor& v) {
  const auto nd = f.s.l.nd;
  const auto& qs = *shard_impl(q)->spec();
  auto out_local = f.acc.to(q.scalar_type());
  if (f.s.zigzag) out_local = to_contiguous({out_local}, f.s.sl, f.s.l)[0];
  auto out_shape = with_dim(q.sizes(), nd - 1, v.size(nd - 1));
  return make_shard_tensor(out_local,
                           ShardSpec::make_with_dim_extents(f.s.l.mesh, qs.placements, out_shape, qs.dim_extents()));
}

struct RingFn : torch::autograd::Function<RingFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale, bool causal, int64_t gqa) {
    ctx->set_materialize_grads(false);
    auto f = ring_forward(q, k, v, mask, scale, causal, gqa);
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["out"] = f.acc;  // in the computing layout (zigzag when used)
    ctx->saved_data["lse"] = f.lse;
    ctx->saved_data["mask"] = f.s.c.mask.defined() ? c10::IValue(f.s.c.mask) : c10::IValue();
    ctx->saved_data["mask_arg"] = mask && mask->defined() ? c10::IValue(*mask) : c10::IValue();  // as the user gave it
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["gqa"] = gqa;
    ctx->saved_data["zigzag"] = f.s.zigzag;
    return ring_output(f, q, v);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool recording = at::GradMode::is_enabled();  // create_graph: read before any NoGradGuard
    variable_list res(7);
    if (!grads[0].defined()) return res;
    if (recording) return recorded_backward(ctx, grads[0]);
    at::NoGradGuard no_grad;
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    BlockCfg cfg;
    cfg.scale = ctx->saved_data["scale"].toDouble();
    cfg.causal = ctx->saved_data["causal"].toBool();
    cfg.gqa = ctx->saved_data["gqa"].toInt();
    if (!ctx->saved_data["mask"].isNone()) cfg.mask = ctx->saved_data["mask"].toTensor();
    auto s = ring_setup(q, k, std::move(cfg), ctx->saved_data["zigzag"].toBool());
    const auto nd = s.l.nd;
    const auto& qs = *shard_impl(q)->spec();
    const auto& ks = *shard_impl(k)->spec();
    auto out = ctx->saved_data["out"].toTensor();
    auto lse = ctx->saved_data["lse"].toTensor();
    auto out_spec = ShardSpec::make_with_dim_extents(s.l.mesh, qs.placements, grads[0].sizes().vec(), qs.dim_extents());
    auto g = local_aligned(resolve_partial(grads[0]), s.l.mesh, grads[0].sizes(), out_spec->placements,
                           out_spec->dim_extents());
    at::Tensor ql = unit_stride_head(shard_impl(q)->local()), kb = unit_stride_head(shard_impl(k)->local()),
               vb = unit_stride_head(shard_impl(v)->local());
    if (s.zigzag) {
      // The same permutation as the forward (out and lse were saved in the zigzag layout).
      auto z = to_zigzag({g, ql, kb, vb}, s.sl, s.l);
      g = z[0];
      ql = z[1];
      kb = z[2];
      vb = z[3];
    }
    const auto acc_type = accumulate_type(ql);
    g = g.to(acc_type);
    auto dsum = (g * out).sum(-1, /*keepdim=*/true);
    auto lse_safe = at::where(at::isinf(lse), at::zeros_like(lse), lse).unsqueeze(-1);
    auto qf = ql.to(acc_type);
    auto dq = at::zeros_like(qf);
    // The accumulated gradients travel with their block; after the last step they are at its owner.
    auto dkv = comm::ring_loop(
        ring_of(s), {kb, vb},
        {at::zeros(kb.sizes(), kb.options().dtype(acc_type)), at::zeros(vb.sizes(), vb.options().dtype(acc_type))},
        [&](int64_t, int64_t owner, const auto& kv, auto& dkv) {
          if (ql.numel() == 0 || kv[0].numel() == 0) return;  // as in the forward: nothing to compute here
          for (const auto& qg : s.qseg)
            for (const auto& kg : s.sl.segments[owner]) {
              s.c.qo = qg.global;
              auto vis = visibility(s.c, qg.len, kg.global, kg.len);
              if (vis == Visibility::None) continue;
              auto rows = [&](const at::Tensor& x) { return x.narrow(nd - 2, qg.start, qg.len); };
              auto cols = [&](const at::Tensor& x) { return x.narrow(nd - 2, kg.start, kg.len); };
              BlockGradInputs in{rows(ql), cols(kv[0]), cols(kv[1]), rows(qf),      rows(g),
                                 rows(out), rows(lse),  rows(lse_safe), rows(dsum)};
              block_backward(in, s.c, vis, BlockRange{qg.start, qg.len, kg.global, kg.len}, rows(dq), cols(dkv[0]),
                             cols(dkv[1]));
            }
        });
    auto dkb = dkv[0], dvb = dkv[1];
    if (s.zigzag) {
      auto c3 = to_contiguous({dq, dkb, dvb}, s.sl, s.l);
      dq = c3[0];
      dkb = c3[1];
      dvb = c3[2];
    }
    // Queries sharded where keys are whole: every query shard holds a term of dK/dV.
    for (int64_t m = 0; m < s.l.mesh->ndim(); ++m) {
      if (qs.placements[m].is_shard(nd - 2) && !ks.placements[m].is_shard()) {
        auto both = fused_sum({dkb, dvb}, {m}, *s.l.mesh);
        dkb = both[0];
        dvb = both[1];
      }
    }
    if (q.requires_grad()) res[0] = make_shard_tensor(dq.to(q.scalar_type()), shard_impl(q)->spec());
    if (k.requires_grad()) res[1] = make_shard_tensor(dkb.to(k.scalar_type()), shard_impl(k)->spec());
    if (v.requires_grad()) res[2] = make_shard_tensor(dvb.to(v.scalar_type()), shard_impl(v)->spec());
    return res;
  }

  // create_graph (a loss on a gradient through attention): the gradients of attention_by_rules (scores of this
  // rank's queries against every key: L_own x L, the math path's memory, paid only when a second derivative is asked
  // for) differentiated with a graph, so higher derivatives run on those rules too.
  static variable_list recorded_backward(AutogradContext* ctx, const at::Tensor& g) {
    auto saved = ctx->get_saved_variables();
    at::AutoGradMode record(true);
    const auto& mask = ctx->saved_data["mask_arg"];
    auto out = attention_by_rules(saved[0], saved[1], saved[2], mask.isNone() ? at::Tensor() : mask.toTensor(),
                                  ctx->saved_data["causal"].toBool(), ctx->saved_data["scale"].toDouble(),
                                  ctx->saved_data["gqa"].toInt());
    std::vector<at::Tensor> inputs;
    std::vector<size_t> where;
    for (size_t i = 0; i < 3; ++i)
      if (saved[i].requires_grad()) {
        inputs.push_back(saved[i]);
        where.push_back(i);
      }
    variable_list res(7);
    if (inputs.empty()) return res;
    auto grads = torch::autograd::grad({out}, inputs, {g}, /*retain_graph=*/true, /*create_graph=*/true,
                                       /*allow_unused=*/true);
    for (size_t j = 0; j < where.size(); ++j) res[where[j]] = grads[j];
    return res;
  }
};

} // namespace

at::Tensor attention_by_rules(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                              bool causal, double scale, int64_t gqa) {
  const auto nd = q.dim();
  auto kk = k, vv = v;
  if (gqa > 1) {
    kk = kk.repeat_interleave(gqa, nd - 3);
    vv = vv.repeat_interleave(gqa, nd - 3);
  }
  auto scores = at::matmul(q, kk.transpose(-2, -1)).mul(scale);
  if (causal) {
    // torch's is_causal: query i sees keys j <= i (top-left aligned).
    auto keep = at::ones({q.size(nd - 2), k.size(nd - 2)}, at::TensorOptions().dtype(at::kBool).device(q.device()));
    scores = scores.masked_fill(keep.tril().logical_not(), kNegInf);
  }
  if (mask.defined())
    scores = mask.scalar_type() == at::kBool ? scores.masked_fill(mask.logical_not(), kNegInf) : scores.add(mask);
  return at::matmul(at::softmax(scores, -1), vv);
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double scale, bool causal, int64_t gqa) {
  return RingFn::apply(q, k, v, mask, scale, causal, gqa);
}

std::pair<at::Tensor, at::Tensor> ring_attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const std::optional<at::Tensor>& mask, double scale,
                                                          bool causal, int64_t gqa) {
  auto f = ring_forward(q, k, v, mask, scale, causal, gqa);
  const auto nd = f.s.l.nd;
  const auto& qs = *shard_impl(q)->spec();
  // The log-sum-exp has q's dims but the last, the sequence dim (nd - 2) among them, and q's layout there.
  auto lse = f.lse;
  if (f.s.zigzag) lse = to_contiguous({lse.unsqueeze(-1)}, f.s.sl, f.s.l)[0].squeeze(-1);
  auto lse_shape = q.sizes().slice(0, nd - 1).vec();
  auto lse_spec = ShardSpec::make_with_dim_extents(f.s.l.mesh, qs.placements, lse_shape, qs.dim_extents());
  return {ring_output(f, q, v), make_shard_tensor(lse, lse_spec)};
}

} // namespace shardtensor::ops::attention
