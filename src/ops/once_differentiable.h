// Gradients from a backward that is not itself differentiable.
//
// Many rules' autograd Functions compute their backward on local tensors (halo windows, routed elements, ring
// passes) under NoGradGuard: the gradients they return carry no graph. Under create_graph=True (a physics-informed
// loss on du/dx, a gradient penalty) a second backward through them would silently treat those gradients as
// constants and return a wrong second derivative. Passed through once_differentiable, such gradients get an error
// node instead (torch's @once_differentiable, in C++): a second backward that reaches them raises
// RuntimeError on every rank (every rank holds the same graph), naming the op and the remedy; a backward
// without create_graph is untouched.
#pragma once

#include <torch/autograd.h>

namespace shardtensor::ops {

// `recording`: grad mode at the backward's entry (create_graph), read before the backward's own NoGradGuard.
torch::autograd::variable_list once_differentiable(torch::autograd::variable_list grads, const char* op,
                                                   bool recording);

} // namespace shardtensor::ops
