// The gather-compute fallback: correct by construction (every rank computes the single-device result on the same
// full data), at the cost of gathering each sharded argument. See include/shardtensor/fallback.h for the policy.
#include "dispatch/fallback.h"

#include "comm/collectives.h"
#include "comm/comm_stats.h"
#include "comm/functional.h"
#include "comm/redistribute.h"
#include "dispatch/args.h"
#include "dispatch/registry.h"
#include "dispatch/replication.h"

#include <shardtensor/fallback.h>
#include <shardtensor/shard_tensor.h>
#include <shardtensor/simulation.h>

#include <ATen/core/enum_tag.h>
#include <c10/util/Exception.h>

#ifdef SHARDTENSOR_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
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

int64_t budget_from_env() {
  const char* v = std::getenv("SHARDTENSOR_FALLBACK_MAX_BYTES");
  if (!v || !*v || std::strcmp(v, "auto") == 0) return -1;
  char* end = nullptr;
  const long long bytes = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(end && *end == 0 && bytes >= 0, "SHARDTENSOR_FALLBACK_MAX_BYTES must be a number of bytes or "
                    "'auto', got '", v, "'");
  return bytes;
}

std::atomic<int64_t>& budget_flag() {
  static std::atomic<int64_t> budget{budget_from_env()};
  return budget;
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

int64_t set_fallback_budget(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= -1, "set_fallback_budget: expected a number of bytes >= 0 or -1 (automatic), got ", bytes);
  return budget_flag().exchange(bytes);
}

int64_t fallback_budget() {
  return budget_flag().load(std::memory_order_relaxed);
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

// Memory this process could still allocate on `device`: CUDA's free memory plus what torch's caching allocator
// holds unused; on the CPU the system's available memory (MemAvailable).
int64_t available_bytes(const c10::Device& device) {
  constexpr int64_t kUnknown = std::numeric_limits<int64_t>::max();
#ifdef SHARDTENSOR_HAVE_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return kUnknown;
    }
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const int64_t unused = stats.reserved_bytes[all].current - stats.allocated_bytes[all].current;
    return static_cast<int64_t>(free) + std::max<int64_t>(unused, 0);
  }
#endif
  if (!device.is_cpu()) return kUnknown;
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    long long kb = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kb) == 1) return static_cast<int64_t>(kb) * 1024;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : kUnknown;
}

// What the fallback would hold on each rank: every argument it gathers at its global size, plus the largest
// ShardTensor argument again as room for the result (not known before the op runs). From the specs alone.
int64_t gather_estimate(const c10::OperatorHandle& op, const torch::jit::Stack* stack, c10::Device* device) {
  int64_t total = 0, largest = 0;
  bool first = true;
  for (const auto& v : op_args(op, stack)) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      const auto* impl = shard_impl(t);
      if (!impl) return;
      if (first) {
        *device = impl->local().device();
        first = false;
      }
      int64_t numel = 1;
      for (auto s : impl->spec()->global_shape) numel *= s;
      const int64_t bytes = numel * static_cast<int64_t>(impl->local().element_size());
      if (!impl->spec()->all_replicate()) total += bytes;
      largest = std::max(largest, bytes);
    });
  }
  return total + largest;
}

struct Agreement {
  bool any_strict = false, all_strict = false;
  int64_t budget = 0;    // the smallest over the ranks
  int64_t estimate = 0;  // the same on every rank
};

// One small all-reduce over the op's mesh: strict mode and the budget of every rank.
Agreement agree(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool strict_here) {
  Agreement a;
  c10::Device device(c10::kCPU);
  a.estimate = gather_estimate(op, stack, &device);
  const int64_t set = fallback_budget();
  // A simulation's local tensors are fake or a rank's share only: the machine's memory says nothing about them.
  a.budget = set >= 0 ? set : simulating() ? std::numeric_limits<int64_t>::max() : available_bytes(device);
  if (comm::tracing(at::Tensor())) {
    // A traced graph cannot read host values: this rank's own settings (every rank traces its own graph).
    a.any_strict = a.all_strict = strict_here;
    return a;
  }
  auto mesh = common_mesh(op, stack);
  comm::CollectiveScope scope("fallback_");  // counted as the fallback's (fallback_all_reduce)
  const auto r = comm::all_reduce_min_ints({strict_here ? 0 : 1, strict_here ? 1 : 0, a.budget}, *mesh);
  a.any_strict = r[0] == 0;
  a.all_strict = r[1] == 1;
  a.budget = r[2];
  return a;
}

std::string strict_differs(const std::string& why) {
  return (why.empty() ? "" : why + "; ") +
         std::string("strict mode (shardtensor.set_strict / SHARDTENSOR_STRICT) is on on some ranks of the mesh and "
                     "off on others, so the ranks would not agree on running the gather-compute fallback: set it alike "
                     "on every rank");
}

} // namespace

void agree_before_strict_refusal(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why) {
  const auto a = agree(op, stack, /*strict_here=*/true);
  if (!a.all_strict) not_implemented(op, stack, strict_differs(why));
}

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
  {
    const auto a = agree(op, stack, /*strict_here=*/false);
    if (a.any_strict) not_implemented(op, stack, strict_differs(why));
    TORCH_CHECK_NOT_IMPLEMENTED(
        a.estimate <= a.budget, "ShardTensor: ", name,
        why.empty() ? " has no domain-parallel rule" : " was refused by its domain-parallel rule (" + why + ")",
        " for arguments ", describe_shard_args(op, stack), ", and its gather-compute fallback would hold about ",
        a.estimate, " bytes on every rank (each sharded argument at its global size, plus room for the result), more "
        "than the fallback budget of ", a.budget, " bytes (the smallest over the ranks: by default the memory "
        "available on the device; set it with shardtensor.set_fallback_budget(bytes) or "
        "SHARDTENSOR_FALLBACK_MAX_BYTES). Nothing was gathered. Remedies: redistribute the input to a layout a rule "
        "supports, run the op on x.to_local(), register a rule (shardtensor.register_handler), or raise the budget.");
  }
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
    FallbackReplicationScope replications(name);
    auto gather = [&](const at::Tensor& t) {
      const auto& spec = shard_impl(t)->spec();
      if (spec->has_shard()) wrap.layouts.push_back(without_partial(spec));
      auto full = redistribute_local(shard_impl(t)->local(), *spec, *replicate_spec(spec->mesh, spec->global_shape));
      // The op sees the strides the ShardTensor reports, those of the single-device tensor: a gathered tensor is
      // contiguous and a Replicate one keeps its local layout, where a kernel may demand what one device gives it
      // (torch-harmonics' DISCO kernels check `inp.is_contiguous()` on a gradient one device holds contiguous).
      if (full.strides() != t.strides() && t.is_non_overlapping_and_dense())
        full = at::empty_strided(t.sizes(), t.strides(), full.options()).copy_(full);
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
