// Helpers for boxed handlers: finding ShardTensors among an op's arguments, unwrapping, describing them.
#pragma once

#include <shardtensor/shard_tensor.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>

namespace shardtensor::dispatch {

// The op's arguments: the last `n` entries of the stack.
inline c10::ArrayRef<c10::IValue> op_args(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  return c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - n, n);
}

// Visit every tensor inside an argument (Tensor, Tensor?, Tensor[], Tensor?[]).
template <typename F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) f(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef())
      if (e.isTensor()) f(e.toTensor());
  }
}

// The first ShardTensor's impl among the arguments, or nullptr.
const ShardTensorImpl* first_shard_arg(const c10::OperatorHandle& op, const torch::jit::Stack* stack);

// The mesh shared by every ShardTensor argument; raises on all ranks alike when they differ.
MeshPtr common_mesh(const c10::OperatorHandle& op, const torch::jit::Stack* stack);

// "(self: Shard(0), other: plain [4, 3])" — for error messages.
std::string describe_shard_args(const c10::OperatorHandle& op, const torch::jit::Stack* stack);

// The local tensor of a ShardTensor, or the tensor itself.
inline at::Tensor local_or_self(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  return impl ? impl->local() : t;
}

// A Replicate spec for a plain tensor of `shape` on `mesh`.
SpecPtr replicate_spec(const MeshPtr& mesh, at::IntArrayRef shape);

// Tensor as a ShardTensor on `mesh`: ShardTensors pass through; plain tensors become Replicate (no copy).
at::Tensor as_shard(const at::Tensor& t, const MeshPtr& mesh);

std::string qualified_name(const c10::OperatorHandle& op);

} // namespace shardtensor::dispatch
