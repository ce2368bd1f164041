// Helpers for boxed handlers: finding ShardTensors among an op's arguments, unwrapping, describing them.
#pragma once

#include <shardtensor/shard_tensor.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

namespace shardtensor::dispatch {

// The op's arguments: the last `n` entries of the stack.
inline c10::ArrayRef<c10::IValue> op_args(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  return c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - n, n);
}

// An op's arguments read by their schema names. For rules shared by overloads whose argument positions differ
// (sum(self, dtype?) vs sum.dim_IntList(self, dim, keepdim, dtype?)) and for generic rules that re-call the op
// with local tensors in place of ShardTensors. A rule for one schema is a typed function instead
// (shardtensor::typed_handler). The view stays valid while the arguments are on the stack.
class NamedArgs {
 public:
  NamedArgs(const c10::OperatorHandle& op, torch::jit::Stack* stack) : op_(op), stack_(stack) {}

  // True when the schema has an argument called `name`.
  bool has(std::string_view name) const {
    return index_of(name).has_value();
  }
  // The argument called `name`; the schema must have it.
  const c10::IValue& operator[](std::string_view name) const {
    return slot(name);
  }
  at::Tensor tensor(std::string_view name) const {
    return slot(name).toTensor();
  }
  // The argument's value, or `fallback` when the schema lacks it or it is None.
  template <typename T>
  T get_or(std::string_view name, T fallback) const {
    auto i = index_of(name);
    if (!i) return fallback;
    const auto& v = args()[*i];
    return v.isNone() ? fallback : v.to<T>();
  }
  // The `dtype` argument as a scalar type, when the schema has one and it is given.
  std::optional<at::ScalarType> dtype() const;
  // Replace an argument (e.g. a ShardTensor by its local tensor before re-calling the op).
  void set(std::string_view name, c10::IValue value) {
    slot(name) = std::move(value);
  }
  // Every argument in schema order; the number of stack entries the op's arguments take.
  c10::ArrayRef<c10::IValue> all() const {
    return args();
  }

 private:
  std::optional<size_t> index_of(std::string_view name) const {
    auto i = op_.schema().argumentIndexWithName(name);
    return i ? std::optional<size_t>(static_cast<size_t>(*i)) : std::nullopt;
  }
  c10::IValue& slot(std::string_view name) const;
  c10::ArrayRef<c10::IValue> args() const {
    return op_args(op_, stack_);
  }

  const c10::OperatorHandle& op_;
  torch::jit::Stack* stack_;
};

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

// The argument with every ShardTensor inside it (Tensor, Tensor?, Tensor[], Tensor?[]) replaced by `f(tensor)`.
template <typename F>
c10::IValue map_shard_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) return shard_impl(v.toTensor()) ? c10::IValue(f(v.toTensor())) : v;
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(shard_impl(t) ? f(t) : t);
    return out;
  }
  if (v.isList()) {
    auto in = v.toList();
    c10::impl::GenericList out(in.elementType());
    for (const c10::IValue& e : in) out.push_back(e.isTensor() && shard_impl(e.toTensor()) ? c10::IValue(f(e.toTensor())) : e);
    return out;
  }
  return v;
}

// The first ShardTensor's impl among the arguments, or nullptr.
const ShardTensorImpl* first_shard_arg(const c10::OperatorHandle& op, const torch::jit::Stack* stack);

// The mesh shared by every ShardTensor argument; raises on all ranks alike when they differ.
MeshPtr common_mesh(const c10::OperatorHandle& op, const torch::jit::Stack* stack);
// The same for a typed rule, which has no stack: the mesh shared by the ShardTensors among `tensors` (its tensor
// arguments; plain and undefined ones are skipped). `op_name` ("aten::cat") names the op in the message.
MeshPtr common_mesh(std::string_view op_name, at::ArrayRef<at::Tensor> tensors);

// "(self: Shard(0), other: plain [4, 3])" — for error messages.
std::string describe_shard_args(const c10::OperatorHandle& op, const torch::jit::Stack* stack);

// Raises NotImplementedError when a tensor argument is a Python tensor subclass with its own dispatch (a DTensor, say) next
// to ShardTensors: the subclass's __torch_dispatch__ would otherwise see ShardTensors as plain tensors (DTensor:
// "mixed torch.Tensor and DTensor", or a 0-d Partial taken as replicated). Call it only when the op's dispatch key
// set has the Python key (cheap to test; a Python dispatch mode sets it too, which this tells apart).
void refuse_python_subclass_args(const c10::OperatorHandle& op, const torch::jit::Stack* stack);

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
