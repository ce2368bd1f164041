// scaled_dot_product_attention on ShardTensors: the entry point, bound above autograd on both shard keys (the op is
// composite-implicit; its decomposition would flatten or softmax over the sharded sequence). It validates the
// arguments, completes pending sums, brings q, k, v to a canonical layout and picks the strategy.
//
// Layout rules (decided from specs only, so every rank issues the same collectives):
//  - Partial inputs are resolved first; plain q/k/v are Replicate (plain inputs that require grad are promoted).
//  - A split of the head dim (last) moves to the heads or the sequence dim first (move_head_dim_split). Leading dims (batch, heads) sharded on q drive k/v: k and v are
//    redistributed to the same shards (heads divided by the GQA ratio), so those mesh dims are local.
//  - At most one mesh dim shards the sequence (dim -2) of q or k/v. With q and k/v sequence-sharded there the
//    attention is a ring (attention_ring.cpp) or the head-parallel all-to-all (attention_all_to_all.cpp, see
//    AttentionStrategy); with only q sharded the attention is local against the full K/V (dK/dV are
//    all-reduced); with only k/v sharded q is sliced to sequence shards, the ring runs, and the output is
//    gathered back to q's (replicated) layout.
// Block kernels: attention_block.cpp; sequence layouts and the zigzag permutation: attention_seq.cpp.
#include "comm/spec_holder.h"
#include "ops/attention_all_to_all.h"
#include "ops/attention_ring.h"
#include "ops/attention_seq.h"
#include "ops/common.h"
#include "ops/describe.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <cmath>
#include <sstream>
#include <tuple>

namespace shardtensor::ops {

namespace {

using attention::CanonicalQkv;
using attention::layout_of;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

[[noreturn]] void refuse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, const std::string& why, const std::string& remedy) {
  std::ostringstream os;
  os << "ShardTensor scaled_dot_product_attention (query: " << describe(q) << ", key: " << describe(k)
     << ", value: " << describe(v) << ", attn_mask: " << describe(mask.value_or(at::Tensor())) << "): " << why
     << ". Remedy: " << remedy;
  TORCH_CHECK_NOT_IMPLEMENTED(false, os.str());
}

// q, k, v that are pending sums over the same mesh dims (e.g. bias-free projections of one pending sum, as in
// Transolver's slice attention) are completed by ONE all-reduce of their concatenation instead of one each. The
// backward is that of the resolution: each gradient taken at its input's layout with Partial read as Replicate.
struct FusedResolveFn : torch::autograd::Function<FusedResolveFn> {
  // A TensorList argument (not a std::vector) is what autograd's argument extraction records as inputs.
  static variable_list forward(AutogradContext* ctx, at::TensorList xs) {
    ctx->set_materialize_grads(false);
    const auto& spec0 = *shard_impl(xs[0])->spec();
    std::vector<int64_t> dims;
    for (int64_t m = 0; m < spec0.mesh->ndim(); ++m)
      if (spec0.placements[m].is_partial()) dims.push_back(m);
    std::vector<at::Tensor> locals;
    for (const auto& x : xs) locals.push_back(shard_impl(x)->local());
    auto sums = fused_sum(locals, dims, *spec0.mesh);
    variable_list out;
    for (size_t i = 0; i < xs.size(); ++i) {
      auto spec = without_partial(shard_impl(xs[i])->spec());
      ctx->saved_data["spec" + std::to_string(i)] = spec_ivalue(spec);
      out.push_back(make_shard_tensor(sums[i], spec));
    }
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // A layout change: under create_graph recorded as one (a higher derivative sees it).
    const bool recording = at::GradMode::is_enabled();
    variable_list res(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      auto spec = spec_from_ivalue(ctx->saved_data["spec" + std::to_string(i)]);
      res[i] = recording ? recorded_grad_to_spec(grads[i], spec) : grad_to_spec(grads[i], spec);
    }
    return res;
  }
};

// Resolves the pending sums of q, k and v: together when at least two share their Partial(sum) placements and
// dtype (decided from specs: the same on every rank), else one by one.
std::vector<at::Tensor> resolve_qkv(const std::vector<at::Tensor>& ts) {
  std::vector<size_t> group;
  const ShardSpec* first = nullptr;
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& sp = *shard_impl(ts[i])->spec();
    if (!sp.has_partial()) continue;
    bool sums = true;
    for (const auto& p : sp.placements) sums = sums && (!p.is_partial() || p.op == ReduceOp::Sum);
    if (!sums) continue;
    if (!first) first = &sp;
    if (sp.placements == first->placements && ts[i].scalar_type() == ts[group.empty() ? i : group[0]].scalar_type())
      group.push_back(i);
  }
  std::vector<at::Tensor> out(ts.begin(), ts.end());
  if (group.size() >= 2) {
    variable_list xs;
    for (auto i : group) xs.push_back(ts[i]);
    auto resolved = FusedResolveFn::apply(at::TensorList(xs));
    for (size_t j = 0; j < group.size(); ++j) out[group[j]] = resolved[j];
  }
  for (auto& t : out) t = resolve_partial_diff(t);  // the rest (no-op for the resolved ones)
  return out;
}

// A learned additive bias (a relative position bias gathered from a parameter table) needs the gradient of the
// scores, which the fused block kernels do not return. Such calls are the math form through ops that have rules
// and their own backward (attention::attention_by_rules). With the sequence whole on every rank (windows or grids
// folded into the batch dim, as in Swin/CoAtNet/MaxViT) every op is local; with the key sequence sharded the score
// contraction gathers the keys (the matmul rule), so memory grows with the full key length on each rank.
at::Tensor attention_with_bias_grad(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& bias, bool is_causal, double scale, int64_t gqa) {
  TORCH_CHECK_VALUE(!is_causal, "scaled_dot_product_attention: attn_mask and is_causal cannot both be set");
  return attention::attention_by_rules(query, key, value, bias, /*causal=*/false, scale, gqa);
}

// A split of the head (embedding) dim -1 would make every score a sum over the ranks (an all-reduce of the whole
// L x S score matrix). The split moves instead, one all-to-all of each tensor split there: to the heads dim -3 when
// no mesh dim splits it and it is at least as long as the mesh dim (head-parallel attention: no communication in
// the attention itself; not with grouped heads, whose key/value heads differ in number), else to the sequence dim -2
// (the ring, or local queries against whole keys) unless another mesh dim already splits a sequence. Decided from
// specs and shapes only, so every rank moves alike; the gradients return in the inputs' layouts.
void move_head_dim_split(std::vector<at::Tensor>& qkv, int64_t gqa, const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value, const std::optional<at::Tensor>& attn_mask) {
  const auto nd = qkv[0].dim();
  const auto& mesh = shard_impl(qkv[0])->spec()->mesh;
  auto splits = [&](int64_t d, int64_t except_m) {
    for (const auto& t : qkv)
      for (int64_t m = 0; m < mesh->ndim(); ++m)
        if (m != except_m && shard_impl(t)->spec()->placements[m].is_shard(d)) return true;
    return false;
  };
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    bool head_split = false;
    for (const auto& t : qkv) head_split = head_split || shard_impl(t)->spec()->placements[m].is_shard(nd - 1);
    if (!head_split) continue;
    int64_t target = -1;
    if (nd >= 3 && gqa == 1 && !splits(nd - 3, -1) && query.size(nd - 3) >= mesh->size(m)) target = nd - 3;
    else if (!splits(nd - 2, m)) target = nd - 2;
    if (target < 0)
      refuse(query, key, value, attn_mask,
             "the head (embedding) dim -1 is sharded and neither the heads dim -3 nor the sequence dim -2 can take "
             "its split (another mesh dim splits them)",
             "redistribute query, key and value so dim -1 is Replicate (e.g. shard the sequence dim -2)");
    for (auto& t : qkv) {
      const auto& spec = *shard_impl(t)->spec();
      if (!spec.placements[m].is_shard(nd - 1)) continue;
      auto placements = spec.placements;
      placements[m] = Placement::shard(target);
      auto extents = spec.dim_extents();
      extents.erase(nd - 1);
      extents[target] = default_split(t.size(target), mesh->size(m));
      t = to_layout(t, placements, extents);
    }
  }
}

// `lse`: when given, the attention runs without autograd as the ring (whatever the strategy) and *lse receives the
// log-sum-exp of every query (the fused kernels' second output), in the output's layout but the head dim.
at::Tensor sdpa_core(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa, at::Tensor* lse = nullptr) {
  const at::Tensor mask_t = attn_mask && attn_mask->defined() ? *attn_mask : at::Tensor();
  MeshPtr mesh;
  for (const auto* t : {&query, &key, &value, &mask_t}) {
    auto* i = t->defined() ? shard_impl(*t) : nullptr;
    if (!i) continue;
    if (!mesh) mesh = i->spec()->mesh;
    else if (!mesh->same_as(*i->spec()->mesh))
      refuse(query, key, value, attn_mask, "the arguments live on different meshes",
             "redistribute them onto one mesh (full_tensor() then distribute_tensor)");
  }
  TORCH_INTERNAL_ASSERT(mesh, "scaled_dot_product_attention: no ShardTensor argument");
  if (!shard_impl(query) && !shard_impl(key) && !shard_impl(value))
    refuse(query, key, value, attn_mask, "query, key and value are plain but attn_mask is a ShardTensor",
           "pass a plain mask (attn_mask.full_tensor())");
  const auto nd = query.dim();
  TORCH_CHECK_VALUE(nd >= 2 && key.dim() == nd && value.dim() == nd,
                    "scaled_dot_product_attention: query, key and value must have the same number of dims (>= 2), got ",
                    query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  TORCH_CHECK_VALUE(key.size(-1) == query.size(-1) && key.size(-2) == value.size(-2),
                    "scaled_dot_product_attention: shape mismatch: query ", query.sizes(), ", key ", key.sizes(),
                    ", value ", value.sizes());
  int64_t gqa = 1;
  for (int64_t d = 0; d < nd - 2; ++d) {
    if (d == nd - 3 && query.size(d) != key.size(d)) {
      // One key/value head for every query head (multi-query attention, MobileNetV4's hybrid blocks): broadcasting,
      // which torch allows with or without enable_gqa, is the grouped case with a single group.
      const bool one_head = key.size(d) == 1 && value.size(d) == 1;
      TORCH_CHECK_VALUE(one_head || (enable_gqa && key.size(d) > 0 && query.size(d) % key.size(d) == 0 &&
                                     key.size(d) == value.size(d)),
                        "scaled_dot_product_attention: query heads (", query.size(d), ") differ from key/value heads (",
                        key.size(d), "); pass enable_gqa=True with query heads a multiple of key heads");
      gqa = query.size(d) / key.size(d);
      continue;
    }
    TORCH_CHECK_VALUE(query.size(d) == key.size(d) && key.size(d) == value.size(d),
                      "scaled_dot_product_attention on ShardTensors: leading dims of query, key and value must be "
                      "equal (no broadcasting but of a single key/value head), got ", query.sizes(), ", ",
                      key.sizes(), ", ", value.sizes());
  }
  if (dropout_p > 0.0)
    refuse(query, key, value, attn_mask,
           "dropout_p > 0 is not supported (the dropout pattern could not match single-device randomness)",
           "pass dropout_p=0.0 (e.g. module.eval() or dropout=0 in nn.MultiheadAttention), or run attention on "
           "full tensors");
  if (mask_t.defined()) {
    TORCH_CHECK_VALUE(mask_t.dim() <= nd, "scaled_dot_product_attention: attn_mask has more dims than query");
    // The mask must broadcast to the attention weights [..., L, S] (global shapes; each rank slices its part).
    auto weights = query.sizes().vec();
    weights.back() = key.size(-2);
    TORCH_CHECK_VALUE(at::is_expandable_to(mask_t.sizes(), weights), "scaled_dot_product_attention: attn_mask ",
                      mask_t.sizes(), " does not broadcast to the attention weights ", c10::IntArrayRef(weights),
                      " (global shapes: query ", query.sizes(), ", key ", key.sizes(), ")");
  }
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
  if (mask_t.defined() && mask_t.requires_grad() && at::GradMode::is_enabled() && !lse) {
    TORCH_CHECK_VALUE(at::isFloatingType(mask_t.scalar_type()),
                      "scaled_dot_product_attention: an attn_mask that requires grad must be floating point");
    return attention_with_bias_grad(query, key, value, mask_t, is_causal, sc, gqa);
  }

  // Canonical inputs: ShardTensors without Partial.
  auto qkv = resolve_qkv({as_shard_input(query, mesh), as_shard_input(key, mesh), as_shard_input(value, mesh)});
  move_head_dim_split(qkv, gqa, query, key, value, attn_mask);
  auto q = qkv[0], k = qkv[1], v = qkv[2];
  if (gqa > 1) {
    // Query heads split in parts that are not whole groups (multi-query attention has one group of all heads) while
    // key/value are whole along the heads: each key/value head is repeated per query head (every rank then holds
    // the key/value heads of its own query heads), which is the grouped computation.
    const auto& sq = *shard_impl(q)->spec();
    bool split_groups = false, kv_heads_whole = true;
    for (size_t m = 0; m < sq.placements.size(); ++m) {
      if (sq.placements[m].is_shard(nd - 3))
        for (auto e : sq.extents[m]) split_groups = split_groups || e % gqa != 0;
      if (shard_impl(k)->spec()->placements[m].is_shard(nd - 3) || shard_impl(v)->spec()->placements[m].is_shard(nd - 3))
        kv_heads_whole = false;
    }
    if (split_groups && kv_heads_whole) {
      k = k.repeat_interleave(gqa, nd - 3);
      v = v.repeat_interleave(gqa, nd - 3);
      gqa = 1;
    }
  }
  const auto pq = shard_impl(q)->spec()->placements, pk = shard_impl(k)->spec()->placements,
             pv = shard_impl(v)->spec()->placements;
  const auto eq = shard_impl(q)->spec()->dim_extents(), ek = shard_impl(k)->spec()->dim_extents(),
             ev = shard_impl(v)->spec()->dim_extents();
  const auto nm = mesh->ndim();
  for (int64_t m = 0; m < nm; ++m)
    TORCH_INTERNAL_ASSERT(!pq[m].is_shard(nd - 1) && !pk[m].is_shard(nd - 1) && !pv[m].is_shard(nd - 1),
                          "scaled_dot_product_attention: a head-dim split left after move_head_dim_split");
  int64_t seq_m = -1;
  for (int64_t m = 0; m < nm; ++m)
    if (pq[m].is_shard(nd - 2) || pk[m].is_shard(nd - 2) || pv[m].is_shard(nd - 2)) {
      if (seq_m >= 0)
        refuse(query, key, value, attn_mask, "the sequence dim -2 is sharded on more than one mesh dim",
               "shard the sequences of query and key/value on one mesh dim (redistribute)");
      seq_m = m;
    }

  // Target placements per mesh dim.
  Placements tq(nm, Placement::replicate()), tk(nm, Placement::replicate());
  DimExtents xq, xk;
  bool q_changed = false;
  auto kv_extents = [&](int64_t m, int64_t d) {
    // Extents of k/v's dim d on mesh dim m (k wins).
    return pk[m].is_shard(d) ? ek.at(d) : ev.at(d);
  };
  for (int64_t m = 0; m < nm; ++m) {
    const auto& a = pq[m];
    if (a.is_shard() && a.dim < nd - 2) {
      const auto d = a.dim;
      tq[m] = a;
      xq[d] = eq.at(d);
      tk[m] = a;
      auto e = eq.at(d);
      if (d == nd - 3 && gqa > 1)
        for (auto& x : e) {
          if (x % gqa != 0)
            refuse(query, key, value, attn_mask,
                   "with grouped-query heads sharded, every rank's query head count must be a multiple of the "
                   "group size",
                   "shard the heads so each rank holds whole groups, or shard the sequence instead");
          x /= gqa;
        }
      xk[d] = e;
    } else if (a.is_shard(nd - 2)) {
      tq[m] = a;
      xq[nd - 2] = eq.at(nd - 2);
      if (pk[m].is_shard(nd - 2) || pv[m].is_shard(nd - 2)) {
        tk[m] = Placement::shard(nd - 2);
        xk[nd - 2] = kv_extents(m, nd - 2);
      }
    } else {
      // q replicated here: follow k/v's shard (q is sliced locally). A leading (batch or heads) dim keeps the shard
      // in the output, as a broadcast elementwise op would (its rows depend on their own q, k, v rows only; the
      // Perceiver of Aurora attends from learned latents, a replicated q, to a batch of sharded tokens); a sequence
      // shard is gathered back at the end (every query attends to every key).
      const Placement& b = pk[m].is_shard() ? pk[m] : pv[m];
      if (!b.is_shard()) continue;
      const auto d = b.dim;
      if (d == nd - 2) q_changed = true;
      tk[m] = Placement::shard(d);
      xk[d] = kv_extents(m, d);
      tq[m] = Placement::shard(d);
      if (d == nd - 2) {
        xq[d] = default_split(query.size(d), mesh->size(m));
      } else {
        auto e = xk[d];
        if (d == nd - 3)
          for (auto& x : e) x *= gqa;
        xq[d] = e;
      }
    }
  }
  auto qc = to_layout(q, tq, xq);
  auto kc = to_layout(k, tk, xk);
  auto vc = to_layout(v, tk, xk);

  at::Tensor out;
  auto l = layout_of(qc, kc);
  const CanonicalQkv canon{qc, kc, vc, tq, tk, xq, xk, gqa};
  auto refuse_heads = [&] {
    refuse(query, key, value, attn_mask, "the all_to_all strategy needs a heads dim (dim -3) that no mesh dim shards",
           "set_attention_strategy('ring') or 'auto', or redistribute the heads dim to Replicate");
  };
  if (lse)
    std::tie(out, *lse) = attention::ring_attention_with_lse(qc, kc, vc, attn_mask, sc, is_causal, gqa);
  else if (attention::use_all_to_all(l, canon, is_causal, refuse_heads))
    out = attention::all_to_all_attention(l, canon, attn_mask, is_causal, sc, enable_gqa);
  else
    out = attention::ring_attention(qc, kc, vc, attn_mask, sc, is_causal, gqa);
  if (q_changed) {
    // The sequence back to q's own layout (after Partial resolution); leading dims keep their shards.
    Placements po = tq;
    DimExtents xo;
    for (int64_t m = 0; m < nm; ++m)
      if (po[m].is_shard(nd - 2) && !pq[m].is_shard(nd - 2)) po[m] = pq[m];
    for (const auto& p : po)
      if (p.is_shard()) xo[p.dim] = p.dim == nd - 2 ? eq.at(nd - 2) : xq.at(p.dim);
    out = to_layout(out, po, xo);
    if (lse) *lse = to_layout(*lse, po, xo);
  }
  return out;
}

at::Tensor sdpa_entry(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                      std::optional<double> scale, bool enable_gqa) {
  if ((query.dim() != key.dim() || key.dim() != value.dim()) && query.dim() >= 2 && key.dim() >= 2 &&
      value.dim() >= 2) {
    // torch broadcasts the leading (batch) dims of query, key and value as matmul does (a 3-D query against 4-D
    // keys): leading dims of size 1 first, then each expanded to the common batch shape (views on the rules).
    const auto nd = std::max({query.dim(), key.dim(), value.dim()});
    auto lead = [&](at::Tensor t) {
      while (t.dim() < nd) t = t.unsqueeze(0);
      return t;
    };
    auto q = lead(query), k = lead(key), v = lead(value);
    auto batch = at::infer_size(q.sizes().slice(0, nd - 2), k.sizes().slice(0, nd - 2));
    batch = at::infer_size(batch, v.sizes().slice(0, nd - 2));
    auto grow = [&](const at::Tensor& t) {
      auto shape = batch;
      shape.push_back(t.size(-2));
      shape.push_back(t.size(-1));
      return t.sizes() == c10::IntArrayRef(shape) ? t : t.expand(shape);
    };
    return sdpa_core(grow(q), grow(k), grow(v), attn_mask, dropout_p, is_causal, scale, enable_gqa);
  }
  return sdpa_core(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

// Whether the fused kernels' query has more heads than key (SDPA's enable_gqa, which their schemas do not carry).
bool grouped_heads(const at::Tensor& query, const at::Tensor& key) {
  return query.dim() >= 3 && key.dim() == query.dim() && query.size(-3) != key.size(-3);
}

// The fused CPU kernel SDPA decomposes to (_scaled_dot_product_flash_attention_for_cpu), reached by a ShardTensor
// where SDPA itself was not bound: compiled code that runs eagerly on traced shards (a frame Dynamo skipped, where
// SDPA decomposes before the traced shard sees it), or a direct call. Below autograd: the ring without autograd,
// returning the output and every query's log-sum-exp as the kernel does. Grouped heads as SDPA's enable_gqa.
std::tuple<at::Tensor, at::Tensor> flash_attention_cpu_rule(const at::Tensor& query, const at::Tensor& key,
                                                            const at::Tensor& value, double dropout_p, bool is_causal,
                                                            const std::optional<at::Tensor>& attn_mask,
                                                            std::optional<double> scale) {
  at::NoGradGuard no_grad;
  at::Tensor lse;
  auto out = sdpa_core(query, key, value, attn_mask, dropout_p, is_causal, scale, grouped_heads(query, key), &lse);
  return {out, lse};
}

// Its backward recomputes the forward with autograd (the differentiable entry above, so every layout, grouped heads
// and Partial inputs take their own backward) and differentiates it: one more forward ring than the entry's own
// backward, on a path that only compiled code running eagerly or a direct call of the fused kernel takes. The given
// output and log-sum-exp are what that forward recomputes (dropout is refused), so they are not read.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_cpu_backward_rule(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& /*out*/, const at::Tensor& /*logsumexp*/, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale) {
  // Rules run below autograd (the autograd keys excluded): include them again for the recomputation.
  const auto tls = c10::impl::tls_local_dispatch_key_set();
  c10::impl::ForceDispatchKeyGuard with_autograd(tls.included_,
                                                 tls.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  at::AutoGradMode grad_mode(true);
  auto leaf = [](const at::Tensor& t) { return t.detach().requires_grad_(true); };
  std::vector<at::Tensor> inputs{leaf(query), leaf(key), leaf(value)};
  std::optional<at::Tensor> mask;
  if (attn_mask && attn_mask->defined()) mask = attn_mask->detach();
  auto out = sdpa_core(inputs[0], inputs[1], inputs[2], mask, dropout_p, is_causal, scale, grouped_heads(query, key));
  auto g = torch::autograd::grad({out}, inputs, {grad_out}, /*retain_graph=*/false, /*create_graph=*/false,
                                 /*allow_unused=*/true);
  return {g[0], g[1], g[2]};
}

} // namespace

SHARDTENSOR_RULE_FAMILY(attention) {
  dispatch::set_handler("aten::scaled_dot_product_attention", typed_handler(&sdpa_entry), dispatch::RuleLevel::above_autograd);
  dispatch::set_handler("aten::_scaled_dot_product_flash_attention_for_cpu", typed_handler(&flash_attention_cpu_rule));
  dispatch::set_handler("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                        typed_handler(&flash_attention_cpu_backward_rule));
}

} // namespace shardtensor::ops
