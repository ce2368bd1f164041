// Write-through for `x[i]` along a sharded dim. Selecting one index of a sharded dim cannot be a view on every
// rank (the slice lives on one rank), so `select` returns a copy: replicated, or scattered along another dim
// (ops/view.cpp, select_landing_dim). The copy is registered here with where it came from; an in-place op that
// writes the copy (or a view of it) is followed by a copy of the updated values into the owner's shard of the base,
// so `x[i] = v`, `x[i].fill_()` and `x.unbind(0)[i].add_()` behave as on one device. A replicated copy is written
// back locally (every rank holds it whole); a scattered one is first moved back to the owner (one all-to-all).
#pragma once

#include <shardtensor/spec.h>

#include <ATen/core/Tensor.h>

#include <string>

namespace shardtensor::dispatch {

// `copy` = select(base, dim, index) replicated along `mesh_dim` (which shards `dim` in `base`), or, when
// `scattered` is set, scattered along it (the slice `base[..., index:index+1, ...]` moved from `owned`, the owner's
// layout, to `scattered`, a shard of another dim): then a write into the copy moves the slice back to the owner
// first (one all-to-all of the slice, issued by every rank of the mesh dim alike), and a select of such a copy
// along another sharded dim (a chain of copies) refuses writes.
void register_select_copy(const at::Tensor& base, const at::Tensor& copy, int64_t dim, int64_t index,
                          int64_t mesh_dim, SpecPtr owned = nullptr, SpecPtr scattered = nullptr);

// `copy` = the result of a view whose input had to be re-laid out first (view.cpp): it does not alias its input,
// so an in-place write into it (or into a view of it) raises NotImplementedError naming `what`, on every rank
// (every rank registers alike: the re-layout is decided from the spec), instead of silently not reaching the input.
void register_relaid_view(const at::Tensor& copy, std::string what);

// False while no copy is registered (the common case: then in-place ops skip the write-back check).
bool any_select_copies();

// Called after an op wrote `written` in place: writes registered copies back to their bases.
void after_write(const at::Tensor& written);

} // namespace shardtensor::dispatch
