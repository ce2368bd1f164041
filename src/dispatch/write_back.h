// Write-through for `x[i]` along a sharded dim. Selecting one index of a sharded dim cannot be a view on every
// rank (the slice lives on one rank), so `select` returns a copy: replicated, or scattered along another dim
// (ops/view.cpp, select_landing_dim). The copy is registered here with where it came from; an in-place op that
// writes the copy (or a view of it) is followed by a copy of the updated values into the owner's shard of the base,
// so `x[i] = v`, `x[i].fill_()` and `x.unbind(0)[i].add_()` behave as on one device. A replicated copy is written
// back locally (every rank holds it whole); a scattered one is first moved back to the owner (one all-to-all).
// The results of views that had to re-lay their input out (ops/view.cpp) are registered here too, and carried back
// into their input the same way (register_relaid_view_copy).
#pragma once

#include <shardtensor/spec.h>

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace shardtensor::dispatch {

// `copy` = select(base, dim, index) replicated along `mesh_dim` (which shards `dim` in `base`), or, when
// `scattered` is set, scattered along it (the slice `base[..., index:index+1, ...]` moved from `owned`, the owner's
// layout, to `scattered`, a shard of another dim): then a write into the copy moves the slice back to the owner
// first (one all-to-all of the slice, issued by every rank of the mesh dim alike), and a select of such a copy
// along another sharded dim (a chain of copies) refuses writes.
// `slice_owned` / `slice_moved`: the selected slice's layout on its owner and the layout it was moved to (the copy's
// with the selected dim kept), for computing the copy again after a write into the base (as a view would show it).
void register_select_copy(const at::Tensor& base, const at::Tensor& copy, int64_t dim, int64_t index,
                          int64_t mesh_dim, SpecPtr owned, SpecPtr scattered, SpecPtr slice_owned,
                          SpecPtr slice_moved);

// A scattered select copy `copy` = base[..., index, ...] (along `dim` of base), scattered along its dim `landing`:
// `base` rebuilt over the base's own buffer (a write into a view of it reaches the base). Empty when `copy` is no
// such copy with exactly this geometry, or its base is gone. A select of the copy along `landing` (x[..., i, j]
// with i sharded: the copy of row i is scattered along j's dim) is computed from the base instead (ops/view.cpp):
// base.select(j).select(i) is one select along a sharded dim of a view of the base, so writes into it reach the
// base; a chain of copies through a scattered one could not be written back.
struct SelectOrigin {
  at::Tensor base;
  int64_t dim = 0, index = 0, landing = 0;
};
std::optional<SelectOrigin> scattered_select_origin(const at::Tensor& copy);

// After a write into `copy` (registered from a view of `source`'s base) reached the base, `source` (a scattered
// select copy of that base, still alive) is refreshed from the base, as a view on one device would show the write:
// its slice moved again from the owner (one collective, on every rank alike).
void register_refresh(const at::Tensor& copy, const at::Tensor& source);

// `copy` = the result of a view whose input had to be re-laid out first (unfold and diagonal along sharded dims):
// it does not alias its input, so an in-place write into it (or into a view of it) raises NotImplementedError naming
// `what`, on every rank (every rank registers alike: the re-layout is decided from the spec), instead of silently
// not reaching the input.
void register_relaid_view(const at::Tensor& copy, std::string what);

// `copy` = view(base) computed as a copy (view.cpp): `base` re-laid out to `aligned` (a layout of base's shape), a
// local view there giving layout `viewed` (of copy's shape), then moved to copy's own layout. An in-place write into
// the copy (or a view of it) is carried back the same way in reverse -- copy's layout to `viewed`, the local
// inverse view, `aligned` to base's layout (one collective per changed mesh dim, as the forward re-layout) -- and
// copied into base's buffer, as the write would reach the base through a view on one device (einops' `x =
// rearrange(conv(x), 'b c h w -> b (h w) c'); x += pos` with W split). Autograd already records the copy as a view
// of the base (ADInplaceOrView), so gradients follow the write as on one device; only the values need carrying.
void register_relaid_view_copy(const at::Tensor& base, const at::Tensor& copy, SpecPtr aligned, SpecPtr viewed);

// False while no copy is registered (the common case: then in-place ops skip the write-back check).
bool any_select_copies();

// Called after an op wrote `written` in place: writes registered copies back to their bases.
void after_write(const at::Tensor& written);

} // namespace shardtensor::dispatch
