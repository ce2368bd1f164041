#include "ops/arg_checks.h"
#include "ops/concrete_ints.h"

#include <ATen/ExpandUtils.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace shardtensor::ops {

namespace {

bool defined(const std::optional<at::Tensor>& t) {
  return t && t->defined();
}

// "input [2, 4, 8, 8] (global), weight [3, 5, 3, 3]": the shapes every message names.
std::string shapes(std::initializer_list<std::pair<const char*, const at::Tensor*>> named) {
  std::ostringstream os;
  bool first = true;
  for (const auto& [name, t] : named) {
    if (!t || !t->defined()) continue;
    os << (first ? "" : ", ") << name << " " << t->sizes();
    first = false;
  }
  os << " (global shapes)";
  return os.str();
}

// A convolution parameter list: one value, or one per spatial dim.
int64_t param(at::IntArrayRef v, int64_t i, int64_t fallback) {
  if (v.empty()) return fallback;
  return v.size() == 1 ? v[0] : v[i];
}

} // namespace

void check_convolution_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, int64_t groups) {
  const at::Tensor* b = defined(bias) ? &*bias : nullptr;
  const auto all = shapes({{"input", &input}, {"weight", &weight}, {"bias", b}});
  const char* op = transposed ? "ShardTensor convolution (transposed)" : "ShardTensor convolution";
  const auto nd = input.dim();
  TORCH_CHECK_VALUE(nd >= 3 && weight.dim() == nd, op, ": expected a weight with as many dims as the input (at least "
                    "3), got ", all);
  const auto spatial = nd - 2;
  TORCH_CHECK_VALUE(groups > 0, op, ": groups must be positive, got ", groups);
  for (auto [name, v] : {std::pair<const char*, at::IntArrayRef>{"stride", stride}, {"padding", padding},
                         {"dilation", dilation}, {"output_padding", output_padding}}) {
    TORCH_CHECK_VALUE(v.empty() || v.size() == 1 || static_cast<int64_t>(v.size()) == spatial, op, ": ", name, " ",
                      v, " must have one value or one per spatial dim (", spatial, ")");
  }
  for (int64_t i = 0; i < spatial; ++i) {
    TORCH_CHECK_VALUE(param(stride, i, 1) > 0, op, ": stride must be positive, got ", stride);
    TORCH_CHECK_VALUE(param(dilation, i, 1) > 0, op, ": dilation must be positive, got ", dilation);
    TORCH_CHECK_VALUE(param(padding, i, 0) >= 0, op, ": negative padding is not supported, got ", padding);
    TORCH_CHECK_VALUE(param(output_padding, i, 0) >= 0, op, ": negative output_padding is not supported, got ",
                      output_padding);
  }
  const auto cin = input.size(1);
  int64_t cout = 0;
  if (!transposed) {
    TORCH_CHECK_VALUE(weight.size(0) % groups == 0, op, ": groups=", groups, " must divide the weight's dim 0; got ",
                      all);
    TORCH_CHECK_VALUE(cin == weight.size(1) * groups, op, ": groups=", groups, " and a weight of in_channels ",
                      weight.size(1), " expect an input of ", weight.size(1) * groups, " channels, but the input has ",
                      cin, "; got ", all);
    cout = weight.size(0);
  } else {
    TORCH_CHECK_VALUE(cin == weight.size(0), op, ": a weight with dim 0 of ", weight.size(0),
                      " expects an input of as many channels, but the input has ", cin, "; got ", all);
    TORCH_CHECK_VALUE(weight.size(0) % groups == 0, op, ": groups=", groups, " must divide the weight's dim 0; got ",
                      all);
    cout = weight.size(1) * groups;
  }
  if (b) TORCH_CHECK_VALUE(b->dim() == 1 && b->size(0) == cout, op, ": expected a 1-D bias of ", cout,
                           " elements; got ", all);
  for (int64_t i = 0; i < spatial; ++i) {
    const auto L = input.size(2 + i), k = weight.size(2 + i);
    const auto s = param(stride, i, 1), p = param(padding, i, 0), d = param(dilation, i, 1);
    const auto span = d * (k - 1) + 1;
    if (!transposed) {
      TORCH_CHECK_VALUE(L + 2 * p >= span, op, ": the padded input size ", L + 2 * p, " of spatial dim ", i,
                        " is smaller than the dilated kernel (", span, "); got ", all);
    } else {
      const auto op_ = param(output_padding, i, 0);
      TORCH_CHECK_VALUE(op_ < s || op_ < d, op, ": output_padding must be smaller than stride or dilation, got ",
                        output_padding);
      TORCH_CHECK_VALUE((L - 1) * s - 2 * p + span + op_ > 0, op, ": the output size of spatial dim ", i,
                        " would not be positive; got ", all);
    }
  }
}

void check_contraction_args(const char* op, bool batched, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor* bias) {
  const auto all = shapes({{"self", bias}, {batched ? "batch1" : "mat1", &a}, {batched ? "batch2" : "mat2", &b}});
  const int64_t nd = batched ? 3 : 2;
  TORCH_CHECK_VALUE(a.dim() == nd && b.dim() == nd, op, ": expected ", nd, "-D operands, got ", all);
  TORCH_CHECK_VALUE(!batched || a.size(0) == b.size(0), op, ": the batch sizes differ; got ", all);
  TORCH_CHECK_VALUE(a.size(nd - 1) == b.size(nd - 2), op, ": the shapes cannot be multiplied (", a.size(nd - 1),
                    " columns against ", b.size(nd - 2), " rows); got ", all);
  if (bias && bias->defined()) {
    std::vector<int64_t> out = batched ? std::vector<int64_t>{a.size(0), a.size(1), b.size(2)}
                                       : std::vector<int64_t>{a.size(0), b.size(1)};
    TORCH_CHECK_VALUE(at::is_expandable_to(bias->sizes(), out), op, ": self does not broadcast to the product's shape ",
                      c10::IntArrayRef(out), "; got ", all);
  }
}

void check_vector_product_args(const char* op, VectorProduct kind, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor* bias) {
  const bool mv = kind == VectorProduct::mv;
  const auto all = shapes({{"self", bias}, {mv ? "mat" : "vec1", &a}, {mv ? "vec" : "vec2", &b}});
  TORCH_CHECK_VALUE(a.dim() == (mv ? 2 : 1) && b.dim() == 1, op, ": expected ", mv ? "a matrix and a vector" :
                    "two 1-D vectors", ", got ", all);
  if (kind == VectorProduct::dot) {
    TORCH_CHECK_VALUE(a.size(0) == b.size(0), op, ": inconsistent tensor size, expected tensors of the same number "
                      "of elements, got ", all);
    TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), op, ": expected both vectors to have same dtype, but found ",
                      a.scalar_type(), " and ", b.scalar_type());
  }
  if (mv)
    TORCH_CHECK_VALUE(a.size(1) == b.size(0), op, ": size mismatch (", a.size(1), " columns against a vector of ",
                      b.size(0), "); got ", all);
  if (bias && bias->defined()) {
    std::vector<int64_t> out = mv ? std::vector<int64_t>{a.size(0)} : std::vector<int64_t>{a.size(0), b.size(0)};
    TORCH_CHECK_VALUE(at::is_expandable_to(bias->sizes(), out), op, ": self does not broadcast to the product's "
                      "shape ", c10::IntArrayRef(out), "; got ", all);
  }
}

void check_cross_args(const at::Tensor& a, const at::Tensor& b, int64_t dim) {
  const auto all = shapes({{"input", &a}, {"other", &b}});
  TORCH_CHECK_VALUE(a.dim() == b.dim(), "linalg.cross: inputs must have the same number of dimensions; got ", all);
  const auto out = at::infer_size(a.sizes(), b.sizes()); // raises torch's own broadcast error
  const auto d = at::maybe_wrap_dim(dim, static_cast<int64_t>(out.size()));
  TORCH_CHECK_VALUE(a.size(d) == 3 && b.size(d) == 3, "linalg.cross: inputs dimension ", dim, " must have length 3; "
                    "got ", all);
}

void check_dist_args(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "dist(): expected both inputs to have same dtype, but self "
                    "has ", a.scalar_type(), " and other has ", b.scalar_type());
  at::infer_size(a.sizes(), b.sizes());
}

void check_cdist_args(const at::Tensor& x1, const at::Tensor& x2, double p) {
  const auto all = shapes({{"x1", &x1}, {"x2", &x2}});
  TORCH_CHECK_VALUE(x1.dim() >= 2 && x2.dim() >= 2, "cdist only supports at least 2D tensors; got ", all);
  TORCH_CHECK_VALUE(x1.size(-1) == x2.size(-1), "X1 and X2 must have the same number of columns. X1: ", x1.size(-1),
                    " X2: ", x2.size(-1));
  TORCH_CHECK_VALUE(p >= 0, "cdist only supports non-negative p values");
  at::infer_size(x1.sizes().slice(0, x1.dim() - 2), x2.sizes().slice(0, x2.dim() - 2));
}

void check_topk_args(const at::Tensor& self, int64_t k, int64_t dim) {
  const auto n = self.dim() == 0 ? 1 : self.size(dim);
  TORCH_CHECK_VALUE(k >= 0 && k <= n, "selected index k out of range (k = ", k, ", the dim's size ", n, ")");
}

void check_linear_args(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const at::Tensor* bp = defined(b) ? &*b : nullptr;
  const auto all = shapes({{"input", &x}, {"weight", &w}, {"bias", bp}});
  TORCH_CHECK_VALUE(x.dim() >= 1 && (w.dim() == 1 || w.dim() == 2), "ShardTensor linear: expected an input of at "
                    "least 1 dim and a 1-D or 2-D weight, got ", all);
  TORCH_CHECK_VALUE(x.size(-1) == w.size(-1), "ShardTensor linear: the input's last dim (", x.size(-1),
                    ") differs from the weight's in_features (", w.size(-1), "); got ", all);
  if (bp) {
    auto out = x.sizes().vec();
    out.pop_back();
    if (w.dim() == 2) out.push_back(w.size(0));
    TORCH_CHECK_VALUE(at::is_expandable_to(bp->sizes(), out), "ShardTensor linear: the bias does not broadcast to the "
                      "output shape ", c10::IntArrayRef(out), "; got ", all);
  }
}

void check_matmul_args(const at::Tensor& a, const at::Tensor& b) {
  const auto all = shapes({{"self", &a}, {"other", &b}});
  TORCH_CHECK_VALUE(a.dim() >= 1 && b.dim() >= 1, "ShardTensor matmul: both arguments need at least 1 dim, got ", all);
  const auto kb = b.dim() == 1 ? b.size(0) : b.size(-2);
  TORCH_CHECK_VALUE(a.size(-1) == kb, "ShardTensor matmul: the shapes cannot be multiplied (", a.size(-1),
                    " against ", kb, "); got ", all);
}

void check_layer_norm_args(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias) {
  const at::Tensor* w = defined(weight) ? &*weight : nullptr;
  const at::Tensor* b = defined(bias) ? &*bias : nullptr;
  const auto all = shapes({{"input", &input}, {"weight", w}, {"bias", b}});
  const auto k = static_cast<int64_t>(normalized_shape.size());
  std::vector<int64_t> ns;
  for (const auto& s : normalized_shape) ns.push_back(concrete_int(s));
  bool fits = k >= 1 && k <= input.dim();
  for (int64_t i = 0; fits && i < k; ++i) fits = input.size(input.dim() - k + i) == ns[i];
  TORCH_CHECK_VALUE(fits, "ShardTensor layer_norm: normalized_shape=", c10::IntArrayRef(ns),
                    " expects an input whose last dims are ", c10::IntArrayRef(ns), "; got ", all);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"weight", w}, {"bias", b}})
    if (t) TORCH_CHECK_VALUE(t->sizes() == c10::IntArrayRef(ns), "ShardTensor layer_norm: the ", name,
                             " must have the shape normalized_shape=", c10::IntArrayRef(ns), "; got ", all);
}

void check_batch_norm_args(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var) {
  const at::Tensor* w = defined(weight) ? &*weight : nullptr;
  const at::Tensor* b = defined(bias) ? &*bias : nullptr;
  const at::Tensor* rm = defined(running_mean) ? &*running_mean : nullptr;
  const at::Tensor* rv = defined(running_var) ? &*running_var : nullptr;
  const auto all = shapes({{"input", &input}, {"weight", w}, {"bias", b}, {"running_mean", rm}, {"running_var", rv}});
  TORCH_CHECK_VALUE(input.dim() >= 2, "ShardTensor batch_norm: expected an input of at least 2 dims, got ", all);
  const auto c = input.size(1);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"weight", w}, {"bias", b}, {"running_mean", rm},
                         {"running_var", rv}})
    if (t) TORCH_CHECK_VALUE(t->numel() == c, "ShardTensor batch_norm: ", name, " should contain ", c,
                             " elements (one per channel) not ", t->numel(), "; got ", all);
}

} // namespace shardtensor::ops
