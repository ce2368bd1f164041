// Gradients from a backward that is not itself differentiable, and backwards that are.
//
// Many rules' autograd Functions compute their backward on local tensors (halo windows, routed elements, ring
// passes) under NoGradGuard: the gradients they return carry no graph. Under create_graph=True (a physics-informed
// loss on du/dx, a gradient penalty) a second backward through them would silently treat those gradients as
// constants and return a wrong second derivative.
//
// Ops linear in their one tensor argument (interpolation, circular padding, unfold, im2col, max_unpool, ...) need no
// such graph: their backward is the adjoint of a fixed linear map, and the adjoint's adjoint is the op itself. Such a
// rule describes the map once (a LinearMap: the op's value and its adjoint on ShardTensors, each running the rule's
// own collectives) and returns linear_backward(map, g, recording): under create_graph the adjoint is recorded with
// the op as its backward, so derivatives of any order run on rules; without it, the adjoint runs as before.
//
// Every other backward passes its gradients through once_differentiable: they get an error node instead (torch's
// @once_differentiable, in C++): a second backward that reaches them raises RuntimeError on every rank (every rank
// holds the same graph), naming the op and the remedy; a backward without create_graph is untouched.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

namespace shardtensor::ops {

// `recording`: grad mode at the backward's entry (create_graph), read before the backward's own NoGradGuard.
torch::autograd::variable_list once_differentiable(torch::autograd::variable_list grads, const char* op,
                                                   bool recording);

// A map linear in one ShardTensor argument, with everything else (layouts, sizes, indices) fixed at the forward.
// Both functions run without a graph and may issue collectives (every rank calls them alike, as the backward does).
struct LinearMap : torch::CustomClassHolder {
  // The op's value: `x` arrives as the op's input (or as a gradient of it: bring it to the input's layout).
  virtual at::Tensor apply(const at::Tensor& x) const = 0;
  // The op's backward: `g` arrives as a gradient of the op's output (any layout, plain or Partial).
  virtual at::Tensor adjoint(const at::Tensor& g) const = 0;
};
using LinearMapPtr = c10::intrusive_ptr<LinearMap>;

// A map kept in an autograd context's saved_data, and back.
c10::IValue map_ivalue(LinearMapPtr map);
LinearMapPtr map_from_ivalue(const c10::IValue& v);

// The backward of an op that is the linear map `map`: its adjoint of `g`; under create_graph (`recording`) recorded
// with the map itself as its backward (and that with the adjoint again), so every derivative order runs on rules.
at::Tensor linear_backward(const LinearMapPtr& map, const at::Tensor& g, bool recording);

// The whole backward of a Function whose forward kept its map in saved_data["map"] (map_ivalue) and whose first of
// `inputs` arguments is the map's: the gradient of that argument, none for the rest.
torch::autograd::variable_list linear_map_backward(torch::autograd::AutogradContext* ctx,
                                                   const torch::autograd::variable_list& grads, size_t inputs);

} // namespace shardtensor::ops
