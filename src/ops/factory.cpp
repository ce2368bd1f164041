// Copies, aliases and factories: *_like and new_* return ShardTensors of the input's layout (a pending
// Partial becomes Replicate: a fresh tensor is a complete value), _to_copy/clone/detach keep the spec.
#include "ops/common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <shardtensor/simulation.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <sstream>

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
// keeps the input's shards: on the dims whose size is unchanged with their extents (backward formulas build
// gradients this way, e.g. grad.new_zeros(input_sizes) that differ along the dim an op worked on), on a sharded dim
// whose size changed with the default split of the new size when no other dim changed (a buffer for a longer
// sequence filled with split tokens, diffusers' Lumina2 `hidden_states.new_zeros(B, L_txt + L_img, C)`): a Replicate
// result would be dense at the global size on every rank, and writing split values into it would gather them.
// More dims (a batch of such tensors, sizes kept or grown): the trailing dims keep the input's shards. Fewer dims are
// Replicate.
// The values are the same in any layout.
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
    // Only a tensor that differs from the input along one sharded dim alone is the same kind of thing at another
    // length (a longer sequence); one that also differs elsewhere (diffusers' UNet1D builds a convolution kernel
    // `x.new_zeros(C, C, k)`, whose first dim may be a split batch on a 2-D mesh) is something else, and its
    // sharded dims stay whole.
    int64_t changed = 0;
    for (int64_t d = 0; d < self.dim(); ++d) changed += size[d] != self.size(d) ? 1 : 0;
    const bool other_dims_kept = changed == 1;
    for (size_t m = 0; m < p.size(); ++m) {
      if (!src.placements[m].is_shard()) continue;
      const auto d = src.placements[m].dim;
      if (size[d] == self.size(d)) {
        p[m] = src.placements[m];
        ext[d] = src.extents[m];
      } else if (other_dims_kept) {
        p[m] = src.placements[m];
      }
    }
    spec = ShardSpec::make_with_dim_extents(mesh, p, std::vector<int64_t>(size.begin(), size.end()), ext);
  } else if (static_cast<int64_t>(size.size()) > self.dim()) {
    // New leading dims over the input's dims: a container of such tensors -- torchvision's detection transform
    // batches images with `images[0].new_full((N, C, H', W'), 0)`, H' and W' rounded up to a multiple of 32, then
    // copies each image into its corner. Its trailing dims keep the input's shards (extents kept where the size is
    // unchanged, the default split of a grown size); Replicate would put the whole batch on every rank and the
    // copy would gather the image. Not when a trailing dim shrinks (then it is some other tensor).
    const auto shift = static_cast<int64_t>(size.size()) - self.dim();
    bool grown_or_kept = true;
    for (int64_t d = 0; d < self.dim(); ++d) grown_or_kept = grown_or_kept && size[d + shift] >= self.size(d);
    const auto& src = *impl->spec();
    Placements p(mesh->ndim(), Placement::replicate());
    DimExtents ext;
    for (size_t m = 0; m < p.size() && grown_or_kept; ++m) {
      if (!src.placements[m].is_shard()) continue;
      const auto d = src.placements[m].dim;
      p[m] = Placement::shard(d + shift);
      if (size[d + shift] == self.size(d)) ext[d + shift] = src.extents[m];
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

// A one-element ShardTensor's value on every rank (a pending sum all-reduced, a split element gathered), as a
// plain tensor; `what` names the caller in the error for another size.
at::Tensor one_element_value(const at::Tensor& self, const std::string& what) {
  TORCH_CHECK_VALUE(self.numel() == 1, what, " needs a one-element tensor, got global shape ", self.sizes());
  auto full = redistribute_to(self, dispatch::replicate_spec(shard_impl(self)->spec()->mesh, self.sizes()));
  return shard_impl(full)->local();
}

// _local_scalar_dense(Tensor self) -> Scalar
at::Scalar item_rule(const at::Tensor& self) {
  return one_element_value(self, "ShardTensor: .item()").item();
}

// _assert_async(Tensor self) / _assert_async.msg(Tensor self, str assert_msg): torch._assert_async and the
// checks libraries write with it (kornia's KORNIA_CHECK on a reduced value). The condition is one element: completed
// (a pending sum is all-reduced, a split one-element tensor gathered: the same value on every rank), then checked on
// every rank alike, so all raise together or none does.
void assert_async_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  auto self = args.tensor("self");
  TORCH_INTERNAL_ASSERT(shard_impl(self), dispatch::qualified_name(op), ": argument 0 must be a ShardTensor");
  args.set("self", one_element_value(self, dispatch::qualified_name(op) + "'s condition"));
  op.callBoxed(stack);
}

// is_same_size(Tensor self, Tensor other) -> bool
bool is_same_size_rule(const at::Tensor& self, const at::Tensor& other) {
  return self.sizes() == other.sizes();
}

// Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) keeps a tangent as it is only when it is laid out like
// its primal (sizes, strides, storage offset and this), so that the primal's views can be taken of it; otherwise it
// copies the tangent into _new_zeros_with_same_feature_meta(tangent, primal). A ShardTensor has no global storage:
// two ShardTensors are laid out alike when their layouts are (mesh, placements, extents), which every rank answers
// alike; a ShardTensor and a plain tensor are not.
// _has_same_storage_numel(Tensor self, Tensor other) -> bool
bool has_same_storage_numel_rule(const at::Tensor& self, const at::Tensor& other) {
  const auto* a = shard_impl(self);
  const auto* b = shard_impl(other);
  return a && b && a->spec()->same_layout(*b->spec());
}

// _new_zeros_with_same_feature_meta(Tensor self, Tensor other, *, int self_num_batch_dims=0) -> Tensor: zeros laid
// out like `other` (its layout: a ShardTensor's shards, a plain tensor's whole) behind `self`'s first
// `self_num_batch_dims` dims (functorch's batch dims over a jvp), in self's dtype. The batch dims must be whole: a
// tangent split along a batch dim would need zeros split along a dim the primal does not have.
at::Tensor new_zeros_with_same_feature_meta_rule(const at::Tensor& self, const at::Tensor& other,
                                                 int64_t self_num_batch_dims) {
  const auto n = self_num_batch_dims;
  TORCH_CHECK_VALUE(n >= 0 && n <= self.dim(), "_new_zeros_with_same_feature_meta: self_num_batch_dims ", n,
                    " for a ", self.dim(), "-d tensor");
  const auto* s = shard_impl(self);
  const auto* o = shard_impl(other);
  if (s) {
    const auto& spec = *s->spec();
    for (size_t m = 0; m < spec.placements.size(); ++m)
      TORCH_CHECK_NOT_IMPLEMENTED(!spec.placements[m].is_shard() || spec.placements[m].dim >= n,
                                  "ShardTensor _new_zeros_with_same_feature_meta (forward-mode AD): a tangent ",
                                  spec.str(), " split along batch dim ", spec.placements[m].dim,
                                  " of its first ", n, " has no layout for its primal's zeros; keep the batch "
                                  "dims whole (vmap over a whole dim) or redistribute the tangent");
  }
  // Only self's batch sizes (whole, so global = local) and dtype are read.
  const auto& self_local = s ? s->local() : self;
  if (!o) return at::_new_zeros_with_same_feature_meta(self_local, other, n);
  const auto& ospec = *o->spec();
  auto shape = self.sizes().slice(0, n).vec();
  shape.insert(shape.end(), ospec.global_shape.begin(), ospec.global_shape.end());
  Placements p(ospec.mesh->ndim(), Placement::replicate());
  std::map<int64_t, std::vector<int64_t>> ext;
  for (size_t m = 0; m < p.size(); ++m) {
    if (!ospec.placements[m].is_shard()) continue;  // a pending sum's zeros are complete: Replicate
    p[m] = Placement::shard(ospec.placements[m].dim + n);
    ext[ospec.placements[m].dim + n] = ospec.extents[m];
  }
  auto spec = ShardSpec::make_with_dim_extents(ospec.mesh, p, shape, ext);
  return make_shard_tensor(at::_new_zeros_with_same_feature_meta(self_local, o->local(), n), spec);
}

// as_strided on a ShardTensor. There is no global storage to restride (the global strides are dense strides in the
// local tensor's order), so a geometry is honoured only when it addresses exactly the tensor's own elements in place:
// the same sizes and storage offset, and the same strides on every dim of size > 1 (a size-1 dim's stride addresses
// nothing) -- the identity. Composite kernels use it that way: adaptive_avg_pool to 1 of a channels-last input
// restrides its (N, C, 1, 1) mean in place to the channels-last strides. Views (CopySlices, a view whose base was
// written) are rebuilt by replaying their view ops (dispatch/view_replay.h), never through as_strided.
bool addresses_self(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride,
                    std::optional<int64_t> storage_offset) {
  if (size != self.sizes() || stride.size() != size.size()) return false;
  if (storage_offset && *storage_offset != self.storage_offset()) return false;
  if (self.numel() == 0) return true;
  for (size_t d = 0; d < size.size(); ++d)
    if (size[d] != 1 && stride[d] != self.stride(static_cast<int64_t>(d))) return false;
  return true;
}

bool addresses_self(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                    const std::optional<c10::SymInt>& storage_offset) {
  std::optional<int64_t> offset;
  if (storage_offset) offset = storage_offset->expect_int();
  return addresses_self(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), offset);
}

[[noreturn]] void refuse_as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  std::ostringstream why;
  why << "a ShardTensor has no global storage to restride: as_strided(size=" << C10_AS_INTARRAYREF_SLOW(size)
      << ", stride=" << C10_AS_INTARRAYREF_SLOW(stride) << ") of a tensor of sizes " << self.sizes()
      << " and strides " << self.strides()
      << " is not the identity (same sizes and storage offset, same strides on every dim of size > 1); express "
         "the view with view ops (slice, select, transpose, permute, view), which have rules";
  dispatch::not_implemented(why.str());
}

// A geometry that selects a sub-grid of the tensor's elements, rebuilt from view ops that have rules, or nullopt.
// The wrapper's global strides are dense (a permutation of a contiguous tensor's), so the storage offset names one
// index per dim, and an output dim whose stride is a multiple of some dim's stride walks that dim with a step:
// slices of the walked dims, selects of the others at their indices, a permutation, size-1 dims added. That covers
// what code asks of as_strided besides the identity -- one element (`torch.as_strided(y, (), ())`, torchdiffeq's
// adjoint; a select along a sharded dim is a collective, every rank runs it alike), a strided sub-grid, a
// transposition. Overlapping, expanded (stride 0) or out-of-range geometries give nullopt (refused as before).
std::optional<at::Tensor> as_strided_by_views(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride,
                                              std::optional<int64_t> storage_offset) {
  const auto ndim = self.dim();
  if (stride.size() != size.size()) return std::nullopt;
  for (auto n : size)
    if (n == 0) return std::nullopt; // an empty result addresses nothing: left to the refusal (no caller needs it)
  int64_t rel = storage_offset.value_or(self.storage_offset()) - self.storage_offset();
  if (rel < 0 || self.numel() == 0) return std::nullopt;
  // Source dims of size > 1, outermost (largest stride) first; the offset's index along each.
  std::vector<int64_t> order;
  for (int64_t d = 0; d < ndim; ++d)
    if (self.size(d) > 1) order.push_back(d);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return self.stride(a) > self.stride(b); });
  std::vector<int64_t> index(ndim, 0);
  for (auto d : order) {
    index[d] = rel / self.stride(d);
    rel -= index[d] * self.stride(d);
    if (index[d] >= self.size(d)) return std::nullopt;
  }
  if (rel != 0) return std::nullopt;
  // Each output dim of size > 1 walks one source dim (the outermost whose stride divides its stride) with a step.
  std::vector<int64_t> walked(size.size(), -1), step(size.size(), 1);
  std::vector<bool> used(ndim, false);
  for (size_t k = 0; k < size.size(); ++k) {
    if (size[k] == 1) continue;
    if (stride[k] <= 0) return std::nullopt;
    for (auto d : order) {
      if (used[d] || stride[k] % self.stride(d) != 0) continue;
      const auto st = stride[k] / self.stride(d);
      if (index[d] + (size[k] - 1) * st >= self.size(d)) continue;
      walked[k] = d;
      step[k] = st;
      used[d] = true;
      break;
    }
    if (walked[k] < 0) return std::nullopt;
  }
  auto out = self;
  for (size_t k = 0; k < size.size(); ++k)
    if (walked[k] >= 0)
      out = at::slice(out, walked[k], index[walked[k]], index[walked[k]] + (size[k] - 1) * step[k] + 1, step[k]);
  for (int64_t d = ndim - 1; d >= 0; --d)
    if (!used[d]) out = at::select(out, d, index[d]);
  // The walked dims remain in source order; put them in output order, then add the output's size-1 dims.
  std::vector<int64_t> kept;
  for (int64_t d = 0; d < ndim; ++d)
    if (used[d]) kept.push_back(d);
  std::vector<int64_t> perm;
  for (size_t k = 0; k < size.size(); ++k)
    if (walked[k] >= 0)
      perm.push_back(std::find(kept.begin(), kept.end(), walked[k]) - kept.begin());
  if (!perm.empty()) out = at::permute(out, perm);
  for (size_t k = 0; k < size.size(); ++k)
    if (walked[k] < 0) out = at::unsqueeze(out, static_cast<int64_t>(k));
  return out;
}

std::optional<at::Tensor> as_strided_by_views(const at::Tensor& self, c10::SymIntArrayRef size,
                                              c10::SymIntArrayRef stride,
                                              const std::optional<c10::SymInt>& storage_offset) {
  std::optional<int64_t> offset;
  if (storage_offset) offset = storage_offset->expect_int();
  return as_strided_by_views(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), offset);
}

// Give the wrapper the requested strides (they differ from its own on size-1 dims only), so its memory format is the
// one the caller asked for, as on one device.
void set_strides(const at::Tensor& t, at::IntArrayRef stride) {
  t.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), stride);
}

// A tensor sharded along no mesh dim (Replicate, or a pending sum, which as_strided's selection commutes with) holds
// the whole tensor on every rank; where its local tensor has the wrapper's own geometry (strides and storage
// offset), the local storage is the storage the geometry addresses, so any as_strided is the local one.
bool restrides_locally(const at::Tensor& self) {
  auto* impl = shard_impl(self);
  for (const auto& p : impl->spec()->placements)
    if (p.is_shard()) return false;
  const auto& local = impl->local();
  return local.strides() == self.strides() && local.storage_offset() == self.storage_offset();
}

// as_strided(Tensor(a) self, SymInt[] size, SymInt[] stride, SymInt? storage_offset=None)
at::Tensor as_strided_rule(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                           std::optional<c10::SymInt> storage_offset) {
  auto* impl = shard_impl(self);
  if (!addresses_self(self, size, stride, storage_offset)) {
    if (!restrides_locally(self)) {
      if (auto views = as_strided_by_views(self, size, stride, storage_offset)) return *views;
      refuse_as_strided(self, size, stride);
    }
    auto out = impl->local().as_strided_symint(size, stride, storage_offset);
    return make_shard_tensor(out, ShardSpec::make(impl->spec()->mesh, impl->spec()->placements, out.sizes().vec()));
  }
  auto out = make_shard_tensor(impl->local().alias(), impl->spec());
  set_strides(out, C10_AS_INTARRAYREF_SLOW(stride));
  return out;
}

// as_strided_(Tensor(a!) self, SymInt[] size, SymInt[] stride, SymInt? storage_offset=None) -> Tensor(a!)
at::Tensor& as_strided_inplace_rule(at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                                    std::optional<c10::SymInt> storage_offset) {
  if (!addresses_self(self, size, stride, storage_offset)) refuse_as_strided(self, size, stride);
  set_strides(self, C10_AS_INTARRAYREF_SLOW(stride));
  return self;
}

// Under autograd, the identity as_strided(_) is the identity for gradients too. Its own derivative
// (as_strided_backward) would scatter the gradient into a flat buffer of the tensor's storage size and restride
// it, which a ShardTensor cannot do; so the identity is recorded as an alias (as_strided) or changes only the
// wrapper's strides of size-1 dims and leaves the history alone (as_strided_: values and addressing are unchanged).
// Any other geometry goes on to the op's own autograd kernel and the rule below, which raises.
bool as_strided_autograd(bool inplace, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!shard_impl(self)) return false;
  const auto size = args["size"].toDimVector();
  const auto stride = args["stride"].toDimVector();
  std::optional<int64_t> offset;
  if (!args["storage_offset"].isNone()) offset = args["storage_offset"].toInt();
  if (!addresses_self(self, size, stride, offset)) {
    // A sub-grid rebuilt from view ops (recorded by autograd as those views: their backward ops have rules). A
    // tensor that restrides locally (Replicate) goes on to the op's own autograd kernel, as before.
    if (inplace || restrides_locally(self)) return false;
    auto views = as_strided_by_views(self, size, stride, offset);
    if (!views) return false;
    torch::jit::drop(*stack, args.all().size());
    torch::jit::push(*stack, std::move(*views));
    return true;
  }
  at::Tensor out = self;
  if (!inplace) out = at::alias(self);
  set_strides(out, stride);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

// A yes/no answer agreed over the ranks decides what the caller does next; under simulation every rank's answer would
// be this rank's own (the fake process group reduces nothing), so it is refused rather than silently wrong.
void refuse_under_simulation(const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(!simulating(), op, " on a ShardTensor under simulation (shardtensor.simulate): the "
                              "answer would need the other ranks' comparisons, which the fake process group does not "
                              "deliver; keep comparisons out of the simulated step");
}

// equal(Tensor self, Tensor other) -> bool
bool equal_rule(const at::Tensor& self, const at::Tensor& other) {
  refuse_under_simulation("torch.equal");
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
  refuse_under_simulation("torch.allclose");
  auto close = at::isclose(self, other, rtol, atol, equal_nan);
  return at::all(close).item<bool>();
}

} // namespace

SHARDTENSOR_RULE_FAMILY(factory) {
  // clone carries the `pointwise` tag: its rule is the pointwise family's.
  for (const char* name : {"aten::_to_copy", "aten::detach", "aten::alias", "aten::lift_fresh",
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
  dispatch::set_handler("aten::_assert_async", assert_async_handler);
  dispatch::set_handler("aten::_assert_async.msg", assert_async_handler);
  dispatch::set_handler("aten::is_same_size", typed_handler(&is_same_size_rule));
  dispatch::set_handler("aten::_has_same_storage_numel", typed_handler(&has_same_storage_numel_rule));
  dispatch::set_handler("aten::_new_zeros_with_same_feature_meta",
                        typed_handler(&new_zeros_with_same_feature_meta_rule));
  dispatch::set_handler("aten::as_strided", typed_handler(&as_strided_rule));
  dispatch::set_handler("aten::as_strided_", typed_handler(&as_strided_inplace_rule));
  dispatch::set_autograd_handler("aten::as_strided", [](const c10::OperatorHandle& op, torch::jit::Stack* s) {
    return as_strided_autograd(false, op, s);
  });
  dispatch::set_autograd_handler("aten::as_strided_", [](const c10::OperatorHandle& op, torch::jit::Stack* s) {
    return as_strided_autograd(true, op, s);
  });
  dispatch::set_handler("aten::equal", typed_handler(&equal_rule));
  dispatch::set_handler("aten::allclose", typed_handler(&allclose_rule));
}

} // namespace shardtensor::ops
