// Padding over sharded dims: constant (any value, negative pads crop), reflect, replicate; circular goes through
// PyTorch's decomposition (slices and cat). Output position o reads source row o - pad_left (mapped into the
// tensor by the mode); it belongs to the rank that owns that source row (pads to the edge ranks), so constant
// padding moves no data and the other modes move only the mirrored rows. Backward sends gradient rows home.
#include "comm/halo_plan.h"
#include "comm/redistribute.h"
#include "comm/spec_holder.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

struct PadDim {
  int64_t dim, left, right;
};

// Pads from the aten `pad` list (last dim first, (left, right) pairs).
std::vector<PadDim> pad_dims(at::IntArrayRef pad, int64_t ndim) {
  std::vector<PadDim> out;
  for (size_t i = 0; i + 1 < pad.size(); i += 2) out.push_back({ndim - 1 - static_cast<int64_t>(i / 2), pad[i], pad[i + 1]});
  return out;
}

// A padding's plan: one step per padded dim (a sharded dim exchanges the rows its outputs read; an unsharded dim
// is gathered locally), from the layout alone, cached and shared by the forward and the backward.
struct PadPlan {
  comm::HaloPlan halo;
  std::vector<int64_t> out_shape;
  DimExtents out_ext;
};

PadPlan make_pad_plan(const ShardSpec& spec, at::IntArrayRef pad, comm::PadMode mode, double value, c10::Device device) {
  PadPlan plan;
  plan.out_shape = spec.global_shape;
  plan.out_ext = spec.dim_extents();
  std::vector<comm::HaloDim> dims;
  for (const auto& p : pad_dims(pad, spec.ndim())) {
    const auto m = spec.mesh_dim_of(p.dim);
    const auto L = spec.global_shape[p.dim];
    if (m < 0) {
      std::vector<int64_t> rows;
      for (int64_t o = 0; o < L + p.left + p.right; ++o) rows.push_back(comm::padded_index(o - p.left, L, mode));
      dims.push_back({p.dim, -1, {L}, {std::move(rows)}});
    } else {
      auto part = comm::padding_partition(plan.out_ext[p.dim], L, p.left, p.right, mode);
      dims.push_back({p.dim, m, plan.out_ext[p.dim], std::move(part.want)});
      plan.out_ext[p.dim] = part.out_extents;
    }
    plan.out_shape[p.dim] += p.left + p.right;
  }
  plan.halo = comm::HaloPlan(dims, spec.mesh->coordinates(), device, comm::fill_value(mode, value));
  return plan;
}

// The plan of padding an input laid out as `spec` (Partial placements resolved), from the cache.
std::shared_ptr<const PadPlan> pad_plan(const ShardSpec& spec, at::IntArrayRef pad, comm::PadMode mode, double value,
                                        c10::Device device) {
  comm::PlanKey key;
  key.add_spec(spec).add_ints(pad).add(static_cast<int64_t>(mode)).add_double(value).add_device(device);
  return comm::cached_plan<PadPlan>(key, [&] { return make_pad_plan(spec, pad, mode, value, device); });
}

// Forward: the padded ShardTensor.
at::Tensor pad_forward(const at::Tensor& self_in, at::IntArrayRef pad, comm::PadMode mode, double value) {
  // A pending sum is completed into a shard of an unpadded dim (a reduce-scatter of the unpadded data) rather than
  // replicated: FNO pads the small contracted mode block of a channel-sharded spectrum to the full spectrum, which
  // then stays divided over the ranks.
  std::vector<int64_t> padded;
  for (const auto& p : pad_dims(pad, self_in.dim()))
    if (p.left != 0 || p.right != 0) padded.push_back(p.dim);  // torch's irfft lists every dim, most with 0 / 0
  auto self = scatter_partial(self_in, padded);
  const auto& spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  auto plan = pad_plan(*spec, pad, mode, value, x.device());
  return wrap(plan->halo.gather(x, *spec->mesh), spec->mesh, spec->placements, plan->out_shape, plan->out_ext);
}

// Backward: gradient of the input (laid out as `spec`, Partial placements resolved) from the gradient of the padded
// output. Reads none of the input's data, so a pending-sum input is not resolved again.
at::Tensor pad_backward(const at::Tensor& grad_in, const SpecPtr& spec, at::IntArrayRef pad, comm::PadMode mode) {
  auto plan = pad_plan(*spec, pad, mode, 0.0, grad_in.device());
  auto g = local_aligned(resolve_partial(dispatch::as_shard(grad_in, spec->mesh)), spec->mesh, plan->out_shape,
                         spec->placements, plan->out_ext);
  return make_shard_tensor(plan->halo.scatter_add(g, *spec->mesh), spec);
}

SpecPtr resolved_spec(const at::Tensor& t) {
  return without_partial(shard_impl(t)->spec());
}

// constant_pad_nd(Tensor self, SymInt[] pad, Scalar value=0)
at::Tensor constant_pad_rule(const at::Tensor& self, c10::SymIntArrayRef pad, const at::Scalar& value) {
  return pad_forward(self, concrete_ints(pad), comm::PadMode::Constant, value.toDouble());
}

// reflection_pad{1,2,3}d(Tensor self, SymInt[2|4|6] padding), replication_pad{1,2,3}d likewise: a mode's three
// schemas differ only in the length of `padding`, which pad_dims reads from the list, so one rule serves them.
template <comm::PadMode Mode>
at::Tensor mode_pad_rule(const at::Tensor& self, c10::SymIntArrayRef padding) {
  const auto pad = concrete_ints(padding);
  // torch's own checks (the kernel that would make them does not run on a ShardTensor), from global sizes.
  const char* name = Mode == comm::PadMode::Reflect ? "reflection_pad" : "replication_pad";
  for (const auto& d : pad_dims(pad, self.dim())) {
    const auto L = self.size(d.dim);
    TORCH_CHECK_VALUE(Mode != comm::PadMode::Reflect || (d.left < L && d.right < L), "ShardTensor ", name,
                      ": padding size should be less than the corresponding input dimension, but got: padding (",
                      d.left, ", ", d.right, ") at dimension ", d.dim, " of input ", self.sizes());
    TORCH_CHECK_VALUE(L + d.left + d.right >= 1, "ShardTensor ", name, ": input (size ", L, " at dimension ", d.dim,
                      ") is too small. Calculated output size: ", L + d.left + d.right);
  }
  return pad_forward(self, pad, Mode, 0.0);
}

// The backward op of a mode's pad of `rank` spatial dims, for messages.
std::string pad_backward_name(comm::PadMode mode, int64_t rank) {
  return std::string(mode == comm::PadMode::Reflect ? "aten::reflection_pad" : "aten::replication_pad") +
      std::to_string(rank) + "d_backward";
}

// reflection_pad{1,2,3}d_backward(Tensor grad_output, Tensor self, SymInt[2|4|6] padding), replication likewise
template <comm::PadMode Mode, int64_t Rank>
at::Tensor mode_pad_backward_rule(const at::Tensor& grad_output, const at::Tensor& self, c10::SymIntArrayRef padding) {
  static const auto name = pad_backward_name(Mode, Rank);
  auto mesh = dispatch::common_mesh(name, {grad_output, self});
  return pad_backward(grad_output, resolved_spec(dispatch::as_shard(self, mesh)),
                      concrete_ints(padding), Mode);
}

// _pad_circular is composite-implicit (slices and cat, which would gather the sharded dim): bound above autograd
// with its own backward. Linear in the input: the backward is the adjoint below, whose own backward is the padding
// again (second derivatives of a periodic-domain PINN).
struct PadCircularMap : LinearMap {
  SpecPtr spec;  // the input's layout: the data is not kept
  std::vector<int64_t> pad;
  PadCircularMap(SpecPtr s, std::vector<int64_t> p) : spec(std::move(s)), pad(std::move(p)) {}
  at::Tensor apply(const at::Tensor& x) const override {
    return pad_forward(grad_to_spec(x, spec), pad, comm::PadMode::Circular, 0.0);
  }
  at::Tensor adjoint(const at::Tensor& g) const override { return pad_backward(g, spec, pad, comm::PadMode::Circular); }
};

struct PadCircularFn : torch::autograd::Function<PadCircularFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& self, std::vector<int64_t> pad) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["map"] = map_ivalue(c10::make_intrusive<PadCircularMap>(resolved_spec(self), pad));
    return pad_forward(self, pad, comm::PadMode::Circular, 0.0);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    return linear_map_backward(ctx, g, 2);
  }
};

// torch's circular padding crops first and wraps the *cropped* tensor: F.pad(arange(4), (-1, 1), "circular") is
// [1, 2, 3, 1], not the rows (o - left) mod L of the whole input ([1, 2, 3, 0]). So the negative parts are a
// crop (a constant pad by them: a local slice, recorded by autograd as usual) and only the positive parts wrap.
at::Tensor pad_circular_entry(const at::Tensor& self, c10::SymIntArrayRef pad) {
  auto p = concrete_ints(pad);
  TORCH_CHECK_NOT_IMPLEMENTED(shard_impl(self), "ShardTensor _pad_circular: the input must be the ShardTensor");
  std::vector<int64_t> crop(p.size()), wrap(p.size());
  bool crops = false;
  for (size_t i = 0; i < p.size(); ++i) {
    crop[i] = std::min<int64_t>(p[i], 0);
    wrap[i] = std::max<int64_t>(p[i], 0);
    crops = crops || p[i] < 0;
  }
  for (const auto& d : pad_dims(p, self.dim())) {
    const auto size = self.size(d.dim) + std::min<int64_t>(d.left, 0) + std::min<int64_t>(d.right, 0);
    TORCH_CHECK_VALUE(size > 0 || (d.left <= 0 && d.right <= 0),
                      "ShardTensor _pad_circular: pads (", d.left, ", ", d.right, ") crop dim ", d.dim, " of size ",
                      self.size(d.dim), " away entirely before wrapping it");
    TORCH_CHECK_VALUE(std::max<int64_t>(d.left, 0) <= size && std::max<int64_t>(d.right, 0) <= size,
                      "ShardTensor _pad_circular: padding value causes wrapping around more than once: pads (",
                      d.left, ", ", d.right, ") of dim ", d.dim, " of size ", self.size(d.dim), " (", size,
                      " after the negative pads crop it)");
  }
  return PadCircularFn::apply(crops ? at::constant_pad_nd(self, crop) : self, wrap);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(pad) {
  dispatch::set_handler("aten::_pad_circular", typed_handler(&pad_circular_entry), dispatch::RuleLevel::above_autograd);
  dispatch::set_handler("aten::constant_pad_nd", typed_handler(&constant_pad_rule));
  using comm::PadMode;
  dispatch::set_handler("aten::reflection_pad1d", typed_handler(&mode_pad_rule<PadMode::Reflect>));
  dispatch::set_handler("aten::reflection_pad2d", typed_handler(&mode_pad_rule<PadMode::Reflect>));
  dispatch::set_handler("aten::reflection_pad3d", typed_handler(&mode_pad_rule<PadMode::Reflect>));
  dispatch::set_handler("aten::replication_pad1d", typed_handler(&mode_pad_rule<PadMode::Replicate>));
  dispatch::set_handler("aten::replication_pad2d", typed_handler(&mode_pad_rule<PadMode::Replicate>));
  dispatch::set_handler("aten::replication_pad3d", typed_handler(&mode_pad_rule<PadMode::Replicate>));
  dispatch::set_handler("aten::reflection_pad1d_backward", typed_handler(&mode_pad_backward_rule<PadMode::Reflect, 1>));
  dispatch::set_handler("aten::reflection_pad2d_backward", typed_handler(&mode_pad_backward_rule<PadMode::Reflect, 2>));
  dispatch::set_handler("aten::reflection_pad3d_backward", typed_handler(&mode_pad_backward_rule<PadMode::Reflect, 3>));
  dispatch::set_handler("aten::replication_pad1d_backward",
                        typed_handler(&mode_pad_backward_rule<PadMode::Replicate, 1>));
  dispatch::set_handler("aten::replication_pad2d_backward",
                        typed_handler(&mode_pad_backward_rule<PadMode::Replicate, 2>));
  dispatch::set_handler("aten::replication_pad3d_backward",
                        typed_handler(&mode_pad_backward_rule<PadMode::Replicate, 3>));
}

} // namespace shardtensor::ops
