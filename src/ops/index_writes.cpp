// Row writes addressed by an index along one dim: index_add(_), index_copy(_), index_reduce(_) (in place and out of
// place). `self` keeps its layout; the index is read whole (a sharded one is gathered: integers, what the
// single-device op reads too); `source` (self's shape with `dim` of the index's length) keeps its shard of `dim`
// when it has one and is aligned to self's layout on every other dim.
//
// Along an unsharded dim every rank runs the op on its own block. Along a sharded dim each source row goes to the
// rank that owns its target row: with `source` whole along the dim every rank picks the rows that land in its block
// (nothing travels); with `source` sharded along the dim (a graph's edges split across ranks, their messages
// summed into the nodes a rank owns) every rank knows, from the whole index and the layouts, which of its rows each
// rank needs and how many it receives, so one all-to-all moves exactly those rows (no counts negotiated, nothing
// gathered) and each rank writes what it received into its own rows. index_reduce combines every row a target gets
// in one call (its mean counts them together). A Partial written tensor raises (a pending sum cannot take a write).
// The family also holds the autograd rule of index_select over a sharded dim with a sharded index, whose gradient
// is such an index_add.
#include "comm/collectives.h"
#include "comm/redistribute.h"
#include "comm/spec_holder.h"
#include "dispatch/args.h"
#include "ops/common.h"
#include "ops/element_routing.h"
#include "ops/index_routed.h"
#include "ops/once_differentiable.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

// The whole value of a (small, integral) index tensor.
at::Tensor whole_index(const at::Tensor& index, const c10::Device& device) {
  auto* impl = shard_impl(index);
  if (!impl) return index.reshape({-1}).to(device, at::kLong);
  auto replicated = redistribute_to(index, dispatch::replicate_spec(impl->spec()->mesh, index.sizes()));
  return shard_impl(replicated)->local().reshape({-1}).to(device, at::kLong);
}

enum class Write { Add, Copy, Reduce };

struct IndexWrite {
  Write kind = Write::Add;
  c10::Scalar alpha = 1;
  c10::string_view reduce;
  bool include_self = true;

  // The op on local tensors, in place into `out`.
  void apply(at::Tensor& out, int64_t dim, const at::Tensor& index, const at::Tensor& rows) const {
    switch (kind) {
      case Write::Add: out.index_add_(dim, index, rows, alpha); break;
      case Write::Copy: out.index_copy_(dim, index, rows); break;
      case Write::Reduce:
        if (reduce == "prod" && at::isReducedFloatingType(out.scalar_type())) {
          // torch's half / bfloat16 prod kernel fails an internal assert on some shapes (one row of (1, 5), which a
          // rank's block can be while the whole (5, 5) runs): in float, rounded once. Only that rank would raise.
          auto wide = out.to(at::kFloat);
          wide.index_reduce_(dim, index, rows.to(at::kFloat), reduce, include_self);
          out.copy_(wide);
        } else {
          out.index_reduce_(dim, index, rows, reduce, include_self);
        }
        break;
    }
  }
};

// Rows of `t` along `dim` at `positions` (int64, t's device), moved to the front and flattened for a collective.
at::Tensor rows_flat(const at::Tensor& t, int64_t dim, const at::Tensor& positions) {
  return t.index_select(dim, positions).movedim(dim, 0).contiguous().reshape({-1});
}

// The rows that land in this rank's block, with their local target rows: [(local index, rows)], each from one rank.
using Pieces = std::vector<std::pair<at::Tensor, at::Tensor>>;

// Routes source rows to the owners of their targets along mesh dim `m` (self's dim `dim` sharded there).
Pieces route(const ShardSpec& self_spec, int64_t dim, int64_t m, const at::Tensor& index, const at::Tensor& src_local,
             const SpecPtr& src_spec, bool src_sharded) {
  const auto& mesh = *self_spec.mesh;
  const auto n = mesh.size(m), me = mesh.coordinate(m);
  std::vector<int64_t> starts(n);
  for (int64_t c = 0; c < n; ++c) starts[c] = self_spec.offset_of(m, c);
  const auto dev = index.device();
  auto starts_t = at::tensor(starts, at::TensorOptions().dtype(at::kLong)).to(dev);
  // The owner of each target row (zero-extent ranks own nothing: the last rank starting at or before the row).
  auto owner = at::searchsorted(starts_t, index, /*out_int32=*/false, /*right=*/true).sub_(1);
  const auto my_start = starts[me];
  if (!src_sharded) {
    // Every rank holds every source row: take those that land here.
    auto pos = at::nonzero(owner == me).reshape({-1});
    return {{index.index_select(0, pos) - my_start, src_local.index_select(dim, pos)}};
  }
  // Source rows [s_c, s_c + k_c) live on coordinate c.
  std::vector<int64_t> src_start(n), src_count(n);
  for (int64_t c = 0; c < n; ++c) {
    src_start[c] = src_spec->offset_of(m, c);
    src_count[c] = src_spec->extents[m][c];
  }
  auto row_sizes = src_local.sizes().vec();
  row_sizes.erase(row_sizes.begin() + dim);
  const auto row_numel = c10::multiply_integers(row_sizes);
  auto mine = owner.narrow(0, src_start[me], src_count[me]);
  std::vector<at::Tensor> send(n), recv_positions(n);
  std::vector<int64_t> recv_numels(n, 0);
  for (int64_t d = 0; d < n; ++d) {
    if (d != me) send[d] = rows_flat(src_local, dim, at::nonzero(mine == d).reshape({-1}));
    // What coordinate d sends here: its rows whose targets this rank owns, in row order.
    auto theirs = owner.narrow(0, src_start[d], src_count[d]);
    recv_positions[d] = at::nonzero(theirs == me).reshape({-1}).add_(src_start[d]);
    if (d != me) recv_numels[d] = recv_positions[d].numel() * row_numel;
  }
  send[me] = at::empty({0}, src_local.options());
  check_same_index({index}, mesh, m, "a row write by a whole index into split dim " + std::to_string(dim));
  auto received = comm::all_to_all_flat(send, recv_numels, src_local.options(), mesh, m);
  auto row_shape = src_local.movedim(dim, 0).sizes().vec();
  Pieces out;
  for (int64_t d = 0; d < n; ++d) {
    const auto count = recv_positions[d].numel();
    if (count == 0) continue;
    auto local_index = index.index_select(0, recv_positions[d]) - my_start;
    at::Tensor rows;
    if (d == me) {
      rows = src_local.index_select(dim, recv_positions[d] - src_start[me]);
    } else {
      row_shape[0] = count;
      rows = received[d].view(row_shape).movedim(0, dim);
    }
    out.emplace_back(std::move(local_index), std::move(rows));
  }
  return out;
}

// The rows of `src_local` (along `dim`) to the owners of their targets `idx` (this rank's part of an index sharded
// like the source), by element routing (ops/element_routing.h: the pair counts in one all-gather, the rows and
// targets in one all-to-all each); each rank writes what it received in one call. An index out of range on any
// rank raises IndexError on every rank.
void write_routed(at::Tensor& out, const ShardSpec& spec, int64_t dim, int64_t m, const at::Tensor& idx,
                  const at::Tensor& src_local, const IndexWrite& w, const char* op) {
  const auto n_rows = spec.global_shape[dim];
  const bool invalid = idx.numel() > 0 && (idx.min().item<int64_t>() < 0 || idx.max().item<int64_t>() >= n_rows);
  const auto error = c10::str(op, "_(): index out of range in self (a dim of size ", n_rows, ")");
  auto safe = invalid ? idx.clamp(0, n_rows - 1) : idx;
  const auto l = dim_layout(spec, m, idx.device());
  auto [rows, targets] = route_elements(src_local.movedim(dim, 0), safe.unsqueeze(1), owner_of(l, safe),
                                        *spec.mesh, m, "index_add with an index sharded like the source (counts)",
                                        invalid, error);
  const auto my_start = spec.offset_of(m, spec.mesh->coordinate(m));
  w.apply(out, dim, targets.select(1, 0) - my_start, rows.movedim(0, dim));
}

// Writes `source` into `out` (this rank's block of a tensor laid out as `spec`) at `index` along `dim`.
void write_rows(at::Tensor& out, const ShardSpec& spec, int64_t dim, const at::Tensor& index_arg,
                const at::Tensor& source, const IndexWrite& w, const char* op) {
  const auto& mesh = spec.mesh;
  // Source's layout: self's on every other dim; along `dim` its own shard on the same mesh dim, else whole.
  const auto m = spec.mesh_dim_of(dim);
  const auto* src_impl = shard_impl(source);
  const bool src_sharded =
      m >= 0 && src_impl && src_impl->spec()->placements[m].is_shard() && src_impl->spec()->placements[m].dim == dim;
  // An index sharded like the source (a graph's destination nodes split with its edges) is never read whole: each
  // rank routes its own rows by its own part of the index (write_routed).
  const auto* idx_impl = shard_impl(index_arg);
  const bool index_with_source = src_sharded && idx_impl && index_arg.dim() == 1 &&
                                 idx_impl->spec()->mesh == mesh && idx_impl->spec()->placements[m].is_shard(0) &&
                                 idx_impl->spec()->extents[m] == src_impl->spec()->extents[m];
  at::Tensor index;
  if (!index_with_source) {
    index = whole_index(index_arg, out.device());
    // The single-device op raises for targets outside the dim; every rank reads the same whole index: all raise.
    if (index.numel() > 0) {
      const auto lo = index.min().item<int64_t>(), hi = index.max().item<int64_t>();
      TORCH_CHECK_INDEX(lo >= 0 && hi < spec.global_shape[dim], op, "_(): index out of range in self (", lo, ", ",
                        hi, " for a dim of size ", spec.global_shape[dim], ")");
    }
  }
  Placements target = spec.placements;
  DimExtents ext = spec.dim_extents();
  if (m >= 0) {
    ext.erase(dim);
    if (src_sharded) ext[dim] = src_impl->spec()->extents[m];
    else target[m] = Placement::replicate();
  }
  const std::vector<int64_t> src_shape = source.sizes().vec();
  auto src_local = local_aligned(resolve_partial(source), mesh, src_shape, target, ext);
  if (m < 0) {
    w.apply(out, dim, index, src_local);
    return;
  }
  if (index_with_source) {
    Placements ip(spec.placements.size(), Placement::replicate());
    ip[m] = Placement::shard(0);
    auto idx = local_as(resolve_partial(index_arg), mesh, ip, {{0, ext.at(dim)}}).reshape({-1}).to(at::kLong);
    write_routed(out, spec, dim, m, idx, src_local, w, op);
    return;
  }
  auto src_spec = ShardSpec::make_with_dim_extents(mesh, target, src_shape, ext);
  auto pieces = route(spec, dim, m, index, src_local, src_spec, src_sharded);
  if (w.kind == Write::Reduce) {
    // One call over every row a target gets (a mean counts them together; with none, include_self=False still
    // leaves the untouched rows as they are).
    std::vector<at::Tensor> idx{index.narrow(0, 0, 0)}, rows{src_local.narrow(dim, 0, 0)};
    for (auto& [i, r] : pieces) {
      idx.push_back(i);
      rows.push_back(r);
    }
    w.apply(out, dim, at::cat(idx), at::cat(rows, dim));
  } else {
    for (auto& [i, r] : pieces) w.apply(out, dim, i, r);
  }
}

// A plain written tensor is Replicate on the source's (or the index's) mesh, its storage written in place: every
// rank writes the whole update into its own copy (the source read whole), so it stays equal on every rank, as on one
// device. Derivative formulas write into plain zeros this way (index_select's backward inside a torch.func
// transform: neuraloperator's GINO).
at::Tensor written_as_shard(const at::Tensor& self, const at::Tensor& index, const at::Tensor& source,
                            const char* op) {
  if (shard_impl(self)) return self;
  return dispatch::as_shard(self, dispatch::common_mesh(op, {index, source}));
}

const ShardSpec& written_spec(const at::Tensor& self, const char* op) {
  const auto& spec = *shard_impl(self)->spec();
  if (spec.has_partial())
    dispatch::not_implemented(std::string(op) + " writes into a Partial (pending sum) tensor; complete it first "
                              "(redistribute to Replicate())");
  return spec;
}

int64_t checked_dim(const at::Tensor& self, int64_t dim, const at::Tensor& index, const char* op) {
  if (self.dim() == 0)
    dispatch::not_implemented(std::string(op) + " into a 0-dim ShardTensor (nothing to shard): use a plain tensor");
  TORCH_CHECK_INDEX(index.dim() <= 1, op, "_(): Index is supposed to be a vector");
  TORCH_CHECK_INDEX(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt, op,
                    "_(): Expected dtype int32/int64 for index");
  return at::maybe_wrap_dim(dim, self.dim());
}

at::Tensor write_functional(const at::Tensor& self_arg, int64_t dim_arg, const at::Tensor& index,
                            const at::Tensor& source, const IndexWrite& w, const char* op) {
  const auto self = written_as_shard(self_arg, index, source, op);
  const auto& spec = written_spec(self, op);
  const auto dim = checked_dim(self, dim_arg, index, op);
  auto out = shard_impl(self)->local().clone();
  write_rows(out, spec, dim, index, source, w, op);
  return make_shard_tensor(out, shard_impl(self)->spec());
}

at::Tensor& write_inplace(at::Tensor& self, int64_t dim_arg, const at::Tensor& index, const at::Tensor& source,
                          const IndexWrite& w, const char* op) {
  const auto written = written_as_shard(self, index, source, op);  // a plain self: its own storage
  const auto& spec = written_spec(written, op);
  const auto dim = checked_dim(written, dim_arg, index, op);
  auto local = shard_impl(written)->local();
  write_rows(local, spec, dim, index, source, w, op);
  return self;
}

// index_add(Tensor self, int dim, Tensor index, Tensor source, *, Scalar alpha=1)
at::Tensor index_add_rule(const at::Tensor& self, int64_t dim, const at::Tensor& index, const at::Tensor& source,
                          const c10::Scalar& alpha) {
  return write_functional(self, dim, index, source, IndexWrite{Write::Add, alpha}, "index_add");
}
at::Tensor& index_add_inplace_rule(at::Tensor& self, int64_t dim, const at::Tensor& index, const at::Tensor& source,
                                   const c10::Scalar& alpha) {
  return write_inplace(self, dim, index, source, IndexWrite{Write::Add, alpha}, "index_add");
}

// index_copy(Tensor self, int dim, Tensor index, Tensor source)
at::Tensor index_copy_rule(const at::Tensor& self, int64_t dim, const at::Tensor& index, const at::Tensor& source) {
  return write_functional(self, dim, index, source, IndexWrite{Write::Copy}, "index_copy");
}
at::Tensor& index_copy_inplace_rule(at::Tensor& self, int64_t dim, const at::Tensor& index, const at::Tensor& source) {
  return write_inplace(self, dim, index, source, IndexWrite{Write::Copy}, "index_copy");
}

// index_reduce(Tensor self, int dim, Tensor index, Tensor source, str reduce, *, bool include_self=True)
at::Tensor index_reduce_rule(const at::Tensor& self, int64_t dim, const at::Tensor& index, const at::Tensor& source,
                             c10::string_view reduce, bool include_self) {
  return write_functional(self, dim, index, source, IndexWrite{Write::Reduce, 1, reduce, include_self},
                          "index_reduce");
}
at::Tensor& index_reduce_inplace_rule(at::Tensor& self, int64_t dim, const at::Tensor& index,
                                      const at::Tensor& source, c10::string_view reduce, bool include_self) {
  return write_inplace(self, dim, index, source, IndexWrite{Write::Reduce, 1, reduce, include_self}, "index_reduce");
}

// index_select of rows a mesh dim shards with an index sharded on the same mesh dim (indexing.cpp fetches the rows
// from their owners) or whole with an entry per rank (indexing.cpp's routed read): its derivative formula would build the gradient whole along the dim on every rank; this
// autograd rule sends each gradient row home instead — index_add into zeros laid out like the input, the rule above
// with a source sharded on the dim (one all-to-all of the gradient rows).
struct IndexSelectMap : LinearMap {
  SpecPtr spec;
  int64_t dim;
  at::Tensor index;
  IndexSelectMap(SpecPtr s, int64_t d, at::Tensor i) : spec(std::move(s)), dim(d), index(std::move(i)) {}
  at::Tensor apply(const at::Tensor& x) const override { return at::index_select(grad_to_spec(x, spec), dim, index); }
  at::Tensor adjoint(const at::Tensor& g) const override {
    auto zeros = make_shard_tensor(at::zeros(spec->local_shape, g.options()), spec);
    return zeros.index_add_(dim, index, g);
  }
};

struct IndexSelectFn : torch::autograd::Function<IndexSelectFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& self, int64_t dim,
                            const at::Tensor& index) {
    ctx->saved_data["map"] =
        map_ivalue(c10::make_intrusive<IndexSelectMap>(without_partial(shard_impl(self)->spec()), dim, index));
    return at::index_select(self, dim, index);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_map_backward(ctx, grads, 3);
  }
};

bool index_select_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self"), index = args.tensor("index");
  if (!at::GradMode::is_enabled() || !shard_impl(self) || !self.requires_grad() || self.dim() == 0 ||
      index.dim() != 1 || index.requires_grad())
    return false;
  const auto dim = at::maybe_wrap_dim(args["dim"].toInt(), self.dim());
  const auto m = shard_impl(self)->spec()->mesh_dim_of(dim);
  if (m < 0) return false;
  if (const auto* ii = shard_impl(index)) {
    if (ii->spec()->mesh != shard_impl(self)->spec()->mesh) return false;
    // A sharded index: the rows fetched by its parts. A whole one (replicated here): the routed read of
    // indexing.cpp when it has an entry per rank; either way the output is split along `dim` and the gradient rows
    // go home by index_add (its source sharded on `dim`, the index sharded alike or whole).
    if (!ii->spec()->placements[m].is_shard(0) &&
        (ii->spec()->placements[m].is_shard() || index.numel() < shard_impl(self)->spec()->mesh->size(m)))
      return false;
  } else if (index.numel() < shard_impl(self)->spec()->mesh->size(m)) {
    return false;
  }
  if (!(shard_impl(index) && shard_impl(index)->spec()->placements[m].is_shard(0)) &&
      !routed_reads_possible(shard_impl(self)->local()))
    return false;
  auto out = IndexSelectFn::apply(self, dim, index);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(index_writes) {
  dispatch::set_handler("aten::index_add", typed_handler(&index_add_rule));
  dispatch::set_handler("aten::index_add_", typed_handler(&index_add_inplace_rule));
  dispatch::set_handler("aten::index_copy", typed_handler(&index_copy_rule));
  dispatch::set_handler("aten::index_copy_", typed_handler(&index_copy_inplace_rule));
  dispatch::set_handler("aten::index_reduce", typed_handler(&index_reduce_rule));
  dispatch::set_handler("aten::index_reduce_", typed_handler(&index_reduce_inplace_rule));
  dispatch::set_autograd_handler("aten::index_select", &index_select_autograd);
}

} // namespace shardtensor::ops
