// scaled_dot_product_attention on ShardTensors, bound above autograd on both shard keys (the op is
// composite-implicit; its decomposition would flatten or softmax over the sharded sequence).
//
// Layout rules (decided from specs only, so every rank issues the same collectives):
//  - Partial inputs are resolved first; plain q/k/v are Replicate (plain inputs that require grad are promoted).
//  - The head dim (last) may not be sharded. Leading dims (batch, heads) sharded on q drive k/v: k and v are
//    redistributed to the same shards (heads divided by the GQA ratio), so those mesh dims are local.
//  - At most one mesh dim shards the sequence (dim -2) of q or k/v. With q and k/v sequence-sharded there the
//    attention is a ring (or the head-parallel all-to-all, see attention_strategy); with only q sharded the
//    attention is local against the full K/V (dK/dV are all-reduced); with only k/v sharded q is sliced to
//    sequence shards, the ring runs, and the output is gathered back to q's (replicated) layout.
//
// Ring (forward): step t computes local q against the K/V block of coordinate (c - t) mod n while the next
// block is in flight (send to c+1, receive from c-1), and merges block outputs with their log-sum-exp.
// Unmasked fully visible blocks (and causal diagonal blocks whose queries and keys cover the same positions) use
// the CPU flash kernels, forward (which returns the log-sum-exp) and backward (given the global output and
// log-sum-exp); masked or unaligned partially causal blocks use fp32 matmul/softmax math with an explicit
// log-sum-exp and recompute their probabilities in backward; dQ accumulates locally, dK/dV accumulate
// in buffers that travel with their block and are passed home after the last step.
#include "comm/collectives.h"
#include "comm/halo.h"
#include "comm/redistribute.h"
#include "comm/spec_holder.h"
#include "dispatch/args.h"
#include "dispatch/promote.h"
#include "ops/common.h"
#include "ops/ops.h"

#include <shardtensor/attention.h>

#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <torch/autograd.h>
#include <torch/library.h>

#ifdef SHARDTENSOR_HAVE_CUDA
#include "lse_merge.h"

#include <c10/cuda/CUDAStream.h>
#endif

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <sstream>

namespace shardtensor {

namespace {
std::mutex g_strategy_mutex;
std::string g_strategy = "auto";
} // namespace

std::string set_attention_strategy(const std::string& strategy) {
  TORCH_CHECK_VALUE(strategy == "ring" || strategy == "ring_contiguous" || strategy == "all_to_all" ||
                        strategy == "auto",
                    "set_attention_strategy: expected 'auto', 'ring', 'ring_contiguous' or 'all_to_all', got '",
                    strategy, "'");
  std::lock_guard<std::mutex> lock(g_strategy_mutex);
  auto old = g_strategy;
  g_strategy = strategy;
  return old;
}

std::string attention_strategy() {
  std::lock_guard<std::mutex> lock(g_strategy_mutex);
  return g_strategy;
}

} // namespace shardtensor

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "None";
  auto* i = shard_impl(t);
  std::ostringstream os;
  if (i) os << to_string(i->spec()->placements);
  else os << "plain";
  os << " " << t.sizes();
  return os.str();
}

[[noreturn]] void refuse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, const std::string& why, const std::string& remedy) {
  std::ostringstream os;
  os << "ShardTensor scaled_dot_product_attention (query: " << describe(q) << ", key: " << describe(k)
     << ", value: " << describe(v) << ", attn_mask: " << describe(mask.value_or(at::Tensor())) << "): " << why
     << ". Remedy: " << remedy;
  TORCH_CHECK_NOT_IMPLEMENTED(false, os.str());
}

// ---- block math ----

struct BlockCfg {
  double scale = 1.0;
  bool causal = false;
  int64_t gqa = 1;   // query heads per key/value head
  int64_t qo = 0;    // global offset of the local queries
  at::Tensor mask;   // additive fp32, ndim = q.dim(), last dim the full key length (or 1); undefined if none
  int64_t nd = 4;
};

enum class Visibility { None, Full, Partial };

Visibility visibility(const BlockCfg& c, int64_t nq, int64_t ko, int64_t nk) {
  if (nq == 0 || nk == 0) return Visibility::None;
  if (!c.causal) return Visibility::Full;
  if (ko > c.qo + nq - 1) return Visibility::None;  // every key in the future of every query
  if (ko + nk - 1 <= c.qo) return Visibility::Full;
  return Visibility::Partial;
}

// Additive fp32 bias of one block (user mask columns + causal part), or undefined.
// `q_start`: where these queries start in the local sequence (the mask rows follow the local queries).
at::Tensor block_bias(const BlockCfg& c, Visibility vis, int64_t q_start, int64_t nq, int64_t ko, int64_t nk,
                      const at::Device& dev) {
  at::Tensor bias;
  if (c.mask.defined()) {
    bias = c.mask.size(-1) == 1 ? c.mask : c.mask.narrow(-1, ko, nk);
    if (bias.size(-2) > 1) bias = bias.narrow(-2, q_start, nq);
  }
  if (vis == Visibility::Partial) {
    auto opts = at::TensorOptions().dtype(at::kLong).device(dev);
    auto qi = at::arange(c.qo, c.qo + nq, opts).unsqueeze(1);
    auto kj = at::arange(ko, ko + nk, opts).unsqueeze(0);
    auto causal = at::zeros({nq, nk}, at::TensorOptions().dtype(at::kFloat).device(dev))
                      .masked_fill_(kj > qi, kNegInf);
    bias = bias.defined() ? bias + causal : causal;
  }
  return bias;
}

at::Tensor expand_heads(const at::Tensor& kv, const BlockCfg& c) {
  return c.gqa > 1 ? kv.repeat_interleave(c.gqa, c.nd - 3) : kv;
}

at::Tensor reduce_heads(const at::Tensor& g, const BlockCfg& c) {
  if (c.gqa == 1) return g;
  const auto h = c.nd - 3;
  return g.unflatten(h, {g.size(h) / c.gqa, c.gqa}).sum(h + 1);
}

// Scores of one block in fp32 (scaled, biased).
at::Tensor block_scores(const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& bias, double scale) {
  auto s = at::matmul(qf, kf.transpose(-1, -2)).mul_(scale);
  if (bias.defined()) s = s + bias;
  return s;
}

// (out fp32, lse fp32) of local queries against one block.
// A causal block whose queries and keys cover the same global positions: PyTorch's top-left causal mask is the
// global one, so the flash kernels apply (no score matrix).
bool aligned_causal(const BlockCfg& c, Visibility vis, int64_t nq, int64_t ko, int64_t nk) {
  return vis == Visibility::Partial && !c.mask.defined() && ko == c.qo && nk == nq;
}

// Can the CPU flash forward kernel compute a block of these tensors?
bool flash_forward_ok(const at::Tensor& q, const at::Tensor& vb, const BlockCfg& c) {
  return c.nd == 4 && q.size(-1) == vb.size(-1) && q.device().is_cpu() &&
      (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble || q.scalar_type() == at::kBFloat16 ||
       q.scalar_type() == at::kHalf);
}

// CUDA blocks without a bias run PyTorch's fused kernels, which return the log-sum-exp: flash (fp16/bf16) or
// memory-efficient (fp32) forward, memory-efficient backward (given the global output and log-sum-exp). Their
// head-dim limits are checked here; other CUDA blocks take the fp32 math path. SHARDTENSOR_CUDA_FUSED_ATTENTION=0
// forces the math path (a local choice: it changes no communication).
bool cuda_fused_ok(const at::Tensor& q, const at::Tensor& vb, const BlockCfg& c) {
  static const bool enabled = [] {
    const char* e = std::getenv("SHARDTENSOR_CUDA_FUSED_ATTENTION");
    return !(e && std::string(e) == "0");
  }();
  const auto d = q.size(-1);
  const auto st = q.scalar_type();
  return enabled && c.nd == 4 && q.is_cuda() && d == vb.size(-1) && d % 8 == 0 && d <= 256 &&
         (st == at::kFloat || st == at::kHalf || st == at::kBFloat16);
}

std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                                                const at::Tensor& bias, const BlockCfg& c, bool causal_block = false) {
  auto ke = expand_heads(kb, c), ve = expand_heads(vb, c);
  if (!bias.defined() && cuda_fused_ok(q, vb, c)) {
    if (q.scalar_type() != at::kFloat) {
      auto r = at::_scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal_block, false, c.scale);
      return {std::get<0>(r).to(at::kFloat), std::get<1>(r).to(at::kFloat)};
    }
    // The efficient kernel pads its log-sum-exp rows to a multiple of 32.
    auto r = at::_scaled_dot_product_efficient_attention(q, ke, ve, std::nullopt, true, 0.0, causal_block, c.scale);
    return {std::get<0>(r).to(at::kFloat), std::get<1>(r).narrow(-1, 0, q.size(-2)).to(at::kFloat)};
  }
  const bool flash_ok = !bias.defined() && flash_forward_ok(q, vb, c);
  if (flash_ok) {
    auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, ke, ve, 0.0, causal_block, std::nullopt, c.scale);
    return {o.to(at::kFloat), lse.to(at::kFloat)};
  }
  auto s = block_scores(q.to(at::kFloat), ke.to(at::kFloat), bias, c.scale);
  auto lse = s.logsumexp(-1);
  auto safe = at::where(at::isinf(lse), at::zeros_like(lse), lse);
  auto p = (s - safe.unsqueeze(-1)).exp_();
  return {at::matmul(p, ve.to(at::kFloat)), lse};
}

// The backward of one bias-free CUDA block through the memory-efficient kernel: (dq, dk, dv) of the expanded
// heads, given this block's rows of the global output and log-sum-exp.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_block_backward(const at::Tensor& g, const at::Tensor& q,
                                                                   const at::Tensor& ke, const at::Tensor& ve,
                                                                   const at::Tensor& out, const at::Tensor& lse,
                                                                   bool causal_block, double scale) {
  const auto dt = q.scalar_type();
  const auto rows = lse.size(-1);
  auto lse_padded = at::constant_pad_nd(lse.contiguous(), {0, (rows + 31) / 32 * 32 - rows}, 0.0);
  auto no_rng = at::zeros({}, q.options().dtype(at::kLong));  // dropout is 0: the generator state is unused
  auto r = at::_scaled_dot_product_efficient_attention_backward(
      g.to(dt).contiguous(), q.contiguous(), ke.contiguous(), ve.contiguous(), at::Tensor(), out.to(dt).contiguous(),
      lse_padded, no_rng, no_rng, 0.0, {true, true, true, false}, causal_block, scale);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

void merge(at::Tensor& acc, at::Tensor& acc_lse, const at::Tensor& o, const at::Tensor& lse) {
#ifdef SHARDTENSOR_HAVE_CUDA
  if (acc.is_cuda() && acc.is_contiguous() && acc_lse.is_contiguous()) {
    auto oc = o.to(at::kFloat).contiguous(), lc = lse.to(at::kFloat).contiguous();
    cuda::lse_merge(acc.data_ptr<float>(), acc_lse.data_ptr<float>(), oc.data_ptr<float>(), lc.data_ptr<float>(),
                    acc_lse.numel(), acc.size(-1), c10::cuda::getCurrentCUDAStream(acc.device().index()).stream());
    return;
  }
#endif
  auto m = at::logaddexp(acc_lse, lse);
  auto wa = at::nan_to_num((acc_lse - m).exp(), 0.0);
  auto wb = at::nan_to_num((lse - m).exp(), 0.0);
  acc = acc * wa.unsqueeze(-1) + o * wb.unsqueeze(-1);
  acc_lse = m;
}

// ---- layout ----

struct Layout {
  MeshPtr mesh;
  int64_t nd = 0;
  int64_t seq_mesh_dim = -1;  // the mesh dim sharding the sequence of q and/or k/v (canonical layout)
  bool kv_ring = false;       // k/v sequence-sharded on seq_mesh_dim
  bool q_seq = false;         // q sequence-sharded on seq_mesh_dim
};

Layout layout_of(const at::Tensor& q, const at::Tensor& k) {
  Layout l;
  const auto& qs = *shard_impl(q)->spec();
  const auto& ks = *shard_impl(k)->spec();
  l.mesh = qs.mesh;
  l.nd = q.dim();
  for (int64_t m = 0; m < l.mesh->ndim(); ++m) {
    const bool qq = qs.placements[m].is_shard(l.nd - 2), kk = ks.placements[m].is_shard(l.nd - 2);
    if (qq || kk) {
      l.seq_mesh_dim = m;
      l.q_seq = qq;
      l.kv_ring = kk;
    }
  }
  return l;
}

std::vector<int64_t> with_dim(at::IntArrayRef shape, int64_t d, int64_t v) {
  auto s = shape.vec();
  s[d] = v;
  return s;
}

// ---- sequence segments and the zigzag layout ----

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

SeqLayout contiguous_layout(const std::vector<int64_t>& ext) {
  SeqLayout s;
  s.ext = ext;
  int64_t off = 0;
  for (auto e : ext) {
    s.segments.push_back({Segment{0, e, off}});
    off += e;
  }
  s.contiguous_ext = ext;
  return s;
}

SeqLayout zigzag_layout(int64_t seq, const std::vector<int64_t>& contiguous_ext) {
  const auto n = static_cast<int64_t>(contiguous_ext.size());
  SeqLayout s;
  s.zigzag = true;
  s.contiguous_ext = contiguous_ext;
  auto chunk = default_split(seq, 2 * n);
  std::vector<int64_t> chunk_off(2 * n + 1, 0);
  for (int64_t j = 0; j < 2 * n; ++j) chunk_off[j + 1] = chunk_off[j] + chunk[j];
  // Position of every global row in the zigzag order (coordinate by coordinate, early chunk first).
  std::vector<int64_t> zig_pos(seq);
  int64_t pos = 0;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t a = c, b = 2 * n - 1 - c;
    s.segments.push_back({Segment{0, chunk[a], chunk_off[a]}, Segment{chunk[a], chunk[b], chunk_off[b]}});
    s.ext.push_back(chunk[a] + chunk[b]);
    std::vector<int64_t> want;
    for (auto j : {a, b})
      for (int64_t g = chunk_off[j]; g < chunk_off[j + 1]; ++g) {
        want.push_back(g);
        zig_pos[g] = pos++;
      }
    s.to_zigzag.push_back(std::move(want));
  }
  int64_t g = 0;
  for (int64_t c = 0; c < n; ++c) {
    std::vector<int64_t> want;
    for (int64_t i = 0; i < contiguous_ext[c]; ++i) want.push_back(zig_pos[g++]);
    s.to_contiguous.push_back(std::move(want));
  }
  return s;
}

// Contiguous -> zigzag (and back) along the sequence dim: a permutation by gather_rows, whose adjoint is the
// gather in the other direction. Tensors of one dtype travel together: each is viewed sequence-major as rows
// (S, rest) and the rows are concatenated, so q, k and v (or dO, q, k, v; or dQ, dK, dV) cost one exchange.
std::vector<at::Tensor> permute_seq(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& from_ext,
                                    const comm::RowRequests& want, const Layout& l) {
  const auto d = l.nd - 2;
  std::vector<at::Tensor> out(ts.size());
  std::vector<bool> done(ts.size(), false);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (done[i]) continue;
    std::vector<size_t> group;
    std::vector<at::Tensor> rows;
    for (size_t j = i; j < ts.size(); ++j)
      if (!done[j] && ts[j].scalar_type() == ts[i].scalar_type()) {
        group.push_back(j);
        done[j] = true;
        rows.push_back(ts[j].movedim(d, 0).flatten(1));
      }
    std::vector<int64_t> widths;
    for (const auto& r : rows) widths.push_back(r.size(1));
    auto packed = rows.size() == 1 ? rows[0] : at::cat(rows, 1);
    rows.clear();  // the packed copy is all that travels: free the per-tensor row views' copies now
    auto moved = comm::gather_rows(packed, 0, from_ext, want, *l.mesh, l.seq_mesh_dim);
    packed.reset();
    int64_t col = 0;
    for (size_t g = 0; g < group.size(); ++g) {
      auto shape = ts[group[g]].movedim(d, 0).sizes().vec();
      shape[0] = moved.size(0);
      // A view into the received buffer (the kernels and the ring take strided tensors).
      out[group[g]] = moved.narrow(1, col, widths[g]).view(shape).movedim(0, d);
      col += widths[g];
    }
  }
  return out;
}
std::vector<at::Tensor> to_zigzag(const std::vector<at::Tensor>& ts, const SeqLayout& s, const Layout& l) {
  return permute_seq(ts, s.contiguous_ext, s.to_zigzag, l);
}
std::vector<at::Tensor> to_contiguous(const std::vector<at::Tensor>& ts, const SeqLayout& s, const Layout& l) {
  return permute_seq(ts, s.ext, s.to_contiguous, l);
}

// Decided from specs and the strategy only (the same on every rank): causal self-attention over a ring whose
// queries and keys share one sequence layout, without a user mask (its rows would need the same permutation).
bool use_zigzag(const Layout& l, const ShardSpec& qs, const ShardSpec& ks, bool causal, bool has_mask) {
  if (!causal || has_mask || !l.q_seq || !l.kv_ring) return false;
  if (l.mesh->size(l.seq_mesh_dim) < 2 || attention_strategy() == "ring_contiguous") return false;
  const auto d = l.nd - 2;
  return qs.global_shape[d] == ks.global_shape[d] && qs.extents[l.seq_mesh_dim] == ks.extents[l.seq_mesh_dim];
}

SeqLayout seq_layout(const Layout& l, const ShardSpec& qs, const ShardSpec& ks, bool zigzag) {
  const auto d = l.nd - 2;
  if (zigzag) return zigzag_layout(ks.global_shape[d], ks.extents[l.seq_mesh_dim]);
  if (l.kv_ring) return contiguous_layout(ks.extents[l.seq_mesh_dim]);
  return contiguous_layout({ks.global_shape[d]});  // k/v whole: one block
}

// ---- the autograd function ----

struct SdpaFn : torch::autograd::Function<SdpaFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale, bool causal, int64_t gqa) {
    ctx->set_materialize_grads(false);
    at::NoGradGuard no_grad;
    auto l = layout_of(q, k);
    const auto& qs = *shard_impl(q)->spec();
    const auto& ks = *shard_impl(k)->spec();
    const auto nd = l.nd;
    BlockCfg c;
    c.scale = scale;
    c.causal = causal;
    c.gqa = gqa;
    c.nd = nd;
    if (mask && mask->defined()) {
      auto attn_shape = q.sizes().vec();
      attn_shape.back() = k.size(nd - 2);
      auto ml = local_aligned(resolve_partial(*mask), l.mesh, attn_shape, qs.placements, qs.dim_extents());
      ml = ml.scalar_type() == at::kBool
               ? at::zeros(ml.sizes(), ml.options().dtype(at::kFloat)).masked_fill_(ml.logical_not(), kNegInf)
               : ml.to(at::kFloat);
      while (ml.dim() < nd) ml = ml.unsqueeze(0);
      c.mask = ml;
    }
    const bool zz = use_zigzag(l, qs, ks, causal, c.mask.defined());
    const auto sl = seq_layout(l, qs, ks, zz);
    const int64_t sm = l.seq_mesh_dim;
    const int64_t n = l.kv_ring ? l.mesh->size(sm) : 1;
    const int64_t me = l.kv_ring ? l.mesh->coordinate(sm) : 0;
    at::Tensor ql = shard_impl(q)->local(), kb = shard_impl(k)->local(), vb = shard_impl(v)->local();
    std::vector<Segment> qseg{Segment{0, ql.size(nd - 2), qs.local_offset(nd - 2)}};
    if (zz) {
      auto z = to_zigzag({ql, kb, vb}, sl, l);
      ql = z[0];
      kb = z[1];
      vb = z[2];
      qseg = sl.segments[me];
    }
    auto out_shape_local = with_dim(ql.sizes(), nd - 1, v.size(nd - 1));
    auto acc = at::zeros(out_shape_local, ql.options().dtype(at::kFloat));
    auto acc_lse = at::full(with_dim(ql.sizes(), nd - 1, 1), kNegInf, ql.options().dtype(at::kFloat)).squeeze(-1);

    for (int64_t t = 0; t < n; ++t) {
      const int64_t owner = (me - t + n) % n;
      comm::RingExchange ex;
      if (t < n - 1) {
        const auto ext = sl.ext[(owner - 1 + n) % n];
        ex = comm::ring_pass_start({kb, vb}, {with_dim(kb.sizes(), nd - 2, ext), with_dim(vb.sizes(), nd - 2, ext)},
                                   *l.mesh, sm, 0);
      }
      for (const auto& qg : qseg)
        for (const auto& kg : sl.segments[owner]) {
          c.qo = qg.global;
          auto vis = visibility(c, qg.len, kg.global, kg.len);
          if (vis == Visibility::None) continue;
          auto qv = ql.narrow(nd - 2, qg.start, qg.len);
          auto kv = kb.narrow(nd - 2, kg.start, kg.len), vv = vb.narrow(nd - 2, kg.start, kg.len);
          const bool diag = (flash_forward_ok(qv, vv, c) || cuda_fused_ok(qv, vv, c)) &&
                            aligned_causal(c, vis, qg.len, kg.global, kg.len);
          auto bias = diag ? at::Tensor() : block_bias(c, vis, qg.start, qg.len, kg.global, kg.len, ql.device());
          auto [o, lse] = block_forward(qv, kv, vv, bias, c, diag);
          auto a = acc.narrow(nd - 2, qg.start, qg.len);
          auto al = acc_lse.narrow(nd - 2, qg.start, qg.len);
          auto a2 = a.clone(), al2 = al.clone();
          merge(a2, al2, o, lse);
          a.copy_(a2);
          al.copy_(al2);
        }
      if (t < n - 1) {
        auto r = ex.wait();
        kb = r[0];
        vb = r[1];
      }
    }
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["out"] = acc;
    ctx->saved_data["lse"] = acc_lse;
    ctx->saved_data["mask"] = c.mask.defined() ? c10::IValue(c.mask) : c10::IValue();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["gqa"] = gqa;
    auto out_local = acc.to(ql.scalar_type());
    if (zz) out_local = to_contiguous({out_local}, sl, l)[0];
    auto out_shape = with_dim(q.sizes(), nd - 1, v.size(nd - 1));
    return make_shard_tensor(out_local,
                             ShardSpec::make_with_dim_extents(l.mesh, qs.placements, out_shape, qs.dim_extents()));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list res(7);
    if (!grads[0].defined()) return res;
    at::NoGradGuard no_grad;
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    auto l = layout_of(q, k);
    const auto& qs = *shard_impl(q)->spec();
    const auto& ks = *shard_impl(k)->spec();
    const auto nd = l.nd;
    BlockCfg c;
    c.scale = ctx->saved_data["scale"].toDouble();
    c.causal = ctx->saved_data["causal"].toBool();
    c.gqa = ctx->saved_data["gqa"].toInt();
    c.nd = nd;
    if (!ctx->saved_data["mask"].isNone()) c.mask = ctx->saved_data["mask"].toTensor();
    const bool zz = use_zigzag(l, qs, ks, c.causal, c.mask.defined());
    const auto sl = seq_layout(l, qs, ks, zz);
    auto out = ctx->saved_data["out"].toTensor();
    auto lse = ctx->saved_data["lse"].toTensor();
    auto out_spec = ShardSpec::make_with_dim_extents(l.mesh, qs.placements, grads[0].sizes().vec(), qs.dim_extents());
    auto g = local_aligned(resolve_partial(grads[0]), l.mesh, grads[0].sizes(), out_spec->placements,
                           out_spec->dim_extents());
    const int64_t sm = l.seq_mesh_dim;
    const int64_t n = l.kv_ring ? l.mesh->size(sm) : 1;
    const int64_t me = l.kv_ring ? l.mesh->coordinate(sm) : 0;
    at::Tensor ql = shard_impl(q)->local(), kb = shard_impl(k)->local(), vb = shard_impl(v)->local();
    std::vector<Segment> qseg{Segment{0, ql.size(nd - 2), qs.local_offset(nd - 2)}};
    if (zz) {
      // The same permutation as the forward (out and lse were saved in the zigzag layout).
      auto z = to_zigzag({g, ql, kb, vb}, sl, l);
      g = z[0];
      ql = z[1];
      kb = z[2];
      vb = z[3];
      qseg = sl.segments[me];
    }
    g = g.to(at::kFloat);
    auto dsum = (g * out).sum(-1, /*keepdim=*/true);
    auto lse_safe = at::where(at::isinf(lse), at::zeros_like(lse), lse).unsqueeze(-1);
    auto qf = ql.to(at::kFloat);
    auto dq = at::zeros_like(qf);
    at::Tensor dkb = at::zeros(kb.sizes(), kb.options().dtype(at::kFloat));
    at::Tensor dvb = at::zeros(vb.sizes(), vb.options().dtype(at::kFloat));
    for (int64_t t = 0; t < n; ++t) {
      const int64_t owner = (me - t + n) % n;
      const auto next_ext = sl.ext[(owner - 1 + n) % n];
      comm::RingExchange ex;
      if (t < n - 1)
        ex = comm::ring_pass_start({kb, vb},
                                   {with_dim(kb.sizes(), nd - 2, next_ext), with_dim(vb.sizes(), nd - 2, next_ext)},
                                   *l.mesh, sm, 0);
      for (const auto& qg : qseg)
        for (const auto& kg : sl.segments[owner]) {
          c.qo = qg.global;
          auto vis = visibility(c, qg.len, kg.global, kg.len);
          if (vis == Visibility::None) continue;
          auto narrow_q = [&](const at::Tensor& x) { return x.narrow(nd - 2, qg.start, qg.len); };
          auto narrow_k = [&](const at::Tensor& x) { return x.narrow(nd - 2, kg.start, kg.len); };
          auto qv = narrow_q(ql), kv = narrow_k(kb), vv = narrow_k(vb);
          auto gv = narrow_q(g), ov = narrow_q(out), lv = narrow_q(lse);
          const bool flash_types = nd == 4 && qv.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat &&
                                   qv.size(-1) == vv.size(-1) && qv.device().is_cpu();
          const bool cuda_fused = cuda_fused_ok(qv, vv, c);
          const bool diag = (flash_types || cuda_fused) && aligned_causal(c, vis, qg.len, kg.global, kg.len);
          auto bias = diag ? at::Tensor() : block_bias(c, vis, qg.start, qg.len, kg.global, kg.len, ql.device());
          if (cuda_fused && !bias.defined()) {
            auto [dq_b, dk_e, dv_e] = cuda_block_backward(gv, qv, expand_heads(kv, c), expand_heads(vv, c), ov, lv,
                                                          diag, c.scale);
            narrow_q(dq).add_(dq_b.to(at::kFloat));
            narrow_k(dkb).add_(reduce_heads(dk_e.to(at::kFloat), c));
            narrow_k(dvb).add_(reduce_heads(dv_e.to(at::kFloat), c));
          } else if (flash_types && !bias.defined()) {
            // Fully visible fp32 block: the CPU flash backward, given the global output and log-sum-exp, yields
            // this block's exact contributions in O(S) memory (no score matrix).
            auto [dq_b, dk_e, dv_e] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
                gv.contiguous(), qv.contiguous(), expand_heads(kv, c).contiguous(), expand_heads(vv, c).contiguous(),
                ov.contiguous(), lv.contiguous(), 0.0, diag, std::nullopt, c.scale);
            narrow_q(dq).add_(dq_b);
            narrow_k(dkb).add_(reduce_heads(dk_e.to(at::kFloat), c));
            narrow_k(dvb).add_(reduce_heads(dv_e.to(at::kFloat), c));
          } else {
            auto qfv = narrow_q(qf);
            auto kf = expand_heads(kv, c).to(at::kFloat), vf = expand_heads(vv, c).to(at::kFloat);
            auto p = (block_scores(qfv, kf, bias, c.scale) - narrow_q(lse_safe)).exp_();
            auto dv_e = at::matmul(p.transpose(-1, -2), gv);
            auto dp = at::matmul(gv, vf.transpose(-1, -2));
            auto ds = p.mul_(dp.sub_(narrow_q(dsum)));
            narrow_q(dq).add_(at::matmul(ds, kf), c.scale);
            auto dk_e = at::matmul(ds.transpose(-1, -2), qfv).mul_(c.scale);
            narrow_k(dkb).add_(reduce_heads(dk_e, c));
            narrow_k(dvb).add_(reduce_heads(dv_e, c));
          }
        }
      if (n > 1) {
        // The accumulated gradients travel with their block; after the last step they reach its owner.
        auto gex = comm::ring_pass_start({dkb, dvb},
                                         {with_dim(dkb.sizes(), nd - 2, next_ext), with_dim(dvb.sizes(), nd - 2, next_ext)},
                                         *l.mesh, sm, 2);
        auto r = gex.wait();
        dkb = r[0];
        dvb = r[1];
      }
      if (t < n - 1) {
        auto r = ex.wait();
        kb = r[0];
        vb = r[1];
      }
    }
    if (zz) {
      auto c3 = to_contiguous({dq, dkb, dvb}, sl, l);
      dq = c3[0];
      dkb = c3[1];
      dvb = c3[2];
    }
    // Queries sharded where keys are whole: every query shard holds a term of dK/dV.
    for (int64_t m = 0; m < l.mesh->ndim(); ++m) {
      if (qs.placements[m].is_shard(nd - 2) && !ks.placements[m].is_shard()) {
        auto both = comm::all_reduce(at::cat({dkb.flatten(), dvb.flatten()}), ReduceOp::Sum, *l.mesh, m);
        dkb = both.narrow(0, 0, dkb.numel()).view(dkb.sizes());
        dvb = both.narrow(0, dkb.numel(), dvb.numel()).view(dvb.sizes());
      }
    }
    if (q.requires_grad()) res[0] = make_shard_tensor(dq.to(q.scalar_type()), shard_impl(q)->spec());
    if (k.requires_grad()) res[1] = make_shard_tensor(dkb.to(k.scalar_type()), shard_impl(k)->spec());
    if (v.requires_grad()) res[2] = make_shard_tensor(dvb.to(v.scalar_type()), shard_impl(v)->spec());
    return res;
  }
};

// ---- entry ----

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
    variable_list res(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      auto spec = spec_from_ivalue(ctx->saved_data["spec" + std::to_string(i)]);
      auto g = shard_impl(grads[i])
                   ? grads[i]
                   : make_shard_tensor(grads[i], ShardSpec::make(spec->mesh,
                                                                 Placements(spec->mesh->ndim(), Placement::replicate()),
                                                                 spec->global_shape));
      res[i] = redistribute_to(g, spec);
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

bool use_all_to_all(const Layout& l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const Placements& pq, const Placements& pk, const Placements& pv, const at::Tensor& q0,
                    const at::Tensor& k0, const at::Tensor& v0, const std::optional<at::Tensor>& mask,
                    bool is_causal) {
  if (l.seq_mesh_dim < 0 || !l.q_seq || !l.kv_ring) return false;
  const auto strategy = attention_strategy();
  if (strategy == "ring" || strategy == "ring_contiguous") return false;
  const auto nd = l.nd;
  bool heads_free = nd >= 3;
  for (int64_t m = 0; m < l.mesh->ndim() && heads_free; ++m)
    heads_free = !pq[m].is_shard(nd - 3) && !pk[m].is_shard(nd - 3) && !pv[m].is_shard(nd - 3);
  if (strategy == "all_to_all") {
    if (!heads_free)
      refuse(q0, k0, v0, mask, "the all_to_all strategy needs a heads dim (dim -3) that no mesh dim shards",
             "set_attention_strategy('ring') or 'auto', or redistribute the heads dim to Replicate");
    return true;
  }
  if (!heads_free) return false;
  const auto n = l.mesh->size(l.seq_mesh_dim);
  const auto hq = q.size(nd - 3), hk = k.size(nd - 3);
  if (hk % n != 0) return false;
  // Bytes per rank (leading dims and n-1 factors cancel): ring moves n-1 K/V shards, the all-to-all moves
  // (n-1)/n of q, k, v and the output.
  const double sq = static_cast<double>(q.size(nd - 2)), skv = static_cast<double>(k.size(nd - 2));
  const double d = static_cast<double>(q.size(nd - 1)), dv = static_cast<double>(v.size(nd - 1));
  const double ring = skv * hk * (d + dv);
  const double a2a = (sq * hq * (d + dv) + skv * hk * (d + dv)) / static_cast<double>(n);
  // Causal self-attention: the all-to-all gives every rank whole sequences of its heads (balanced work) and moves
  // less than the ring, which, even balanced by the zigzag layout, passes K/V n-1 times plus two permutations.
  if (is_causal) return true;
  return a2a <= ring;
}

at::Tensor sdpa_entry(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                      std::optional<double> scale, bool enable_gqa) {
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
      TORCH_CHECK_VALUE(enable_gqa && key.size(d) > 0 && query.size(d) % key.size(d) == 0 &&
                            key.size(d) == value.size(d),
                        "scaled_dot_product_attention: query heads (", query.size(d), ") differ from key/value heads (",
                        key.size(d), "); pass enable_gqa=True with query heads a multiple of key heads");
      gqa = query.size(d) / key.size(d);
      continue;
    }
    TORCH_CHECK_VALUE(query.size(d) == key.size(d) && key.size(d) == value.size(d),
                      "scaled_dot_product_attention on ShardTensors: leading dims of query, key and value must be "
                      "equal (no broadcasting), got ", query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  }
  if (dropout_p > 0.0)
    refuse(query, key, value, attn_mask,
           "dropout_p > 0 is not supported (the dropout pattern could not match single-device randomness)",
           "pass dropout_p=0.0 (e.g. module.eval() or dropout=0 in nn.MultiheadAttention), or run attention on "
           "full tensors");
  if (mask_t.defined() && mask_t.requires_grad() && at::GradMode::is_enabled())
    refuse(query, key, value, attn_mask, "a gradient for attn_mask is not supported",
           "pass attn_mask.detach()");
  if (mask_t.defined())
    TORCH_CHECK_VALUE(mask_t.dim() <= nd, "scaled_dot_product_attention: attn_mask has more dims than query");

  // Canonical inputs: ShardTensors without Partial.
  auto qkv = resolve_qkv({as_shard_input(query, mesh), as_shard_input(key, mesh), as_shard_input(value, mesh)});
  auto q = qkv[0], k = qkv[1], v = qkv[2];
  const auto pq = shard_impl(q)->spec()->placements, pk = shard_impl(k)->spec()->placements,
             pv = shard_impl(v)->spec()->placements;
  const auto eq = shard_impl(q)->spec()->dim_extents(), ek = shard_impl(k)->spec()->dim_extents(),
             ev = shard_impl(v)->spec()->dim_extents();
  const auto nm = mesh->ndim();
  for (int64_t m = 0; m < nm; ++m)
    if (pq[m].is_shard(nd - 1) || pk[m].is_shard(nd - 1) || pv[m].is_shard(nd - 1))
      refuse(query, key, value, attn_mask, "the head (embedding) dim -1 is sharded",
             "redistribute query, key and value so dim -1 is Replicate (e.g. shard the sequence dim -2)");
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
      // q replicated here: follow k/v's shard (q is sliced locally; the output is gathered back at the end).
      const Placement& b = pk[m].is_shard() ? pk[m] : pv[m];
      if (!b.is_shard()) continue;
      const auto d = b.dim;
      q_changed = true;
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
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));

  at::Tensor out;
  auto l = layout_of(qc, kc);
  if (use_all_to_all(l, qc, kc, vc, tq, tk, tk, query, key, value, attn_mask, is_causal)) {
    // Sequence shards -> head shards (an all-to-all each), local attention on full sequences, back.
    const auto sm = l.seq_mesh_dim, n = mesh->size(sm);
    auto hp_q = tq, hp_k = tk;
    hp_q[sm] = Placement::shard(nd - 3);
    hp_k[sm] = Placement::shard(nd - 3);
    auto hk_ext = default_split(key.size(nd - 3), n);
    auto hq_ext = hk_ext;
    for (auto& x : hq_ext) x *= gqa;
    auto xq_h = xq, xk_h = xk;
    xq_h.erase(nd - 2);
    xk_h.erase(nd - 2);
    xq_h[nd - 3] = hq_ext;
    xk_h[nd - 3] = hk_ext;
    auto qh = to_layout(qc, hp_q, xq_h), kh = to_layout(kc, hp_k, xk_h), vh = to_layout(vc, hp_k, xk_h);
    at::Tensor oh;
    if (!attn_mask || !attn_mask->defined()) {
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
        ol = at::scaled_dot_product_attention(ql, kl, vl, std::nullopt, 0.0, is_causal, sc, enable_gqa);
      }
      const auto& qspec = *shard_impl(qh)->spec();
      oh = from_local(ol, qspec.mesh, qspec.placements, ShapeInference::Explicit, qspec.sharding_shapes());
    } else {
      oh = at::scaled_dot_product_attention(qh, kh, vh, attn_mask, 0.0, is_causal, sc, enable_gqa);
    }
    out = to_layout(oh, tq, xq);
  } else {
    out = SdpaFn::apply(qc, kc, vc, attn_mask, sc, is_causal, gqa);
  }
  if (q_changed) {
    // Back to q's own layout (after Partial resolution).
    const auto& qspec = *shard_impl(q)->spec();
    out = to_layout(out, qspec.placements, qspec.dim_extents());
  }
  return out;
}

} // namespace

void register_attention() {
  static torch::Library autograd_lib(torch::Library::IMPL, "aten", kShardAutogradKey, __FILE__, __LINE__);
  autograd_lib.impl("scaled_dot_product_attention", TORCH_FN(sdpa_entry));
  // Inference mode skips autograd keys: bind the same entry point below autograd too.
  static torch::Library shard_lib(torch::Library::IMPL, "aten", kShardKey, __FILE__, __LINE__);
  shard_lib.impl("scaled_dot_product_attention", TORCH_FN(sdpa_entry));
}

} // namespace shardtensor::ops
