// Shape ops. A view that keeps each sharded dim a clean contiguous-range shard is local (no communication):
// the sharded dim may be the outermost of merged dims, or split with its inner factor dividing every extent. Other
// views re-lay the input out first (window-aligned extents, the shard moved to the outer dim of a merge).
// Slicing and selecting along a sharded dim use global indices; cat along a sharded dim keeps it sharded when the
// other inputs are whole along it (they join the edge ranks), else gathers that dim.
#include "comm/halo.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include "dispatch/write_back.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>

#include <numeric>
#include <optional>

namespace shardtensor::ops {

namespace {

const ShardSpec& spec_of(const at::Tensor& t) {
  return *shard_impl(t)->spec();
}

std::vector<int64_t> local_shape_for(const std::vector<int64_t>& global, const Placements& p, const DimExtents& ext,
                                     const Mesh& mesh) {
  auto local = global;
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].is_shard()) local[p[m].dim] = ext.at(p[m].dim)[mesh.coordinate(static_cast<int64_t>(m))];
  return local;
}

// Groups of input dims and output dims with equal products (a reshape maps each group to its partner).
struct Group {
  std::vector<int64_t> in, out;
};

std::vector<Group> view_groups(at::IntArrayRef in, at::IntArrayRef out) {
  std::vector<Group> groups;
  size_t i = 0, j = 0;
  while (i < in.size() || j < out.size()) {
    Group g;
    int64_t pi = 1, po = 1;
    // Size-1 dims on either side form their own groups so that shards stay put.
    if (i < in.size() && in[i] == 1 && !(j < out.size() && out[j] == 1)) {
      g.in.push_back(static_cast<int64_t>(i++));
      groups.push_back(g);
      continue;
    }
    if (j < out.size() && out[j] == 1 && !(i < in.size() && in[i] == 1)) {
      g.out.push_back(static_cast<int64_t>(j++));
      groups.push_back(g);
      continue;
    }
    do {
      if (pi <= po && i < in.size()) {
        pi *= in[i];
        g.in.push_back(static_cast<int64_t>(i++));
      } else if (j < out.size()) {
        po *= out[j];
        g.out.push_back(static_cast<int64_t>(j++));
      } else {
        break;
      }
    } while (pi != po || g.in.empty() || g.out.empty());
    groups.push_back(g);
  }
  return groups;
}

// Where a group of a view puts a shard held on its input dim `t`: the first output dim of size > 1 takes it. The
// local view keeps the shard a contiguous block of the result when every input dim before `t` in the group has size
// 1 and every extent of `t` is a multiple of `quantum`: the inner output size over what the inner input dims
// supply (`inner_out / gcd(inner_in, inner_out)`), so each shard holds whole rows of the inner output dims.
struct GroupFit {
  int64_t first_out = -1;
  int64_t inner_in = 1, inner_out = 1, quantum = 1;
  bool outermost = true;
};

GroupFit fit_of(const Group& g, int64_t t, at::IntArrayRef in, at::IntArrayRef out) {
  GroupFit f;
  for (auto k : g.in) {
    if (k < t && in[k] != 1) f.outermost = false;
    if (k > t) f.inner_in *= in[k];
  }
  for (auto k : g.out) {
    if (f.first_out < 0 && out[k] != 1) {
      f.first_out = k;
      continue;
    }
    if (f.first_out >= 0) f.inner_out *= out[k];
  }
  if (f.first_out < 0) f.first_out = g.out.front();
  // An empty group (a zero-size dim) holds no data: any extents fit.
  f.quantum = f.inner_out == 0 ? 1 : f.inner_out / std::gcd(f.inner_in, f.inner_out);
  return f;
}

const Group* group_of(const std::vector<Group>& groups, int64_t in_dim) {
  for (const auto& g : groups)
    if (std::find(g.in.begin(), g.in.end(), in_dim) != g.in.end()) return &g;
  TORCH_INTERNAL_ASSERT(false, "view: input dim ", in_dim, " in no group");
  return nullptr;
}

struct ViewLayout {
  Placements placements;
  DimExtents extents;
};

// The result's layout when the view is local on every rank (each shard stays a contiguous block of the result), or
// nullopt: a sharded dim is removed, merged under an outer dim of size > 1 or under another sharded dim, or split
// with an inner size its extents do not hold whole.
std::optional<ViewLayout> local_view_layout(const ShardSpec& spec, at::IntArrayRef in, at::IntArrayRef out,
                                            const std::vector<Group>& groups) {
  ViewLayout r{spec.placements, {}};
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const auto& p = spec.placements[m];
    if (!p.is_shard()) continue;
    const auto& g = *group_of(groups, p.dim);
    if (g.out.empty()) return std::nullopt;
    for (auto k : g.in)
      if (k > p.dim && spec.mesh_dim_of(k) >= 0) return std::nullopt;
    const auto f = fit_of(g, p.dim, in, out);
    if (!f.outermost) return std::nullopt;
    std::vector<int64_t> ext;
    if (f.inner_out == 0) {
      ext = default_split(out[f.first_out], static_cast<int64_t>(spec.extents[m].size()));
    } else {
      for (auto e : spec.extents[m]) {
        if (e % f.quantum != 0) return std::nullopt;
        ext.push_back(e * f.inner_in / f.inner_out);
      }
    }
    r.placements[m] = Placement::shard(f.first_out);
    r.extents[f.first_out] = std::move(ext);
  }
  return r;
}

// The input layout closest to `spec` for which the view is local (see local_view_layout). Per group of merged/split
// dims, the outermost sharded input dim keeps its mesh dim:
// - when the input dims before it have size 1, the shard stays on its dim with its extents rounded to the nearest
//   multiples of the group's quantum (nearest_aligned: the fewest rows move);
// - otherwise (a merge under an outer dim of size > 1, e.g. flatten(0, 1) of (B, N, C) with N sharded) the shard
//   moves to the outermost input dim of size > 1, default-split in multiples of the quantum (one all-to-all; fewer
//   bytes than gathering, and every rank keeps a part);
// other sharded dims of the group move onto the leading dim when it passes through the view unsplit and holds a row
// per rank (a batch), else are gathered (a tensor dim is sharded by at most one mesh dim, so two shards cannot both
// stay on one merged dim), as is a sharded size-1 dim the view removes. Everything is decided from the spec and the
// shapes, so every rank picks the same target.
SpecPtr view_aligned_spec(const ShardSpec& spec, at::IntArrayRef in, at::IntArrayRef out,
                          const std::vector<Group>& groups) {
  auto placements = spec.placements;
  auto ext = spec.dim_extents();
  // The leading input dim (the first of size > 1: a batch) when it passes through the view untouched and no mesh
  // dim splits it: where a merge's second split can go instead of being gathered.
  int64_t lead = 0;
  while (lead < static_cast<int64_t>(in.size()) && in[lead] == 1) ++lead;
  bool lead_free = lead < static_cast<int64_t>(in.size()) && spec.mesh_dim_of(lead) < 0;
  if (lead_free) {
    const Group* lg = nullptr;
    for (const auto& g : groups)
      if (std::find(g.in.begin(), g.in.end(), lead) != g.in.end()) lg = &g;
    lead_free = lg && lg->in.size() == 1 && lg->out.size() == 1 && out[lg->out[0]] == in[lead];
  }
  for (const auto& g : groups) {
    std::vector<int64_t> sharded; // the group's sharded input dims, outermost first
    for (auto k : g.in)
      if (spec.mesh_dim_of(k) >= 0) sharded.push_back(k);
    for (size_t i = 0; i < sharded.size(); ++i) {
      const auto d = sharded[i];
      const auto m = spec.mesh_dim_of(d);
      if (i > 0 || g.out.empty()) {
        // A merge keeps one split (one tensor dim takes one mesh dim): a second one moves onto the leading dim when
        // that dim passes through untouched and holds a row per rank -- a ViT's patch flatten `(B, C, H, W) ->
        // (B, C, H*W)` with H and W on the two dims of a mesh: the batch takes W's mesh dim, one all-to-all, and the
        // work stays divided over both mesh dims --; otherwise it is gathered.
        const auto n = spec.mesh->size(m);
        if (i > 0 && lead_free && in[lead] >= n) {
          placements[m] = Placement::shard(lead);
          ext.erase(d);
          ext[lead] = default_split(in[lead], n);
          lead_free = false;
          continue;
        }
        placements[m] = Placement::replicate();
        ext.erase(d);
        continue;
      }
      auto f = fit_of(g, d, in, out);
      auto t = d;
      if (!f.outermost) {
        t = *std::find_if(g.in.begin(), g.in.end(), [&](int64_t k) { return in[k] != 1; });
        f = fit_of(g, t, in, out);
      }
      const auto n = in[t];
      const auto k = static_cast<int64_t>(spec.extents[m].size());
      std::vector<int64_t> e;
      if (t == d) {
        e = nearest_aligned(spec.extents[m], n, f.quantum);
      } else {
        e = default_split(n / f.quantum, k);
        for (auto& v : e) v *= f.quantum;
      }
      placements[m] = Placement::shard(t);
      ext.erase(d);
      ext[t] = std::move(e);
    }
  }
  return ShardSpec::make_with_dim_extents(spec.mesh, std::move(placements), in.vec(), ext);
}

// A split of a sharded dim whose outer factor is small beside the rest (outer * outer < inner: a stride or a pooling
// window put outermost, as in Hiera's unrolled layout `x.view(B, q, N // q, C).amax(1)`; a handful of variables
// unflattened from a token dim, as in FengWu's fuser; MaxViT's grid split `view(B, g, H / g, ...)`) would leave the
// shard on a dim of a few rows: each rank then holds whole slices that the next reduction or select over that dim
// must combine on every rank, and it divides the work by at most `outer`. The shard goes to the next output dim of size > 1 instead (default split), one
// all-to-all after the local view. Returns the result's layout with those shards moved, or nullopt when none moves.
// Decided from the shapes and the layout alone, so every rank picks the same target.
std::optional<ViewLayout> inner_split_layout(const ViewLayout& layout, at::IntArrayRef in, at::IntArrayRef out,
                                             const Mesh& mesh, const std::vector<Group>& groups) {
  auto moved = layout;
  bool any = false;
  for (size_t m = 0; m < layout.placements.size(); ++m) {
    const auto& p = layout.placements[m];
    if (!p.is_shard() || mesh.size(static_cast<int64_t>(m)) == 1) continue;
    const auto o = p.dim;
    const Group* g = nullptr;
    for (const auto& cand : groups)
      if (std::find(cand.out.begin(), cand.out.end(), o) != cand.out.end()) g = &cand;
    // Only a split (one input dim of size > 1 becoming several): a merge keeps its shard on the merged dim.
    if (!g || std::count_if(g->in.begin(), g->in.end(), [&](int64_t k) { return in[k] > 1; }) != 1) continue;
    // A leading dim is where a batch is folded with other dims ((B * N, C) -> (B, N, C), windows into the batch):
    // its outer factor is the batch, whose shard is the cheapest one there is.
    if (o == 0) continue;
    int64_t inner = 1, next = -1;
    for (auto k : g->out)
      if (k > o) {
        inner *= out[k];
        if (next < 0 && out[k] > 1) next = k;
      }
    if (next < 0 || out[o] * out[o] >= inner) continue;
    moved.placements[m] = Placement::shard(next);
    moved.extents.erase(o);
    moved.extents[next] = default_split(out[next], mesh.size(static_cast<int64_t>(m)));
    any = true;
  }
  if (!any) return std::nullopt;
  return moved;
}

// view / _unsafe_view / _reshape_alias (`op_name` for messages); `unsafe`: the local result is an _unsafe_view.
// A view that keeps every shard a contiguous block of the result is local. Any other view first redistributes the
// input to the nearest layout that is (view_aligned_spec: one collective per changed mesh dim), then views locally.
// That redistribution runs below autograd and changes no values; the view's backward (a reshape of the gradient back
// to the input shape) goes through this rule again and re-lays the gradient out as it needs.
at::Tensor view_impl(const char* op_name, const at::Tensor& self_arg, c10::SymIntArrayRef size, bool unsafe) {
  auto out_shape = at::infer_size(concrete_ints(size), self_arg.numel());
  auto groups = view_groups(self_arg.sizes(), out_shape);
  auto self = self_arg;
  auto layout = local_view_layout(spec_of(self), self.sizes(), out_shape, groups);
  const bool relaid = !layout;
  if (!layout) {
    // An empty tensor (a zero-size dim) holds nothing to align: whole on every rank, which is every layout's content.
    self = redistribute_to(self, self_arg.numel() == 0
                                     ? dispatch::replicate_spec(spec_of(self).mesh, self.sizes())
                                     : view_aligned_spec(spec_of(self), self.sizes(), out_shape, groups));
    layout = local_view_layout(spec_of(self), self.sizes(), out_shape, groups);
    TORCH_INTERNAL_ASSERT(layout, op_name, " from ", self.sizes(), " to ", c10::IntArrayRef(out_shape),
                          ": the re-aligned layout ", to_string(spec_of(self).placements), " is not local");
  }
  const auto& spec = spec_of(self);
  auto local_shape = local_shape_for(out_shape, layout->placements, layout->extents, *spec.mesh);
  const auto& local = shard_impl(self)->local();
  at::Tensor out;
  if (unsafe) {
    out = at::_unsafe_view(local, local_shape);
  } else if (at::detail::computeStride(local.sizes(), local.strides(), local_shape)) {
    out = local.view(local_shape);
  } else {
    // The wrapper reports dense global strides, so `reshape` picks a view even when the local tensor cannot be
    // viewed (e.g. an expanded mask): copy, as reshape does on one device for such a tensor.
    out = local.reshape(local_shape);
  }
  auto result = wrap(out, spec.mesh, layout->placements, out_shape, layout->extents);
  const auto viewed = shard_impl(result)->spec();
  const auto inner = inner_split_layout(*layout, self.sizes(), out_shape, *spec.mesh, groups);
  if (inner)
    result = redistribute_to(result, ShardSpec::make_with_dim_extents(spec.mesh, inner->placements, out_shape,
                                                                      inner->extents));
  // A re-laid-out `view` is a copy where one device has an alias: an in-place write into it is carried back into
  // the input (write_back.h), never silently left out. `_unsafe_view` is reshape's copy path: not an alias on one
  // device either.
  if ((relaid || inner) && !unsafe)
    dispatch::register_relaid_view_copy(self_arg, result, shard_impl(self)->spec(), viewed);
  return result;
}

// view(Tensor(a) self, SymInt[] size)
at::Tensor view_rule(const at::Tensor& self, c10::SymIntArrayRef size) {
  return view_impl("aten::view", self, size, false);
}

// _unsafe_view(Tensor self, SymInt[] size)
at::Tensor unsafe_view_rule(const at::Tensor& self, c10::SymIntArrayRef size) {
  return view_impl("aten::_unsafe_view", self, size, true);
}

// _reshape_alias(Tensor(a) self, SymInt[] size, SymInt[] stride): its strides are global; the local view computes
// its own.
at::Tensor reshape_alias_rule(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef /*stride*/) {
  return view_impl("aten::_reshape_alias", self, size, false);
}

// A permutation `dims` (output dim k = input dim dims[k]).
at::Tensor permute_local(const at::Tensor& self, std::vector<int64_t> dims) {
  const auto& spec = spec_of(self);
  const auto ndim = self.dim();
  for (auto& d : dims) d = wrap_dim(d, ndim);
  std::vector<int64_t> inv(ndim);
  for (int64_t k = 0; k < ndim; ++k) inv[dims[k]] = k;
  Placements out_p = spec.placements;
  DimExtents out_ext;
  for (size_t m = 0; m < out_p.size(); ++m)
    if (out_p[m].is_shard()) {
      out_ext[inv[out_p[m].dim]] = spec.extents[m];
      out_p[m] = Placement::shard(inv[out_p[m].dim]);
    }
  std::vector<int64_t> out_shape(ndim);
  for (int64_t k = 0; k < ndim; ++k) out_shape[k] = self.size(dims[k]);
  auto out = shard_impl(self)->local().permute(dims);
  auto result = wrap(out, spec.mesh, out_p, out_shape, out_ext);
  std::vector<int64_t> strides(ndim);
  for (int64_t k = 0; k < ndim; ++k) strides[k] = self.stride(dims[k]);
  shard_impl(result)->set_global_strides(strides);
  return result;
}

// permute(Tensor(a) self, int[] dims)
at::Tensor permute_rule(const at::Tensor& self, at::IntArrayRef dims) {
  return permute_local(self, dims.vec());
}

std::vector<int64_t> identity_dims(int64_t ndim) {
  std::vector<int64_t> dims(ndim);
  for (int64_t k = 0; k < ndim; ++k) dims[k] = k;
  return dims;
}

// transpose.int(Tensor(a) self, int dim0, int dim1)
at::Tensor transpose_rule(const at::Tensor& self, int64_t dim0, int64_t dim1) {
  auto dims = identity_dims(self.dim());
  std::swap(dims[wrap_dim(dim0, self.dim())], dims[wrap_dim(dim1, self.dim())]);
  return permute_local(self, dims);
}

// t(Tensor(a) self): 0-, 1- and 2-D.
at::Tensor t_rule(const at::Tensor& self) {
  TORCH_CHECK_VALUE(self.dim() <= 2, "t() expects a tensor with <= 2 dimensions, but self is ", self.dim(), "D");
  auto dims = identity_dims(self.dim());
  if (self.dim() == 2) std::swap(dims[0], dims[1]);
  return permute_local(self, dims);
}

// unsqueeze(Tensor(a) self, int dim)
at::Tensor unsqueeze_rule(const at::Tensor& self, int64_t dim) {
  const auto& spec = spec_of(self);
  const auto d = wrap_dim(dim, self.dim() + 1);
  Placements out_p = spec.placements;
  DimExtents out_ext;
  for (size_t m = 0; m < out_p.size(); ++m)
    if (out_p[m].is_shard()) {
      auto nd = out_p[m].dim >= d ? out_p[m].dim + 1 : out_p[m].dim;
      out_ext[nd] = spec.extents[m];
      out_p[m] = Placement::shard(nd);
    }
  auto out_shape = self.sizes().vec();
  out_shape.insert(out_shape.begin() + d, 1);
  auto out = shard_impl(self)->local().unsqueeze(d);
  return wrap(out, spec.mesh, out_p, out_shape, out_ext);
}

// squeeze / squeeze.dim / squeeze.dims: decided on global sizes, applied with explicit local dims.
// Squeeze the size-1 dims among `dims` (already wrapped).
at::Tensor squeeze_local(const at::Tensor& self, const std::vector<int64_t>& dims) {
  const auto ndim = self.dim();
  std::vector<int64_t> squeezed;
  for (auto k : dims)
    if (ndim > 0 && self.size(k) == 1) squeezed.push_back(k);
  // A sharded size-1 dim lives on one rank: replicate it first.
  auto t = self;
  const auto& spec0 = spec_of(self);
  auto placements = spec0.placements;
  bool gather = false;
  for (auto k : squeezed) {
    auto m = spec0.mesh_dim_of(k);
    if (m >= 0) {
      placements[m] = Placement::replicate();
      gather = true;
    }
  }
  if (gather) t = redistribute_to(t, redistribute_target_spec(spec0, placements));
  const auto& spec = spec_of(t);
  Placements out_p = spec.placements;
  DimExtents out_ext;
  for (size_t m = 0; m < out_p.size(); ++m)
    if (out_p[m].is_shard()) {
      auto d = out_p[m].dim;
      auto nd = d - static_cast<int64_t>(std::count_if(squeezed.begin(), squeezed.end(), [&](int64_t k) { return k < d; }));
      out_ext[nd] = spec.extents[m];
      out_p[m] = Placement::shard(nd);
    }
  std::vector<int64_t> out_shape;
  for (int64_t k = 0; k < ndim; ++k)
    if (std::find(squeezed.begin(), squeezed.end(), k) == squeezed.end()) out_shape.push_back(self.size(k));
  auto out = squeezed.empty() ? shard_impl(t)->local().alias() : shard_impl(t)->local().squeeze(squeezed);
  return wrap(out, spec.mesh, out_p, out_shape, out_ext);
}

// squeeze(Tensor(a) self)
at::Tensor squeeze_rule(const at::Tensor& self) {
  std::vector<int64_t> dims;
  for (int64_t k = 0; k < self.dim(); ++k) dims.push_back(k);
  return squeeze_local(self, dims);
}

// squeeze.dim(Tensor(a) self, int dim)
at::Tensor squeeze_dim_rule(const at::Tensor& self, int64_t dim) {
  return squeeze_local(self, {wrap_dim(dim, std::max<int64_t>(self.dim(), 1))});
}

// squeeze.dims(Tensor(a) self, int[] dim)
at::Tensor squeeze_dims_rule(const at::Tensor& self, at::IntArrayRef dim) {
  std::vector<int64_t> dims;
  for (auto k : dim) dims.push_back(wrap_dim(k, std::max<int64_t>(self.dim(), 1)));
  return squeeze_local(self, dims);
}

// expand(Tensor(a) self, SymInt[] size, *, bool implicit=False)
at::Tensor expand_rule(const at::Tensor& self, c10::SymIntArrayRef sym_size, bool /*implicit*/) {
  const auto& spec = spec_of(self);
  const auto size = concrete_ints(sym_size);
  const auto shift = static_cast<int64_t>(size.size()) - self.dim();
  std::vector<int64_t> out_shape(size.begin(), size.end());
  for (int64_t k = 0; k < self.dim(); ++k)
    if (out_shape[k + shift] == -1) out_shape[k + shift] = self.size(k);
  auto t = self;
  // A pending sum is completed before it is broadcast: the all-reduce then moves the small tensor, where resolving
  // the expanded one later (e.g. the gradient of a sum over a sharded dim meeting a sharded gradient) would move
  // the broadcast size.
  int64_t out_numel = 1;
  for (auto v : out_shape) out_numel *= v;
  if (spec.has_partial() && out_numel > self.numel()) t = resolve_partial(t);
  const auto& rspec = spec_of(t);
  auto placements = rspec.placements;
  bool gather = false;
  for (size_t m = 0; m < placements.size(); ++m)
    if (placements[m].is_shard() && out_shape[placements[m].dim + shift] != self.size(placements[m].dim)) {
      placements[m] = Placement::replicate();
      gather = true;
    }
  if (gather) t = redistribute_to(t, redistribute_target_spec(rspec, placements));
  const auto& tspec = spec_of(t);
  Placements out_p = tspec.placements;
  DimExtents out_ext;
  auto local_size = out_shape;
  for (size_t m = 0; m < out_p.size(); ++m)
    if (out_p[m].is_shard()) {
      auto nd = out_p[m].dim + shift;
      out_ext[nd] = tspec.extents[m];
      local_size[nd] = tspec.local_shape[out_p[m].dim];
      out_p[m] = Placement::shard(nd);
    }
  auto out = shard_impl(t)->local().expand(local_size);
  return wrap(out, tspec.mesh, out_p, out_shape, out_ext);
}

// Global [start, end) with step on dim of size n, normalized like Python slicing.
struct SliceRange {
  int64_t start, end, step;
};

SliceRange normalize_slice(int64_t n, std::optional<int64_t> start, std::optional<int64_t> end, int64_t step) {
  int64_t s = start.value_or(0), e = end.value_or(n);
  if (s < 0) s += n;
  if (e < 0) e += n;
  s = std::clamp<int64_t>(s, 0, n);
  e = std::clamp<int64_t>(e, s, n);
  return {s, e, step};
}

// slice.Tensor(Tensor(a) self, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1)
at::Tensor slice_rule(const at::Tensor& self, int64_t dim_arg, std::optional<c10::SymInt> start_arg,
                      std::optional<c10::SymInt> end_arg, c10::SymInt step_arg) {
  const auto& spec = spec_of(self);
  const auto dim = wrap_dim(dim_arg, self.dim());
  std::optional<int64_t> start, end;
  if (start_arg) start = concrete_int(*start_arg);
  if (end_arg) end = concrete_int(*end_arg);
  const auto step = concrete_int(step_arg);
  TORCH_CHECK_VALUE(step > 0, "slice step must be positive");
  const auto r = normalize_slice(self.size(dim), start, end, step);
  const auto count = r.end > r.start ? (r.end - r.start + step - 1) / step : 0;
  auto out_shape = self.sizes().vec();
  out_shape[dim] = count;
  const auto m = spec.mesh_dim_of(dim);
  const auto& local = shard_impl(self)->local();
  DimExtents out_ext = spec.dim_extents();
  at::Tensor out;
  if (m < 0) {
    out = local.slice(dim, r.start, r.end, step);
  } else {
    // Each rank keeps the selected global indices inside its range [off, off + ext).
    std::vector<int64_t> new_ext;
    int64_t my_first = 0, my_count = 0;
    for (int64_t c = 0; c < spec.mesh->size(m); ++c) {
      const auto off = spec.offset_of(m, c), ext = spec.extents[m][c];
      // First selected index >= off.
      int64_t first = r.start >= off ? r.start : r.start + ((off - r.start + step - 1) / step) * step;
      const auto stop = std::min(r.end, off + ext);
      const auto n = first < stop ? (stop - first + step - 1) / step : 0;
      new_ext.push_back(n);
      if (c == spec.mesh->coordinate(m)) {
        my_first = first - off;
        my_count = n;
      }
    }
    out_ext[dim] = new_ext;
    out = my_count > 0 ? local.slice(dim, my_first, my_first + (my_count - 1) * step + 1, step)
                       : local.narrow(dim, 0, 0);
  }
  return wrap(out, spec.mesh, spec.placements, out_shape, out_ext);
}

// Where the result of selecting one index of `dim` (sharded on a mesh dim of `ranks` ranks) keeps that mesh dim's
// shard, as a dim of the slice (the input's numbering; `dim` itself excluded), or -1 to replicate the result. The
// selected slice lives on one rank; replicated, every rank would compute all that follows it (Pangu's surface level
// `output[:, :, 0]`, FengWu's per-variable decoders `x[:, i]`). So a result of at least 3 dims (a field or a
// token sequence per sample) is scattered from the owner along its neighbour of the selected dim instead: the inner
// one (the next spatial dim of a channels-first field, the tokens after a variables dim), else the outer one unless
// that is dim 1 (the channels of a channels-first field: a conv or norm over channels split across ranks costs more
// than it divides); one that another mesh dim shards, or with fewer rows than ranks, does not take it either. The
// shapes cannot tell a channels-last field (B, H, W, C) from a channels-first one, so selecting its last spatial
// dim lands on C. A result of 1 or 2 dims (a class token `x[:, 0]`, a per-sample vector or row) is small and feeds
// heads that want it whole: it stays replicated. Decided from the shapes and the layout alone, so every rank picks
// the same dim.
int64_t select_landing_dim(const ShardSpec& spec, int64_t dim, int64_t ranks) {
  const auto ndim = static_cast<int64_t>(spec.global_shape.size());
  if (ndim - 1 < 3) return -1;
  auto takes = [&](int64_t d) {
    return d >= 0 && d < ndim && spec.mesh_dim_of(d) < 0 && spec.global_shape[d] >= ranks;
  };
  if (takes(dim + 1)) return dim + 1;
  if (dim - 1 != 1 && takes(dim - 1)) return dim - 1;
  return -1;
}

// select.int(Tensor(a) self, int dim, SymInt index)
at::Tensor select_rule(const at::Tensor& self, int64_t dim_arg, c10::SymInt index_arg) {
  const auto dim = wrap_dim(dim_arg, self.dim());
  auto index = concrete_int(index_arg);
  TORCH_CHECK_INDEX(index >= -self.size(dim) && index < self.size(dim), "select: index ", index,
                    " out of range for dim ", dim, " of size ", self.size(dim));
  if (index < 0) index += self.size(dim);
  auto t = self;
  const auto& spec0 = spec_of(self);
  const auto global_index = index;
  const auto sharded_on = spec0.mesh_dim_of(dim);
  if (sharded_on >= 0 && dispatch::any_select_copies()) {
    // `self` = base.select(i) scattered along this very dim (x[..., i, j] with i sharded): a copy of a copy could
    // not be written back, so take base.select(j) (a view: this dim is whole in the base) and select i there. The
    // values are the base's, as a view's would be on one device; `self`, if it outlives a write into the result,
    // is refreshed from the base (dispatch/write_back.h).
    if (auto origin = dispatch::scattered_select_origin(self); origin && origin->landing == dim) {
      const auto base_dim = dim < origin->dim ? dim : dim + 1;
      auto view = at::select(origin->base, base_dim, index);
      auto out = at::select(view, origin->dim > base_dim ? origin->dim - 1 : origin->dim, origin->index);
      dispatch::register_refresh(out, self);
      return out;
    }
  }
  int64_t landing = -1;
  SpecPtr owned;
  if (auto m = sharded_on; m >= 0) {
    // The index lives on one rank: slice it out, then move that one slice along the mesh dim (a collective): a
    // scatter from the owner onto the landing dim (select_landing_dim), or a broadcast to every rank. The result
    // is a copy; writes into it are written back to the owner (dispatch/write_back.h).
    t = at::slice(self, dim, index, index + 1);
    owned = shard_impl(t)->spec();
    auto placements = owned->placements;
    landing = select_landing_dim(*owned, dim, spec0.mesh->size(m));
    placements[m] = landing >= 0 ? Placement::shard(landing) : Placement::replicate();
    t = redistribute_to(t, redistribute_target_spec(*owned, placements));
    index = 0;
  }
  const auto& spec = spec_of(t);
  Placements out_p = spec.placements;
  DimExtents out_ext;
  for (size_t m = 0; m < out_p.size(); ++m)
    if (out_p[m].is_shard()) {
      auto nd = out_p[m].dim > dim ? out_p[m].dim - 1 : out_p[m].dim;
      out_ext[nd] = spec.extents[m];
      out_p[m] = Placement::shard(nd);
    }
  auto out_shape = self.sizes().vec();
  out_shape.erase(out_shape.begin() + dim);
  auto out = wrap(shard_impl(t)->local().select(dim, index), spec.mesh, out_p, out_shape, out_ext);
  // One device's strides (the input's without `dim`), also for a copy, whose local tensor is dense: a row of a
  // (3, 6, 5) tensor is not contiguous there, so `x[:, 2].reshape(15)` copies (a write into it leaves x alone)
  // rather than viewing the copy and writing through to x.
  auto strides = self.strides().vec();
  strides.erase(strides.begin() + dim);
  shard_impl(out)->set_global_strides(strides);
  if (sharded_on >= 0)
    dispatch::register_select_copy(self, out, dim, global_index, sharded_on, landing >= 0 ? owned : nullptr,
                                   landing >= 0 ? shard_impl(t)->spec() : nullptr, owned, shard_impl(t)->spec());
  return out;
}

// split.Tensor / split_with_sizes / unbind: as global slices / selects.
// Consecutive slices of `sizes` along `dim` (already wrapped).
std::vector<at::Tensor> slices_of(const at::Tensor& self, int64_t dim, const std::vector<int64_t>& sizes) {
  std::vector<at::Tensor> pieces;
  int64_t off = 0;
  for (auto s : sizes) {
    pieces.push_back(at::slice(self, dim, off, off + s));
    off += s;
  }
  return pieces;
}

// split.Tensor(Tensor(a -> *) self, SymInt split_size, int dim=0) -> Tensor(a)[]
std::vector<at::Tensor> split_rule(const at::Tensor& self, c10::SymInt split_size, int64_t dim_arg) {
  const auto dim = wrap_dim(dim_arg, self.dim());
  const auto s = concrete_int(split_size);
  const auto n = self.size(dim);
  std::vector<int64_t> sizes;
  for (int64_t off = 0; off < n || (n == 0 && sizes.empty()); off += std::max<int64_t>(s, 1))
    sizes.push_back(std::min(s, n - off));
  return slices_of(self, dim, sizes);
}

// split_with_sizes(Tensor(a -> *) self, SymInt[] split_sizes, int dim=0) -> Tensor(a)[]
std::vector<at::Tensor> split_with_sizes_rule(const at::Tensor& self, c10::SymIntArrayRef split_sizes,
                                              int64_t dim_arg) {
  return slices_of(self, wrap_dim(dim_arg, self.dim()), concrete_ints(split_sizes));
}

// unbind.int(Tensor(a -> *) self, int dim=0) -> Tensor(a)[]
std::vector<at::Tensor> unbind_rule(const at::Tensor& self, int64_t dim_arg) {
  const auto dim = wrap_dim(dim_arg, self.dim());
  std::vector<at::Tensor> pieces;
  for (int64_t i = 0; i < self.size(dim); ++i) pieces.push_back(at::select(self, dim, i));
  return pieces;
}

// cat(Tensor[] tensors, int dim=0)
// The reference layout is the most sharded input (a promoted plain parameter is a Replicate ShardTensor and must not
// decide it). Along an unsharded dim every input is brought to that layout and the cat is local. Along a dim sharded
// on mesh dim m: when no other input is sharded on m (a class token, a constant pad), the pieces before the sharded
// input join coordinate 0 and those after it the last coordinate, so the result stays sharded with no communication
// (the edge extents grow); with several inputs sharded along it whose rows follow each other in coordinate order (a
// slice put back), each rank concatenates its own pieces; otherwise the dim is gathered, concatenated and re-split
// with the default rule.
at::Tensor cat_rule(at::TensorList list, int64_t dim_arg) {
  auto mesh = dispatch::common_mesh("aten::cat", list);
  const ShardTensorImpl* ref = nullptr;
  int64_t ref_index = -1, ref_shards = -1, ndim = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(list.size()); ++i) {
    const auto& t = list[i];
    if (t.dim() > 0) ndim = t.dim();
    if (is_shard_tensor(t) && shard_count(t) > ref_shards) {
      ref = shard_impl(t);
      ref_index = i;
      ref_shards = shard_count(t);
    }
  }
  const auto dim = wrap_dim(dim_arg, ndim);
  auto placements = without_partial(ref->spec())->placements;
  auto ext = ref->spec()->dim_extents();
  const auto m = ref->spec()->mesh_dim_of(dim);
  auto skipped = [&](const at::Tensor& t) { return t.dim() == 1 && t.size(0) == 0 && ndim != 1; };  // legacy empty
  // A mesh dim the reference leaves replicated but another input splits along a dim other than the cat dim (the two
  // grids of a meshgrid, latitudes split on one mesh dim and longitudes on the other, stacked: Aurora's position
  // encoding): the result takes that split too, so the inputs replicated there are sliced locally instead of the
  // split one being gathered. Decided from the specs alone (the same on every rank).
  for (size_t mm = 0; mm < placements.size(); ++mm) {
    if (!placements[mm].is_replicate()) continue;
    for (const auto& t : list) {
      if (skipped(t) || !is_shard_tensor(t) || t.dim() != ndim) continue;
      const auto& p = spec_of(t).placements[mm];
      if (!p.is_shard() || p.dim == dim || ext.count(p.dim)) continue;
      placements[mm] = p;
      ext[p.dim] = spec_of(t).dim_extents().at(p.dim);
      break;
    }
  }
  bool whole_joiners = m >= 0;
  for (int64_t i = 0; i < static_cast<int64_t>(list.size()) && whole_joiners; ++i)
    if (i != ref_index && !skipped(list[i]) && is_shard_tensor(list[i]) &&
        spec_of(list[i]).placements[m].is_shard())
      whole_joiners = false;
  // Inputs other than the reference are read whole along the cat dim.
  auto joiner_placements = placements;
  if (m >= 0) joiner_placements[m] = Placement::replicate();
  auto joiner_ext = ext;
  if (m >= 0) joiner_ext.erase(dim);

  std::vector<int64_t> out_shape;
  for (auto& t : list) {
    if (skipped(t)) continue;
    if (out_shape.empty()) {
      out_shape = t.sizes().vec();
    } else {
      out_shape[dim] += t.size(dim);
    }
  }
  auto local_of = [&](const at::Tensor& t, const Placements& base, const DimExtents& e) {
    auto p = base;
    for (auto& pl : p)
      if (pl.is_shard() && pl.dim >= t.dim()) pl = Placement::replicate();
    return local_in(t, mesh, p, e);
  };

  if (whole_joiners) {
    const auto n = mesh->size(m), me = mesh->coordinate(m);
    int64_t before = 0, after = 0;
    std::vector<at::Tensor> locals;
    for (int64_t i = 0; i < static_cast<int64_t>(list.size()); ++i) {
      const auto& t = list[i];
      if (skipped(t)) continue;
      if (i == ref_index) {
        locals.push_back(local_of(t, placements, ext));
        continue;
      }
      (i < ref_index ? before : after) += t.size(dim);
      // Every rank takes the joiner's local (a pending sum completes by a collective of the whole mesh dim, so all
      // must run it); the edge rank keeps it.
      auto joiner = local_of(t, joiner_placements, joiner_ext);
      if ((i < ref_index && me == 0) || (i > ref_index && me == n - 1)) locals.push_back(std::move(joiner));
    }
    auto out_ext = ext;
    out_ext[dim].front() += before;
    out_ext[dim].back() += after;
    return wrap(at::cat(locals, dim), mesh, placements, out_shape, out_ext);
  }

  if (m >= 0) {
    // Several inputs split along the cat dim on m (CoaT's class token sliced off a sharded sequence and put back): a
    // local cat of each rank's pieces is the global order when no input's rows sit on an earlier coordinate than
    // an earlier input's last rows. Whole inputs go to the coordinate that holds the rows before them.
    const auto n = mesh->size(m), me = mesh->coordinate(m);
    std::vector<int64_t> home(list.size(), -1);
    bool ordered = true;
    int64_t cur = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(list.size()) && ordered; ++i) {
      const auto& t = list[i];
      if (skipped(t)) continue;
      if (!is_shard_tensor(t) || !spec_of(t).placements[m].is_shard()) {
        home[i] = cur;
        continue;
      }
      if (!spec_of(t).placements[m].is_shard(dim)) {
        ordered = false;
        break;
      }
      const auto& e = spec_of(t).extents[m];
      int64_t lo = -1, hi = -1;
      for (int64_t r = 0; r < n; ++r)
        if (e[r] > 0) {
          if (lo < 0) lo = r;
          hi = r;
        }
      if (lo < 0) continue;
      if (lo < cur) ordered = false;
      cur = hi;
    }
    if (ordered) {
      std::vector<at::Tensor> locals;
      std::vector<int64_t> out_e(n, 0);
      for (int64_t i = 0; i < static_cast<int64_t>(list.size()); ++i) {
        const auto& t = list[i];
        if (skipped(t)) continue;
        if (home[i] >= 0) {
          out_e[home[i]] += t.size(dim);
          auto joiner = local_of(t, joiner_placements, joiner_ext); // on every rank: it may be a collective
          if (me == home[i]) locals.push_back(std::move(joiner));
          continue;
        }
        auto e = ext;
        e[dim] = spec_of(t).extents[m];
        for (int64_t r = 0; r < n; ++r) out_e[r] += e[dim][r];
        locals.push_back(local_of(t, placements, e));
      }
      auto out_ext = ext;
      out_ext[dim] = out_e;
      return wrap(at::cat(locals, dim), mesh, placements, out_shape, out_ext);
    }
  }

  std::vector<at::Tensor> locals;
  for (auto& t : list)
    if (!skipped(t)) locals.push_back(local_of(t, joiner_placements, joiner_ext));
  at::Tensor result = wrap(at::cat(locals, dim), mesh, joiner_placements, out_shape, joiner_ext);
  if (m >= 0) result = redistribute_to(result, ShardSpec::make_with_dim_extents(mesh, placements, out_shape, joiner_ext));
  return result;
}

// stack(Tensor[] tensors, int dim=0): unsqueeze each, then cat (which has the rule for sharded dims).
at::Tensor stack_rule(at::TensorList tensors, int64_t dim_arg) {
  const auto dim = wrap_dim(dim_arg, tensors.at(0).dim() + 1);
  std::vector<at::Tensor> expanded;
  for (const auto& t : tensors) expanded.push_back(at::unsqueeze(t, dim));
  return at::cat(expanded, dim);
}

// repeat(Tensor self, SymInt[] repeats)
// Unsharded dims repeat locally. A sharded dim repeated R times (output row j is input row j mod L) takes the
// default split of its R·L output rows, and each rank gathers the input rows its output rows read from their owners
// (comm::gather_rows: a neighbour exchange of as many rows as its output block, no more); a 2-D mesh does one dim
// after the other. The backward (aten's formula: a view of the copies and a sum) runs on the same rules.
at::Tensor repeat_rule(const at::Tensor& self, c10::SymIntArrayRef repeats) {
  const auto& spec = spec_of(self);
  auto reps = concrete_ints(repeats);
  TORCH_CHECK_VALUE(static_cast<int64_t>(reps.size()) >= self.dim(),
                    "Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor");
  const auto shift = static_cast<int64_t>(reps.size()) - self.dim();
  Placements out_p = spec.placements;
  DimExtents out_ext;
  std::vector<int64_t> out_shape(reps.size());
  for (int64_t k = 0; k < static_cast<int64_t>(reps.size()); ++k)
    out_shape[k] = reps[k] * (k - shift >= 0 ? self.size(k - shift) : 1);
  auto local = shard_impl(self)->local();
  for (size_t m = 0; m < out_p.size(); ++m) {
    if (!out_p[m].is_shard()) continue;
    const auto d = out_p[m].dim;
    const auto mesh_dim = static_cast<int64_t>(m);
    out_p[m] = Placement::shard(d + shift);
    if (reps[d + shift] == 1) {
      out_ext[d + shift] = spec.extents[m];
      continue;
    }
    const auto L = self.size(d);
    const auto ext = default_split(out_shape[d + shift], spec.mesh->size(mesh_dim));
    comm::RowRequests want;
    int64_t first = 0;
    for (auto e : ext) {
      std::vector<int64_t> rows;
      for (int64_t j = first; j < first + e; ++j) rows.push_back(j % L);
      first += e;
      want.push_back(std::move(rows));
    }
    local = comm::gather_rows(local, d, spec.extents[m], want, *spec.mesh, mesh_dim);
    reps[d + shift] = 1;
    out_ext[d + shift] = ext;
  }
  return wrap(local.repeat(reps), spec.mesh, out_p, out_shape, out_ext);
}

// slice_backward(grad, input_sizes, dim, start, end, step): zeros of the input's global shape with `grad`
// placed at the slice. Along a sharded dim the output extents are chosen so every rank's range holds exactly
// its own gradient rows (no communication).
// slice_backward(Tensor grad_output, SymInt[] input_sizes, int dim, SymInt start, SymInt end, SymInt step)
at::Tensor slice_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef sym_sizes, int64_t dim_arg,
                               c10::SymInt start, c10::SymInt end, c10::SymInt step_arg) {
  auto grad = resolve_partial(grad_output);
  const auto input_sizes = concrete_ints(sym_sizes);
  const auto ndim = static_cast<int64_t>(input_sizes.size());
  const auto dim = wrap_dim(dim_arg, ndim);
  const auto step = concrete_int(step_arg);
  const auto r = normalize_slice(input_sizes[dim], concrete_int(start), concrete_int(end), step);
  const auto& spec = spec_of(grad);
  const auto& mesh = *spec.mesh;
  std::vector<int64_t> out_shape(input_sizes.begin(), input_sizes.end());
  DimExtents out_ext = spec.dim_extents();
  auto local_sizes = spec.local_shape;
  local_sizes[dim] = input_sizes[dim];
  int64_t local_start = r.start, local_end = r.end;
  const auto m = spec.mesh_dim_of(dim);
  if (m >= 0) {
    const auto n = mesh.size(m);
    std::vector<int64_t> bounds(n + 1);
    bounds[0] = 0;
    bounds[n] = input_sizes[dim];
    for (int64_t c = 1; c < n; ++c) bounds[c] = std::min(r.start + step * spec.offset_of(m, c), input_sizes[dim]);
    std::vector<int64_t> ext(n);
    for (int64_t c = 0; c < n; ++c) ext[c] = bounds[c + 1] - bounds[c];
    const auto me = mesh.coordinate(m);
    local_sizes[dim] = ext[me];
    const auto first = r.start + step * spec.offset_of(m, me);
    local_start = first - bounds[me];
    local_end = local_start + (spec.extents[m][me] > 0 ? (spec.extents[m][me] - 1) * step + 1 : 0);
    out_ext[dim] = ext;
  }
  const auto& g = shard_impl(grad)->local();
  auto out = at::zeros(local_sizes, g.options());
  if (g.numel() > 0) out.slice(dim, local_start, local_end, step).copy_(g);
  return wrap(out, spec.mesh, spec.placements, out_shape, out_ext);
}

// select_backward(grad, input_sizes, dim, index): zeros with `grad` at `index`; a sharded `dim` uses the
// default split and only the owner of `index` writes (grad is replicated along that mesh dim).
// select_backward(Tensor grad_output, SymInt[] input_sizes, int dim, SymInt index)
at::Tensor select_backward_rule(const at::Tensor& grad_output, c10::SymIntArrayRef sym_sizes, int64_t dim_arg,
                                c10::SymInt index_arg) {
  auto grad = resolve_partial(grad_output);
  const auto input_sizes = concrete_ints(sym_sizes);
  const auto ndim = static_cast<int64_t>(input_sizes.size());
  const auto dim = wrap_dim(dim_arg, ndim);
  auto index = concrete_int(index_arg);
  if (index < 0) index += input_sizes[dim];
  const auto& gspec = spec_of(grad);
  Placements out_p = gspec.placements;
  DimExtents out_ext;
  for (size_t m = 0; m < out_p.size(); ++m)
    if (out_p[m].is_shard()) {
      auto nd = out_p[m].dim >= dim ? out_p[m].dim + 1 : out_p[m].dim;
      out_ext[nd] = gspec.extents[m];
      out_p[m] = Placement::shard(nd);
    }
  std::vector<int64_t> out_shape(input_sizes.begin(), input_sizes.end());
  auto local_sizes = gspec.local_shape;
  local_sizes.insert(local_sizes.begin() + dim, input_sizes[dim]);
  const auto& g = shard_impl(grad)->local();
  auto out = at::zeros(local_sizes, g.options());
  out.select(dim, index).copy_(g);
  return wrap(out, gspec.mesh, out_p, out_shape, out_ext);
}

// A local reinterpretation. A change of element size rescales the last dim; when that dim is sharded its extents
// scale alike (a larger element needs every extent divisible by the ratio).
// view.dtype(Tensor(a) self, ScalarType dtype)
at::Tensor view_dtype_rule(const at::Tensor& self_arg, at::ScalarType dtype) {
  auto self = resolve_partial(self_arg);
  const auto& spec = spec_of(self);
  const auto from = static_cast<int64_t>(c10::elementSize(self.scalar_type()));
  const auto to = static_cast<int64_t>(c10::elementSize(dtype));
  auto out_shape = self.sizes().vec();
  DimExtents out_ext = spec.dim_extents();
  if (from != to && self.dim() > 0) {
    const auto last = self.dim() - 1;
    auto scale = [&](int64_t n) { return to < from ? n * (from / to) : n / (to / from); };
    TORCH_CHECK(to < from || out_shape[last] % (to / from) == 0, "self.size(-1) must be divisible by ", to / from,
                " to view ", self.scalar_type(), " as ", dtype, " (different element sizes), but got ", out_shape[last]);
    out_shape[last] = scale(out_shape[last]);
    if (auto it = out_ext.find(last); it != out_ext.end()) {
      for (auto e : it->second)
        if (to > from && e % (to / from) != 0) {
          dispatch::not_implemented("the last dim is sharded with extents that are not multiples of " +
                                    std::to_string(to / from) +
                                    " (the element size grows); redistribute it to Replicate() first");
        }
      for (auto& e : it->second) e = scale(e);
    }
  }
  auto out = shard_impl(self)->local().view(dtype);
  return wrap(out, spec.mesh, spec.placements, out_shape, out_ext);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(view) {
  dispatch::set_handler("aten::view", typed_handler(&view_rule));
  dispatch::set_handler("aten::view.dtype", typed_handler(&view_dtype_rule));
  dispatch::set_handler("aten::_unsafe_view", typed_handler(&unsafe_view_rule));
  dispatch::set_handler("aten::_reshape_alias", typed_handler(&reshape_alias_rule));
  dispatch::set_handler("aten::permute", typed_handler(&permute_rule));
  dispatch::set_handler("aten::transpose.int", typed_handler(&transpose_rule));
  dispatch::set_handler("aten::t", typed_handler(&t_rule));
  dispatch::set_handler("aten::unsqueeze", typed_handler(&unsqueeze_rule));
  dispatch::set_handler("aten::squeeze", typed_handler(&squeeze_rule));
  dispatch::set_handler("aten::squeeze.dim", typed_handler(&squeeze_dim_rule));
  dispatch::set_handler("aten::squeeze.dims", typed_handler(&squeeze_dims_rule));
  dispatch::set_handler("aten::expand", typed_handler(&expand_rule));
  dispatch::set_handler("aten::slice.Tensor", typed_handler(&slice_rule));
  dispatch::set_handler("aten::select.int", typed_handler(&select_rule));
  dispatch::set_handler("aten::split.Tensor", typed_handler(&split_rule));
  dispatch::set_handler("aten::split_with_sizes", typed_handler(&split_with_sizes_rule));
  dispatch::set_handler("aten::unbind.int", typed_handler(&unbind_rule));
  dispatch::set_handler("aten::cat", typed_handler(&cat_rule));
  dispatch::set_handler("aten::stack", typed_handler(&stack_rule));
  dispatch::set_handler("aten::repeat", typed_handler(&repeat_rule));
  dispatch::set_handler("aten::slice_backward", typed_handler(&slice_backward_rule));
  dispatch::set_handler("aten::select_backward", typed_handler(&select_backward_rule));
}

} // namespace shardtensor::ops
