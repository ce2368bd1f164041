// Contractions. mm/bmm/addmm/baddbmm and the vector products (dot, vdot, mv, addmv, addr) pick the output layout
// per mesh dim from the operands' shards: batch or row or column shards stay shards, a sharded contracted dim gives
// Partial(sum).
// `linear` and `matmul` are bound above autograd so token-sharded (..., S, K) inputs are never flattened
// across their sharded dim: the local op runs on the local tokens and weight gradients are reduced once.
#include "comm/collectives.h"
#include "comm/redistribute.h"
#include "dispatch/grad_buckets.h"
#include "dispatch/grad_layout.h"
#include "dispatch/promote.h"
#include "ops/arg_checks.h"
#include "ops/common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/einsum_native.h>
#include <ATen/ops/linear_native.h>
#include <ATen/ops/matmul_native.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>


namespace shardtensor::ops {

namespace {


// Labels: 'b' batch, 'm' rows, 'k' contracted, 'n' columns.
struct ContractPlan {
  Placements pa, pb, po;
  DimExtents ea, eb, eo;
  std::vector<int64_t> partial_mesh_dims; // where the output is Partial(sum) because k is sharded
};

ContractPlan plan_contraction(const at::Tensor& a, const std::string& la, const at::Tensor& b, const std::string& lb,
                              const std::string& lo, const MeshPtr& mesh) {
  ContractPlan plan;
  const auto nm = static_cast<size_t>(mesh->ndim());
  plan.pa.assign(nm, Placement::replicate());
  plan.pb.assign(nm, Placement::replicate());
  plan.po.assign(nm, Placement::replicate());
  auto pa0 = placements_of(a, mesh), pb0 = placements_of(b, mesh);
  const ShardSpec* sa = shard_impl(a) ? shard_impl(a)->spec().get() : nullptr;
  const ShardSpec* sb = shard_impl(b) ? shard_impl(b)->spec().get() : nullptr;
  std::string used;
  for (size_t m = 0; m < nm; ++m) {
    const char La = pa0[m].is_shard() ? la[pa0[m].dim] : 0;
    const char Lb = pb0[m].is_shard() ? lb[pb0[m].dim] : 0;
    char X = 0;
    for (char c : {'b', 'm', 'n', 'k'})
      if ((La == c || Lb == c) && used.find(c) == std::string::npos) {
        X = c;
        break;
      }
    if (!X) {
      // Keep a single pending sum (linear in that operand).
      const bool a_part = pa0[m].is_partial() && pa0[m].op == ReduceOp::Sum;
      const bool b_part = pb0[m].is_partial() && pb0[m].op == ReduceOp::Sum;
      if (a_part != b_part) {
        (a_part ? plan.pa : plan.pb)[m] = Placement::partial(ReduceOp::Sum);
        plan.po[m] = Placement::partial(ReduceOp::Sum);
      }
      continue;
    }
    used.push_back(X);
    const std::vector<int64_t>& ext = La == X ? sa->extents[m] : sb->extents[m];
    if (auto i = la.find(X); i != std::string::npos) {
      plan.pa[m] = Placement::shard(static_cast<int64_t>(i));
      plan.ea[static_cast<int64_t>(i)] = ext;
    }
    if (auto i = lb.find(X); i != std::string::npos) {
      plan.pb[m] = Placement::shard(static_cast<int64_t>(i));
      plan.eb[static_cast<int64_t>(i)] = ext;
    }
    if (auto i = lo.find(X); i != std::string::npos) {
      plan.po[m] = Placement::shard(static_cast<int64_t>(i));
      plan.eo[static_cast<int64_t>(i)] = ext;
    } else {
      plan.po[m] = Placement::partial(ReduceOp::Sum);
      plan.partial_mesh_dims.push_back(static_cast<int64_t>(m));
    }
  }
  return plan;
}

// Only the first rank along every Partial mesh dim adds a bias term (so the pending sum counts it once).
bool owns_bias(const ContractPlan& plan, const Mesh& mesh) {
  for (size_t m = 0; m < plan.po.size(); ++m)
    if (plan.po[m].is_partial() && mesh.coordinate(static_cast<int64_t>(m)) != 0) return false;
  return true;
}

// The local kernel of a labelled contraction: the operands' local parts and, with a bias, its local part and the
// beta this rank applies (0 on ranks that do not own the bias of a pending sum).
using LocalContraction =
    std::function<at::Tensor(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, const at::Scalar& beta)>;

// A contraction described by dim labels ('b' batch, 'm' rows, 'k' contracted, 'n' columns): `la`/`lb` label the
// operands' dims and `lo` the output's (of `out_shape`). Batch, row and column shards stay shards of the output, a
// sharded contracted dim leaves Partial(sum); `bias` (when given) is aligned to the output's layout.
at::Tensor labelled_contraction(const char* op_name, const at::Tensor& a, const std::string& la, const at::Tensor& b,
                                const std::string& lb, const std::string& lo, const std::vector<int64_t>& out_shape,
                                const at::Tensor* bias, at::Scalar beta, const LocalContraction& kernel) {
  auto mesh = bias ? dispatch::common_mesh(op_name, {*bias, a, b}) : dispatch::common_mesh(op_name, {a, b});
  auto plan = plan_contraction(a, la, b, lb, lo, mesh);
  auto a_local = local_as(a, mesh, plan.pa, plan.ea);
  auto b_local = local_as(b, mesh, plan.pb, plan.eb);
  at::Tensor bias_local;
  if (bias) {
    Placements bias_target = plan.po;
    for (auto& p : bias_target)
      if (p.is_partial()) p = Placement::replicate();
    bias_local = local_aligned(resolve_partial(*bias), mesh, out_shape, bias_target, plan.eo);
    if (!owns_bias(plan, *mesh)) beta = 0;
  }
  return wrap(kernel(a_local, b_local, bias_local, beta), mesh, plan.po, out_shape, plan.eo);
}

// A matrix product `a @ b` (batched: bmm), plus `beta * bias` when a bias is given (addmm, baddbmm).
at::Tensor contraction(const char* op_name, bool batched, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor* bias, at::Scalar beta, const at::Scalar& alpha) {
  check_contraction_args(op_name, batched, a, b, bias);
  std::vector<int64_t> out_shape = batched ? std::vector<int64_t>{a.size(0), a.size(1), b.size(2)}
                                           : std::vector<int64_t>{a.size(0), b.size(1)};
  return labelled_contraction(
      op_name, a, batched ? "bmk" : "mk", b, batched ? "bkn" : "kn", batched ? "bmn" : "mn", out_shape, bias, beta,
      [&](const at::Tensor& al, const at::Tensor& bl, const at::Tensor& bias_local, const at::Scalar& beta_here) {
        if (!bias) return batched ? at::bmm(al, bl) : at::mm(al, bl);
        return batched ? at::baddbmm(bias_local, al, bl, beta_here, alpha) : at::addmm(bias_local, al, bl, beta_here, alpha);
      });
}

// ---- vector products: dot, vdot, mv, addmv, addr ----
// dot(Tensor self, Tensor tensor) / vdot(Tensor self, Tensor other): a sharded vector gives Partial(sum).
at::Tensor dot_rule(const at::Tensor& self, const at::Tensor& tensor) {
  check_vector_product_args("aten::dot", VectorProduct::dot, self, tensor, nullptr);
  return labelled_contraction("aten::dot", self, "k", tensor, "k", "", {}, nullptr, 0,
                              [](const at::Tensor& a, const at::Tensor& b, const at::Tensor&, const at::Scalar&) {
                                return at::dot(a, b);
                              });
}
at::Tensor vdot_rule(const at::Tensor& self, const at::Tensor& other) {
  check_vector_product_args("aten::vdot", VectorProduct::dot, self, other, nullptr);
  return labelled_contraction("aten::vdot", self, "k", other, "k", "", {}, nullptr, 0,
                              [](const at::Tensor& a, const at::Tensor& b, const at::Tensor&, const at::Scalar&) {
                                return at::vdot(a, b);
                              });
}
// mv(Tensor self, Tensor vec): row shards stay shards, column shards give Partial(sum).
at::Tensor mv_rule(const at::Tensor& self, const at::Tensor& vec) {
  check_vector_product_args("aten::mv", VectorProduct::mv, self, vec, nullptr);
  return labelled_contraction("aten::mv", self, "mk", vec, "k", "m", {self.size(0)}, nullptr, 0,
                              [](const at::Tensor& a, const at::Tensor& b, const at::Tensor&, const at::Scalar&) {
                                return at::mv(a, b);
                              });
}
// addmv(Tensor self, Tensor mat, Tensor vec, *, Scalar beta=1, Scalar alpha=1)
at::Tensor addmv_rule(const at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec, const at::Scalar& beta,
                      const at::Scalar& alpha) {
  check_vector_product_args("aten::addmv", VectorProduct::mv, mat, vec, &self);
  return labelled_contraction(
      "aten::addmv", mat, "mk", vec, "k", "m", {mat.size(0)}, &self, beta,
      [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, const at::Scalar& beta_here) {
        return at::addmv(bias, a, b, beta_here, alpha);
      });
}
// addr(Tensor self, Tensor vec1, Tensor vec2, *, Scalar beta=1, Scalar alpha=1): an outer product, every shard
// stays a shard.
at::Tensor addr_rule(const at::Tensor& self, const at::Tensor& vec1, const at::Tensor& vec2, const at::Scalar& beta,
                     const at::Scalar& alpha) {
  check_vector_product_args("aten::addr", VectorProduct::outer, vec1, vec2, &self);
  return labelled_contraction(
      "aten::addr", vec1, "m", vec2, "n", "mn", {vec1.size(0), vec2.size(0)}, &self, beta,
      [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, const at::Scalar& beta_here) {
        return at::addr(bias, a, b, beta_here, alpha);
      });
}

// mm(Tensor self, Tensor mat2)
at::Tensor mm_rule(const at::Tensor& self, const at::Tensor& mat2) {
  return contraction("aten::mm", false, self, mat2, nullptr, 0, 1);
}
// bmm(Tensor self, Tensor mat2)
at::Tensor bmm_rule(const at::Tensor& self, const at::Tensor& mat2) {
  return contraction("aten::bmm", true, self, mat2, nullptr, 0, 1);
}
// addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1)
at::Tensor addmm_rule(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const at::Scalar& beta,
                      const at::Scalar& alpha) {
  return contraction("aten::addmm", false, mat1, mat2, &self, beta, alpha);
}
// baddbmm(Tensor self, Tensor batch1, Tensor batch2, *, Scalar beta=1, Scalar alpha=1)
at::Tensor baddbmm_rule(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                        const at::Scalar& beta, const at::Scalar& alpha) {
  return contraction("aten::baddbmm", true, batch1, batch2, &self, beta, alpha);
}

// addbmm(Tensor self, Tensor batch1, Tensor batch2, *, Scalar beta=1, Scalar alpha=1): beta * self + alpha * the sum
// over the batch of batch1 @ batch2, composed from the rules of bmm (a split batch leaves its sum pending), sum and
// add (below autograd: addbmm's own derivative formulas run on the rules of their parts). A split `self` keeps its
// layout; beta = 0 ignores self's values (NaN included), as on one device.
at::Tensor addbmm_rule(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                       const at::Scalar& beta, const at::Scalar& alpha) {
  TORCH_CHECK_VALUE(batch1.dim() == 3 && batch2.dim() == 3, "addbmm: batch1 and batch2 must be 3-D tensors, got ",
                    batch1.dim(), "-D and ", batch2.dim(), "-D");
  // Integer tensors: torch's kernel takes beta and alpha as the integer type (0.6 -> 0), so the terms stay integers.
  const bool integral = at::isIntegralType(self.scalar_type(), /*includeBool=*/false);
  const auto b_ = integral ? at::Scalar(beta.to<int64_t>()) : beta;
  const auto a_ = integral ? at::Scalar(alpha.to<int64_t>()) : alpha;
  auto products = at::sum(at::bmm(batch1, batch2), 0);
  auto scaled = b_.toComplexDouble() == 0.0 ? at::zeros_like(self) : at::mul(self, b_);
  return at::add(scaled, products, a_);
}

// ---- linear above autograd ----

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Is `x @ w.T + b` computable on local tokens? x sharded only on leading (non-contracted) dims, no Partial;
// w and b plain or fully replicated.
// The weight and bias whole on every rank: plain or fully replicated.
bool whole_params(const at::Tensor& w, const std::optional<at::Tensor>& b) {
  auto replicated = [](const at::Tensor& t) {
    auto* i = shard_impl(t);
    return !i || i->spec()->all_replicate();
  };
  return replicated(w) && (!b || !b->defined() || replicated(*b));
}

bool token_local_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  auto* xi = shard_impl(x);
  if (!xi || x.dim() < 2) return false;
  for (const auto& p : xi->spec()->placements) {
    if (p.is_partial()) return false;
    if (p.is_shard() && p.dim == x.dim() - 1) return false;
  }
  return whole_params(w, b);
}

at::Tensor plain_of(const at::Tensor& t) {
  auto* i = shard_impl(t);
  return i ? i->local() : t;
}

// Reduce a per-rank term of a weight gradient over every mesh dim that shards the tokens, then hand it back in
// the parameter's own kind (plain, or Replicate ShardTensor).
at::Tensor reduce_param_grad(at::Tensor term, const ShardSpec& x_spec, const at::Tensor& param) {
  std::vector<int64_t> dims;
  for (size_t m = 0; m < x_spec.placements.size(); ++m)
    if (x_spec.placements[m].is_shard()) dims.push_back(static_cast<int64_t>(m));
  term = sum_over_mesh_dims(std::move(term), dims, *x_spec.mesh);
  if (param.defined() && shard_impl(param)) return make_shard_tensor(term, shard_impl(param)->spec());
  return term;
}

at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  auto* xi = shard_impl(x);
  auto out = at::linear(xi->local(), plain_of(w), b.defined() ? std::optional<at::Tensor>(plain_of(b)) : std::nullopt);
  auto shape = x.sizes().vec();
  shape.back() = w.size(0);
  return make_shard_tensor(out, ShardSpec::make(xi->spec()->mesh, xi->spec()->placements, shape,
                                                xi->spec()->sharding_shapes()));
}

// A complex operand's conjugate (torch's mm gradients are grad @ b^H and a^H @ grad); a real one itself. A physical
// conjugate (pointwise, it has a rule) since the operand may be a ShardTensor.
at::Tensor conj_of(const at::Tensor& t) {
  return t.is_complex() ? at::conj_physical(t) : t;
}

// Gradients of x, w and (when defined) b.
// create_graph=True (a physics-informed loss on du/dx through an MLP over split points): the same gradients from
// recorded ShardTensor ops, so that a second derivative sees them. Costlier than the path below (views merging the
// token dims, one full_tensor per plain parameter, nothing deferred) and taken only then.
variable_list linear_backward_recorded(const at::Tensor& g_in, const at::Tensor& x, const at::Tensor& w,
                                       const at::Tensor& b) {
  const auto g = resolve_partial_diff(g_in);
  at::Tensor gx, gw, gb;
  if (x.requires_grad()) gx = at::matmul(g, conj_of(w));
  const bool want_w = w.requires_grad(), want_b = b.defined() && b.requires_grad();
  if (!want_w && !want_b) return {gx, gw, gb};
  auto g2 = g.reshape({-1, g.size(-1)});
  if (want_w) gw = recorded_param_grad(at::mm(g2.t(), conj_of(x).reshape({-1, x.size(-1)})), w);
  if (want_b) gb = recorded_param_grad(g2.sum(0), b);
  return {gx, gw, gb};
}

variable_list linear_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
  if (at::GradMode::is_enabled()) return linear_backward_recorded(g, x, w, b);
  // Read before the guard: a create_graph backward (grad mode on) reduces at once (dispatch/grad_buckets.h).
  const bool may_defer = dispatch::backward_defers_grad_reductions();
  at::NoGradGuard no_grad;
  const auto& x_spec = *shard_impl(x)->spec();
  auto g_local = local_aligned(resolve_partial(g), x_spec.mesh, g.sizes(), x_spec.placements, x_spec.dim_extents());
  auto x_local = shard_impl(x)->local();
  at::Tensor gx, gw, gb;
  if (x.requires_grad()) gx = make_shard_tensor(at::matmul(g_local, plain_of(w).conj()), shard_impl(x)->spec());
  auto g2 = g_local.reshape({-1, g_local.size(-1)});
  const bool want_w = w.requires_grad(), want_b = b.defined() && b.requires_grad();
  at::Tensor tw = want_w ? at::mm(g2.t(), x_local.conj().reshape({-1, x_local.size(-1)})) : at::Tensor();
  at::Tensor tb = want_b ? g2.sum(0) : at::Tensor();
  std::vector<int64_t> token_dims;
  for (size_t m = 0; m < x_spec.placements.size(); ++m)
    if (x_spec.placements[m].is_shard()) token_dims.push_back(static_cast<int64_t>(m));
  const bool pending = may_defer && !token_dims.empty() && (want_w || want_b) &&
                       (!want_w || dispatch::param_grad_deferrable(w)) &&
                       (!want_b || dispatch::param_grad_deferrable(b));
  if (pending) {
    // The gradient buckets sum them (dispatch/grad_buckets.h): a promoted parameter gets its term pending over the
    // token mesh dims (its promotion defers it); a plain leaf's term is deferred here and it gets none from us.
    Placements p(x_spec.placements.size(), Placement::replicate());
    for (auto m : token_dims) p[m] = Placement::partial();
    auto pending_grad = [&](const at::Tensor& term, const at::Tensor& param) {
      if (shard_impl(param)) return make_shard_tensor(term, ShardSpec::make(x_spec.mesh, p, param.sizes().vec()));
      if (dispatch::defer_leaf_grad(param, term, x_spec.mesh, token_dims)) return at::Tensor();
      return reduce_param_grad(term, x_spec, param);
    };
    if (want_w) gw = pending_grad(tw, w);
    if (want_b) gb = pending_grad(tb, b);
  } else if (want_w && want_b && tw.scalar_type() == tb.scalar_type()) {
    // One fused all-reduce for both parameter gradients.
    auto both = reduce_param_grad(at::cat({tw.flatten(), tb}), x_spec, at::Tensor());
    auto plain = shard_impl(both) ? shard_impl(both)->local() : both;
    gw = plain.narrow(0, 0, tw.numel()).view(tw.sizes());
    gb = plain.narrow(0, tw.numel(), tb.numel());
    if (shard_impl(w)) gw = make_shard_tensor(gw.clone(), shard_impl(w)->spec());
    if (shard_impl(b)) gb = make_shard_tensor(gb.clone(), shard_impl(b)->spec());
  } else {
    if (want_w) gw = reduce_param_grad(tw, x_spec, w);
    if (want_b) gb = reduce_param_grad(tb, x_spec, b);
  }
  return {gx, gw, gb};
}

// Undefined tensors cannot be Function inputs: one Function with a bias, one without.
struct LinearFn : torch::autograd::Function<LinearFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, w, b});
    return linear_forward(x, w, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    return linear_backward(grads[0], s[0], s[1], s[2]);
  }
};

struct LinearNoBiasFn : torch::autograd::Function<LinearNoBiasFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, w});
    return linear_forward(x, w, at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto g = linear_backward(grads[0], s[0], s[1], at::Tensor());
    return {g[0], g[1]};
  }
};

at::Tensor apply_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (b && b->defined()) return LinearFn::apply(x, w, *b);
  return LinearNoBiasFn::apply(x, w);
}

// A Linear of a tensor split along its features (the contracted last dim: a channels-last field whose channels
// came split out of a spectral layer, a spectrogram split along its frequencies) would leave a pending sum of the
// whole output on every rank, completed later by a reduce-scatter of the output. When the input per rank is no
// larger than the output (C_in / P <= C_out) moving the split to the largest leading dim first is the smaller
// message (one all-to-all of the input) and keeps the output divided; the token-local path then runs. One mesh dim
// splits the features, no pending sum, the weight and bias whole; nullopt otherwise, or when no leading dim has a
// row per rank. The same decision as the convolution's (conv.cpp, channel_split_to_space), from global shapes.
std::optional<at::Tensor> features_split_to_rows(const at::Tensor& x, const at::Tensor& w,
                                                 const std::optional<at::Tensor>& b) {
  auto* xi = shard_impl(x);
  if (!xi || x.dim() < 2 || w.dim() != 2) return std::nullopt;
  const auto& spec = *xi->spec();
  const auto last = x.dim() - 1;
  int64_t m = -1;
  for (size_t j = 0; j < spec.placements.size(); ++j) {
    const auto& p = spec.placements[j];
    if (p.is_partial()) return std::nullopt;
    if (p.is_shard() && p.dim == last) {
      if (m >= 0) return std::nullopt;
      m = static_cast<int64_t>(j);
    }
  }
  if (m < 0 || !whole_params(w, b)) return std::nullopt;
  if (x.size(last) > w.size(0) * spec.mesh->size(m)) return std::nullopt;  // a narrow output: its pending sum is smaller
  auto layout = split_moved_layout(spec, x.sizes(), last);
  if (!layout) return std::nullopt;
  return to_layout(x, layout->first, layout->second);
}

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  check_linear_args(x, w, b);
  // Held until the op below has recorded its graph edges.
  auto acc_x = at::GradMode::is_enabled() ? dispatch::ensure_grad_layout_hook(x) : nullptr;
  auto acc_w = at::GradMode::is_enabled() ? dispatch::ensure_grad_layout_hook(w) : nullptr;
  if (token_local_linear(x, w, b)) return apply_linear(x, w, b);
  if (auto moved = features_split_to_rows(x, w, b)) {
    if (token_local_linear(*moved, w, b)) return apply_linear(*moved, w, b);
  }
  return at::native::linear(x, w, b);
}

// The batch dim that both operands shard alike (same placements and extents, no broadcast, no Partial, the matrix
// dims unsharded), when they are not already the leading dims; else empty. matmul's decomposition merges the
// batch dims into one for bmm: a shard of an inner batch dim (Pangu/FengWu windows under the heads dim) is not a
// block of the merged dim, so the merge redistributed it and the result came back sharded on the outer dim.
std::vector<int64_t> inner_shared_batch_shard(const at::Tensor& a, const at::Tensor& b) {
  auto* ai = shard_impl(a);
  auto* bi = shard_impl(b);
  if (!ai || !bi || a.dim() != b.dim() || a.dim() < 3) return {};
  const ShardSpec& sa = *ai->spec();
  const ShardSpec& sb = *bi->spec();
  if (sa.mesh != sb.mesh || sa.placements != sb.placements || sa.has_partial() || !sa.has_shard()) return {};
  std::vector<int64_t> dims;
  for (const auto& p : sa.placements) {
    if (!p.is_shard()) continue;
    if (p.dim >= a.dim() - 2 || a.size(p.dim) != b.size(p.dim)) return {};
    dims.push_back(p.dim);
  }
  // One sharded batch dim (a merge of two sharded dims cannot stay sharded on both mesh dims); a leading one
  // already is a block of the merged dim.
  if (dims.size() != 1 || dims[0] == 0 || sa.dim_extents() != sb.dim_extents()) return {};
  return dims;
}

at::Tensor matmul_autograd(const at::Tensor& a, const at::Tensor& b) {
  check_matmul_args(a, b);
  // Held until the op below has recorded its graph edges.
  auto acc_a = at::GradMode::is_enabled() ? dispatch::ensure_grad_layout_hook(a) : nullptr;
  auto acc_b = at::GradMode::is_enabled() ? dispatch::ensure_grad_layout_hook(b) : nullptr;
  // (..., S, K) @ (K, N) with tokens sharded: a linear without bias.
  if (b.dim() == 2 && a.dim() >= 3 && token_local_linear(a, b, std::nullopt)) {
    return apply_linear(a, b.t(), std::nullopt);
  }
  // (..., S, K) @ (K,): a one-output linear.
  if (b.dim() == 1 && a.dim() >= 2 && token_local_linear(a, b, std::nullopt)) {
    return at::squeeze(apply_linear(a, b.unsqueeze(0), std::nullopt), -1);
  }
  // Batch-sharded on an inner batch dim: move the shared sharded dim to the front so that the bmm the
  // decomposition calls is local per rank, and move them back.
  auto front = inner_shared_batch_shard(a, b);
  if (!front.empty()) {
    const int64_t d = front[0];
    return at::native::matmul(a.movedim(d, 0), b.movedim(d, 0)).movedim(0, d);
  }
  return at::native::matmul(a, b);
}

// einsum's label code, as ATen numbers labels (upper case before lower case): non-output labels are laid out in
// this order after the output's.
int einsum_label_code(char c) {
  return c >= 'A' && c <= 'Z' ? c - 'A' : c - 'a' + 26;
}

// An einsum equation with an explicit output, its ellipses written out as labels of their own (right-aligned
// across operands, as ATen broadcasts them); nullopt for an implicit output or labels that do not fit.
struct EinsumEquation {
  std::vector<std::string> inputs;
  std::string output;
};

std::optional<EinsumEquation> explicit_einsum(c10::string_view equation, at::TensorList operands) {
  std::string eq;
  for (char c : equation)
    if (c != ' ') eq.push_back(c);
  const auto arrow = eq.find("->");
  if (arrow == std::string::npos) return std::nullopt;
  EinsumEquation out;
  std::string cur;
  for (char c : eq.substr(0, arrow)) {
    if (c == ',') out.inputs.push_back(cur), cur.clear();
    else cur.push_back(c);
  }
  out.inputs.push_back(cur);
  out.output = eq.substr(arrow + 2);
  if (out.inputs.size() != operands.size()) return std::nullopt;
  const std::string ellipsis = "...";
  int64_t width = 0;  // the ellipsis' dims (the most any operand has)
  std::vector<int64_t> own(operands.size(), 0);
  for (size_t i = 0; i < operands.size(); ++i) {
    auto& in = out.inputs[i];
    if (in.find(ellipsis) == std::string::npos) continue;
    own[i] = operands[i].dim() - static_cast<int64_t>(in.size() - ellipsis.size());
    if (own[i] < 0) return std::nullopt;
    width = std::max(width, own[i]);
  }
  std::string fresh;
  for (char c = 'A'; c <= 'z' && static_cast<int64_t>(fresh.size()) < width; ++c)
    if (std::isalpha(static_cast<unsigned char>(c)) && eq.find(c) == std::string::npos) fresh.push_back(c);
  if (static_cast<int64_t>(fresh.size()) < width) return std::nullopt;
  for (size_t i = 0; i < operands.size(); ++i) {
    auto& in = out.inputs[i];
    const auto at = in.find(ellipsis);
    if (at != std::string::npos) in.replace(at, ellipsis.size(), fresh.substr(width - own[i]));
    if (static_cast<int64_t>(in.size()) != operands[i].dim()) return std::nullopt;
    for (char c : in)
      if (!std::isalpha(static_cast<unsigned char>(c))) return std::nullopt;
  }
  const auto at = out.output.find(ellipsis);
  if (at != std::string::npos) out.output.replace(at, ellipsis.size(), fresh);
  for (char c : out.output)
    if (!std::isalpha(static_cast<unsigned char>(c))) return std::nullopt;
  return out;
}

// An einsum computed on the ranks' blocks, with no communication: every mesh dim splits at most one label, split
// alike (same extents) in every operand that holds it (an operand that holds it unsplit is cut to the block), so each
// rank's blocks give its block of the result -- the label's block where the output keeps it, a pending sum where it
// is contracted. What ATen's decomposition cannot do when one operand holds two split labels of one merged group (a
// 2-D mesh's H and W both free in kornia's colour transforms `einsum("oi,...ihw->...ohw")`, both batch labels in a
// spectral layer's `einsum("bixy,ioxy->boxy")`): its reshape would gather one. The backward is einsum again
// (the gradient with the other operands, on ShardTensors, through this rule; under create_graph it is recorded as
// any einsum is).
struct LocalEinsum {
  MeshPtr mesh;
  std::vector<char> label_of_mesh_dim;         // per mesh dim: the label it splits, or 0
  std::map<char, std::vector<int64_t>> extents;  // per split label: its extents on its mesh dim
  std::map<char, int64_t> sizes;                 // every label's size
  std::vector<bool> pending;                     // per mesh dim: one operand is a pending sum over it
};

std::optional<LocalEinsum> local_einsum_plan(const EinsumEquation& eq, const std::vector<at::Tensor>& ops) {
  LocalEinsum plan;
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& in = eq.inputs[i];
    for (size_t k = 0; k < in.size(); ++k) {
      // A label twice in one operand (a diagonal) or with different sizes (a broadcast) has a backward that is not
      // an einsum of the others: ATen's path.
      if (in.find(in[k]) != k) return std::nullopt;
      const auto size = ops[i].size(static_cast<int64_t>(k));
      auto [it, fresh] = plan.sizes.emplace(in[k], size);
      if (!fresh && it->second != size) return std::nullopt;
    }
    if (const auto* impl = shard_impl(ops[i])) {
      if (plan.mesh && impl->spec()->mesh != plan.mesh) return std::nullopt;
      plan.mesh = impl->spec()->mesh;
    }
  }
  // Every label of an operand is in the output or another operand (its gradient is an einsum of the others).
  for (size_t i = 0; i < ops.size(); ++i)
    for (char c : eq.inputs[i]) {
      bool elsewhere = eq.output.find(c) != std::string::npos;
      for (size_t j = 0; j < ops.size() && !elsewhere; ++j)
        elsewhere = j != i && eq.inputs[j].find(c) != std::string::npos;
      if (!elsewhere) return std::nullopt;
    }
  if (!plan.mesh) return std::nullopt;
  plan.label_of_mesh_dim.assign(plan.mesh->ndim(), 0);
  plan.pending.assign(plan.mesh->ndim(), false);
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto* impl = shard_impl(ops[i]);
    if (!impl) continue;
    const auto& spec = *impl->spec();
    for (int64_t m = 0; m < plan.mesh->ndim(); ++m) {
      const auto& p = spec.placements[m];
      if (p.is_partial()) {
        // einsum is linear in each operand: one pending sum over a mesh dim that splits no label stays pending.
        if (plan.pending[m] || p.op != ReduceOp::Sum) return std::nullopt;
        plan.pending[m] = true;
        continue;
      }
      if (!p.is_shard()) continue;
      const char c = eq.inputs[i][p.dim];
      auto& l = plan.label_of_mesh_dim[m];
      if (l && l != c) return std::nullopt;
      l = c;
      auto [it, fresh] = plan.extents.emplace(c, spec.extents[m]);
      if (!fresh && it->second != spec.extents[m]) return std::nullopt;
    }
  }
  // One label per mesh dim, one mesh dim per label.
  std::string seen;
  for (int64_t m = 0; m < plan.mesh->ndim(); ++m) {
    const char c = plan.label_of_mesh_dim[m];
    if (!c) continue;
    if (plan.pending[m] || seen.find(c) != std::string::npos) return std::nullopt;
    seen.push_back(c);
  }
  // An operand split on a mesh dim along another label than the plan's was excluded above; one replicated there that
  // holds the label is cut to the block in the forward.
  return plan;
}

// Operand `i`'s block: its local tensor cut, along labels it holds unsplit that the plan splits, to this rank's block.
at::Tensor einsum_block(const LocalEinsum& plan, const std::string& labels, const at::Tensor& t) {
  const auto* impl = shard_impl(t);
  auto local = impl ? impl->local() : t;
  for (int64_t m = 0; m < plan.mesh->ndim(); ++m) {
    const char c = plan.label_of_mesh_dim[m];
    const auto k = c ? labels.find(c) : std::string::npos;
    if (k == std::string::npos) continue;
    if (impl && impl->spec()->placements[m].is_shard()) continue;
    const auto& e = plan.extents.at(c);
    const auto coord = plan.mesh->coordinate(m);
    int64_t off = 0;
    for (int64_t q = 0; q < coord; ++q) off += e[q];
    local = local.narrow(static_cast<int64_t>(k), off, e[coord]);
  }
  return local;
}

struct LocalEinsumFn : torch::autograd::Function<LocalEinsumFn> {
  static at::Tensor forward(AutogradContext* ctx, at::TensorList operands, const std::string& equation,
                            const std::string& output) {
    std::vector<at::Tensor> ops(operands.begin(), operands.end());
    auto eq = explicit_einsum(equation, ops);
    TORCH_INTERNAL_ASSERT(eq && eq->output == output, "einsum: the equation changed");
    auto plan = local_einsum_plan(*eq, ops);
    TORCH_INTERNAL_ASSERT(plan, "einsum: the local plan changed");
    std::vector<at::Tensor> blocks;
    std::string local_eq;
    for (size_t i = 0; i < ops.size(); ++i) {
      blocks.push_back(einsum_block(*plan, eq->inputs[i], ops[i]));
      local_eq += (i ? "," : "") + eq->inputs[i];
    }
    local_eq += "->" + eq->output;
    auto out = at::einsum(local_eq, blocks);
    Placements p(plan->mesh->ndim(), Placement::replicate());
    DimExtents ext;
    std::vector<int64_t> shape;
    for (char c : eq->output) shape.push_back(plan->sizes.at(c));
    for (int64_t m = 0; m < plan->mesh->ndim(); ++m) {
      const char c = plan->label_of_mesh_dim[m];
      if (plan->pending[m]) p[m] = Placement::partial();
      if (!c) continue;
      const auto at = eq->output.find(c);
      if (at == std::string::npos) {
        p[m] = Placement::partial();
      } else {
        p[m] = Placement::shard(static_cast<int64_t>(at));
        ext[static_cast<int64_t>(at)] = plan->extents.at(c);
      }
    }
    ctx->save_for_backward(ops);
    ctx->saved_data["inputs"] = c10::List<std::string>(eq->inputs);
    ctx->saved_data["output"] = eq->output;
    return make_shard_tensor(out, ShardSpec::make_with_dim_extents(plan->mesh, p, shape, ext));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto ops = ctx->get_saved_variables();
    const auto inputs = ctx->saved_data["inputs"].toList();
    const auto output = ctx->saved_data["output"].toStringRef();
    variable_list out(ops.size() + 2);  // the operands', then none for the two strings
    if (!grads[0].defined()) return out;
    for (size_t k = 0; k < ops.size(); ++k) {
      if (!ctx->needs_input_grad(k)) continue;
      std::string eq = output;
      std::vector<at::Tensor> args{grads[0]};
      for (size_t j = 0; j < ops.size(); ++j) {
        if (j == k) continue;
        eq += "," + inputs.get(j).toStringRef();
        args.push_back(ops[j].is_complex() ? ops[j].conj() : ops[j]);
      }
      eq += "->" + inputs.get(k).toStringRef();
      out[k] = at::einsum(eq, args);
    }
    return out;
  }
};

// The local einsum when some operand is split or pending over two or more mesh dims (a 2-D mesh: two split labels,
// or a split label and a pending sum, which ATen's path would complete or re-lay out) and the plan holds; every
// operand a ShardTensor (plain ones promoted: their gradient is reduced once).
std::optional<at::Tensor> local_einsum(const EinsumEquation& eq, at::TensorList operands) {
  bool two = false;
  MeshPtr mesh;
  for (const auto& t : operands)
    if (const auto* impl = shard_impl(t)) {
      int64_t n = 0;
      for (const auto& p : impl->spec()->placements) n += p.is_replicate() ? 0 : 1;
      two = two || n >= 2;
      mesh = impl->spec()->mesh;
    }
  if (!two) return std::nullopt;
  std::vector<at::Tensor> ops(operands.begin(), operands.end());
  // A pending sum over a mesh dim that splits no label stays pending (a spherical harmonic transform's spectrum is
  // completed later, onto latitude, by the inverse transform's FFT); other pending sums: ATen's path.
  if (!local_einsum_plan(eq, ops)) return std::nullopt;
  for (auto& t : ops) t = as_shard_input(t, mesh);
  std::string equation;
  for (size_t i = 0; i < ops.size(); ++i) equation += (i ? "," : "") + eq.inputs[i];
  equation += "->" + eq.output;
  return LocalEinsumFn::apply(at::TensorList(ops), equation, eq.output);
}

// torch.einsum on ShardTensors. ATen's decomposition permutes each pair of operands to (batch labels, free labels,
// contracted labels), in output order and then in label order, and merges each group with one reshape; a split
// label that is not the first of its group makes that reshape re-lay the operand out (an all-to-all onto the
// group's first dim: torch-harmonics' `einsum("bgckxy,gock->bgoxy")` of a latitude-split x moved the split to the
// batch). So the equation is rewritten first, the same on every rank from the layouts alone: split output labels
// go to the front of the output (the result is permuted back, a view), split contracted labels are renamed to sort
// first among the contracted ones. Each split dim then leads its merged group: a block of it, no communication, and
// the split stays on its label (a contracted one leaves a pending sum).
at::Tensor einsum_autograd(c10::string_view equation, at::TensorList operands, at::OptionalIntArrayRef path) {
  bool any_split = false;
  for (const auto& t : operands)
    if (const auto* impl = shard_impl(t))
      for (const auto& p : impl->spec()->placements) any_split = any_split || p.is_shard();
  auto parsed = any_split ? explicit_einsum(equation, operands) : std::nullopt;
  if (!parsed) return at::native::einsum(equation, operands, path);
  const auto& eq = *parsed;
  if (auto local = local_einsum(eq, operands)) return *local;
  // The split labels, by operand and mesh dim order.
  std::string split;
  for (size_t i = 0; i < operands.size(); ++i)
    if (const auto* impl = shard_impl(operands[i]))
      for (const auto& p : impl->spec()->placements)
        if (p.is_shard() && split.find(eq.inputs[i][p.dim]) == std::string::npos) split.push_back(eq.inputs[i][p.dim]);
  // Output: split labels first; the permutation back to the requested order.
  std::string out_first;
  for (char c : split)
    if (eq.output.find(c) != std::string::npos) out_first.push_back(c);
  for (char c : eq.output)
    if (out_first.find(c) == std::string::npos) out_first.push_back(c);
  // Contracted labels (in no output): the split ones take the smallest codes among them.
  std::string contracted;
  for (const auto& in : eq.inputs)
    for (char c : in)
      if (eq.output.find(c) == std::string::npos && contracted.find(c) == std::string::npos) contracted.push_back(c);
  std::string codes = contracted;
  std::sort(codes.begin(), codes.end(), [](char a, char b) { return einsum_label_code(a) < einsum_label_code(b); });
  std::string order;  // contracted labels, split ones first, the rest in label order
  for (char c : split)
    if (contracted.find(c) != std::string::npos) order.push_back(c);
  for (char c : codes)
    if (order.find(c) == std::string::npos) order.push_back(c);
  std::map<char, char> rename;
  for (size_t k = 0; k < order.size(); ++k) rename[order[k]] = codes[k];
  std::string rewritten;
  for (size_t i = 0; i < eq.inputs.size(); ++i) {
    if (i) rewritten.push_back(',');
    for (char c : eq.inputs[i]) rewritten.push_back(rename.count(c) ? rename[c] : c);
  }
  rewritten += "->" + out_first;
  auto result = at::native::einsum(rewritten, operands, path);
  if (out_first == eq.output) return result;
  std::vector<int64_t> perm;
  for (char c : eq.output) perm.push_back(static_cast<int64_t>(out_first.find(c)));
  return result.permute(perm);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(linear) {
  dispatch::set_handler("aten::mm", typed_handler(&mm_rule));
  dispatch::set_handler("aten::bmm", typed_handler(&bmm_rule));
  dispatch::set_handler("aten::addmm", typed_handler(&addmm_rule));
  dispatch::set_handler("aten::baddbmm", typed_handler(&baddbmm_rule));
  dispatch::set_handler("aten::addbmm", typed_handler(&addbmm_rule));
  dispatch::set_handler("aten::dot", typed_handler(&dot_rule));
  dispatch::set_handler("aten::vdot", typed_handler(&vdot_rule));
  dispatch::set_handler("aten::mv", typed_handler(&mv_rule));
  dispatch::set_handler("aten::addmv", typed_handler(&addmv_rule));
  dispatch::set_handler("aten::addr", typed_handler(&addr_rule));
  // Composite-implicit: their decomposition would flatten a token-sharded input (see docs/architecture.md).
  dispatch::set_handler("aten::linear", typed_handler(&linear_autograd), dispatch::RuleLevel::above_autograd);
  dispatch::set_handler("aten::matmul", typed_handler(&matmul_autograd), dispatch::RuleLevel::above_autograd);
  dispatch::set_handler("aten::einsum", typed_handler(&einsum_autograd), dispatch::RuleLevel::above_autograd);
}

} // namespace shardtensor::ops
