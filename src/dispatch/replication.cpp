// Replications: see include/shardtensor/replication.h. comm's redistribution calls `observe` before it gathers a
// shard to Replicate; only gathers made while an op's rule runs (or inside the fallback) are the op's own choice.
// Gathers outside any rule are a user's explicit request (full_tensor, redistribute) or its adjoint.
#include "dispatch/replication.h"

#include "comm/comm_stats.h"
#include "comm/redistribute.h"
#include "comm/wait.h"
#include "dispatch/registry.h"

#include <shardtensor/fallback.h>
#include <shardtensor/replication.h>
#include <shardtensor/spec.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>

namespace shardtensor {

namespace {

int64_t threshold_from_env() {
  const char* v = std::getenv("SHARDTENSOR_REPLICATION_MIN_NUMEL");
  if (!v || !*v) return 16384;
  char* end = nullptr;
  const auto n = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(end && *end == '\0' && n >= 0, "SHARDTENSOR_REPLICATION_MIN_NUMEL: expected an element count >= 0, got '",
                    v, "'");
  return n;
}

std::atomic<int64_t>& threshold_flag() {
  static std::atomic<int64_t> threshold{threshold_from_env()};
  return threshold;
}

struct Warned {
  std::mutex mutex;
  std::set<std::string> sites;
};

Warned& warned() {
  static auto* w = new Warned(); // never destroyed: ops may run during interpreter shutdown
  return *w;
}

bool first_warning_at(const std::string& site) {
  auto& w = warned();
  std::lock_guard<std::mutex> lock(w.mutex);
  return w.sites.insert(site).second;
}

} // namespace

int64_t set_replication_threshold(int64_t numel) {
  TORCH_CHECK_VALUE(numel >= 0, "set_replication_threshold: expected an element count >= 0, got ", numel);
  return threshold_flag().exchange(numel);
}

int64_t replication_threshold() {
  return threshold_flag().load(std::memory_order_relaxed);
}

void reset_replication_warnings() {
  auto& w = warned();
  std::lock_guard<std::mutex> lock(w.mutex);
  w.sites.clear();
}

namespace dispatch {

namespace {

thread_local const FallbackReplicationScope* fallback_scope = nullptr;

std::string shape_str(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

} // namespace

FallbackReplicationScope::FallbackReplicationScope(std::string op) : op_(std::move(op)), outer_(fallback_scope) {
  fallback_scope = this;
}

FallbackReplicationScope::~FallbackReplicationScope() {
  fallback_scope = outer_;
}

namespace {

void observe(const ShardSpec& src, int64_t mesh_dim, int64_t dim, int64_t element_size) {
  const bool in_fallback = fallback_scope != nullptr;
  const std::string op = in_fallback ? fallback_scope->op() : running_op_name();
  if (op.empty()) return;  // outside any rule: the user asked for it
  int64_t numel = 1;
  for (auto n : src.global_shape) numel *= n;
  // A one-rank mesh dim held the whole dim already: nothing stops being divided.
  const auto ranks = src.mesh->size(mesh_dim);
  if (ranks == 1 || src.global_shape[dim] <= ranks || numel < replication_threshold()) return;
  const auto bytes = numel * element_size;
  comm::record_replication(op, bytes);
  if (in_fallback) return;
  const auto what = op + " turned a tensor of shape " + shape_str(src.global_shape) + " laid out as " +
                    to_string(src.placements) + " into a replicated one (dim " + std::to_string(dim) +
                    " gathered to every rank: " + std::to_string(bytes) + " bytes each)";
  const auto where = comm::python_location();
  TORCH_CHECK_NOT_IMPLEMENTED(!strict(), "ShardTensor: ", what, (where.empty() ? "" : " at " + where),
                              "; strict mode refuses it: the work is no longer divided. Redistribute the input to a "
                              "layout the op keeps sharded, or turn strict mode off to let it gather.");
  if (first_warning_at(op + "@" + where)) {
    TORCH_WARN("ShardTensor: ", what, (where.empty() ? "" : " at " + where),
               ": the work is no longer divided. Counted in st.CommCounter().replications; strict mode "
               "(st.set_strict(True)) raises instead. Shown once per op and call site.");
  }
}

struct Installer {
  Installer() {
    set_replication_observer(&observe);
  }
} installer;

} // namespace

} // namespace dispatch

} // namespace shardtensor
