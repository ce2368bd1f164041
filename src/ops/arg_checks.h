// Argument checks of rules against the GLOBAL shapes, run at the top of a rule before it communicates. A rule works
// on local shards and slices plain parameters to them, so the local kernel alone would accept arguments that do not
// fit the whole tensor (a weight with the wrong in_channels against a channel shard), run on some ranks and fail
// on others, or fail after collectives with the shapes of a shard. Every rank sees the same global shapes, so these
// checks raise the same ValueError on every rank, naming the op and the global shapes, as torch raises on one device.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace shardtensor::ops {

// A meta tensor of `t`'s global shape and dtype: run torch's own op on such tensors (under comm::HostMetadataGuard)
// to raise its own argument errors from the global shapes, on every rank alike, before any collective.
inline at::Tensor meta_like(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kMeta));
}

// aten::convolution's arguments (torch's check_shape_forward and parameter checks).
void check_convolution_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, int64_t groups);

// mm / bmm (batched) and, with `bias`, addmm / baddbmm: the operand shapes multiply and the bias broadcasts.
void check_contraction_args(const char* op, bool batched, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor* bias);

// linear(x, w, b) and matmul(a, b): the contracted sizes agree (and the bias broadcasts to the output).
void check_linear_args(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);
void check_matmul_args(const at::Tensor& a, const at::Tensor& b);

// native_layer_norm: the input ends with normalized_shape; weight and bias have that shape.
void check_layer_norm_args(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias);

// batch_norm: weight, bias and running statistics hold one element per channel (input dim 1).
void check_batch_norm_args(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var);

} // namespace shardtensor::ops
