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

using dispatch::op_args;

at::Tensor opt_tensor(const c10::IValue& v) {
  auto t = v.toOptional<at::Tensor>();
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

// _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
//                              proj_bias, mask?, need_weights, average_attn_weights, mask_type?) -> (Tensor, Tensor)
void native_mha_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto a = op_args(op, stack);
  auto [out, weights] = multi_head_attention(a[0].toTensor(), a[1].toTensor(), a[2].toTensor(), a[3].toInt(),
                                             a[4].toInt(), a[5].toTensor(), a[6].toTensor(), a[7].toTensor(),
                                             a[8].toTensor(), opt_tensor(a[9]), a[10].toBool(), a[11].toBool(),
                                             a[12].toOptional<int64_t>());
  torch::jit::drop(*stack, a.size());
  torch::jit::push(*stack, std::move(out));
  torch::jit::push(*stack, std::move(weights));
}

// _transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
//     norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
//     ffn_weight_2, ffn_bias_2, mask?, mask_type?) -> Tensor
// Post-norm: x = norm1(src + sa(src)); out = norm2(x + ff(x)). Pre-norm: x = src + sa(norm1(src));
// out = x + ff(norm2(x)). ff = linear2(act(linear1(.))), act = exact gelu or relu. No dropout (eval only).
void encoder_layer_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto a = op_args(op, stack);
  const auto src = a[0].toTensor();
  const auto embed_dim = a[1].toInt(), heads = a[2].toInt();
  const bool use_gelu = a[7].toBool(), norm_first = a[8].toBool();
  const double eps = a[9].toDouble();
  auto norm = [&](const at::Tensor& x, int64_t w) {
    return at::layer_norm(x, {embed_dim}, a[w].toTensor(), a[w + 1].toTensor(), eps);
  };
  at::Tensor out;
  if (src.numel() == 0) {
    out = src.clone();
  } else {
    auto attend = [&](const at::Tensor& x) {
      return std::get<0>(multi_head_attention(x, x, x, embed_dim, heads, a[3].toTensor(), a[4].toTensor(),
                                              a[5].toTensor(), a[6].toTensor(), opt_tensor(a[18]), false, true,
                                              a[19].toOptional<int64_t>()));
    };
    auto feed_forward = [&](const at::Tensor& x) {
      auto h = at::linear(x, a[14].toTensor(), a[15].toTensor());
      h = use_gelu ? at::gelu(h) : at::relu(h);
      return at::linear(h, a[16].toTensor(), a[17].toTensor());
    };
    if (norm_first) {
      auto x = src + attend(norm(src, 10));
      out = x + feed_forward(norm(x, 12));
    } else {
      auto x = norm(src + attend(src), 10);
      out = norm(x + feed_forward(x), 12);
    }
  }
  torch::jit::drop(*stack, a.size());
  torch::jit::push(*stack, std::move(out));
}

// _nested_tensor_from_mask_left_aligned(t, mask) -> bool. nn.TransformerEncoder asks it before packing a padded
// batch into a NestedTensor; a ShardTensor cannot be packed, so the answer is "no" and the encoder runs its layers
// on the dense tensor with the key padding mask (outputs at padded positions are then the masked computation's,
// not zeros).
void nested_left_aligned_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::drop(*stack, op_args(op, stack).size());
  torch::jit::push(*stack, false);
}

// _nested_tensor_from_mask(t, mask, mask_check): reached when the encoder was built with mask_check=False (the
// question above is skipped). Refused on every rank alike.
void nested_from_mask_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::not_implemented(op, stack,
                            "a ShardTensor cannot be packed into a NestedTensor; build nn.TransformerEncoder with "
                            "enable_nested_tensor=False (or keep mask_check=True, which keeps the tensor dense)");
}

} // namespace

void register_transformer_fastpath() {
  dispatch::set_handler("aten::_native_multi_head_attention", native_mha_handler);
  dispatch::set_handler("aten::_transformer_encoder_layer_fwd", encoder_layer_handler);
  dispatch::set_handler("aten::_nested_tensor_from_mask_left_aligned", nested_left_aligned_handler);
  dispatch::set_handler("aten::_nested_tensor_from_mask", nested_from_mask_handler);
}

} // namespace shardtensor::ops
