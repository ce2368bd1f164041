#include "comm/shm_transport.h"

#include "comm/wait.h"

#include <shardtensor/comm_backend.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace shardtensor::comm::shm {

namespace {

constexpr int64_t kAlign = 64;                // messages start on a cache line
constexpr int64_t kPage = 4096;               // ring sizes are whole pages
constexpr int64_t kMinRing = 64 * 1024;       // below this (many ranks on one host) the transport is not worth it
constexpr int64_t kMaxSegment = 256LL << 20;  // all rings of one group together
constexpr int kTickMs = 50;                   // how often a blocked wait checks its deadline and the peer's process
constexpr int kSpins = 2000;                  // polls before a receiver sleeps on the futex (a few µs)

static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free, "ring indices are shared between processes");

int64_t round_up(int64_t v, int64_t to) {
  return (v + to - 1) / to * to;
}

int64_t capacity_from_env() {
  const char* v = std::getenv("SHARDTENSOR_SHM_BYTES");
  if (!v || !*v) return 1 << 20;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(end && *end == '\0' && n >= 0, "SHARDTENSOR_SHM_BYTES: expected a number of bytes >= 0 (0 turns ",
                    "the shared-memory transport off), got \"", v, "\"");
  return n == 0 ? 0 : round_up(n, kPage);
}

std::atomic<int64_t>& capacity_setting() {
  static std::atomic<int64_t> cap{capacity_from_env()};
  return cap;
}

std::atomic<int64_t> g_sent{0}, g_deferred{0}, g_received{0}, g_groups{0}, g_released{0};

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A futex on a word of the shared mapping (not FUTEX_PRIVATE: the waker is another process).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int ms) {
  timespec ts{ms / 1000, static_cast<long>(ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// The shared part of one ring: the sender advances `head`, the receiver `tail` (bytes, never wrapped); each side
// sleeps on the other's sequence word when it must wait, and a side wakes the other only when that one says it waits.
struct alignas(64) RingControl {
  std::atomic<uint64_t> head;
  std::atomic<uint32_t> head_seq;
  std::atomic<uint32_t> receivers_waiting;
  char pad0[48];
  std::atomic<uint64_t> tail;
  std::atomic<uint32_t> tail_seq;
  std::atomic<uint32_t> senders_waiting;
  char pad1[48];
};
static_assert(sizeof(RingControl) == 128);

// A message: a 64-byte header holding its size, then the payload (wrapping around the ring's end), padded to 64.
struct Ring {
  RingControl* ctl = nullptr;
  char* data = nullptr;
  int64_t cap = 0;

  static int64_t footprint(int64_t nbytes) { return kAlign + round_up(nbytes, kAlign); }

  bool has_space(int64_t need) const {
    const auto head = ctl->head.load(std::memory_order_relaxed);  // only the sender (under its mutex) moves it
    return cap - static_cast<int64_t>(head - ctl->tail.load(std::memory_order_acquire)) >= need;
  }

  void write(const char* src, int64_t nbytes) {
    const auto head = ctl->head.load(std::memory_order_relaxed);
    const int64_t pos = static_cast<int64_t>(head % static_cast<uint64_t>(cap));
    const uint64_t size = static_cast<uint64_t>(nbytes);
    std::memcpy(data + pos, &size, sizeof(size));
    const int64_t at = (pos + kAlign) % cap;
    const int64_t first = std::min(nbytes, cap - at);
    std::memcpy(data + at, src, first);
    if (first < nbytes) std::memcpy(data, src + first, nbytes - first);
    ctl->head.store(head + footprint(nbytes), std::memory_order_release);
    ctl->head_seq.fetch_add(1);
    if (ctl->receivers_waiting.load() > 0) futex_wake(&ctl->head_seq);
  }

  // Copies the next message into `dst` (whose size it must have); false when none has arrived.
  bool read(char* dst, int64_t nbytes, const std::function<std::string()>& where) {
    const auto tail = ctl->tail.load(std::memory_order_relaxed);  // only the receiver (under its mutex) moves it
    if (ctl->head.load(std::memory_order_acquire) == tail) return false;
    const int64_t pos = static_cast<int64_t>(tail % static_cast<uint64_t>(cap));
    uint64_t size = 0;
    std::memcpy(&size, data + pos, sizeof(size));
    if (static_cast<int64_t>(size) != nbytes)
      C10_THROW_ERROR(DistBackendError,
                      where() + ": the next message holds " + std::to_string(size) + " bytes where this rank expects " +
                          std::to_string(nbytes) + "; the ranks issued different exchanges (every rank must issue the "
                          "library's collectives in the same order)");
    const int64_t at = (pos + kAlign) % cap;
    const int64_t first = std::min(nbytes, cap - at);
    std::memcpy(dst, data + at, first);
    if (first < nbytes) std::memcpy(dst + first, data, nbytes - first);
    ctl->tail.store(tail + footprint(nbytes), std::memory_order_release);
    ctl->tail_seq.fetch_add(1);
    if (ctl->senders_waiting.load() > 0) futex_wake(&ctl->tail_seq);
    return true;
  }
};

class RecvWork;

} // namespace

class Channels {
 public:
  Channels(int n, int me, int64_t cap, char* base, size_t size, std::vector<int64_t> pids,
           std::chrono::milliseconds timeout, std::string name)
      : n_(n), me_(me), cap_(cap), base_(base), size_(size), pids_(std::move(pids)), timeout_(timeout),
        name_(std::move(name)) {
    for (int i = 0; i < n; ++i) {
      out_.push_back(std::make_unique<Out>());
      in_.push_back(std::make_unique<In>());
    }
  }

  static int64_t segment_bytes(int n, int64_t cap) {
    return static_cast<int64_t>(n) * (n - 1) * (static_cast<int64_t>(sizeof(RingControl)) + cap);
  }

  int64_t cap() const { return cap_; }
  // Unmaps the rings unless a helper thread was started or a receive is still posted (then they stay, and so does this
  // object: the thread or the receive's work may still use them); true if unmapped.
  bool release() {
    for (auto& o : out_) {
      std::lock_guard<std::mutex> lock(o->mu);
      if (o->helper) return false;
    }
    for (auto& i : in_) {
      std::lock_guard<std::mutex> lock(i->mu);
      if (!i->posted.empty()) return false;
    }
    munmap(base_, size_);
    base_ = nullptr;
    return true;
  }
  int size() const { return n_; }
  int rank() const { return me_; }

  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& t, int peer);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& t, int peer);
  void complete(RecvWork& w);
  bool poll(RecvWork& w);

 private:
  struct Out {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::vector<char>> pending;  // sends the ring could not take yet, in order
    bool helper = false;
    std::string error;
  };
  struct In {
    std::mutex mu;
    std::deque<c10::intrusive_ptr<RecvWork>> posted;  // receives not completed yet, in the order posted
  };

  Ring ring(int src, int dst) const {
    const int idx = src * (n_ - 1) + (dst < src ? dst : dst - 1);
    char* p = base_ + static_cast<int64_t>(idx) * (static_cast<int64_t>(sizeof(RingControl)) + cap_);
    return Ring{reinterpret_cast<RingControl*>(p), p + sizeof(RingControl), cap_};
  }
  std::string where(int peer, bool sending) const {
    std::ostringstream os;
    os << "shared-memory " << (sending ? "send to" : "receive from") << " rank " << peer << " of process group "
       << name_ << " (this rank: " << me_ << " of " << n_ << ")";
    return os.str();
  }
  // Throws when the wait has gone on past the deadline or the peer's process has exited.
  void check_alive(int peer, bool sending, std::chrono::steady_clock::time_point deadline) const {
    if (kill(static_cast<pid_t>(pids_[peer]), 0) != 0 && errno == ESRCH)
      C10_THROW_ERROR(DistBackendError, where(peer, sending) + ": the process of rank " + std::to_string(peer) +
                                            " (pid " + std::to_string(pids_[peer]) + ") has exited");
    if (std::chrono::steady_clock::now() > deadline)
      C10_THROW_ERROR(DistBackendError, where(peer, sending) + ": timed out after " +
                                            std::to_string(timeout_.count()) + " ms (the process group's timeout)");
  }
  void drain(In& in, Ring r, int peer);
  void helper_loop(int peer);

  int n_, me_;
  int64_t cap_;
  char* base_;
  size_t size_;
  std::vector<int64_t> pids_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  std::vector<std::unique_ptr<Out>> out_;
  std::vector<std::unique_ptr<In>> in_;
};

namespace {

class SentWork : public c10d::Work {
 public:
  SentWork() : c10d::Work(-1, c10d::OpType::SEND) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
};

class RecvWork : public c10d::Work {
 public:
  RecvWork(Channels& ch, at::Tensor target, int peer)
      : c10d::Work(-1, c10d::OpType::RECV), ch_(ch), target_(std::move(target)), peer_(peer) {}
  bool isCompleted() override { return done_.load() || ch_.poll(*this); }
  bool isSuccess() const override { return done_.load(); }
  bool wait(std::chrono::milliseconds /*timeout: the group's own bounds it*/) override {
    if (!done_.load()) ch_.complete(*this);
    return true;
  }
  int sourceRank() const override { return peer_; }

  Channels& ch_;
  at::Tensor target_;
  int peer_;
  std::atomic<bool> done_{false};
};

} // namespace

void Channels::drain(In& in, Ring r, int peer) {
  while (!in.posted.empty()) {
    auto& w = *in.posted.front();
    if (!r.read(static_cast<char*>(w.target_.data_ptr()), static_cast<int64_t>(w.target_.nbytes()),
                [&] { return where(peer, false); }))
      return;
    w.target_ = at::Tensor();  // the caller holds the result; the work need not
    w.done_.store(true);
    g_received.fetch_add(1, std::memory_order_relaxed);
    in.posted.pop_front();
  }
}

bool Channels::poll(RecvWork& w) {
  auto& in = *in_[w.peer_];
  std::lock_guard<std::mutex> lock(in.mu);
  drain(in, ring(w.peer_, me_), w.peer_);
  return w.done_.load();
}

void Channels::complete(RecvWork& w) {
  auto& in = *in_[w.peer_];
  auto r = ring(w.peer_, me_);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(in.mu);
      drain(in, r, w.peer_);
      if (w.done_.load()) return;
      // The drain stopped at an empty ring (`w` is still posted), so what it has consumed, not a fresh read of
      // `head`, marks "nothing new": a message written since the drain must count as new.
      seen = r.ctl->tail.load(std::memory_order_relaxed);
    }
    // Nothing more has arrived: poll a little (the sender is usually about to write), then sleep until it does.
    bool moved = false;
    for (int i = 0; i < kSpins && !moved; ++i) {
      cpu_relax();
      moved = r.ctl->head.load(std::memory_order_acquire) != seen;
    }
    while (!moved) {
      const uint32_t seq = r.ctl->head_seq.load();
      r.ctl->receivers_waiting.fetch_add(1);
      if (r.ctl->head.load() == seen) futex_wait(&r.ctl->head_seq, seq, kTickMs);
      r.ctl->receivers_waiting.fetch_sub(1);
      moved = r.ctl->head.load(std::memory_order_acquire) != seen;
      if (!moved) check_alive(w.peer_, false, deadline);
    }
  }
}

c10::intrusive_ptr<c10d::Work> Channels::recv(const at::Tensor& t, int peer) {
  auto w = c10::make_intrusive<RecvWork>(*this, t, peer);
  auto& in = *in_[peer];
  std::lock_guard<std::mutex> lock(in.mu);
  in.posted.push_back(w);
  drain(in, ring(peer, me_), peer);
  return w;
}

c10::intrusive_ptr<c10d::Work> Channels::send(const at::Tensor& t, int peer) {
  const auto nbytes = static_cast<int64_t>(t.nbytes());
  const char* src = static_cast<const char*>(t.const_data_ptr());
  auto& out = *out_[peer];
  std::unique_lock<std::mutex> lock(out.mu);
  if (!out.error.empty()) C10_THROW_ERROR(DistBackendError, out.error);
  auto r = ring(me_, peer);
  if (out.pending.empty() && r.has_space(Ring::footprint(nbytes))) {
    r.write(src, nbytes);
    g_sent.fetch_add(1, std::memory_order_relaxed);
  } else {
    // The receiver has not taken enough of the earlier messages: keep a copy and let the ring's helper write it when
    // space frees, so this send completes now (a blocking send could wait on a receiver that first waits for us).
    out.pending.emplace_back(src, src + nbytes);
    g_deferred.fetch_add(1, std::memory_order_relaxed);
    if (!out.helper) {
      out.helper = true;
      std::thread([this, peer] { helper_loop(peer); }).detach();
    }
    out.cv.notify_one();
  }
  return c10::make_intrusive<SentWork>();
}

// The helper of one ring: writes deferred sends in order as the receiver frees space. Lives as long as the process
// (channels with a helper are never destroyed: their mapping may be in use by the detached thread until exit).
void Channels::helper_loop(int peer) {
  auto& out = *out_[peer];
  auto r = ring(me_, peer);
  for (;;) {
    std::vector<char>* item = nullptr;
    {
      std::unique_lock<std::mutex> lock(out.mu);
      out.cv.wait(lock, [&] { return !out.pending.empty(); });
      item = &out.pending.front();  // stays valid: the deque only grows at the back meanwhile
    }
    const auto need = Ring::footprint(static_cast<int64_t>(item->size()));
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    try {
      while (!r.has_space(need)) {
        const uint32_t seq = r.ctl->tail_seq.load();
        r.ctl->senders_waiting.fetch_add(1);
        if (!r.has_space(need)) futex_wait(&r.ctl->tail_seq, seq, kTickMs);
        r.ctl->senders_waiting.fetch_sub(1);
        if (!r.has_space(need)) check_alive(peer, true, deadline);
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(out.mu);
      out.error = e.what();
      out.pending.clear();
      continue;
    }
    std::lock_guard<std::mutex> lock(out.mu);
    r.write(item->data(), static_cast<int64_t>(item->size()));
    g_sent.fetch_add(1, std::memory_order_relaxed);
    out.pending.pop_front();
  }
}

namespace {

struct Registry {
  std::mutex mu;
  // By group: the group (weakly, so a new group at a freed group's address is not mistaken for it) and its channels
  // (null: the group does not use them). Dead groups are released when a new group is set up (release_dead_groups).
  std::map<const c10d::ProcessGroup*, std::pair<c10::weak_intrusive_ptr<c10d::ProcessGroup>, Channels*>> groups;
  int64_t segments = 0;  // per-process counter naming the segments this process creates
};
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

// Identifies the kernel (boot id) and the PID namespace: ranks that share both share /proc's pids (the liveness
// check) and normally /dev/shm (checked by opening the segment).
std::pair<int64_t, int64_t> host_identity() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const auto key = static_cast<int64_t>(std::hash<std::string>{}(boot + "/" + host) & 0x7fffffffffffffffULL);
  struct stat st{};
  const int64_t ns = stat("/proc/self/ns/pid", &st) == 0 ? static_cast<int64_t>(st.st_ino) : -1;
  return {boot.empty() ? -1 : key, ns};
}

// One all-gather of int64 values over the group's CPU backend; result [rank][i].
std::vector<std::vector<int64_t>> gather(c10d::ProcessGroup& pg, const std::vector<int64_t>& values) {
  const int n = pg.getSize();
  auto in = at::tensor(values, at::TensorOptions().dtype(at::kLong));
  std::vector<at::Tensor> outs;
  for (int i = 0; i < n; ++i) outs.push_back(at::empty_like(in));
  std::vector<std::vector<at::Tensor>> out_lists{outs};
  std::vector<at::Tensor> in_list{in};
  wait_work(pg.allgather(out_lists, in_list), "all_gather (shared-memory setup)");
  std::vector<std::vector<int64_t>> result;
  for (const auto& t : out_lists[0]) result.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  return result;
}

std::chrono::milliseconds group_timeout(c10d::ProcessGroup& pg) {
  try {
    return pg.getBackend(c10::DeviceType::CPU)->getBackendOptions()->timeout;
  } catch (const std::exception&) {
    return std::chrono::minutes(5);
  }
}

Channels* set_up(c10d::ProcessGroup& pg, int64_t counter) {
  const int n = pg.getSize(), me = pg.getRank();
  const auto [host, ns] = host_identity();
  const int64_t wanted = capacity_setting().load();
  const auto info = gather(pg, {wanted, host, ns, static_cast<int64_t>(getpid()), counter});
  int64_t cap = wanted;
  bool same = host != -1 && ns != -1;
  for (const auto& r : info) {
    cap = std::min(cap, r[0]);
    same = same && r[1] == info[0][1] && r[2] == info[0][2];
  }
  // Fewer bytes per ring with many ranks, within one bound per group; every rank computes the same from `info`.
  if (cap > 0 && n > 1) cap = std::min(cap, kMaxSegment / (static_cast<int64_t>(n) * (n - 1)) / kPage * kPage);
  if (!same || cap < kMinRing) return nullptr;
  const auto bytes = Channels::segment_bytes(n, cap);
  const std::string name = "/shardtensor-" + std::to_string(info[0][3]) + "-" + std::to_string(info[0][4]);
  // Rank 0 creates the segment (zeroed: every ring empty) and reserves its pages, so a full /dev/shm shows here and
  // not as a SIGBUS at a later write; then the others map it; then rank 0 unlinks the name (the mappings stay, and
  // nothing is left behind in /dev/shm when the processes end).
  int fd = -1;
  bool made = false;
  int64_t ok = 1;
  if (me == 0) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    made = fd >= 0;
    ok = fd >= 0 && ftruncate(fd, bytes) == 0;
    if (ok) {
      const int rc = posix_fallocate(fd, 0, bytes);
      ok = rc == 0 || rc == EOPNOTSUPP || rc == ENOSYS;
    }
  }
  const auto created = gather(pg, {ok});
  if (me != 0 && created[0][0]) {
    fd = shm_open(name.c_str(), O_RDWR, 0600);
    ok = fd >= 0;
  }
  void* base = MAP_FAILED;
  if (ok && created[0][0]) base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ok = created[0][0] && base != MAP_FAILED;
  if (fd >= 0) close(fd);
  const auto opened = gather(pg, {ok});
  if (made) shm_unlink(name.c_str());
  bool all = true;
  for (const auto& r : opened) all = all && r[0];
  if (!all) {
    if (base != MAP_FAILED) munmap(base, bytes);
    return nullptr;
  }
  std::vector<int64_t> pids;
  for (const auto& r : info) pids.push_back(r[3]);
  g_groups.fetch_add(1, std::memory_order_relaxed);
  std::string group_name;
  try {
    group_name = pg.getGroupName();
  } catch (const std::exception&) {
  }
  return new Channels(n, me, cap, static_cast<char*>(base), bytes, std::move(pids), group_timeout(pg),
                      group_name.empty() ? std::string("(unnamed)") : group_name);
}

} // namespace

int64_t shm_set_capacity(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "set_shm_capacity: expected a number of bytes >= 0 (0 turns the shared-memory ",
                    "transport off), got ", bytes);
  return capacity_setting().exchange(bytes == 0 ? 0 : round_up(bytes, kPage));
}

int64_t shm_get_capacity() {
  return capacity_setting().load();
}

namespace {

// Unmaps the rings of groups that no longer exist (tests and programs that make many groups would otherwise keep every
// segment's reserved pages until they exit); see Channels::release for the ones that stay.
void release_dead_groups(Registry& reg) {
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto it = reg.groups.begin(); it != reg.groups.end();) {
    auto* ch = it->second.second;
    if (!it->second.first.expired() || (ch && !ch->release())) {
      ++it;
      continue;
    }
    if (ch) g_released.fetch_add(1, std::memory_order_relaxed);
    delete ch;
    it = reg.groups.erase(it);
  }
}

} // namespace

Channels* channels(c10d::ProcessGroup& pg) {
  if (pg.getSize() < 2) return nullptr;
  auto& reg = registry();
  int64_t counter = 0;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.groups.find(&pg);
    if (it != reg.groups.end() && !it->second.first.expired()) return it->second.second;
    counter = reg.segments++;
  }
  release_dead_groups(reg);
  // The set-up's collectives run without the registry's lock (another thread may use other groups meanwhile).
  Channels* ch = set_up(pg, counter);
  auto owner = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(&pg);
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.groups.insert_or_assign(&pg, std::make_pair(c10::weak_intrusive_ptr<c10d::ProcessGroup>(owner), ch));
  return ch;
}

bool fits(const Channels& ch, int64_t nbytes) {
  return Ring::footprint(nbytes) <= ch.cap();
}

c10::intrusive_ptr<c10d::Work> send(Channels& ch, const at::Tensor& t, int peer) {
  return ch.send(t, peer);
}

c10::intrusive_ptr<c10d::Work> recv(Channels& ch, const at::Tensor& t, int peer) {
  return ch.recv(t, peer);
}

bool reduces(const Channels& ch, const at::Tensor& buf, c10d::ReduceOp op) {
  if (!fits(ch, static_cast<int64_t>(buf.nbytes())) || !buf.is_cpu() || !buf.is_contiguous()) return false;
  switch (buf.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kInt: case at::kLong:
    case at::kChar: case at::kByte: break;
    default: return false;
  }
  return op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::MAX || op == c10d::ReduceOp::MIN;
}

namespace {

// The terms of one all-reduce in flight: this rank's sends are done when posted; wait() receives the others' terms
// and combines them in coordinate order into `buf`.
class ReduceWork : public c10d::Work {
 public:
  ReduceWork(at::Tensor buf, c10d::ReduceOp op, int me) : c10d::Work(-1, c10d::OpType::ALLREDUCE), buf_(std::move(buf)), op_(op), me_(me) {}
  bool isCompleted() override {
    if (done_) return true;
    for (auto& w : recvs_)
      if (!w->isCompleted()) return false;
    return true;
  }
  bool isSuccess() const override { return done_; }
  bool wait(std::chrono::milliseconds /*timeout: the group's own bounds it*/) override {
    if (done_) return true;
    for (auto& w : recvs_) w->wait();
    recvs_.clear();
    // Left to right over coordinates, every rank alike: acc = t0 (op) t1 (op) ... The running value lives in a
    // received buffer (coordinate 0's, or ours when we are coordinate 0), so `buf` is read as a term until the end.
    at::Tensor acc = me_ == 0 ? buf_ : terms_[0];
    for (size_t i = 1; i < terms_.size(); ++i) {
      const auto& t = terms_[i];
      if (op_ == c10d::ReduceOp::SUM) acc.add_(t);
      else if (op_ == c10d::ReduceOp::MAX) at::maximum_out(acc, acc, t);
      else at::minimum_out(acc, acc, t);
    }
    if (me_ != 0) buf_.copy_(acc);
    terms_.clear();
    done_ = true;
    return true;
  }

  at::Tensor buf_;
  c10d::ReduceOp op_;
  int me_;
  std::vector<at::Tensor> terms_;  // by coordinate; terms_[me] is buf_
  std::vector<c10::intrusive_ptr<c10d::Work>> recvs_;
  bool done_ = false;
};

} // namespace

namespace {
// A receive buffer of the all-reduce: the transport's own memory, like Gloo's and NCCL's internal buffers, so it is not
// a tensor allocation that the memory accounting (st.RankStats, the simulation's peak) counts; the tensor owns it.
at::Tensor transport_scratch_like(const at::Tensor& buf) {
  const auto nbytes = std::max<int64_t>(static_cast<int64_t>(buf.nbytes()), 1);
  void* p = std::aligned_alloc(kAlign, static_cast<size_t>(round_up(nbytes, kAlign)));
  TORCH_CHECK(p, "shared-memory all-reduce: out of memory for a ", nbytes, "-byte receive buffer");
  return at::from_blob(p, buf.sizes(), [](void* q) { std::free(q); }, buf.options());
}
} // namespace

c10::intrusive_ptr<c10d::Work> all_reduce_start(Channels& ch, const at::Tensor& buf, c10d::ReduceOp op) {
  auto w = c10::make_intrusive<ReduceWork>(buf, op, ch.rank());
  const int n = ch.size(), me = ch.rank();
  // Sends first (they complete at once), to the ranks after this one first: each rank's first receive is then the
  // one its predecessor posted first.
  for (int k = 1; k < n; ++k) ch.send(buf, (me + k) % n);
  for (int c = 0; c < n; ++c) {
    if (c == me) {
      w->terms_.push_back(buf);
      continue;
    }
    auto t = transport_scratch_like(buf);
    w->recvs_.push_back(ch.recv(t, c));
    w->terms_.push_back(t);
  }
  return w;
}

c10::intrusive_ptr<c10d::Work> post(Channels* ch, c10d::ProcessGroup& pg, const at::Tensor& t, int peer, bool send,
                                    int tag) {
  if (ch && fits(*ch, static_cast<int64_t>(t.nbytes()))) return send ? ch->send(t, peer) : ch->recv(t, peer);
  std::vector<at::Tensor> ts{t};
  return send ? pg.send(ts, peer, tag) : pg.recv(ts, peer, tag);
}

std::vector<c10::intrusive_ptr<c10d::Work>> all_to_all_start(Channels& ch, c10d::ProcessGroup& pg, const at::Tensor& in,
                                                             const at::Tensor& out,
                                                             const std::vector<int64_t>& send_splits,
                                                             const std::vector<int64_t>& recv_splits, int tag) {
  const int n = ch.size(), me = ch.rank();
  TORCH_INTERNAL_ASSERT(static_cast<int>(send_splits.size()) == n && static_cast<int>(recv_splits.size()) == n,
                        "all_to_all_start: one split per coordinate");
  std::vector<int64_t> send_off(n + 1, 0), recv_off(n + 1, 0);
  for (int j = 0; j < n; ++j) {
    send_off[j + 1] = send_off[j] + send_splits[j];
    recv_off[j + 1] = recv_off[j] + recv_splits[j];
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (send_splits[me] > 0) out.narrow(0, recv_off[me], recv_splits[me]).copy_(in.narrow(0, send_off[me], send_splits[me]));
  // To the coordinates after this one first, from those before it first: each rank's first receive is then the
  // piece its predecessor posted first (the order does not matter for matching, only for how early data flows).
  for (int k = 1; k < n; ++k) {
    const int to = (me + k) % n, from = (me - k + n) % n;
    if (send_splits[to] > 0)
      works.push_back(post(&ch, pg, in.narrow(0, send_off[to], send_splits[to]), to, /*send=*/true, tag));
    if (recv_splits[from] > 0)
      works.push_back(post(&ch, pg, out.narrow(0, recv_off[from], recv_splits[from]), from, /*send=*/false, tag));
  }
  return works;
}


std::vector<c10::intrusive_ptr<c10d::Work>> all_gather_start(Channels& ch, c10d::ProcessGroup& pg, const at::Tensor& in,
                                                             const std::vector<at::Tensor>& outs, int tag) {
  const int n = ch.size(), me = ch.rank();
  TORCH_INTERNAL_ASSERT(static_cast<int>(outs.size()) == n, "all_gather_start: one output per coordinate");
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int k = 1; k < n; ++k) {
    const int to = (me + k) % n, from = (me - k + n) % n;
    if (in.numel() > 0) works.push_back(post(&ch, pg, in, to, /*send=*/true, tag));
    if (outs[from].numel() > 0) works.push_back(post(&ch, pg, outs[from], from, /*send=*/false, tag));
  }
  return works;
}

ShmStats shm_stats() {
  return ShmStats{g_sent.load(), g_deferred.load(), g_received.load(), g_groups.load(), g_released.load()};
}

} // namespace shardtensor::comm::shm

namespace shardtensor {
int64_t set_shm_capacity(int64_t bytes) {
  return comm::shm::shm_set_capacity(bytes);
}
int64_t shm_capacity() {
  return comm::shm::shm_get_capacity();
}
} // namespace shardtensor
