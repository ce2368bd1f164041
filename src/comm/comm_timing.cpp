#include "comm/comm_timing.h"
#include "comm/collectives.h"
#include "comm/shm_transport.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <mutex>

namespace shardtensor::comm {

namespace timing_detail {
std::atomic<bool> on{false};
} // namespace timing_detail

namespace {

struct Recorded {
  std::string key;
  IssuedCollective collective;
  std::vector<std::pair<double, double>> waits;
};

struct State {
  std::map<std::string, KindTiming> kinds;
  std::vector<Recorded> recording;
  std::map<const c10d::Work*, int64_t> bound;  // works in flight -> their record (dropped at their first wait)
  std::vector<c10::intrusive_ptr<c10d::Work>> bound_alive;  // keeps bound works' addresses unique while bound
};

std::mutex& mu() {
  static std::mutex m;
  return m;
}
State& state() {
  static State s;
  return s;
}

// The kind, told apart by pass: a halo of the forward and the halo-gradient return of the backward are different
// communication with different compute to hide behind.
std::string key_of(const char* kind) {
  std::string key = kind;
  if (torch::autograd::get_current_graph_task_id() != -1) key += " [backward]";
  return key;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Issues one recorded collective again on fresh buffers of the recorded sizes; returns its work(s).
std::vector<c10::intrusive_ptr<c10d::Work>> reissue(const IssuedCollective& c) {
  using Op = IssuedCollective::Op;
  auto& pg = *c.group;
  const auto opts = c.options;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  switch (c.op) {
    case Op::AllReduce: {
      std::vector<at::Tensor> ts{at::zeros({c.numel}, opts)};
      c10d::AllreduceOptions o;
      o.reduceOp = c.reduce;
      auto* ring = c.shm ? shm::channels(pg) : nullptr;  // set up already, by the recorded all-reduce
      works.push_back(ring ? shm::all_reduce_start(*ring, ts[0], o.reduceOp) : pg.allreduce(ts, o));
      break;
    }
    case Op::AllGather: {
      if (auto* ring = c.shm ? shm::channels(pg) : nullptr) {  // exact pieces, paired (set up already)
        std::vector<at::Tensor> outs;
        for (auto k : c.recv_splits) outs.push_back(at::empty({k}, opts));
        for (auto& w : shm::all_gather_start(*ring, pg, at::zeros({c.numel}, opts), outs, kAllToAllTag)) works.push_back(w);
        break;
      }
      std::vector<at::Tensor> in{at::zeros({c.numel}, opts)};
      std::vector<std::vector<at::Tensor>> out(1);
      for (int i = 0; i < pg.getSize(); ++i) out[0].push_back(at::empty({c.numel}, opts));
      works.push_back(pg.allgather(out, in));
      break;
    }
    case Op::AllToAll: {
      int64_t ns = 0, nr = 0;
      for (auto v : c.send_splits) ns += v;
      for (auto v : c.recv_splits) nr += v;
      auto in = at::zeros({ns}, opts), out = at::empty({nr}, opts);
      auto send = c.send_splits, recv = c.recv_splits;
      if (auto* ring = c.shm ? shm::channels(pg) : nullptr) {  // set up already, by the recorded all-to-all
        for (auto& w : shm::all_to_all_start(*ring, pg, in, out, send, recv, kAllToAllTag)) works.push_back(w);
      } else {
        works.push_back(pg.alltoall_base(out, in, recv, send));
      }
      break;
    }
    case Op::Broadcast: {
      std::vector<at::Tensor> ts{at::zeros({c.numel}, opts)};
      c10d::BroadcastOptions o;
      o.rootRank = c.root;
      works.push_back(pg.broadcast(ts, o));
      break;
    }
    case Op::Scatter: {
      std::vector<at::Tensor> out{at::empty({c.numel}, opts)};
      std::vector<std::vector<at::Tensor>> in;
      if (pg.getRank() == c.root) {
        in.emplace_back();
        for (int i = 0; i < pg.getSize(); ++i) in[0].push_back(at::zeros({c.numel}, opts));
      }
      c10d::ScatterOptions o;
      o.rootRank = c.root;
      works.push_back(pg.scatter(out, in, o));
      break;
    }
    case Op::PointToPoint: {
      if (c.coalesced) pg.startCoalescing(opts.device().type());
      for (const auto& m : c.messages) {
        const auto o = opts.dtype(m.dtype);
        auto* ring = m.shm ? shm::channels(pg) : nullptr;  // set up already, by the recorded exchange
        works.push_back(shm::post(ring, pg, m.send ? at::zeros({m.numel}, o) : at::empty({m.numel}, o), m.peer, m.send,
                                  m.tag));
      }
      if (c.coalesced) {
        works.clear();
        if (auto w = pg.endCoalescing(opts.device().type())) works.push_back(w);
      }
      break;
    }
  }
  return works;
}

} // namespace

namespace timing_detail {
void add_exposed(const char* kind, double seconds, bool is_wait) {
  auto key = key_of(kind);
  std::lock_guard<std::mutex> lock(mu());
  auto& k = state().kinds[key];
  k.exposed_s += seconds;
  if (is_wait) k.waits += 1;
}
} // namespace timing_detail

void set_comm_timing(bool on) {
  reset_comm_timing();
  timing_detail::on = on;
}

void reset_comm_timing() {
  std::lock_guard<std::mutex> lock(mu());
  state() = State{};
}

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t record_issued(IssuedCollective c) {
  if (!comm_timing_on()) return -1;
  if (c.posted_s == 0) c.posted_s = steady_seconds();
  auto key = key_of(c.kind);
  std::lock_guard<std::mutex> lock(mu());
  state().kinds[key].issued += 1;
  state().recording.push_back({std::move(key), std::move(c), {}});
  return static_cast<int64_t>(state().recording.size()) - 1;
}

void set_issued_on_shm(int64_t index, bool shm) {
  std::lock_guard<std::mutex> lock(mu());
  state().recording.at(static_cast<size_t>(index)).collective.shm = shm;
}

void bind_work(const c10::intrusive_ptr<c10d::Work>& work, int64_t index) {
  if (index < 0 || !work) return;
  std::lock_guard<std::mutex> lock(mu());
  state().bound[work.get()] = index;
  state().bound_alive.push_back(work);
}

void note_wait(const c10d::Work* work, double start_s, double end_s) {
  std::lock_guard<std::mutex> lock(mu());
  auto& st = state();
  auto it = st.bound.find(work);
  if (it == st.bound.end()) return;
  st.recording[it->second].waits.emplace_back(start_s, end_s);
  st.bound.erase(it);
  auto alive = std::find_if(st.bound_alive.begin(), st.bound_alive.end(), [&](const auto& w) { return w.get() == work; });
  if (alive != st.bound_alive.end()) st.bound_alive.erase(alive);
}

std::vector<CollectiveTimes> comm_timing_records() {
  std::lock_guard<std::mutex> lock(mu());
  std::vector<CollectiveTimes> out;
  out.reserve(state().recording.size());
  for (const auto& r : state().recording) out.push_back({r.key, r.collective.posted_s, r.waits});
  return out;
}

std::map<std::string, KindTiming> comm_timing_stats() {
  std::lock_guard<std::mutex> lock(mu());
  return state().kinds;
}

std::map<std::string, double> replay_recorded_collectives(int64_t reps) {
  std::vector<Recorded> recording;
  {
    std::lock_guard<std::mutex> lock(mu());
    recording = state().recording;
  }
  std::map<std::string, double> alone;
  for (const auto& r : recording) alone[r.key] = 0;
  // One untimed pass first: the transport's buffers and connections warm, and the ranks leave it together (its last
  // collective synchronizes them), so the timed passes do not charge one rank's lateness to the first collective.
  for (int64_t pass = 0; pass <= reps; ++pass) {
    for (const auto& r : recording) {
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& w : reissue(r.collective)) w->wait();
      if (pass > 0) alone[r.key] += seconds_since(t0);
    }
  }
  if (reps > 0)
    for (auto& [k, v] : alone) v /= static_cast<double>(reps);
  return alone;
}

} // namespace shardtensor::comm
