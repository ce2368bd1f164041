// The gather-compute fallback: correct by construction (every rank computes the single-device result on the same
// full data), at the cost of gathering each sharded argument. See include/shardtensor/fallback.h for the policy.
#include "dispatch/fallback.h"

#include "comm/comm_stats.h"
#include "comm/redistribute.h"
#include "dispatch/args.h"

#include <shardtensor/fallback.h>
#include <shardtensor/shard_tensor.h>

#include <ATen/core/enum_tag.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string_view>

namespace shardtensor {

namespace {

bool strict_from_env() {
  const char* v = std::getenv("SHARDTENSOR_STRICT");
  return v && std::strcmp(v, "") != 0 && std::strcmp(v, "0") != 0;
}

std::atomic<bool>& strict_flag() {
  static std::atomic<bool> flag{strict_from_env()};
  return flag;
}

struct Warned {
  std::mutex mutex;
  std::set<std::string> ops;
};

Warned& warned() {
  static auto* w = new Warned(); // never destroyed: ops may run during interpreter shutdown
  return *w;
}

// True the first time `op` asks in this process.
bool first_fallback_of(const std::string& op) {
  auto& w = warned();
  std::lock_guard<std::mutex> lock(w.mutex);
  return w.ops.insert(op).second;
}

} // namespace

bool set_strict(bool on) {
  return strict_flag().exchange(on);
}

bool strict() {
  return strict_flag().load(std::memory_order_relaxed);
}

void reset_fallback_warnings() {
  auto& w = warned();
  std::lock_guard<std::mutex> lock(w.mutex);
  w.ops.clear();
}

namespace dispatch {

namespace {

// Functional by their schemas, but they write `dst` (_copy_from) or answer about storage, which a gathered copy
// does not share with the caller's tensor.
constexpr std::string_view kRefused[] = {
    "aten::_copy_from", "aten::_copy_from_and_resize", "aten::is_set_to", "aten::_has_same_storage_numel",
    "aten::is_pinned",  "aten::_pin_memory",
};

bool has_alias(const c10::Argument& a) {
  return a.alias_info() != nullptr;
}

// The argument with every ShardTensor inside it (Tensor, Tensor?, Tensor[], Tensor?[]) replaced by `f(tensor)`.
template <typename F>
c10::IValue map_shard_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) return shard_impl(v.toTensor()) ? c10::IValue(f(v.toTensor())) : v;
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(shard_impl(t) ? f(t) : t);
    return out;
  }
  if (v.isList()) {
    auto in = v.toList();
    c10::impl::GenericList out(in.elementType());
    for (const c10::IValue& e : in) out.push_back(e.isTensor() && shard_impl(e.toTensor()) ? c10::IValue(f(e.toTensor())) : e);
    return out;
  }
  return v;
}

// A return of the op, run on plain full tensors, as a ShardTensor.
struct OutputWrapper {
  const c10::OperatorHandle& op;
  const std::string& why;
  MeshPtr mesh;
  std::vector<SpecPtr> layouts;   // the sharded arguments' layouts (Partial read as Replicate), in schema order
  std::vector<at::Tensor> inputs; // the plain full tensors the op ran on

  at::Tensor operator()(const at::Tensor& out) const {
    if (!out.defined()) return out;
    TORCH_CHECK_NOT_IMPLEMENTED(out.layout() == at::kStrided && !out.is_nested(), "ShardTensor: ",
                                qualified_name(op), why.empty() ? " has no domain-parallel rule" : " was refused by its domain-parallel rule (" + why + ")",
                                ", and its fallback returned a ", out.is_nested() ? "nested" : "non-strided",
                                " tensor, which a ShardTensor cannot hold");
    // A return sharing memory with an argument (an op breaking its schema's promise, or a Replicate argument that
    // needed no gather) must not alias the caller's tensor.
    at::Tensor full = out;
    for (const auto& in : inputs)
      if (full.is_alias_of(in)) {
        full = full.clone();
        break;
      }
    for (const auto& spec : layouts)
      if (c10::IntArrayRef(spec->global_shape) == full.sizes())
        return make_shard_tensor(redistribute_local(full, *replicate_spec(mesh, full.sizes()), *spec), spec);
    return make_shard_tensor(full, replicate_spec(mesh, full.sizes()));
  }
};

} // namespace

bool fallback_allowed(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  const auto name = qualified_name(op);
  for (auto refused : kRefused)
    if (name == refused) return false;
  if (name.rfind("aten::_nested_", 0) == 0) return false; // nested tensors cannot be ShardTensor locals
  if (schema.overload_name() == "out" || schema.is_mutable()) return false;
  if (op.hasTag(at::Tag::inplace_view) || op.hasTag(at::Tag::nondeterministic_seeded)) return false;
  for (const auto& a : schema.arguments())
    if (has_alias(a)) return false;
  for (const auto& r : schema.returns())
    if (has_alias(r)) return false;
  return true;
}

void run_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why) {
  const auto name = qualified_name(op);
  const bool warn = first_fallback_of(name);
  const std::string described = warn ? describe_shard_args(op, stack) : std::string();
  OutputWrapper wrap{op, why, common_mesh(op, stack), {}, {}};
  const auto nargs = op.schema().arguments().size();
  const auto base = stack->size() - nargs;
  int64_t bytes = 0;
  {
    // Every rank walks the same arguments in the same order and each plan depends only on the specs, so the
    // collectives match across ranks.
    comm::CollectiveScope scope("fallback_");
    auto gather = [&](const at::Tensor& t) {
      const auto& spec = shard_impl(t)->spec();
      if (spec->has_shard()) wrap.layouts.push_back(without_partial(spec));
      auto full = redistribute_local(shard_impl(t)->local(), *spec, *replicate_spec(spec->mesh, spec->global_shape));
      wrap.inputs.push_back(full);
      return full;
    };
    for (size_t i = 0; i < nargs; ++i) (*stack)[base + i] = map_shard_tensors((*stack)[base + i], gather);
    bytes = scope.bytes();
  }
  if (warn) {
    TORCH_WARN("ShardTensor: ", name, why.empty() ? " has no domain-parallel rule" : " was refused by its domain-parallel rule (" + why + ")",
               " for arguments ", described, "; it ran on the full tensors instead (every sharded argument gathered "
               "to every rank: ", bytes, " bytes collected on this rank by this call), and its results are "
               "Replicate or laid out like the first sharded argument of their shape. This warning is shown once per "
               "op. To keep the work sharded, redistribute to a layout it supports or register a rule "
               "(shardtensor.register_handler); to raise instead, set SHARDTENSOR_STRICT=1 or "
               "shardtensor.set_strict(True).");
  }
  op.callBoxed(stack);
  const auto nret = op.schema().returns().size();
  for (size_t r = 0; r < nret; ++r) {
    auto& v = (*stack)[stack->size() - nret + r];
    if (v.isTensor()) {
      v = wrap(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(wrap(t));
      v = out;
    } else if (v.isList()) {
      auto in = v.toList();
      c10::impl::GenericList out(in.elementType());
      for (const c10::IValue& e : in) out.push_back(e.isTensor() ? c10::IValue(wrap(e.toTensor())) : e);
      v = out;
    }
  }
}

} // namespace dispatch
} // namespace shardtensor
