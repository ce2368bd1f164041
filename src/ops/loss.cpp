// Losses and scans over sharded dims. Pointwise losses (mse, smooth_l1, huber) are composed from sharded ops,
// so `mean`/`sum` reductions give Partial sums. nll_loss (and cross_entropy through it) over sharded batch or
// spatial dims: per-rank sums of the picked log-probabilities and of the class weights, all-reduced together.
// logsumexp: global max, then global sum. cumsum: local scan plus the totals of lower ranks. flip along a
// sharded dim mirrors the ranks.
#include "comm/collectives.h"
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

using dispatch::op_args;

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

void mse_loss_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto d = at::sub(args[0].toTensor(), args[1].toTensor());
  auto out = reduce_loss(d * d, args[2].toInt());
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
}

// mse_loss_backward(grad, self, target, reduction)
void mse_loss_backward_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto self = args[1].toTensor();
  auto d = at::sub(self, args[2].toTensor());
  auto out = reduce_grad(args[0].toTensor(), self, args[3].toInt()) * d * 2.0;
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
}

// smooth_l1_loss(self, target, reduction, beta) / huber_loss(self, target, reduction, delta)
void smooth_l1_handler(bool huber, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  const double beta = args[3].toDouble();
  auto d = at::sub(args[0].toTensor(), args[1].toTensor());
  auto a = at::abs(d);
  at::Tensor l;
  if (huber) {
    l = at::where(at::lt(a, beta), d * d * 0.5, (a - 0.5 * beta) * beta);
  } else if (beta == 0) {
    l = a;
  } else {
    l = at::where(at::lt(a, beta), d * d * (0.5 / beta), a - 0.5 * beta);
  }
  auto out = reduce_loss(l, args[2].toInt());
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
}

// smooth_l1_loss_backward(grad, self, target, reduction, beta) / huber_loss_backward(..., delta)
void smooth_l1_backward_handler(bool huber, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto self = args[1].toTensor();
  const double beta = args[4].toDouble();
  auto d = at::sub(self, args[2].toTensor());
  auto a = at::abs(d);
  at::Tensor local_grad;
  if (huber) {
    local_grad = at::where(at::lt(a, beta), d, at::sign(d) * beta);
  } else if (beta == 0) {
    local_grad = at::sign(d);
  } else {
    local_grad = at::where(at::lt(a, beta), d / beta, at::sign(d));
  }
  auto out = reduce_grad(args[0].toTensor(), self, args[3].toInt()) * local_grad;
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
}

// Layout shared by nll_loss's input (N, C, d1...) and target (N, d1...): the class dim must be whole.
struct NllLayout {
  at::Tensor self, target; // locals
  SpecPtr self_spec, target_spec;
  std::vector<int64_t> mesh_dims; // mesh dims sharding the batch/spatial dims
};

NllLayout nll_layout(const c10::OperatorHandle& op, const torch::jit::Stack* stack, const at::Tensor& self,
                     const at::Tensor& target, const MeshPtr& mesh) {
  NllLayout l;
  auto s = resolve_partial(dispatch::as_shard(self, mesh));
  l.self_spec = shard_impl(s)->spec();
  const auto class_dim = self.dim() == 1 ? 0 : 1;
  for (size_t m = 0; m < l.self_spec->placements.size(); ++m) {
    const auto& p = l.self_spec->placements[m];
    if (p.is_shard(class_dim)) dispatch::not_implemented(op, stack, "nll_loss with the class dim sharded");
    if (p.is_shard()) l.mesh_dims.push_back(static_cast<int64_t>(m));
  }
  l.self = shard_impl(s)->local();
  // The target's layout: the input's with the class dim removed.
  Placements tp = l.self_spec->placements;
  DimExtents text;
  for (size_t m = 0; m < tp.size(); ++m)
    if (tp[m].is_shard()) {
      auto d = tp[m].dim > class_dim ? tp[m].dim - 1 : tp[m].dim;
      tp[m] = Placement::shard(d);
      text[d] = l.self_spec->extents[m];
    }
  l.target = local_as(dispatch::as_shard(target, mesh), mesh, tp, text);
  l.target_spec = ShardSpec::make_with_dim_extents(mesh, tp, target.sizes().vec(), text);
  return l;
}

at::Tensor plain_weight(const std::optional<at::Tensor>& w, const MeshPtr& mesh) {
  if (!w || !w->defined()) return at::Tensor();
  return shard_impl(w.value()) ? shard_impl(resolve_partial(*w))->local() : *w;
}

// nll_loss_forward / nll_loss2d_forward(self, target, weight?, reduction, ignore_index) -> (output, total_weight)
void nll_forward_handler(bool two_d, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto mesh = dispatch::common_mesh(op, stack);
  auto self = args[0].toTensor();
  auto l = nll_layout(op, stack, self, args[1].toTensor(), mesh);
  auto w = plain_weight(args[2].toOptional<at::Tensor>(), mesh);
  const auto reduction = args[3].toInt();
  const auto ignore = args[4].toInt();
  std::optional<at::Tensor> wopt = w.defined() ? std::optional<at::Tensor>(w) : std::nullopt;
  at::Tensor out, total;
  if (reduction == kNone) {
    std::tie(out, total) = two_d ? at::nll_loss2d_forward(l.self, l.target, wopt, kNone, ignore)
                                 : at::nll_loss_forward(l.self, l.target, wopt, kNone, ignore);
    torch::jit::drop(*stack, args.size());
    torch::jit::push(*stack, make_shard_tensor(out, l.target_spec));
    torch::jit::push(*stack, make_shard_tensor(total, dispatch::replicate_spec(mesh, total.sizes())));
    return;
  }
  // Local sum and local total weight, reduced together in one all-reduce.
  at::Tensor local_sum, unused;
  std::tie(local_sum, unused) = two_d ? at::nll_loss2d_forward(l.self, l.target, wopt, kSum, ignore)
                                      : at::nll_loss_forward(l.self, l.target, wopt, kSum, ignore);
  auto valid = at::ne(l.target, ignore);
  auto tw = w.defined() ? at::where(valid, w.index_select(0, l.target.clamp_min(0).flatten()).view(l.target.sizes()),
                                    at::zeros({}, w.options()))
                        : valid.to(l.self.scalar_type());
  auto both = at::stack({local_sum.to(l.self.scalar_type()), tw.sum().to(l.self.scalar_type())});
  for (auto m : l.mesh_dims) both = comm::all_reduce(both, ReduceOp::Sum, *mesh, m);
  total = both[1];
  out = reduction == kMean ? both[0] / total : both[0];
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, make_shard_tensor(out, dispatch::replicate_spec(mesh, {})));
  torch::jit::push(*stack, make_shard_tensor(total, dispatch::replicate_spec(mesh, {})));
}

// nll_loss_backward / nll_loss2d_backward(grad, self, target, weight?, reduction, ignore_index, total_weight)
void nll_backward_handler(bool two_d, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto mesh = dispatch::common_mesh(op, stack);
  auto self = args[1].toTensor();
  auto l = nll_layout(op, stack, self, args[2].toTensor(), mesh);
  auto w = plain_weight(args[3].toOptional<at::Tensor>(), mesh);
  const auto reduction = args[4].toInt();
  const auto ignore = args[5].toInt();
  auto grad = reduction == kNone
      ? local_as(resolve_partial(dispatch::as_shard(args[0].toTensor(), mesh)), mesh, l.target_spec->placements,
                 l.target_spec->dim_extents())
      : shard_impl(resolve_partial(dispatch::as_shard(args[0].toTensor(), mesh)))->local();
  auto total = shard_impl(resolve_partial(dispatch::as_shard(args[6].toTensor(), mesh)))->local();
  std::optional<at::Tensor> wopt = w.defined() ? std::optional<at::Tensor>(w) : std::nullopt;
  auto gi = two_d ? at::nll_loss2d_backward(grad, l.self, l.target, wopt, reduction, ignore, total)
                  : at::nll_loss_backward(grad, l.self, l.target, wopt, reduction, ignore, total);
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, make_shard_tensor(gi, l.self_spec));
}

// logsumexp(self, dim[], keepdim)
void logsumexp_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto self = resolve_partial(args[0].toTensor());
  const auto keepdim = args[2].toBool();
  std::vector<int64_t> dims;
  for (auto d : args[1].toDimVector()) dims.push_back(wrap_dim(d, std::max<int64_t>(self.dim(), 1)));
  if (dims.empty())
    for (int64_t d = 0; d < self.dim(); ++d) dims.push_back(d);
  auto mx = at::amax(self, dims, true);                // Partial(max) over sharded reduced dims
  auto mxr = resolve_partial(mx);
  auto safe = at::where(at::isinf(mxr), at::zeros_like(mxr), mxr);
  auto s = at::sum(at::exp(self - safe), dims, true);  // Partial(sum)
  auto out = at::log(resolve_partial(s)) + safe;
  if (!keepdim) {
    std::vector<int64_t> sq(dims.begin(), dims.end());
    std::sort(sq.rbegin(), sq.rend());
    for (auto d : sq) out = at::squeeze(out, d);
  }
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
}

// cumsum(self, dim, dtype?)
void cumsum_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto self = resolve_partial(args[0].toTensor());
  const auto dim = wrap_dim(args[1].toInt(), std::max<int64_t>(self.dim(), 1));
  std::optional<at::ScalarType> dtype;
  if (!args[2].isNone()) dtype = static_cast<at::ScalarType>(args[2].toInt());
  auto spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  auto out = at::cumsum(x, dim, dtype);
  const auto m = spec->mesh_dim_of(dim);
  if (m >= 0) {
    // Add the totals of every lower coordinate along the mesh dim.
    auto total = x.size(dim) > 0 ? out.narrow(dim, x.size(dim) - 1, 1) : at::zeros_like(out.narrow(dim, 0, 0)).sum(dim, true);
    const auto n = spec->mesh->size(m);
    auto all = comm::all_gather_v(total.unsqueeze(0), 0, std::vector<int64_t>(n, 1), *spec->mesh, m);
    const auto me = spec->mesh->coordinate(m);
    if (me > 0) out = out + all.narrow(0, 0, me).sum(0);
  }
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, make_shard_tensor(out, spec));
}

// flip(self, dims): along a sharded dim, rank c's flipped data belongs to coordinate n-1-c.
void flip_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto self = resolve_partial(args[0].toTensor());
  std::vector<int64_t> dims;
  for (auto d : args[1].toDimVector()) dims.push_back(wrap_dim(d, std::max<int64_t>(self.dim(), 1)));
  auto spec = shard_impl(self)->spec();
  auto out = at::flip(shard_impl(self)->local(), dims);
  auto placements = spec->placements;
  auto ext = spec->dim_extents();
  for (auto d : dims) {
    const auto m = spec->mesh_dim_of(d);
    if (m < 0) continue;
    out = comm::mirror_ranks(out, *spec->mesh, m);
    std::reverse(ext[d].begin(), ext[d].end());
  }
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, wrap(out, spec->mesh, placements, spec->global_shape, ext));
}

} // namespace

void register_loss() {
  using dispatch::set_handler;
  set_handler("aten::mse_loss", mse_loss_handler);
  set_handler("aten::mse_loss_backward", mse_loss_backward_handler);
  set_handler("aten::smooth_l1_loss", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { smooth_l1_handler(false, op, s); });
  set_handler("aten::smooth_l1_loss_backward", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { smooth_l1_backward_handler(false, op, s); });
  set_handler("aten::huber_loss", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { smooth_l1_handler(true, op, s); });
  set_handler("aten::huber_loss_backward", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { smooth_l1_backward_handler(true, op, s); });
  set_handler("aten::nll_loss_forward", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { nll_forward_handler(false, op, s); });
  set_handler("aten::nll_loss2d_forward", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { nll_forward_handler(true, op, s); });
  set_handler("aten::nll_loss_backward", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { nll_backward_handler(false, op, s); });
  set_handler("aten::nll_loss2d_backward", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { nll_backward_handler(true, op, s); });
  set_handler("aten::logsumexp", logsumexp_handler);
  set_handler("aten::cumsum", cumsum_handler);
  set_handler("aten::flip", flip_handler);
}

} // namespace shardtensor::ops
