// Ops that work along given dims: sort, topk, cummax / cummin (cumsum, cumprod and logcumsumexp scan sharded dims:
// loss.cpp) and view_as_real / view_as_complex. Along dims that are not sharded they run on the local shards and
// every output keeps the input's layout. topk along a sharded dim merges every rank's own top k (one gathered
// collective of k candidates per rank); cummax / cummin scan their own rows and take the lower ranks' carry (one
// gathered collective of each rank's last values); sort along a sharded dim is a distributed sort (sort_sharded.cpp).
// The FFT kernels behind torch.fft.* have their own rule (fft.cpp).
#include "comm/stat_reduce.h"
#include "ops/arg_checks.h"
#include "ops/concrete_ints.h"
#include "ops/common.h"
#include "ops/empty_shard.h"
#include "ops/sort_sharded.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace shardtensor::ops {

namespace {

// Which dims an op works along: the one its `dim` argument names, none, or the last dim.
enum class Along { dim_arg, none, last };

// The dims of `self` (`ndim` >= 1) that the op works along, wrapped.
std::vector<int64_t> dims_along(Along along, const dispatch::NamedArgs& args, int64_t ndim) {
  std::vector<int64_t> dims;
  switch (along) {
    case Along::dim_arg: dims.push_back(wrap_dim(args["dim"].toInt(), ndim)); break;
    case Along::last: dims.push_back(ndim - 1); break;
    case Along::none: break;
  }
  return dims;
}

// Generic over ops whose argument lists differ (sort.stable's `dim` follows a keyword `stable`, topk's follows `k`):
// boxed, reading `self` and `dim` by name, and re-calling the op that ran with the local tensor. `linear`: the op is
// linear in `self` (view_as_real / view_as_complex), so a pending sum stays pending (the real and imaginary parts of
// a Partial spectrum); the sorts need complete values.
void along_dims_handler(Along along, bool linear, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  auto self = linear ? args.tensor("self") : resolve_partial(args.tensor("self"));
  const auto& spec = *shard_impl(self)->spec();
  const auto ndim = std::max<int64_t>(self.dim(), 1);
  const auto dims = dims_along(along, args, ndim);
  const bool is_sort = op.schema().name() == "aten::sort";
  for (auto d : dims)
    if (spec.mesh_dim_of(d) >= 0) {
      if (is_sort) {
        // A distributed sort (sort_sharded.cpp): nothing whole along the dim on any rank.
        auto [values, indices] = sort_sharded(self, d, args["descending"].toBool());
        torch::jit::drop(*stack, args.all().size());
        torch::jit::push(*stack, std::move(values), std::move(indices));
        return;
      }
      dispatch::not_implemented(op, stack, "it works along sharded dim " + std::to_string(d) +
                                               ", which needs the whole dim on one rank; redistribute that dim to "
                                               "Replicate() first");
    }
  // A rank whose shard is empty along a sharded dim runs the op on a stand-in row (ops/empty_shard.h).
  const auto in = stand_in_for_empty_shard(shard_impl(self)->local().resolve_conj().resolve_neg(), spec);
  const auto& local = in.local;
  args.set("self", local);
  op.callBoxed(stack);
  // Outputs: the input's layout (sharded dims precede the dims an op adds or drops); the sizes of the other dims
  // come from the local result.
  const auto nret = op.schema().returns().size();
  const auto ext = spec.dim_extents();
  for (size_t r = 0; r < nret; ++r) {
    auto& out = (*stack)[stack->size() - nret + r];
    auto local = in.trim(out.toTensor());
    auto shape = local.sizes().vec();
    for (const auto& [d, e] : ext) {
      int64_t n = 0;
      for (auto v : e) n += v;
      shape[d] = n;
    }
    out = wrap(local, spec.mesh, spec.placements, shape, ext);
  }
}

// ---- topk along a sharded dim ----
// Every rank takes the top min(k, extent) of its own rows (global indices), the candidates of the mesh dim's ranks
// are gathered in one collective (k per rank: P·k values and indices, never the dim itself), and every rank merges
// them alike, in coordinate order. The result is whole along `dim` (its k entries) and keeps the input's other
// shards. Its gradient scatters into each rank's own rows only (selection_grad.cpp): no rank builds the whole dim.
std::tuple<at::Tensor, at::Tensor> topk_sharded(const at::Tensor& self_in, int64_t k, int64_t dim, bool largest) {
  auto self = resolve_partial(self_in);
  const auto& spec = *shard_impl(self)->spec();
  const auto& mesh = *spec.mesh;
  const auto m = spec.mesh_dim_of(dim);
  const auto& extents = spec.extents[m];
  const auto coord = mesh.coordinate(m);
  const auto& local = shard_impl(self)->local();
  const auto own = std::min(k, extents[coord]);
  auto [lv, li] = at::topk(local, own, dim, largest, /*sorted=*/true);
  // Padded to k along `dim` so every rank's part has one shape; the padding is dropped by count below.
  auto shape = local.sizes().vec();
  shape[dim] = k;
  auto pv = at::zeros(shape, lv.options());
  auto pi = at::zeros(shape, li.options());
  pv.narrow(dim, 0, own).copy_(lv);
  pi.narrow(dim, 0, own).copy_(li.add(spec.offset_of(m, coord)));
  comm::StatReduce r;
  const auto values = r.gathered(pv), indices = r.gathered(pi);
  r.run(mesh, {m});
  std::vector<at::Tensor> cand_v, cand_i;
  for (size_t j = 0; j < extents.size(); ++j) {
    const auto n = std::min(k, extents[j]);
    cand_v.push_back(r.result(values)[0].select(0, static_cast<int64_t>(j)).narrow(dim, 0, n));
    cand_i.push_back(r.result(indices)[0].select(0, static_cast<int64_t>(j)).narrow(dim, 0, n));
  }
  auto [v, pos] = at::topk(at::cat(cand_v, dim), k, dim, largest, /*sorted=*/true);
  auto idx = at::gather(at::cat(cand_i, dim), dim, pos);
  auto placements = spec.placements;
  placements[m] = Placement::replicate();
  auto out_shape = self.sizes().vec();
  out_shape[dim] = k;
  auto ext = spec.dim_extents();
  ext.erase(dim);
  return {wrap(v, spec.mesh, placements, out_shape, ext), wrap(idx, spec.mesh, placements, out_shape, ext)};
}

// ---- cummax / cummin along a sharded dim ----
// Each rank scans its own rows, then takes the carry of the lower ranks: their last running values and indices,
// gathered in one collective and combined in coordinate order as the single-device scan does (a later element
// replaces the running one when it is NaN, or when neither is NaN and it is >= (max) / <= (min) — ties take the
// later index). Where the carry still wins over the rank's own running value, it replaces it.
at::Tensor later_wins(const at::Tensor& later, const at::Tensor& running, bool is_max) {
  auto beats = is_max ? later.ge(running) : later.le(running);
  return at::isnan(later).logical_or(at::isnan(running).logical_not().logical_and(beats));
}

std::tuple<at::Tensor, at::Tensor> cum_extreme_sharded(const at::Tensor& self_in, int64_t dim, bool is_max) {
  auto self = resolve_partial(self_in);
  const auto& spec = *shard_impl(self)->spec();
  const auto& mesh = *spec.mesh;
  const auto m = spec.mesh_dim_of(dim);
  const auto coord = mesh.coordinate(m);
  const auto& extents = spec.extents[m];
  const auto n = extents[coord];
  const auto& local = shard_impl(self)->local();
  const auto longs = local.options().dtype(at::kLong);
  at::Tensor v, i;
  if (n > 0) {
    std::tie(v, i) = is_max ? at::cummax(local, dim) : at::cummin(local, dim);
    i = i + spec.offset_of(m, coord);
  } else {
    v = local.clone();
    i = at::empty(local.sizes(), longs);
  }
  auto shape = local.sizes().vec();
  shape[dim] = 1;
  comm::StatReduce r;
  const auto tv = r.gathered(n > 0 ? v.narrow(dim, n - 1, 1).contiguous() : at::zeros(shape, local.options()));
  const auto ti = r.gathered(n > 0 ? i.narrow(dim, n - 1, 1).contiguous() : at::zeros(shape, longs));
  r.run(mesh, {m});
  at::Tensor cv, ci;  // the lower ranks' carry (undefined: none)
  for (int64_t j = 0; j < coord; ++j) {
    if (extents[j] == 0) continue;
    auto xv = r.result(tv)[0].select(0, j), xi = r.result(ti)[0].select(0, j);
    if (!cv.defined()) {
      cv = xv, ci = xi;
      continue;
    }
    auto later = later_wins(xv, cv, is_max);
    cv = at::where(later, xv, cv);
    ci = at::where(later, xi, ci);
  }
  if (cv.defined() && n > 0) {
    auto own = later_wins(v, cv, is_max);
    v = at::where(own, v, cv);
    i = at::where(own, i, ci);
  }
  return {wrap(v, spec.mesh, spec.placements, self.sizes().vec(), spec.dim_extents()),
          wrap(i, spec.mesh, spec.placements, self.sizes().vec(), spec.dim_extents())};
}

// cummax(Tensor self, int dim) / cummin(...) -> (Tensor values, Tensor indices)
void cum_extreme_handler(bool is_max, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (self.dim() == 0) return along_dims_handler(Along::dim_arg, /*linear=*/false, op, stack);
  const auto dim = wrap_dim(args["dim"].toInt(), self.dim());
  if (shard_impl(self)->spec()->mesh_dim_of(dim) < 0)
    return along_dims_handler(Along::dim_arg, /*linear=*/false, op, stack);
  auto [v, i] = cum_extreme_sharded(self, dim, is_max);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(v), std::move(i));
}

// topk(Tensor self, SymInt k, int dim=-1, bool largest=True, bool sorted=True) -> (Tensor values, Tensor indices)
void topk_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  const auto ndim = std::max<int64_t>(self.dim(), 1);
  const auto dim = wrap_dim(args["dim"].toInt(), ndim);
  if (self.dim() == 0 || shard_impl(self)->spec()->mesh_dim_of(dim) < 0)
    return along_dims_handler(Along::dim_arg, /*linear=*/false, op, stack);
  const auto k = concrete_int(args["k"].toSymInt());
  const bool largest = args["largest"].toBool();
  check_topk_args(self, k, dim);
  auto [v, i] = topk_sharded(self, k, dim, largest);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(v), std::move(i));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(sort_fft) {
  auto rule = [](Along along, bool linear = false) {
    return [along, linear](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
      along_dims_handler(along, linear, op, stack);
    };
  };
  // Along `dim` (sort, sort.stable, topk, the scans).
  for (const char* name : {"aten::sort", "aten::sort.stable"}) dispatch::set_handler(name, rule(Along::dim_arg));
  // cummax / cummin scan a sharded dim with the lower ranks' carry; their autograd rule: selection_grad.cpp.
  dispatch::set_handler("aten::cummax", [](const c10::OperatorHandle& op, torch::jit::Stack* s) {
    cum_extreme_handler(true, op, s);
  });
  dispatch::set_handler("aten::cummin", [](const c10::OperatorHandle& op, torch::jit::Stack* s) {
    cum_extreme_handler(false, op, s);
  });
  // topk along a sharded dim merges the ranks' candidates; its gradient stays in each rank's rows.
  dispatch::set_handler("aten::topk", topk_handler);  // its autograd rule: selection_grad.cpp
  // Complex <-> real pairs: view_as_real appends a dim of 2, view_as_complex consumes the last dim.
  dispatch::set_handler("aten::view_as_real", rule(Along::none, /*linear=*/true));
  dispatch::set_handler("aten::view_as_complex", rule(Along::last, /*linear=*/true));
}

} // namespace shardtensor::ops
