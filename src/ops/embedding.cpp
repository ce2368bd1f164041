// embedding: a lookup of table rows at the indices.
//
// The indices any layout, the table replicated: a local lookup laid out like the indices; its backward gives each
// rank the table gradient of its own indices, a Partial(sum) over the mesh dims that shard the indices.
// The table's embedding dim (1) sharded (a column-parallel table): each rank looks up its own columns, and the
// output is sharded on its last dim there (the indices are whole along those mesh dims); the backward gives each rank
// its own columns of the table gradient.
// The table's rows (0) sharded (a vocabulary-parallel table): the lookup is index_select of the rows (its rule: the
// owners read, or, with the indices sharded on the same mesh dim, each rank fetches only the rows it names), and with
// a gradient to take, an autograd rule composes it differentiably so the gradient rows go home through index_select's
// rule instead of a table-sized gradient on every rank (padding_idx, scale_grad_by_freq and sparse gradients
// decline there to the fallback).
#include "comm/collectives.h"
#include "dispatch/args.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include <cmath>

namespace shardtensor::ops {

namespace {

Placements table_placements(const at::Tensor& weight, const MeshPtr& mesh) {
  auto* wi = shard_impl(weight);
  return wi ? without_partial(wi->spec())->placements : Placements(mesh->ndim(), Placement::replicate());
}

bool rows_sharded(const Placements& p) {
  for (const auto& pl : p)
    if (pl.is_shard(0)) return true;
  return false;
}

// The lookup of a row-sharded table as index_select of its rows (the result: the indices' shape, then the rows').
at::Tensor lookup_rows(const at::Tensor& weight, const at::Tensor& indices) {
  auto shape = indices.sizes().vec();
  shape.push_back(weight.size(1));
  return at::index_select(weight, 0, at::reshape(indices, {-1})).reshape(shape);
}

// embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, bool sparse=False)
at::Tensor embedding_rule(const at::Tensor& weight, const at::Tensor& indices, c10::SymInt padding_idx,
                          bool scale_grad_by_freq, bool sparse) {
  auto mesh = dispatch::common_mesh("aten::embedding", {weight, indices});
  const auto wp = table_placements(weight, mesh);
  // The forward ignores padding_idx and the gradient options: a row-sharded table is index_select of its rows.
  if (rows_sharded(wp)) return lookup_rows(dispatch::as_shard(weight, mesh), indices);
  auto w_local = shard_impl(weight) ? shard_impl(resolve_partial(weight))->local() : weight;
  auto idx = resolve_partial(dispatch::as_shard(indices, mesh));
  const auto& ispec = *shard_impl(idx)->spec();
  // The indices keep their layout except along the mesh dims that shard the table's columns (read whole there).
  Placements ip = ispec.placements, op = ispec.placements;
  DimExtents iext = ispec.dim_extents(), oext;
  const auto out_last = indices.dim();
  for (size_t m = 0; m < wp.size(); ++m) {
    if (!wp[m].is_shard(1)) continue;
    if (ip[m].is_shard()) iext.erase(ip[m].dim);
    ip[m] = Placement::replicate();
    op[m] = Placement::shard(out_last);
    oext[out_last] = shard_impl(weight)->spec()->extents[m];
  }
  for (const auto& [d, e] : iext) oext[d] = e;
  auto idx_local = local_as(idx, mesh, ip, iext);
  auto out = at::embedding(w_local, idx_local, concrete_int(padding_idx), scale_grad_by_freq, sparse);
  auto shape = indices.sizes().vec();
  shape.push_back(weight.size(1));
  return wrap(out, mesh, op, shape, oext);
}

// embedding_dense_backward(Tensor grad_output, Tensor indices, SymInt num_weights, SymInt padding_idx,
//                          bool scale_grad_by_freq)
at::Tensor embedding_backward_rule(const at::Tensor& grad_output, const at::Tensor& indices_arg,
                                   c10::SymInt num_weights_arg, c10::SymInt padding_idx, bool scale) {
  auto mesh = dispatch::common_mesh("aten::embedding_dense_backward", {grad_output, indices_arg});
  auto indices = resolve_partial(dispatch::as_shard(indices_arg, mesh));
  const auto& ispec = *shard_impl(indices)->spec();
  auto grad = resolve_partial(dispatch::as_shard(grad_output, mesh));
  const auto& gspec = *shard_impl(grad)->spec();
  const auto last = grad_output.dim() - 1;
  // Mesh dims that shard the gradient's last dim are the table's column shards; the others follow the indices.
  Placements ip = ispec.placements, gp = ispec.placements, out_p(mesh->ndim(), Placement::replicate());
  DimExtents iext = ispec.dim_extents(), out_ext;
  for (size_t m = 0; m < gp.size(); ++m) {
    if (gspec.placements[m].is_shard(last)) {
      if (ip[m].is_shard()) iext.erase(ip[m].dim);
      ip[m] = Placement::replicate();
      gp[m] = Placement::shard(last);
      out_p[m] = Placement::shard(1);
      out_ext[1] = gspec.extents[m];
    } else if (ip[m].is_shard()) {
      out_p[m] = Placement::partial(ReduceOp::Sum);
    }
  }
  bool index_shards = false;
  for (const auto& p : ip) index_shards = index_shards || p.is_shard();
  if (scale && index_shards) dispatch::not_implemented("scale_grad_by_freq needs global index counts");
  auto gext = iext;
  if (out_ext.count(1)) gext[last] = out_ext[1];
  auto g = local_as(grad, mesh, gp, gext);
  auto idx_local = local_as(indices, mesh, ip, iext);
  const auto num_weights = concrete_int(num_weights_arg);
  auto out = at::embedding_dense_backward(g, idx_local, num_weights, concrete_int(padding_idx), scale);
  return wrap(out, mesh, out_p, {num_weights, grad_output.size(last)}, out_ext);
}

// The autograd rule of embedding with a row-sharded table that requires grad: index_select of the rows, composed
// differentiably, so the gradient goes through index_select's rule (each rank's gradient rows home when the indices
// are sharded on the table's mesh dim) and never builds the whole table on a rank. Declines (the op's own
// derivative) for padding_idx, scale_grad_by_freq and sparse gradients, whose semantics index_select lacks.
bool embedding_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto weight = args.tensor("weight"), indices = args.tensor("indices");
  if (!at::GradMode::is_enabled() || !shard_impl(weight) || !weight.requires_grad()) return false;
  if (!rows_sharded(table_placements(weight, shard_impl(weight)->spec()->mesh))) return false;
  if (concrete_int(args["padding_idx"].toSymInt()) >= 0 || args["scale_grad_by_freq"].toBool() ||
      args["sparse"].toBool())
    return false;
  auto out = lookup_rows(weight, indices);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

// embedding_renorm_(Tensor(a!) self, Tensor indices, float max_norm, float norm_type) -> Tensor(a!): what
// F.embedding(max_norm=) runs first, without grad: the table rows the indices name whose norm exceeds max_norm are
// scaled to it, in place. The indices are read whole (a few integers), so every rank renormalizes the same rows: a
// replicated table stays the same on every rank when the token ids are split (renormalizing each rank's own ids
// would let the copies drift apart). A table split along its rows renormalizes the rows it holds; split along its
// columns, each row's norm is completed over those mesh dims (one all-reduce of the named rows' |w|^p sums, or of
// their maxima for the infinity norm), the same rows on every rank of the reduction.
at::Tensor& embedding_renorm_rule(at::Tensor& self, const at::Tensor& indices, double max_norm, double norm_type) {
  auto mesh = dispatch::common_mesh("aten::embedding_renorm_", {self, indices});
  const auto idx = whole_value(indices).reshape({-1});
  auto* wi = shard_impl(self);
  if (!wi) {  // a plain table, the indices sharded
    at::embedding_renorm_(self, idx, max_norm, norm_type);
    return self;
  }
  const auto& spec = *wi->spec();
  for (const auto& p : spec.placements)
    if (p.is_partial())
      dispatch::not_implemented("embedding_renorm_ of a table with a pending sum (its rows' norms are not known); "
                                "complete it first (redistribute to Replicate())");
  auto local = wi->local();
  const auto row0 = spec.local_offset(0), rows = local.size(0);
  std::vector<int64_t> column_dims;
  for (int64_t m = 0; m < mesh->ndim(); ++m)
    if (spec.placements[m].is_shard(1)) column_dims.push_back(m);
  // This rank's rows among the named ones (each once, as torch takes them), as local row numbers.
  auto named = std::get<0>(at::_unique(idx, /*sorted=*/true));
  const auto mine = named.ge(row0).logical_and(named.lt(row0 + rows));
  const auto local_rows = named.masked_select(mine).sub(row0);
  const bool inf = std::isinf(norm_type);
  auto selected = local.index_select(0, local_rows);
  auto acc = selected.abs().to(at::kDouble);
  // p = 0 counts the nonzero entries (as torch's norm does); p = inf takes the largest.
  auto partial = inf ? (acc.size(1) > 0 ? acc.amax(1) : at::zeros({acc.size(0)}, acc.options()))
                     : norm_type == 0 ? acc.ne(0).to(at::kDouble).sum(1) : acc.pow(norm_type).sum(1);
  for (auto m : column_dims)
    partial = comm::all_reduce(partial, inf ? ReduceOp::Max : ReduceOp::Sum, *mesh, m);
  const auto norms = inf || norm_type == 0 ? partial : partial.pow(1.0 / norm_type);
  const auto scale = at::where(norms.gt(max_norm), max_norm / (norms + 1e-7), at::ones_like(norms));
  local.index_copy_(0, local_rows, selected.mul(scale.unsqueeze(1).to(selected.scalar_type())));
  return self;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(embedding) {
  dispatch::set_handler("aten::embedding", typed_handler(&embedding_rule));
  dispatch::set_handler("aten::embedding_dense_backward", typed_handler(&embedding_backward_rule));
  dispatch::set_autograd_handler("aten::embedding", &embedding_autograd);
  dispatch::set_handler("aten::embedding_renorm_", typed_handler(&embedding_renorm_rule));
}

} // namespace shardtensor::ops
