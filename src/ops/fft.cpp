// FFTs along sharded dims (the aten kernels behind torch.fft.*: _fft_r2c, _fft_c2c, _fft_c2r) by pencil transposes:
// before a transform, every mesh dim that shards a transformed dim moves its shard to a dim that is not
// transformed (one all-to-all each, decided from the spec alone), then the transform runs on the local tensor and
// the result keeps that transposed layout (the next op handles any layout; an inverse transform moves the shard
// back only if it must). When no untransformed dim can take a shard (a 1-D signal, every dim transformed), the
// transform is split into stages over disjoint dims — a multi-dim FFT is separable — and the shard moves between
// the stages' dims: r2c = r2c(last) then c2c(rest); c2r = c2c(rest) then c2r(last); c2c = c2c(whole dims) then
// c2c(the others). Each stage applies the normalization to its own dims, so the product is the requested one.
// A 1-D transform whose split no other dim can take (a long signal split along its only dim) runs the four-step
// algorithm instead (fft_four_step.h). Transforms along unsharded dims only run on the local shards, layout kept.
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/empty_shard.h"
#include "ops/fft_four_step.h"

#include <ATen/ops/_fft_c2c.h>
#include <ATen/ops/_fft_c2r.h>
#include <ATen/ops/_fft_r2c.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <set>

namespace shardtensor::ops {

namespace {

using LocalTransform = std::function<at::Tensor(const at::Tensor& local, const std::vector<int64_t>& dims)>;

const ShardSpec& spec_of(const at::Tensor& t) {
  return *shard_impl(t)->spec();
}

std::vector<int64_t> wrapped(at::IntArrayRef dims, int64_t ndim) {
  std::vector<int64_t> out;
  for (auto d : dims) out.push_back(wrap_dim(d, ndim));
  return out;
}

bool any_sharded(const ShardSpec& spec, const std::vector<int64_t>& dims) {
  return std::any_of(dims.begin(), dims.end(), [&](int64_t d) { return spec.mesh_dim_of(d) >= 0; });
}

// Moves every shard of the `stage` dims onto another dim: first choice a dim no transform of this call touches
// (`transformed`), the largest; else a transformed dim outside this stage, the largest; ties to the lower dim. The
// choice depends on the spec only, so every rank issues the same all-to-alls.
// Without a target for some shard: nullopt (`op` null) or the not-implemented error naming `op`.
std::optional<at::Tensor> try_make_local(const at::Tensor& x, const std::vector<int64_t>& stage,
                                         const std::vector<int64_t>& transformed, const char* op) {
  const auto& spec = spec_of(x);
  auto placements = spec.placements;
  auto ext = spec.dim_extents();
  std::set<int64_t> busy;  // dims sharded now or chosen as targets
  for (const auto& p : placements)
    if (p.is_shard()) busy.insert(p.dim);
  bool moved = false;
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard() || std::find(stage.begin(), stage.end(), placements[m].dim) == stage.end()) continue;
    const auto ranks = spec.mesh->size(static_cast<int64_t>(m));
    int64_t best = -1;
    // An untransformed dim with at least one element per rank first (one all-to-all for the whole call), then a
    // transformed dim of another stage, then a small untransformed dim (a batch or channel of 1 would leave ranks
    // idle).
    auto rank_of = [&](int64_t d) {
      const bool untransformed = std::find(transformed.begin(), transformed.end(), d) == transformed.end();
      return untransformed && x.size(d) >= ranks ? 2 : untransformed ? 0 : 1;
    };
    auto better = [&](int64_t d) {
      if (best < 0) return true;
      if (rank_of(d) != rank_of(best)) return rank_of(d) > rank_of(best);
      return x.size(d) > x.size(best);
    };
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (busy.count(d) || std::find(stage.begin(), stage.end(), d) != stage.end()) continue;
      if (better(d)) best = d;
    }
    if (best < 0 && !op) return std::nullopt;
    if (best < 0)
      dispatch::not_implemented(std::string("the FFT (") + op + ") transforms sharded dim " +
                                std::to_string(placements[m].dim) +
                                " and no other dim can hold its shard during the transform (every dim is transformed "
                                "or already sharded); redistribute that dim to Replicate() first");
    ext.erase(placements[m].dim);
    placements[m] = Placement::shard(best);
    ext[best] = default_split(x.size(best), spec.mesh->size(static_cast<int64_t>(m)));
    busy.insert(best);
    moved = true;
  }
  if (!moved) return x;
  return redistribute_to(x, ShardSpec::make_with_dim_extents(spec.mesh, placements, x.sizes().vec(), ext));
}

at::Tensor make_local(const at::Tensor& x, const std::vector<int64_t>& stage, const std::vector<int64_t>& transformed,
                      const char* op) {
  return *try_make_local(x, stage, transformed, op);
}

// Runs `fn` on the local tensor of `x` (no transformed dim sharded) and wraps the result in `x`'s layout; the
// transformed dims' sizes come from the local result (an empty shard runs on a stand-in row: ops/empty_shard.h).
at::Tensor run_local(const at::Tensor& x, const std::vector<int64_t>& dims, const LocalTransform& fn) {
  const auto& spec = spec_of(x);
  const auto in = stand_in_for_empty_shard(shard_impl(x)->local().resolve_conj().resolve_neg(), spec);
  auto out = in.trim(fn(in.local, dims));
  auto shape = out.sizes().vec();
  const auto ext = spec.dim_extents();
  for (const auto& [d, e] : ext) {
    int64_t n = 0;
    for (auto v : e) n += v;
    shape[d] = n;
  }
  return wrap(out, spec.mesh, spec.placements, shape, ext);
}

struct Stage {
  std::vector<int64_t> dims;
  LocalTransform fn;
};

at::Tensor run_stages(const at::Tensor& self, const std::vector<int64_t>& dims, const std::vector<Stage>& staged,
                      const LocalTransform& whole, const char* op) {
  // A pending sum (a linear transform's input may be one) is completed into a shard of an untransformed dim.
  auto x = scatter_partial(self, dims);
  // One stage when every shard of a transformed dim can move to an untransformed dim.
  int64_t sharded_transformed = 0, free_dims = 0;
  const auto& spec = spec_of(x);
  for (auto d : dims) sharded_transformed += spec.mesh_dim_of(d) >= 0 ? 1 : 0;
  int64_t ranks = 1;
  for (auto d : dims)
    if (spec.mesh_dim_of(d) >= 0) ranks = std::max(ranks, spec.mesh->size(spec.mesh_dim_of(d)));
  for (int64_t d = 0; d < x.dim(); ++d)
    if (spec.mesh_dim_of(d) < 0 && std::find(dims.begin(), dims.end(), d) == dims.end() && x.size(d) >= ranks)
      ++free_dims;
  if (free_dims >= sharded_transformed) return run_local(make_local(x, dims, dims, op), dims, whole);
  for (const auto& s : staged) {
    if (s.dims.empty()) continue;
    // A stage whose shards cannot all move at once (a pencil: a 3-D transform of a volume split along two dims,
    // every other dim transformed or split) runs dim by dim -- the transforms are separable, normalization
    // included -- its unsplit dims first, then each split one after its shard moves to a dim transformed already
    // (one all-to-all each). Decided from the spec alone.
    if (s.dims.size() > 1) {
      if (auto local = try_make_local(x, s.dims, dims, nullptr)) {
        x = run_local(*local, s.dims, s.fn);
        continue;
      }
      std::vector<int64_t> unsplit;
      std::vector<std::vector<int64_t>> parts;
      for (auto d : s.dims) {
        if (spec_of(x).mesh_dim_of(d) >= 0) parts.push_back({d});
        else unsplit.push_back(d);
      }
      if (!unsplit.empty()) x = run_local(x, unsplit, s.fn);
      for (const auto& part : parts) x = run_local(make_local(x, part, dims, op), part, s.fn);
      continue;
    }
    x = run_local(make_local(x, s.dims, dims, op), s.dims, s.fn);
  }
  return x;
}

// _fft_r2c(Tensor self, int[] dim, int normalization, bool onesided) -> Tensor
at::Tensor fft_r2c_rule(const at::Tensor& self, at::IntArrayRef dim, int64_t normalization, bool onesided) {
  const auto dims = wrapped(dim, self.dim());
  auto whole = [=](const at::Tensor& l, const std::vector<int64_t>& d) {
    return at::_fft_r2c(l, d, normalization, onesided);
  };
  const auto x = scatter_partial(self, dims);
  if (!any_sharded(spec_of(x), dims)) return run_local(x, dims, whole);
  if (dims.size() == 1)
    if (auto out = four_step_r2c(x, dims[0], normalization, onesided)) return *out;
  const std::vector<int64_t> last{dims.back()}, rest(dims.begin(), dims.end() - 1);
  auto c2c = [=](const at::Tensor& l, const std::vector<int64_t>& d) { return at::_fft_c2c(l, d, normalization, true); };
  return run_stages(x, dims, {{last, whole}, {rest, c2c}}, whole, "_fft_r2c");
}

// _fft_c2r(Tensor self, int[] dim, int normalization, SymInt last_dim_size) -> Tensor
at::Tensor fft_c2r_rule(const at::Tensor& self, at::IntArrayRef dim, int64_t normalization, c10::SymInt last_dim_size) {
  const auto dims = wrapped(dim, self.dim());
  const auto n = concrete_int(last_dim_size);
  auto whole = [=](const at::Tensor& l, const std::vector<int64_t>& d) {
    return at::_fft_c2r(l, d, normalization, n);
  };
  const auto x = scatter_partial(self, dims);
  if (!any_sharded(spec_of(x), dims)) return run_local(x, dims, whole);
  if (dims.size() == 1)
    if (auto out = four_step_c2r(x, dims[0], normalization, n)) return *out;
  const std::vector<int64_t> last{dims.back()}, rest(dims.begin(), dims.end() - 1);
  auto c2c = [=](const at::Tensor& l, const std::vector<int64_t>& d) { return at::_fft_c2c(l, d, normalization, false); };
  return run_stages(x, dims, {{rest, c2c}, {last, whole}}, whole, "_fft_c2r");
}

// _fft_c2c(Tensor self, SymInt[] dim, int normalization, bool forward) -> Tensor
at::Tensor fft_c2c_rule(const at::Tensor& self, c10::SymIntArrayRef dim, int64_t normalization, bool forward) {
  const auto dims = wrapped(c10::IntArrayRef(concrete_ints(dim)), self.dim());
  auto whole = [=](const at::Tensor& l, const std::vector<int64_t>& d) {
    return at::_fft_c2c(l, d, normalization, forward);
  };
  const auto x = scatter_partial(self, dims);
  if (!any_sharded(spec_of(x), dims)) return run_local(x, dims, whole);
  if (dims.size() == 1)
    if (auto out = four_step_c2c(x, dims[0], normalization, forward)) return *out;
  std::vector<int64_t> local_dims, sharded_dims;
  for (auto d : dims) (spec_of(x).mesh_dim_of(d) >= 0 ? sharded_dims : local_dims).push_back(d);
  return run_stages(x, dims, {{local_dims, whole}, {sharded_dims, whole}}, whole, "_fft_c2c");
}

} // namespace

SHARDTENSOR_RULE_FAMILY(fft) {
  dispatch::set_handler("aten::_fft_r2c", typed_handler(&fft_r2c_rule));
  dispatch::set_handler("aten::_fft_c2r", typed_handler(&fft_c2r_rule));
  dispatch::set_handler("aten::_fft_c2c", typed_handler(&fft_c2c_rule));
}

} // namespace shardtensor::ops
