// Copies, aliases and factories: *_like and new_* return ShardTensors of the input's layout (a pending
// Partial becomes Replicate: a fresh tensor is a complete value), _to_copy/clone/detach keep the spec.
#include "ops/common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/strides.h>

namespace shardtensor::ops {

namespace {

using dispatch::op_args;

// Run `op` with ShardTensor argument 0 replaced by its local tensor; return its first output.
at::Tensor run_on_local_self(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t self_index = 0) {
  const auto n = op.schema().arguments().size();
  auto& self = (*stack)[stack->size() - n + self_index];
  self = shard_impl(self.toTensor())->local();
  op.callBoxed(stack);
  return stack->back().toTensor();
}

// The op keeps the spec: output = wrap(op(local)).
void same_spec_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  auto self = (*stack)[stack->size() - n].toTensor();
  auto* impl = shard_impl(self);
  TORCH_INTERNAL_ASSERT(impl, dispatch::qualified_name(op), ": argument 0 must be a ShardTensor");
  auto spec = impl->spec();
  auto local = run_on_local_self(op, stack);
  stack->back() = make_shard_tensor(local, spec);
}

// *_like: the input's layout without pending reductions.
void like_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  auto self = (*stack)[stack->size() - n].toTensor();
  auto spec = without_partial(shard_impl(self)->spec());
  auto local = run_on_local_self(op, stack);
  stack->back() = make_shard_tensor(local, spec);
}

// new_*(self, size, ...): the input's layout when the size matches its global size. Another size of the same rank
// keeps the input's shards on the dims whose size is unchanged (backward formulas build gradients this way, e.g.
// grad.new_zeros(input_sizes) that differ along the dim an op worked on: a Replicate result would be dense at the
// global size on every rank); every other dim is Replicate. The values are the same in any layout.
void new_factory_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  auto args = op_args(op, stack);
  auto self = args[0].toTensor();
  auto* impl = shard_impl(self);
  auto size = args[1].toDimVector();
  auto mesh = impl->spec()->mesh;
  SpecPtr spec;
  if (c10::IntArrayRef(size) == self.sizes()) {
    spec = without_partial(impl->spec());
  } else if (static_cast<int64_t>(size.size()) == self.dim()) {
    const auto& src = *impl->spec();
    Placements p(mesh->ndim(), Placement::replicate());
    DimExtents ext;
    for (size_t m = 0; m < p.size(); ++m)
      if (src.placements[m].is_shard() && size[src.placements[m].dim] == self.size(src.placements[m].dim)) {
        p[m] = src.placements[m];
        ext[p[m].dim] = src.extents[m];
      }
    spec = ShardSpec::make_with_dim_extents(mesh, p, std::vector<int64_t>(size.begin(), size.end()), ext);
  } else {
    spec = dispatch::replicate_spec(mesh, size);
  }
  (*stack)[stack->size() - n + 1] = c10::IValue(spec->local_shape);
  if (op.schema().name() == "aten::new_empty_strided") {
    const auto strides = c10::contiguous_strides(spec->local_shape);
    (*stack)[stack->size() - n + 2] = c10::IValue(std::vector<int64_t>(strides.begin(), strides.end()));
  }
  auto local = run_on_local_self(op, stack);
  stack->back() = make_shard_tensor(local, spec);
}

void item_handler(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto self = torch::jit::pop(*stack).toTensor();
  auto* impl = shard_impl(self);
  TORCH_CHECK_VALUE(self.numel() == 1, "ShardTensor: .item() needs a one-element tensor, got global shape ",
                    self.sizes());
  auto full = redistribute_to(self, dispatch::replicate_spec(impl->spec()->mesh, self.sizes()));
  torch::jit::push(*stack, shard_impl(full)->local().item());
}

void is_same_size_handler(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto other = torch::jit::pop(*stack).toTensor();
  auto self = torch::jit::pop(*stack).toTensor();
  torch::jit::push(*stack, self.sizes() == other.sizes());
}

void as_strided_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto self = args[0].toTensor();
  auto size = args[1].toDimVector();
  auto stride = args[2].toDimVector();
  const bool identity = c10::IntArrayRef(size) == self.sizes() && c10::IntArrayRef(stride) == self.strides() &&
      (args.size() < 4 || args[3].isNone() || args[3].toInt() == self.storage_offset());
  if (!identity) {
    dispatch::not_implemented(op, stack, "only the identity as_strided (same sizes and strides) is supported");
  }
  auto spec = shard_impl(self)->spec();
  auto local = shard_impl(self)->local();
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, make_shard_tensor(local.alias(), spec));
}

void equal_handler(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto other = torch::jit::pop(*stack).toTensor();
  auto self = torch::jit::pop(*stack).toTensor();
  auto mesh = shard_impl(self) ? shard_impl(self)->spec()->mesh : shard_impl(other)->spec()->mesh;
  if (self.sizes() != other.sizes()) {
    torch::jit::push(*stack, false);
    return;
  }
  // Compare in self's layout, then agree across the mesh.
  auto a = resolve_partial(dispatch::as_shard(self, mesh));
  auto spec = shard_impl(a)->spec();
  auto b = local_as(other, mesh, spec->placements, spec->dim_extents());
  auto ok = at::equal(shard_impl(a)->local(), b) ? 1 : 0;
  // The agreement flag lives on the data's device (NCCL groups reduce device tensors only).
  auto flag = at::full({1}, ok, b.options().dtype(at::kLong));
  auto all = dispatch::replicate_spec(mesh, {1});
  auto t = make_shard_tensor(flag, ShardSpec::make(mesh, Placements(mesh->ndim(), Placement::partial(ReduceOp::Min)), {1}));
  auto r = redistribute_to(t, all);
  torch::jit::push(*stack, shard_impl(r)->local().item<int64_t>() == 1);
}

// allclose(self, other, rtol, atol, equal_nan): isclose (elementwise, broadcasting, plain operands Replicate) and
// all() (one all-reduce of a flag) give the same answer on every rank.
void allclose_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = op_args(op, stack);
  auto close = at::isclose(args[0].toTensor(), args[1].toTensor(), args[2].toDouble(), args[3].toDouble(),
                           args[4].toBool());
  const bool all = at::all(close).item<bool>();
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, all);
}

} // namespace

void register_factory() {
  for (const char* name : {"aten::_to_copy", "aten::clone", "aten::detach", "aten::alias", "aten::lift_fresh",
                           "aten::lift_fresh_copy", "aten::contiguous", "aten::_conj", "aten::resolve_conj",
                           "aten::resolve_neg", "aten::_neg_view", "aten::positive", "aten::_lazy_clone"}) {
    auto h = c10::Dispatcher::singleton().findOp({name, ""});
    if (h && !h->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      dispatch::set_handler(name, same_spec_handler);
  }
  for (const char* base : {"aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like",
                           "aten::rand_like", "aten::randn_like", "aten::randint_like"}) {
    dispatch::set_handler_all_overloads(base, like_handler);
  }
  for (const char* base : {"aten::new_empty", "aten::new_zeros", "aten::new_ones", "aten::new_full",
                           "aten::new_empty_strided"}) {
    dispatch::set_handler_all_overloads(base, new_factory_handler);
  }
  dispatch::set_handler("aten::_local_scalar_dense", item_handler);
  dispatch::set_handler("aten::is_same_size", is_same_size_handler);
  dispatch::set_handler("aten::as_strided", as_strided_handler);
  dispatch::set_handler("aten::equal", equal_handler);
  dispatch::set_handler("aten::allclose", allclose_handler);
}

} // namespace shardtensor::ops
