// Typed handlers: a rule written as an ordinary C++ function of the op's arguments, adapted to the registry's
// boxed slot by c10's own boxing code (the same conversion a TORCH_FN kernel gets), so no rule unpacks the stack
// by position.
//
//   at::Tensor linear_rule(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);
//   dispatch::set_handler("aten::linear", dispatch::typed_handler(&linear_rule), RuleLevel::above_autograd);
#pragma once

#include "dispatch/registry.h"

#include <ATen/core/boxing/KernelFunction.h>

namespace shardtensor::dispatch {

template <class FuncType>
BoxedHandler typed_handler(FuncType* fn) {
  auto kernel = c10::KernelFunction::makeFromUnboxedRuntimeFunction(fn);
  return [kernel](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    kernel.callBoxed(op, c10::DispatchKeySet(), stack);
  };
}

} // namespace shardtensor::dispatch
