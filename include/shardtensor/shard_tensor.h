// The ShardTensor type and the user-facing operations on it.
#pragma once

#include <shardtensor/spec.h>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <optional>
#include <string>

namespace shardtensor {

// The dispatch key ShardTensors carry. One constant so it can move to PrivateUse3 if a vendor plugin owns
// PrivateUse1 in the same process.
constexpr c10::DispatchKey kShardKey = c10::DispatchKey::PrivateUse1;
constexpr c10::DispatchKey kShardAutogradKey = c10::DispatchKey::AutogradPrivateUse1;

// A TensorImpl that holds this rank's local tensor and the spec. sizes() are global, device() is the local
// device, storage access throws.
class ShardTensorImpl final : public c10::TensorImpl {
 public:
  ShardTensorImpl(at::Tensor local, SpecPtr spec);

  const at::Tensor& local() const { return local_; }
  const SpecPtr& spec() const { return spec_; }

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter,
      bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter,
      bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;
  void release_resources() override;
  // There is no global storage; the error names the way out (to_local, full_tensor, and for torch.compile,
  // whose fake-tensor conversion lands here, compiling the local computation).
  const c10::Storage& storage() const override;

  // Replace the local tensor and spec in place (used by in-place ops that change nothing visible globally).
  void set_local(at::Tensor local);
  // Replace the local tensor and the spec together: an in-place view op (squeeze_, transpose_, ...) changes the
  // tensor's shape and layout; the global sizes and strides follow.
  void set_local_and_spec(at::Tensor local, SpecPtr spec);
  // Under torch.inference_mode a new wrapper is an inference tensor (no autograd keys, no version counter). A view
  // of a normal tensor must be a normal one (ADInplaceOrView then gives it its base's version counter), as aten's
  // views are, even where the rule's local result is computed (a split dim gathered): the dispatcher calls this on
  // a view op's fresh results before autograd sees them.
  void make_normal_tensor();
  // A permutation's result takes its input's global strides permuted (`strides`, as one device's permute gives)
  // instead of those derived from the local tensor: a sharded dim that some rank holds at most one row of has no
  // order the local tensor can tell, and placing it by position misplaced it in permuted layouts (W split 3 ways,
  // `x.permute(0, 2, 3, 1)`: W put outside C, so `reshape` merging H and W copied where one device has a view).
  void set_global_strides(c10::IntArrayRef strides);

 private:
  template <typename VersionCounter>
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach_core(
      VersionCounter&& version_counter, bool allow_tensor_metadata_change) const;
  void refresh_metadata();
  const char* tensorimpl_type_name() const override { return "ShardTensorImpl"; }

  at::Tensor local_;
  SpecPtr spec_;
};

bool is_shard_tensor(const at::Tensor& t);
// nullptr for plain tensors.
ShardTensorImpl* shard_impl(const at::Tensor& t);
// Throws TypeError-like c10::TypeError for plain tensors.
ShardTensorImpl& checked_shard_impl(const at::Tensor& t, const char* what);

// Wrap without autograd (the local must not require grad). Checks local shape against the spec.
at::Tensor make_shard_tensor(at::Tensor local, SpecPtr spec);

// ---- The public API (differentiable where it says so) ----

// How from_local learns the extents of sharded dims.
enum class ShapeInference { Infer, Even, Explicit };

// Differentiable. `Infer`: one small all-gather of extents per sharded mesh dim. `Even`: default split of
// `global_shape` (required). `Explicit`: `sharding_shapes` gives the extents. `check`: verify that every rank passed
// the same arguments and that each local tensor fits the layout, raising ValueError on every rank otherwise (one
// small all-reduce per mesh dim; two for `Infer` on a multi-dim mesh). The Python API checks by default.
at::Tensor from_local(const at::Tensor& local, MeshPtr mesh, Placements placements,
                      ShapeInference mode = ShapeInference::Infer,
                      const ShardingShapes& sharding_shapes = {},
                      std::optional<std::vector<int64_t>> global_shape = std::nullopt, bool check = false);
// Differentiable; the gradient is rewrapped with the input's spec (Partial taken as Replicate).
at::Tensor to_local(const at::Tensor& shard);
// Differentiable; a collective. The incoming gradient is taken as replicated.
at::Tensor full_tensor(const at::Tensor& shard);
// Differentiable; target extents default to the default split (or the current ones where unchanged).
at::Tensor redistribute(const at::Tensor& shard, Placements placements,
                        const ShardingShapes& sharding_shapes = {});
// Every rank holds the same full tensor; each keeps its slice. Differentiable.
at::Tensor distribute_tensor(const at::Tensor& full, MeshPtr mesh, Placements placements,
                             const ShardingShapes& sharding_shapes = {});
// `full` is read on global rank `src` only (undefined elsewhere); a real scatter along each mesh dim.
at::Tensor scatter_tensor(const at::Tensor& full, int64_t src, MeshPtr mesh, Placements placements,
                          const ShardingShapes& sharding_shapes = {});

// A summary of the local shard and the spec; never communicates.
std::string shard_repr(const at::Tensor& shard);

} // namespace shardtensor
