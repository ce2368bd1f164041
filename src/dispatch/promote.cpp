#include "dispatch/promote.h"

#include <shardtensor/shard_tensor.h>

#include "comm/collectives.h"
#include "comm/redistribute.h"
#include "dispatch/args.h"
#include "dispatch/grad_buckets.h"
#include "dispatch/grad_layout.h"

#include "comm/spec_holder.h"

#include <ATen/functorch/BatchedTensorImpl.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

namespace shardtensor::dispatch {

namespace {

using torch::autograd::variable_list;

std::vector<int64_t> pending_sum_dims(const ShardSpec& spec);
at::Tensor complete_to_plain(const at::Tensor& g);

// The backward of a promotion: completes the gradient (Partial terms summed, shards gathered) and hands the plain
// tensor its full gradient. A pending sum whose target is a parameter's accumulator goes to the gradient buckets
// instead (dispatch/grad_buckets.h) and reaches `.grad` by the end of the backward. A Node of its own (not an
// autograd::Function) because that decision needs the edge to the parameter.
struct PromoteBackward final : torch::autograd::Node {
  std::string name() const override { return "shardtensor::PromoteBackward"; }

  variable_list apply(variable_list&& grads) override {
    const auto& g = grads[0];
    if (!g.defined() || !is_shard_tensor(g)) return {g};
    // A gradient with a graph of its own (create_graph=True: a gradient penalty on a parameter's gradient) is
    // completed by the differentiable full_tensor, so its graph reaches the plain tensor's gradient. Nothing is
    // deferred then (the buckets never defer under create_graph).
    if (at::GradMode::is_enabled() && g.requires_grad()) return {full_tensor(g)};
    const auto& spec = shard_impl(g)->spec();
    if (auto dims = pending_sum_dims(*spec); !dims.empty()) {
      auto term = shard_impl(g)->local();
      if (defer_grad_reduction(next_edge(0), term, spec->mesh, dims)) return {at::Tensor()};
    }
    return {complete_to_plain(g)};
  }
};

// The mesh dims of a pending sum that leaves a replicated value (no shards, no other reduction); empty otherwise.
std::vector<int64_t> pending_sum_dims(const ShardSpec& spec) {
  std::vector<int64_t> dims;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const auto& p = spec.placements[m];
    if (p.is_shard() || (p.is_partial() && p.op != ReduceOp::Sum)) return {};
    if (p.is_partial()) dims.push_back(static_cast<int64_t>(m));
  }
  return dims;
}

// A promoted tensor's gradient as the plain tensor's: pending terms summed, shards gathered.
at::Tensor complete_to_plain(const at::Tensor& g) {
  const auto& spec = shard_impl(g)->spec();
  if (auto dims = pending_sum_dims(*spec); !dims.empty()) {
    // A sum left to complete: all-reduces (the redistribute planner may route Partial -> Replicate otherwise).
    auto term = shard_impl(g)->local();
    for (auto m : dims) term = comm::all_reduce(term, ReduceOp::Sum, *spec->mesh, m);
    return term;
  }
  auto full = redistribute_to(g, replicate_spec(spec->mesh, g.sizes()));
  return shard_impl(full)->local();
}


} // namespace

bool promotable(const at::Tensor& t) {
  return t.defined() && t.requires_grad() && !shard_impl(t) && !t.unsafeGetTensorImpl()->is_wrapped_number();
}

at::Tensor promote_to_replicate(const at::Tensor& plain, const MeshPtr& mesh) {
  auto out = make_shard_tensor(plain.detach(), replicate_spec(mesh, plain.sizes()));
  if (!plain.requires_grad() || !at::GradMode::is_enabled()) return out;
  auto node = std::shared_ptr<PromoteBackward>(new PromoteBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(plain));
  torch::autograd::set_history(out, node);
  return out;
}

namespace {
// Replaces each tensor of the op's arguments that it only reads (written arguments keep theirs) by `map(t)`.
template <class Map>
void map_read_args(const c10::OperatorHandle& op, torch::jit::Stack* stack, Map&& map) {
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  const auto base = stack->size() - n;
  for (size_t i = 0; i < n; ++i) {
    const auto& arg = schema.arguments()[i];
    if (arg.alias_info() && arg.alias_info()->isWrite()) continue;
    auto& v = (*stack)[base + i];
    if (v.isTensor()) {
      v = map(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list.set(j, map(list.get(j)));
    } else if (v.isList()) {
      auto list = v.toList();
      for (size_t j = 0; j < list.size(); ++j)
        if (c10::IValue e = list.get(j); e.isTensor()) list.set(j, map(e.toTensor()));
    }
  }
}

torch::autograd::Edge leaf_edge(const at::Tensor& t) {
  if (!t.defined() || shard_impl(t) || !t.is_leaf() || !t.requires_grad()) return {};
  auto acc = torch::autograd::impl::try_get_grad_accumulator(t);
  return acc ? torch::autograd::Edge(std::move(acc), 0) : torch::autograd::Edge();
}
} // namespace

bool param_grad_deferrable(const at::Tensor& t) {
  if (!t.defined()) return false;
  if (!shard_impl(t)) return grad_edge_deferrable(leaf_edge(t));
  auto* node = dynamic_cast<PromoteBackward*>(t.grad_fn().get());
  return node && grad_edge_deferrable(node->next_edge(0));
}

bool defer_leaf_grad(const at::Tensor& param, const at::Tensor& term, const MeshPtr& mesh,
                     const std::vector<int64_t>& mesh_dims) {
  return defer_grad_reduction(leaf_edge(param), term, mesh, mesh_dims);
}

std::vector<std::shared_ptr<torch::autograd::Node>> prepare_autograd_args(const c10::OperatorHandle& op,
                                                                          torch::jit::Stack* stack) {
  std::vector<std::shared_ptr<torch::autograd::Node>> keep;
  auto hook = [&](const at::Tensor& t) {
    if (auto acc = ensure_grad_layout_hook(t)) keep.push_back(std::move(acc));
  };
  MeshPtr mesh;
  for (const auto& v : op_args(op, stack)) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!mesh)
        if (auto* impl = shard_impl(t)) mesh = impl->spec()->mesh;
    });
    if (mesh) break;
  }
  if (!mesh) return keep;
  map_read_args(op, stack, [&](const at::Tensor& t) {
    if (promotable(t)) return promote_to_replicate(t, mesh);
    hook(t);
    return t;
  });
  return keep;
}

// ---- Promotion inside torch.func transforms and under forward-mode AD
//
// There the op's own derivative formula runs (registry.cpp: needs_own_autograd), over functorch's wrappers: a plain
// argument promoted by promote_to_replicate would wrap the wrapper, and its gradient would reach the plain tensor as
// the ShardTensor the formulas computed (Replicate, or a pending sum). Instead the plain argument goes through
// `shardtensor::promote_plain`, a dispatcher op with an autograd node of its own, which functorch records at each
// transform level like any op (it refuses C++ autograd Functions); the node's backward is
// `shardtensor::full_plain` (the promotion's completion as an op: a ShardTensor's whole value as a plain tensor,
// also `st.full_tensor` inside a transform), whose own backward is the promotion again, so gradients of gradients
// (hessian, jvp of grad) compose. Forward AD: the tangent is promoted or completed alike. The mesh
// travels as an argument, not as a tensor to take it from: vmap would batch such a tensor and run the promotion per
// sample (functorch's fallback), copying the parameter as many times.
//
// functorch's wrappers carry the PrivateUse1 key of a ShardTensor beneath them (kKeysToPropagateToWrapper), so the
// key tells whether one lies beneath; `shardtensor::mesh_of` finds its mesh: functorch unwraps a grad/jvp level's
// TensorWrapper for any op (its class is in a header that needs nlohmann/json, which the torch wheel lacks), vmap's
// BatchedTensor is unwrapped here (mesh_of_batched).

namespace {

using MeshArg = c10::intrusive_ptr<MeshHolder>;

bool shard_beneath(const at::Tensor& t) { return t.defined() && t.key_set().has(kShardKey); }

c10::OperatorHandle schema_of(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

MeshArg call_mesh_of(const at::Tensor& t) {
  if (auto* impl = shard_impl(t)) return c10::make_intrusive<MeshHolder>(impl->spec()->mesh);
  static const auto op = schema_of("shardtensor::mesh_of").typed<MeshArg(const at::Tensor&)>();
  return op.call(t);
}

const auto& promote_plain_op() {
  static const auto op = schema_of("shardtensor::promote_plain").typed<at::Tensor(const at::Tensor&, const MeshArg&)>();
  return op;
}

const auto& full_plain_op() {
  static const auto op = schema_of("shardtensor::full_plain").typed<at::Tensor(const at::Tensor&)>();
  return op;
}

at::Tensor call_promote_plain(const at::Tensor& plain, const MeshArg& mesh) {
  return promote_plain_op().call(plain, mesh);
}

at::Tensor call_full_plain(const at::Tensor& shard) { return full_plain_op().call(shard); }

// promote_plain's backward: the gradient completed into a plain tensor.
struct PromotePlainBackward final : torch::autograd::Node {
  std::string name() const override { return "shardtensor::PromotePlainBackward"; }
  variable_list apply(variable_list&& grads) override {
    const auto& g = grads[0];
    return {shard_beneath(g) ? call_full_plain(g) : g};
  }
};

// full_plain's backward: the plain value's cotangent promoted back onto the mesh (Replicate: its input's layout is
// not known at a transform level; the value is the input's gradient).
struct FullPlainBackward final : torch::autograd::Node {
  explicit FullPlainBackward(MeshArg m) : mesh(std::move(m)) {}
  std::string name() const override { return "shardtensor::FullPlainBackward"; }
  variable_list apply(variable_list&& grads) override {
    const auto& g = grads[0];
    return {g.defined() && !shard_beneath(g) ? call_promote_plain(g, mesh) : g};
  }
  MeshArg mesh;
};

// The autograd kernel both ops share: the op below autograd, then its node and the forward-AD tangent.
template <class MakeNode, class Below, class Tangent>
at::Tensor with_autograd(const at::Tensor& input, MakeNode&& make_node, Below&& below, Tangent&& tangent_of) {
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = below();
  }
  if (at::GradMode::is_enabled() && input.requires_grad()) {
    std::shared_ptr<torch::autograd::Node> node(make_node(), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(input));
    torch::autograd::set_history(out, node);
  }
  if (const auto& t = input._fw_grad(/*level=*/0); t.defined())
    out._set_fw_grad(tangent_of(t), /*level=*/0, /*is_inplace_op=*/false);
  return out;
}

at::Tensor promote_plain_autograd(c10::DispatchKeySet ks, const at::Tensor& plain, const MeshArg& mesh) {
  return with_autograd(
      plain, [] { return new PromotePlainBackward(); },
      [&] { return promote_plain_op().redispatch(ks & c10::after_autograd_keyset, plain, mesh); },
      [&](const at::Tensor& t) { return shard_beneath(t) ? t : call_promote_plain(t, mesh); });
}

at::Tensor full_plain_autograd(c10::DispatchKeySet ks, const at::Tensor& shard) {
  return with_autograd(
      shard, [&] { return new FullPlainBackward(call_mesh_of(shard)); },
      [&] { return full_plain_op().redispatch(ks & c10::after_autograd_keyset, shard); },
      [&](const at::Tensor& t) { return shard_beneath(t) ? call_full_plain(t) : t; });
}

// Below autograd and functorch, on the innermost tensors.
at::Tensor promote_plain_kernel(const at::Tensor& plain, const MeshArg& mesh) {
  TORCH_INTERNAL_ASSERT(!shard_impl(plain), "promote_plain: the argument is a ShardTensor already");
  return make_shard_tensor(plain.detach(), replicate_spec(mesh->mesh, plain.sizes()));
}

// A tensor of its own (a replicated input's value is its local tensor): the autograd kernel may give it a history,
// which a ShardTensor's local tensor must not carry.
at::Tensor full_plain_kernel(const at::Tensor& shard) { return complete_to_plain(shard).detach(); }

MeshArg mesh_of_kernel(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  TORCH_INTERNAL_ASSERT(impl, "mesh_of: not a ShardTensor");
  return c10::make_intrusive<MeshHolder>(impl->spec()->mesh);
}

// Under vmap: the mesh of the ShardTensor beneath the batched tensors (any level: only the mesh is read).
MeshArg mesh_of_batched(const at::Tensor& t) {
  at::Tensor inner = t;
  while (auto* b = at::functorch::maybeGetBatchedImpl(inner)) inner = b->value();
  c10::impl::ExcludeDispatchKeyGuard no_vmap(c10::DispatchKey::FuncTorchBatched);
  return call_mesh_of(inner);
}

// vmap (jacrev's and hessian's cotangents, an ensemble's batched parameters): both ops treat every sample alike and
// communicate once for all of them, so they run on the batched tensor's value (its batch dim one more dim of the
// promoted or completed tensor) and batch the result again at the same level and dim, instead of functorch's
// fallback (a call and a collective per sample, then a stack).
template <class Call>
at::Tensor batched(const at::Tensor& t, Call&& call) {
  auto* b = at::functorch::maybeGetBatchedImpl(t);
  TORCH_INTERNAL_ASSERT(b, "shardtensor's batching rule: the argument is not batched");
  return at::functorch::makeBatched(call(b->value()), b->bdim(), b->level());
}

at::Tensor promote_plain_batched(const at::Tensor& plain, const MeshArg& mesh) {
  return batched(plain, [&](const at::Tensor& v) { return call_promote_plain(v, mesh); });
}

at::Tensor full_plain_batched(const at::Tensor& shard) { return batched(shard, call_full_plain); }

} // namespace

void promote_plain_args_in_transform(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto promotable_here = [](const at::Tensor& t) {
    return t.defined() && t.requires_grad() && !shard_beneath(t) && !t.unsafeGetTensorImpl()->is_wrapped_number();
  };
  at::Tensor with_mesh;
  bool any = false;
  for (const auto& v : op_args(op, stack)) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!with_mesh.defined() && shard_beneath(t)) with_mesh = t;
      any = any || promotable_here(t);
    });
  }
  if (!with_mesh.defined() || !any) return;
  const auto mesh = call_mesh_of(with_mesh);
  map_read_args(op, stack, [&](const at::Tensor& t) { return promotable_here(t) ? call_promote_plain(t, mesh) : t; });
}

// The kernels, registered by the library's installer once the schemas and the mesh class exist (src/library.cpp: a
// static TORCH_LIBRARY_IMPL here could run first, and the typed kernels' schema inference needs the class).
void register_transform_promotion_kernels() {
  static std::vector<std::unique_ptr<torch::Library>> libs;
  auto lib = [](c10::DispatchKey key) {
    return libs.emplace_back(std::make_unique<torch::Library>(torch::Library::IMPL, "shardtensor", key, __FILE__,
                                                              __LINE__)).get();
  };
  auto* autograd = lib(c10::DispatchKey::Autograd);
  autograd->impl("promote_plain", TORCH_FN(promote_plain_autograd));
  autograd->impl("full_plain", TORCH_FN(full_plain_autograd));
  autograd->impl("mesh_of", torch::CppFunction::makeFallthrough());
  lib(c10::DispatchKey::CompositeExplicitAutograd)->impl("promote_plain", TORCH_FN(promote_plain_kernel));
  auto* shard = lib(kShardKey);
  shard->impl("full_plain", TORCH_FN(full_plain_kernel));
  shard->impl("mesh_of", TORCH_FN(mesh_of_kernel));
  auto* vmap = lib(c10::DispatchKey::FuncTorchBatched);
  vmap->impl("mesh_of", TORCH_FN(mesh_of_batched));
  vmap->impl("promote_plain", TORCH_FN(promote_plain_batched));
  vmap->impl("full_plain", TORCH_FN(full_plain_batched));
}

} // namespace shardtensor::dispatch
