#include "dispatch/grad_layout.h"

#include "comm/redistribute.h"

#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace shardtensor::dispatch {

namespace {

// The hook holds the leaf's TensorImpl without a reference: it lives in the leaf's AccumulateGrad node, which
// holds the leaf. The leaf is read when the hook runs (its .data may have been reassigned since).
struct GradLayoutHook final : torch::autograd::FunctionPreHook {
  explicit GradLayoutHook(c10::TensorImpl* leaf) : leaf_(leaf) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (grads.empty() || !grads[0].defined()) return grads;
    auto leaf = at::Tensor(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(leaf_));
    if (!shard_impl(leaf)) return grads;
    auto out = grads;
    out[0] = grad_in_leaf_layout(grads[0], leaf);
    return out;
  }

  c10::TensorImpl* leaf_;
};

bool strides_match(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t i = 0; i < a.dim(); ++i)
    if (a.size(i) != 1 && a.stride(i) != b.stride(i)) return false;
  return true;
}

} // namespace

at::Tensor grad_in_leaf_layout(const at::Tensor& grad, const at::Tensor& leaf) {
  const auto& spec = shard_impl(leaf)->spec();
  if (at::GradMode::is_enabled() && is_shard_tensor(grad)) {
    // create_graph: the accumulated gradient keeps its history; AccumulateGrad then copies it itself.
    auto target = without_partial(spec);
    return redistribute(grad, target->placements, target->sharding_shapes());
  }
  auto g = grad_to_spec(grad, spec);
  // AccumulateGrad keeps a gradient whose strides match the parameter's and otherwise copies it into a buffer
  // made by new_empty_strided + copy_; doing the copy here on the local shard keeps it shard-sized and lets
  // the accumulator steal the result. An expanded (stride-0) local would also break in-place accumulation.
  const auto& gl = shard_impl(g)->local();
  const auto& ll = shard_impl(leaf)->local();
  at::Tensor dense;
  if (ll.is_non_overlapping_and_dense()) {
    if (!strides_match(gl, ll)) dense = at::empty_strided(ll.sizes(), ll.strides(), gl.options()).copy_(gl);
  } else if (!gl.is_non_overlapping_and_dense()) {
    dense = gl.contiguous();
  }
  if (!dense.defined()) return g;
  return make_shard_tensor(dense, shard_impl(g)->spec());
}

std::shared_ptr<torch::autograd::Node> ensure_grad_layout_hook(const at::Tensor& t) {
  if (!shard_impl(t) || !t.requires_grad() || !t.is_leaf()) return nullptr;
  auto acc = torch::autograd::impl::grad_accumulator(t);
  if (!acc) return nullptr;
  for (const auto& h : acc->pre_hooks())
    if (dynamic_cast<GradLayoutHook*>(h.get())) return acc;
  acc->add_pre_hook(std::make_unique<GradLayoutHook>(t.unsafeGetTensorImpl()));
  return acc;
}

} // namespace shardtensor::dispatch
