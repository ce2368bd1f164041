// Ops that work along given dims: sort, topk, cummax / cummin (cumsum, cumprod and logcumsumexp scan sharded dims:
// loss.cpp) and view_as_real / view_as_complex. Along dims that are not sharded they run on the local shards and
// every output keeps the input's layout; along a sharded dim they raise with the remedy (each needs the whole dim: a
// distributed sort is not implemented). The FFT kernels behind torch.fft.* have their own rule (fft.cpp).
#include "ops/common.h"
#include "ops/empty_shard.h"

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
// boxed, reading `self` and `dim` by name, and re-calling the op that ran with the local tensor.
void along_dims_handler(Along along, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  auto self = resolve_partial(args.tensor("self"));
  const auto& spec = *shard_impl(self)->spec();
  const auto ndim = std::max<int64_t>(self.dim(), 1);
  const auto dims = dims_along(along, args, ndim);
  for (auto d : dims)
    if (spec.mesh_dim_of(d) >= 0) {
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

} // namespace

SHARDTENSOR_RULE_FAMILY(sort_fft) {
  auto rule = [](Along along) {
    return [along](const c10::OperatorHandle& op, torch::jit::Stack* stack) { along_dims_handler(along, op, stack); };
  };
  // Along `dim` (sort, sort.stable, topk, the scans).
  for (const char* name : {"aten::sort", "aten::sort.stable", "aten::topk", "aten::cummax", "aten::cummin"})
    dispatch::set_handler(name, rule(Along::dim_arg));
  // Complex <-> real pairs: view_as_real appends a dim of 2, view_as_complex consumes the last dim.
  dispatch::set_handler("aten::view_as_real", rule(Along::none));
  dispatch::set_handler("aten::view_as_complex", rule(Along::last));
}

} // namespace shardtensor::ops
