// Indexing by index tensors: index_select, gather, scatter (src, value, add, reduce) and index / index_put
// (`x[idx]`, `x[idx] = v`). Along dims that are not sharded they run on the local shards and the output keeps
// the input's layout. Along a sharded dim with global indices, index_select, gather and index let each rank pick
// the indices it owns (zero elsewhere) and one all-reduce over that mesh dim completes the output (Replicate there;
// the traffic is the output's size, never the input's); index_put (and its accumulate form, index's backward)
// writes on each rank the entries it owns; scatter along a sharded dim sends each element to its target's owner
// (scatter_sharded_dim). `x[mask] = value`
// with a mask laid out like x is local. Index values are checked by the local
// kernels: an out-of-range index raises on the ranks that hold it.
#include "comm/collectives.h"
#include "comm/stat_reduce.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/element_routing.h"
#include "ops/index_routed.h"
#include "comm/spec_holder.h"
#include "ops/once_differentiable.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ExpandUtils.h>
#include <shardtensor/simulation.h>
#include <torch/autograd.h>

#include <sstream>

namespace shardtensor::ops {

namespace {

Placements all_replicate(const MeshPtr& mesh) {
  return Placements(mesh->ndim(), Placement::replicate());
}

// An index argument whole on every rank (plain tensors as they are; pending sums completed).
at::Tensor whole_local(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  if (!impl) return t;
  const auto& mesh = impl->spec()->mesh;
  return local_as(t, mesh, all_replicate(mesh), {});
}

// The rows of `local` (this rank's range [off, off + ext) of `dim`) that global indices `idx` pick with `pick`;
// entries owned by other ranks are zero, so a sum over the mesh dim completes the result. `owned_view` shapes the
// ownership mask to broadcast against the picked values.
template <typename Pick>
at::Tensor pick_owned(const at::Tensor& local, const at::Tensor& idx, int64_t off, int64_t ext,
                      at::IntArrayRef out_local_shape, const std::vector<int64_t>& owned_view, Pick pick) {
  if (ext == 0 || idx.numel() == 0) return at::zeros(out_local_shape, local.options());
  auto owned = idx.ge(off).logical_and(idx.lt(off + ext));
  auto picked = pick(local, (idx - off).clamp(0, ext - 1));
  return at::where(owned.view(owned_view), picked, at::zeros({}, picked.options()));
}

// Sums owner picks over mesh dim `m` (bool values travel as bytes).
at::Tensor sum_picks(const at::Tensor& picks, const Mesh& mesh, int64_t m) {
  if (picks.scalar_type() == at::kBool) return comm::all_reduce(picks.to(at::kByte), ReduceOp::Sum, mesh, m).to(at::kBool);
  return comm::all_reduce(picks, ReduceOp::Sum, mesh, m);
}

void check_indices_in_range(const at::Tensor& idx, int64_t n, const char* op) {
  if (idx.numel() == 0) return;
  TORCH_CHECK_INDEX(idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < n, op,
                    "(): index out of range for a dim of size ", n);
}

// An index into a dim of `size` rows as global rows: long, negative entries wrapped, every entry range-checked on
// the whole index (an IndexError raised on every rank alike).
at::Tensor global_rows(const at::Tensor& index, int64_t size) {
  auto idx = index.to(at::kLong);
  idx = at::where(idx.lt(0), idx + size, idx);
  check_indices_in_range(idx, size, "index");
  return idx;
}

// The rows `rows` (global, along `dim`, which mesh dim `m` shards) of the tensor whose block is `local`, fetched
// from their owners: the requests (row, where it goes) travel to the owners and the rows come back, each by element
// routing (ops/element_routing.h: counts in one all-gather, one all-to-all each way). Traffic: the rows asked for,
// never the dim. An index out of range on any rank raises IndexError on every rank.
at::Tensor fetch_rows(const at::Tensor& local, const ShardSpec& spec, int64_t dim, int64_t m, const at::Tensor& rows) {
  const auto& mesh = *spec.mesh;
  const auto me = mesh.coordinate(m);
  const auto n_rows = spec.global_shape[dim];
  const bool invalid = rows.numel() > 0 && (rows.min().item<int64_t>() < 0 || rows.max().item<int64_t>() >= n_rows);
  const auto error = c10::str("index_select(): index out of range for a dim of size ", n_rows);
  auto safe = invalid ? rows.clamp(0, n_rows - 1) : rows;
  const auto l = dim_layout(spec, m, rows.device());
  auto owner = owner_of(l, safe);
  const auto k = rows.numel();
  auto requests = at::stack({safe, at::arange(k, safe.options()), at::full({k}, me, safe.options())}, 1);
  auto [unused, asked] =
      route_elements({}, requests, owner, mesh, m, "index_select of sharded rows (requests)", invalid, error);
  // The asked rows of this block, one per request, as [count, rest...] with `dim` first.
  auto block = local.movedim(dim, 0);
  auto found = block.index_select(0, asked.select(1, 0) - spec.offset_of(m, me));
  auto [got, where] = route_elements(found, asked.select(1, 1).unsqueeze(1), asked.select(1, 2), mesh, m,
                                     "index_select of sharded rows (replies)");
  // Written through a moved-dim view of a buffer laid out as torch's index_select lays out its result (contiguous).
  auto out_shape = local.sizes().vec();
  out_shape[dim] = k;
  auto out = at::empty(out_shape, local.options());
  out.movedim(dim, 0).index_copy_(0, where.select(1, 0), got);
  return out;
}

at::Tensor index_select_read(const at::Tensor& self, int64_t dim, const at::Tensor& index);

// Per mesh dim, self Shard(d != dim) stays; self Shard(dim) with a whole index of at least one entry per rank: a
// routed read (index_select_read, the output split along `dim`), with fewer entries each rank picks the indices it
// owns (all-reduce, Replicate); self Replicate with a sharded index gives Shard(dim) with the index's extents.
// index_select(Tensor self, int dim, Tensor index)
at::Tensor index_select_rule(const at::Tensor& self_arg, int64_t dim_arg, const at::Tensor& index) {
  const auto mesh_of_args = dispatch::common_mesh("aten::index_select", {self_arg, index});
  auto self = resolve_partial(dispatch::as_shard(self_arg, mesh_of_args));
  const auto& spec = *shard_impl(self)->spec();
  const auto& mesh = spec.mesh;
  const auto dim = wrap_dim(dim_arg, std::max<int64_t>(self.dim(), 1));
  TORCH_CHECK_INDEX(index.dim() <= 1, "index_select(): Index is supposed to be a vector");
  Placements out_p = spec.placements, idx_p = all_replicate(mesh);
  DimExtents out_ext = spec.dim_extents(), idx_ext;
  int64_t owner_m = -1;
  auto index_placements = placements_of(resolve_partial(index), mesh);
  for (size_t m = 0; m < out_p.size(); ++m) {
    if (out_p[m].is_shard() && out_p[m].dim == dim) {
      owner_m = static_cast<int64_t>(m);
      out_p[m] = Placement::replicate();
      out_ext.erase(dim);
    } else if (!out_p[m].is_shard() && index.dim() == 1 && index_placements[m].is_shard() && !out_ext.count(dim)) {
      const auto& iext = shard_impl(index)->spec()->extents[m];
      out_p[m] = Placement::shard(dim);
      out_ext[dim] = iext;
      idx_p[m] = Placement::shard(0);
      idx_ext[0] = iext;
    }
  }
  auto out_shape = self.sizes().vec();
  if (self.dim() > 0) out_shape[dim] = index.numel();
  const auto& local = shard_impl(self)->local();
  if (owner_m >= 0 && index.dim() == 1 && index_placements[owner_m].is_shard(0)) {
    // The rows sharded and the index sharded on the same mesh dim (a graph's node features read at its edges, the
    // edges split across ranks): each rank fetches the rows its part of the index names from their owners, and the
    // output is sharded like the index.
    idx_p[owner_m] = Placement::shard(0);
    idx_ext[0] = shard_impl(index)->spec()->extents[owner_m];
    out_p[owner_m] = Placement::shard(dim);
    out_ext[dim] = idx_ext[0];
    auto idx = local_as(resolve_partial(index), mesh, idx_p, idx_ext);
    return wrap(fetch_rows(local, spec, dim, owner_m, idx.reshape({-1}).to(at::kLong)), mesh, out_p, out_shape,
                out_ext);
  }
  if (owner_m >= 0 && index.dim() == 1 && !index_placements[owner_m].is_shard() &&
      index.numel() >= mesh->size(owner_m) && routed_reads_possible(local))
    return index_select_read(self, dim, whole_local(index));
  auto idx = local_as(resolve_partial(index), mesh, idx_p, idx_ext);
  at::Tensor out;
  if (owner_m < 0) {
    out = at::index_select(local, dim, idx);
  } else {
    check_indices_in_range(idx, self.size(dim), "index_select");
    auto local_shape = local.sizes().vec();
    local_shape[dim] = idx.numel();
    std::vector<int64_t> view(local.dim(), 1);
    view[dim] = idx.numel();
    const auto coord = mesh->coordinate(owner_m);
    auto picks = pick_owned(local, idx.reshape({-1}), spec.offset_of(owner_m, coord), spec.extents[owner_m][coord],
                            local_shape, view,
                            [&](const at::Tensor& l, const at::Tensor& i) { return at::index_select(l, dim, i); });
    out = sum_picks(picks, *mesh, owner_m);
  }
  return wrap(out, mesh, out_p, out_shape, out_ext);
}

// index_select_backward(grad, self_sizes, dim, index): composite in PyTorch (a dense zeros of the global size);
// here zeros in grad's layout with `dim` whole, and where grad is sharded along `dim` (a sharded index) each rank
// adds its own rows: Partial(sum) on that mesh dim.
at::Tensor index_select_backward(const at::Tensor& grad_in, c10::SymIntArrayRef sym_sizes, int64_t dim,
                                 const at::Tensor& index) {
  const auto sizes = concrete_ints(sym_sizes);
  dim = wrap_dim(dim, std::max<int64_t>(static_cast<int64_t>(sizes.size()), 1));
  auto* gi = shard_impl(grad_in);
  const auto& mesh = (gi ? gi : shard_impl(index))->spec()->mesh;
  auto grad = resolve_partial(dispatch::as_shard(grad_in, mesh));
  const auto& gspec = *shard_impl(grad)->spec();
  Placements out_p = gspec.placements, idx_p = all_replicate(mesh);
  DimExtents out_ext = gspec.dim_extents(), idx_ext;
  auto local_sizes = gspec.local_shape;
  if (!sizes.empty()) local_sizes[dim] = sizes[dim];
  for (size_t m = 0; m < out_p.size(); ++m)
    if (out_p[m].is_shard() && out_p[m].dim == dim) {
      idx_p[m] = Placement::shard(0);
      idx_ext[0] = gspec.extents[m];
      out_p[m] = Placement::partial(ReduceOp::Sum);
      out_ext.erase(dim);
    }
  auto idx = local_in(index, mesh, idx_p, idx_ext);
  const auto& g = shard_impl(grad)->local();
  auto out = at::zeros(local_sizes, g.options());
  if (g.numel() > 0) out.index_add_(dim, idx.reshape({-1}), g.dim() == 0 ? g.reshape({1}) : g);
  return wrap(out, mesh, out_p, sizes, out_ext);
}

// The routed read (ops/index_routed.h) of gather along a sharded dim with the index whole along it (`idx`: the
// index's block, aligned to self's layout on the other dims) when the index has at least one row per rank there
// and self keeps its own layout: every element of the index is an entry (its coordinates on the other dims, its
// global row along `dim`), and the output is split along `dim`. Range-checked on the whole index.
std::optional<RoutedRead> gather_read_plan(const SpecPtr& spec, const Placements& self_p, int64_t dim,
                                           const at::Tensor& idx, const at::Tensor& local) {
  if (self_p != spec->placements || idx.dim() == 0 || (local.defined() && !routed_reads_possible(local)))
    return std::nullopt;
  const auto m = spec->mesh_dim_of(dim);
  const auto n = spec->mesh->size(m);
  if (idx.size(dim) < n) return std::nullopt;
  check_indices_in_range(idx, spec->global_shape[dim], "gather");
  RoutedRead r;
  r.spec = spec;
  r.m = m;
  r.d = r.j = dim;
  r.shape = idx.sizes().vec();
  r.take = default_split(idx.size(dim), n);
  for (int64_t k = 0; k < idx.dim(); ++k) {
    if (k == dim) {
      r.idx.push_back(idx.to(at::kLong));
      continue;
    }
    std::vector<int64_t> v(idx.dim(), 1);
    v[k] = idx.size(k);
    r.idx.push_back(at::arange(idx.size(k), idx.options().dtype(at::kLong)).view(v));
  }
  return r;
}

// Per mesh dim, self Shard(d != dim) aligns the index (same size along d required); self Shard(dim): a routed read
// (gather_read_plan, the output Shard(dim)), else (fewer index rows than ranks) picks owned indices (all-reduce,
// Replicate); self Replicate with an index sharded on d gives Shard(d) (self sliced alike when d != dim).
// gather(Tensor self, int dim, Tensor index, *, bool sparse_grad=False)
at::Tensor gather_rule(const at::Tensor& self_arg, int64_t dim_arg, const at::Tensor& index_arg,
                       bool /*sparse_grad*/) {
  const auto mesh_of_args = dispatch::common_mesh("aten::gather", {self_arg, index_arg});
  auto self = resolve_partial(dispatch::as_shard(self_arg, mesh_of_args));
  const auto& spec = *shard_impl(self)->spec();
  const auto& mesh = spec.mesh;
  const auto ndim = std::max<int64_t>(self.dim(), 1);
  const auto dim = wrap_dim(dim_arg, ndim);
  auto index = resolve_partial(index_arg);
  // An empty index: torch checks nothing else and returns an empty tensor of its shape (any number of dims).
  if (index.numel() == 0) {
    const auto& local = shard_impl(self)->local();
    return make_shard_tensor(at::empty(index.sizes(), local.options()), dispatch::replicate_spec(mesh, index.sizes()));
  }
  TORCH_CHECK_VALUE(index.dim() == self.dim() || (index.dim() <= 1 && self.dim() <= 1),
                    "gather(): Index tensor must have the same number of dimensions as input tensor");
  // torch's shape check, on the global shapes before any collective (every rank alike).
  for (int64_t d = 0; d < index.dim() && index.dim() == self.dim(); ++d)
    TORCH_CHECK_VALUE(d == dim || index.size(d) <= self.size(d), "Size does not match at dimension ", d,
                      " expected index ", index.sizes(), " to be no larger than self ", self.sizes(),
                      " apart from dimension ", dim);
  const auto index_p = placements_of(index, mesh);
  // A plain index is whole on every rank: checked whole here, so every rank raises alike (each rank's block of it
  // along another split dim holds different entries: one rank's local gather would raise alone).
  if (!shard_impl(index)) check_indices_in_range(index, self.size(dim), "gather");
  Placements self_p = spec.placements, idx_p = all_replicate(mesh), out_p = all_replicate(mesh);
  DimExtents self_ext, idx_ext;
  int64_t owner_m = -1;
  for (size_t m = 0; m < self_p.size(); ++m) {
    const auto& p = spec.placements[m];
    if (p.is_shard() && p.dim == dim) {
      owner_m = static_cast<int64_t>(m);
      self_ext[dim] = spec.extents[m];
    } else if (p.is_shard()) {
      if (index.size(p.dim) != self.size(p.dim)) {
        dispatch::not_implemented("the index is smaller than the input along sharded dim " + std::to_string(p.dim) +
                                  "; redistribute that dim to Replicate() first");
      }
      self_ext[p.dim] = spec.extents[m];
      idx_p[m] = out_p[m] = p;
      idx_ext[p.dim] = spec.extents[m];
    } else if (index_p[m].is_shard()) {
      const auto d = index_p[m].dim;
      const auto& iext = shard_impl(index)->spec()->extents[m];
      if (d == dim || index.size(d) == self.size(d)) {
        idx_p[m] = out_p[m] = index_p[m];
        idx_ext[d] = iext;
        if (d != dim) {
          self_p[m] = index_p[m];
          self_ext[d] = iext;
        }
      }
    }
  }
  auto local = local_as(self, mesh, self_p, self_ext);
  auto idx = local_as(index, mesh, idx_p, idx_ext);
  at::Tensor out;
  if (owner_m < 0) {
    out = at::gather(local, dim, idx);
  } else if (auto r = gather_read_plan(shard_impl(self)->spec(), self_p, dim, idx, local)) {
    // The output split along `dim` (the default split of the index's length), each rank receiving the elements its
    // part names from their owners.
    out = routed_read(*r, local);
    out_p[owner_m] = Placement::shard(dim);
    idx_ext[dim] = r->take;
  } else {
    check_indices_in_range(idx, self.size(dim), "gather");
    const auto coord = mesh->coordinate(owner_m);
    auto picks = pick_owned(local, idx, spec.offset_of(owner_m, coord), spec.extents[owner_m][coord], idx.sizes(),
                            idx.sizes().vec(),
                            [&](const at::Tensor& l, const at::Tensor& i) { return at::gather(l, dim, i); });
    out = sum_picks(picks, *mesh, owner_m);
  }
  DimExtents out_ext;
  for (auto& p : out_p)
    if (p.is_shard()) out_ext[p.dim] = idx_ext.at(p.dim);
  return wrap(out, mesh, out_p, index.sizes().vec(), out_ext);
}

// The tensor an op writes (its `self`) as a ShardTensor on `mesh`: a plain one is Replicate and is written through
// its wrapper; a Partial one is completed first -- in place, the tensor itself becomes the completed value
// (torchvision's autocontrast writes `minimum[maximum == minimum] = 0` into a per-image min that is still a pending
// min over the split rows; its terms are not the values being indexed). Its value does not change, only how it is
// held; every rank completes alike (the spec decides). Only a tensor that shares its terms with no other (not a view,
// no views of it): a view's base would keep the old terms.
at::Tensor target_of_write(const at::Tensor& written, bool in_place, const MeshPtr& mesh) {
  auto self = dispatch::as_shard(written, mesh);
  auto* impl = shard_impl(self);
  if (!impl->spec()->has_partial()) return self;
  if (in_place && (self.is_view() || impl->local().storage().use_count() > 1))
    dispatch::not_implemented("writing into a view of a pending reduction (a Partial tensor sharing its terms with "
                              "another); complete it first (.redistribute to Replicate(), or write into the "
                              "reduction's own result)");
  auto done = resolve_partial(self);
  if (!in_place) return done;
  impl->set_local_and_spec(shard_impl(done)->local().detach(), shard_impl(done)->spec());
  return self;
}

// scatter / scatter_add / scatter_reduce along a sharded dim (a graph's edge messages summed into the nodes a rank
// owns; a write addressed by global rows): each source element goes to the rank owning its target row. The index
// (and the source, cut to the index's shape) keep a shard of `dim` on its mesh dim when they have one (the index's,
// or the source's with the index cut to it), else are read whole; on every other dim they are aligned to self's
// layout (same size along its sharded dims, as along unsharded dims). Whole, every rank takes the elements that land
// in its block (nothing travels); sharded, every rank sends each element to its target's owner (the pair counts in
// one small all-gather, the values and the flat target positions in one all-to-all each: ops/element_routing.h). Each
// rank then runs the op on its flattened block with the flat positions, so every reduction (the mean's count,
// include_self) is the op's own, in one call.
void scatter_sharded_dim(const c10::OperatorHandle& op, torch::jit::Stack* stack, const at::Tensor& written,
                         const at::Tensor& self, int64_t dim, bool in_place) {
  dispatch::NamedArgs args(op, stack);
  const auto& spec = *shard_impl(self)->spec();
  const auto& mesh = spec.mesh;
  const auto m = spec.mesh_dim_of(dim);
  auto index = args.tensor("index");
  TORCH_CHECK_VALUE(index.dim() == self.dim(), op.schema().name(),
                    ": index should have the same number of dimensions as self (", index.dim(), " vs ", self.dim(),
                    ")");
  for (const auto& p : spec.placements)
    if (p.is_shard() && p.dim != dim && index.size(p.dim) != self.size(p.dim))
      dispatch::not_implemented(op, stack, "the index is smaller than the input along sharded dim " +
                                               std::to_string(p.dim) + "; redistribute that dim to Replicate() first");
  const bool has_src = args.has("src") && args["src"].isTensor();
  at::Tensor src;
  if (has_src) {
    src = args.tensor("src");
    for (int64_t d = 0; d < src.dim(); ++d)
      if (src.size(d) != index.size(d)) src = src.narrow(d, 0, index.size(d));
  }
  // Layout of the index and source: self's on the other dims; on `m` the index's shard of `dim`, or whole.
  Placements target = spec.placements;
  DimExtents ext = spec.dim_extents();
  ext.erase(dim);
  const auto* iimpl = shard_impl(index);
  const auto* simpl = has_src ? shard_impl(src) : nullptr;
  bool routed = iimpl && iimpl->spec()->placements[m].is_shard(dim);
  if (routed) {
    ext[dim] = iimpl->spec()->extents[m];
  } else if (simpl && simpl->spec()->placements[m].is_shard(dim)) {
    // A whole index with a source split along `dim` (PyTorch Geometric's messages, one per edge and split with the
    // edges, summed into the nodes by `scatter_add_(0, edge_index[1] broadcast, messages)`): the index is cut to the
    // source's split (a local slice) and the elements routed to their rows' owners, instead of the source gathered
    // to every rank.
    routed = true;
    ext[dim] = simpl->spec()->extents[m];
  } else {
    target[m] = Placement::replicate();
  }
  auto idx = local_as(dispatch::as_shard(index, mesh), mesh, target, ext).to(at::kLong);
  at::Tensor vals;
  if (has_src) vals = local_in(src, mesh, target, ext);
  const auto n_rows = self.size(dim);
  const bool invalid = idx.numel() > 0 && (idx.min().item<int64_t>() < 0 || idx.max().item<int64_t>() >= n_rows);
  const auto error = c10::str(op.schema().name(), "(): index out of range for a dim of size ", n_rows);
  // Whole, every rank reads the same index and raises alike; sharded, the ranks agree with the counts (below).
  if (!routed) TORCH_CHECK_INDEX(!invalid, error);
  if (invalid) idx = idx.clamp(0, n_rows - 1);
  // Each element's owner and flat position in the owner's block (self's local shape with the owner's extent).
  const auto local = shard_impl(self)->local();
  const auto block = local.sizes().vec();
  const auto opts = idx.options();
  const auto l = dim_layout(spec, m, idx.device());
  auto owner = owner_of(l, idx);
  int64_t inner = 1;
  for (int64_t d = dim + 1; d < self.dim(); ++d) inner *= block[d];
  auto grid = [&](int64_t d) {
    std::vector<int64_t> shape(idx.dim(), 1);
    shape[d] = idx.size(d);
    return at::arange(idx.size(d), opts).view(shape);
  };
  // The row-major position over the dims before `dim`, and within a row (the dims after it).
  auto outer = at::zeros({}, opts), after = at::zeros({}, opts);
  for (int64_t d = 0; d < dim; ++d) outer = outer * block[d] + grid(d);
  for (int64_t d = self.dim() - 1, stride = 1; d > dim; stride *= block[d], --d) after = after + grid(d) * stride;
  auto e_owner = l.extents_t.index_select(0, owner.flatten()).view_as(owner);
  auto start_owner = l.starts_t.index_select(0, owner.flatten()).view_as(owner);
  auto flat = (outer * e_owner + (idx - start_owner)) * inner + after;
  at::Tensor pos, got;
  if (routed) {
    std::tie(got, pos) = route_elements(has_src ? vals.flatten() : at::Tensor(), flat.reshape({-1, 1}),
                                        owner.flatten(), *mesh, m, "scatter along a sharded dim (element counts)",
                                        invalid, error);
    pos = pos.select(1, 0);
  } else {
    auto mine = at::nonzero(owner.flatten() == mesh->coordinate(m)).select(1, 0);
    pos = flat.flatten().index_select(0, mine);
    if (has_src) got = vals.flatten().index_select(0, mine);
  }
  // The op on the flattened block, at the flat positions.
  auto work = local.is_contiguous() ? local : local.contiguous();
  args.set("self", work.view(-1));  // out of place, the op allocates its result; in place, it writes the block
  args.set("dim", int64_t{0});
  args.set("index", pos);
  if (has_src) args.set("src", got);
  op.callBoxed(stack);
  auto out = torch::jit::pop(*stack).toTensor().view(block);
  if (in_place) {
    if (!work.is_same(local)) local.copy_(out);
    torch::jit::push(*stack, written);
  } else {
    torch::jit::push(*stack, wrap(out, mesh, spec.placements, self.sizes().vec(), spec.dim_extents()));
  }
}

// scatter / scatter_add / scatter_reduce (out-of-place and in place; twelve overloads, with a tensor `src` or a
// scalar `value`, with or without `reduce`): self's layout; the index and the source are aligned to it (same size
// along every sharded dim required). A sharded `dim` raises. Boxed, reading arguments by name, since it re-calls
// whichever overload ran on the local tensors.
void scatter_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto& self_arg = op.schema().arguments()[0];
  const bool in_place = self_arg.alias_info() && self_arg.alias_info()->isWrite();
  const auto written = args.tensor("self");
  const auto self = target_of_write(written, in_place, dispatch::common_mesh(op, stack));
  const auto& spec = *shard_impl(self)->spec();
  const auto& mesh = spec.mesh;
  const auto dim = wrap_dim(args["dim"].toInt(), std::max<int64_t>(self.dim(), 1));
  if (spec.mesh_dim_of(dim) >= 0) return scatter_sharded_dim(op, stack, written, self, dim, in_place);
  // The tensor arguments aligned to self: the index, then the source where it is a tensor.
  std::vector<std::string_view> aligned;
  for (std::string_view name : {"index", "src"})
    if (args.has(name) && args[name].isTensor()) aligned.push_back(name);
  for (auto name : aligned) {
    const auto t = args.tensor(name);
    for (const auto& p : spec.placements)
      if (p.is_shard() && (t.dim() != self.dim() || t.size(p.dim) != self.size(p.dim))) {
        dispatch::not_implemented(op, stack,
                                  std::string(name) + " is smaller than the input along sharded dim " +
                                      std::to_string(p.dim) + "; redistribute that dim to Replicate() first");
      }
  }
  const auto ext = spec.dim_extents();
  std::vector<at::Tensor> locals;
  for (auto name : aligned) locals.push_back(local_as(args.tensor(name), mesh, spec.placements, ext));
  for (size_t k = 0; k < aligned.size(); ++k) args.set(aligned[k], locals[k]);
  args.set("self", shard_impl(self)->local());
  op.callBoxed(stack);
  auto out = torch::jit::pop(*stack).toTensor();
  torch::jit::push(*stack, in_place ? written : wrap(out, mesh, spec.placements, self.sizes().vec(), ext));
}

// `self`, the given tensors among `indices` and `values` (when defined): the tensor arguments of index and
// index_put, in schema order, for common_mesh.
std::vector<at::Tensor> index_args(const at::Tensor& self, const c10::List<std::optional<at::Tensor>>& indices,
                                   const at::Tensor& values = {}) {
  std::vector<at::Tensor> all{self};
  for (size_t k = 0; k < indices.size(); ++k) {
    const std::optional<at::Tensor> opt = indices.get(k);
    if (opt && opt->defined()) all.push_back(*opt);
  }
  if (values.defined()) all.push_back(values);
  return all;
}

// Advanced indexing `x[indices]`: the index tensors (long, whole on every rank; bool masks become their nonzero
// coordinates), the dims they index and where every other dim of x lands in the result.
struct AdvancedIndex {
  std::vector<at::Tensor> indices; // per dim of x; undefined = full slice
  std::vector<bool> indexed;       // per dim of x
  std::vector<int64_t> result_shape;
  std::vector<int64_t> dim_map;    // dim of x -> dim of the result (-1: indexed)
};

AdvancedIndex advanced_index(const at::Tensor& self, const c10::List<std::optional<at::Tensor>>& list) {
  AdvancedIndex a;
  const auto ndim = self.dim();
  a.indexed.assign(ndim, false);
  a.indices.resize(ndim);
  int64_t d = 0;
  for (size_t k = 0; k < list.size(); ++k) {
    const std::optional<at::Tensor> opt = list.get(k);
    if (!opt || !opt->defined()) {
      ++d;
      continue;
    }
    auto t = whole_local(*opt);
    if (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte) {
      TORCH_CHECK_INDEX(d + t.dim() <= ndim, "too many indices for tensor of dimension ", ndim);
      for (int64_t j = 0; j < t.dim(); ++j)
        TORCH_CHECK_INDEX(t.size(j) == self.size(d + j), "The shape of the mask ", t.sizes(), " at index ", j,
                          " does not match the shape of the indexed tensor ", self.sizes(), " at index ", d + j);
      auto nz = t.nonzero();
      for (int64_t j = 0; j < t.dim(); ++j) {
        a.indices[d] = nz.select(1, j);
        a.indexed[d++] = true;
      }
    } else {
      TORCH_CHECK_INDEX(d < ndim, "too many indices for tensor of dimension ", ndim);
      TORCH_CHECK_INDEX(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt,
                        "tensors used as indices must be long, int, byte or bool tensors");
      a.indices[d] = t;
      a.indexed[d++] = true;
    }
  }
  std::vector<at::Tensor> defined;
  int64_t first = -1, last = -1;
  for (int64_t k = 0; k < ndim; ++k)
    if (a.indexed[k]) {
      defined.push_back(a.indices[k]);
      if (first < 0) first = k;
      last = k;
    }
  std::vector<int64_t> bshape;
  for (const auto& t : defined) {
    const auto before = bshape;
    try {
      bshape = at::infer_size(bshape, t.sizes());
    } catch (const c10::Error&) {
      // torch's own error (an IndexError) for index tensors that do not broadcast together.
      std::ostringstream shapes;
      for (size_t k = 0; k < defined.size(); ++k) shapes << (k ? ", " : "") << defined[k].sizes();
      TORCH_CHECK_INDEX(false, "shape mismatch: indexing tensors could not be broadcast together with shapes ",
                        shapes.str());
    }
  }
  bool adjacent = true;
  for (int64_t k = first; k >= 0 && k <= last; ++k) adjacent = adjacent && a.indexed[k];
  a.dim_map.assign(ndim, -1);
  if (adjacent) {
    for (int64_t k = 0; k < first; ++k) {
      a.dim_map[k] = static_cast<int64_t>(a.result_shape.size());
      a.result_shape.push_back(self.size(k));
    }
    a.result_shape.insert(a.result_shape.end(), bshape.begin(), bshape.end());
    for (int64_t k = last + 1; k < ndim; ++k) {
      a.dim_map[k] = static_cast<int64_t>(a.result_shape.size());
      a.result_shape.push_back(self.size(k));
    }
  } else {
    a.result_shape = bshape;
    for (int64_t k = 0; k < ndim; ++k)
      if (!a.indexed[k]) {
        a.dim_map[k] = static_cast<int64_t>(a.result_shape.size());
        a.result_shape.push_back(self.size(k));
      }
  }
  return a;
}

c10::List<std::optional<at::Tensor>> local_index_list(const AdvancedIndex& a) {
  c10::List<std::optional<at::Tensor>> out;
  int64_t last = -1;
  for (int64_t k = 0; k < static_cast<int64_t>(a.indexed.size()); ++k)
    if (a.indexed[k]) last = k;
  for (int64_t k = 0; k <= last; ++k)
    out.push_back(a.indexed[k] ? std::optional<at::Tensor>(a.indices[k]) : std::nullopt);
  return out;
}

// The broadcast shape of the index tensors as they stand (narrowed to this rank's block where align_owned cut them).
std::vector<int64_t> index_shape(const AdvancedIndex& a) {
  std::vector<int64_t> shape;
  for (size_t k = 0; k < a.indices.size(); ++k)
    if (a.indexed[k]) shape = at::infer_size(shape, a.indices[k].sizes());
  return shape;
}

// A sharded dim that is indexed: each rank reads the entries whose index falls in its rows, the others' are zero.
struct OwnedDim {
  int64_t mesh_dim, dim, offset, extent;
};

// The result's layout: x's shards of dims that are not indexed moved to their result dims; an indexed sharded dim
// is Replicate in the result (its entries are summed from their owners over that mesh dim) and listed in `owned`.
std::pair<Placements, DimExtents> result_layout(const ShardSpec& spec, const AdvancedIndex& a,
                                                std::vector<OwnedDim>* owned) {
  Placements p = spec.placements;
  DimExtents ext;
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_shard()) continue;
    const auto d = p[m].dim;
    if (a.indexed[d]) {
      const auto mi = static_cast<int64_t>(m);
      const auto coord = spec.mesh->coordinate(mi);
      owned->push_back({mi, d, spec.offset_of(mi, coord), spec.extents[m][coord]});
      p[m] = Placement::replicate();
      continue;
    }
    p[m] = Placement::shard(a.dim_map[d]);
    ext[a.dim_map[d]] = spec.extents[m];
  }
  return {p, ext};
}

// Where the broadcast index dims sit in the result: after the dims before the first indexed one when the indexed
// dims are adjacent, else in front (numpy's rule, as advanced_index lays the result out).
int64_t index_dims_position(const AdvancedIndex& a) {
  int64_t first = -1, last = -1;
  for (int64_t k = 0; k < static_cast<int64_t>(a.indexed.size()); ++k)
    if (a.indexed[k]) {
      if (first < 0) first = k;
      last = k;
    }
  for (int64_t k = first; k <= last; ++k)
    if (!a.indexed[k]) return 0;
  return first;
}

// Turns the indices of the owned dims into this rank's local rows (negative ones wrapped, range-checked against
// the global size) and returns where this rank owns the entry (the indices' broadcast shape), or an undefined
// tensor when no indexed dim is sharded. `empty` is set when this rank holds no row of an owned dim.
at::Tensor localize_owned(AdvancedIndex& a, const std::vector<OwnedDim>& owned, at::IntArrayRef sizes, bool& empty) {
  empty = false;
  if (owned.empty()) return {};
  at::Tensor mine;
  for (const auto& o : owned) {
    const auto idx = global_rows(a.indices[o.dim], sizes[o.dim]);
    auto own = idx.ge(o.offset).logical_and(idx.lt(o.offset + o.extent));
    mine = mine.defined() ? mine.logical_and(own) : own;
    empty = empty || o.extent == 0;
    a.indices[o.dim] = (idx - o.offset).clamp(0, std::max<int64_t>(o.extent - 1, 0));
  }
  return mine.expand(index_shape(a));
}

// An indexed sharded dim whose index follows the result's own layout: a dim `bdim` of the indices' broadcast shape
// has the dim's global size and every entry at position i along it names a row of the block that owns row i (a masked
// autoencoder's `x[arange(B)[:, None], ids]` with the batch split: each rank's batch rows read from its own rows).
// The result keeps that split along `bdim` (x's extents) and nothing travels along that mesh dim.
struct AlignedDim {
  int64_t mesh_dim, dim, bdim;
};

// Finds the aligned dims among `owned` (see AlignedDim), takes them out of `owned`, narrows every index to this rank's
// block along their broadcast dims, turns their values into local rows and puts the split into the result's layout
// (`p`, `ext`). Decided from the spec and the whole index, alike on every rank; skipped where index values cannot be
// read (a trace, a simulation: `local` carries the tracer's key or the simulation runs; undefined = readable).
std::vector<AlignedDim> align_owned(const ShardSpec& spec, AdvancedIndex& a, std::vector<OwnedDim>& owned,
                                    Placements& p, DimExtents& ext, const at::Tensor& local) {
  std::vector<AlignedDim> aligned;
  if (owned.empty() || (local.defined() && !routed_reads_possible(local))) return aligned;
  const auto bshape = index_shape(a);
  const auto nb = static_cast<int64_t>(bshape.size());
  const auto pos = index_dims_position(a);
  // Every owned dim is checked on the whole index first (the same decision on every rank), then applied.
  std::vector<bool> bdim_taken(nb, false);
  std::vector<OwnedDim> rest;
  std::vector<std::pair<OwnedDim, at::Tensor>> apply;  // an aligned dim and its index's values
  for (const auto& o : owned) {
    const auto size = spec.global_shape[o.dim];
    const auto idx = global_rows(a.indices[o.dim], size);
    const auto l = dim_layout(spec, o.mesh_dim, idx.device());
    const auto value_owner = owner_of(l, idx.expand(bshape).contiguous());
    int64_t found = -1;
    for (int64_t j = 0; j < nb && found < 0; ++j) {
      if (bdim_taken[j] || bshape[j] != size) continue;
      std::vector<int64_t> along(nb, 1);
      along[j] = size;
      const auto position_owner = owner_of(l, at::arange(size, idx.options())).view(along);
      if (value_owner.eq(position_owner).all().item<bool>()) found = j;
    }
    if (found < 0) {
      rest.push_back(o);
      continue;
    }
    bdim_taken[found] = true;
    aligned.push_back({o.mesh_dim, o.dim, found});
    apply.emplace_back(o, idx - o.offset);
  }
  for (size_t i = 0; i < apply.size(); ++i) {
    const auto& [o, rows] = apply[i];
    const auto j = aligned[i].bdim;
    a.indices[o.dim] = rows;
    for (size_t k = 0; k < a.indices.size(); ++k) {
      if (!a.indexed[k]) continue;
      auto& t = a.indices[k];
      // Not where the index broadcasts along j (size 1 in a longer dim); a dim of global size 1 is narrowed too
      // (to nothing on a rank with an empty block).
      const auto td = j - (nb - t.dim());
      if (td >= 0 && t.size(td) == bshape[j]) t = t.narrow(td, o.offset, o.extent);
    }
    p[o.mesh_dim] = Placement::shard(pos + j);
    ext[pos + j] = spec.extents[o.mesh_dim];
  }
  owned = rest;
  return aligned;
}

// `mine` (the broadcast index shape) viewed to broadcast over a result of `ndim` dims.
at::Tensor mask_over_result(const at::Tensor& mine, const AdvancedIndex& a, int64_t ndim) {
  std::vector<int64_t> shape(ndim, 1);
  const auto pos = index_dims_position(a);
  for (int64_t j = 0; j < mine.dim(); ++j) shape[pos + j] = mine.size(j);
  return mine.reshape(shape);
}

// The routed read (ops/index_routed.h) of `x[indices]` when exactly one indexed dim is sharded and the index shape
// has a dim with at least one entry per rank of its mesh dim: the result is split along the largest such dim (the
// first of equals). Negative indices are wrapped and every index is range-checked here, on the whole index, so an
// IndexError is raised on every rank alike. Decided from the spec and the index's shape (the same on every rank).
std::optional<RoutedRead> index_read_plan(const SpecPtr& spec, const AdvancedIndex& a,
                                          const std::vector<OwnedDim>& owned, const at::Tensor& local,
                                          const std::vector<AlignedDim>& aligned = {}) {
  if (owned.size() != 1 || (local.defined() && !routed_reads_possible(local))) return std::nullopt;
  const auto shape = index_shape(a);
  const auto m = owned[0].mesh_dim;
  const auto n = spec->mesh->size(m);
  // The largest broadcast dim that an aligned dim does not split already (those are narrowed to this rank's block;
  // the others have their global sizes, so the choice is the same on every rank).
  int64_t j = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(shape.size()); ++i) {
    bool taken = false;
    for (const auto& al : aligned) taken = taken || al.bdim == i;
    if (!taken && (j < 0 || shape[i] > shape[j])) j = i;
  }
  if (j < 0 || shape[j] < n) return std::nullopt;
  RoutedRead r;
  r.spec = spec;
  r.m = m;
  r.d = owned[0].dim;
  r.j = j;
  r.shape = shape;
  r.take = default_split(shape[j], n);
  r.idx.resize(a.indices.size());
  for (size_t k = 0; k < a.indices.size(); ++k) {
    if (!a.indexed[k]) continue;
    // Unsharded indexed dims are whole on every rank (a sharded one would be owned).
    r.idx[k] = global_rows(a.indices[k], spec->global_shape[k]);
  }
  return r;
}

// The routed read's block [index shape..., dims not indexed...] in the result's dim order (the index dims after
// the dims before the first indexed one when the indexed dims are adjacent), and the permutation back.
std::vector<int64_t> routed_result_order(const AdvancedIndex& a, const RoutedRead& r, int64_t ndim) {
  const auto pos = index_dims_position(a);
  const auto nb = static_cast<int64_t>(r.shape.size());
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < pos; ++i) perm.push_back(nb + i);
  for (int64_t i = 0; i < nb; ++i) perm.push_back(i);
  for (int64_t i = nb + pos; i < ndim; ++i) perm.push_back(i);
  return perm;
}

// `x[indices]` by a routed read: the result split along the index's dim `j` (the default split), nothing whole.
at::Tensor index_read(const at::Tensor& self, const AdvancedIndex& a, const RoutedRead& r, Placements p,
                      DimExtents ext) {
  auto block = routed_read(r, shard_impl(self)->local());
  const auto perm = routed_result_order(a, r, block.dim());
  if (!std::is_sorted(perm.begin(), perm.end())) block = block.permute(perm).contiguous();
  const auto at_dim = index_dims_position(a) + r.j;
  p[r.m] = Placement::shard(at_dim);
  ext[at_dim] = r.take;
  return wrap(block, r.spec->mesh, p, a.result_shape, ext);
}

// index_select(self, dim, index) along a sharded dim with a whole index: `self[:, ..., index]` by a routed read.
at::Tensor index_select_read(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  c10::List<std::optional<at::Tensor>> list;
  for (int64_t k = 0; k < dim; ++k) list.push_back(std::nullopt);
  list.push_back(index.reshape({-1}));
  const auto spec = shard_impl(self)->spec();
  auto a = advanced_index(self, list);
  std::vector<OwnedDim> owned;
  auto [p, ext] = result_layout(*spec, a, &owned);
  auto r = index_read_plan(spec, a, owned, {});
  TORCH_INTERNAL_ASSERT(r, "index_select: no routed read for a whole index of ", index.numel(), " entries");
  return index_read(self, a, *r, p, ext);
}

// `x[idx]`. Along dims that are not sharded: local. An index into a sharded dim (global indices: a point cloud's
// sampled points, a masked autoencoder's kept tokens, a token selection): a routed read when the index shape has a
// dim with an entry per rank (index_read_plan: the result is split along it, each rank receives the entries its
// part names); otherwise (a few entries, two indexed sharded dims) each rank reads the entries it owns (zero
// elsewhere) and one sum over that mesh dim completes them (the result is Replicate there; the traffic is the
// result's size, never x's).
// index.Tensor(Tensor self, Tensor?[] indices)
at::Tensor index_rule(const at::Tensor& self_arg, const c10::List<std::optional<at::Tensor>>& indices) {
  const auto mesh = dispatch::common_mesh("aten::index.Tensor", index_args(self_arg, indices));
  auto self = resolve_partial(dispatch::as_shard(self_arg, mesh));
  const auto& spec = *shard_impl(self)->spec();
  auto a = advanced_index(self, indices);
  std::vector<OwnedDim> owned;
  auto [p, ext] = result_layout(spec, a, &owned);
  if (c10::multiply_integers(a.result_shape) == 0) {
    // Nothing is read (as on one device, no index is checked either): an empty result, no communication.
    const auto out_spec = ShardSpec::make_with_dim_extents(mesh, p, a.result_shape, ext);
    return make_shard_tensor(at::empty(out_spec->local_shape, shard_impl(self)->local().options()), out_spec);
  }
  const auto aligned = align_owned(spec, a, owned, p, ext, shard_impl(self)->local());
  if (auto r = index_read_plan(shard_impl(self)->spec(), a, owned, shard_impl(self)->local(), aligned))
    return index_read(self, a, *r, p, ext);
  bool empty = false;
  auto mine = localize_owned(a, owned, self.sizes(), empty);
  const auto& local = shard_impl(self)->local();
  at::Tensor out;
  if (empty) {
    out = at::zeros(ShardSpec::make_with_dim_extents(mesh, p, a.result_shape, ext)->local_shape, local.options());
  } else {
    out = at::index(local, local_index_list(a));
  }
  if (mine.defined()) {
    out = at::where(mask_over_result(mine, a, out.dim()), out, at::zeros({}, out.options()));
    for (const auto& o : owned) out = sum_picks(out, *mesh, o.mesh_dim);
  }
  return wrap(out, spec.mesh, p, a.result_shape, ext);
}

// A result whose rows (dim 0) are each rank's own selection, in rank order: Shard(0) on `mesh_dim` with every rank's
// count as its extent (agreed in one small gathered collective), nothing gathered. `what` names the op for the
// simulation's refusal (the counts are data).
at::Tensor rows_by_count(const at::Tensor& local, const MeshPtr& mesh, int64_t mesh_dim, const char* what) {
  TORCH_CHECK_NOT_IMPLEMENTED(!simulating(), what, " on a ShardTensor under simulation (shardtensor.simulate): the "
                              "result's extents are every rank's counts");
  comm::StatReduce r;
  const auto c = r.gathered(at::full({1}, local.size(0), local.options().dtype(at::kLong)));
  r.run(*mesh, {mesh_dim});
  auto counts_t = r.result(c)[0].reshape({-1}).cpu();
  std::vector<int64_t> counts(counts_t.data_ptr<int64_t>(), counts_t.data_ptr<int64_t>() + counts_t.numel());
  int64_t total = 0;
  for (auto n : counts) total += n;
  Placements p(mesh->ndim(), Placement::replicate());
  p[mesh_dim] = Placement::shard(0);
  auto shape = local.sizes().vec();
  shape[0] = total;
  return wrap(local, mesh, p, shape, {{0, counts}});
}

// The selection of a field by a mask laid out like it, split on its leading dim: each rank's selected elements are a
// block of the row-major result, in rank order, so the result stays sharded and nothing is gathered.
std::optional<at::Tensor> masked_select_blocks(const at::Tensor& self, const at::Tensor& mask) {
  auto* si = shard_impl(self);
  auto* mi = shard_impl(mask);
  if (!si || !mi || self.sizes() != mask.sizes() || !si->spec()->same_layout(*mi->spec())) return std::nullopt;
  const auto mesh_dim = leading_split(*si->spec());
  if (mesh_dim < 0) return std::nullopt;
  return rows_by_count(at::masked_select(si->local(), mi->local()), si->spec()->mesh, mesh_dim, "masked_select");
}

// nonzero(Tensor self) (argwhere, torch.where(cond) through it): the global coordinates of the nonzero elements in
// row-major order. A tensor split on its leading dim: each rank's own coordinates (its offset added) are a block of
// the result, in rank order (rows_by_count). Whole tensors: the local op. A tensor one mesh dim splits along a later
// dim is re-laid out on its leading dim first (one all-to-all); two split dims interleave the ranks' rows in
// row-major order and decline (the fallback).
at::Tensor nonzero_rule(const at::Tensor& self_arg) {
  auto self = resolve_partial(self_arg);
  const auto& spec = *shard_impl(self)->spec();
  const auto& local = shard_impl(self)->local();
  if (!spec.has_shard()) {
    auto out = at::nonzero(local);
    return wrap(out, spec.mesh, Placements(spec.mesh->ndim(), Placement::replicate()), out.sizes().vec(), {});
  }
  const auto mesh_dim = leading_split(spec);
  if (mesh_dim < 0) {
    // Split along a later dim, the ranks' rows would interleave in row-major order: re-laid out on the leading dim
    // first (prod's backward calls nonzero on `input == 0` whatever the layout); split by several mesh dims, the
    // one that splits the leading dim keeps it and the others are gathered (a mask of the leading split's rows, not
    // the whole tensor on every rank), so the result stays divided over that mesh dim.
    if (auto relaid = split_on_leading_dim(self)) return nonzero_rule(*relaid);
    if (auto relaid = one_split_on_leading_dim(self)) return nonzero_rule(*relaid);
    dispatch::not_implemented("nonzero of a tensor split by two mesh dims, not only on its leading dim (its rows would "
                              "interleave the ranks in row-major order); redistribute to Shard() of the first dim "
                              "larger than 1 on one mesh dim");
  }
  auto out = at::nonzero(local);
  const auto d = spec.placements[mesh_dim].dim;
  out.select(1, d).add_(spec.offset_of(mesh_dim, spec.mesh->coordinate(mesh_dim)));
  return rows_by_count(out, spec.mesh, mesh_dim, "nonzero");
}

// nonzero_static(Tensor self, *, SymInt size, int fill_value=-1): nonzero's first `size` rows, padded with rows of
// fill_value up to `size` (a static shape for compiled code): the nonzero rule's result cut by the slice rule, or
// padded by the padding rule (the fill rows join the last rank's block).
at::Tensor nonzero_static_rule(const at::Tensor& self, c10::SymInt size_arg, int64_t fill_value) {
  const auto size = concrete_int(size_arg);
  TORCH_CHECK_VALUE(size >= 0, "nonzero_static: 'size' must be an non-negative integer");
  auto nz = at::nonzero(self);
  const auto n = nz.size(0);
  if (n >= size) return at::slice(nz, 0, 0, size).clone();
  return at::constant_pad_nd(nz, {0, 0, 0, size - n}, fill_value);
}

// masked_select(Tensor self, Tensor mask): with a mask laid out like a field split on its leading dim, each rank
// keeps its own selection (above); otherwise `x[mask]` over the broadcast shape (the index rule: owners read their
// selected elements, in row-major order, and one all-reduce completes the 1-D result). Its backward,
// masked_select_backward, is a masked_scatter into zeros laid out like the input (position_writes.cpp).
at::Tensor masked_select_rule(const at::Tensor& self, const at::Tensor& mask) {
  TORCH_CHECK_VALUE(mask.scalar_type() == at::kBool, "masked_select: expected BoolTensor for mask");
  if (auto blocks = masked_select_blocks(self, mask)) return *blocks;
  const auto shape = at::infer_size(self.sizes(), mask.sizes());
  auto x = self.sizes().equals(shape) ? self : self.expand(shape);
  if (const auto* xi = shard_impl(x); xi && !shard_impl(mask) && !xi->spec()->has_partial()) {
    // A plain mask over a field split by two mesh dims (The Well's ReFNO picks its spectral modes from a spectrum
    // split along batch and channels on a 2x2 mesh): both indexed dims would be owned and the selection completed on
    // every rank. The leading dim's mesh dim keeps its split and the other is gathered within it, so the selection is
    // a routed read along the leading dim, divided over that mesh dim.
    if (shard_count(x) >= 2)
      if (auto relaid = one_split_on_leading_dim(x)) x = *relaid;
  }
  auto m = mask.sizes().equals(shape) ? mask : mask.expand(shape);
  c10::List<std::optional<at::Tensor>> list;
  list.push_back(std::optional<at::Tensor>(m));
  return at::index(x, list);
}

// A single bool mask over dims [d, d + mask.dim()) laid out like x there (or plain), with one value: local.
bool local_mask_put(const at::Tensor& self, const c10::List<std::optional<at::Tensor>>& list, const at::Tensor& values,
                    at::Tensor& local_mask, int64_t& mask_pos) {
  const auto& spec = *shard_impl(self)->spec();
  if (values.numel() != 1 || !spec.has_shard()) return false;
  int64_t found = -1;
  for (size_t k = 0; k < list.size(); ++k) {
    const std::optional<at::Tensor> opt = list.get(k);
    if (!opt || !opt->defined()) continue;
    if (found >= 0 || (opt->scalar_type() != at::kBool && opt->scalar_type() != at::kByte)) return false;
    found = static_cast<int64_t>(k);
  }
  if (found < 0) return false;
  const at::Tensor mask = *list.get(found);
  if (found + mask.dim() > self.dim()) return false;
  for (int64_t j = 0; j < mask.dim(); ++j)
    if (mask.size(j) != self.size(found + j)) return false;
  Placements mp = all_replicate(spec.mesh);
  DimExtents mext;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const auto& p = spec.placements[m];
    if (p.is_shard() && p.dim >= found && p.dim < found + mask.dim()) {
      mp[m] = Placement::shard(p.dim - found);
      mext[p.dim - found] = spec.extents[m];
    }
  }
  local_mask = local_as(resolve_partial(mask), spec.mesh, mp, mext);
  mask_pos = found;
  return true;
}

// index_put_ / index_put / _index_put_impl_ (`op_name`): along dims that are not sharded the values are aligned to
// the result's layout; `x[mask] = v` with a mask covering sharded dims is local. In place, `written` is updated and
// returned.
at::Tensor index_put_impl(const char* op_name, const at::Tensor& written,
                          const c10::List<std::optional<at::Tensor>>& list, const at::Tensor& values, bool accumulate,
                          bool in_place) {
  const auto self =
      target_of_write(written, in_place, dispatch::common_mesh(op_name, index_args(written, list, values)));
  // torch's check, made here on every rank (a rank that holds none of the written entries runs no local kernel).
  TORCH_CHECK(values.scalar_type() == self.scalar_type(), "Index put requires the source and destination dtypes "
              "match, got ", self.scalar_type(), " for the destination and ", values.scalar_type(), " for the source.");
  const auto& spec = *shard_impl(self)->spec();
  const auto& mesh = spec.mesh;
  at::Tensor local_values, local_mask;
  c10::List<std::optional<at::Tensor>> local_list;
  int64_t mask_pos = -1;
  bool nothing = false; // this rank holds none of the written entries
  if (local_mask_put(self, list, values, local_mask, mask_pos)) {
    for (int64_t k = 0; k < mask_pos; ++k) local_list.push_back(std::nullopt);
    local_list.push_back(local_mask);
    local_values = whole_local(values);
  } else {
    auto a = advanced_index(self, list);
    std::vector<OwnedDim> owned;
    auto [p, ext] = result_layout(spec, a, &owned);
    align_owned(spec, a, owned, p, ext, shard_impl(self)->local());
    bool empty = false;
    auto mine = localize_owned(a, owned, self.sizes(), empty);
    local_values = local_aligned(values, mesh, a.result_shape, p, ext);
    if (mine.defined()) {
      // Indices into sharded dims: each rank writes the entries it owns. The broadcast index dims are flattened
      // into one and only the owned entries kept (with their values), so an assignment never writes elsewhere.
      nothing = empty;
      const auto keep = mine.reshape({-1}).nonzero().squeeze(1);
      const auto pos = index_dims_position(a);
      const auto lshape = ShardSpec::make_with_dim_extents(mesh, p, a.result_shape, ext)->local_shape;
      std::vector<int64_t> flat(lshape.begin(), lshape.begin() + pos);
      flat.push_back(mine.numel());
      flat.insert(flat.end(), lshape.begin() + pos + mine.dim(), lshape.end());
      local_values = local_values.expand(lshape).reshape(flat).index_select(pos, keep);
      for (size_t k = 0; k < a.indices.size(); ++k)
        if (a.indexed[k]) a.indices[k] = a.indices[k].expand(mine.sizes()).reshape({-1}).index_select(0, keep);
    }
    local_list = local_index_list(a);
  }
  const auto& local = shard_impl(self)->local();
  if (in_place) {
    if (!nothing) at::_index_put_impl_(const_cast<at::Tensor&>(local), local_list, local_values, accumulate, false);
    return written;
  }
  return wrap(nothing ? local.clone() : at::index_put(local, local_list, local_values, accumulate), mesh,
              spec.placements, self.sizes().vec(), spec.dim_extents());
}

// index_put_(Tensor(a!) self, Tensor?[] indices, Tensor values, bool accumulate=False) -> Tensor(a!)
at::Tensor& index_put_inplace_rule(at::Tensor& self, const c10::List<std::optional<at::Tensor>>& indices,
                                   const at::Tensor& values, bool accumulate) {
  index_put_impl("aten::index_put_", self, indices, values, accumulate, true);
  return self;
}

// index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False) -> Tensor
at::Tensor index_put_rule(const at::Tensor& self, const c10::List<std::optional<at::Tensor>>& indices,
                          const at::Tensor& values, bool accumulate) {
  return index_put_impl("aten::index_put", self, indices, values, accumulate, false);
}

// _index_put_impl_(Tensor(a!) self, Tensor?[] indices, Tensor values, bool accumulate=False, bool unsafe=False)
//     -> Tensor(a!)
at::Tensor& index_put_impl_inplace_rule(at::Tensor& self, const c10::List<std::optional<at::Tensor>>& indices,
                                        const at::Tensor& values, bool accumulate, bool /*unsafe*/) {
  index_put_impl("aten::_index_put_impl_", self, indices, values, accumulate, true);
  return self;
}

// The autograd rules of the routed reads. Their derivative formulas would scatter the gradient into zeros built
// from the gradient with the input's size (`grad.new_zeros(self.sizes())`: Replicate along the read dim, so whole
// on every rank, and the split gradient gathered into it); these send each gradient entry home instead
// (routed_accumulate: the reverse all-to-all) and add it into zeros laid out like the input.

// The gradient laid out like the routed read's result (`out_spec`), as a plain block.
at::Tensor result_block(const at::Tensor& grad, const SpecPtr& out_spec) {
  return local_as(grad, out_spec->mesh, out_spec->placements, out_spec->dim_extents());
}

// The input's gradient: each entry of `block` (this rank's gradient of the read, in routed_read's order) sent home
// and added into zeros laid out like the input (`xspec`).
at::Tensor gradient_home(const RoutedRead& r, const at::Tensor& block, const SpecPtr& xspec) {
  auto zeros = at::zeros(xspec->local_shape, block.options());
  routed_accumulate(r, block, zeros);
  return make_shard_tensor(zeros, xspec);
}

// A read is linear in the tensor read (the index fixed): its backward is the adjoint (each gradient entry sent home),
// whose own backward is the read again.
struct IndexReadMap : LinearMap {
  SpecPtr xspec, out_spec;
  c10::List<std::optional<at::Tensor>> indices;
  IndexReadMap(SpecPtr x, SpecPtr o, c10::List<std::optional<at::Tensor>> i)
      : xspec(std::move(x)), out_spec(std::move(o)), indices(std::move(i)) {}
  at::Tensor apply(const at::Tensor& x) const override { return at::index(grad_to_spec(x, xspec), indices); }
  at::Tensor adjoint(const at::Tensor& grad) const override {
    auto a = advanced_index(at::empty(xspec->global_shape, at::TensorOptions().device(at::kMeta)), indices);
    std::vector<OwnedDim> owned;
    auto [p, ext] = result_layout(*xspec, a, &owned);
    const auto aligned = align_owned(*xspec, a, owned, p, ext, {});
    const auto r = index_read_plan(xspec, a, owned, {}, aligned);
    auto g = result_block(grad, out_spec);
    if (!r) {
      // Aligned dims read locally (and other owned dims by owner picks summed over their mesh dims, so the gradient
      // is whole there): each rank adds the gradient of the entries it owns into its own rows.
      TORCH_INTERNAL_ASSERT(!aligned.empty(), "index: the read's plan changed between forward and backward");
      bool empty = false;
      const auto mine = localize_owned(a, owned, xspec->global_shape, empty);
      if (mine.defined()) g = at::where(mask_over_result(mine, a, g.dim()), g, at::zeros({}, g.options()));
      auto zeros = at::zeros(xspec->local_shape, g.options());
      if (!empty) zeros.index_put_(local_index_list(a), g, /*accumulate=*/true);
      return make_shard_tensor(zeros, xspec);
    }
    const auto perm = routed_result_order(a, *r, g.dim());
    std::vector<int64_t> back(perm.size());
    for (size_t i = 0; i < perm.size(); ++i) back[perm[i]] = static_cast<int64_t>(i);
    return gradient_home(*r, g.permute(back), xspec);
  }
};

struct IndexReadFn : torch::autograd::Function<IndexReadFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& self,
                            const c10::List<std::optional<at::Tensor>>& indices) {
    auto out = at::index(self, indices);
    ctx->saved_data["map"] =
        map_ivalue(c10::make_intrusive<IndexReadMap>(shard_impl(self)->spec(), shard_impl(out)->spec(), indices));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_map_backward(ctx, grads, 2);
  }
};

// index.Tensor above autograd: a routed read (index_read_plan) of a ShardTensor that requires grad.
bool index_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!at::GradMode::is_enabled() || !shard_impl(self) || !self.requires_grad() ||
      shard_impl(self)->spec()->has_partial())
    return false;
  const auto list = args["indices"].to<c10::List<std::optional<at::Tensor>>>();
  c10::List<std::optional<at::Tensor>> whole;
  for (size_t k = 0; k < list.size(); ++k) {
    const std::optional<at::Tensor> opt = list.get(k);
    if (opt && opt->defined() && shard_impl(*opt) && shard_impl(*opt)->spec()->mesh != shard_impl(self)->spec()->mesh)
      return false;  // the rule names the mesh mismatch
    whole.push_back(opt && opt->defined() ? std::optional<at::Tensor>(whole_local(*opt)) : std::nullopt);
  }
  const auto spec = shard_impl(self)->spec();
  auto a = advanced_index(self, whole);
  std::vector<OwnedDim> owned;
  auto [p, ext] = result_layout(*spec, a, &owned);
  if (c10::multiply_integers(a.result_shape) == 0) return false;
  const auto& local = shard_impl(self)->local();
  const auto aligned = align_owned(*spec, a, owned, p, ext, local);
  if (aligned.empty() && !index_read_plan(spec, a, owned, local)) return false;
  auto out = IndexReadFn::apply(self, whole);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

struct GatherReadMap : LinearMap {
  SpecPtr xspec, out_spec;
  int64_t dim;
  at::Tensor index;
  GatherReadMap(SpecPtr x, SpecPtr o, int64_t d, at::Tensor i)
      : xspec(std::move(x)), out_spec(std::move(o)), dim(d), index(std::move(i)) {}
  at::Tensor apply(const at::Tensor& x) const override { return at::gather(grad_to_spec(x, xspec), dim, index); }
  at::Tensor adjoint(const at::Tensor& grad) const override {
    // The index as the forward read it: whole along `dim`, aligned to the input's shards elsewhere.
    Placements ip = xspec->placements;
    ip[xspec->mesh_dim_of(dim)] = Placement::replicate();
    auto iext = xspec->dim_extents();
    iext.erase(dim);
    const auto idx = local_as(index, xspec->mesh, ip, iext);
    const auto r = gather_read_plan(xspec, xspec->placements, dim, idx, {});
    TORCH_INTERNAL_ASSERT(r, "gather: the routed read's plan changed between forward and backward");
    return gradient_home(*r, result_block(grad, out_spec), xspec);
  }
};

struct GatherReadFn : torch::autograd::Function<GatherReadFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& self, int64_t dim,
                            const at::Tensor& index) {
    auto out = at::gather(self, dim, index);
    ctx->saved_data["map"] = map_ivalue(
        c10::make_intrusive<GatherReadMap>(shard_impl(self)->spec(), shard_impl(out)->spec(), dim, index));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_map_backward(ctx, grads, 3);
  }
};

// gather above autograd: a routed read (gather_read_plan) of a ShardTensor that requires grad, with a whole index
// (plain or replicated; a sharded index keeps aten's formula).
bool gather_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self"), index = args.tensor("index");
  if (!at::GradMode::is_enabled() || !shard_impl(self) || !self.requires_grad() || self.dim() == 0 ||
      index.dim() != self.dim() || args["sparse_grad"].toBool())
    return false;
  const auto& spec = *shard_impl(self)->spec();
  if (spec.has_partial()) return false;
  if (const auto* ii = shard_impl(index)) {
    if (ii->spec()->mesh != spec.mesh) return false;
    for (const auto& p : ii->spec()->placements)
      if (!p.is_replicate()) return false;
  }
  const auto dim = wrap_dim(args["dim"].toInt(), self.dim());
  const auto m = spec.mesh_dim_of(dim);
  if (m < 0 || index.size(dim) < spec.mesh->size(m) || !routed_reads_possible(shard_impl(self)->local())) return false;
  for (const auto& p : spec.placements)
    if (p.is_shard() && p.dim != dim && index.size(p.dim) != self.size(p.dim)) return false;
  auto out = GatherReadFn::apply(self, dim, whole_local(index));
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(indexing) {
  using dispatch::set_handler;
  // Composite-implicit: its decomposition would build a dense global-size gradient.
  set_handler("aten::index_select_backward", typed_handler(&index_select_backward),
              dispatch::RuleLevel::above_autograd);
  set_handler("aten::index_select", typed_handler(&index_select_rule));
  set_handler("aten::gather", typed_handler(&gather_rule));
  for (const char* name : {"aten::scatter.src", "aten::scatter.value", "aten::scatter.reduce",
                           "aten::scatter.value_reduce", "aten::scatter_.src", "aten::scatter_.value",
                           "aten::scatter_.reduce", "aten::scatter_.value_reduce", "aten::scatter_add",
                           "aten::scatter_add_", "aten::scatter_reduce.two", "aten::scatter_reduce_.two"})
    set_handler(name, scatter_handler);
  set_handler("aten::index.Tensor", typed_handler(&index_rule));
  dispatch::set_autograd_handler("aten::index.Tensor", &index_autograd);
  dispatch::set_autograd_handler("aten::gather", &gather_autograd);
  set_handler("aten::masked_select", typed_handler(&masked_select_rule));
  set_handler("aten::nonzero", typed_handler(&nonzero_rule));
  set_handler("aten::nonzero_static", typed_handler(&nonzero_static_rule));
  set_handler("aten::index_put_", typed_handler(&index_put_inplace_rule));
  set_handler("aten::index_put", typed_handler(&index_put_rule));
  set_handler("aten::_index_put_impl_", typed_handler(&index_put_impl_inplace_rule));
}

} // namespace shardtensor::ops
