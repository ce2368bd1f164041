// ShardTensorImpl: a storage-less TensorImpl on the shard dispatch key that wraps the local tensor.
#include <shardtensor/shard_tensor.h>
#include <shardtensor/simulation.h>

#include <ATen/ExpandUtils.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace shardtensor {

ShardTensorImpl::ShardTensorImpl(at::Tensor local, SpecPtr spec)
    // The base constructor adds AutogradPrivateUse1 and ADInplaceOrView from the backend key.
    : c10::TensorImpl(c10::DispatchKeySet(kShardKey), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
  TORCH_INTERNAL_ASSERT(local_.defined(), "ShardTensor: undefined local tensor");
  TORCH_INTERNAL_ASSERT(!local_.requires_grad(), "ShardTensor: the local tensor must not carry autograd history");
  TORCH_INTERNAL_ASSERT(!is_shard_tensor(local_), "ShardTensor: nested ShardTensors are not allowed");
  TORCH_INTERNAL_ASSERT(local_.sizes() == c10::IntArrayRef(spec_->local_shape), "ShardTensor: local shape ",
                        local_.sizes(), " does not match the spec: ", spec_->str());
  // Autocast: the base constructor gave the shard backend's autocast key (AutocastPrivateUse1), which
  // torch.autocast("cuda"/"cpu") never enables. The local tensor's autocast key instead makes torch's own autocast
  // kernels of that device (its policy: which ops run in the lower precision, which in float32) run on ShardTensors
  // above autograd, exactly as on one device; their casts are `.to()` calls on the ShardTensor, recorded by autograd.
  key_set_ = (key_set_ - c10::autocast_dispatch_keyset) | (local_.key_set() & c10::autocast_dispatch_keyset);
  set_storage_access_should_throw();
  refresh_metadata();
}

void ShardTensorImpl::refresh_metadata() {
  // Global sizes with dense strides in the local tensor's stride order, so autograd's layout contract
  // (grad strides == param strides) holds without a dense global copy. The order must be the same on every rank:
  // code that branches on strides or contiguity (reshape's view-or-copy, tensordot's paths) would otherwise issue
  // different ops, and so different collectives, on different ranks.
  //  - Ties of non-zero local strides (a dim of extent 1 next to another) are broken by position (the lower dim
  //    outer, as in a contiguous tensor), not by infer_dense_strides' sizes; zero strides (expanded dims) keep its
  //    own handling.
  //  - A sharded dim that some rank holds one row or none of has a stride there that says nothing of the layout
  //    (a narrow of extent 0 or 1 keeps any stride), while other ranks' strides for it do: such a dim is placed by
  //    position instead, just outside the next dim after it whose order is known (innermost when none), decided
  //    from the spec alone.
  const auto& global = spec_->global_shape;
  const auto ndim = static_cast<int64_t>(global.size());
  std::vector<bool> by_position(ndim, false);
  for (size_t m = 0; m < spec_->placements.size(); ++m) {
    const auto& p = spec_->placements[m];
    if (!p.is_shard() || global[p.dim] <= 1) continue;
    const auto& ext = spec_->extents[m];
    if (!ext.empty() && *std::min_element(ext.begin(), ext.end()) <= 1) by_position[p.dim] = true;
  }
  const int64_t tie = 2 * (ndim + 1);     // room between two known keys for the dims placed by position
  const int64_t level = tie * (ndim + 1); // one unit of local stride
  std::vector<int64_t> keyed(ndim, 0);
  for (int64_t d = 0; d < ndim; ++d) {
    const auto s = local_.stride(d);
    if (!by_position[d] && s != 0) keyed[d] = s * level + (ndim - d) * tie;
  }
  for (int64_t d = ndim - 1; d >= 0; --d) {
    if (!by_position[d]) continue;
    int64_t next = 0;
    for (int64_t r = d + 1; r < ndim && next == 0; ++r)
      if (!by_position[r]) next = keyed[r];
    keyed[d] = next + (ndim - d) + 1;
  }
  auto strides = at::infer_dense_strides(global, keyed);
  sizes_and_strides_.set_sizes(global);
  for (size_t i = 0; i < strides.size(); ++i) sizes_and_strides_.stride_at_unchecked(i) = strides[i];
  refresh_numel();
  refresh_contiguous();
}

void ShardTensorImpl::set_global_strides(c10::IntArrayRef strides) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(strides.size()) == dim());
  for (size_t i = 0; i < strides.size(); ++i) sizes_and_strides_.stride_at_unchecked(i) = strides[i];
  refresh_contiguous();
}

void ShardTensorImpl::make_normal_tensor() {
  if (!is_inference()) return;
  key_set_ = key_set_ | c10::getAutogradRelatedKeySetFromBackend(c10::toBackendComponent(kShardKey));
  version_counter_ = c10::VariableVersion(/*version=*/0);
}

void ShardTensorImpl::set_local(at::Tensor local) {
  TORCH_INTERNAL_ASSERT(local.sizes() == local_.sizes() && local.dtype() == local_.dtype());
  local_ = std::move(local);
}

void ShardTensorImpl::set_local_and_spec(at::Tensor local, SpecPtr spec) {
  TORCH_INTERNAL_ASSERT(local.defined() && !local.requires_grad() && !is_shard_tensor(local) &&
                        local.dtype() == local_.dtype());
  TORCH_INTERNAL_ASSERT(local.sizes() == c10::IntArrayRef(spec->local_shape), "ShardTensor: local shape ",
                        local.sizes(), " does not match the spec: ", spec->str());
  local_ = std::move(local);
  spec_ = std::move(spec);
  refresh_metadata();
}

template <typename VersionCounter>
c10::intrusive_ptr<c10::TensorImpl> ShardTensorImpl::shallow_copy_and_detach_core(
    VersionCounter&& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<ShardTensorImpl>(local_, spec_);
  copy_tensor_metadata(this, impl.get(), std::forward<VersionCounter>(version_counter),
                       allow_tensor_metadata_change);
  impl->refresh_numel();
  impl->refresh_contiguous();
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> ShardTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  return shallow_copy_and_detach_core(version_counter, allow_tensor_metadata_change);
}

c10::intrusive_ptr<c10::TensorImpl> ShardTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  return shallow_copy_and_detach_core(std::move(version_counter), allow_tensor_metadata_change);
}

void ShardTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  auto* other = dynamic_cast<ShardTensorImpl*>(impl.get());
  TORCH_CHECK_TYPE(other, "ShardTensor: cannot assign a plain tensor to a ShardTensor's .data; use "
                          "shardtensor.from_local or distribute_tensor to build a ShardTensor");
  copy_tensor_metadata(other, this, version_counter(), allow_tensor_metadata_change());
  local_ = other->local_;
  spec_ = other->spec_;
  refresh_numel();
  refresh_contiguous();
}

const c10::Storage& ShardTensorImpl::storage() const {
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "ShardTensor has no storage of its own (it is a global view of per-rank shards): use x.to_local() for ",
      "this rank's shard or x.full_tensor() (a collective) for the whole tensor. Under torch.compile, ShardTensors ",
      "are traceable as arguments and results of the compiled function or module; a ShardTensor made inside "
      "compiled code (st.* layout functions, graph breaks between sharded ops) is not traceable yet: keep that code "
      "outside the compiled region (torch.compiler.disable), or compile the per-shard computation "
      "(shardtensor.local_map(torch.compile(fn)))");
}

void ShardTensorImpl::release_resources() {
  TensorImpl::release_resources();
  local_.reset();
  spec_.reset();
}

bool is_shard_tensor(const at::Tensor& t) {
  return t.defined() && t.key_set().has(kShardKey) &&
      dynamic_cast<ShardTensorImpl*>(t.unsafeGetTensorImpl()) != nullptr;
}

ShardTensorImpl* shard_impl(const at::Tensor& t) {
  if (!t.defined() || !t.key_set().has(kShardKey)) return nullptr;
  return dynamic_cast<ShardTensorImpl*>(t.unsafeGetTensorImpl());
}

ShardTensorImpl& checked_shard_impl(const at::Tensor& t, const char* what) {
  auto* impl = shard_impl(t);
  TORCH_CHECK_TYPE(impl, what, ": expected a ShardTensor, got a plain tensor; wrap it first with "
                   "shardtensor.from_local, distribute_tensor or scatter_tensor");
  return *impl;
}

at::Tensor make_shard_tensor(at::Tensor local, SpecPtr spec) {
  TORCH_INTERNAL_ASSERT(spec);
  // Every op's result is wrapped here: one load on the usual path.
  if (C10_UNLIKELY(spec->mesh->simulation() != 0)) check_simulation_alive(*spec->mesh, "ShardTensor");
  return at::detail::make_tensor<ShardTensorImpl>(std::move(local), std::move(spec));
}

std::string shard_repr(const at::Tensor& shard) {
  auto& impl = checked_shard_impl(shard, "shard_repr");
  std::ostringstream os;
  const auto& l = impl.local();
  os << "ShardTensor(" << impl.spec()->str() << ", local=" << l.dtype().name() << l.sizes() << " on "
     << l.device();
  if (shard.requires_grad()) os << ", requires_grad=True";
  os << ")";
  return os.str();
}

} // namespace shardtensor
