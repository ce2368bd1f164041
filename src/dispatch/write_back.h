// Write-through for `x[i]` along a sharded dim. Selecting one index of a sharded dim cannot be a view on every
// rank (the slice lives on one rank), so `select` returns a replicated copy. The copy is registered here with
// where it came from; an in-place op that writes the copy (or a view of it) is followed by a local copy of the
// updated values into the owner's shard of the base, so `x[i] = v`, `x[i].fill_()` and
// `x.unbind(0)[i].add_()` behave as on one device. No communication: every rank holds the same copy.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace shardtensor::dispatch {

// `copy` = select(base, dim, index) replicated along `mesh_dim` (which shards `dim` in `base`).
void register_select_copy(const at::Tensor& base, const at::Tensor& copy, int64_t dim, int64_t index,
                          int64_t mesh_dim);

// `copy` = the result of a view whose input had to be re-laid out first (view.cpp): it does not alias its input,
// so an in-place write into it (or into a view of it) raises NotImplementedError naming `what`, on every rank
// (every rank registers alike: the re-layout is decided from the spec), instead of silently not reaching the input.
void register_relaid_view(const at::Tensor& copy, std::string what);

// False while no copy is registered (the common case: then in-place ops skip the write-back check).
bool any_select_copies();

// Called after an op wrote `written` in place: writes registered copies back to their bases.
void after_write(const at::Tensor& written);

} // namespace shardtensor::dispatch
