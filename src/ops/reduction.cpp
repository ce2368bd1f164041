// Reductions. Over unsharded dims they are local. Over a sharded dim: sum/mean give Partial(sum), amax/amin
// give Partial(max/min); max/min/argmax/argmin with indices, prod, all/any, norms and var/std combine small
// per-rank results (var/std with Chan's parallel formula, never E[x^2]-E[x]^2) into a Replicate result.
#include "comm/collectives.h"
#include "comm/stat_reduce.h"
#include "ops/arg_checks.h"
#include "ops/concrete_ints.h"
#include "ops/common.h"
#include "comm/dtype_limits.h"
#include "ops/moments.h"

#include <ATen/AccumulateType.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace shardtensor::ops {

namespace {

// Reduced dims (sorted, wrapped) from an `int[]? dim` argument; empty list / None = all dims.
std::vector<int64_t> reduced_dims(at::OptionalIntArrayRef given, int64_t ndim) {
  std::vector<int64_t> dims;
  if (given)
    for (auto d : *given) dims.push_back(wrap_dim(d, std::max<int64_t>(ndim, 1)));
  if (dims.empty())
    for (int64_t d = 0; d < ndim; ++d) dims.push_back(d);
  std::sort(dims.begin(), dims.end());
  // A dim named twice is an error on one device (sum, amax, var, norm, ...): refused alike on every rank.
  const auto twice = std::adjacent_find(dims.begin(), dims.end());
  TORCH_CHECK_VALUE(twice == dims.end(), "dim ", twice == dims.end() ? 0 : *twice,
                    " appears multiple times in the list of dims");
  return dims;
}

// The same from an argument that may be absent, None, an `int dim` or an `int[]? dim` (rules shared by overloads).
std::vector<int64_t> reduced_dims(const c10::IValue* v, int64_t ndim) {
  if (!v || v->isNone()) return reduced_dims(at::OptionalIntArrayRef(), ndim);
  if (v->isInt()) return reduced_dims(at::IntArrayRef(v->toInt()), ndim);
  auto list = v->toDimVector();
  return reduced_dims(at::IntArrayRef(list), ndim);
}

bool contains(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// Output layout of a reduction: sharded kept dims move to their new index; reduced sharded mesh dims are
// reported in `reduced_mesh_dims`.
struct ReduceLayout {
  Placements placements;
  DimExtents ext;
  std::vector<int64_t> out_shape;
  std::vector<int64_t> reduced_mesh_dims;
};

ReduceLayout reduce_layout(const ShardSpec& spec, const std::vector<int64_t>& dims, bool keepdim) {
  ReduceLayout l;
  const auto ndim = spec.ndim();
  for (int64_t d = 0; d < ndim; ++d) {
    if (!contains(dims, d)) {
      l.out_shape.push_back(spec.global_shape[d]);
    } else if (keepdim) {
      l.out_shape.push_back(1);
    }
  }
  l.placements = spec.placements;
  for (size_t m = 0; m < l.placements.size(); ++m) {
    auto& p = l.placements[m];
    if (!p.is_shard()) continue;
    if (contains(dims, p.dim)) {
      l.reduced_mesh_dims.push_back(static_cast<int64_t>(m));
      p = Placement::replicate();
      continue;
    }
    auto nd = keepdim ? p.dim : p.dim - static_cast<int64_t>(std::count_if(dims.begin(), dims.end(),
                                                                            [&](int64_t k) { return k < p.dim; }));
    l.ext[nd] = spec.extents[m];
    p = Placement::shard(nd);
  }
  return l;
}

// Local output shape of a reduction of `local` over `dims`.
std::vector<int64_t> local_reduced_shape(const at::Tensor& local, const std::vector<int64_t>& dims, bool keepdim) {
  std::vector<int64_t> s;
  for (int64_t d = 0; d < local.dim(); ++d) {
    if (!contains(dims, d)) {
      s.push_back(local.size(d));
    } else if (keepdim) {
      s.push_back(1);
    }
  }
  return s;
}

bool empty_reduction(const at::Tensor& local, const std::vector<int64_t>& dims) {
  for (auto d : dims)
    if (d < local.dim() && local.size(d) == 0) return true;
  return false;
}

at::Scalar lowest(at::ScalarType t) {
  return comm::dtype_limit(t, /*low=*/true);
}
at::Scalar highest(at::ScalarType t) {
  return comm::dtype_limit(t, /*low=*/false);
}

enum class Kind { Sum, Mean, Amax, Amin, All, Any, Prod, Norm, NanSum, CountNonzero };

// A reduction of an empty global tensor raises exactly as on one device: `run_on` runs the op on an empty tensor of
// the global shape (no memory). The decision reads global shapes only, so every rank raises alike; when one device
// would not raise (e.g. amax over a non-empty dim of an empty tensor) the rule goes on.
template <typename RunOn>
void raise_like_torch_if_empty(const at::Tensor& self, RunOn run_on) {
  if (self.numel() != 0) return;
  run_on(at::empty(self.sizes(), dispatch::local_or_self(self).options()));
}

// sum, mean, amax, amin, all, any, prod, linalg_vector_norm, nansum, count_nonzero: eighteen overloads whose arguments differ in position
// (sum(self, dtype?) vs sum.dim_IntList(self, dim, keepdim, dtype?); all.dim's dim is an int): one boxed rule reads
// them by name, and the empty-input probe re-calls the op itself.
void decomposable_handler(Kind kind, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  auto self = args.tensor("self");
  raise_like_torch_if_empty(self, [&](const at::Tensor& empty) {
    torch::jit::Stack probe(args.all().begin(), args.all().end());
    dispatch::NamedArgs(op, &probe).set("self", empty);
    op.callBoxed(probe);
  });
  auto* impl = shard_impl(self);
  const auto name = op.schema().name();
  const auto ndim = self.dim();
  const bool keepdim = args.get_or<bool>("keepdim", false);
  const auto dtype = args.dtype();
  const auto ord = args.get_or<at::Scalar>("ord", 2);
  auto dims = reduced_dims(args.has("dim") ? &args["dim"] : nullptr, ndim);

  // Sum and mean are linear: a Partial(sum/avg) input stays pending. Everything else needs complete values.
  auto t = self;
  const bool linear = kind == Kind::Sum || kind == Kind::Mean;
  // A pending max/min (amax over a sharded dim, then sum) is not linear: it is completed first.
  bool nonlinear_partial = false;
  for (const auto& p : impl->spec()->placements)
    nonlinear_partial = nonlinear_partial || (p.is_partial() && p.op != ReduceOp::Sum && p.op != ReduceOp::Avg);
  if (!linear || nonlinear_partial) t = resolve_partial(t);
  impl = shard_impl(t);
  const auto& spec = *impl->spec();
  auto layout = reduce_layout(spec, dims, keepdim);
  const auto& local = impl->local();
  const auto& mesh = spec.mesh;
  at::Tensor out;
  bool norm_in_float = false;
  auto local_shape = local_reduced_shape(local, dims, keepdim);
  switch (kind) {
    case Kind::Sum:
      out = at::sum(local, dims, keepdim, dtype);
      break;
    case Kind::Mean: {
      // torch's mean refuses integral results (its meta function); the sum below would not, so check as it does.
      const auto result_type = dtype.value_or(self.scalar_type());
      TORCH_CHECK(at::isFloatingType(result_type) || at::isComplexType(result_type),
                  "mean(): could not infer output dtype. ", dtype ? "Optional" : "Input",
                  " dtype must be either a floating point or complex dtype. Got: ", c10::toString(result_type));
      int64_t count = 1;
      for (auto d : dims) count *= self.size(d);
      // Half and bfloat16 accumulate in float and are divided before the cast back, as torch's mean does: a rank's
      // partial sum in the reduced type overflows (65504 for half) where the mean does not.
      if (result_type == at::kHalf || result_type == at::kBFloat16) {
        out = at::sum(local, dims, keepdim, at::kFloat).div_(count).to(result_type);
      } else {
        out = at::sum(local, dims, keepdim, dtype).div(count);
      }
      break;
    }
    case Kind::Amax:
    case Kind::Amin:
      if (empty_reduction(local, dims)) {
        out = at::full(local_shape, kind == Kind::Amax ? lowest(local.scalar_type()) : highest(local.scalar_type()),
                       local.options());
      } else {
        out = kind == Kind::Amax ? at::amax(local, dims, keepdim) : at::amin(local, dims, keepdim);
      }
      break;
    case Kind::NanSum: out = at::nansum(local, dims, keepdim, dtype); break;
    case Kind::CountNonzero: out = at::count_nonzero(local, dims); break;
    case Kind::All: out = at::all(local, dims, keepdim); break;
    case Kind::Any: out = at::any(local, dims, keepdim); break;
    case Kind::Prod: {
      out = local;
      if (dtype) out = out.to(*dtype);
      // prod over several dims: one at a time, innermost first.
      for (auto it = dims.rbegin(); it != dims.rend(); ++it) out = at::prod(out, *it, true);
      if (!keepdim) out = out.reshape(local_shape);
      break;
    }
    case Kind::Norm: {
      // Half and bfloat16 accumulate in float (cast back at the end, below), as torch's norm does: the sum of
      // squares overflows the reduced type long before the norm does.
      const auto norm_type = dtype.value_or(local.scalar_type());
      norm_in_float = norm_type == at::kHalf || norm_type == at::kBFloat16;
      auto x = norm_in_float ? local.to(at::kFloat) : dtype ? local.to(*dtype) : local;
      const auto p = ord.toDouble();
      if (std::isinf(p)) {
        auto a = x.abs();
        out = empty_reduction(x, dims) ? at::zeros(local_shape, a.options())
                                       : (p > 0 ? at::amax(a, dims, keepdim) : at::amin(a, dims, keepdim));
        if (p < 0 && empty_reduction(x, dims)) out.fill_(std::numeric_limits<double>::infinity());
      } else if (p == 0) {
        out = at::sum(x.ne(0).to(c10::toRealValueType(x.scalar_type())), dims, keepdim);  // a count: real
      } else {
        out = at::sum(x.abs().pow(p), dims, keepdim);
      }
      break;
    }
  }
  auto placements = layout.placements;
  bool need_resolve = false;
  for (auto m : layout.reduced_mesh_dims) {
    switch (kind) {
      case Kind::Sum:
      case Kind::Mean:
      case Kind::NanSum:
      case Kind::CountNonzero: placements[m] = Placement::partial(ReduceOp::Sum); break;
      case Kind::Amax: placements[m] = Placement::partial(ReduceOp::Max); break;
      case Kind::Amin: placements[m] = Placement::partial(ReduceOp::Min); break;
      case Kind::All: placements[m] = Placement::partial(ReduceOp::Min); need_resolve = true; break;
      case Kind::Any: placements[m] = Placement::partial(ReduceOp::Max); need_resolve = true; break;
      case Kind::Norm: {
        const auto p = ord.toDouble();
        placements[m] = std::isinf(p) ? Placement::partial(p > 0 ? ReduceOp::Max : ReduceOp::Min)
                                      : Placement::partial(ReduceOp::Sum);
        need_resolve = true;
        break;
      }
      case Kind::Prod: {
        // No Partial(prod): gather the per-rank products and multiply them.
        comm::StatReduce r;
        const auto i = r.gathered(out);
        r.run(*mesh, {m});
        out = at::prod(r.result(i)[0], 0);
        break;
      }
    }
  }
  // Keep a pending sum when the input was pending too.
  for (size_t m = 0; m < placements.size(); ++m)
    if (spec.placements[m].is_partial() && linear) placements[m] = spec.placements[m];
  bool bool_out = out.scalar_type() == at::kBool;
  if (bool_out && need_resolve) out = out.to(at::kByte);
  auto result = wrap(out, mesh, placements, layout.out_shape, layout.ext);
  if (need_resolve) result = resolve_partial(result);
  if (kind == Kind::Norm && !std::isinf(ord.toDouble()) && ord.toDouble() != 0) {
    auto* r = shard_impl(result);
    result = make_shard_tensor(r->local().pow(1.0 / ord.toDouble()), r->spec());
  }
  if (norm_in_float) {
    auto* r = shard_impl(result);
    result = make_shard_tensor(r->local().to(c10::toRealValueType(dtype.value_or(self.scalar_type()))), r->spec());
  }
  if (bool_out && need_resolve) {
    auto* r = shard_impl(result);
    result = make_shard_tensor(r->local().to(at::kBool), r->spec());
  }
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, result);
}

// max.dim / min.dim / argmax / argmin / max() / min(): values with global indices. `dim` absent: over all elements.
std::tuple<at::Tensor, at::Tensor> extreme_with_index(bool is_max, const at::Tensor& self_in,
                                                      std::optional<int64_t> dim_arg, bool keepdim) {
  auto self = resolve_partial(self_in);
  auto* impl = shard_impl(self);
  const auto& spec = *impl->spec();
  const auto& mesh = spec.mesh;
  const auto ndim = self.dim();
  const bool has_dim = dim_arg.has_value();
  at::Tensor local = impl->local();
  at::Tensor t = self;
  int64_t dim = 0;
  if (!has_dim) {
    // Over all elements: flatten. The flat order follows the global layout only when at most the outermost
    // dim is sharded; otherwise gather the other sharded dims first.
    auto placements = spec.placements;
    bool gather = false;
    for (auto& p : placements)
      if (p.is_shard() && p.dim != 0) {
        p = Placement::replicate();
        gather = true;
      }
    if (gather) t = redistribute_to(self, redistribute_target_spec(spec, placements));
    t = at::reshape(t, {-1});
    dim = 0;
  } else {
    dim = wrap_dim(*dim_arg, std::max<int64_t>(ndim, 1));
  }
  auto* timpl = shard_impl(t);
  const auto& tspec = *timpl->spec();
  local = timpl->local();
  const auto m = tspec.ndim() == 0 ? -1 : tspec.mesh_dim_of(dim);
  const bool kd = has_dim && keepdim;
  at::Tensor values, indices;
  if (local.dim() > 0 && local.size(dim) == 0) {
    auto shape = local_reduced_shape(local, {dim}, true);
    values = at::full(shape, is_max ? lowest(local.scalar_type()) : highest(local.scalar_type()), local.options());
    indices = at::zeros(shape, local.options().dtype(at::kLong));
  } else if (local.dim() == 0) {
    values = local.unsqueeze(0);
    indices = at::zeros({1}, local.options().dtype(at::kLong));
  } else {
    std::tie(values, indices) = is_max ? at::max(local, dim, true) : at::min(local, dim, true);
  }
  if (m >= 0) {
    indices = indices + tspec.local_offset(dim);
    // Values and indices in one collective; the first coordinate holding the extreme: the smallest global index.
    comm::StatReduce r;
    const auto i = is_max ? r.arg_max(values, indices) : r.arg_min(values, indices);
    r.run(*mesh, {m});
    values = r.result(i)[0];
    indices = r.result(i)[1];
  }
  auto layout = reduce_layout(tspec, {dim}, true);
  if (!kd) {
    values = values.squeeze(dim);
    indices = indices.squeeze(dim);
    layout = reduce_layout(tspec, {dim}, false);
  }
  if (!has_dim) layout.out_shape = {};
  return {wrap(values, mesh, layout.placements, layout.out_shape, layout.ext),
          wrap(indices, mesh, layout.placements, layout.out_shape, layout.ext)};
}

// max.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)
std::tuple<at::Tensor, at::Tensor> max_dim_rule(const at::Tensor& self, int64_t dim, bool keepdim) {
  raise_like_torch_if_empty(self, [&](const at::Tensor& e) { at::max(e, dim, keepdim); });
  return extreme_with_index(true, self, dim, keepdim);
}
// min.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)
std::tuple<at::Tensor, at::Tensor> min_dim_rule(const at::Tensor& self, int64_t dim, bool keepdim) {
  raise_like_torch_if_empty(self, [&](const at::Tensor& e) { at::min(e, dim, keepdim); });
  return extreme_with_index(false, self, dim, keepdim);
}
// max(Tensor self) -> Tensor
at::Tensor max_rule(const at::Tensor& self) {
  raise_like_torch_if_empty(self, [](const at::Tensor& e) { at::max(e); });
  return std::get<0>(extreme_with_index(true, self, std::nullopt, false));
}
// min(Tensor self) -> Tensor
at::Tensor min_rule(const at::Tensor& self) {
  raise_like_torch_if_empty(self, [](const at::Tensor& e) { at::min(e); });
  return std::get<0>(extreme_with_index(false, self, std::nullopt, false));
}
// argmax(Tensor self, int? dim=None, bool keepdim=False) -> Tensor
at::Tensor argmax_rule(const at::Tensor& self, std::optional<int64_t> dim, bool keepdim) {
  raise_like_torch_if_empty(self, [&](const at::Tensor& e) { at::argmax(e, dim, keepdim); });
  return std::get<1>(extreme_with_index(true, self, dim, keepdim));
}
// argmin(Tensor self, int? dim=None, bool keepdim=False) -> Tensor
at::Tensor argmin_rule(const at::Tensor& self, std::optional<int64_t> dim, bool keepdim) {
  raise_like_torch_if_empty(self, [&](const at::Tensor& e) { at::argmin(e, dim, keepdim); });
  return std::get<1>(extreme_with_index(false, self, dim, keepdim));
}

// logsumexp(Tensor self, int[1] dim, bool keepdim=False): every rank's (max, Σ exp(x − max)) over its part of the
// reduced dims, combined in one collective (comm/stat_reduce.h); Replicate over the reduced mesh dims. As on one
// device: an all -inf slice gives -inf, a +inf gives +inf, integral inputs give the default float dtype.
at::Tensor logsumexp_rule(const at::Tensor& self_arg, at::IntArrayRef dim, bool keepdim) {
  if (self_arg.is_complex()) dispatch::not_implemented("logsumexp of a complex tensor");
  auto self = resolve_partial(self_arg);
  const auto& spec = *shard_impl(self)->spec();
  const auto& local = shard_impl(self)->local();
  const auto x = at::isIntegralType(local.scalar_type(), /*includeBool=*/true)
                     ? local.to(c10::typeMetaToScalarType(at::get_default_dtype()))
                     : local;
  const auto dims = reduced_dims(at::OptionalIntArrayRef(dim), self.dim());
  const auto layout = reduce_layout(spec, dims, keepdim);
  at::Tensor out;
  if (layout.reduced_mesh_dims.empty()) {
    out = at::logsumexp(x, dims, keepdim);
  } else {
    constexpr auto inf = std::numeric_limits<double>::infinity();
    auto zero = at::zeros({}, x.options());
    comm::StatReduce r;
    const auto lse = r.log_sum_exp_over(x, dims);
    r.run(*spec.mesh, layout.reduced_mesh_dims);
    const auto& top = r.result(lse)[0];
    out = at::where(top == inf, top, at::log(r.result(lse)[1]) + at::where(at::isinf(top), zero, top));
    if (!keepdim)
      for (auto it = dims.rbegin(); it != dims.rend(); ++it) out = out.squeeze(*it);
  }
  return wrap(out, spec.mesh, layout.placements, layout.out_shape, layout.ext);
}

// aminmax(Tensor self, *, int? dim=None, bool keepdim=False) -> (Tensor min, Tensor max): amin and amax, each
// Partial(min) / Partial(max) over the sharded reduced dims (completed where used, as amax's own result).
std::tuple<at::Tensor, at::Tensor> aminmax_rule(const at::Tensor& self, std::optional<int64_t> dim, bool keepdim) {
  raise_like_torch_if_empty(self, [&](const at::Tensor& e) { at::aminmax(e, dim, keepdim); });
  std::vector<int64_t> dims;
  if (dim) dims.push_back(*dim);
  if (!dim && keepdim) {  // every dim reduced and kept
    for (int64_t d = 0; d < self.dim(); ++d) dims.push_back(d);
  }
  return {at::amin(self, dims, keepdim), at::amax(self, dims, keepdim)};
}

// Variance (or standard deviation) and mean over `dim_arg` with Chan's parallel formula across sharded dims.
std::tuple<at::Tensor, at::Tensor> moments(bool is_std, const at::Tensor& self_in, at::OptionalIntArrayRef dim_arg,
                                           const std::optional<at::Scalar>& correction_arg, bool keepdim) {
  auto self = resolve_partial(self_in);
  auto* impl = shard_impl(self);
  const auto& spec = *impl->spec();
  const auto& mesh = spec.mesh;
  const auto ndim = self.dim();
  auto dims = reduced_dims(dim_arg, ndim);
  const double correction = correction_arg ? correction_arg->toDouble() : 1.0;
  const auto& local = impl->local();
  const auto in_type = local.scalar_type();
  const auto acc_type = at::isReducedFloatingType(in_type) ? at::kFloat : in_type;
  auto x = local.to(acc_type);
  std::vector<ShardedDim> sharded;
  for (size_t mi = 0; mi < spec.placements.size(); ++mi) {
    const auto& p = spec.placements[mi];
    if (p.is_shard() && contains(dims, p.dim)) sharded.push_back({static_cast<int64_t>(mi), p.dim, spec.extents[mi]});
  }
  auto moments = global_moments(x, dims, sharded, *mesh);
  auto mean = moments.mean;
  auto m2 = moments.m2;
  double N = 1;
  for (auto d : dims) N *= static_cast<double>(self.size(d));
  auto var = m2 / std::max(N - correction, 0.0);
  auto out = is_std ? var.sqrt() : var;
  auto layout = reduce_layout(spec, dims, true);
  if (!keepdim) {
    std::vector<int64_t> sq(dims.begin(), dims.end());
    out = out.squeeze(sq);
    mean = mean.squeeze(sq);
    layout = reduce_layout(spec, dims, false);
  }
  out = out.to(c10::toRealValueType(in_type));  // a complex input's variance is real, as on one device
  mean = mean.to(in_type);
  return {wrap(out, mesh, layout.placements, layout.out_shape, layout.ext),
          wrap(mean, mesh, layout.placements, layout.out_shape, layout.ext)};
}

// var.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor
at::Tensor var_rule(const at::Tensor& self, at::OptionalIntArrayRef dim, const std::optional<at::Scalar>& correction,
                    bool keepdim) {
  return std::get<0>(moments(false, self, dim, correction, keepdim));
}
// std.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor
at::Tensor std_rule(const at::Tensor& self, at::OptionalIntArrayRef dim, const std::optional<at::Scalar>& correction,
                    bool keepdim) {
  return std::get<0>(moments(true, self, dim, correction, keepdim));
}
// var_mean.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> var_mean_rule(const at::Tensor& self, at::OptionalIntArrayRef dim,
                                                 const std::optional<at::Scalar>& correction, bool keepdim) {
  return moments(false, self, dim, correction, keepdim);
}
// std_mean.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> std_mean_rule(const at::Tensor& self, at::OptionalIntArrayRef dim,
                                                 const std::optional<at::Scalar>& correction, bool keepdim) {
  return moments(true, self, dim, correction, keepdim);
}

template <Kind K>
void decomposable(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  decomposable_handler(K, op, stack);
}

// value_selecting_reduction_backward(grad, dim, indices, sizes, keepdim): the backward of max/min with indices.
// Its composite form allocates a dense plain tensor of the global size; here the result takes grad's layout
// with the reduced dim whole on every rank (the indices are global along it).
at::Tensor value_selecting_backward(const at::Tensor& grad_in, int64_t dim, const at::Tensor& indices_in,
                                    c10::SymIntArrayRef sym_sizes, bool keepdim) {
  auto* gi = shard_impl(grad_in);
  auto* ii = shard_impl(indices_in);
  const auto sizes = concrete_ints(sym_sizes);
  const auto ndim = static_cast<int64_t>(sizes.size());
  dim = wrap_dim(dim, std::max<int64_t>(ndim, 1));
  const auto& mesh = (gi ? gi : ii)->spec()->mesh;
  auto grad = resolve_partial(dispatch::as_shard(grad_in, mesh));
  auto gspec = shard_impl(grad)->spec();
  // sort's gradient along `dim` keeps that dim (keepdim), and it may arrive sharded there (sort along a sharded dim
  // runs through the gather-compute fallback, whose outputs keep the input's layout): the indices are global along
  // `dim`, so that dim is gathered first.
  if (keepdim && gspec->mesh_dim_of(dim) >= 0) {
    auto placements = gspec->placements;
    placements[gspec->mesh_dim_of(dim)] = Placement::replicate();
    grad = redistribute_to(grad, redistribute_target_spec(*gspec, placements));
    gspec = shard_impl(grad)->spec();
  }
  auto idx = local_as(indices_in, mesh, gspec->placements, gspec->dim_extents());
  Placements out_p = gspec->placements;
  DimExtents out_ext;
  auto local_sizes = sizes;
  for (size_t m = 0; m < out_p.size(); ++m) {
    if (!out_p[m].is_shard()) continue;
    auto nd = (!keepdim && out_p[m].dim >= dim) ? out_p[m].dim + 1 : out_p[m].dim;
    out_ext[nd] = gspec->extents[m];
    local_sizes[nd] = gspec->local_shape[out_p[m].dim];
    out_p[m] = Placement::shard(nd);
  }
  auto out = at::value_selecting_reduction_backward(shard_impl(grad)->local(), dim, idx, local_sizes, keepdim);
  return wrap(out, mesh, out_p, sizes, out_ext);
}

// The legacy torch.norm overloads are linalg_vector_norm with p's default (2) spelled out; its rule (and, through
// the derivative formula, norm_backward's pointwise ops) runs on the ShardTensor.
// norm.Scalar(Tensor self, Scalar p=2)
at::Tensor norm_scalar_rule(const at::Tensor& self, const at::Scalar& p) {
  return at::linalg_vector_norm(self, p);
}
// norm.ScalarOpt_dtype(Tensor self, Scalar? p, *, ScalarType dtype)
at::Tensor norm_dtype_rule(const at::Tensor& self, const std::optional<at::Scalar>& p, at::ScalarType dtype) {
  return at::linalg_vector_norm(self, p.value_or(2), std::nullopt, false, dtype);
}
// norm.ScalarOpt_dim(Tensor self, Scalar? p, int[1] dim, bool keepdim=False)
at::Tensor norm_dim_rule(const at::Tensor& self, const std::optional<at::Scalar>& p, at::IntArrayRef dim,
                         bool keepdim) {
  return at::linalg_vector_norm(self, p.value_or(2), dim, keepdim);
}
// norm.ScalarOpt_dim_dtype(Tensor self, Scalar? p, int[1] dim, bool keepdim, *, ScalarType dtype)
at::Tensor norm_dim_dtype_rule(const at::Tensor& self, const std::optional<at::Scalar>& p, at::IntArrayRef dim,
                               bool keepdim, at::ScalarType dtype) {
  return at::linalg_vector_norm(self, p.value_or(2), dim, keepdim, dtype);
}
// dist(Tensor self, Tensor other, Scalar p=2): the p-norm of the difference (broadcast), as aten computes it.
at::Tensor dist_rule(const at::Tensor& self, const at::Tensor& other, const at::Scalar& p) {
  check_dist_args(self, other);
  return at::linalg_vector_norm(at::sub(self, other), p);
}

// renorm(Tensor self, Scalar p, int dim, Scalar maxnorm): every slice along `dim` whose p-norm (over the other
// dims) exceeds maxnorm is scaled down to it — aten's own composition (vector norm in the accumulate type, the
// factor maxnorm / (norm + 1e-7), a product), here on the ShardTensor: the norms' rule reduces over sharded dims.
at::Tensor renorm_rule(const at::Tensor& self, const at::Scalar& p, int64_t dim, const at::Scalar& maxnorm) {
  TORCH_CHECK_VALUE(!p.isComplex() && p.toDouble() > 0, "renorm: non-positive-norm not supported");
  TORCH_CHECK_VALUE(!maxnorm.isComplex() && maxnorm.toDouble() >= 0, "renorm: expected maxnorm to be >= 0 but got ",
                    maxnorm.toDouble());
  const auto ndim = self.dim();
  TORCH_CHECK_VALUE(ndim > 1, "renorm: input needs at least 2 dimensions, got ", ndim, " dimensions");
  dim = wrap_dim(dim, ndim);
  std::vector<int64_t> reduce_dims;
  for (int64_t d = 0; d < ndim; ++d)
    if (d != dim) reduce_dims.push_back(d);
  const auto acc = at::toAccumulateType(self.scalar_type(), /*is_cuda=*/true);
  auto norm = at::linalg_vector_norm(self, p, reduce_dims, /*keepdim=*/true, acc);
  auto factor = at::where(at::gt(norm, maxnorm), at::div(at::full({}, maxnorm, norm.options()), norm + 1e-7),
                          at::ones({}, norm.options()));
  return at::mul(self, factor.to(c10::toRealValueType(self.scalar_type())));
}

// _is_all_true / _is_any_true (torch's boolean checks, `if not torch._is_all_true(valid)`: transformers' time-series
// models check their lag indices with it): all / any of a bool tensor, a 0-dim result complete on every rank (the
// reduction rule above). Non-bool input raises as torch's does (a RuntimeError).
at::Tensor is_all_true_rule(const at::Tensor& self) {
  TORCH_CHECK(self.scalar_type() == at::kBool, "_is_all_true: expected a bool tensor, got ", self.scalar_type());
  return at::all(self);
}

at::Tensor is_any_true_rule(const at::Tensor& self) {
  TORCH_CHECK(self.scalar_type() == at::kBool, "_is_any_true: expected a bool tensor, got ", self.scalar_type());
  return at::any(self);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(reduction) {
  using dispatch::set_handler;
  // Composite-implicit: bound on both shard keys so it never decomposes into a dense global allocation.
  dispatch::set_handler("aten::value_selecting_reduction_backward", typed_handler(&value_selecting_backward),
                        dispatch::RuleLevel::above_autograd);
  set_handler("aten::sum", decomposable<Kind::Sum>);
  set_handler("aten::sum.dim_IntList", decomposable<Kind::Sum>);
  set_handler("aten::mean", decomposable<Kind::Mean>);
  set_handler("aten::mean.dim", decomposable<Kind::Mean>);
  set_handler("aten::amax", decomposable<Kind::Amax>);
  set_handler("aten::amin", decomposable<Kind::Amin>);
  set_handler("aten::all", decomposable<Kind::All>);
  set_handler("aten::all.dim", decomposable<Kind::All>);
  set_handler("aten::all.dims", decomposable<Kind::All>);
  set_handler("aten::any", decomposable<Kind::Any>);
  set_handler("aten::any.dim", decomposable<Kind::Any>);
  set_handler("aten::any.dims", decomposable<Kind::Any>);
  set_handler("aten::_is_all_true", typed_handler(&is_all_true_rule));
  set_handler("aten::_is_any_true", typed_handler(&is_any_true_rule));
  set_handler("aten::nansum", decomposable<Kind::NanSum>);
  set_handler("aten::count_nonzero", decomposable<Kind::CountNonzero>);
  set_handler("aten::count_nonzero.dim_IntList", decomposable<Kind::CountNonzero>);
  set_handler("aten::prod", decomposable<Kind::Prod>);
  set_handler("aten::prod.dim_int", decomposable<Kind::Prod>);
  set_handler("aten::linalg_vector_norm", decomposable<Kind::Norm>);
  set_handler("aten::norm.Scalar", typed_handler(&norm_scalar_rule));
  set_handler("aten::norm.ScalarOpt_dtype", typed_handler(&norm_dtype_rule));
  set_handler("aten::norm.ScalarOpt_dim", typed_handler(&norm_dim_rule));
  set_handler("aten::norm.ScalarOpt_dim_dtype", typed_handler(&norm_dim_dtype_rule));
  set_handler("aten::dist", typed_handler(&dist_rule));
  set_handler("aten::renorm", typed_handler(&renorm_rule));
  set_handler("aten::max.dim", typed_handler(&max_dim_rule));
  set_handler("aten::min.dim", typed_handler(&min_dim_rule));
  set_handler("aten::max", typed_handler(&max_rule));
  set_handler("aten::min", typed_handler(&min_rule));
  set_handler("aten::argmax", typed_handler(&argmax_rule));
  set_handler("aten::argmin", typed_handler(&argmin_rule));
  set_handler("aten::aminmax", typed_handler(&aminmax_rule));
  set_handler("aten::logsumexp", typed_handler(&logsumexp_rule));
  set_handler("aten::var.correction", typed_handler(&var_rule));
  set_handler("aten::std.correction", typed_handler(&std_rule));
  set_handler("aten::var_mean.correction", typed_handler(&var_mean_rule));
  set_handler("aten::std_mean.correction", typed_handler(&std_mean_rule));
}

} // namespace shardtensor::ops
