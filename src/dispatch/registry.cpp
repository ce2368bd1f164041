// Binds every aten operator (and registered custom ops) to the ShardTensor keys.
//
// PrivateUse1: one boxed kernel per op (a "slot") that runs the op's handler; without one, or when the handler
// declines (not_implemented), a functional op runs through the gather-compute fallback (dispatch/fallback.h) and
// any other op raises NotImplementedError (strict mode: every op raises).
// Per-op kernels are required: CompositeExplicitAutograd(NonFunctional) kernels win over a backend fallback
// and would run dense global-size code on the wrapper.
//
// AutogradPrivateUse1: per op with an autograd formula, a kernel that promotes plain tensors requiring grad
// to Replicate ShardTensors (so their gradient is reduced exactly once, by the promotion's backward) and
// then runs the op's own autograd kernel.
#include "dispatch/registry.h"

#include "comm/redistribute.h"
#include "comm/wait.h"

#include "dispatch/args.h"
#include "dispatch/consistency.h"
#include "dispatch/fallback.h"
#include "dispatch/grad_layout.h"
#include "dispatch/promote.h"
#include "dispatch/rule_family.h"
#include "dispatch/shard_random.h"
#include "dispatch/view_replay.h"
#include "dispatch/write_back.h"
#include "ops/schema_util.h"

#include <shardtensor/fallback.h>
#include <shardtensor/shard_tensor.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/function.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace shardtensor {
namespace dispatch {

namespace {

// Rules are read by every dispatch without a lock and replaced rarely (registration): a slot holds an atomic
// pointer to its current rule; replaced rules stay alive in the registry (never freed), so a dispatch that loaded
// the old pointer just before a swap finishes safely.
struct Slot {
  explicit Slot(c10::OperatorName n) : name(std::move(n)) {}
  c10::OperatorName name;
  RuleLevel level = RuleLevel::below_autograd;
  std::atomic<const BoxedHandler*> handler{nullptr};              // nullptr: no rule
  std::atomic<const AutogradHandler*> autograd_handler{nullptr}; // nullptr: the op's own autograd formula
  std::vector<size_t> written;                                   // arguments the op writes in place (Tensor(a!))
  bool fallback = false;                                         // functional: may run through the fallback
  bool returns_view = false;                                     // the result aliases an argument (Tensor(a))
  bool seeded = false;                                           // draws random numbers (shard_random.h)
  // A composite op bound above autograd that autocast does not handle itself on a device (einsum on the CPU; CUDA
  // autocast lists it): on one device its decomposition's ops see autocast (its bmm casts both operands), so the
  // rule's ops see it too.
  bool composite_autocast_cpu = false, composite_autocast_cuda = false;
  std::string family, autograd_family; // the built-in families that own the rules (empty: none)
};

struct Registry {
  std::mutex mutex; // registration only; dispatch reads the slots' atomics
  std::unordered_map<c10::OperatorName, std::unique_ptr<Slot>> slots;
  std::unordered_map<std::string, std::unique_ptr<torch::Library>> shard_libs;
  std::unordered_map<std::string, std::unique_ptr<torch::Library>> autograd_libs;
  std::vector<std::unique_ptr<const BoxedHandler>> rules;                   // every rule ever set
  std::vector<std::unique_ptr<const AutogradHandler>> autograd_rules;       // likewise
  // Built-in rules for other libraries' ops by name, bound when the library defines them (set_handler_when_defined).
  struct RuleWhenDefined {
    BoxedHandler handler;
    RuleLevel level;
    std::string family;
  };
  std::unordered_map<c10::OperatorName, RuleWhenDefined> rules_when_defined;
  bool installed = false;
};

Registry& registry() {
  static auto* r = new Registry(); // never destroyed: kernels may run during interpreter shutdown
  return *r;
}

// Ops defined after install_dispatch (a library imported later: `torch.library.custom_op`s such as PhysicsNeMo's
// radius search). Such an op's default kernel is CompositeExplicitAutograd, which takes precedence over the backend
// fallback for every key, so without a slot of its own a ShardTensor reaches the op's Python body (which reads
// data_ptr() or calls .numpy()) instead of the fallback. The dispatcher tells a listener about every new op, but
// while holding its lock, so the listener only notes the name; the next kernel of ours (or from_local /
// distribute_tensor) binds the noted ops (bind_new_ops).
struct PendingOps {
  std::mutex mutex;
  std::vector<c10::OperatorName> names;
  std::atomic<bool> any{false};
};

PendingOps& pending_ops() {
  static auto* p = new PendingOps(); // never destroyed, like the registry
  return *p;
}

// Namespaces of torch itself: their ops have explicit kernels or are not called on user tensors (prims,
// functional collectives, streams, profiler marks, inductor helpers); only other libraries' ops are bound.
bool torch_namespace(const std::string& op_name) {
  static const char* const internal[] = {"aten::", "prims::", "_c10d_functional::", "c10d::", "_dtensor::",
                                         "streams::", "profiler::", "inductor::", "symm_mem::", "onnx::",
                                         "onnx_symbolic::", "rngprims::", "flex_lib::", "debug_mode_ops::",
                                         "quantized::", "_quantized::", "shardtensor::"};
  for (const char* ns : internal)
    if (op_name.rfind(ns, 0) == 0) return true;
  return false;
}

struct NewOpListener final : c10::OpRegistrationListener {
  void onOperatorRegistered(const c10::OperatorHandle& op) override {
    if (torch_namespace(op.operator_name().name)) return;
    auto& p = pending_ops();
    std::lock_guard<std::mutex> lock(p.mutex);
    p.names.push_back(op.operator_name());
    p.any.store(true, std::memory_order_release);
  }
  void onOperatorDeregistered(const c10::OperatorHandle&) override {}
};

// A collective that failed inside a handler (a peer died or raised first, a timeout): the error names the op and
// the layouts of its arguments (handlers leave their arguments on the stack until their collectives are done).
// The user's spelling of ops reached from Python methods rather than torch functions.
std::string user_call(const std::string& op) {
  if (op == "aten::_local_scalar_dense")
    return ".item() (or float()/int()/bool() of a one-element ShardTensor; aten::_local_scalar_dense)";
  if (op == "aten::is_nonzero") return "bool() of a ShardTensor (aten::is_nonzero)";
  return op;
}

[[noreturn]] void rethrow_with_op(const c10::OperatorHandle& op, const torch::jit::Stack* stack,
                                  const c10::DistBackendError& e) {
  const bool has_args = stack->size() >= op.schema().arguments().size();
  // A rank waits here when its peers do not reach the same call: `.item()` on one rank only is the usual case.
  const auto where = comm::python_location();
  C10_THROW_ERROR(DistBackendError, std::string(e.what_without_backtrace()) + "\n  while running " +
                                        user_call(qualified_name(op)) +
                                        (has_args ? " with arguments " + describe_shard_args(op, stack) : "") +
                                        (where.empty() ? "" : "\n  called from " + where) +
                                        "\n  Every rank of the mesh must make the same call (a collective) at this "
                                        "point; a rank that skipped it or made another leaves this one waiting.");
}

// The op whose rule runs on this thread (innermost; a rule's own ops dispatch through their slots and restore it),
// so a typed rule, which has no op handle or stack, can still raise naming the op and its argument placements.
// `call` numbers the slot kernel calls on this thread, so a rule's refusal is told apart from one raised by a
// nested op (or left over from an error someone caught).
struct RunningRule {
  const c10::OperatorHandle* op = nullptr;
  const torch::jit::Stack* stack = nullptr;
  uint64_t call = 0;
};
thread_local RunningRule running_rule;
thread_local uint64_t rule_calls = 0;

// The last refusal through not_implemented on this thread: the call of the rule that declined, and its reason.
struct Declined {
  uint64_t call = 0;
  std::string why;
};
thread_local Declined declined;

struct RunningRuleGuard {
  RunningRuleGuard(const c10::OperatorHandle& op, const torch::jit::Stack* stack) : saved(running_rule) {
    running_rule = {&op, stack, ++rule_calls};
  }
  ~RunningRuleGuard() {
    running_rule = saved;
  }
  RunningRule saved;
};

// Handling a NotImplementedError from the rule of this call: its own refusal through not_implemented, made before it
// took its arguments off the stack (still `depth` deep)? Then the reason, consumed; otherwise nullopt (a nested op's
// error, or one raised after the arguments were taken: the caller rethrows it).
std::optional<std::string> own_decline(const torch::jit::Stack* stack, size_t depth) {
  if (declined.call != running_rule.call || stack->size() != depth) return std::nullopt;
  auto why = std::move(declined.why);
  declined = {};
  return why;
}

// The slot kernel: below autograd for ordinary rules; on both shard keys for above-autograd ones.
// The gradient-layout hooks of the op's ShardTensor leaf arguments that require grad.
std::vector<std::shared_ptr<torch::autograd::Node>> leaf_hooks(const c10::OperatorHandle& op,
                                                               const torch::jit::Stack* stack) {
  std::vector<std::shared_ptr<torch::autograd::Node>> out;
  const auto n = op.schema().arguments().size();
  for (size_t i = stack->size() - n; i < stack->size(); ++i)
    for_each_tensor((*stack)[i], [&](const at::Tensor& t) {
      if (auto acc = ensure_grad_layout_hook(t)) out.push_back(std::move(acc));
    });
  return out;
}

// The functional overload of an out= op (`sum.IntList_out` -> `sum.dim_IntList`): the overload of the same name
// whose arguments are the out= op's without its written keyword-only ones. Found from the schemas (overload names
// do not map), once per op.
std::optional<c10::OperatorHandle> functional_overload(const c10::OperatorHandle& op) {
  static std::mutex mutex;
  static std::unordered_map<c10::OperatorName, std::optional<c10::OperatorName>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& d = c10::Dispatcher::singleton();
  auto it = cache.find(op.operator_name());
  if (it == cache.end()) {
    std::optional<c10::OperatorName> found;
    for (const auto& name : d.getAllOpNames()) {
      if (name.name != op.operator_name().name || name == op.operator_name()) continue;
      auto h = d.findOp(name);
      if (h && h->schema().returns().size() == op.schema().returns().size() &&
          ops::same_arguments(op.schema(), h->schema(),
                              [](const c10::Argument& a) { return a.kwarg_only() && ops::is_written(a); }))
        found = name;
    }
    it = cache.emplace(op.operator_name(), found).first;
  }
  if (!it->second) return std::nullopt;
  return d.findOp(*it->second);
}

// An out= or in-place op without a rule that writes only plain tensors and reads ShardTensors, decided from the
// schema and the layouts alone (every rank alike); not for ops that draw random numbers (each rank's generator):
// - every ShardTensor Replicate (torch.linalg.matrix_rank's sum(S > tol, out=...) over a gathered svd's values):
//   every rank holds the whole values, so the op runs on them as on one device and writes the same into its plain
//   outputs on every rank -- no communication, nothing gathered;
// - some input split (matrix_rank of a batch of matrices split along the batch): its functional overload runs on
//   its rule and each plain output (an out= argument) receives the whole result, gathered on every rank, as a plain
//   tensor written from ShardTensors does elsewhere.
bool run_into_plain_outputs(const Slot& slot, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (slot.written.empty() || slot.seeded || !ops::returns_written(op.schema())) return false;
  const auto& args = op.schema().arguments();
  const auto n = args.size();
  const auto base = stack->size() - n;
  bool any_shard = false, all_replicate = true, outs_only = true;
  for (size_t i = 0; i < n; ++i) {
    const auto& v = (*stack)[base + i];
    if (ops::is_written(args[i])) {
      if (v.isTensor() && v.toTensor().defined() && shard_impl(v.toTensor())) return false;
      outs_only = outs_only && args[i].kwarg_only() && v.isTensor() && v.toTensor().defined();
      continue;
    }
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!t.defined() || !shard_impl(t)) return;
      any_shard = true;
      all_replicate = all_replicate && shard_impl(t)->spec()->all_replicate();
    });
  }
  if (!any_shard) return false;
  if (all_replicate) {
    for (size_t i = 0; i < n; ++i)
      (*stack)[base + i] = map_shard_tensors((*stack)[base + i], [](const at::Tensor& t) { return local_or_self(t); });
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.callBoxed(stack);
    return true;
  }
  auto functional = outs_only ? functional_overload(op) : std::nullopt;
  if (!functional) return false;
  std::vector<at::Tensor> outs;
  torch::jit::Stack fstack;
  for (size_t i = 0; i < n; ++i) {
    const auto& v = (*stack)[base + i];
    if (ops::is_written(args[i])) outs.push_back(v.toTensor());
    else fstack.push_back(v);
  }
  functional->callBoxed(fstack);
  TORCH_INTERNAL_ASSERT(fstack.size() == outs.size(), dispatch::qualified_name(op), ": ", fstack.size(),
                        " results for ", outs.size(), " outputs");
  for (size_t k = 0; k < outs.size(); ++k) {
    auto r = fstack[k].toTensor();
    if (shard_impl(r)) {
      const auto whole = replicate_spec(shard_impl(r)->spec()->mesh, r.sizes());
      r = shard_impl(redistribute_to(r, whole))->local();
    }
    at::NoGradGuard no_grad;
    at::native::resize_output(outs[k], r.sizes());
    outs[k].copy_(r);
  }
  torch::jit::drop(*stack, n);
  for (const auto& o : outs) torch::jit::push(*stack, o);
  return true;
}

// A tangent at any forward-AD level (read without the autograd meta's lock: a tensor's own tangents are set by the
// thread that computes it; every op's dispatch asks, so no lock and no level lookup).
bool is_dual(const at::Tensor& t) {
  const auto* meta = torch::autograd::impl::get_autograd_meta(t);
  return meta && meta->fw_grad_ && !meta->fw_grad_->empty();
}

template <class Pred>
bool any_tensor_arg(const c10::OperatorHandle& op, const torch::jit::Stack* stack, Pred&& pred) {
  bool found = false;
  for (const auto& v : op_args(op, stack)) {
    for_each_tensor(v, [&](const at::Tensor& t) { found = found || (t.defined() && pred(t)); });
    if (found) break;
  }
  return found;
}

// Whether the library's autograd rules must give way to the op's own autograd:
//  - inside a torch.func transform (grad, vjp, jacrev, jvp, jacfwd, hessian, vmap of them: functorch includes its
//    dynamic-layer keys in the thread's dispatch while one is active), and for functorch's wrappers of ShardTensors
//    (its TensorWrapper carries the inner tensor's PrivateUse1 keys, so the wrappers reach the autograd key): the
//    rules cannot read a wrapper, and functorch refuses the C++ autograd Functions they record;
//  - for dual tensors of forward-mode AD (torch.autograd.forward_ad): C++ autograd Functions have no forward
//    derivative.
// The op's own derivative formula (or composite decomposition) then runs, whose ops reach the rules below autograd
// on the ShardTensors, tangents included.
bool needs_own_autograd(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerBackMode)) return true;
  const bool forward_ad = c10::AutogradState::get_tls_state().get_fw_grad_mode();
  return any_tensor_arg(op, stack, [&](const at::Tensor& t) {
    return t.key_set().has(c10::DispatchKey::FuncTorchGradWrapper) || (forward_ad && is_dual(t));
  });
}

bool has_dual_tensors(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  return c10::AutogradState::get_tls_state().get_fw_grad_mode() && any_tensor_arg(op, stack, is_dual);
}

// Above autograd, for such arguments: the op's own autograd (its composite decomposition, whose ops each find their
// rule, or its derivative formula over the rules below autograd), as on a plain tensor.
void run_own_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
    return op.callBoxedForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd, *stack);
  TORCH_CHECK_NOT_IMPLEMENTED(op.hasKernelForDispatchKey(c10::DispatchKey::Autograd), "ShardTensor: ",
                              qualified_name(op), " has a domain-parallel rule above autograd and no derivative "
                              "formula of its own, so it cannot run inside a torch.func transform (grad, vjp, jvp, "
                              "jacrev, ...); call it outside the transform, or on x.to_local()");
  op.redispatchBoxed((ks - c10::autograd_dispatch_keyset) | c10::DispatchKeySet(c10::DispatchKey::AutogradOther),
                     stack);
}

struct SlotKernel final : c10::OperatorKernel {
  SlotKernel(Slot* s, bool autograd_key) : slot(s), at_autograd_key(autograd_key) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    bind_new_ops();
    // Above autograd (linear, matmul, attention, ...): a DTensor argument is refused before the rule unwraps it.
    if (ks.has(c10::DispatchKey::Python)) refuse_python_subclass_args(op, stack);
    if (at_autograd_key && needs_own_autograd(op, stack)) {
      if (at::GradMode::is_enabled()) promote_plain_args_in_transform(op, stack);
      return run_own_autograd(op, ks, stack);
    }
    // Below autograd the op's autograd kernel takes the tangents of dual arguments (its forward formula, after this
    // returns): nothing the rule records may take them again (its C++ autograd Functions have no forward derivative).
    std::optional<c10::AutoFwGradMode> no_forward_ad;
    if (!at_autograd_key && has_dual_tensors(op, stack)) no_forward_ad.emplace(false);
    // A rule above autograd records its own graph: its ShardTensor leaves get the gradient-layout hook, as the
    // promote kernel gives every other op's (a rank's local gradient dense and in its leaf's local layout, even
    // where the global strides, equal on every rank, cannot tell the layouts apart).
    std::vector<std::shared_ptr<torch::autograd::Node>> accumulators; // alive until the rule has recorded edges
    if (slot->level == RuleLevel::above_autograd && at::GradMode::is_enabled()) accumulators = leaf_hooks(op, stack);
    // Autocast decided at the op's own level (the device's autocast kernel ran on the ShardTensors, see
    // ShardTensorImpl); the rule's local ops run as they are given, as a device kernel's internals do -- except a
    // composite op's that autocast leaves to its decomposition (Slot::composite_autocast_*).
    std::optional<c10::impl::ExcludeDispatchKeyGuard> no_autocast;
    if (!autocast_inside(op, stack)) no_autocast.emplace(c10::autocast_dispatch_keyset);
    const bool view_of_normal = slot->returns_view && c10::InferenceMode::is_enabled() && first_arg_normal(op, stack);
    try {
      run(op, stack);
    } catch (const c10::DistBackendError& e) {
      rethrow_with_op(op, stack, e);
    }
    if (view_of_normal) keep_views_normal(op, stack);
  }
  // Whether the rule runs with autocast left on (Slot::composite_autocast_*), by the device of the first tensor.
  bool autocast_inside(const c10::OperatorHandle& op, const torch::jit::Stack* stack) const {
    if (!slot->composite_autocast_cpu && !slot->composite_autocast_cuda) return false;
    std::optional<c10::DeviceType> device;
    any_tensor_arg(op, stack, [&](const at::Tensor& t) {
      device = t.device().type();
      return true;  // the first tensor decides
    });
    return device && ((*device == c10::kCPU && slot->composite_autocast_cpu) ||
                      (*device == c10::kCUDA && slot->composite_autocast_cuda));
  }
  // Under inference mode a view of a normal tensor is a normal tensor (ADInplaceOrView, which runs after this kernel,
  // gives it the base's version counter); a rule whose local result is computed (a gathered split dim) made an
  // inference tensor.
  static bool first_arg_normal(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
    const auto n = op.schema().arguments().size();
    if (n == 0 || stack->size() < n) return false;
    const auto& self = (*stack)[stack->size() - n];
    return self.isTensor() && self.toTensor().defined() && !self.toTensor().is_inference();
  }
  static void keep_views_normal(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    const auto n = op.schema().returns().size();
    auto normal = [](const at::Tensor& t) {
      if (auto* impl = t.defined() ? shard_impl(t) : nullptr) impl->make_normal_tensor();
    };
    for (size_t i = stack->size() - std::min(n, stack->size()); i < stack->size(); ++i) {
      const auto& v = (*stack)[i];
      if (v.isTensor()) normal(v.toTensor());
      else if (v.isTensorList())
        for (const auto& t : v.toTensorList()) normal(t);
    }
  }
  void run(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    const BoxedHandler* rule = slot->handler.load(std::memory_order_acquire);
    // Strict mode is a rank's own setting: where the fallback could run, a strict rank's refusal first meets its
    // peers' fallback agreement (a peer that is not strict waits there), so both raise instead of one waiting.
    const bool fallback_op = slot->fallback && slot->level == RuleLevel::below_autograd;
    const bool may_fall_back = fallback_op && !strict();
    if (!rule) {
      if (run_into_plain_outputs(*slot, op, stack)) return;
      if (!fallback_op) not_implemented(op, stack);
      if (consistency_check_enabled()) check_op_consistency(op, stack);
      if (!may_fall_back) {
        agree_before_strict_refusal(op, stack, "");
        not_implemented(op, stack);
      }
      return run_fallback(op, stack, "");
    }
    RunningRuleGuard running(op, stack);
    if (consistency_check_enabled()) check_op_consistency(op, stack);
    std::optional<ShardRandomGuard> random_streams; // per-shard streams, generator kept in step (shard_random.h)
    if (slot->seeded) random_streams.emplace(op, stack);
    if (fallback_op) {
      // A rule that declines (every rank alike: rules decide from the specs) before it takes its arguments off the
      // stack (typed rules always do) leaves them there, so the fallback runs on them.
      const auto depth = stack->size();
      try {
        return (*rule)(op, stack);
      } catch (const c10::NotImplementedError&) {
        auto declined_why = own_decline(stack, depth);
        if (!declined_why) throw;
        auto why = std::move(*declined_why);
        if (!may_fall_back) {
          agree_before_strict_refusal(op, stack, why);
          throw;
        }
        return run_fallback(op, stack, why);
      }
    }
    if (slot->written.empty() || !any_select_copies()) return (*rule)(op, stack);
    // In-place and out= ops: copies of x[i] along a sharded dim write through to x (write_back.h).
    const auto base = stack->size() - op.schema().arguments().size();
    std::vector<at::Tensor> written;
    for (auto i : slot->written)
      if ((*stack)[base + i].isTensor()) written.push_back((*stack)[base + i].toTensor());
    (*rule)(op, stack);
    for (const auto& t : written) after_write(t);
  }
  Slot* slot;
  bool at_autograd_key;  // bound on the autograd key (a rule above autograd), not the backend key
};

struct PromoteKernel final : c10::OperatorKernel {
  PromoteKernel(Slot* s, bool /*autograd_key: always*/) : slot(s) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    bind_new_ops();
    // A DTensor argument: refuse here, above the Python key, before DTensor's dispatch sees ShardTensors.
    if (ks.has(c10::DispatchKey::Python)) refuse_python_subclass_args(op, stack);
    ViewReplayGuard replay(slot->returns_view);
    std::vector<std::shared_ptr<torch::autograd::Node>> accumulators; // alive until the op has recorded edges
    const bool grad_mode = at::GradMode::is_enabled();
    const bool own_autograd = grad_mode && needs_own_autograd(op, stack);
    if (own_autograd) promote_plain_args_in_transform(op, stack);
    if (grad_mode && !own_autograd) {
      accumulators = prepare_autograd_args(op, stack);
      const AutogradHandler* rule = slot->autograd_handler.load(std::memory_order_acquire);
      if (rule) {
        // An autograd rule that declines through not_implemented (every rank alike: rules decide from the specs)
        // before taking its arguments off the stack leaves the op to its own derivative formula, whose forward
        // reaches the op's rule below autograd or the fallback (a split the autograd rule does not take).
        RunningRuleGuard running(op, stack);
        const auto depth = stack->size();
        try {
          if ((*rule)(op, stack)) return;
        } catch (const c10::NotImplementedError&) {
          if (!own_decline(stack, depth)) throw;
        }
      }
    }
    // Run the op's generated autograd kernel, which is also bound to AutogradOther.
    auto next = (ks - c10::autograd_dispatch_keyset) | c10::DispatchKeySet(c10::DispatchKey::AutogradOther);
    // A promoted ZeroTensor argument (forward-mode AD's absent tangent) is a ShardTensor of real zeros now: the
    // ZeroTensor kernels must not run (they take every argument they do not see as zero for the zero one).
    if (next.has(c10::DispatchKey::ZeroTensor) &&
        !any_tensor_arg(op, stack, [](const at::Tensor& t) { return t._is_zerotensor(); }))
      next = next.remove(c10::DispatchKey::ZeroTensor);
    op.redispatchBoxed(next, stack);
  }
  Slot* slot;
};

std::string qualified(const c10::OperatorName& name) {
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

torch::Library& library_for(std::unordered_map<std::string, std::unique_ptr<torch::Library>>& libs,
                            const std::string& ns, c10::DispatchKey key) {
  auto& lib = libs[ns];
  if (!lib) lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
  return *lib;
}

// Register `Kernel(slot)` for the op on one shard key.
template <class Kernel>
void bind_kernel(Registry& r, const c10::OperatorName& name, c10::DispatchKey key, Slot* slot) {
  const auto sep = name.name.find("::");
  const auto ns = name.name.substr(0, sep);
  const auto local_name = qualified(name).substr(sep + 2);
  library_for(key == kShardKey ? r.shard_libs : r.autograd_libs, ns, key)
      .impl(local_name.c_str(),
            torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(slot, key == kShardAutogradKey)));
}

// Bind one op to the shard key (and its autograd kernel where the op has a derivative formula).
Slot* bind_op(Registry& r, const c10::OperatorName& name, const c10::OperatorHandle& handle) {
  auto it = r.slots.find(name);
  if (it != r.slots.end()) return it->second.get();
  auto slot = std::make_unique<Slot>(name);
  const auto& args = handle.schema().arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].alias_info() && args[i].alias_info()->isWrite()) slot->written.push_back(i);
  slot->fallback = fallback_allowed(handle);
  slot->returns_view = returns_view(handle.schema());
  slot->seeded = handle.hasTag(at::Tag::nondeterministic_seeded);
  auto* raw = slot.get();
  bind_kernel<SlotKernel>(r, name, kShardKey, raw);
  if (handle.hasKernelForDispatchKey(c10::DispatchKey::Autograd) && !handle.hasKernelForDispatchKey(kShardAutogradKey))
    bind_kernel<PromoteKernel>(r, name, kShardAutogradKey, raw);
  r.slots.emplace(name, std::move(slot));
  return raw;
}

// Bind a rule that runs before autograd (RuleLevel::above_autograd): the slot kernel on both shard keys.
Slot* bind_above_autograd(Registry& r, const c10::OperatorName& name, const c10::OperatorHandle& handle) {
  auto it = r.slots.find(name);
  if (it != r.slots.end()) {
    TORCH_INTERNAL_ASSERT(it->second->level == RuleLevel::above_autograd, qualified(name),
                          " already has a rule below autograd");
    return it->second.get();
  }
  TORCH_INTERNAL_ASSERT(!handle.hasKernelForDispatchKey(kShardKey), qualified(name), " is bound already");
  auto slot = std::make_unique<Slot>(name);
  slot->level = RuleLevel::above_autograd;
  slot->seeded = handle.hasTag(at::Tag::nondeterministic_seeded);
  const bool composite = decomposes_before_shard_key(handle);
  slot->composite_autocast_cpu = composite && !handle.hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU);
  slot->composite_autocast_cuda = composite && !handle.hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA);
  auto* raw = slot.get();
  bind_kernel<SlotKernel>(r, name, kShardAutogradKey, raw);
  bind_kernel<SlotKernel>(r, name, kShardKey, raw);
  r.slots.emplace(name, std::move(slot));
  return raw;
}

// A built-in family claims an op's rule: one owner per op, so no family's rule silently replaces another's and the
// families' installation order cannot matter. Users' registrations (no family running) replace rules freely.
void claim(std::string& owner, const c10::OperatorName& name, const char* what) {
  const auto& family = registering_family();
  if (family.empty()) return;
  TORCH_INTERNAL_ASSERT(owner.empty(), "two built-in ", what, " for ", qualified(name), ": the family ", owner,
                        " registered one and the family ", family,
                        " registers another. An op has one built-in rule; merge them into the family that owns the op");
  owner = family;
}

void store_rule(Registry& r, Slot* slot, BoxedHandler handler) {
  claim(slot->family, slot->name, "rules");
  r.rules.push_back(std::make_unique<const BoxedHandler>(std::move(handler)));
  slot->handler.store(r.rules.back().get(), std::memory_order_release);
}

bool should_bind(const c10::OperatorHandle& h) {
  // Composite-implicit ops must keep decomposing above the backend (binding them would drop their autograd).
  return !decomposes_before_shard_key(h) && !h.hasKernelForDispatchKey(kShardKey);
}

// Another library's op that would bypass the fallback: a CompositeExplicitAutograd kernel and nothing of ours.
bool needs_custom_op_slot(const c10::OperatorHandle& h) {
  return !torch_namespace(h.operator_name().name) &&
      h.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) && should_bind(h);
}

// Slots (no rule: the fallback's policy) for the ops the listener noted. An op whose kernels are registered after
// the next dispatch of ours is not bound (it was seen without them); torch.library.custom_op registers its
// definition and kernel in one call.
void bind_noted_ops() {
  auto& p = pending_ops();
  std::vector<c10::OperatorName> names;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    names.swap(p.names);
    p.any.store(false, std::memory_order_release);
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& d = c10::Dispatcher::singleton();
  for (const auto& name : names) {
    if (r.slots.count(name)) continue;
    auto h = d.findOp(name);
    if (!h) continue;
    auto rule = r.rules_when_defined.find(name);
    if (rule != r.rules_when_defined.end() && should_bind(*h)) {
      auto* slot = rule->second.level == RuleLevel::above_autograd ? bind_above_autograd(r, name, *h)
                                                                   : bind_op(r, name, *h);
      slot->family = rule->second.family;
      r.rules.push_back(std::make_unique<const BoxedHandler>(rule->second.handler));
      slot->handler.store(r.rules.back().get(), std::memory_order_release);
    } else if (needs_custom_op_slot(*h)) {
      bind_op(r, name, *h);
    }
  }
}

c10::OperatorName parse_name(const std::string& full) {
  auto dot = full.find('.', full.find("::"));
  if (dot == std::string::npos) return {full, ""};
  return {full.substr(0, dot), full.substr(dot + 1)};
}

// Ops of other namespaces (no slots): the same policy as a slot without a rule.
void shard_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  bind_new_ops();
  if (!fallback_allowed(op)) not_implemented(op, stack);
  if (consistency_check_enabled()) check_op_consistency(op, stack);
  if (strict()) {
    agree_before_strict_refusal(op, stack, "");
    not_implemented(op, stack);
  }
  run_fallback(op, stack, "");
}

} // namespace

bool decomposes_before_shard_key(const c10::OperatorHandle& op) {
  return op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
      !op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
      !op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
}

void install_dispatch() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.installed) return;
  r.installed = true;
  auto& d = c10::Dispatcher::singleton();
  for (const auto& name : d.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto h = d.findOp(name);
    if (!h || !should_bind(*h)) continue;
    bind_op(r, name, *h);
  }
  // Other libraries' ops, defined so far (the listener is told of them at once) and later.
  static auto* listener = new c10::RegistrationHandleRAII(
      d.addRegistrationListener(std::make_unique<NewOpListener>())); // never removed, like the slots
  (void)listener;
  static torch::Library fallback_lib(torch::Library::IMPL, "_", kShardKey, __FILE__, __LINE__);
  fallback_lib.fallback(torch::CppFunction::makeFromBoxedFunction<&shard_fallback>());
  static torch::Library autograd_fallback_lib(torch::Library::IMPL, "_", kShardAutogradKey, __FILE__, __LINE__);
  autograd_fallback_lib.fallback(torch::autograd::autogradNotImplementedFallback());
}

void set_handler_when_defined(const char* qualified_name, BoxedHandler handler, RuleLevel level) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto name = parse_name(qualified_name);
  TORCH_INTERNAL_ASSERT(!torch_namespace(name.name) && !r.slots.count(name) && !r.rules_when_defined.count(name),
                        qualified_name, ": a rule for a library's op is registered once, before the op is bound");
  r.rules_when_defined.emplace(name, Registry::RuleWhenDefined{std::move(handler), level, registering_family()});
  // Defined already (the library was imported first): the listener noted it; bound with the next bind_new_ops.
  if (c10::Dispatcher::singleton().findOp(name)) {
    auto& p = pending_ops();
    std::lock_guard<std::mutex> plock(p.mutex);
    p.names.push_back(name);
    p.any.store(true, std::memory_order_release);
  }
}

void bind_new_ops() {
  if (pending_ops().any.load(std::memory_order_acquire)) bind_noted_ops();
}

void set_handler(const c10::OperatorName& name, BoxedHandler handler, bool strict) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.slots.find(name);
  if (it == r.slots.end()) {
    auto h = c10::Dispatcher::singleton().findOp(name);
    TORCH_CHECK_VALUE(h.has_value(), "register_handler: no operator named '", qualified(name),
                      "' is registered; define the op (torch.library) before registering its handler");
    if (!strict && decomposes_before_shard_key(*h)) return;
    TORCH_CHECK_NOT_IMPLEMENTED(!decomposes_before_shard_key(*h),
                                "register_handler: '", qualified(name),
                                "' is composite-implicit (it decomposes into other ops); register handlers "
                                "for the ops it decomposes into instead");
    store_rule(r, bind_op(r, name, *h), std::move(handler));
    return;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!strict || it->second->level == RuleLevel::below_autograd, "register_handler: '",
                              qualified(name), "' has a built-in rule that runs above autograd (it records its own "
                              "backward); a registered handler runs below autograd and cannot replace it. Register "
                              "handlers for the ops it calls instead");
  store_rule(r, it->second.get(), std::move(handler));
}

void set_autograd_handler(const char* qualified_name, AutogradHandler handler) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto name = parse_name(qualified_name);
  auto h = c10::Dispatcher::singleton().findOp(name);
  TORCH_INTERNAL_ASSERT(h && h->hasKernelForDispatchKey(c10::DispatchKey::Autograd), qualified_name,
                        " has no autograd kernel to replace");
  // The op's own rule may belong to another family, not registered yet (families register in any order).
  auto* slot = bind_op(r, name, *h);
  TORCH_INTERNAL_ASSERT(slot->level == RuleLevel::below_autograd, qualified_name,
                        " has a rule above autograd, which replaces its autograd kernel already");
  claim(slot->autograd_family, name, "autograd rules");
  r.autograd_rules.push_back(std::make_unique<const AutogradHandler>(std::move(handler)));
  slot->autograd_handler.store(r.autograd_rules.back().get(), std::memory_order_release);
}

void set_handler(const char* qualified_name, BoxedHandler handler, RuleLevel level) {
  if (level == RuleLevel::below_autograd) return set_handler(parse_name(qualified_name), std::move(handler), false);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto name = parse_name(qualified_name);
  auto h = c10::Dispatcher::singleton().findOp(name);
  TORCH_INTERNAL_ASSERT(h.has_value(), qualified_name, " is not defined (its schema belongs in src/library.cpp)");
  store_rule(r, bind_above_autograd(r, name, *h), std::move(handler));
}

void set_handler_all_overloads(const char* base_name, BoxedHandler handler) {
  auto& d = c10::Dispatcher::singleton();
  bool any = false;
  for (const auto& name : d.getAllOpNames()) {
    // out= overloads write into a caller's tensor and are handled by the op's own rule, if any.
    if (name.name != base_name || name.overload_name == "out") continue;
    auto h = d.findOp(name);
    if (!h || decomposes_before_shard_key(*h)) continue;
    set_handler(name, handler, /*strict=*/false);
    any = true;
  }
  TORCH_INTERNAL_ASSERT(any, "no bindable overload of ", base_name);
}

void not_implemented(const std::string& why) {
  // Called from code that no slot kernel entered (a helper run directly, outside any rule): no op to name.
  TORCH_CHECK_NOT_IMPLEMENTED(running_rule.op, "ShardTensor: not supported (", why,
                              "); raised outside an op's domain-parallel rule, so no op or argument layouts to show");
  not_implemented(*running_rule.op, running_rule.stack, why);
}

void not_implemented(const c10::OperatorHandle& op, const torch::jit::Stack* stack, const std::string& why) {
  // Inside the rule of this very call: a refusal the slot kernel may answer with the fallback. The op has a rule
  // then, and the message says it refused (not that there is none).
  const bool refused_by_rule = running_rule.stack == stack;
  if (refused_by_rule) declined = {running_rule.call, why};
  std::string placements = describe_shard_args(op, stack);
  TORCH_CHECK_NOT_IMPLEMENTED(false, "ShardTensor: ", qualified(op.operator_name()),
                              refused_by_rule ? " was refused by its domain-parallel rule" : " has no domain-parallel rule",
                              why.empty() ? "" : " (" + why + ")", " for arguments ", placements,
                              ". Remedies: redistribute the input first (x.redistribute([Replicate()]) or "
                              "x.full_tensor()), run the op on x.to_local(), or register a handler with "
                              "shardtensor.register_handler.");
}

std::string running_op_name() {
  return running_rule.op ? qualified(running_rule.op->operator_name()) : std::string();
}

} // namespace dispatch

void not_implemented(const std::string& why) {
  dispatch::not_implemented(why);
}

void register_handler(const std::string& op_name, BoxedHandler handler) {
  auto full = op_name.find("::") == std::string::npos ? "aten::" + op_name : op_name;
  dispatch::set_handler(dispatch::parse_name(full), std::move(handler), /*strict=*/true);
}

bool has_handler(const std::string& op_name) {
  auto& r = dispatch::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.slots.find(dispatch::parse_name(op_name.find("::") == std::string::npos ? "aten::" + op_name : op_name));
  return it != r.slots.end() && it->second->handler.load() != nullptr;
}

namespace dispatch {

std::string rule_family_of(const std::string& op_name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.slots.find(parse_name(op_name));
  return it == r.slots.end() ? std::string() : it->second->family;
}

std::vector<std::string> rules_above_autograd() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, slot] : r.slots)
    if (slot->level == RuleLevel::above_autograd && slot->handler.load())
      out.push_back(qualified(name));
  std::sort(out.begin(), out.end());
  return out;
}

} // namespace dispatch

std::vector<std::string> registered_handlers() {
  auto& r = dispatch::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, slot] : r.slots)
    if (slot->handler.load()) out.push_back(dispatch::qualified(name));
  std::sort(out.begin(), out.end());
  return out;
}

} // namespace shardtensor
