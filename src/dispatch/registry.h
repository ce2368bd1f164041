// Internal handler registry: one slot per operator, bound to the ShardTensor key once.
#pragma once

#include <shardtensor/handler_registry.h>

#include <c10/core/DispatchKeySet.h>

namespace shardtensor::dispatch {

// Called once (from the library's static initializer, after every aten op is registered).
void install_dispatch();

// Built-in registration helpers for src/ops: register by full name or by all overloads of a base name.
// `strict`: raise for composite-implicit ops (user registrations); built-ins skip them quietly, since such
// ops decompose into ops that have rules.
void set_handler(const c10::OperatorName& name, BoxedHandler handler, bool strict = false);
void set_handler(const char* qualified_name, BoxedHandler handler);
void set_handler_all_overloads(const char* base_name, BoxedHandler handler);

// An op's rule above autograd, run (with grad mode on) instead of the op's own derivative formula after plain
// arguments are promoted. It returns false to take the op's own formula after all (e.g. nothing requires grad).
using AutogradHandler = std::function<bool(const c10::OperatorHandle& op, torch::jit::Stack* stack)>;
void set_autograd_handler(const char* qualified_name, AutogradHandler handler);

// Raises NotImplementedError naming the op, the placements of its ShardTensor arguments and the remedy.
[[noreturn]] void not_implemented(const c10::OperatorHandle& op, const torch::jit::Stack* stack,
                                  const std::string& why = "");

} // namespace shardtensor::dispatch
