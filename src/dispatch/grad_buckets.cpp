#include "dispatch/grad_buckets.h"

#include "comm/collectives.h"
#include "comm/functional.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

namespace shardtensor::dispatch {

namespace {

using torch::autograd::AccumulateGrad;
using torch::autograd::Node;

int64_t initial_bucket_bytes() {
  const char* env = std::getenv("SHARDTENSOR_GRAD_BUCKET_BYTES");
  if (!env || !*env) return int64_t{1} << 20;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  TORCH_CHECK_VALUE(end && *end == '\0' && v >= 0, "SHARDTENSOR_GRAD_BUCKET_BYTES: expected a number of bytes >= 0 ",
                    "(0 turns gradient bucketing off), got '", env, "'");
  return v;
}

std::atomic<int64_t>& bucket_bytes() {
  static std::atomic<int64_t> bytes{initial_bucket_bytes()};
  return bytes;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Entry {
  std::shared_ptr<Node> acc;  // the parameter's AccumulateGrad
  at::Tensor term;            // this rank's term, until the bucket is flattened
  int64_t numel = 0;
};

// Terms of one mesh, mesh dims and dtype. Issued: one all-reduce per mesh dim, in turn, on the flat buffer.
struct Bucket {
  MeshPtr mesh;
  std::vector<int64_t> dims;
  at::ScalarType dtype = at::kFloat;
  at::Device device{at::kCPU};
  std::vector<Entry> entries;
  int64_t bytes = 0;
  bool issued = false;
  size_t stage = 0;  // the mesh dim (index into dims) whose all-reduce is in flight
  comm::PendingAllReduce pending;
  at::Tensor result;  // the complete sums, once every stage finished

  bool holds(const MeshPtr& m, const std::vector<int64_t>& d, const at::Tensor& t) const {
    return !issued && mesh == m && dims == d && dtype == t.scalar_type() && device == t.device();
  }
};

// The deferred reductions of one backward (autograd graph task). The final callback queued for it holds `token`;
// a backward that ended without running it (an error) leaves the weak pointer expired.
struct TaskState {
  int task = -1;
  std::weak_ptr<int> token;
  std::vector<std::unique_ptr<Bucket>> buckets;  // in creation order, the same on every rank
};

struct Stats {
  int64_t buckets = 0;
  int64_t bytes = 0;
  int64_t deferred = 0;
  double wait_s = 0;
  double issue_s = 0;
};

std::mutex& mu() {
  static std::mutex m;
  return m;
}
std::vector<TaskState>& states() {
  static std::vector<TaskState> s;
  return s;
}
Stats& stats() {
  static Stats s;
  return s;
}

// Moves a multi-dim bucket on to its next mesh dim (waits the current one).
void advance(Bucket& b) {
  const auto t0 = now();
  auto flat = comm::finish_all_reduce_sum(b.pending, *b.mesh, b.dims[b.stage]);
  stats().wait_s += now() - t0;
  if (++b.stage < b.dims.size()) {
    const auto t1 = now();
    b.pending = comm::all_reduce_sum_start(std::move(flat), *b.mesh, b.dims[b.stage]);
    stats().issue_s += now() - t1;
  } else {
    b.result = std::move(flat);
  }
}

// Flattens bucket `i` of `s` and issues its first all-reduce. Earlier buckets with mesh dims left move on by one
// first: their next all-reduce goes out in the same place on every rank.
void issue(TaskState& s, size_t i) {
  for (size_t j = 0; j < i; ++j) {
    auto& b = *s.buckets[j];
    if (b.issued && !b.result.defined() && b.stage + 1 < b.dims.size()) advance(b);
  }
  auto& b = *s.buckets[i];
  const auto t0 = now();
  std::vector<at::Tensor> flat;
  flat.reserve(b.entries.size());
  for (auto& e : b.entries) {
    flat.push_back(e.term.reshape({-1}));
    e.term = at::Tensor();
  }
  // A buffer of our own (cat copies), reduced in place.
  auto buf = at::cat(flat);
  flat.clear();
  b.issued = true;
  b.pending = comm::all_reduce_sum_start(std::move(buf), *b.mesh, b.dims[0]);
  stats().issue_s += now() - t0;
  stats().buckets += 1;
  stats().bytes += b.bytes;
}

// Issues what is left, waits for every sum and accumulates each into its parameter.
void complete(TaskState& s) {
  for (size_t i = 0; i < s.buckets.size(); ++i)
    if (!s.buckets[i]->issued) issue(s, i);
  for (auto& b : s.buckets)
    while (!b->result.defined()) advance(*b);
  // One accumulation per parameter: a parameter used by several layers gets the sum of its terms, as autograd's
  // input buffer would have handed it.
  std::vector<std::pair<std::shared_ptr<Node>, at::Tensor>> grads;
  for (auto& b : s.buckets) {
    int64_t offset = 0;
    for (auto& e : b->entries) {
      auto* acc = static_cast<AccumulateGrad*>(e.acc.get());
      auto g = b->result.narrow(0, offset, e.numel).view(acc->variable.sizes());
      offset += e.numel;
      auto it = std::find_if(grads.begin(), grads.end(), [&](const auto& p) { return p.first == e.acc; });
      if (it == grads.end()) grads.emplace_back(e.acc, std::move(g));
      else it->second = it->second + g;
    }
  }
  s.buckets.clear();
  at::NoGradGuard no_grad;
  for (auto& [node, g] : grads) {
    auto* acc = static_cast<AccumulateGrad*>(node.get());
    if (g.scalar_type() != acc->variable.scalar_type()) g = g.to(acc->variable.scalar_type());
    (*node)({std::move(g)});
  }
}

// A backward that failed never ran its callback: its issued all-reduces were issued on every rank (an error raised
// on every rank alike), so they are waited and dropped; what was never issued anywhere is dropped.
void discard(TaskState& s) {
  for (auto& b : s.buckets)
    if (b->issued)
      while (!b->result.defined()) advance(*b);
  s.buckets.clear();
}

void drop_dead_states(std::vector<TaskState>& dead) {
  auto& all = states();
  for (auto it = all.begin(); it != all.end();) {
    if (it->token.expired()) {
      dead.push_back(std::move(*it));
      it = all.erase(it);
    } else {
      ++it;
    }
  }
}

void complete_task(int task, const int* token) {
  TaskState mine;
  {
    std::lock_guard<std::mutex> lock(mu());
    auto& all = states();
    for (auto it = all.begin(); it != all.end(); ++it) {
      auto held = it->token.lock();
      if (it->task == task && held.get() == token) {
        mine = std::move(*it);
        all.erase(it);
        break;
      }
    }
  }
  complete(mine);
}

// The state of the running backward, made (and its final callback queued) on its first deferred term.
TaskState& state_for(int task) {
  auto& all = states();
  for (auto& s : all)
    if (s.task == task && !s.token.expired()) return s;
  auto token = std::make_shared<int>(task);
  torch::autograd::Engine::get_default_engine().queue_callback(
      [token, task] { complete_task(task, token.get()); });
  TaskState s;
  s.task = task;
  s.token = token;
  all.push_back(std::move(s));
  return all.back();
}

bool reducible_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

} // namespace

int64_t grad_bucket_bytes() {
  return bucket_bytes().load();
}

int64_t set_grad_bucket_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "set_grad_bucket_bytes: expected a number of bytes >= 0 (0 turns gradient bucketing "
                    "off), got ", bytes);
  return bucket_bytes().exchange(bytes);
}

bool backward_defers_grad_reductions() {
  if (bucket_bytes().load() <= 0 || at::GradMode::is_enabled()) return false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  return exec_info && exec_info->empty();
}

bool grad_edge_deferrable(const torch::autograd::Edge& edge) {
  if (!edge.is_valid() || !backward_defers_grad_reductions()) return false;
  auto* acc = dynamic_cast<AccumulateGrad*>(edge.function.get());
  if (!acc || !acc->variable.requires_grad()) return false;
  return acc->tensor_pre_hooks().empty() && acc->pre_hooks().empty() && acc->post_hooks().empty() &&
         acc->retains_grad_hooks().empty() && !acc->tensor_post_acc_grad_hooks();
}

bool defer_grad_reduction(const torch::autograd::Edge& edge, const at::Tensor& term, const MeshPtr& mesh,
                          const std::vector<int64_t>& mesh_dims) {
  if (!term.defined() || !reducible_dtype(term.scalar_type()) || comm::use_functional(term)) return false;
  if (!grad_edge_deferrable(edge)) return false;
  auto* acc = static_cast<AccumulateGrad*>(edge.function.get());
  if (!term.sizes().equals(acc->variable.sizes()) || term.device() != acc->variable.device()) return false;
  std::vector<int64_t> dims;
  for (auto m : mesh_dims)
    if (mesh->size(m) > 1) dims.push_back(m);
  if (dims.empty()) return false;
  const int task = torch::autograd::get_current_graph_task_id();
  std::vector<TaskState> dead;
  {
    std::lock_guard<std::mutex> lock(mu());
    drop_dead_states(dead);
    for (auto& s : dead) discard(s);
    auto& s = state_for(task);
    Bucket* bucket = nullptr;
    for (auto it = s.buckets.rbegin(); it != s.buckets.rend() && !bucket; ++it)
      if ((*it)->holds(mesh, dims, term)) bucket = it->get();
    if (!bucket) {
      auto b = std::make_unique<Bucket>();
      b->mesh = mesh;
      b->dims = dims;
      b->dtype = term.scalar_type();
      b->device = term.device();
      s.buckets.push_back(std::move(b));
      bucket = s.buckets.back().get();
    }
    bucket->entries.push_back({edge.function, term, term.numel()});
    bucket->bytes += term.numel() * static_cast<int64_t>(term.element_size());
    stats().deferred += 1;
    if (bucket->bytes >= bucket_bytes().load()) {
      size_t i = 0;
      while (s.buckets[i].get() != bucket) ++i;
      issue(s, i);
    }
  }
  return true;
}

void wait_grad_reductions() {
  std::vector<TaskState> pending;
  {
    std::lock_guard<std::mutex> lock(mu());
    std::vector<TaskState> dead;
    drop_dead_states(dead);
    for (auto& s : dead) discard(s);
    pending = std::move(states());
    states().clear();
  }
  for (auto& s : pending) complete(s);
}

std::map<std::string, double> grad_reduction_stats() {
  std::lock_guard<std::mutex> lock(mu());
  const auto& s = stats();
  return {{"buckets", static_cast<double>(s.buckets)}, {"bytes", static_cast<double>(s.bytes)},
          {"deferred", static_cast<double>(s.deferred)}, {"wait_s", s.wait_s}, {"issue_s", s.issue_s}};
}

void reset_grad_reduction_stats() {
  std::lock_guard<std::mutex> lock(mu());
  stats() = Stats{};
}

} // namespace shardtensor::dispatch
