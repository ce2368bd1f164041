// Shared helpers for handlers: building output specs and bringing arguments to a wanted layout.
#pragma once

#include "comm/redistribute.h"
#include "dispatch/args.h"
#include "dispatch/registry.h"
#include "dispatch/rule_family.h"

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <vector>

namespace shardtensor::ops {

using DimExtents = std::map<int64_t, std::vector<int64_t>>; // tensor dim -> extents along its mesh dim

// The local tensor of `t` laid out as `want` on `mesh` (extents from `ext` where given). ShardTensors are
// redistributed (collectives, the same on every rank); plain tensors are Replicate and are sliced locally.
at::Tensor local_as(const at::Tensor& t, const MeshPtr& mesh, const Placements& want, const DimExtents& ext);

// What a rule reads of an argument or an incoming gradient: `t` (a ShardTensor, or a plain tensor read as Replicate)
// with any pending sum completed, this rank's part laid out as `want` on `mesh`.
at::Tensor local_in(const at::Tensor& t, const MeshPtr& mesh, const Placements& want, const DimExtents& ext);

// The whole value of `t` on every rank, as a plain tensor: a ShardTensor gathered (and a pending sum completed) over
// its mesh; a plain tensor is itself. For small operands a rule needs whole (bin edges, lookup sets, per-channel
// parameters, index tensors read on the host).
at::Tensor whole_value(const at::Tensor& t);

// Placements of `t` on `mesh` (plain tensors: all Replicate).
Placements placements_of(const at::Tensor& t, const MeshPtr& mesh);

// Wrap an op's local output.
inline at::Tensor wrap(at::Tensor local, const MeshPtr& mesh, Placements placements, std::vector<int64_t> global,
                       const DimExtents& ext) {
  return make_shard_tensor(std::move(local),
                           ShardSpec::make_with_dim_extents(mesh, std::move(placements), std::move(global), ext));
}

// Bring every Partial placement of `t` to Replicate (an all-reduce per Partial mesh dim).
at::Tensor resolve_partial(const at::Tensor& t);

// Complete every Partial placement of `t` into a shard instead (a reduce-scatter per Partial mesh dim: (P-1)/P of the
// bytes of an all-reduce's, and 1/P of the memory): onto the largest dim not in `keep_whole`, not yet sharded, with
// an element per rank (ties: the lower dim), a spatial one (dim 2 on) first for tensors of 4 or more dims (read as
// channels-first); Replicate where no dim qualifies. For ops that need some dims whole
// (a padding's padded dims, a transform's dims) on a pending sum (FNO's channel contraction of a channel-sharded
// spectrum). Decided from the spec alone.
at::Tensor scatter_partial(const at::Tensor& t, const std::vector<int64_t>& keep_whole);

// resolve_partial, at most once per value: with `keep`, the complete value stays attached to `t` (while `t` lives
// and is not modified in place), so the backward of an op that saved `t` (a convolution's weight gradient reads its
// input) reuses it instead of issuing the all-reduce again; an attached value is used whenever present. Whether a
// value is attached depends only on the program (grad mode, requires_grad, versions), so every rank decides alike.
at::Tensor resolve_partial_once(const at::Tensor& t, bool keep);

// Normalize a possibly negative dim.
inline int64_t wrap_dim(int64_t d, int64_t ndim) {
  return at::maybe_wrap_dim(d, ndim);
}

} // namespace shardtensor::ops

namespace shardtensor::ops {
// The local tensor of `t` aligned to an output of `out_shape` laid out as `target`/`target_ext` (numpy
// broadcasting: `t`'s dims align to the trailing output dims; broadcast dims stay Replicate; a Partial target
// keeps `t`'s own Partial or asks for Replicate).
at::Tensor local_aligned(const at::Tensor& t, const MeshPtr& mesh, at::IntArrayRef out_shape, const Placements& target,
                         const DimExtents& target_ext);
} // namespace shardtensor::ops

namespace shardtensor::ops {
// Sum per-rank terms (e.g. a weight and a bias gradient) over `mesh_dims` with ONE all-reduce of their
// concatenation; returns the complete values in the same order. Undefined terms stay undefined.
std::vector<at::Tensor> fused_sum(const std::vector<at::Tensor>& terms, const std::vector<int64_t>& mesh_dims,
                                  const Mesh& mesh);

// Parameter-gradient terms (terms[i] of params[i], as the rule received them): summed over `mesh_dims` now, in one
// fused all-reduce, unless every parameter that gets a term is a promoted one whose sum the gradient buckets would
// defer (dispatch/promote.h, dispatch/grad_buckets.h); then the terms stay as they are and the caller marks them
// Partial(sum) over `mesh_dims`. Returns true when left pending. The same answer on every rank.
bool sum_param_grads(std::vector<at::Tensor>& terms, const std::vector<at::Tensor>& params,
                     const std::vector<int64_t>& mesh_dims, const Mesh& mesh);
} // namespace shardtensor::ops

namespace shardtensor::ops {
// A per-channel vector shaped to broadcast over dim 1 of a `dims`-d tensor ([1, C, 1, ...]).
inline at::Tensor channel_view(const at::Tensor& per_channel, int64_t dims) {
  std::vector<int64_t> shape(dims, 1);
  shape[1] = per_channel.numel();
  return per_channel.reshape(shape);
}

// Sum `t` over every mesh dim in `mesh_dims` (no-op when empty).
at::Tensor sum_over_mesh_dims(at::Tensor t, const std::vector<int64_t>& mesh_dims, const Mesh& mesh);
} // namespace shardtensor::ops

namespace shardtensor::ops {
// Differentiable argument preparation for handlers bound above autograd (attention, neighbourhood attention,
// point search). A plain tensor becomes Replicate (promoted when it requires grad, so its gradient is reduced
// once); a ShardTensor is kept.
at::Tensor as_shard_input(const at::Tensor& t, const MeshPtr& mesh);
// Completes pending sums (Partial -> Replicate), differentiably; no-op without Partial.
at::Tensor resolve_partial_diff(const at::Tensor& t);
// A parameter's gradient made by recorded ShardTensor ops (a backward under create_graph: linear's, batch norm's):
// completed by the differentiable full_tensor when the parameter is a plain tensor, so the gradient keeps its graph.
at::Tensor recorded_param_grad(const at::Tensor& grad, const at::Tensor& param);
// Differentiable redistribution to `placements` with extents keyed by tensor dim; `t` itself when the layout
// already matches.
at::Tensor to_layout(const at::Tensor& t, const Placements& placements, const DimExtents& extents);
// The number of mesh dims on which `t` is sharded (plain tensors: 0).
int64_t shard_count(const at::Tensor& t);
// The mesh dim that splits `spec`'s tensor on its leading dim (every dim before the sharded one of size 1; one
// sharded mesh dim, no pending sum), or -1. A row-major walk of such a tensor meets the ranks' blocks in rank order.
int64_t leading_split(const ShardSpec& spec);
// The largest dim of `sizes` at least `at_least` long that `may_take` allows (the first of equal ones), or -1: where a
// split that must leave a dim goes (split_moved_off, linalg_cross's vector dim, a pending sum's reduce-scatter).
int64_t largest_dim_for_split(at::IntArrayRef sizes, int64_t at_least, const std::function<bool(int64_t)>& may_take);
// A ShardTensor (no Partial) that one mesh dim splits along a dim after its leading one (the first of size > 1),
// re-laid out on that leading dim (default split; one all-to-all of its own size, not a gather), for ops whose result
// follows the row-major order (nonzero, unique_consecutive): each rank's part is then one block of that order.
// nullopt when two mesh dims split it or none does.
std::optional<at::Tensor> split_on_leading_dim(const at::Tensor& t);

// `t` (no Partial) split along `dim` by one mesh dim only: the mesh dim that splits `dim` keeps it -- or the first
// sharded mesh dim moves there (default split; one all-to-all) -- and every other split is gathered, for ops that need
// whole slices across `dim` (unique(dim)) or a row-major order (nonzero, unique_consecutive on the leading dim: the
// first of size > 1). Nullopt when nothing changes, nothing is split, or (leading) no dim is larger than 1.
std::optional<at::Tensor> one_split_on(const at::Tensor& t, int64_t dim);
std::optional<at::Tensor> one_split_on_leading_dim(const at::Tensor& t);
// A ShardTensor (no Partial) with the mesh dim that splits `dim` moved to the largest other dim no mesh dim splits
// and at least as large as that mesh dim (default split; one all-to-all, not a gather), for ops that need `dim` whole
// and treat the others alike (mode, channel_shuffle); `may_take`, when given, limits the dims that may take it.
// nullopt when no mesh dim splits `dim` or no dim can take it.
std::optional<at::Tensor> split_moved_off(const at::Tensor& t, int64_t dim,
                                          const std::function<bool(int64_t)>& may_take = nullptr);
// The layout split_moved_off moves to (placements and extents), for callers that re-lay out differentiably
// (to_layout, above autograd); nullopt as there.
std::optional<std::pair<Placements, DimExtents>> split_moved_layout(const ShardSpec& spec, at::IntArrayRef sizes,
                                                                    int64_t dim,
                                                                    const std::function<bool(int64_t)>& may_take = nullptr);
// `extents` (summing to `n`, a multiple of `q`) moved to the nearest multiples of `q`: each shard boundary rounds to
// the nearest multiple (ties down), so a boundary moves by at most q/2 rows and aligned extents stay as they are
// (views whose blocks must not straddle ranks, pixel_unshuffle's r x r blocks).
std::vector<int64_t> nearest_aligned(const std::vector<int64_t>& extents, int64_t n, int64_t q);
} // namespace shardtensor::ops
