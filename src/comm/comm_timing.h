// How much of the library's communication a step hides: per kind of collective, the time its calling thread is
// blocked on it ("exposed": issuing the transport calls + waiting for completion) against the wall time of the same
// collectives run alone ("alone": replayed back to back, without compute, on the same groups). Hidden = 1 -
// exposed / alone (docs/performance.md, "Communication hidden").
//
// Off by default; while on, every wait costs two steady_clock reads and a map update under a mutex, and every
// issued collective appends a small record (its group, shape of each message, tag) for the replay. Kinds are the
// names the waits carry ("halo", "all_reduce", "all_reduce (gradient bucket)", "ring send/recv", ...), suffixed
// " [backward]" when issued or waited inside an autograd backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardtensor::comm {

namespace timing_detail {
extern std::atomic<bool> on;
void add_exposed(const char* kind, double seconds, bool is_wait);
} // namespace timing_detail

inline bool comm_timing_on() {
  return timing_detail::on.load(std::memory_order_relaxed);
}
// Turns the accounting on or off; either way clears what was accumulated and recorded.
void set_comm_timing(bool on);
void reset_comm_timing();

// Adds its lifetime to `kind`'s exposed time (a wait: also counts one wait) when the accounting is on.
class ExposedTime {
 public:
  ExposedTime(const char* kind, bool is_wait) : kind_(kind), is_wait_(is_wait) {
    if (comm_timing_on()) start_ = std::chrono::steady_clock::now();
  }
  ~ExposedTime() {
    if (start_ != std::chrono::steady_clock::time_point{})
      timing_detail::add_exposed(kind_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(),
                                 is_wait_);
  }
  ExposedTime(const ExposedTime&) = delete;
  ExposedTime& operator=(const ExposedTime&) = delete;

 private:
  const char* kind_;
  bool is_wait_;
  std::chrono::steady_clock::time_point start_{};
};

// Runs `issue` (a transport call returning its work) as exposed time of `kind`.
template <class F>
auto timed_issue(const char* kind, F&& issue) {
  ExposedTime t(kind, /*is_wait=*/false);
  return issue();
}

// One collective as issued on this rank, enough to issue it again with buffers of the same sizes.
struct IssuedCollective {
  enum class Op { AllReduce, AllGather, AllToAll, Broadcast, Scatter, PointToPoint };
  struct Message {
    bool send = true;
    int peer = 0;
    int64_t numel = 0;
    int tag = 0;
    at::ScalarType dtype = at::kFloat;  // on the wire (complex data travels as its real view)
    bool shm = false;                   // the group's shared-memory rings were in use (comm/shm_transport.h)
  };
  const char* kind = "";
  Op op = Op::AllReduce;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  at::TensorOptions options;  // dtype and device of the buffers (point to point: the device; each message its dtype)
  int64_t numel = 0;                    // all_reduce, broadcast, all_gather (input), scatter (one chunk)
  int64_t root = 0;                     // broadcast, scatter
  c10d::ReduceOp reduce = c10d::ReduceOp::SUM;
  std::vector<int64_t> send_splits, recv_splits;  // all_to_all
  std::vector<Message> messages;       // point to point, in issue order
  bool coalesced = false;              // point to point on NCCL: posted between start/endCoalescing
  bool shm = false;                    // all_reduce, all_to_all: through the group's shared-memory rings
  double posted_s = 0;                 // steady_clock seconds when this rank began posting it (0: at the record)
};
// Appends `c` to the recording when the accounting is on (callers test comm_timing_on() before building it);
// returns its index in the recording, for bind_work (-1 when off).
int64_t record_issued(IssuedCollective c);
// Marks recorded collective `index` as issued through the group's shared-memory rings (the replay issues it alike).
void set_issued_on_shm(int64_t index, bool shm);
// Ties `work` to recorded collective `index`: its waits are kept with it (comm_timing_records).
void bind_work(const c10::intrusive_ptr<c10d::Work>& work, int64_t index);
// Called by wait_work when the accounting is on: the wall interval this thread was blocked on `work`.
void note_wait(const c10d::Work* work, double start_s, double end_s);
double steady_seconds();

// Every recorded collective of this rank in issue order: its kind, when this rank posted it and the intervals a
// thread of this rank waited for it (steady_clock seconds: CLOCK_MONOTONIC, one clock for every process of a host, so
// ranks on one host compare their times directly; benchmarks/overlap/ splits a wait into the part before the last
// rank posted, imbalance, and the part after, the transfer).
struct CollectiveTimes {
  std::string kind;
  double posted_s = 0;
  std::vector<std::pair<double, double>> waits;
};
std::vector<CollectiveTimes> comm_timing_records();

// Per kind since the last reset: waits, exposed seconds (issue + wait), collectives recorded.
struct KindTiming {
  int64_t waits = 0;
  int64_t issued = 0;
  double exposed_s = 0;
};
std::map<std::string, KindTiming> comm_timing_stats();

// Issues every recorded collective again, in the recorded order, each waited before the next (no compute between),
// `reps` times; returns the mean wall seconds per kind of one pass over the recording. Collective: every rank of
// the recorded groups calls it at the same point with the same recording (the library issues the same collectives in
// the same order on every rank). Leaves the recording and the exposed totals as they were.
std::map<std::string, double> replay_recorded_collectives(int64_t reps);

} // namespace shardtensor::comm
