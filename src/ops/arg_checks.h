// Argument checks of rules against the GLOBAL shapes, run at the top of a rule before it communicates. A rule works
// on local shards and slices plain parameters to them, so the local kernel alone would accept arguments that do not
// fit the whole tensor (a weight with the wrong in_channels against a channel shard), run on some ranks and fail
// on others, or fail after collectives with the shapes of a shard. Every rank sees the same global shapes, so these
// checks raise the same ValueError on every rank, naming the op and the global shapes, as torch raises on one device.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace shardtensor::ops {

// aten::convolution's arguments (torch's check_shape_forward and parameter checks).
void check_convolution_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, int64_t groups);

// mm / bmm (batched) and, with `bias`, addmm / baddbmm: the operand shapes multiply and the bias broadcasts.
void check_contraction_args(const char* op, bool batched, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor* bias);

// The vector products: dot / vdot (`a`, `b` 1-D of one size and dtype), mv / addmv (`a` a matrix, `b` a vector of
// its columns; addmv's `bias` broadcasts to the rows), addr (`a`, `b` vectors; `bias` broadcasts to their outer
// product).
enum class VectorProduct { dot, mv, outer };
void check_vector_product_args(const char* op, VectorProduct kind, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor* bias);

// linalg_cross: operands of one rank that broadcast, 3 components along `dim`. dist: operands that broadcast, one
// dtype. _cdist_forward: two operands of rank >= 2 with one feature count, p >= 0. topk: 0 <= k <= the dim's size.
void check_cross_args(const at::Tensor& a, const at::Tensor& b, int64_t dim);
void check_dist_args(const at::Tensor& a, const at::Tensor& b);
void check_cdist_args(const at::Tensor& x1, const at::Tensor& x2, double p);
void check_topk_args(const at::Tensor& self, int64_t k, int64_t dim);

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
