// Extending ShardTensor: register a domain-parallel handler for an operator (aten or a custom op).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <functional>
#include <string>

namespace shardtensor {

// A boxed handler: receives the operator and the stack holding its arguments (ShardTensors, plain tensors,
// scalars) and must leave the operator's returns on the stack. It runs below autograd.
using BoxedHandler = std::function<void(const c10::OperatorHandle& op, torch::jit::Stack* stack)>;

// Register (or replace) the handler of `op_name` ("aten::add.Tensor", "mylib::knn"; "aten::add" is the
// overload-less name). Ops not registered at load (custom ops) are bound to the ShardTensor key now.
void register_handler(const std::string& op_name, BoxedHandler handler);

// A handler written as an ordinary C++ function of the op's arguments (in schema order, as a TORCH_FN kernel takes
// them), adapted to a BoxedHandler by c10's own boxing code, so it never unpacks the stack by position:
//
//   at::Tensor scale_rule(const at::Tensor& x, double f);          // schema: mylib::scale(Tensor x, float f)
//   shardtensor::register_handler("mylib::scale", shardtensor::typed_handler(&scale_rule));
template <class FuncType>
BoxedHandler typed_handler(FuncType* fn) {
  auto kernel = c10::KernelFunction::makeFromUnboxedRuntimeFunction(fn);
  return [kernel](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    // c10's boxing moves list and optional arguments (Tensor[], Tensor?[], Tensor?, int[]) out of their stack slots.
    // The function runs on copies (reference-count bumps), so the op's arguments stay on the stack until it returns:
    // an error raised inside it (dispatch::not_implemented, a failed collective) names all of their placements.
    const auto n = op.schema().arguments().size();
    torch::jit::Stack args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    kernel.callBoxed(op, c10::DispatchKeySet(), &args);
    torch::jit::drop(*stack, n);
    for (auto& r : args) stack->push_back(std::move(r));
  };
}

// From inside a handler: raise NotImplementedError naming the op whose handler is running on this thread, the
// placements of its arguments, `why`, and the usual remedies (redistribute, to_local, register_handler). For
// layouts a handler does not support; it raises alike on every rank when `why` depends only on layouts.
[[noreturn]] void not_implemented(const std::string& why);

// True when `op_name` has a domain-parallel rule (built-in or registered).
bool has_handler(const std::string& op_name);

// Names of every op with a rule, for the supported-ops table.
std::vector<std::string> registered_handlers();

} // namespace shardtensor
