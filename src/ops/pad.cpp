// Padding over sharded dims: constant (any value, negative pads crop), reflect, replicate; circular goes through
// PyTorch's decomposition (slices and cat). Output position o reads source row o - pad_left (mapped into the
// tensor by the mode); it belongs to the rank that owns that source row (pads to the edge ranks), so constant
// padding moves no data and the other modes move only the mirrored rows. Backward sends gradient rows home.
#include "comm/halo.h"
#include "ops/common.h"

#include <torch/autograd.h>
#include <torch/library.h>

namespace shardtensor::ops {

namespace {

using dispatch::op_args;

struct PadDim {
  int64_t dim, left, right;
};

// Pads from the aten `pad` list (last dim first, (left, right) pairs).
std::vector<PadDim> pad_dims(at::IntArrayRef pad, int64_t ndim) {
  std::vector<PadDim> out;
  for (size_t i = 0; i + 1 < pad.size(); i += 2) out.push_back({ndim - 1 - static_cast<int64_t>(i / 2), pad[i], pad[i + 1]});
  return out;
}

struct PadPlan {
  std::vector<int64_t> out_extents;
  comm::RowRequests want;
};

PadPlan plan_pad(const std::vector<int64_t>& extents, int64_t L, const PadDim& p, const std::string& mode) {
  const auto n = static_cast<int64_t>(extents.size());
  const auto lout = L + p.left + p.right;
  std::vector<int64_t> off(n + 1, 0);
  for (int64_t c = 0; c < n; ++c) off[c + 1] = off[c] + extents[c];
  PadPlan plan{std::vector<int64_t>(n, 0), comm::RowRequests(n)};
  // The owner of output position o: the rank holding source row o - left (first/last rank for pads).
  auto owner = [&](int64_t src) {
    if (src < 0) {
      for (int64_t c = 0; c < n; ++c)
        if (extents[c] > 0 || c == n - 1) return c;
    }
    for (int64_t c = 0; c < n; ++c)
      if (src >= off[c] && src < off[c + 1]) return c;
    for (int64_t c = n - 1; c >= 0; --c)
      if (extents[c] > 0 || c == 0) return c;
    return n - 1;
  };
  for (int64_t o = 0; o < lout; ++o) {
    const auto src = o - p.left;
    const auto c = owner(src);
    plan.out_extents[c] += 1;
    plan.want[c].push_back(comm::padded_index(src, L, mode));
  }
  return plan;
}

// Local padding along an unsharded dim by index (-1 rows take `value`).
at::Tensor pad_local(const at::Tensor& t, const PadDim& p, const std::string& mode, double value) {
  const auto L = t.size(p.dim);
  std::vector<int64_t> idx;
  for (int64_t o = 0; o < L + p.left + p.right; ++o) idx.push_back(comm::padded_index(o - p.left, L, mode));
  auto index = at::tensor(idx, at::TensorOptions().dtype(at::kLong)).to(t.device());
  auto out = t.index_select(p.dim, index.clamp_min(0));
  if (std::find(idx.begin(), idx.end(), -1) != idx.end()) {
    std::vector<int64_t> shape(t.dim(), 1);
    shape[p.dim] = static_cast<int64_t>(idx.size());
    out = at::where(index.lt(0).view(shape), at::scalar_tensor(value, out.options()), out);
  }
  return out;
}

at::Tensor unpad_local(const at::Tensor& g, int64_t L, const PadDim& p, const std::string& mode) {
  std::vector<int64_t> pos, rows;
  for (int64_t o = 0; o < g.size(p.dim); ++o) {
    const auto r = comm::padded_index(o - p.left, L, mode);
    if (r >= 0) {
      pos.push_back(o);
      rows.push_back(r);
    }
  }
  auto shape = g.sizes().vec();
  shape[p.dim] = L;
  auto out = at::zeros(shape, g.options());
  auto opts = at::TensorOptions().dtype(at::kLong).device(g.device());
  if (!pos.empty()) out.index_add_(p.dim, at::tensor(rows, opts), g.index_select(p.dim, at::tensor(pos, opts)));
  return out;
}

// Forward: the padded ShardTensor.
at::Tensor pad_forward(const at::Tensor& self_in, at::IntArrayRef pad, const std::string& mode, double value) {
  auto self = resolve_partial(self_in);
  auto spec = shard_impl(self)->spec();
  auto t = shard_impl(self)->local();
  auto shape = spec->global_shape;
  auto ext = spec->dim_extents();
  for (const auto& p : pad_dims(pad, self.dim())) {
    const auto m = spec->mesh_dim_of(p.dim);
    if (m < 0) {
      t = pad_local(t, p, mode, value);
    } else {
      auto plan = plan_pad(ext[p.dim], shape[p.dim], p, mode);
      t = comm::gather_rows(t, p.dim, ext[p.dim], plan.want, *spec->mesh, m, value);
      ext[p.dim] = plan.out_extents;
    }
    shape[p.dim] += p.left + p.right;
  }
  return wrap(t, spec->mesh, spec->placements, shape, ext);
}

// Backward: gradient of the input from the gradient of the padded output.
at::Tensor pad_backward(const at::Tensor& grad_in, const at::Tensor& self_in, at::IntArrayRef pad, const std::string& mode) {
  auto self = resolve_partial(self_in);
  auto spec = shard_impl(self)->spec();
  auto dims = pad_dims(pad, self.dim());
  // Replay the forward's layouts to know each step's extents.
  std::vector<DimExtents> ext_before;
  std::vector<std::vector<int64_t>> shape_before;
  auto shape = spec->global_shape;
  auto ext = spec->dim_extents();
  std::vector<PadPlan> plans;
  for (const auto& p : dims) {
    ext_before.push_back(ext);
    shape_before.push_back(shape);
    if (spec->mesh_dim_of(p.dim) >= 0) {
      plans.push_back(plan_pad(ext[p.dim], shape[p.dim], p, mode));
      ext[p.dim] = plans.back().out_extents;
    } else {
      plans.push_back({});
    }
    shape[p.dim] += p.left + p.right;
  }
  auto g = local_aligned(resolve_partial(dispatch::as_shard(grad_in, spec->mesh)), spec->mesh, shape, spec->placements, ext);
  for (int64_t i = static_cast<int64_t>(dims.size()) - 1; i >= 0; --i) {
    const auto& p = dims[i];
    const auto m = spec->mesh_dim_of(p.dim);
    if (m < 0) {
      g = unpad_local(g, shape_before[i][p.dim], p, mode);
    } else {
      g = comm::scatter_add_rows(g, p.dim, ext_before[i].at(p.dim), plans[i].want, *spec->mesh, m);
    }
  }
  return make_shard_tensor(g, spec);
}

void constant_pad_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto out = pad_forward(args[0].toTensor(), args[1].toDimVector(), "constant", args[2].toScalar().toDouble());
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
}

void mode_pad_handler(const std::string& mode, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto out = pad_forward(args[0].toTensor(), args[1].toDimVector(), mode, 0.0);
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
}

// *_pad*d_backward(grad_output, self, padding)
void mode_pad_backward_handler(const std::string& mode, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto out = pad_backward(args[0].toTensor(), args[1].toTensor(), args[2].toDimVector(), mode);
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
}

// _pad_circular is composite-implicit (slices and cat, which would gather the sharded dim): bound above autograd
// with its own backward.
struct PadCircularFn : torch::autograd::Function<PadCircularFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& self, std::vector<int64_t> pad) {
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({self});
    ctx->saved_data["pad"] = pad;
    return pad_forward(self, pad, "circular", 0.0);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    if (!g[0].defined()) return {at::Tensor(), at::Tensor()};
    auto self = ctx->get_saved_variables()[0];
    return {pad_backward(g[0], self, ctx->saved_data["pad"].toIntVector(), "circular"), at::Tensor()};
  }
};

at::Tensor pad_circular_entry(const at::Tensor& self, c10::SymIntArrayRef pad) {
  auto p = C10_AS_INTARRAYREF_SLOW(pad).vec();
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(self), "ShardTensor _pad_circular: the input must be the ShardTensor");
  return PadCircularFn::apply(self, p);
}

} // namespace

void register_pad() {
  static torch::Library autograd_lib(torch::Library::IMPL, "aten", kShardAutogradKey, __FILE__, __LINE__);
  autograd_lib.impl("_pad_circular", TORCH_FN(pad_circular_entry));
  static torch::Library shard_lib(torch::Library::IMPL, "aten", kShardKey, __FILE__, __LINE__);
  shard_lib.impl("_pad_circular", TORCH_FN(pad_circular_entry));
  dispatch::set_handler("aten::constant_pad_nd", constant_pad_handler);
  for (const char* n : {"aten::reflection_pad1d", "aten::reflection_pad2d", "aten::reflection_pad3d"})
    dispatch::set_handler(n, [](const c10::OperatorHandle& op, torch::jit::Stack* s) { mode_pad_handler("reflect", op, s); });
  for (const char* n : {"aten::replication_pad1d", "aten::replication_pad2d", "aten::replication_pad3d"})
    dispatch::set_handler(n, [](const c10::OperatorHandle& op, torch::jit::Stack* s) { mode_pad_handler("replicate", op, s); });
  for (const char* n : {"aten::reflection_pad1d_backward", "aten::reflection_pad2d_backward", "aten::reflection_pad3d_backward"})
    dispatch::set_handler(n, [](const c10::OperatorHandle& op, torch::jit::Stack* s) { mode_pad_backward_handler("reflect", op, s); });
  for (const char* n : {"aten::replication_pad1d_backward", "aten::replication_pad2d_backward", "aten::replication_pad3d_backward"})
    dispatch::set_handler(n, [](const c10::OperatorHandle& op, torch::jit::Stack* s) { mode_pad_backward_handler("replicate", op, s); });
}

} // namespace shardtensor::ops
