// Matrix parts of the last two dims, or of any two: diagonal (and diagonal_backward), tril and triu (in place too).
//
// diagonal: the elements (i + max(0, -offset), i + max(0, offset)) of dims (dim1, dim2) as a
// new last dim. Linear, so a Partial input stays Partial.
//
// A shard of another dim stays on that dim (renumbered). A shard of dim1 (rows) or dim2 (columns) goes to the
// diagonal dim: a rank holds the diagonal elements whose row (column) it holds, which are a diagonal of its local
// block at a shifted offset, so the result is still a view of the local tensor (no communication). With both
// dims sharded (a 2-D mesh) the columns are gathered first and the result is a copy (writes into it raise).
// The backward places the gradient's diagonal shard back on the rows that hold it: a zero-filled local block per
// rank, no communication.
//
// diag_embed puts the last dim on the diagonal of two new dims (the backward of eigh, svd, det, ...): a shard of any
// other dim stays on it (renumbered), the op is local; linear, so Partial(sum) is kept. A sharded last dim (the
// entries) splits the new rows (dim1): each rank builds the zero rows of its entries with them on a shifted diagonal.
//
// tril/triu keep the elements with col - row <= k (>= k) of the last two dims: on a local block that starts at row
// a and column b that is the local tril/triu at k + a - b, for any layout (no communication; Partial kept).
#include "dispatch/write_back.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include <algorithm>

namespace shardtensor::ops {

namespace {

struct Diag {
  int64_t d1, d2, offset;
  int64_t row0() const { return std::max<int64_t>(0, -offset); }
  int64_t col0() const { return std::max<int64_t>(0, offset); }
  // The number of diagonal elements of an R x C plane.
  int64_t length(int64_t R, int64_t C) const { return std::max<int64_t>(0, std::min(R - row0(), C - col0())); }
  // The output position of input dim d (neither d1 nor d2).
  int64_t out_dim(int64_t d) const { return d - (d > d1 ? 1 : 0) - (d > d2 ? 1 : 0); }
};

Diag diag_of(int64_t ndim, int64_t offset, int64_t dim1, int64_t dim2) {
  TORCH_CHECK_VALUE(ndim >= 2, "diagonal: expected a tensor of at least 2 dims, got ", ndim);
  Diag g{wrap_dim(dim1, ndim), wrap_dim(dim2, ndim), offset};
  TORCH_CHECK_VALUE(g.d1 != g.d2, "diagonal dimensions cannot be identical ", dim1, ", ", dim2);
  return g;
}

// Diagonal elements held by a coordinate that holds rows (columns) [a, a + e) of the rotated dim whose diagonal
// index starts at `start` (row0 or col0).
int64_t diag_count(int64_t a, int64_t e, int64_t start, int64_t n) {
  return std::max<int64_t>(0, std::min(a + e, start + n) - std::max(a, start));
}

// diagonal(Tensor(a) self, int offset=0, int dim1=0, int dim2=1) -> Tensor(a)
at::Tensor diagonal_rule(const at::Tensor& self_in, int64_t offset, int64_t dim1, int64_t dim2) {
  const auto g = diag_of(self_in.dim(), offset, dim1, dim2);
  auto self = self_in;
  bool relaid = false;
  {
    const auto& spec = *shard_impl(self)->spec();
    const auto m1 = spec.mesh_dim_of(g.d1), m2 = spec.mesh_dim_of(g.d2);
    if (m1 >= 0 && m2 >= 0) {
      auto pl = spec.placements;
      auto ext = spec.dim_extents();
      pl[m2] = Placement::replicate();
      ext.erase(g.d2);
      self = redistribute_to(self, ShardSpec::make_with_dim_extents(spec.mesh, pl, spec.global_shape, ext));
      relaid = true;
    }
  }
  const auto& spec = *shard_impl(self)->spec();
  const auto& local = shard_impl(self)->local();
  const auto R = self.size(g.d1), C = self.size(g.d2);
  const auto n = g.length(R, C);
  std::vector<int64_t> shape;
  for (int64_t d = 0; d < self.dim(); ++d)
    if (d != g.d1 && d != g.d2) shape.push_back(self.size(d));
  shape.push_back(n);
  const auto last = static_cast<int64_t>(shape.size()) - 1;
  auto pl = spec.placements;
  DimExtents ext;
  auto local_offset = offset;
  for (size_t m = 0; m < pl.size(); ++m) {
    if (!pl[m].is_shard()) continue;
    const auto d = pl[m].dim;
    const auto& e = spec.extents[m];
    if (d != g.d1 && d != g.d2) {
      pl[m] = Placement::shard(g.out_dim(d));
      ext[g.out_dim(d)] = e;
      continue;
    }
    const auto start = d == g.d1 ? g.row0() : g.col0();
    std::vector<int64_t> counts;
    int64_t a = 0;
    for (auto v : e) {
      counts.push_back(diag_count(a, v, start, n));
      a += v;
    }
    const auto mine = spec.offset_of(static_cast<int64_t>(m), spec.mesh->coordinate(static_cast<int64_t>(m)));
    local_offset = d == g.d1 ? offset + mine : offset - mine;
    pl[m] = Placement::shard(last);
    ext[last] = counts;
  }
  auto out = wrap(local.diagonal(local_offset, g.d1, g.d2), spec.mesh, pl, shape, ext);
  if (relaid) dispatch::register_relaid_view(out, "aten::diagonal with both dims sharded");
  return out;
}

// diagonal_backward(Tensor grad_output, SymInt[] input_sizes, int offset, int dim1, int dim2) -> Tensor
at::Tensor diagonal_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef input_sizes, int64_t offset,
                                  int64_t dim1, int64_t dim2) {
  const auto sizes = concrete_ints(input_sizes);
  const auto nd = static_cast<int64_t>(sizes.size());
  const auto g = diag_of(nd, offset, dim1, dim2);
  const auto& spec = *shard_impl(grad_output)->spec();
  const auto& gl = shard_impl(grad_output)->local();
  const auto last = grad_output.dim() - 1;
  // Input dim of each output dim but the last.
  std::vector<int64_t> in_dim;
  for (int64_t d = 0; d < nd; ++d)
    if (d != g.d1 && d != g.d2) in_dim.push_back(d);
  auto pl = spec.placements;
  DimExtents ext;
  auto local_sizes = sizes;
  auto local_offset = offset;
  for (size_t m = 0; m < pl.size(); ++m) {
    if (!pl[m].is_shard()) continue;
    const auto d = pl[m].dim;
    const auto& e = spec.extents[m];
    const auto coord = spec.mesh->coordinate(static_cast<int64_t>(m));
    if (d != last) {
      pl[m] = Placement::shard(in_dim[d]);
      ext[in_dim[d]] = e;
      local_sizes[in_dim[d]] = e[coord];
      continue;
    }
    // The rows holding each coordinate's diagonal elements: boundaries at the rows of its first element.
    std::vector<int64_t> rows;
    int64_t k = 0, prev = 0;
    for (size_t c = 0; c + 1 < e.size(); ++c) {
      k += e[c];
      rows.push_back(k + g.row0() - prev);
      prev = k + g.row0();
    }
    rows.push_back(sizes[g.d1] - prev);
    pl[m] = Placement::shard(g.d1);
    ext[g.d1] = rows;
    local_sizes[g.d1] = rows[coord];
    int64_t a = 0;
    for (int64_t c = 0; c < coord; ++c) a += rows[c];
    local_offset = offset + a;
  }
  auto out = at::zeros(local_sizes, gl.options());
  out.diagonal(local_offset, g.d1, g.d2).copy_(gl);
  return wrap(out, spec.mesh, pl, sizes, ext);
}

// The local triangle's diagonal: shifted by where this rank's block of the last two dims starts.
int64_t local_triangle_offset(const at::Tensor& self, int64_t k) {
  TORCH_CHECK_VALUE(self.dim() >= 2, "tril/triu: input tensor must have at least 2 dimensions");
  const auto& spec = *shard_impl(self)->spec();
  int64_t a = 0, b = 0;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const auto& p = spec.placements[m];
    if (!p.is_shard()) continue;
    const auto off = spec.offset_of(static_cast<int64_t>(m), spec.mesh->coordinate(static_cast<int64_t>(m)));
    if (p.dim == self.dim() - 2) a = off;
    if (p.dim == self.dim() - 1) b = off;
  }
  return k + a - b;
}

// tril(Tensor self, SymInt diagonal=0) -> Tensor, triu likewise
template <bool Lower>
at::Tensor triangle_rule(const at::Tensor& self, c10::SymInt diagonal) {
  const auto k = local_triangle_offset(self, concrete_int(diagonal));
  const auto& x = shard_impl(self)->local();
  return make_shard_tensor(Lower ? at::tril(x, k) : at::triu(x, k), shard_impl(self)->spec());
}

// tril_(Tensor(a!) self, SymInt diagonal=0) -> Tensor(a!), triu_ likewise
template <bool Lower>
at::Tensor& triangle_inplace_rule(at::Tensor& self, c10::SymInt diagonal) {
  const auto k = local_triangle_offset(self, concrete_int(diagonal));
  auto x = shard_impl(self)->local();
  if (Lower) x.tril_(k);
  else x.triu_(k);
  return self;
}

// diagonal_copy(Tensor self, int offset=0, int dim1=0, int dim2=1) -> Tensor (torch.diag of a matrix)
at::Tensor diagonal_copy_rule(const at::Tensor& self, int64_t offset, int64_t dim1, int64_t dim2) {
  return diagonal_rule(self, offset, dim1, dim2).clone();
}

// trace(Tensor self) -> Tensor: the diagonal's sum (a Partial sum when the diagonal is sharded).
at::Tensor trace_rule(const at::Tensor& self) {
  TORCH_CHECK_VALUE(self.dim() == 2, "trace: expected a matrix, but got tensor with dim ", self.dim());
  return diagonal_rule(self, 0, 0, 1).sum();
}

// diag_embed(Tensor self, int offset=0, int dim1=-2, int dim2=-1) -> Tensor
at::Tensor diag_embed_rule(const at::Tensor& self_in, int64_t offset, int64_t dim1, int64_t dim2) {
  auto self = self_in;
  if (shard_impl(self)->spec()->has_partial()) {
    for (const auto& p : shard_impl(self)->spec()->placements)
      if (p.is_partial() && p.op != ReduceOp::Sum) self = resolve_partial(self);
  }
  const auto& spec = *shard_impl(self)->spec();
  const auto n = self.dim() + 1;
  const auto d1 = wrap_dim(dim1, n), d2 = wrap_dim(dim2, n);
  TORCH_CHECK_VALUE(d1 != d2, "diag_embed: diagonal dimensions cannot be identical ", dim1, ", ", dim2);
  // Output position of input dim d (every input dim but the last).
  std::vector<int64_t> pos;
  for (int64_t o = 0; o < n; ++o)
    if (o != d1 && o != d2) pos.push_back(o);
  Placements pl = spec.placements;
  DimExtents ext;
  const auto in_ext = spec.dim_extents();
  const auto last = self.dim() - 1;
  const auto L = self.size(last) + std::abs(offset);  // the size of the two new dims
  int64_t diag_mesh_dim = -1;
  for (size_t m = 0; m < pl.size(); ++m) {
    auto& p = pl[m];
    if (!p.is_shard()) continue;
    if (p.dim == last) {
      // The diagonal's entries split: the output's dim1 (rows) takes the split, each rank the rows of its entries
      // (the empty rows before the first entry or after the last, |offset| of them, go to the first or the last
      // rank); its local block is zeros with its entries on a diagonal shifted by its first row.
      diag_mesh_dim = static_cast<int64_t>(m);
      auto rows = in_ext.at(last);
      if (offset < 0) rows.front() += -offset;
      if (offset > 0) rows.back() += offset;
      ext[d1] = rows;
      p = Placement::shard(d1);
      continue;
    }
    ext[pos[p.dim]] = in_ext.at(p.dim);
    p = Placement::shard(pos[p.dim]);
  }
  std::vector<int64_t> shape(n);
  for (int64_t d = 0; d + 1 < self.dim(); ++d) shape[pos[d]] = self.size(d);
  shape[d1] = shape[d2] = L;
  const auto& v = shard_impl(self)->local();
  if (diag_mesh_dim < 0) return wrap(at::diag_embed(v, offset, dim1, dim2), spec.mesh, pl, shape, ext);
  const auto c = spec.mesh->coordinate(diag_mesh_dim);
  const auto& rows = ext.at(d1);
  int64_t first_row = 0;
  for (int64_t r = 0; r < c; ++r) first_row += rows[r];
  auto local_shape = shape;
  for (int64_t d = 0; d + 1 < self.dim(); ++d) local_shape[pos[d]] = v.size(d);
  local_shape[d1] = rows[c];
  local_shape[d2] = L;
  auto local = at::zeros(local_shape, v.options());
  // Global entry i sits at (row i + max(0, -offset), column i + max(0, offset)): in this block's coordinates, on the
  // diagonal at offset + first_row, whose first entry is this rank's first.
  local.diagonal(offset + first_row, d1, d2).narrow(-1, 0, v.size(-1)).copy_(v);
  return wrap(local, spec.mesh, pl, shape, ext);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(diagonal) {
  dispatch::set_handler("aten::diag_embed", typed_handler(&diag_embed_rule));
  dispatch::set_handler("aten::trace", typed_handler(&trace_rule));
  dispatch::set_handler("aten::diagonal_copy", typed_handler(&diagonal_copy_rule));
  dispatch::set_handler("aten::tril", typed_handler(&triangle_rule<true>));
  dispatch::set_handler("aten::triu", typed_handler(&triangle_rule<false>));
  dispatch::set_handler("aten::tril_", typed_handler(&triangle_inplace_rule<true>));
  dispatch::set_handler("aten::triu_", typed_handler(&triangle_inplace_rule<false>));
  dispatch::set_handler("aten::diagonal", typed_handler(&diagonal_rule));
  dispatch::set_handler("aten::diagonal_backward", typed_handler(&diagonal_backward_rule));
}

} // namespace shardtensor::ops
