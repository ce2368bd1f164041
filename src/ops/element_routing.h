// Moving single elements to the rank that owns their target position along a sharded dim: what a distributed sort
// (sort_sharded.cpp) and a scatter into a sharded dim (indexing.cpp) do with data-dependent destinations.
#pragma once

#include <shardtensor/mesh.h>
#include <shardtensor/spec.h>

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace shardtensor::ops {

// The starts and extents of the coordinates of mesh dim `m` along the dim it shards, on `device`.
struct DimLayout {
  std::vector<int64_t> starts;
  at::Tensor starts_t, extents_t;
};
DimLayout dim_layout(const ShardSpec& spec, int64_t m, const c10::Device& device);

// The coordinate owning each global row in `rows` (zero-extent coordinates own nothing).
at::Tensor owner_of(const DimLayout& l, const at::Tensor& rows);

// Moves element i (its value, when `values` [K, ...] is defined — a scalar or a row per element —, and its int64
// columns `ints` [K, c]) to coordinate dest[i]
// of mesh dim `m`: the counts of every pair of ranks in one small all-gather (a rank knows only what it sends), then
// the values and the integer columns in one all-to-all each. Every rank of the mesh dim issues the same collectives.
// Returns what this rank received, in coordinate order (values undefined when none were given). `what` names the
// caller in the count exchange (simulation refuses data-dependent counts). `invalid`: this rank found an argument
// error in its part (an index out of range); it travels with the counts, and when any rank set it every rank raises
// `error` (IndexError) before anything moves, so no rank is left waiting.
std::pair<at::Tensor, at::Tensor> route_elements(const at::Tensor& values, const at::Tensor& ints,
                                                 const at::Tensor& dest, const Mesh& mesh, int64_t m, const char* what,
                                                 bool invalid = false, const std::string& error = "");

} // namespace shardtensor::ops
