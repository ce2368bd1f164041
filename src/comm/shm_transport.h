// Point-to-point messages between the ranks of one host through shared memory, for the library's neighbour
// exchanges (halos, ring passes) on CPU tensors, and the all-reduces, all-to-alls and all-gathers built from them.
//
// Why: a Gloo send/recv pair is a rendezvous of three messages handled by each rank's transport thread, so one halo
// exchange costs four thread wake-ups (0.5-2.4 ms on a busy 2-core host for ~40 µs of CPU) and Gloo's loop thread
// spins on the pair's mutex while the rank's main thread posts (benchmarks/results/halo_conv_256_step_breakdown.md).
// Here a send copies the rows into a ring buffer the receiver maps and returns; a receive copies them out, blocking
// (spin, then a futex) only when they have not arrived yet. No thread of either rank is involved otherwise.
//
// A process group gets channels the first time an exchange over it asks (`channels`): a collective over the group
// (three small all-gathers on its CPU backend, once), so it is made where every rank of the group issues the same
// exchange. Every rank then agrees (the decision is made from the gathered values, never a local one): all ranks of
// the group run on one kernel, in one PID namespace, see one /dev/shm, and enable it (`set_shm_capacity` > 0 on
// every rank); otherwise the group keeps using its process group's send/recv.
//
// Each ordered pair (sender, receiver) has one ring of `capacity` bytes; messages on it are received in the order
// they were sent, which matches the library's rule that every rank issues its exchanges in the same order (c10d's
// tags are not needed). A message larger than a ring goes through the process group instead (both sides know its
// size, so both choose alike: `fits`). A send that finds its ring full is copied aside and written by a helper
// thread of that ring when the receiver frees space, so a send never blocks and no wait order can deadlock.
// A receive that waits longer than the process group's timeout, finds the sending process gone, or reads a message
// of another size than it expects (ranks issued different exchanges) raises; the channels of that group are then
// unusable (the error names them).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <vector>

namespace shardtensor::comm::shm {

// The ring size setting (shardtensor::set_shm_capacity, <shardtensor/comm_backend.h>); rounded up to 4 KiB.
int64_t shm_set_capacity(int64_t bytes);
int64_t shm_get_capacity();

class Channels;

// The shared-memory channels of `pg` (set up on the first call: collective over `pg`, see above), or null when the
// group does not use them. Only for groups with a CPU backend and real ranks (no simulation).
Channels* channels(c10d::ProcessGroup& pg);

// Whether a message of `nbytes` travels through the channels (else through the process group); the same answer on
// every rank of the group.
bool fits(const Channels& ch, int64_t nbytes);

// One message of `t` (contiguous) to or from `peer`: through the rings when `ch` is set and the message fits them,
// else the process group's send/recv under `tag` (both sides know its size, so both choose alike).
c10::intrusive_ptr<c10d::Work> post(Channels* ch, c10d::ProcessGroup& pg, const at::Tensor& t, int peer, bool send,
                                    int tag);

// `t`: a contiguous CPU tensor of `fits` size. The send's work is complete when it returns (the bytes are copied);
// the receive's completes when the message has been copied into `t` (which it keeps alive until then).
c10::intrusive_ptr<c10d::Work> send(Channels& ch, const at::Tensor& t, int peer);
c10::intrusive_ptr<c10d::Work> recv(Channels& ch, const at::Tensor& t, int peer);

// An all-reduce through the rings: every rank sends `buf` to every other and combines the n terms in coordinate order,
// so every rank computes the same values bit for bit. `buf`: contiguous, on the CPU, of a dtype `reduces` accepts; it
// holds the result when the returned work's wait() returns (one wait per work; the work keeps `buf` alive).
// `reduces`: whether an all-reduce of `buf` with `op` can go this way (the same answer on every rank of the group).
bool reduces(const Channels& ch, const at::Tensor& buf, c10d::ReduceOp op);
c10::intrusive_ptr<c10d::Work> all_reduce_start(Channels& ch, const at::Tensor& buf, c10d::ReduceOp op);

// An all-to-all as paired messages: piece j of `in` (flat, `send_splits[j]` elements, in coordinate order) to
// coordinate j, piece j of `out` from it; each message through the rings when it fits one, else the process group's
// send/recv under `tag` (both sides know its size, so both choose alike); this rank's own piece is copied. Empty pieces
// are skipped on both sides. Returns the works to wait (they keep no buffers: the caller keeps `in` and `out`).
std::vector<c10::intrusive_ptr<c10d::Work>> all_to_all_start(Channels& ch, c10d::ProcessGroup& pg, const at::Tensor& in,
                                                             const at::Tensor& out,
                                                             const std::vector<int64_t>& send_splits,
                                                             const std::vector<int64_t>& recv_splits, int tag);

// An all-gather as paired messages: `in` to every other coordinate, `outs[j]` (contiguous, its size known to both
// sides) from coordinate j; each message through the rings when it fits one, else the process group's send/recv under
// `tag`. `outs[me]` is not touched; empty pieces are skipped on both sides. Returns the works to wait.
std::vector<c10::intrusive_ptr<c10d::Work>> all_gather_start(Channels& ch, c10d::ProcessGroup& pg, const at::Tensor& in,
                                                             const std::vector<at::Tensor>& outs, int tag);

// Counters since the process started (tests and benchmarks): messages sent through rings, of those the ones a ring
// could not take at once (written later by its helper thread), messages received, groups set up with channels, and
// of those the ones released.
struct ShmStats {
  int64_t sent = 0;
  int64_t deferred = 0;
  int64_t received = 0;
  int64_t groups = 0;
  int64_t released = 0;  // groups whose rings were unmapped after the group was gone
};
ShmStats shm_stats();

} // namespace shardtensor::comm::shm
