// Carries a SpecPtr through at::IValue (autograd contexts save IValues).
#pragma once

#include <shardtensor/spec.h>

#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>

namespace shardtensor {

struct SpecHolder : torch::CustomClassHolder {
  explicit SpecHolder(SpecPtr s) : spec(std::move(s)) {}
  SpecPtr spec;
};

inline at::IValue spec_ivalue(SpecPtr spec) {
  return at::IValue(c10::make_intrusive<SpecHolder>(std::move(spec)));
}

inline SpecPtr spec_from_ivalue(const at::IValue& v) {
  return v.toCustomClass<SpecHolder>()->spec;
}

} // namespace shardtensor
