// Linear algebra of batches of matrices split along their batch dims (a 3x3 covariance per point for normals or
// principal axes, a Jacobian per cell, a small system per grid point): every matrix is whole on one rank, so the
// factorizations, solves, inverses, determinants and eigen- / singular-value decompositions are local.
//
// One boxed rule for every functional linalg kernel. The "lead" argument is the ShardTensor with the most dims; its
// batch dims are all but its last two, and only batch dims may be sharded. The other arguments must have the lead's
// dims or one fewer (a batch of vectors: linalg.solve's B, pivots, tau) so their batch dims line up from the left;
// each is brought to the lead's layout along the sharded batch dims it has (a plain or replicated one is cut, a
// differently split one redistributed; a size-1 dim broadcasts as it is). Every output keeps the batch:
// its sharded dims take the lead's layout. A split matrix dim, or batch dims that do not line up, decline (the
// fallback; strict mode: NotImplementedError).
//
// `_linalg_check_errors` (how linalg.inv, cholesky, solve, ... raise on a singular or non-definite matrix) checks
// each rank's own batch after one small all-reduce of a failure flag, and when any rank found one, every rank
// checks the whole `info` (gathered, a few integers per matrix) and raises the same error with the global batch
// index — never on one rank alone.
#include "comm/collectives.h"
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

struct BatchLead {
  MeshPtr mesh;
  SpecPtr spec;     // the lead's spec (no Partial)
  int64_t dims = 0; // the lead's dim count
  std::vector<int64_t> sharded;  // the tensor dims its placements shard
};

void batched_local_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  // Pending sums are completed first (the kernels are not linear).
  for (auto it = first; it != stack->end(); ++it)
    if (it->isTensor() && shard_impl(it->toTensor()) && shard_impl(it->toTensor())->spec()->has_partial())
      *it = resolve_partial(it->toTensor());
  BatchLead lead;
  for (auto it = first; it != stack->end(); ++it) {
    if (!it->isTensor()) continue;
    const auto& t = it->toTensor();
    if (shard_impl(t) && t.dim() > lead.dims) {
      lead.spec = shard_impl(t)->spec();
      lead.dims = t.dim();
    }
  }
  TORCH_INTERNAL_ASSERT(lead.spec, dispatch::qualified_name(op), ": no ShardTensor argument");
  lead.mesh = lead.spec->mesh;
  for (const auto& p : lead.spec->placements)
    if (p.is_shard()) {
      if (p.dim >= lead.dims - 2)
        dispatch::not_implemented(op, stack, "a matrix dim (one of the last two) is sharded; only batch dims may be "
                                             "split (redistribute the matrix dims to Replicate())");
      lead.sharded.push_back(p.dim);
    }
  const auto& gshape = lead.spec->global_shape;
  const auto ext = lead.spec->dim_extents();
  // Every other tensor argument: laid out like the lead along the sharded batch dims it has (a size-1 dim
  // broadcasts as it is). Checked for all before any is replaced, so a refusal names the arguments as given.
  std::vector<std::pair<c10::IValue*, Placements>> wanted;
  for (auto it = first; it != stack->end(); ++it) {
    if (!it->isTensor() || !it->toTensor().defined()) continue;
    const auto& t = it->toTensor();
    const bool lines_up = t.dim() == lead.dims || t.dim() == lead.dims - 1;
    Placements pl(lead.mesh->ndim(), Placement::replicate());
    for (size_t m = 0; m < lead.spec->placements.size(); ++m) {
      const auto& p = lead.spec->placements[m];
      if (!p.is_shard() || p.dim >= t.dim() || t.size(p.dim) == 1) continue;
      if (!lines_up || t.size(p.dim) != gshape[p.dim])
        dispatch::not_implemented(op, stack, "an argument's batch dims do not line up with the sharded batch dims "
                                             "of the others (redistribute its batch dims to Replicate())");
      pl[m] = p;
    }
    wanted.emplace_back(&*it, std::move(pl));
  }
  for (auto& [slot, pl] : wanted) {
    const auto t = slot->toTensor();
    DimExtents e;
    for (const auto& p : pl)
      if (p.is_shard()) e[p.dim] = ext.at(p.dim);
    *slot = local_as(t, lead.mesh, pl, e);
  }
  op.callBoxed(stack);
  const auto nret = op.schema().returns().size();
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(nret); it != stack->end(); ++it) {
    if (!it->isTensor()) continue;
    const auto local = it->toTensor();
    auto shape = local.sizes().vec();
    Placements pl(lead.mesh->ndim(), Placement::replicate());
    DimExtents e;
    for (size_t m = 0; m < lead.spec->placements.size(); ++m) {
      const auto& p = lead.spec->placements[m];
      if (!p.is_shard()) continue;
      // Outputs keep the batch in front; an empty output without it (lstsq's residuals when not computed) is whole.
      if (p.dim < local.dim() && local.size(p.dim) == lead.spec->local_shape[p.dim]) {
        pl[m] = p;
        e[p.dim] = ext.at(p.dim);
        shape[p.dim] = gshape[p.dim];
      } else if (local.numel() != 0) {
        TORCH_INTERNAL_ASSERT(false, dispatch::qualified_name(op), ": an output without the batch dims");
      }
    }
    *it = wrap(local, lead.mesh, pl, shape, e);
  }
}

// _linalg_check_errors(Tensor info, str api_name, *, bool is_matrix) -> ()
void check_errors_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  auto info = args.tensor("info");
  const auto api = args["api_name"].toStringRef();
  const auto is_matrix = args["is_matrix"].toBool();
  auto* impl = shard_impl(info);
  const auto spec = impl->spec();
  const auto& mesh = spec->mesh;
  auto local = impl->local();
  // One flag per rank, the maximum over every mesh dim (each rank issues the same all-reduces).
  auto flag = at::full({1}, local.numel() > 0 && local.ne(0).any().item<bool>() ? 1 : 0,
                       local.options().dtype(at::kLong));
  for (int64_t m = 0; m < mesh->ndim(); ++m) flag = comm::all_reduce(flag, ReduceOp::Max, *mesh, m);
  if (flag.item<int64_t>() != 0) {
    auto whole = redistribute_to(info, ShardSpec::make(mesh, Placements(mesh->ndim(), Placement::replicate()),
                                                       spec->global_shape));
    at::_linalg_check_errors(shard_impl(whole)->local(), api, is_matrix);
    TORCH_INTERNAL_ASSERT(false, api, ": a rank's batch failed but the gathered info shows no failure");
  }
  torch::jit::drop(*stack, args.all().size());
}

} // namespace

SHARDTENSOR_RULE_FAMILY(linalg_batched) {
  for (const char* name :
       {"aten::linalg_inv_ex", "aten::linalg_cholesky_ex", "aten::cholesky", "aten::_linalg_eigh", "aten::linalg_eig",
        "aten::_linalg_eigvals", "aten::_linalg_svd", "aten::_linalg_det", "aten::_linalg_slogdet",
        "aten::linalg_lu_factor_ex", "aten::linalg_lu", "aten::linalg_lu_solve", "aten::_linalg_solve_ex",
        "aten::linalg_solve_triangular", "aten::triangular_solve", "aten::linalg_qr", "aten::geqrf", "aten::ormqr",
        "aten::linalg_householder_product", "aten::linalg_ldl_factor_ex", "aten::linalg_ldl_solve",
        "aten::linalg_lstsq", "aten::cholesky_solve", "aten::_cholesky_solve_helper", "aten::cholesky_inverse",
        "aten::linalg_matrix_exp", "aten::lu_unpack", "aten::linalg_pinv.atol_rtol_tensor"})
    dispatch::set_handler(name, &batched_local_handler);
  dispatch::set_handler("aten::_linalg_check_errors", &check_errors_handler);
}

} // namespace shardtensor::ops
