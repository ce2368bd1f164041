// The inference fast paths of nn.MultiheadAttention, nn.TransformerEncoderLayer and nn.TransformerEncoder.
// In eval() with grad off (or nothing requiring grad), PyTorch's Python modules call fused ops that have only
// CPU/CUDA kernels: aten::_native_multi_head_attention and aten::_transformer_encoder_layer_fwd. On ShardTensors
// these handlers compute the same thing from ops that have domain-parallel rules: token-local projections
// (linear), attention through SDPA (ring or all-to-all) or, when the weights are wanted, through matmul and
// softmax, layer norm and the activation. Every branch depends on global shapes and argument kinds only, so all
// ranks issue the same collectives.
#include "ops/common.h"

#include <cmath>
#include <limits>

namespace shardtensor::ops {

namespace {

// An optional tensor argument as a tensor (undefined when absent).
at::Tensor or_undefined(const std::optional<at::Tensor>& t) {
  return t ? *t : at::Tensor();
}

// [B, L, E] -> [B, H, L, E/H]
at::Tensor split_heads(const at::Tensor& x, int64_t heads) {
  return x.view({x.size(0), x.size(1), heads, x.size(2) / heads}).transpose(1, 2);
}

// The fused kernels treat the mask as boolean (any non-zero entry excludes the key; Python passes bool masks as
// 0/-inf floats). Shapes by mask_type: 0 = [L, S], 1 = key padding [B, S], 2 = [B, H, L, S]. Returns a
// "masked out" boolean tensor broadcastable to [B, H, L, S].
at::Tensor masked_out(const at::Tensor& mask, std::optional<int64_t> mask_type, int64_t batch, int64_t q_len,
                      int64_t k_len) {
  auto m = mask.scalar_type() == at::kBool ? mask : mask.to(at::kBool);
  if (m.dim() == 4) return m;
  if (m.dim() == 2 && mask_type == 1) {
    TORCH_CHECK_VALUE(m.size(0) == batch && m.size(1) == k_len, "_native_multi_head_attention: key padding mask of ",
                      "shape ", m.sizes(), " does not match batch ", batch, " and key length ", k_len);
    return m.view({batch, 1, 1, k_len});
  }
  if (m.dim() == 2) {
    TORCH_CHECK_VALUE(m.size(0) == q_len && m.size(1) == k_len, "_native_multi_head_attention: attention mask of ",
                      "shape ", m.sizes(), " does not match query length ", q_len, " and key length ", k_len);
    return m.view({1, 1, q_len, k_len});
  }
  TORCH_CHECK_VALUE(false, "_native_multi_head_attention: mask must be 2-D or 4-D, got ", m.dim(), "-D");
}

// q/k/v projections as the fused kernel does them: one GEMM for self-attention, else per input with its third of
// the packed weight.
std::array<at::Tensor, 3> project_qkv(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& w, const at::Tensor& b) {
  if (query.is_same(key) && key.is_same(value)) {
    auto qkv = at::linear(query, w, b).chunk(3, -1);
    return {qkv[0], qkv[1], qkv[2]};
  }
  auto ws = w.chunk(3, 0), bs = b.chunk(3, 0);
  return {at::linear(query, ws[0], bs[0]), at::linear(key, ws[1], bs[1]), at::linear(value, ws[2], bs[2])};
}

// Returns (output [B, L, E], weights or undefined).
std::tuple<at::Tensor, at::Tensor> multi_head_attention(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& value, int64_t embed_dim, int64_t heads,
                                                        const at::Tensor& qkv_weight, const at::Tensor& qkv_bias,
                                                        const at::Tensor& proj_weight, const at::Tensor& proj_bias,
                                                        const at::Tensor& mask, bool need_weights, bool average,
                                                        std::optional<int64_t> mask_type) {
  TORCH_CHECK_VALUE(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
                    "_native_multi_head_attention: expected 3-D query, key and value");
  TORCH_CHECK_VALUE(query.size(2) == embed_dim, "_native_multi_head_attention: embed_dim ", embed_dim,
                    " does not match the last dim of query ", query.size(2));
  TORCH_CHECK_VALUE(embed_dim % heads == 0, "_native_multi_head_attention: embed_dim must divide by num_heads");
  const auto batch = query.size(0), q_len = query.size(1), k_len = key.size(1);
  if (query.numel() == 0 || key.numel() == 0) return {at::empty_like(query), at::Tensor()};
  auto [q, k, v] = project_qkv(query, key, value, qkv_weight, qkv_bias);
  q = split_heads(q, heads);
  k = split_heads(k, heads);
  v = split_heads(v, heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(embed_dim / heads));
  at::Tensor masked = mask.defined() ? masked_out(mask, mask_type, batch, q_len, k_len) : at::Tensor();
  at::Tensor ctx, weights;
  if (need_weights) {
    // The weights are an output: scores against every key (the key operand is gathered), as the fused kernel.
    auto scores = at::matmul(q * scale, k.transpose(-2, -1));
    if (masked.defined()) scores = scores.masked_fill(masked, -std::numeric_limits<double>::infinity());
    weights = at::softmax(scores, -1);
    ctx = at::matmul(weights, v);
    if (average) weights = weights.sum(1) / static_cast<double>(heads);
  } else {
    // Ring or all-to-all attention; SDPA's boolean mask means "attend".
    std::optional<at::Tensor> keep;
    if (masked.defined()) keep = masked.logical_not();
    ctx = at::scaled_dot_product_attention(q, k, v, keep, 0.0, false, scale);
    // The fused kernel's softmax leaves rows without any visible key NaN; SDPA zeroes them.
    if (masked.defined()) ctx = ctx.masked_fill(masked.all(-1, true), std::numeric_limits<double>::quiet_NaN());
  }
  auto merged = ctx.transpose(1, 2).reshape({batch, q_len, embed_dim});
  return {at::linear(merged, proj_weight, proj_bias), weights};
}

// _native_multi_head_attention(Tensor query, Tensor key, Tensor value, int embed_dim, int num_head,
//     Tensor qkv_weight, Tensor qkv_bias, Tensor proj_weight, Tensor proj_bias, Tensor? mask=None,
//     bool need_weights=True, bool average_attn_weights=True, int? mask_type=None) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> native_mha_rule(const at::Tensor& query, const at::Tensor& key,
                                                   const at::Tensor& value, int64_t embed_dim, int64_t num_head,
                                                   const at::Tensor& qkv_weight, const at::Tensor& qkv_bias,
                                                   const at::Tensor& proj_weight, const at::Tensor& proj_bias,
                                                   const std::optional<at::Tensor>& mask, bool need_weights,
                                                   bool average_attn_weights, std::optional<int64_t> mask_type) {
  return multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                              or_undefined(mask), need_weights, average_attn_weights, mask_type);
}

// Post-norm: x = norm1(src + sa(src)); out = norm2(x + ff(x)). Pre-norm: x = src + sa(norm1(src));
// out = x + ff(norm2(x)). ff = linear2(act(linear1(.))), act = exact gelu or relu. No dropout (eval only).
// _transformer_encoder_layer_fwd(Tensor src, int embed_dim, int num_heads, Tensor qkv_weight, Tensor qkv_bias,
//     Tensor proj_weight, Tensor proj_bias, bool use_gelu, bool norm_first, float eps, Tensor norm_weight_1,
//     Tensor norm_bias_1, Tensor norm_weight_2, Tensor norm_bias_2, Tensor ffn_weight_1, Tensor ffn_bias_1,
//     Tensor ffn_weight_2, Tensor ffn_bias_2, Tensor? mask=None, int? mask_type=None) -> Tensor
at::Tensor encoder_layer_rule(const at::Tensor& src, int64_t embed_dim, int64_t heads, const at::Tensor& qkv_weight,
                              const at::Tensor& qkv_bias, const at::Tensor& proj_weight, const at::Tensor& proj_bias,
                              bool use_gelu, bool norm_first, double eps, const at::Tensor& norm_weight_1,
                              const at::Tensor& norm_bias_1, const at::Tensor& norm_weight_2,
                              const at::Tensor& norm_bias_2, const at::Tensor& ffn_weight_1,
                              const at::Tensor& ffn_bias_1, const at::Tensor& ffn_weight_2,
                              const at::Tensor& ffn_bias_2, const std::optional<at::Tensor>& mask,
                              std::optional<int64_t> mask_type) {
  if (src.numel() == 0) return src.clone();
  auto norm = [&](const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
    return at::layer_norm(x, {embed_dim}, weight, bias, eps);
  };
  auto attend = [&](const at::Tensor& x) {
    return std::get<0>(multi_head_attention(x, x, x, embed_dim, heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                            or_undefined(mask), false, true, mask_type));
  };
  auto feed_forward = [&](const at::Tensor& x) {
    auto h = at::linear(x, ffn_weight_1, ffn_bias_1);
    h = use_gelu ? at::gelu(h) : at::relu(h);
    return at::linear(h, ffn_weight_2, ffn_bias_2);
  };
  if (norm_first) {
    auto x = src + attend(norm(src, norm_weight_1, norm_bias_1));
    return x + feed_forward(norm(x, norm_weight_2, norm_bias_2));
  }
  auto x = norm(src + attend(src), norm_weight_1, norm_bias_1);
  return norm(x + feed_forward(x), norm_weight_2, norm_bias_2);
}

// nn.TransformerEncoder asks it before packing a padded batch into a NestedTensor; a ShardTensor cannot be packed,
// so the answer is "no" and the encoder runs its layers on the dense tensor with the key padding mask (outputs at
// padded positions are then the masked computation's, not zeros).
// _nested_tensor_from_mask_left_aligned(Tensor t, Tensor mask) -> bool
bool nested_left_aligned_rule(const at::Tensor& /*t*/, const at::Tensor& /*mask*/) {
  return false;
}

// Reached when the encoder was built with mask_check=False (the question above is skipped). Refused on every rank
// alike.
// _nested_tensor_from_mask(Tensor t, Tensor mask, bool mask_check=True) -> Tensor
at::Tensor nested_from_mask_rule(const at::Tensor& /*t*/, const at::Tensor& /*mask*/, bool /*mask_check*/) {
  dispatch::not_implemented("a ShardTensor cannot be packed into a NestedTensor; build nn.TransformerEncoder with "
                            "enable_nested_tensor=False (or keep mask_check=True, which keeps the tensor dense)");
}

} // namespace

SHARDTENSOR_RULE_FAMILY(transformer_fastpath) {
  dispatch::set_handler("aten::_native_multi_head_attention", typed_handler(&native_mha_rule));
  dispatch::set_handler("aten::_transformer_encoder_layer_fwd", typed_handler(&encoder_layer_rule));
  dispatch::set_handler("aten::_nested_tensor_from_mask_left_aligned", typed_handler(&nested_left_aligned_rule));
  dispatch::set_handler("aten::_nested_tensor_from_mask", typed_handler(&nested_from_mask_rule));
}

} // namespace shardtensor::ops
