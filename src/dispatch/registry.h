// Internal handler registry: one slot per operator, bound to the ShardTensor key once.
#pragma once

#include <shardtensor/handler_registry.h>

#include <c10/core/DispatchKeySet.h>

namespace shardtensor::dispatch {

// Called once (from the library's static initializer, after every aten op is registered).
void install_dispatch();

// Where a rule runs. Every rule, built-in or registered, lives in the op's slot (so registered_handlers() lists
// it) and is swapped atomically: a dispatch running concurrently with a registration sees the old or the new rule.
enum class RuleLevel {
  // The slot's PrivateUse1 kernel: below autograd, the op's own derivative formula records the backward.
  below_autograd,
  // Before autograd and before a composite-implicit op decomposes: bound to AutogradPrivateUse1 and, since
  // inference mode skips autograd keys, to PrivateUse1 too. For composite ops whose decomposition loses the
  // layout (linear, matmul, scaled_dot_product_attention, batch_norm, upsample .vec, _pad_circular, max_pool1d)
  // and custom ops whose rule records its own backward (knn, radius_search, neighborhood_attention).
  above_autograd,
};

// Whether `op` decomposes before reaching the ShardTensor key: a CompositeImplicitAutograd kernel and no explicit
// composite one. Such ops are left to their parts' rules. An op with both (silu_backward: its structured wrapper is
// CompositeExplicitAutogradNonFunctional) decomposes above autograd, but below it (torch.compile's tracer, any call
// under no autograd key) the explicit kernel runs at the ShardTensor key, allocating a plain global-size output:
// those are bound like any other op.
bool decomposes_before_shard_key(const c10::OperatorHandle& op);

// Built-in registration helpers for src/ops: register by full name or by all overloads of a base name.
// `strict`: raise for composite-implicit ops (user registrations); built-ins skip them quietly, since such
// ops decompose into ops that have rules.
void set_handler(const c10::OperatorName& name, BoxedHandler handler, bool strict = false);
void set_handler(const char* qualified_name, BoxedHandler handler, RuleLevel level = RuleLevel::below_autograd);
void set_handler_all_overloads(const char* base_name, BoxedHandler handler);

// An op's rule above autograd, run (with grad mode on) instead of the op's own derivative formula after plain
// arguments are promoted. It returns false to take the op's own formula after all (e.g. nothing requires grad).
using AutogradHandler = std::function<bool(const c10::OperatorHandle& op, torch::jit::Stack* stack)>;
void set_autograd_handler(const char* qualified_name, AutogradHandler handler);

// Binds the ops other libraries defined since the last call (torch.library custom ops: their default kernel would
// otherwise run on the ShardTensor itself) to a slot without a rule, i.e. the fallback. Cheap when there are none;
// called by our kernels and by from_local / distribute_tensor / scatter_tensor.
void bind_new_ops();

// A built-in rule (below autograd) for an op another library defines (PhysicsNeMo's neighbour searches): bound
// when the op is defined, which may be after the library loads or never.
void set_handler_when_defined(const char* qualified_name, BoxedHandler handler,
                              RuleLevel level = RuleLevel::below_autograd);

// Ops whose ShardTensor rule runs at RuleLevel::above_autograd. torch.compile's tracers decompose composite-implicit
// ops before a traced ShardTensor's __torch_dispatch__ sees them; python/shardtensor/_traced.py routes these ops to
// their rules at the autograd key instead. (Ops with an AutogradHandler are not listed: their handler saves memory
// eagerly, and their own derivative formula traces correctly.)
std::vector<std::string> rules_above_autograd();

// The built-in rule family (dispatch/rule_family.h) that owns `op_name`'s rule ("conv (src/ops/conv.cpp)"), or empty
// when no family registered one. A user's registered handler may have replaced the rule since.
std::string rule_family_of(const std::string& op_name);

// Raises NotImplementedError naming the op, the placements of its ShardTensor arguments and the remedy.
[[noreturn]] void not_implemented(const c10::OperatorHandle& op, const torch::jit::Stack* stack,
                                  const std::string& why = "");
// The same from inside a typed rule: names the op whose rule is running on this thread and its arguments.
[[noreturn]] void not_implemented(const std::string& why);

// The qualified name of the op whose rule is running on this thread (innermost), or "" outside any rule.
std::string running_op_name();

} // namespace shardtensor::dispatch
