// Waiting on c10d work. Two rules every blocking wait of the library follows:
// - The caller's Python GIL is released while it blocks (when the Python module installed the hooks). c10d's worker
//   threads may have to release Python-owned tensors of earlier work, which needs the GIL; a rank that waits while
//   holding it (an op called from Python's indexing, `x[i]`, which does not release it) would deadlock.
// - A failed collective (a peer died or raised before it, a timeout, ranks issuing different collectives) raises
//   c10::DistBackendError naming the collective; the dispatch layer adds the op and its placements.
#pragma once

#include <shardtensor/mesh.h>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>

namespace shardtensor::comm {

// Installed by the Python module: `release` drops the GIL if this thread holds it and returns a token for
// `restore` (nullptr when nothing was released).
struct GilHooks {
  void* (*release)() = nullptr;
  void (*restore)(void*) = nullptr;
};
void set_gil_hooks(GilHooks hooks);

// Installed by the Python module: "file:line in function" of the Python code running on this thread (empty when
// none). Called only to word errors (it takes the GIL).
void set_python_location_hook(std::string (*hook)());
std::string python_location();

// Drops the GIL (when this thread holds it) for its lifetime. Held around issuing c10d work too: Gloo's run loop
// destroys finished work while holding the queue lock, so a thread that enqueues while holding the GIL can deadlock
// with it.
//
// Every collective is issued and waited inside one, so it also measures this thread's CPU time spent in collectives
// (outermost scopes only): `collective_thread_cpu_seconds`. The simulation's validation subtracts it to compare a
// real rank's local compute with a simulated one's (a fake group's collectives cost nothing).
class GilReleased {
 public:
  GilReleased();
  ~GilReleased();
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  void* token_ = nullptr;
  double cpu_start_ = -1;  // thread CPU seconds at entry of an outermost scope
};

// This thread's CPU time spent inside GilReleased scopes (issuing and waiting on collectives), in seconds, since the
// thread started.
double collective_thread_cpu_seconds();

// Block until `work` completes, without the GIL; failures raise DistBackendError naming `kind` and the mesh dim.
void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* kind, const Mesh* mesh = nullptr,
               int64_t mesh_dim = -1);

} // namespace shardtensor::comm
