// Block kernels of sharded attention. Unmasked fully visible blocks (and causal diagonal blocks whose queries and
// keys cover the same positions) use the CPU flash kernels, forward (which returns the log-sum-exp) and backward
// (given the global output and log-sum-exp), or on CUDA PyTorch's flash / memory-efficient kernels; masked or
// unaligned partially causal blocks use fp32 matmul/softmax math with an explicit log-sum-exp and recompute their
// probabilities in backward.
#include "ops/attention_block.h"

#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

#ifdef SHARDTENSOR_HAVE_CUDA
#include "lse_merge.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdlib>
#include <string>

namespace shardtensor::ops::attention {

namespace {

// Additive fp32 bias of one block (user mask columns + causal part), or undefined.
at::Tensor block_bias(const BlockCfg& c, Visibility vis, const BlockRange& r, const at::Device& dev) {
  at::Tensor bias;
  if (c.mask.defined()) {
    bias = c.mask.size(-1) == 1 ? c.mask : c.mask.narrow(-1, r.ko, r.nk);
    if (bias.size(-2) > 1) bias = bias.narrow(-2, r.q_start, r.nq);  // mask rows follow the local queries
  }
  if (vis == Visibility::Partial) {
    auto opts = at::TensorOptions().dtype(at::kLong).device(dev);
    auto qi = at::arange(c.qo, c.qo + r.nq, opts).unsqueeze(1);
    auto kj = at::arange(r.ko, r.ko + r.nk, opts).unsqueeze(0);
    auto causal = at::zeros({r.nq, r.nk}, at::TensorOptions().dtype(at::kFloat).device(dev))
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

// A causal block whose queries and keys cover the same global positions: PyTorch's top-left causal mask is the
// global one, so the fused kernels apply (no score matrix).
bool aligned_causal(const BlockCfg& c, Visibility vis, const BlockRange& r) {
  return vis == Visibility::Partial && !c.mask.defined() && r.ko == c.qo && r.nk == r.nq;
}

// Can the CPU flash forward kernel compute a block of these tensors?
// (3-D inputs, batch x sequence x head dim, run as one head: the kernels take 4-D.)
bool flash_forward_ok(const at::Tensor& q, const at::Tensor& vb, const BlockCfg& c) {
  return (c.nd == 4 || c.nd == 3) && q.size(-1) == vb.size(-1) && q.device().is_cpu() &&
      (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble || q.scalar_type() == at::kBFloat16 ||
       q.scalar_type() == at::kHalf);
}

// The CPU flash backward: fp32 only.
bool flash_backward_ok(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockCfg& c) {
  return (c.nd == 4 || c.nd == 3) && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
      q.size(-1) == v.size(-1) && q.device().is_cpu();
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

// One bias-free block through a fused kernel (the head dim has unit stride): output and log-sum-exp in fp32/acc.
std::pair<at::Tensor, at::Tensor> fused_block_forward(const at::Tensor& q, const at::Tensor& ke, const at::Tensor& ve,
                                                      const BlockCfg& c, bool diag) {
  if (cuda_fused_ok(q, ve, c)) {
    if (q.scalar_type() != at::kFloat) {
      auto o = at::_scaled_dot_product_flash_attention(q, ke, ve, 0.0, diag, false, c.scale);
      return {std::get<0>(o).to(at::kFloat), std::get<1>(o).to(at::kFloat)};
    }
    // The efficient kernel pads its log-sum-exp rows to a multiple of 32.
    auto o = at::_scaled_dot_product_efficient_attention(q, ke, ve, std::nullopt, true, 0.0, diag, c.scale);
    return {std::get<0>(o).to(at::kFloat), std::get<1>(o).narrow(-1, 0, q.size(-2)).to(at::kFloat)};
  }
  const auto acc = accumulate_type(q);
  if (q.dim() == 3) {  // one head
    auto [o, lse] = fused_block_forward(q.unsqueeze(1), ke.unsqueeze(1), ve.unsqueeze(1), c, diag);
    return {o.squeeze(1), lse.squeeze(1)};
  }
  auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, ke, ve, 0.0, diag, std::nullopt, c.scale);
  return {o.to(acc), lse.to(acc)};
}

} // namespace

// The fused kernels (CPU flash, CUDA flash and memory-efficient) do not check the head dim's stride: a transposed
// or permuted view (q = x.transpose(-1, -2), qkv[..., i, :]) gave silently wrong values. PyTorch's public entry
// checks it before choosing them; these direct calls must ensure it.
at::Tensor unit_stride_head(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

Visibility visibility(const BlockCfg& c, int64_t nq, int64_t ko, int64_t nk) {
  if (nq == 0 || nk == 0) return Visibility::None;
  if (!c.causal) return Visibility::Full;
  if (ko > c.qo + nq - 1) return Visibility::None;  // every key in the future of every query
  if (ko + nk - 1 <= c.qo) return Visibility::Full;
  return Visibility::Partial;
}

std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                                                const BlockCfg& c, Visibility vis, const BlockRange& r) {
  const bool fused = flash_forward_ok(q, vb, c) || cuda_fused_ok(q, vb, c);
  const bool diag = fused && aligned_causal(c, vis, r);
  auto bias = diag ? at::Tensor() : block_bias(c, vis, r, q.device());
  auto ke = expand_heads(kb, c), ve = expand_heads(vb, c);
  const auto acc = accumulate_type(q);
  if (!bias.defined() && fused) {
    auto qd = unit_stride_head(q);
    ke = unit_stride_head(ke);
    ve = unit_stride_head(ve);
    return fused_block_forward(qd, ke, ve, c, diag);
  }
  // Normalized by the row's sum about its maximum, as softmax is: exp(s - lse) would carry the rounding of the
  // log-sum-exp (an ulp of |lse|, 1e-5 relative at logits of 200 in fp32) into every weight. A row with a finite
  // score sums to at least 1 (its maximum's term); a fully masked row sums to 0 and gives 0 with lse = -inf.
  auto s = block_scores(q.to(acc), ke.to(acc), bias, c.scale);
  auto mx = std::get<0>(s.max(-1, /*keepdim=*/true));
  auto safe = at::where(at::isinf(mx), at::zeros_like(mx), mx);
  auto e = (s - safe).exp_();
  auto sum = e.sum(-1, /*keepdim=*/true);
  auto lse = (safe + sum.log()).squeeze(-1);
  return {at::matmul(e, ve.to(acc)).div_(sum.clamp_min(1.0)), lse};
}

void block_backward(const BlockGradInputs& in, const BlockCfg& c, Visibility vis, const BlockRange& r,
                    at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  const bool flash = flash_backward_ok(in.q, in.k, in.v, c);
  const bool cuda_fused = cuda_fused_ok(in.q, in.v, c);
  const bool diag = (flash || cuda_fused) && aligned_causal(c, vis, r);
  auto bias = diag ? at::Tensor() : block_bias(c, vis, r, in.q.device());
  if (cuda_fused && !bias.defined()) {
    auto [dq_b, dk_e, dv_e] = cuda_block_backward(in.g, in.q, expand_heads(in.k, c), expand_heads(in.v, c), in.out,
                                                  in.lse, diag, c.scale);
    dq.add_(dq_b.to(dq.scalar_type()));
    dk.add_(reduce_heads(dk_e.to(dk.scalar_type()), c));
    dv.add_(reduce_heads(dv_e.to(dv.scalar_type()), c));
  } else if (flash && !bias.defined()) {
    // Fully visible fp32 block: the CPU flash backward, given the global output and log-sum-exp, yields this
    // block's exact contributions in O(S) memory (no score matrix).
    const bool one_head = in.q.dim() == 3;  // run as 4-D, one head
    auto four = [&](const at::Tensor& t) { return (one_head ? t.unsqueeze(1) : t).contiguous(); };
    auto [dq_b, dk_e, dv_e] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        four(in.g), four(in.q), four(expand_heads(in.k, c)), four(expand_heads(in.v, c)), four(in.out),
        four(in.lse), 0.0, diag, std::nullopt, c.scale);
    if (one_head) {
      dq_b = dq_b.squeeze(1);
      dk_e = dk_e.squeeze(1);
      dv_e = dv_e.squeeze(1);
    }
    dq.add_(dq_b);
    dk.add_(reduce_heads(dk_e.to(dk.scalar_type()), c));
    dv.add_(reduce_heads(dv_e.to(dv.scalar_type()), c));
  } else {
    const auto acc = in.qf.scalar_type();
    auto kf = expand_heads(in.k, c).to(acc), vf = expand_heads(in.v, c).to(acc);
    // A block of every key is the whole softmax row: normalized by its own sum (exact to an ulp), not by
    // exp(-lse), which carries the log-sum-exp's rounding into every weight.
    auto s = block_scores(in.qf, kf, bias, c.scale);
    auto p = r.ko == 0 && r.nk == c.keys ? at::softmax(s, -1).nan_to_num_(0.0) : (s - in.lse_safe).exp_();
    auto dv_e = at::matmul(p.transpose(-1, -2), in.g);
    auto dp = at::matmul(in.g, vf.transpose(-1, -2));
    auto ds = p.mul_(dp.sub_(in.dsum));
    dq.add_(at::matmul(ds, kf), c.scale);
    auto dk_e = at::matmul(ds.transpose(-1, -2), in.qf).mul_(c.scale);
    dk.add_(reduce_heads(dk_e, c));
    dv.add_(reduce_heads(dv_e, c));
  }
}

void merge(const at::Tensor& acc, const at::Tensor& acc_lse, const at::Tensor& o, const at::Tensor& lse) {
#ifdef SHARDTENSOR_HAVE_CUDA
  if (acc.is_cuda() && acc.scalar_type() == at::kFloat && acc.is_contiguous() && acc_lse.is_contiguous()) {
    c10::cuda::CUDAGuard guard(acc.device());
    auto oc = o.to(at::kFloat).contiguous(), lc = lse.to(at::kFloat).contiguous();
    cuda::lse_merge(acc.data_ptr<float>(), acc_lse.data_ptr<float>(), oc.data_ptr<float>(), lc.data_ptr<float>(),
                    acc_lse.numel(), acc.size(-1), c10::cuda::getCurrentCUDAStream(acc.device().index()).stream());
    return;
  }
#endif
  // Written through the caller's views (the query rows of a block: no copy of the accumulator); the weights are a
  // row each, the output rows are read and written once.
  auto m = at::logaddexp(acc_lse, lse);
  auto wa = at::nan_to_num((acc_lse - m).exp(), 0.0);
  auto wb = at::nan_to_num((lse - m).exp(), 0.0);
  acc.mul_(wa.unsqueeze(-1)).addcmul_(o, wb.unsqueeze(-1));
  acc_lse.copy_(m);
}

} // namespace shardtensor::ops::attention
