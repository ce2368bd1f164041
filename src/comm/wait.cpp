#include "comm/wait.h"

#include "comm/comm_timing.h"

#include <shardtensor/mesh.h>
#include <shardtensor/simulation.h>

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <ctime>
#include <sstream>

namespace shardtensor::comm {

namespace {

std::atomic<void* (*)()> g_release{nullptr};
std::atomic<void (*)(void*)> g_restore{nullptr};
std::atomic<std::string (*)()> g_location{nullptr};

} // namespace

namespace {
thread_local int gil_released_depth = 0;
thread_local double collective_cpu_total = 0;

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
} // namespace

GilReleased::GilReleased() {
  if (gil_released_depth++ == 0) cpu_start_ = thread_cpu_seconds();
  if (auto release = g_release.load()) token_ = release();
}

GilReleased::~GilReleased() {
  if (token_) g_restore.load()(token_);
  if (--gil_released_depth == 0 && cpu_start_ >= 0) collective_cpu_total += thread_cpu_seconds() - cpu_start_;
}

double collective_thread_cpu_seconds() {
  return collective_cpu_total;
}

void set_python_location_hook(std::string (*hook)()) {
  g_location = hook;
}

std::string python_location() {
  auto hook = g_location.load();
  return hook ? hook() : std::string();
}

void set_gil_hooks(GilHooks hooks) {
  g_restore = hooks.restore;
  g_release = hooks.release;
}

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* kind, const Mesh* mesh, int64_t mesh_dim) {
  // A collective over an ended simulation's fake group would "complete" with garbage.
  if (mesh && C10_UNLIKELY(mesh->simulation() != 0)) check_simulation_alive(*mesh, kind);
  std::string failure;
  {
    ExposedTime blocked(kind, /*is_wait=*/true);  // comm/comm_timing.h
    const double start = comm_timing_on() ? steady_seconds() : 0;
    // A profiler range per wait: the wall a rank is blocked in a collective, next to the ops it waits between.
    RECORD_FUNCTION_WITH_SCOPE(at::RecordScope::USER_SCOPE, std::string("shardtensor::wait ") + kind,
                               c10::ArrayRef<const c10::IValue>{});
    {
      GilReleased no_gil;
      try {
        work->wait();
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    if (start != 0) note_wait(work.get(), start, steady_seconds());
  }
  if (failure.empty()) return;
  std::ostringstream os;
  os << "ShardTensor: the " << kind << " collective";
  if (mesh && mesh_dim >= 0) os << " along mesh dim " << mesh_dim << " (" << mesh->size(mesh_dim) << " ranks) of " << mesh->str();
  os << " failed. A peer rank may have died, raised before reaching it, or issued a different collective; the "
        "process group's timeout bounds the wait (shardtensor.init_distributed(timeout=...)). Cause: "
     << failure;
  C10_THROW_ERROR(DistBackendError, os.str());
}

} // namespace shardtensor::comm
