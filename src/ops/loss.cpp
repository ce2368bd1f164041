// Losses and scans over sharded dims. Pointwise losses (mse, smooth_l1, huber, binary cross-entropy with and without
// logits) are composed from sharded ops,
// so `mean`/`sum` reductions give Partial sums. nll_loss (and cross_entropy through it) over sharded batch, spatial or
// class dims: per-rank sums of the picked log-probabilities and of the class weights, all-reduced together.
// cumsum, cumprod, logcumsumexp: local scan combined with the totals of
// lower ranks. flip along a
// sharded dim mirrors the ranks.
#include "comm/collectives.h"
#include "comm/functional.h"
#include "comm/stat_reduce.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include <torch/autograd.h>

#include <limits>

namespace shardtensor::ops {

namespace {

enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

at::Tensor reduce_loss(const at::Tensor& l, int64_t reduction) {
  switch (reduction) {
    case kMean: return at::mean(l);
    case kSum: return at::sum(l);
    default: return l;
  }
}

// d(loss)/d(elementwise loss) for the given reduction: grad broadcast, divided by the element count for mean.
at::Tensor reduce_grad(const at::Tensor& grad, const at::Tensor& like, int64_t reduction) {
  return reduction == kMean ? grad / static_cast<double>(like.numel()) : grad;
}

// mse_loss(Tensor self, Tensor target, int reduction=Mean)
at::Tensor mse_loss_rule(const at::Tensor& self, const at::Tensor& target, int64_t reduction) {
  auto d = at::sub(self, target);
  return reduce_loss(d * d, reduction);
}

// mse_loss_backward(Tensor grad_output, Tensor self, Tensor target, int reduction)
at::Tensor mse_loss_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& target,
                                  int64_t reduction) {
  auto d = at::sub(self, target);
  return reduce_grad(grad_output, self, reduction) * d * 2.0;
}

// soft_margin_loss(Tensor self, Tensor target, int reduction=Mean): log(1 + exp(-target * self)), elementwise
// (target broadcast to self's layout by the pointwise rules), then reduced.
at::Tensor soft_margin_loss_rule(const at::Tensor& self, const at::Tensor& target, int64_t reduction) {
  return reduce_loss(at::log1p(at::exp(at::neg(target) * self)), reduction);
}

// soft_margin_loss_backward(Tensor grad_output, Tensor self, Tensor target, int reduction)
at::Tensor soft_margin_loss_backward_rule(const at::Tensor& grad_output, const at::Tensor& self,
                                          const at::Tensor& target, int64_t reduction) {
  auto z = at::exp(at::neg(target) * self);
  return reduce_grad(grad_output, self, reduction) * at::neg(target) * z / (z + 1.0);
}

// Elementwise smooth L1 of d = self - target (|d| = a): quadratic below beta, linear above; |d| when beta is 0.
at::Tensor smooth_l1_terms(const at::Tensor& d, const at::Tensor& a, double beta) {
  if (beta == 0) return a;
  return at::where(at::lt(a, beta), d * d * (0.5 / beta), a - 0.5 * beta);
}

// Elementwise Huber loss: smooth L1 scaled by delta.
at::Tensor huber_terms(const at::Tensor& d, const at::Tensor& a, double delta) {
  return at::where(at::lt(a, delta), d * d * 0.5, (a - 0.5 * delta) * delta);
}

// smooth_l1_loss(Tensor self, Tensor target, int reduction=Mean, float beta=1.0)
at::Tensor smooth_l1_loss_rule(const at::Tensor& self, const at::Tensor& target, int64_t reduction, double beta) {
  TORCH_CHECK_VALUE(beta >= 0, "smooth_l1_loss does not support negative values for beta.");
  auto d = at::sub(self, target);
  return reduce_loss(smooth_l1_terms(d, at::abs(d), beta), reduction);
}

// huber_loss(Tensor self, Tensor target, int reduction=Mean, float delta=1.0)
at::Tensor huber_loss_rule(const at::Tensor& self, const at::Tensor& target, int64_t reduction, double delta) {
  TORCH_CHECK_VALUE(delta > 0, "huber_loss does not support non-positive values for delta.");
  auto d = at::sub(self, target);
  return reduce_loss(huber_terms(d, at::abs(d), delta), reduction);
}

// d(smooth L1)/d(self) elementwise.
at::Tensor smooth_l1_term_grad(const at::Tensor& d, const at::Tensor& a, double beta) {
  if (beta == 0) return at::sign(d);
  return at::where(at::lt(a, beta), d / beta, at::sign(d));
}

// d(Huber)/d(self) elementwise.
at::Tensor huber_term_grad(const at::Tensor& d, const at::Tensor& a, double delta) {
  return at::where(at::lt(a, delta), d, at::sign(d) * delta);
}

// smooth_l1_loss_backward(Tensor grad_output, Tensor self, Tensor target, int reduction, float beta)
at::Tensor smooth_l1_loss_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& target,
                                        int64_t reduction, double beta) {
  auto d = at::sub(self, target);
  auto local_grad = smooth_l1_term_grad(d, at::abs(d), beta);
  return reduce_grad(grad_output, self, reduction) * local_grad;
}

// huber_loss_backward(Tensor grad_output, Tensor self, Tensor target, int reduction, float delta)
at::Tensor huber_loss_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& target,
                                    int64_t reduction, double delta) {
  auto d = at::sub(self, target);
  auto local_grad = huber_term_grad(d, at::abs(d), delta);
  return reduce_grad(grad_output, self, reduction) * local_grad;
}

// binary_cross_entropy_with_logits(Tensor self, Tensor target, Tensor? weight=None, Tensor? pos_weight=None,
//                                   int reduction=Mean): torch's stable form, -w [p t log σ(x) + (1 - t) log(1 - σ(x))]
// = w [(1 - t) x - (1 + (p - 1) t) log σ(x)], composed from sharded ops; its gradients are autograd's formulas
// (pointwise).
// The in-place steps are torch's own: with a float64 input and a float32 target (torchvision's RPN passes float32
// labels) torch computes `(1 - t) x` and the loss in the target's dtype, and so does this rule.
at::Tensor bce_with_logits_rule(const at::Tensor& self_in, const at::Tensor& target_in,
                                const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& pos_weight,
                                int64_t reduction) {
  const auto mesh = dispatch::common_mesh("aten::binary_cross_entropy_with_logits", {self_in, target_in});
  const auto self = as_shard_input(self_in, mesh), target = as_shard_input(target_in, mesh);
  auto log_sig = at::log_sigmoid(self);
  if (pos_weight && pos_weight->defined()) log_sig.mul_(at::sub(*pos_weight, 1).mul(target).add_(1));
  auto loss = at::rsub(target, 1).mul_(self).sub_(log_sig);
  if (weight && weight->defined()) loss.mul_(*weight);
  return reduce_loss(loss, reduction);
}

// binary_cross_entropy's check that every input is a probability, agreed by every rank (one small collective) so
// that all raise alike; not under simulation or tracing, where values are not known.
void check_probabilities(const at::Tensor& self) {
  auto* impl = shard_impl(self);
  if (!impl) return;
  const auto& x = impl->local();
  if (x.is_meta() || comm::tracing(x)) return;
  const auto& spec = *impl->spec();
  std::vector<int64_t> dims;
  for (int64_t m = 0; m < static_cast<int64_t>(spec.placements.size()); ++m)
    if (spec.placements[m].is_shard()) dims.push_back(m);
  auto bad = at::logical_not(at::logical_and(x >= 0, x <= 1)).any().to(at::kFloat).reshape({1});
  comm::StatReduce r;
  const auto i = r.max(bad);
  r.run(*spec.mesh, dims);
  TORCH_CHECK(r.result(i)[0].item<float>() == 0, "all elements of input should be between 0 and 1");
}

// binary_cross_entropy(Tensor self, Tensor target, Tensor? weight=None, int reduction=Mean): torch's form with the
// logarithms clamped at -100.
at::Tensor bce_rule(const at::Tensor& self, const at::Tensor& target, const std::optional<at::Tensor>& weight,
                    int64_t reduction) {
  check_probabilities(self);
  auto loss = at::sub(target, 1) * at::clamp_min(at::log1p(at::neg(self)), -100) -
              target * at::clamp_min(at::log(self), -100);
  if (weight && weight->defined()) loss = loss * *weight;
  return reduce_loss(loss, reduction);
}

// binary_cross_entropy_backward(Tensor grad_output, Tensor self, Tensor target, Tensor? weight=None,
//                               int reduction=Mean): grad (x - t) / max(x (1 - x), 1e-12), times the weight.
at::Tensor bce_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& target,
                             const std::optional<at::Tensor>& weight, int64_t reduction) {
  auto g = reduce_grad(grad_output, self, reduction) * at::sub(self, target) /
           at::clamp_min(at::rsub(self, 1) * self, 1e-12);
  if (weight && weight->defined()) g = g * *weight;
  return g;
}

at::Tensor plain_weight(const std::optional<at::Tensor>& w, const MeshPtr& mesh) {
  if (!w || !w->defined()) return at::Tensor();
  return shard_impl(w.value()) ? shard_impl(resolve_partial(*w))->local() : *w;
}

// Layout shared by nll_loss's input (N, C, d1...) and target (N, d1...). Batch and spatial shards of the input are
// the target's too. A shard of the class dim (vocab-parallel logits; a channel-sharded field) stays: each rank holds
// the target whole along it and runs the local kernel on its own classes [c0, c0 + C_r), with the target shifted
// by c0 and every target outside its classes (and the ignored ones) mapped to a local ignore index (-1, never a
// local class), and the weight's own classes; its terms are those of the targets it owns, so the per-sample loss is
// a pending sum over that mesh dim and the reduced loss and total weight sum over it too; the backward writes each
// rank's own classes only.
struct NllLayout {
  at::Tensor self, target, weight; // locals (target shifted, weight narrowed when the class dim is sharded)
  SpecPtr self_spec, target_spec;  // target_spec: the per-sample loss's layout (Partial on the class mesh dim)
  std::vector<int64_t> mesh_dims;  // mesh dims over which the reduced loss and total weight are summed
  int64_t class_mesh_dim = -1;
  int64_t ignore = -100;           // the ignore index the local kernel takes
};

NllLayout nll_layout(const at::Tensor& self, const at::Tensor& target, const std::optional<at::Tensor>& weight,
                     int64_t ignore, const MeshPtr& mesh) {
  NllLayout l;
  auto s = resolve_partial(dispatch::as_shard(self, mesh));
  l.self_spec = shard_impl(s)->spec();
  const auto class_dim = self.dim() == 1 ? 0 : 1;
  for (size_t m = 0; m < l.self_spec->placements.size(); ++m) {
    const auto& p = l.self_spec->placements[m];
    if (p.is_shard(class_dim)) l.class_mesh_dim = static_cast<int64_t>(m);
    if (p.is_shard()) l.mesh_dims.push_back(static_cast<int64_t>(m));
  }
  l.self = shard_impl(s)->local();
  // The target's layout: the input's with the class dim removed (whole along the class mesh dim).
  Placements tp = l.self_spec->placements;
  DimExtents text;
  for (size_t m = 0; m < tp.size(); ++m) {
    if (!tp[m].is_shard()) continue;
    if (tp[m].dim == class_dim) {
      tp[m] = Placement::replicate();
      continue;
    }
    auto d = tp[m].dim > class_dim ? tp[m].dim - 1 : tp[m].dim;
    tp[m] = Placement::shard(d);
    text[d] = l.self_spec->extents[m];
  }
  l.target = local_as(dispatch::as_shard(target, mesh), mesh, tp, text);
  l.weight = plain_weight(weight, mesh);
  l.ignore = ignore;
  if (l.class_mesh_dim >= 0) {
    const auto c0 = l.self_spec->local_offset(class_dim), classes = l.self.size(class_dim);
    const auto owned = at::logical_and(at::ne(l.target, ignore),
                                       at::logical_and(l.target >= c0, l.target < c0 + classes));
    l.ignore = -1;
    l.target = at::where(owned, l.target - c0, at::full({}, l.ignore, l.target.options()));
    if (l.weight.defined()) l.weight = l.weight.narrow(0, c0, classes);
    tp[l.class_mesh_dim] = Placement::partial();
  }
  l.target_spec = ShardSpec::make_with_dim_extents(mesh, tp, target.sizes().vec(), text);
  return l;
}

// Which aten kernel runs on the local tensors: nll_loss (N, C) / (C) or nll_loss2d (N, C, H, W).
enum class NllKernel { plain, two_d };

// nll_loss_forward / nll_loss2d_forward on `mesh` (the arguments' common mesh) -> (output, total_weight)
std::tuple<at::Tensor, at::Tensor> nll_forward(NllKernel kernel, const MeshPtr& mesh, const at::Tensor& self,
                                               const at::Tensor& target, const std::optional<at::Tensor>& weight,
                                               int64_t reduction, int64_t ignore) {
  auto l = nll_layout(self, target, weight, ignore, mesh);
  const auto& w = l.weight;
  ignore = l.ignore;
  std::optional<at::Tensor> wopt = w.defined() ? std::optional<at::Tensor>(w) : std::nullopt;
  auto local_nll = [&](int64_t r) {
    return kernel == NllKernel::two_d ? at::nll_loss2d_forward(l.self, l.target, wopt, r, ignore)
                                      : at::nll_loss_forward(l.self, l.target, wopt, r, ignore);
  };
  at::Tensor out, total;
  if (reduction == kNone) {
    std::tie(out, total) = local_nll(kNone);
    return {make_shard_tensor(out, l.target_spec), make_shard_tensor(total, dispatch::replicate_spec(mesh, total.sizes()))};
  }
  // Local sum and local total weight, reduced together in one all-reduce.
  auto local_sum = std::get<0>(local_nll(kSum));
  auto valid = at::ne(l.target, ignore);
  // A rank without classes (an empty class shard) owns no target: its weight is empty and it adds nothing.
  auto tw = !w.defined()     ? valid.to(l.self.scalar_type())
            : w.numel() == 0 ? at::zeros(l.target.sizes(), w.options())
                             : at::where(valid,
                                         w.index_select(0, l.target.clamp_min(0).flatten()).view(l.target.sizes()),
                                         at::zeros({}, w.options()));
  auto both = at::stack({local_sum.to(l.self.scalar_type()), tw.sum().to(l.self.scalar_type())});
  both = sum_over_mesh_dims(both, l.mesh_dims, *mesh);
  total = both[1];
  out = reduction == kMean ? both[0] / total : both[0];
  return {make_shard_tensor(out, dispatch::replicate_spec(mesh, {})),
          make_shard_tensor(total, dispatch::replicate_spec(mesh, {}))};
}

// nll_loss_forward(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index)
std::tuple<at::Tensor, at::Tensor> nll_loss_forward_rule(const at::Tensor& self, const at::Tensor& target,
                                                         const std::optional<at::Tensor>& weight, int64_t reduction,
                                                         c10::SymInt ignore_index) {
  auto mesh = dispatch::common_mesh("aten::nll_loss_forward", {self, target, weight.value_or(at::Tensor())});
  return nll_forward(NllKernel::plain, mesh, self, target, weight, reduction, concrete_int(ignore_index));
}

// nll_loss2d_forward(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index)
std::tuple<at::Tensor, at::Tensor> nll_loss2d_forward_rule(const at::Tensor& self, const at::Tensor& target,
                                                           const std::optional<at::Tensor>& weight, int64_t reduction,
                                                           c10::SymInt ignore_index) {
  auto mesh = dispatch::common_mesh("aten::nll_loss2d_forward", {self, target, weight.value_or(at::Tensor())});
  return nll_forward(NllKernel::two_d, mesh, self, target, weight, reduction, concrete_int(ignore_index));
}

// nll_loss_backward / nll_loss2d_backward on `mesh` (the arguments' common mesh) -> grad_input
at::Tensor nll_backward(NllKernel kernel, const MeshPtr& mesh, const at::Tensor& grad_output, const at::Tensor& self,
                        const at::Tensor& target, const std::optional<at::Tensor>& weight, int64_t reduction,
                        int64_t ignore, const at::Tensor& total_weight) {
  auto l = nll_layout(self, target, weight, ignore, mesh);
  const auto& w = l.weight;
  ignore = l.ignore;
  auto target_layout = l.target_spec->placements;
  if (l.class_mesh_dim >= 0) target_layout[l.class_mesh_dim] = Placement::replicate();  // the loss's gradient
  auto grad = reduction == kNone
      ? local_in(grad_output, mesh, target_layout,
                 l.target_spec->dim_extents())
      : shard_impl(resolve_partial(dispatch::as_shard(grad_output, mesh)))->local();
  auto total = shard_impl(resolve_partial(dispatch::as_shard(total_weight, mesh)))->local();
  std::optional<at::Tensor> wopt = w.defined() ? std::optional<at::Tensor>(w) : std::nullopt;
  // aten's nll_loss2d backward refuses a channels-last-strided input of one sample ("grad_input must be
  // contiguous"), which a rank's block can be (one sample of a split batch) where the whole input is not.
  if (kernel == NllKernel::two_d && !l.self.is_contiguous()) l.self = l.self.contiguous();
  auto gi = kernel == NllKernel::two_d ? at::nll_loss2d_backward(grad, l.self, l.target, wopt, reduction, ignore, total)
                                       : at::nll_loss_backward(grad, l.self, l.target, wopt, reduction, ignore, total);
  return make_shard_tensor(gi, l.self_spec);
}

// nll_loss_backward(Tensor grad_output, Tensor self, Tensor target, Tensor? weight, int reduction,
//                   SymInt ignore_index, Tensor total_weight)
at::Tensor nll_loss_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& target,
                                  const std::optional<at::Tensor>& weight, int64_t reduction, c10::SymInt ignore_index,
                                  const at::Tensor& total_weight) {
  auto mesh = dispatch::common_mesh("aten::nll_loss_backward",
                                    {grad_output, self, target, weight.value_or(at::Tensor()), total_weight});
  return nll_backward(NllKernel::plain, mesh, grad_output, self, target, weight, reduction, concrete_int(ignore_index),
                      total_weight);
}

// nll_loss2d_backward(Tensor grad_output, Tensor self, Tensor target, Tensor? weight, int reduction,
//                     SymInt ignore_index, Tensor total_weight)
at::Tensor nll_loss2d_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& target,
                                    const std::optional<at::Tensor>& weight, int64_t reduction,
                                    c10::SymInt ignore_index, const at::Tensor& total_weight) {
  auto mesh = dispatch::common_mesh("aten::nll_loss2d_backward",
                                    {grad_output, self, target, weight.value_or(at::Tensor()), total_weight});
  return nll_backward(NllKernel::two_d, mesh, grad_output, self, target, weight, reduction, concrete_int(ignore_index),
                      total_weight);
}

// A scan along a sharded dim (cumsum, cumprod, logcumsumexp): the local scan, then every row combined with the totals of the
// lower coordinates along the mesh dim (their last rows, gathered in one collective) by `combine(local, prefix)`;
// `empty_total` is the total of a rank without rows (the scan's identity), `fold(all, count)` reduces the first
// `count` gathered totals.
template <typename Scan, typename Fold, typename Combine>
at::Tensor sharded_scan(const at::Tensor& self_arg, int64_t dim_arg, double empty_total, Scan scan, Fold fold,
                        Combine combine) {
  auto self = resolve_partial(self_arg);
  const auto dim = wrap_dim(dim_arg, std::max<int64_t>(self.dim(), 1));
  auto spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  auto out = scan(x, dim);
  const auto m = spec->mesh_dim_of(dim);
  if (m >= 0) {
    auto total = x.size(dim) > 0 ? out.narrow(dim, x.size(dim) - 1, 1)
                                 : at::full(out.narrow(dim, 0, 0).sum(dim, true).sizes(), empty_total, out.options());
    comm::StatReduce r;
    const auto i = r.gathered(total);
    r.run(*spec->mesh, {m});
    const auto me = spec->mesh->coordinate(m);
    if (me > 0) out = combine(out, fold(r.result(i)[0].narrow(0, 0, me)));
  }
  return make_shard_tensor(out, spec);
}

// cumsum(Tensor self, int dim, *, ScalarType? dtype=None)
at::Tensor cumsum_rule(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  return sharded_scan(
      self, dim, 0.0, [&](const at::Tensor& x, int64_t d) { return at::cumsum(x, d, dtype); },
      [](const at::Tensor& lower) { return at::sum(lower, 0); },
      [](const at::Tensor& out, const at::Tensor& prefix) { return out + prefix; });
}

// cumprod(Tensor self, int dim, *, ScalarType? dtype=None)
at::Tensor cumprod_rule(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  return sharded_scan(
      self, dim, 1.0, [&](const at::Tensor& x, int64_t d) { return at::cumprod(x, d, dtype); },
      [](const at::Tensor& lower) { return at::prod(lower, 0); },
      [](const at::Tensor& out, const at::Tensor& prefix) { return out * prefix; });
}

// cumprod's gradient from ops with rules. aten's formula, for an input with zeros, writes into a plain zeros tensor
// of the global size (its fast path for plain tensors), which a ShardTensor's gradient cannot be. The same
// quantity: with z1 the first zero of a slice, positions before it get Σ_{j≥k} g_j conj(out_j) / conj(x_k); z1
// itself gets Σ_{j≥z1} g_j conj(Π_{i≤j, i≠z1} x_i), the reversed cumulative sum of g times the cumulative product of
// x with its first zero replaced by 1; positions after it get 0 (every product includes x_z1).
at::Tensor cumprod_grad(const at::Tensor& g, const at::Tensor& x, const at::Tensor& out, int64_t dim) {
  if (x.numel() <= 1 || x.size(dim) == 1) return g;
  auto reversed_cumsum = [&](const at::Tensor& t) { return at::flip(at::cumsum(at::flip(t, {dim}), dim), {dim}); };
  const auto is_zero = at::eq(x, 0);
  const auto zeros_so_far = at::cumsum(is_zero, dim);
  const auto before = at::eq(zeros_so_far, 0);
  const auto first = at::logical_and(is_zero, at::eq(zeros_so_far, 1));
  const auto w = at::where(before, out.conj() * g, 0);
  const auto grad_before = reversed_cumsum(w) / at::where(before, x, 1).conj();
  const auto grad_first = reversed_cumsum(g * at::cumprod(at::where(first, 1, x), dim).conj());
  return at::where(before, grad_before, at::where(first, grad_first, 0));
}

struct CumprodFn : torch::autograd::Function<CumprodFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& self, int64_t dim,
                            std::optional<at::ScalarType> dtype) {
    auto out = at::cumprod(self, dim, dtype);
    ctx->save_for_backward({self, out});
    ctx->saved_data["dim"] = dim;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    return {cumprod_grad(grads[0].to(x.scalar_type()), x, saved[1], ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

// With grad: CumprodFn (the formula above), for every ShardTensor input.
bool cumprod_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!shard_impl(self) || !self.requires_grad()) return false;
  const auto dim = wrap_dim(args["dim"].toInt(), std::max<int64_t>(self.dim(), 1));
  auto out = CumprodFn::apply(self, dim, args.dtype());
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

// log(exp(a) + exp(b)) about the operand with the larger real part, as the single-device scan steps: torch's
// complex logaddexp exponentiates directly (NaN at a real-part gap of ~90 in complex64, where the scan is finite).
at::Tensor scan_log_add_exp(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_complex()) return at::logaddexp(a, b);
  const auto a_leads = at::real(a) >= at::real(b);
  const auto hi = at::where(a_leads, a, b), lo = at::where(a_leads, b, a);
  // A -inf term (a rank without rows, an empty prefix) adds nothing; -inf - -inf would be NaN.
  const auto nothing = at::logical_and(at::isinf(at::real(lo)), at::real(lo) < 0);
  // log(1 + z), not log1p: torch's complex log1p returns NaN for a subnormal z (a gap of ~90 in complex64); the
  // absolute error of log(1 + z) is below the rounding of `hi` itself.
  return at::where(nothing, hi, hi + at::log(at::exp(lo - hi) + 1));
}

// logcumsumexp(Tensor self, int dim)
at::Tensor logcumsumexp_rule(const at::Tensor& self, int64_t dim) {
  return sharded_scan(
      self, dim, -std::numeric_limits<double>::infinity(),
      [](const at::Tensor& x, int64_t d) { return at::logcumsumexp(x, d); },
      // The lower totals folded one by one with logaddexp, as the single-device scan runs: for complex inputs each
      // step keeps the dominant term's imaginary part (logsumexp's log of a sum would fold it into (-pi, pi]).
      [](const at::Tensor& lower) {
        auto acc = lower.select(0, 0);
        for (int64_t j = 1; j < lower.size(0); ++j) acc = scan_log_add_exp(acc, lower.select(0, j));
        return acc;
      },
      [](const at::Tensor& out, const at::Tensor& prefix) { return scan_log_add_exp(out, prefix); });
}

// flip(Tensor self, int[] dims): along a sharded dim, rank c's flipped data belongs to coordinate n-1-c.
at::Tensor flip_rule(const at::Tensor& self_arg, at::IntArrayRef dims_arg) {
  auto self = resolve_partial(self_arg);
  std::vector<int64_t> dims;
  for (auto d : dims_arg) dims.push_back(wrap_dim(d, std::max<int64_t>(self.dim(), 1)));
  auto spec = shard_impl(self)->spec();
  auto out = at::flip(shard_impl(self)->local(), dims);
  auto placements = spec->placements;
  auto ext = spec->dim_extents();
  for (auto d : dims) {
    const auto m = spec->mesh_dim_of(d);
    if (m < 0) continue;
    // The partner along m holds the same extents as this rank on every other dim (flips along other mesh dims
    // have already swapped those alike), and its own extent along d.
    auto partner_shape = out.sizes().vec();
    partner_shape[d] = ext[d][spec->mesh->size(m) - 1 - spec->mesh->coordinate(m)];
    out = comm::mirror_ranks(out, partner_shape, *spec->mesh, m);
    std::reverse(ext[d].begin(), ext[d].end());
  }
  return wrap(out, spec->mesh, placements, spec->global_shape, ext);
}

// multi_margin_loss(Tensor self, Tensor target, Scalar p=1, Scalar margin=1, Tensor? weight=None,
//                   int reduction=Mean): per sample (1/C) sum over j != y of w[y] max(0, margin - x[y] + x[j])^p,
// composed above autograd from sharded ops (a split batch stays local; a split class dim reduces through the sums'
// pending sums), so the composition's autograd is the gradient: relu's, like torch's kernel, counts a term only
// where it is > 0. The weight gets no gradient (torch defines none).
at::Tensor multi_margin_loss_rule(const at::Tensor& self, const at::Tensor& target, const at::Scalar& p,
                                  const at::Scalar& margin, const std::optional<at::Tensor>& weight, int64_t reduction) {
  const auto pv = p.toDouble();
  TORCH_CHECK_VALUE(pv == 1.0 || pv == 2.0, "multi_margin_loss: only p == 1 and p == 2 are supported, got ", pv);
  TORCH_CHECK_VALUE(self.dim() == 1 || self.dim() == 2, "multi_margin_loss: expected a 1-D or 2-D input, got ",
                    self.dim(), "-D");
  const bool batched = self.dim() == 2;
  auto x = batched ? self : self.unsqueeze(0);  // [N, C]
  const auto C = x.size(1);
  auto y = target.reshape({x.size(0), 1});
  auto z = at::relu(at::add(at::sub(x, at::gather(x, 1, y)), margin));
  if (pv == 2.0) z = z * z;
  // Only the classes other than the sample's own.
  z = z * at::ne(at::arange(C, y.options()), y).to(z.scalar_type());
  if (weight && weight->defined()) z = z * at::index_select(weight->detach(), 0, y.reshape({-1})).unsqueeze(1);
  auto l = at::sum(z, {1}) / static_cast<double>(C);
  if (!batched) l = l.reshape(target.sizes());
  return reduce_loss(l, reduction);
}

// multilabel_margin_loss(Tensor self, Tensor target, int reduction=Mean): a sample's targets are its target row
// up to the first -1; per sample (1/C) sum over its targets j and its non-target classes k of
// max(0, 1 - (x[y_j] - x[k])), composed above autograd from sharded ops as multi_margin_loss is (every target entry
// against every class: N * C * C terms, the single-device kernel's loop).
at::Tensor multilabel_margin_loss_rule(const at::Tensor& self, const at::Tensor& target, int64_t reduction) {
  TORCH_CHECK_VALUE(self.dim() == 1 || self.dim() == 2, "multilabel_margin_loss: expected a 1-D or 2-D input, got ",
                    self.dim(), "-D");
  TORCH_CHECK_VALUE(target.sizes().equals(self.sizes()), "multilabel_margin_loss: inconsistent target size ",
                    target.sizes(), " for input of size ", self.sizes());
  const bool batched = self.dim() == 2;
  auto x = batched ? self : self.unsqueeze(0);  // [N, C]
  auto y = batched ? target : target.unsqueeze(0);
  const auto C = x.size(1);
  auto dtype = x.scalar_type();
  // The valid targets: the entries before the row's first -1.
  auto valid = at::cumprod(at::ge(y, 0).to(at::kLong), 1);
  auto yc = at::clamp_min(y, 0);
  // A class is a target when some valid entry names it.
  auto named = at::eq(yc.unsqueeze(2), at::arange(C, y.options())) .logical_and(valid.unsqueeze(2).to(at::kBool));
  auto is_target = at::any(named, 1);  // [N, C]
  auto xy = at::gather(x, 1, yc);       // [N, T]
  auto terms = at::relu(at::add(at::sub(x.unsqueeze(1), xy.unsqueeze(2)), 1.0));  // [N, T, C]
  terms = terms * valid.unsqueeze(2).to(dtype) * at::logical_not(is_target).unsqueeze(1).to(dtype);
  auto l = at::sum(terms, {1, 2}) / static_cast<double>(C);
  if (!batched) l = l.squeeze(0);
  return reduce_loss(l, reduction);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(loss) {
  using dispatch::set_handler;
  set_handler("aten::mse_loss", typed_handler(&mse_loss_rule));
  const auto above = dispatch::RuleLevel::above_autograd;
  set_handler("aten::multi_margin_loss", typed_handler(&multi_margin_loss_rule), above);
  set_handler("aten::multilabel_margin_loss", typed_handler(&multilabel_margin_loss_rule), above);
  set_handler("aten::mse_loss_backward", typed_handler(&mse_loss_backward_rule));
  set_handler("aten::smooth_l1_loss", typed_handler(&smooth_l1_loss_rule));
  set_handler("aten::smooth_l1_loss_backward", typed_handler(&smooth_l1_loss_backward_rule));
  set_handler("aten::soft_margin_loss", typed_handler(&soft_margin_loss_rule));
  set_handler("aten::soft_margin_loss_backward", typed_handler(&soft_margin_loss_backward_rule));
  set_handler("aten::huber_loss", typed_handler(&huber_loss_rule));
  set_handler("aten::huber_loss_backward", typed_handler(&huber_loss_backward_rule));
  set_handler("aten::binary_cross_entropy_with_logits", typed_handler(&bce_with_logits_rule));
  set_handler("aten::binary_cross_entropy", typed_handler(&bce_rule));
  set_handler("aten::binary_cross_entropy_backward", typed_handler(&bce_backward_rule));
  set_handler("aten::nll_loss_forward", typed_handler(&nll_loss_forward_rule));
  set_handler("aten::nll_loss2d_forward", typed_handler(&nll_loss2d_forward_rule));
  set_handler("aten::nll_loss_backward", typed_handler(&nll_loss_backward_rule));
  set_handler("aten::nll_loss2d_backward", typed_handler(&nll_loss2d_backward_rule));
  set_handler("aten::cumsum", typed_handler(&cumsum_rule));
  set_handler("aten::cumprod", typed_handler(&cumprod_rule));
  dispatch::set_autograd_handler("aten::cumprod", cumprod_autograd);
  set_handler("aten::logcumsumexp", typed_handler(&logcumsumexp_rule));
  set_handler("aten::flip", typed_handler(&flip_rule));
}

} // namespace shardtensor::ops
