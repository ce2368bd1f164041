// Copies, aliases and factories: *_like and new_* return ShardTensors of the input's layout (a pending
// Partial becomes Replicate: a fresh tensor is a complete value), _to_copy/clone/detach keep the spec.
#include "ops/common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/strides.h>

namespace shardtensor::ops {

namespace {

// The rules below that serve several ops or every overload of a family re-call the op that ran with the local
// tensor in place of the ShardTensor `self` (the other arguments pass through), so they stay boxed and read their
// arguments by name.

// Run `op` with the ShardTensor `self` replaced by its local tensor; return its first output.
at::Tensor run_on_local_self(const c10::OperatorHandle& op, torch::jit::Stack* stack, dispatch::NamedArgs& args) {
  args.set("self", shard_impl(args.tensor("self"))->local());
  op.callBoxed(stack);
  return stack->back().toTensor();
}

// _to_copy, clone, detach, alias, ...: the op keeps the spec: output = wrap(op(local)).
void same_spec_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  auto self = args.tensor("self");
  auto* impl = shard_impl(self);
  TORCH_INTERNAL_ASSERT(impl, dispatch::qualified_name(op), ": argument 0 must be a ShardTensor");
  auto spec = impl->spec();
  auto local = run_on_local_self(op, stack, args);
  stack->back() = make_shard_tensor(local, spec);
}

// *_like (every overload): the input's layout without pending reductions.
void like_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  auto spec = without_partial(shard_impl(args.tensor("self"))->spec());
  auto local = run_on_local_self(op, stack, args);
  stack->back() = make_shard_tensor(local, spec);
}

// new_*(self, size, ...): the input's layout when the size matches its global size. Another size of the same rank
// keeps the input's shards on the dims whose size is unchanged (backward formulas build gradients this way, e.g.
// grad.new_zeros(input_sizes) that differ along the dim an op worked on: a Replicate result would be dense at the
// global size on every rank); every other dim is Replicate. The values are the same in any layout.
// Every overload of new_empty, new_zeros, new_ones, new_full, new_empty_strided (the last with a `stride`).
void new_factory_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  auto self = args.tensor("self");
  auto* impl = shard_impl(self);
  auto size = args["size"].toDimVector();
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
  args.set("size", c10::IValue(spec->local_shape));
  if (args.has("stride")) {
    const auto strides = c10::contiguous_strides(spec->local_shape);
    args.set("stride", c10::IValue(std::vector<int64_t>(strides.begin(), strides.end())));
  }
  auto local = run_on_local_self(op, stack, args);
  stack->back() = make_shard_tensor(local, spec);
}

// _local_scalar_dense(Tensor self) -> Scalar
at::Scalar item_rule(const at::Tensor& self) {
  auto* impl = shard_impl(self);
  TORCH_CHECK_VALUE(self.numel() == 1, "ShardTensor: .item() needs a one-element tensor, got global shape ",
                    self.sizes());
  auto full = redistribute_to(self, dispatch::replicate_spec(impl->spec()->mesh, self.sizes()));
  return shard_impl(full)->local().item();
}

// is_same_size(Tensor self, Tensor other) -> bool
bool is_same_size_rule(const at::Tensor& self, const at::Tensor& other) {
  return self.sizes() == other.sizes();
}

// as_strided(Tensor(a) self, SymInt[] size, SymInt[] stride, SymInt? storage_offset=None)
at::Tensor as_strided_rule(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                           std::optional<c10::SymInt> storage_offset) {
  const bool identity = C10_AS_INTARRAYREF_SLOW(size) == self.sizes() &&
      C10_AS_INTARRAYREF_SLOW(stride) == self.strides() &&
      (!storage_offset || storage_offset->expect_int() == self.storage_offset());
  if (!identity) {
    dispatch::not_implemented("only the identity as_strided (same sizes and strides) is supported");
  }
  auto spec = shard_impl(self)->spec();
  auto local = shard_impl(self)->local();
  return make_shard_tensor(local.alias(), spec);
}

// equal(Tensor self, Tensor other) -> bool
bool equal_rule(const at::Tensor& self, const at::Tensor& other) {
  auto mesh = shard_impl(self) ? shard_impl(self)->spec()->mesh : shard_impl(other)->spec()->mesh;
  if (self.sizes() != other.sizes()) return false;
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
  return shard_impl(r)->local().item<int64_t>() == 1;
}

// isclose (elementwise, broadcasting, plain operands Replicate) and all() (one all-reduce of a flag) give the same
// answer on every rank.
// allclose(Tensor self, Tensor other, float rtol=1e-05, float atol=1e-08, bool equal_nan=False) -> bool
bool allclose_rule(const at::Tensor& self, const at::Tensor& other, double rtol, double atol, bool equal_nan) {
  auto close = at::isclose(self, other, rtol, atol, equal_nan);
  return at::all(close).item<bool>();
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
  dispatch::set_handler("aten::_local_scalar_dense", typed_handler(&item_rule));
  dispatch::set_handler("aten::is_same_size", typed_handler(&is_same_size_rule));
  dispatch::set_handler("aten::as_strided", typed_handler(&as_strided_rule));
  dispatch::set_handler("aten::equal", typed_handler(&equal_rule));
  dispatch::set_handler("aten::allclose", typed_handler(&allclose_rule));
}

} // namespace shardtensor::ops
