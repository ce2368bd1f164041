// Ops that work along given dims: sort, topk, the scans other than cumsum (cumprod, cummax, cummin,
// logcumsumexp), the FFT kernels (_fft_r2c, _fft_c2r, _fft_c2c, behind torch.fft.*) and view_as_real /
// view_as_complex. Along dims that are not sharded they run on the local shards and every output keeps the
// input's layout; along a sharded dim they raise with the remedy (each needs the whole dim: a distributed sort
// or FFT is not implemented).
#include "ops/common.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace shardtensor::ops {

namespace {

using dispatch::op_args;

// Where an op's dims are: one `int dim` argument, an `int[] dim` argument, none, or the last dim.
struct DimArg {
  enum Kind { Int, List, None, Last } kind;
  size_t index = 0;
};

void along_dims_handler(DimArg where, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto self = resolve_partial(args[0].toTensor());
  const auto& spec = *shard_impl(self)->spec();
  const auto ndim = std::max<int64_t>(self.dim(), 1);
  std::vector<int64_t> dims;
  switch (where.kind) {
    case DimArg::List:
      for (auto d : args[where.index].toDimVector()) dims.push_back(wrap_dim(d, ndim));
      break;
    case DimArg::Int: dims.push_back(wrap_dim(args[where.index].toInt(), ndim)); break;
    case DimArg::Last: dims.push_back(ndim - 1); break;
    case DimArg::None: break;
  }
  for (auto d : dims)
    if (spec.mesh_dim_of(d) >= 0) {
      dispatch::not_implemented(op, stack, "it works along sharded dim " + std::to_string(d) +
                                               ", which needs the whole dim on one rank; redistribute that dim to "
                                               "Replicate() first");
    }
  const auto base = stack->size() - args.size();
  // A rank whose shard is empty along a sharded dim runs the op on one row there (kernels such as MKL's FFT
  // refuse empty input that one device never passes them) and keeps none of the result.
  auto local = shard_impl(self)->local().resolve_conj().resolve_neg();
  std::vector<int64_t> emptied;
  for (const auto& [d, e] : spec.dim_extents())
    if (local.size(d) == 0 && local.numel() == 0) emptied.push_back(d);
  if (!emptied.empty()) {
    auto shape = local.sizes().vec();
    for (auto d : emptied) shape[d] = 1;
    if (std::all_of(shape.begin(), shape.end(), [](int64_t n) { return n > 0; }))
      local = at::zeros(shape, local.options());
    else
      emptied.clear();
  }
  (*stack)[base] = local;
  op.callBoxed(stack);
  // Outputs: the input's layout (sharded dims precede the dims an op adds or drops); the sizes of the other dims
  // come from the local result.
  const auto nret = op.schema().returns().size();
  const auto ext = spec.dim_extents();
  for (size_t r = 0; r < nret; ++r) {
    auto& out = (*stack)[stack->size() - nret + r];
    auto local = out.toTensor();
    for (auto d : emptied) local = local.narrow(d, 0, 0);
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

void register_sort_fft() {
  auto at = [](DimArg where) {
    return [where](const c10::OperatorHandle& op, torch::jit::Stack* stack) { along_dims_handler(where, op, stack); };
  };
  dispatch::set_handler("aten::sort", at({DimArg::Int, 1}));        // sort(self, dim, descending)
  dispatch::set_handler("aten::sort.stable", at({DimArg::Int, 2})); // sort.stable(self, *, stable, dim, descending)
  dispatch::set_handler("aten::topk", at({DimArg::Int, 2}));        // topk(self, k, dim, largest, sorted)
  dispatch::set_handler("aten::cumprod", at({DimArg::Int, 1}));
  dispatch::set_handler("aten::cummax", at({DimArg::Int, 1}));
  dispatch::set_handler("aten::cummin", at({DimArg::Int, 1}));
  dispatch::set_handler("aten::logcumsumexp", at({DimArg::Int, 1}));
  dispatch::set_handler("aten::_fft_r2c", at({DimArg::List, 1}));   // _fft_r2c(self, dim[], normalization, onesided)
  dispatch::set_handler("aten::_fft_c2r", at({DimArg::List, 1}));   // _fft_c2r(self, dim[], normalization, last_dim_size)
  dispatch::set_handler("aten::_fft_c2c", at({DimArg::List, 1}));   // _fft_c2c(self, dim[], normalization, forward)
  // Complex <-> real pairs: view_as_real appends a dim of 2, view_as_complex consumes the last dim.
  dispatch::set_handler("aten::view_as_real", at({DimArg::None}));
  dispatch::set_handler("aten::view_as_complex", at({DimArg::Last}));
}

} // namespace shardtensor::ops
