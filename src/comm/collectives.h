// Collectives over one mesh dim's c10d process group, on plain local tensors. Uneven shapes everywhere.
// Every function is a collective: all ranks of the mesh dim's group must call it, in the same order.
#pragma once

#include <shardtensor/mesh.h>
#include <shardtensor/placement.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace shardtensor::comm {

// Gather a tensor sharded along `dim` with `extents` (one per coordinate) into the full tensor.
at::Tensor all_gather_v(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                        const Mesh& mesh, int64_t mesh_dim);

// Reduce over the mesh dim; returns a new tensor.
at::Tensor all_reduce(const at::Tensor& local, ReduceOp op, const Mesh& mesh, int64_t mesh_dim);

// A sum over one mesh dim in flight (gradient buckets, dispatch/grad_buckets.h): started on a buffer the caller owns
// and leaves alone until `finish_all_reduce_sum` hands it back reduced. Dtypes the backend reduces natively only
// (float, double, half, bfloat16); no functional (traced) path: callers reduce synchronously while tracing.
struct PendingAllReduce {
  c10::intrusive_ptr<c10d::Work> work;  // null when nothing is in flight (a size-1 mesh dim)
  at::Tensor buf;                       // reduced in place (its host copy when staged)
  at::Device device{at::kCPU};
  bool staged = false;
};
PendingAllReduce all_reduce_sum_start(at::Tensor buf, const Mesh& mesh, int64_t mesh_dim);
at::Tensor finish_all_reduce_sum(PendingAllReduce& pending, const Mesh& mesh, int64_t mesh_dim);

// Each rank holds a full-size term along `dim`; returns this rank's chunk (`extents`) of the reduction.
at::Tensor reduce_scatter_v(const at::Tensor& local, ReduceOp op, int64_t dim,
                            const std::vector<int64_t>& extents, const Mesh& mesh, int64_t mesh_dim);

// Re-split: `local` is split along `src_dim` with `src_extents`; the result is split along `dst_dim` with
// `dst_extents`. `src_dim == dst_dim` changes the extents of one dim.
at::Tensor all_to_all_v(const at::Tensor& local, int64_t src_dim, const std::vector<int64_t>& src_extents,
                        int64_t dst_dim, const std::vector<int64_t>& dst_extents, const Mesh& mesh,
                        int64_t mesh_dim);

// Broadcast from coordinate `root` along the mesh dim. Non-root ranks pass a tensor of the right shape.
at::Tensor broadcast(const at::Tensor& tensor, int64_t root, const Mesh& mesh, int64_t mesh_dim);

// Scatter from coordinate `root`: the root passes the full tensor (split along `dim` with `extents`),
// others pass an empty tensor with the right dtype/device and `shape_template` as the full shape.
at::Tensor scatter_v(const at::Tensor& full, int64_t root, int64_t dim, const std::vector<int64_t>& extents,
                     const std::vector<int64_t>& full_shape, const at::TensorOptions& options,
                     const Mesh& mesh, int64_t mesh_dim);

// Coordinate c receives the tensor of coordinate n-1-c, whose shape is `partner_shape` (shapes may differ; every
// rank knows them from the layout); for flips along a sharded dim.
at::Tensor mirror_ranks(const at::Tensor& local, at::IntArrayRef partner_shape, const Mesh& mesh, int64_t mesh_dim);

// An all-to-all in flight: wait with finish_all_to_all (buffers stay alive until then).
struct PendingAllToAll {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<c10::intrusive_ptr<c10d::Work>> pair_works;  // as paired messages (comm/shm_transport.h)
  at::Tensor in, out;
  std::vector<int64_t> recv_numels;
  bool staged = false;
  bool functional = false;  // `out` is a functional collective's result, not yet waited (comm/functional.h)
  bool complex = false;     // functional: `out` holds the real view of complex data
  at::ScalarType dtype = at::kFloat;  // of the data: `out` travels in another dtype when the backend lacks it
  at::Device device{at::kCPU};
};
PendingAllToAll all_to_all_flat_start(const std::vector<at::Tensor>& send_pieces, const std::vector<int64_t>& recv_numels,
                                      const at::TensorOptions& opts, const Mesh& mesh, int64_t mesh_dim);
// The flat chunks received from every coordinate, in coordinate order.
std::vector<at::Tensor> finish_all_to_all(PendingAllToAll& pending);

// One all-to-all of flattened pieces: piece j goes to coordinate j; returns the flat chunks received from every
// coordinate (recv_numels[j] elements from coordinate j), in coordinate order.
std::vector<at::Tensor> all_to_all_flat(const std::vector<at::Tensor>& send_pieces,
                                        const std::vector<int64_t>& recv_numels, const at::TensorOptions& opts,
                                        const Mesh& mesh, int64_t mesh_dim);

// A point-to-point exchange along a mesh dim (a halo: rows move only between the ranks that need them, not through
// a group-wide all-to-all): this rank sends send[j] to coordinate j and receives a tensor of recv_shapes[j] from it
// (send[me] and recv_shapes[me] are empty). Sizes come from the layout, which every rank knows, so both sides of a
// pair skip an empty piece alike; the messages between a pair go in coordinate order under one tag, so consecutive
// exchanges match in the order every rank issues them. Gloo: one send and one receive per non-empty piece. NCCL:
// coalesced (batch_isend_irecv), and every rank also exchanges a one-element placeholder with each ring neighbour
// (c +- 1) it has nothing for, so every rank joins each coalesced group (the first one on a group creates its
// communicator, collectively). The functional path (tracing, or selected) has no send/recv: one all-to-all whose
// splits are empty except between those pairs. Counted as one call of `kind` with the bytes sent and one message
// per piece sent. `like`: a tensor of the exchange (dtype, device, and whether it is being traced decides the path).
// Host staging as for the collectives.
class PeerExchange {
 public:
  // Completes the exchange: the received tensors, by coordinate (empty where nothing came).
  std::vector<at::Tensor> wait();

 private:
  friend PeerExchange peer_exchange_start(const std::vector<at::Tensor>&, const std::vector<std::vector<int64_t>>&,
                                          const at::Tensor&, const Mesh&, int64_t, const char*);
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<at::Tensor> keep_alive_;  // contiguous send buffers and placeholders
  std::vector<at::Tensor> recv_;        // by coordinate (host staged when needed)
  std::vector<std::vector<int64_t>> shapes_;
  c10::Device device_{c10::kCPU};
  bool staged_ = false;
  bool use_functional_ = false;
  PendingAllToAll functional_;
  const char* kind_ = "halo";
};
// The tag of peer exchanges on Gloo (ring passes use small tags of their own).
constexpr int kPeerExchangeTag = 0x4a10;
// The tag of an all-to-all's or all-gather's messages too large for the shared-memory rings (comm/shm_transport.h),
// on Gloo.
constexpr int kAllToAllTag = 0x4a11;
PeerExchange peer_exchange_start(const std::vector<at::Tensor>& send,
                                 const std::vector<std::vector<int64_t>>& recv_shapes, const at::Tensor& like,
                                 const Mesh& mesh, int64_t mesh_dim, const char* kind = "halo");

// Ring pass along a mesh dim: send each of `send` to coordinate (c+1) % n and receive tensors of
// `recv_shapes` (dtype of the matching send tensor, same device) from coordinate (c-1+n) % n (`backward`: the
// other way round, to (c-1+n) % n and from (c+1) % n). Shapes come from
// specs every rank knows, so nothing is negotiated; zero-element tensors are neither sent nor received (both
// sides know they are empty). `start` posts every send and receive (coalesced on NCCL) and returns at once;
// `wait` completes them and returns the received tensors. A size-1 mesh dim hands `send` back.
class RingExchange {
 public:
  std::vector<at::Tensor> wait();
  bool pending() const { return !works_.empty() || !done_.empty(); }

 private:
  friend RingExchange ring_pass_start(const std::vector<at::Tensor>&, const std::vector<std::vector<int64_t>>&,
                                      const Mesh&, int64_t, int, bool);
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<at::Tensor> keep_alive_;  // contiguous send buffers
  std::vector<at::Tensor> recv_;        // receive buffers (host staged when needed)
  std::vector<at::Tensor> done_;        // results when nothing was exchanged
  c10::Device device_{c10::kCPU};
  bool staged_ = false;
  bool functional_ = false;                   // recv_ holds functional results (flat), not yet waited
  std::vector<std::vector<int64_t>> shapes_;  // functional: the received tensors' shapes
  std::vector<bool> complex_;                 // functional: which received tensors travel as real views
};
RingExchange ring_pass_start(const std::vector<at::Tensor>& send, const std::vector<std::vector<int64_t>>& recv_shapes,
                             const Mesh& mesh, int64_t mesh_dim, int tag_base = 0, bool backward = false);
std::vector<at::Tensor> ring_pass(const std::vector<at::Tensor>& send,
                                  const std::vector<std::vector<int64_t>>& recv_shapes, const Mesh& mesh,
                                  int64_t mesh_dim, bool backward = false);

// All-gather of a small int64 vector (same length on every rank); result [size, n] row-major. `what` names the
// caller: under simulation (shardtensor/simulation.h) it raises NotImplementedError instead, as the fake process
// group would hand back this rank's values in every slot.
std::vector<std::vector<int64_t>> all_gather_ints(const std::vector<int64_t>& values, const Mesh& mesh,
                                                  int64_t mesh_dim, const char* what);

// Element-wise minimum of a small int64 vector (same length on every rank) over every rank of the mesh: one
// all-reduce per mesh dim, in mesh-dim order.
std::vector<int64_t> all_reduce_min_ints(const std::vector<int64_t>& values, const Mesh& mesh);

} // namespace shardtensor::comm
