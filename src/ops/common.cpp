#include "ops/common.h"

#include <shardtensor/shard_tensor.h>

#include <algorithm>

#include "comm/collectives.h"
#include "comm/stat_reduce.h"
#include "dispatch/args.h"
#include "dispatch/promote.h"

namespace shardtensor::ops {

Placements placements_of(const at::Tensor& t, const MeshPtr& mesh) {
  if (auto* impl = shard_impl(t)) return impl->spec()->placements;
  return Placements(mesh->ndim(), Placement::replicate());
}

at::Tensor whole_value(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  if (!impl) return t;
  const auto& mesh = impl->spec()->mesh;
  return local_as(t, mesh, Placements(mesh->ndim(), Placement::replicate()), {});
}

at::Tensor local_as(const at::Tensor& t, const MeshPtr& mesh, const Placements& want, const DimExtents& ext) {
  if (auto* impl = shard_impl(t)) {
    const auto& spec = *impl->spec();
    if (spec.placements == want) {
      bool same = true;
      for (size_t m = 0; m < want.size(); ++m)
        if (want[m].is_shard()) {
          auto it = ext.find(want[m].dim);
          if (it != ext.end() && it->second != spec.extents[m]) same = false;
        }
      if (same) return impl->local();
    }
    auto dst = ShardSpec::make_with_dim_extents(mesh, want, spec.global_shape, ext);
    return shard_impl(redistribute_to(t, dst))->local();
  }
  // Plain = Replicate: slice the sharded dims.
  at::Tensor local = t;
  bool sliced = false;
  for (size_t m = 0; m < want.size(); ++m) {
    if (!want[m].is_shard()) {
      TORCH_INTERNAL_ASSERT(!want[m].is_partial(), "local_as: a plain tensor cannot be Partial");
      continue;
    }
    const auto d = want[m].dim;
    auto it = ext.find(d);
    const auto extents = it != ext.end() ? it->second : default_split(t.size(d), mesh->size(m));
    const auto coord = mesh->coordinate(static_cast<int64_t>(m));
    int64_t off = 0;
    for (int64_t i = 0; i < coord; ++i) off += extents[i];
    local = local.narrow(d, off, extents[coord]);
    sliced = true;
  }
  return sliced ? local : t;
}

at::Tensor local_in(const at::Tensor& t, const MeshPtr& mesh, const Placements& want, const DimExtents& ext) {
  return local_as(resolve_partial(dispatch::as_shard(t, mesh)), mesh, want, ext);
}

at::Tensor resolve_partial(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  if (!impl || !impl->spec()->has_partial()) return t;
  return redistribute_to(t, without_partial(impl->spec()));
}

at::Tensor scatter_partial(const at::Tensor& t, const std::vector<int64_t>& keep_whole) {
  auto* impl = shard_impl(t);
  if (!impl || !impl->spec()->has_partial()) return t;
  const auto& spec = *impl->spec();
  auto placements = spec.placements;
  auto ext = spec.dim_extents();
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_partial()) continue;
    const auto ranks = spec.mesh->size(static_cast<int64_t>(m));
    // A tensor of 4 or more dims is read as channels-first (N, C, spatial...): a spatial dim first, so a field
    // stays divided over its domain (an inverse spherical harmonic transform's pending sum lands on latitude, not on
    // the channels, whose split would leave every following 1x1 convolution a pending sum); else any dim.
    int64_t best = -1;
    for (int64_t first : {spec.ndim() >= 4 ? int64_t{2} : int64_t{0}, int64_t{0}}) {
      for (int64_t d = first; d < spec.ndim(); ++d) {
        if (std::find(keep_whole.begin(), keep_whole.end(), d) != keep_whole.end() || ext.count(d)) continue;
        if (spec.global_shape[d] < ranks) continue;
        if (best < 0 || spec.global_shape[d] > spec.global_shape[best]) best = d;
      }
      if (best >= 0) break;
    }
    if (best < 0) {
      placements[m] = Placement::replicate();
      continue;
    }
    placements[m] = Placement::shard(best);
    ext[best] = default_split(spec.global_shape[best], ranks);
  }
  return redistribute_to(t, ShardSpec::make_with_dim_extents(spec.mesh, placements, spec.global_shape, ext));
}

namespace {

// The complete value of a Partial ShardTensor, kept in the TensorImpl's slot for a backend's own metadata
// (c10::BackendMeta, shared by detached aliases, which share the version counter too). Valid while neither the
// wrapper nor its local tensor has been modified or replaced since.
struct ResolvedValue : c10::BackendMeta {
  ResolvedValue(at::Tensor value, const at::Tensor& t, const at::Tensor& local)
      : value(std::move(value)), local(local.getIntrusivePtr()), version(t._version()),
        local_version(local._version()) {}
  at::Tensor value;
  c10::weak_intrusive_ptr<c10::TensorImpl> local;
  int64_t version, local_version;
};

} // namespace

at::Tensor resolve_partial_once(const at::Tensor& t, bool keep) {
  auto* impl = shard_impl(t);
  if (!impl || !impl->spec()->has_partial()) return t;
  const auto& local = impl->local();
  // Inference tensors have no version counter: nothing is attached to them.
  const bool versioned = !t.is_inference() && !local.is_inference();
  if (versioned) {
    if (auto* kept = dynamic_cast<ResolvedValue*>(t.unsafeGetTensorImpl()->get_backend_meta())) {
      if (kept->version == t._version() && kept->local_version == local._version() &&
          kept->local.lock().get() == local.unsafeGetTensorImpl())
        return kept->value;
    }
  }
  auto value = resolve_partial(t);
  if (keep && versioned) {
    t.unsafeGetTensorImpl()->set_backend_meta(c10::make_intrusive<ResolvedValue>(value, t, local));
  }
  return value;
}

} // namespace shardtensor::ops

namespace shardtensor::ops {
at::Tensor local_aligned(const at::Tensor& t, const MeshPtr& mesh, at::IntArrayRef out_shape, const Placements& target,
                         const DimExtents& target_ext) {
  const auto shift = static_cast<int64_t>(out_shape.size()) - t.dim();
  Placements want(target.size(), Placement::replicate());
  DimExtents ext;
  for (size_t m = 0; m < target.size(); ++m) {
    const auto& p = target[m];
    if (p.is_shard()) {
      const auto d_in = p.dim - shift;
      if (d_in >= 0 && t.size(d_in) == out_shape[p.dim]) {
        want[m] = Placement::shard(d_in);
        auto it = target_ext.find(p.dim);
        ext[d_in] = it != target_ext.end() ? it->second : default_split(out_shape[p.dim], mesh->size(static_cast<int64_t>(m)));
      }
    } else if (p.is_partial() && placements_of(t, mesh)[m].is_partial()) {
      want[m] = p;
    }
  }
  return local_as(t, mesh, want, ext);
}
} // namespace shardtensor::ops

namespace shardtensor::ops {
at::Tensor sum_over_mesh_dims(at::Tensor t, const std::vector<int64_t>& mesh_dims, const Mesh& mesh) {
  if (mesh_dims.empty()) return t;
  comm::StatReduce r;
  const auto i = r.sum(t);
  r.run(mesh, mesh_dims);
  return r.result(i)[0];
}

std::vector<at::Tensor> fused_sum(const std::vector<at::Tensor>& terms, const std::vector<int64_t>& mesh_dims,
                                  const Mesh& mesh) {
  if (mesh_dims.empty()) return terms;
  comm::StatReduce r;
  for (const auto& t : terms) r.sum(t);
  r.run(mesh, mesh_dims);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < terms.size(); ++i) out.push_back(r.result(i)[0]);
  return out;
}

bool sum_param_grads(std::vector<at::Tensor>& terms, const std::vector<at::Tensor>& params,
                     const std::vector<int64_t>& mesh_dims, const Mesh& mesh) {
  bool any = false, pending = !mesh_dims.empty();
  for (size_t i = 0; i < terms.size(); ++i) {
    if (!terms[i].defined()) continue;
    any = true;
    pending = pending && i < params.size() && dispatch::param_grad_deferrable(params[i]);
  }
  if (any && pending) return true;
  terms = fused_sum(terms, mesh_dims, mesh);
  return false;
}
} // namespace shardtensor::ops

namespace shardtensor::ops {

at::Tensor as_shard_input(const at::Tensor& t, const MeshPtr& mesh) {
  if (shard_impl(t)) return t;
  if (t.requires_grad() && at::GradMode::is_enabled()) return dispatch::promote_to_replicate(t, mesh);
  return dispatch::as_shard(t, mesh);
}

at::Tensor resolve_partial_diff(const at::Tensor& t) {
  auto* i = shard_impl(t);
  if (!i->spec()->has_partial()) return t;
  auto spec = without_partial(i->spec());
  return redistribute(t, spec->placements, spec->sharding_shapes());
}

at::Tensor recorded_param_grad(const at::Tensor& grad, const at::Tensor& param) {
  return shard_impl(grad) && !shard_impl(param) ? full_tensor(grad) : grad;
}

at::Tensor to_layout(const at::Tensor& t, const Placements& placements, const DimExtents& extents) {
  const auto& spec = *shard_impl(t)->spec();
  auto dst = ShardSpec::make_with_dim_extents(spec.mesh, placements, spec.global_shape, extents);
  if (dst->same_layout(spec)) return t;
  return redistribute(t, dst->placements, dst->sharding_shapes());
}

int64_t shard_count(const at::Tensor& t) {
  const auto* impl = shard_impl(t);
  if (!impl) return 0;
  int64_t n = 0;
  for (const auto& p : impl->spec()->placements) n += p.is_shard() ? 1 : 0;
  return n;
}

int64_t leading_split(const ShardSpec& spec) {
  int64_t mesh_dim = -1;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const auto& p = spec.placements[m];
    if (p.is_partial() || (p.is_shard() && mesh_dim >= 0)) return -1;
    if (!p.is_shard()) continue;
    for (int64_t d = 0; d < p.dim; ++d)
      if (spec.global_shape[d] != 1) return -1;
    mesh_dim = static_cast<int64_t>(m);
  }
  return mesh_dim;
}

std::vector<int64_t> nearest_aligned(const std::vector<int64_t>& extents, int64_t n, int64_t q) {
  std::vector<int64_t> out;
  int64_t bound = 0, prev = 0;
  for (size_t c = 0; c < extents.size(); ++c) {
    bound += extents[c];
    int64_t b = bound - bound % q;
    if (2 * (bound % q) > q) b += q;
    if (c + 1 == extents.size()) b = n;
    out.push_back(b - prev);
    prev = b;
  }
  return out;
}

int64_t largest_dim_for_split(at::IntArrayRef sizes, int64_t at_least, const std::function<bool(int64_t)>& may_take) {
  int64_t best = -1;
  for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d)
    if (sizes[d] >= at_least && may_take(d) && (best < 0 || sizes[d] > sizes[best])) best = d;
  return best;
}

std::optional<at::Tensor> split_on_leading_dim(const at::Tensor& t) {
  const auto& spec = *shard_impl(t)->spec();
  int64_t m = -1;
  for (size_t j = 0; j < spec.placements.size(); ++j) {
    TORCH_INTERNAL_ASSERT(!spec.placements[j].is_partial(), "split_on_leading_dim: complete the pending sum first");
    if (!spec.placements[j].is_shard()) continue;
    if (m >= 0) return std::nullopt;
    m = static_cast<int64_t>(j);
  }
  if (m < 0) return std::nullopt;
  int64_t lead = 0;
  while (lead < t.dim() && spec.global_shape[lead] == 1) ++lead;
  if (lead >= t.dim()) return std::nullopt;
  Placements p = spec.placements;
  p[m] = Placement::shard(lead);
  DimExtents ext{{lead, default_split(spec.global_shape[lead], spec.mesh->size(m))}};
  return wrap(local_as(t, spec.mesh, p, ext), spec.mesh, p, spec.global_shape, ext);
}

std::optional<at::Tensor> one_split_on(const at::Tensor& t, int64_t dim) {
  const auto& spec = *shard_impl(t)->spec();
  int64_t keep = spec.mesh_dim_of(dim);
  for (size_t j = 0; j < spec.placements.size() && keep < 0; ++j)
    if (spec.placements[j].is_shard()) keep = static_cast<int64_t>(j);
  if (keep < 0) return std::nullopt;
  Placements p(spec.placements.size(), Placement::replicate());
  p[keep] = Placement::shard(dim);
  DimExtents ext{{dim, spec.mesh_dim_of(dim) == keep ? spec.extents[keep]
                                                     : default_split(spec.global_shape[dim], spec.mesh->size(keep))}};
  if (p == spec.placements) return std::nullopt;
  return wrap(local_as(t, spec.mesh, p, ext), spec.mesh, p, spec.global_shape, ext);
}

std::optional<at::Tensor> one_split_on_leading_dim(const at::Tensor& t) {
  const auto& spec = *shard_impl(t)->spec();
  int64_t lead = 0;
  while (lead < t.dim() && spec.global_shape[lead] == 1) ++lead;
  if (lead >= t.dim()) return std::nullopt;
  return one_split_on(t, lead);
}

std::optional<std::pair<Placements, DimExtents>> split_moved_layout(const ShardSpec& spec, at::IntArrayRef sizes,
                                                                    int64_t dim,
                                                                    const std::function<bool(int64_t)>& may_take) {
  const auto m = spec.mesh_dim_of(dim);
  if (m < 0) return std::nullopt;
  const auto P = spec.mesh->size(m);
  const auto other = largest_dim_for_split(sizes, P, [&](int64_t d) {
    return d != dim && spec.mesh_dim_of(d) < 0 && (!may_take || may_take(d));
  });
  if (other < 0) return std::nullopt;
  Placements p = spec.placements;
  p[m] = Placement::shard(other);
  auto ext = spec.dim_extents();
  ext.erase(dim);
  ext[other] = default_split(sizes[other], P);
  return std::make_pair(std::move(p), std::move(ext));
}

std::optional<at::Tensor> split_moved_off(const at::Tensor& t, int64_t dim,
                                          const std::function<bool(int64_t)>& may_take) {
  const auto& spec = *shard_impl(t)->spec();
  auto layout = split_moved_layout(spec, t.sizes(), dim, may_take);
  if (!layout) return std::nullopt;
  const auto& [p, ext] = *layout;
  return wrap(local_as(t, spec.mesh, p, ext), spec.mesh, p, spec.global_shape, ext);
}

} // namespace shardtensor::ops
