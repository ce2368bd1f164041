// Pairwise distances (torch.cdist: `_cdist_forward`, `_cdist_backward`, and `_euclidean_dist`, its matrix-product
// form for p = 2 on more than 25 rows): x1 [..., P, M] against x2 [..., R, M] gives [..., P, R]. Every pair reads
// one row of each, so a shard of x1's rows gives the output's rows, a shard of x2's rows its columns, and batch
// shards stay batch shards: each rank computes its own block, no communication (the other operand is read whole on
// that mesh dim; a point cloud sharded on both is gathered on the x2 side, the smaller of the two reads). The
// backward of x1 (`_cdist_backward`) follows the gradient's rows; the transposed call that gives x2's gradient sums
// over the sharded rows of x1: Partial(sum); with broadcast batch dims x1's gradient comes at the broadcast shape
// (autograd sums it, as on one device). A sharded feature dim M moves to that operand's rows first (a distance is
// not a sum of per-rank terms for every p; one all-to-all), and the output is split along them.
#include "ops/arg_checks.h"
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

struct PairPlan {
  Placements p1, p2, po;
  DimExtents e1, e2, eo;
};

// The layout of a pairwise op over rows of `a` ([..., P, M]) and `b` ([..., R, M]) into [..., P, R] (out_shape).
PairPlan plan_pairs(const char* op, const at::Tensor& a, const at::Tensor& b, const std::vector<int64_t>& out_shape,
                    const MeshPtr& mesh) {
  PairPlan plan;
  const auto nm = static_cast<size_t>(mesh->ndim());
  plan.p1.assign(nm, Placement::replicate());
  plan.p2.assign(nm, Placement::replicate());
  plan.po.assign(nm, Placement::replicate());
  const auto na = a.dim(), nb = b.dim(), no = static_cast<int64_t>(out_shape.size());
  auto pa = placements_of(a, mesh), pb = placements_of(b, mesh);
  for (size_t m = 0; m < nm; ++m) {
    const auto& sa = pa[m];
    const auto& sb = pb[m];
    const auto n = mesh->size(m);
    const bool a_features = sa.is_shard() && sa.dim == na - 1, b_features = sb.is_shard() && sb.dim == nb - 1;
    if (a_features || (b_features && !sa.is_shard())) {
      // A split feature dim: a distance needs every feature of a pair on one rank (it is not a sum of per-rank
      // terms for every p), so the split moves to that operand's rows (one all-to-all; the other operand is read
      // whole on this mesh dim), and the output is split along them: divided, as for split rows. Rows another mesh
      // dim splits already (one tensor dim takes one mesh dim) leave the other operand's rows, or none (this mesh
      // dim's ranks then compute the same block).
      auto rows_taken = [&](bool of_a) {
        const auto rows = (of_a ? na : nb) - 2;
        const auto& planned = of_a ? plan.p1 : plan.p2;
        const auto& given = of_a ? pa : pb;
        for (size_t j = 0; j < nm; ++j) {
          if (j == m) continue;
          if (j < m ? planned[j].is_shard() && planned[j].dim == rows
                    : given[j].is_shard() && given[j].dim == rows)
            return true;
        }
        return false;
      };
      bool onto_a = a_features;
      if (rows_taken(onto_a)) onto_a = !onto_a;
      if (!rows_taken(onto_a)) {
        const auto& t = onto_a ? a : b;
        const auto rows = t.dim() - 2;
        auto ext = default_split(t.size(rows), n);
        (onto_a ? plan.p1 : plan.p2)[m] = Placement::shard(rows);
        (onto_a ? plan.e1 : plan.e2)[rows] = ext;
        plan.po[m] = Placement::shard(onto_a ? no - 2 : no - 1);
        plan.eo[onto_a ? no - 2 : no - 1] = ext;
      }
      continue;
    }
    const auto& ea = sa.is_shard() ? shard_impl(a)->spec()->extents[m] : std::vector<int64_t>{};
    const auto& eb = sb.is_shard() && !b_features ? shard_impl(b)->spec()->extents[m] : std::vector<int64_t>{};
    if (sa.is_shard() && sa.dim == na - 2) { // a's rows -> the output's rows
      plan.p1[m] = sa;
      plan.e1[sa.dim] = ea;
      plan.po[m] = Placement::shard(no - 2);
      plan.eo[no - 2] = ea;
    } else if (sb.is_shard() && sb.dim == nb - 2) { // b's rows -> the output's columns
      plan.p2[m] = sb;
      plan.e2[sb.dim] = eb;
      plan.po[m] = Placement::shard(no - 1);
      plan.eo[no - 1] = eb;
    } else if (sa.is_shard() || (sb.is_shard() && !b_features)) { // a batch dim, aligned from the right
      const bool from_a = sa.is_shard();
      const auto d_out = (from_a ? sa.dim : sb.dim) + no - (from_a ? na : nb);
      const auto& ext = from_a ? ea : eb;
      if ((from_a ? a : b).size(from_a ? sa.dim : sb.dim) != out_shape[d_out])
        dispatch::not_implemented(std::string(op) + ": a sharded batch dim that broadcasts; redistribute it to "
                                  "Replicate() first");
      plan.po[m] = Placement::shard(d_out);
      plan.eo[d_out] = ext;
      for (auto [t, p, e, n] : {std::tuple{&a, &plan.p1, &plan.e1, na}, std::tuple{&b, &plan.p2, &plan.e2, nb}}) {
        const auto d = d_out - (no - n);
        if (d >= 0 && t->size(d) == out_shape[d_out]) {
          (*p)[m] = Placement::shard(d);
          (*e)[d] = ext;
        }
      }
    }
  }
  return plan;
}

std::vector<int64_t> pair_shape(const at::Tensor& x1, const at::Tensor& x2) {
  auto batch = at::infer_size(x1.sizes().slice(0, x1.dim() - 2), x2.sizes().slice(0, x2.dim() - 2));
  batch.push_back(x1.size(-2));
  batch.push_back(x2.size(-2));
  return batch;
}

// The forward of a pairwise kernel (`_cdist_forward`, `_euclidean_dist`): the operands brought to plan_pairs's
// layout, each rank's block of the distance matrix.
template <typename Kernel>
at::Tensor pairwise_forward(const char* op, const at::Tensor& x1_in, const at::Tensor& x2_in, Kernel kernel) {
  auto mesh = dispatch::common_mesh(op, {x1_in, x2_in});
  const auto shape = pair_shape(x1_in, x2_in);
  auto plan = plan_pairs(op, x1_in, x2_in, shape, mesh);
  auto a = local_as(resolve_partial(x1_in), mesh, plan.p1, plan.e1);
  auto b = local_as(resolve_partial(x2_in), mesh, plan.p2, plan.e2);
  return wrap(kernel(a, b), mesh, plan.po, shape, plan.eo);
}

// _cdist_forward(Tensor x1, Tensor x2, float p, int? compute_mode)
at::Tensor cdist_forward_rule(const at::Tensor& x1, const at::Tensor& x2, double p,
                              std::optional<int64_t> compute_mode) {
  check_cdist_args(x1, x2, p);
  // The matrix-product form (p = 2, mode 0) is chosen from the rows' counts: decide it from the global ones, so each
  // rank computes its block as one device would.
  auto mode = compute_mode;
  if (p == 2.0 && mode.value_or(0) == 0) mode = (x1.size(-2) > 25 || x2.size(-2) > 25) ? 1 : 2;
  return pairwise_forward("aten::_cdist_forward", x1, x2,
                          [&](const at::Tensor& a, const at::Tensor& b) { return at::_cdist_forward(a, b, p, mode); });
}

// _euclidean_dist(Tensor x1, Tensor x2): the same layout; its derivative formula runs on the rules of its parts.
at::Tensor euclidean_dist_rule(const at::Tensor& x1, const at::Tensor& x2) {
  return pairwise_forward("aten::_euclidean_dist", x1, x2,
                          [](const at::Tensor& a, const at::Tensor& b) { return at::_euclidean_dist(a, b); });
}

// _cdist_backward(Tensor grad, Tensor x1, Tensor x2, float p, Tensor cdist) -> x1's gradient [..., P, M]. The
// gradient of row i of x1 reads row i of grad and cdist and every row of x2: rows and batch shards stay shards; a
// shard of x2's rows (the grad's columns) leaves a pending sum over them.
at::Tensor cdist_backward_rule(const at::Tensor& grad_in, const at::Tensor& x1_in, const at::Tensor& x2_in, double p,
                               const at::Tensor& cdist_in) {
  auto mesh = dispatch::common_mesh("aten::_cdist_backward", {grad_in, x1_in, x2_in, cdist_in});
  auto grad = resolve_partial(dispatch::as_shard(grad_in, mesh));
  // The layout: the gradient's (the forward output's) rows, columns and batch dims; else x1's or x2's rows.
  const auto no = grad.dim();
  const auto& gp = shard_impl(grad)->spec()->placements;
  auto p1 = placements_of(x1_in, mesh), p2 = placements_of(x2_in, mesh);
  const auto nm = static_cast<size_t>(mesh->ndim());
  Placements pg(nm, Placement::replicate()), pa(nm, Placement::replicate()), pb(nm, Placement::replicate()),
      po(nm, Placement::replicate());
  DimExtents eg, ea, eb, eo;
  const auto n1 = x1_in.dim(), n2 = x2_in.dim();
  for (size_t m = 0; m < nm; ++m) {
    // A split feature dim is read whole here (the forward moved it to the rows, which the gradient's layout gives).
    int64_t d = -1; // the grad's dim that mesh dim m shards
    std::vector<int64_t> ext;
    if (gp[m].is_shard()) {
      d = gp[m].dim;
      ext = shard_impl(grad)->spec()->extents[m];
    } else if (p1[m].is_shard() && p1[m].dim < n1 - 1 && p1[m].dim + no - n1 >= 0) {
      d = p1[m].dim + no - n1;
      ext = shard_impl(x1_in)->spec()->extents[m];
    } else if (p2[m].is_shard() && p2[m].dim == n2 - 2) {
      d = no - 1;
      ext = shard_impl(x2_in)->spec()->extents[m];
    }
    if (d < 0) continue;
    pg[m] = Placement::shard(d);
    eg[d] = ext;
    if (d == no - 1) { // columns: x2's rows, summed over
      pb[m] = Placement::shard(n2 - 2);
      eb[n2 - 2] = ext;
      po[m] = Placement::partial(ReduceOp::Sum);
      continue;
    }
    // rows or a batch dim: x1 alike where it has that dim whole-sized (its dims align to the grad's from the right;
    // a broadcast dim is read whole), x2 on a batch dim it has whole-sized
    po[m] = Placement::shard(d);
    eo[d] = ext;
    const auto d1 = d - (no - n1);
    if (d1 >= 0 && x1_in.size(d1) == grad.size(d)) {
      pa[m] = Placement::shard(d1);
      ea[d1] = ext;
    }
    const auto d2 = d - (no - n2);
    if (d < no - 2 && d2 >= 0 && x2_in.size(d2) == grad.size(d)) {
      pb[m] = Placement::shard(d2);
      eb[d2] = ext;
    }
  }
  auto g = local_as(grad, mesh, pg, eg).contiguous();
  auto c = local_in(cdist_in, mesh, pg, eg).contiguous();
  auto a = local_as(resolve_partial(x1_in), mesh, pa, ea).contiguous();
  auto b = local_as(resolve_partial(x2_in), mesh, pb, eb).contiguous();
  // The kernel returns x1's gradient at the broadcast batch shape (the gradient's, with x1's rows and features):
  // autograd sums it to x1's shape, as on one device.
  auto shape = grad.sizes().vec();
  shape.back() = x1_in.size(-1);
  auto spec = ShardSpec::make_with_dim_extents(mesh, po, shape, eo);
  auto out = at::_cdist_backward(g, a, b, p, c);
  // With no pair on this rank (its block of rows or columns empty) torch returns zeros of the local x1's own shape,
  // not the broadcast one: the same zeros at the block's shape (a rank-local shape, so no rank may raise on it).
  if (out.sizes() != c10::IntArrayRef(spec->local_shape)) {
    TORCH_INTERNAL_ASSERT(g.numel() == 0 || a.numel() == 0 || b.numel() == 0,
                          "_cdist_backward: a block of shape ", out.sizes(), " for ", spec->local_shape);
    out = at::zeros(spec->local_shape, out.options());
  }
  return make_shard_tensor(out, spec);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(cdist) {
  dispatch::set_handler("aten::_cdist_forward", typed_handler(&cdist_forward_rule));
  dispatch::set_handler("aten::_cdist_backward", typed_handler(&cdist_backward_rule));
  dispatch::set_handler("aten::_euclidean_dist", typed_handler(&euclidean_dist_rule));
}

} // namespace shardtensor::ops
