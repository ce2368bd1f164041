// Dispatch overhead of ShardTensor ops, from C++ (Google Benchmark).
//
// For each op, two benchmarks: the op on a plain local tensor (`local_*`) and the same op on a ShardTensor that
// wraps that local tensor (`shard_*`). The difference is the per-op cost ShardTensor adds: the
// AutogradPrivateUse1 / PrivateUse1 dispatch, the handler's spec propagation, and wrapping the result. Tensors
// are small ([64, 32] float32 on CPU) so the kernel itself is cheap and the overhead dominates.
//
// Mesh: one rank. A real c10d::ProcessGroup of size 1 over a HashStore, with no backend registered. The
// library issues no collective along a mesh dim of size 1 (every collective in src/comm/collectives.cpp
// returns early when `mesh.size(mesh_dim) == 1`, and redistribute is a no-op when the layout is unchanged),
// so no backend is needed. This is checked at runtime two ways: the process group has no backend, so any
// collective would throw; and the library's own comm counter must read zero calls after all benchmarks.
//
// Run: build-bench/benchmarks/dispatch_overhead/dispatch_overhead_bench --benchmark_min_time=0.2
//        [--benchmark_repetitions=5] [--torch_threads=1]
// After the Google Benchmark table it prints a summary: per op, the local and ShardTensor times (median over
// repetitions when --benchmark_repetitions is given) and the added microseconds, against the 5 us target.
#include <shardtensor/comm_stats.h>
#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

using shardtensor::Placement;
using shardtensor::ShapeInference;

constexpr double kTargetUs = 5.0;
constexpr int64_t kRows = 64, kCols = 32, kOut = 16;

shardtensor::MeshPtr make_mesh() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, /*rank=*/0, /*size=*/1);
  return shardtensor::Mesh::from_group(pg, c10::kCPU, "domain");
}

const shardtensor::MeshPtr& mesh() {
  static const shardtensor::MeshPtr m = make_mesh();
  return m;
}

// A ShardTensor wrapping `local` as Shard(0) of a size-1 mesh (global shape == local shape).
at::Tensor shard(const at::Tensor& local) {
  return shardtensor::from_local(local, mesh(), {Placement::shard(0)}, ShapeInference::Even, {},
                                 local.sizes().vec());
}

struct Inputs {
  at::Tensor x, y, w, b;  // plain: x, y [64, 32]; weight [16, 32]; bias [16]
  at::Tensor X, Y;        // ShardTensors wrapping x and y
};

// requires_grad applies to x, y (and X, Y) and to the plain weight and bias.
Inputs make_inputs(bool requires_grad) {
  at::manual_seed(0);
  Inputs in;
  in.x = at::randn({kRows, kCols});
  in.y = at::randn({kRows, kCols});
  in.w = at::randn({kOut, kCols});
  in.b = at::randn({kOut});
  {
    at::AutoGradMode no_grad(false);
    in.X = shard(in.x);
    in.Y = shard(in.y);
  }
  if (requires_grad) {
    for (auto* t : {&in.x, &in.y, &in.w, &in.b, &in.X, &in.Y}) t->requires_grad_(true);
  }
  return in;
}

template <typename Op>
void run(benchmark::State& state, bool sharded, bool grad, Op op) {
  at::AutoGradMode mode(grad);
  auto in = make_inputs(grad);
  const at::Tensor& a = sharded ? in.X : in.x;
  const at::Tensor& c = sharded ? in.Y : in.y;
  {  // correctness guard: the sharded result's local tensor equals the plain result
    auto expect = op(in.x, in.y, in.w, in.b);
    auto got = op(a, c, in.w, in.b);
    if (sharded) {
      at::AutoGradMode off(false);
      got = shardtensor::to_local(got);
      // A full reduction over a sharded dim gives Partial(sum); on one rank its local value is the sum.
    }
    if (!at::allclose(expect.detach(), got.detach(), 1e-5, 1e-5)) {
      state.SkipWithError("sharded result differs from the local result");
      return;
    }
  }
  for (auto _ : state) {
    auto out = op(a, c, in.w, in.b);
    benchmark::DoNotOptimize(out.unsafeGetTensorImpl());
  }
}

#define OP_PAIR(NAME, GRAD, EXPR)                                                                      \
  void BM_local_##NAME(benchmark::State& s) {                                                          \
    run(s, false, GRAD, [](const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,              \
                           const at::Tensor& b) { return EXPR; });                                     \
  }                                                                                                    \
  void BM_shard_##NAME(benchmark::State& s) {                                                          \
    run(s, true, GRAD, [](const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,               \
                          const at::Tensor& b) { return EXPR; });                                      \
  }                                                                                                    \
  BENCHMARK(BM_local_##NAME);                                                                          \
  BENCHMARK(BM_shard_##NAME);

// Inference-style (grad mode off).
OP_PAIR(add, false, x + y)
OP_PAIR(mul, false, x * y)
OP_PAIR(sum, false, x.sum())            // sharded: reduces the sharded dim -> Partial(sum)
OP_PAIR(sum_dim1, false, x.sum(1))      // keeps Shard(0)
OP_PAIR(sum_dim0, false, x.sum(0))      // reduces the sharded dim -> Partial(sum)
OP_PAIR(view, false, x.view({kRows, 4, kCols / 4}))
OP_PAIR(linear, false, at::linear(x, w, b))
// Grad mode on, every input requires grad (forward only: records the graph). For linear the plain weight
// and bias require grad, as parameters do in training.
OP_PAIR(add_grad, true, x + y)
OP_PAIR(linear_grad, true, at::linear(x, w, b))

// Console output as usual, plus a summary of local vs shard per op at the end.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  // A display reporter passed to RunSpecifiedBenchmarks ignores --benchmark_color: no colour unless a terminal.
  SummaryReporter() : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_Defaults : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs) {
      if (r.run_type != Run::RT_Iteration || r.error_occurred) continue;
      double ns = r.GetAdjustedRealTime() * to_ns(r.time_unit);
      times_[r.run_name.function_name].push_back(ns);
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nSummary (real time per op, median over repetitions; target: added <= %.1f us)\n", kTargetUs);
    std::printf("%-12s %10s %10s %10s  %s\n", "op", "local_us", "shard_us", "added_us", "target");
    bool all_met = true;
    for (const auto& name : order_) {
      auto l = times_.find("BM_local_" + name), s = times_.find("BM_shard_" + name);
      if (l == times_.end() || s == times_.end()) continue;
      double lu = median(l->second) / 1e3, su = median(s->second) / 1e3, added = su - lu;
      bool met = added <= kTargetUs;
      all_met = all_met && met;
      std::printf("%-12s %10.2f %10.2f %10.2f  %s\n", name.c_str(), lu, su, added, met ? "met" : "MISSED");
    }
    auto stats = shardtensor::comm_stats();
    std::printf("collectives issued by the library during the run: %lld (expected 0 on a 1-rank mesh)\n",
                static_cast<long long>(stats.total_calls()));
    std::printf("torch intra-op threads: %d\n", at::get_num_threads());
    std::fflush(stdout);
  }

 private:
  static double to_ns(benchmark::TimeUnit u) {
    switch (u) {
      case benchmark::kSecond: return 1e9;
      case benchmark::kMillisecond: return 1e6;
      case benchmark::kMicrosecond: return 1e3;
      default: return 1.0;
    }
  }
  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }
  std::map<std::string, std::vector<double>> times_;
  std::vector<std::string> order_{"add", "mul", "sum", "sum_dim1", "sum_dim0", "view", "linear",
                                  "add_grad", "linear_grad"};
};

}  // namespace

int main(int argc, char** argv) {
  // --torch_threads=N (ours, removed before Google Benchmark sees the arguments): torch intra-op threads.
  // Default 1: the tensors are far too small to parallelize, and on a small shared machine idle OpenMP
  // workers only add noise (spin-waits that lose their core).
  int threads = 1;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--torch_threads=", 16) == 0) threads = std::atoi(argv[i] + 16);
    else argv[kept++] = argv[i];
  }
  argc = kept;
  if (threads > 0) at::set_num_threads(threads);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  shardtensor::reset_comm_stats();
  SummaryReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return shardtensor::comm_stats().total_calls() == 0 ? 0 : 2;
}
