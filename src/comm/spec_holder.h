// Carries a SpecPtr (or a MeshPtr) through at::IValue (autograd contexts save IValues).
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

struct MeshHolder : torch::CustomClassHolder {
  explicit MeshHolder(MeshPtr m) : mesh(std::move(m)) {}
  MeshPtr mesh;
};

inline at::IValue mesh_ivalue(MeshPtr mesh) {
  return at::IValue(c10::make_intrusive<MeshHolder>(std::move(mesh)));
}

inline MeshPtr mesh_from_ivalue(const at::IValue& v) {
  return v.toCustomClass<MeshHolder>()->mesh;
}

} // namespace shardtensor
