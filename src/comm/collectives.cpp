#include "comm/collectives.h"
#include "comm/host_metadata.h"

#include <shardtensor/simulation.h>

#include "comm/comm_stats.h"
#include "comm/comm_timing.h"
#include "comm/functional.h"
#include "comm/shm_transport.h"
#include "comm/wait.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <optional>
#include <utility>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace shardtensor::comm {

namespace {

// Gloo lacks several collectives for CUDA tensors; stage those through host memory (correctness first).
bool needs_host_staging(c10d::ProcessGroup& pg, const at::Tensor& t) {
  if (!t.is_cuda()) return false;
  try {
    auto backend = pg.getBackend(c10::DeviceType::CUDA);
    if (backend->getBackendName() == "nccl") return false;
  } catch (const std::exception&) {
  }
  TORCH_WARN_ONCE("shardtensor: the process group has no NCCL backend for CUDA tensors; collectives are staged "
                  "through host memory (correct, but slow). Use init_process_group('cpu:gloo,cuda:nccl') or "
                  "'nccl' for CUDA tensors.");
  return true;
}

// c10d's backends move no complex tensors (Gloo rejects them; torch.distributed's Python API views them as real
// before calling c10d). Collectives here do the same: a complex tensor travels as its real view, a trailing dim
// of 2 (a view, no copy).
bool travels_as_real(const at::Tensor& t) {
  return t.defined() && at::isComplexType(t.scalar_type());
}

at::Tensor real_view(const at::Tensor& t) {
  return at::view_as_real(t.resolve_conj());
}

// Gloo moves and reduces only float, double, half, bfloat16, int8, uint8, int32, int64 and bool (NCCL lacks int16
// too). Other dtypes travel as a supported dtype of the same element size: for collectives that only move data the
// bytes are reinterpreted (a view, no copy: the backend copies them verbatim); reductions convert instead (below).
std::optional<at::ScalarType> wire_dtype(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  switch (t.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kChar: case at::kByte:
    case at::kInt: case at::kLong: case at::kBool:
      return std::nullopt;
    default: break;
  }
  if (at::isComplexType(t.scalar_type())) return std::nullopt;  // travels as its real view (travels_as_real)
  switch (t.element_size()) {
    case 1: return at::kByte;
    case 2: return at::kHalf;  // no 16-bit integer in Gloo; half is moved byte for byte
    case 4: return at::kInt;
    case 8: return at::kLong;
    default: return std::nullopt;
  }
}

// The dtype an all-reduce of `t` computes in when the backend lacks t's dtype: one that holds every value and whose
// result converts back exactly (sums wrap modulo 2^bits as torch's own do). uint64 sums wrap identically in int64;
// its max/min have no such dtype.
at::ScalarType reduce_dtype(const at::Tensor& t, ReduceOp op) {
  switch (t.scalar_type()) {
    case at::kShort: case at::kUInt16: return at::kInt;
    case at::kUInt32: return at::kLong;
    case at::kUInt64:
      TORCH_CHECK_NOT_IMPLEMENTED(op == ReduceOp::Sum,
                                  "all_reduce of a uint64 tensor: only a sum can be computed (no backend reduces "
                                  "unsigned 64-bit integers and no wider dtype holds them); convert to int64 first");
      return at::kLong;
    default: return at::isFloat8Type(t.scalar_type()) ? at::kFloat : t.scalar_type();
  }
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return c10d::ReduceOp::SUM;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

at::Tensor finish_avg(at::Tensor t, ReduceOp op, int64_t n) {
  if (op != ReduceOp::Avg) return t;
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/true)) return t.div(n, "trunc");
  return t.div_(n);
}

// Reduce a stack of N terms (dim 0) with the given op.
at::Tensor reduce_terms(const at::Tensor& terms, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return terms.sum(0);
    case ReduceOp::Avg:
      return at::isIntegralType(terms.scalar_type(), true) ? terms.sum(0).div(terms.size(0), "trunc")
                                                            : terms.mean(0);
    case ReduceOp::Max: return std::get<0>(terms.max(0));
    case ReduceOp::Min: return std::get<0>(terms.min(0));
  }
  return terms.sum(0);
}

// Records a collective about to be issued, for the replay of comm/comm_timing.h, when the accounting is on; `fill`
// sets the fields particular to its op. Returns its record index (-1: off), for issue_bound.
template <class Fill>
int64_t record_if_timed(IssuedCollective::Op op, const char* kind, const Mesh& mesh, int64_t mesh_dim,
                        const at::TensorOptions& options, int64_t numel, Fill&& fill) {
  if (!comm_timing_on()) return -1;
  IssuedCollective c;
  c.op = op;
  c.kind = kind;
  c.group = mesh.group(mesh_dim);
  c.options = options;
  c.numel = numel;
  fill(c);
  return record_issued(std::move(c));
}
int64_t record_if_timed(IssuedCollective::Op op, const char* kind, const Mesh& mesh, int64_t mesh_dim,
                        const at::TensorOptions& options, int64_t numel = 0) {
  return record_if_timed(op, kind, mesh, mesh_dim, options, numel, [](IssuedCollective&) {});
}

// Issues a collective through `issue` (a transport call returning its work), timed as exposed, and ties the work to
// its record `rec` (comm/comm_timing.h; -1: none).
template <class F>
c10::intrusive_ptr<c10d::Work> issue_bound(const char* kind, int64_t rec, F&& issue) {
  auto work = timed_issue(kind, std::forward<F>(issue));
  bind_work(work, rec);
  return work;
}

// The shared-memory rings of an exchange's group, when its messages travel on the host (not coalesced on a device)
// and the group is real (a simulation's fake group has no peers to share memory with). Sets them up on the group's
// first exchange: the callers are collectives, so every rank of the group asks at the same point.
shm::Channels* host_channels(c10d::ProcessGroup& pg, const Mesh& mesh, bool on_host) {
  if (!on_host || mesh.simulation() != 0) return nullptr;
  return shm::channels(pg);
}

// An all-reduce of `t` (contiguous, this rank's term; reduced in place) issued on the group's rings when it has them
// and they take it (comm/shm_transport.h), else on the process group.
c10::intrusive_ptr<c10d::Work> issue_all_reduce(c10d::ProcessGroup& pg, const Mesh& mesh, const at::Tensor& t,
                                                const c10d::AllreduceOptions& opts, const char* kind, int64_t rec) {
  auto* ring = host_channels(pg, mesh, t.is_cpu());
  const bool shm = ring && shm::reduces(*ring, t, opts.reduceOp);
  if (rec >= 0) set_issued_on_shm(rec, shm);
  return issue_bound(kind, rec, [&] {
    if (shm) return shm::all_reduce_start(*ring, t, opts.reduceOp);
    std::vector<at::Tensor> ts{t};
    return pg.allreduce(ts, opts);
  });
}

// Post one flat all-to-all: rank i sends send_pieces[j] (flattened) to rank j and receives recv_numels[j]
// elements from rank j. The pending object keeps the buffers alive until finish_all_to_all.
// Counted as one `kind` of the bytes that leave this rank (the piece addressed to itself stays: c10d copies it
// locally), made of `messages` point-to-point messages (-1: one to every other rank of the group).
PendingAllToAll start_flat_all_to_all(const std::vector<at::Tensor>& send_pieces, const std::vector<int64_t>& recv_numels,
                                      const at::TensorOptions& opts, const Mesh& mesh, int64_t mesh_dim,
                                      const char* kind = "all_to_all", int64_t messages = -1) {
  auto& pg = *mesh.group(mesh_dim);
  GilReleased no_gil; // see comm/wait.h
  // Only non-empty pieces are touched: a halo exchange has two of them among P (on fake tensors, under a simulation,
  // every tensor op costs a Python dispatch, so per-peer ops made a step's time grow with P).
  std::vector<at::Tensor> flat;
  std::vector<int64_t> send_splits;
  send_splits.reserve(send_pieces.size());
  for (const auto& p : send_pieces) {
    const auto n = p.numel();
    if (n > 0) flat.push_back(p.reshape({-1}));
    send_splits.push_back(n);
  }
  PendingAllToAll pending;
  // A buffer of its own, as cat gives (the caller may write to its tensors while the exchange is in flight).
  auto input = flat.size() == 1 ? flat[0].clone()
               : flat.empty()   ? at::empty({0}, send_pieces.empty() ? opts : send_pieces[0].options())
                                : at::cat(flat);
  pending.device = input.device();
  int64_t recv_total = 0;
  for (auto n : recv_numels) recv_total += n;
  pending.staged = !use_functional(input) && needs_host_staging(pg, input);
  pending.in = pending.staged ? input.cpu() : input;
  pending.out = at::empty({recv_total}, opts.device(pending.in.device()));
  pending.recv_numels = recv_numels;
  pending.dtype = input.scalar_type();
  auto recv_splits = recv_numels;
  // Complex data travels as its real view (2 reals per element), dtypes the backend lacks as a same-size one;
  // `out` stays the original view of the buffer.
  auto wire_in = pending.in, wire_out = pending.out;
  if (auto wire = wire_dtype(pending.in)) {
    wire_in = pending.in.view(*wire);
    wire_out = pending.out.view(*wire);
    pending.in = wire_in;
  } else if (travels_as_real(pending.in)) {
    wire_in = real_view(pending.in).reshape({-1});
    wire_out = at::view_as_real(pending.out).reshape({-1});
    for (auto& n : recv_splits) n *= 2;
    for (auto& n : send_splits) n *= 2;
    pending.in = wire_in;  // keeps the sent buffer alive until the wait
  }
  const auto me = mesh.coordinate(mesh_dim);
  record_collective(kind, (wire_in.numel() - send_splits[me]) * wire_in.element_size(),
                    messages < 0 ? mesh.size(mesh_dim) - 1 : messages);
  if (use_functional(input)) {
    pending.functional = true;
    pending.complex = travels_as_real(input);
    pending.staged = false;
    pending.out = functional::all_to_all_single_start(wire_in, recv_splits, send_splits, mesh, mesh_dim, nullptr);
    return pending;
  }
  // On one host: paired messages through the rings (the large ones through the process group's send/recv).
  auto* ring = host_channels(pg, mesh, wire_in.is_cpu());
  const auto rec = record_if_timed(IssuedCollective::Op::AllToAll, "all_to_all", mesh, mesh_dim, wire_in.options(), 0,
                                   [&](IssuedCollective& c) {
                                     c.send_splits = send_splits;
                                     c.recv_splits = recv_splits;
                                     c.shm = ring != nullptr;
                                   });
  if (ring) {
    pending.pair_works = timed_issue("all_to_all", [&] {
      return shm::all_to_all_start(*ring, pg, wire_in, wire_out, send_splits, recv_splits, kAllToAllTag);
    });
    for (const auto& w : pending.pair_works) bind_work(w, rec);
    pending.in = wire_in;
    return pending;
  }
  pending.work = issue_bound("all_to_all", rec, [&] { return pg.alltoall_base(wire_out, wire_in, recv_splits, send_splits); });
  return pending;
}

std::vector<at::Tensor> flat_all_to_all(const std::vector<at::Tensor>& send_pieces,
                                        const std::vector<int64_t>& recv_numels, const at::TensorOptions& opts,
                                        const Mesh& mesh, int64_t mesh_dim) {
  auto pending = start_flat_all_to_all(send_pieces, recv_numels, opts, mesh, mesh_dim);
  return finish_all_to_all(pending);
}

} // namespace

std::vector<at::Tensor> finish_all_to_all(PendingAllToAll& pending) {
  if (pending.work) wait_work(pending.work, "all_to_all");
  pending.work.reset();
  for (auto& w : pending.pair_works) wait_work(w, "all_to_all");
  pending.pair_works.clear();
  if (pending.functional) {
    pending.out = functional::wait(pending.out);
    if (pending.complex) pending.out = at::view_as_complex(pending.out.view({-1, 2}));
    else if (pending.out.scalar_type() != pending.dtype) pending.out = pending.out.view(pending.dtype);
    pending.functional = false;
  }
  auto out = pending.staged ? pending.out.to(pending.device) : pending.out;
  std::vector<at::Tensor> chunks;
  chunks.reserve(pending.recv_numels.size());
  // Every empty chunk shares one empty view (one op instead of one per peer; see start_flat_all_to_all).
  at::Tensor empty;
  int64_t off = 0;
  for (auto n : pending.recv_numels) {
    if (n == 0) {
      if (!empty.defined()) empty = out.narrow(0, 0, 0);
      chunks.push_back(empty);
    } else {
      chunks.push_back(out.narrow(0, off, n));
    }
    off += n;
  }
  return chunks;
}

PendingAllToAll all_to_all_flat_start(const std::vector<at::Tensor>& send_pieces, const std::vector<int64_t>& recv_numels,
                                      const at::TensorOptions& opts, const Mesh& mesh, int64_t mesh_dim) {
  if (mesh.size(mesh_dim) == 1) {
    PendingAllToAll p;
    p.out = send_pieces[0].reshape({-1});
    p.recv_numels = recv_numels;
    p.device = p.out.device();
    return p;
  }
  return start_flat_all_to_all(send_pieces, recv_numels, opts, mesh, mesh_dim);
}

std::vector<at::Tensor> all_to_all_flat(const std::vector<at::Tensor>& send_pieces,
                                        const std::vector<int64_t>& recv_numels, const at::TensorOptions& opts,
                                        const Mesh& mesh, int64_t mesh_dim) {
  if (mesh.size(mesh_dim) == 1) return {send_pieces[0].reshape({-1})};
  return flat_all_to_all(send_pieces, recv_numels, opts, mesh, mesh_dim);
}

at::Tensor all_gather_v(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                        const Mesh& mesh, int64_t mesh_dim) {
  const auto n = mesh.size(mesh_dim);
  if (n == 1) return local;
  if (travels_as_real(local)) return at::view_as_complex(all_gather_v(real_view(local), dim, extents, mesh, mesh_dim));
  if (auto wire = wire_dtype(local))
    return all_gather_v(local.view(*wire), dim, extents, mesh, mesh_dim).view(local.scalar_type());
  if (use_functional(local)) return functional::all_gather_v(local, dim, extents, mesh, mesh_dim);
  auto& pg = *mesh.group(mesh_dim);
  GilReleased no_gil; // see comm/wait.h
  int64_t max_extent = 0;
  bool even = true;
  for (auto e : extents) {
    max_extent = std::max(max_extent, e);
    even = even && e == extents[0];
  }
  auto padded_shape = local.sizes().vec();
  padded_shape[dim] = max_extent;
  int64_t padded_numel = 1;
  for (auto v : padded_shape) padded_numel *= v;
  // On one host: paired messages of the exact pieces through the rings (comm/shm_transport.h); no padding.
  if (auto* ring = host_channels(pg, mesh, local.is_cpu())) {
    const auto me = mesh.coordinate(mesh_dim);
    auto exact = local.contiguous();
    std::vector<at::Tensor> pieces;
    std::vector<int64_t> numels;
    for (int64_t j = 0; j < n; ++j) {
      auto shape = local.sizes().vec();
      shape[dim] = extents[j];
      pieces.push_back(j == me ? exact : at::empty(shape, exact.options()));
      numels.push_back(pieces.back().numel());
    }
    // Counted as the padded all-gather would be: the bytes a rank's collectives carry do not depend on the transport
    // (a simulation, whose group has no rings, counts the same).
    record_collective("all_gather", padded_numel * exact.element_size() * n);
    const auto rec = record_if_timed(IssuedCollective::Op::AllGather, "all_gather", mesh, mesh_dim, exact.options(),
                                     exact.numel(), [&](IssuedCollective& c) {
                                       c.recv_splits = numels;
                                       c.shm = true;
                                     });
    const auto works = timed_issue("all_gather", [&] { return shm::all_gather_start(*ring, pg, exact, pieces, kAllToAllTag); });
    for (const auto& w : works) bind_work(w, rec);
    for (const auto& w : works) wait_work(w, "all_gather", &mesh, mesh_dim);
    return at::cat(pieces, dim);
  }
  // Gloo's allgather needs equal sizes: pad along `dim` to the largest extent, trim after.
  at::Tensor input = local.contiguous();
  if (!even && local.size(dim) != max_extent) {
    input = at::zeros(padded_shape, local.options());
    input.narrow(dim, 0, local.size(dim)).copy_(local);
  }
  const bool stage = needs_host_staging(pg, input);
  if (stage) input = input.cpu();
  std::vector<at::Tensor> outputs;
  for (int64_t i = 0; i < n; ++i) outputs.push_back(at::empty(padded_shape, input.options()));
  std::vector<std::vector<at::Tensor>> out_lists{outputs};
  std::vector<at::Tensor> in_list{input};
  record_collective("all_gather", input.numel() * input.element_size() * n);
  const auto rec =
      record_if_timed(IssuedCollective::Op::AllGather, "all_gather", mesh, mesh_dim, input.options(), input.numel());
  wait_work(issue_bound("all_gather", rec, [&] { return pg.allgather(out_lists, in_list); }), "all_gather", &mesh, mesh_dim);
  std::vector<at::Tensor> pieces;
  for (int64_t i = 0; i < n; ++i) {
    auto piece = out_lists[0][i];
    pieces.push_back(even ? piece : piece.narrow(dim, 0, extents[i]));
  }
  auto full = at::cat(pieces, dim);
  return stage ? full.to(local.device()) : full;
}

at::Tensor all_reduce(const at::Tensor& local, ReduceOp op, const Mesh& mesh, int64_t mesh_dim) {
  const auto n = mesh.size(mesh_dim);
  if (n == 1) return local.clone();
  if (travels_as_real(local)) {
    TORCH_CHECK_VALUE(op == ReduceOp::Sum || op == ReduceOp::Avg,
                      "all_reduce of a complex tensor: only sum and avg are defined (complex numbers have no order)");
    return at::view_as_complex(all_reduce(real_view(local), op, mesh, mesh_dim));
  }
  if (wire_dtype(local)) {
    const auto compute = reduce_dtype(local, op);
    auto wide = compute == at::kLong && local.element_size() == 8 ? local.view(at::kLong) : local.to(compute);
    auto reduced = all_reduce(wide, op, mesh, mesh_dim);
    return local.element_size() == reduced.element_size() && !at::isFloatingType(compute)
               ? reduced.view(local.scalar_type())
               : reduced.to(local.scalar_type());
  }
  if (use_functional(local)) return finish_avg(functional::all_reduce(local, op, mesh, mesh_dim), op, n);
  auto& pg = *mesh.group(mesh_dim);
  GilReleased no_gil; // see comm/wait.h
  const bool stage = needs_host_staging(pg, local);
  auto t = stage ? local.cpu() : local.clone(at::MemoryFormat::Contiguous);
  if (stage) t = t.contiguous();
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  record_collective("all_reduce", t.numel() * t.element_size());
  const auto rec = record_if_timed(IssuedCollective::Op::AllReduce, "all_reduce", mesh, mesh_dim, t.options(),
                                   t.numel(), [&](IssuedCollective& c) { c.reduce = opts.reduceOp; });
  wait_work(issue_all_reduce(pg, mesh, t, opts, "all_reduce", rec), "all_reduce", &mesh, mesh_dim);
  t = finish_avg(t, op, n);
  return stage ? t.to(local.device()) : t;
}

namespace {
constexpr const char* kGradientBucket = "all_reduce (gradient bucket)";
} // namespace

PendingAllReduce all_reduce_sum_start(at::Tensor buf, const Mesh& mesh, int64_t mesh_dim) {
  PendingAllReduce pending;
  pending.device = buf.device();
  pending.buf = std::move(buf);
  if (mesh.size(mesh_dim) == 1) return pending;
  TORCH_INTERNAL_ASSERT(pending.buf.is_contiguous() && !wire_dtype(pending.buf) && !travels_as_real(pending.buf),
                        "all_reduce_sum_start: a contiguous buffer of a natively reduced dtype");
  auto& pg = *mesh.group(mesh_dim);
  GilReleased no_gil;  // see comm/wait.h
  pending.staged = needs_host_staging(pg, pending.buf);
  if (pending.staged) pending.buf = pending.buf.cpu();
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  record_collective("all_reduce", pending.buf.numel() * pending.buf.element_size());
  const auto rec = record_if_timed(IssuedCollective::Op::AllReduce, kGradientBucket, mesh, mesh_dim,
                                   pending.buf.options(), pending.buf.numel());
  pending.work = issue_all_reduce(pg, mesh, pending.buf, opts, kGradientBucket, rec);
  return pending;
}

at::Tensor finish_all_reduce_sum(PendingAllReduce& pending, const Mesh& mesh, int64_t mesh_dim) {
  if (pending.work) wait_work(pending.work, kGradientBucket, &mesh, mesh_dim);
  pending.work.reset();
  auto out = pending.staged ? pending.buf.to(pending.device) : pending.buf;
  pending.buf = at::Tensor();
  return out;
}

at::Tensor reduce_scatter_v(const at::Tensor& local, ReduceOp op, int64_t dim, const std::vector<int64_t>& extents,
                            const Mesh& mesh, int64_t mesh_dim) {
  const auto n = mesh.size(mesh_dim);
  if (n == 1) return local.clone();
  // Send chunk j to rank j, receive every rank's term of my chunk, reduce locally. Works on every backend
  // with uneven chunks and moves exactly the reduce-scatter volume.
  std::vector<at::Tensor> send;
  int64_t off = 0;
  for (auto e : extents) {
    send.push_back(local.narrow(dim, off, e));
    off += e;
  }
  const auto me = mesh.coordinate(mesh_dim);
  auto my_shape = local.sizes().vec();
  my_shape[dim] = extents[me];
  int64_t my_numel = 1;
  for (auto s : my_shape) my_numel *= s;
  auto chunks = flat_all_to_all(send, std::vector<int64_t>(n, my_numel), local.options(), mesh, mesh_dim);
  std::vector<at::Tensor> terms;
  for (auto& c : chunks) terms.push_back(c.view(my_shape));
  return reduce_terms(at::stack(terms), op);
}

at::Tensor all_to_all_v(const at::Tensor& local, int64_t src_dim, const std::vector<int64_t>& src_extents,
                        int64_t dst_dim, const std::vector<int64_t>& dst_extents, const Mesh& mesh,
                        int64_t mesh_dim) {
  const auto n = mesh.size(mesh_dim);
  const auto me = mesh.coordinate(mesh_dim);
  if (n == 1) return local;
  std::vector<at::Tensor> send;
  std::vector<int64_t> recv_numels;
  std::vector<std::vector<int64_t>> recv_shapes;
  if (src_dim != dst_dim) {
    int64_t off = 0;
    for (auto e : dst_extents) {
      send.push_back(local.narrow(dst_dim, off, e));
      off += e;
    }
    for (int64_t i = 0; i < n; ++i) {
      auto shape = local.sizes().vec();
      shape[src_dim] = src_extents[i];
      shape[dst_dim] = dst_extents[me];
      recv_shapes.push_back(shape);
    }
  } else {
    // Same dim, new extents: send the overlap of my source range with each target range.
    auto src_off = [&](int64_t r) {
      int64_t o = 0;
      for (int64_t i = 0; i < r; ++i) o += src_extents[i];
      return o;
    };
    auto dst_off = [&](int64_t r) {
      int64_t o = 0;
      for (int64_t i = 0; i < r; ++i) o += dst_extents[i];
      return o;
    };
    auto overlap = [](int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
      return std::pair<int64_t, int64_t>{std::max(a0, b0), std::max(std::max(a0, b0), std::min(a1, b1))};
    };
    const auto my_src0 = src_off(me), my_src1 = my_src0 + src_extents[me];
    const auto my_dst0 = dst_off(me), my_dst1 = my_dst0 + dst_extents[me];
    for (int64_t j = 0; j < n; ++j) {
      auto [lo, hi] = overlap(my_src0, my_src1, dst_off(j), dst_off(j) + dst_extents[j]);
      send.push_back(hi > lo ? local.narrow(src_dim, lo - my_src0, hi - lo) : local.narrow(src_dim, 0, 0));
      auto [rlo, rhi] = overlap(src_off(j), src_off(j) + src_extents[j], my_dst0, my_dst1);
      auto shape = local.sizes().vec();
      shape[src_dim] = rhi - rlo;
      recv_shapes.push_back(shape);
    }
  }
  for (auto& s : recv_shapes) {
    int64_t k = 1;
    for (auto v : s) k *= v;
    recv_numels.push_back(k);
  }
  auto chunks = flat_all_to_all(send, recv_numels, local.options(), mesh, mesh_dim);
  std::vector<at::Tensor> pieces;
  for (int64_t i = 0; i < n; ++i) pieces.push_back(chunks[i].view(recv_shapes[i]));
  return at::cat(pieces, src_dim);
}

at::Tensor broadcast(const at::Tensor& tensor, int64_t root, const Mesh& mesh, int64_t mesh_dim) {
  if (mesh.size(mesh_dim) == 1) return tensor;
  if (travels_as_real(tensor)) return at::view_as_complex(broadcast(real_view(tensor), root, mesh, mesh_dim));
  if (auto wire = wire_dtype(tensor))
    return broadcast(tensor.view(*wire), root, mesh, mesh_dim).view(tensor.scalar_type());
  if (use_functional(tensor)) return functional::broadcast(tensor, root, mesh, mesh_dim);
  auto& pg = *mesh.group(mesh_dim);
  GilReleased no_gil; // see comm/wait.h
  const bool stage = needs_host_staging(pg, tensor);
  auto t = stage ? tensor.cpu() : tensor.contiguous();
  if (mesh.coordinate(mesh_dim) == root && !stage) t = t.clone();
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  record_collective("broadcast", t.numel() * t.element_size());
  const auto rec = record_if_timed(IssuedCollective::Op::Broadcast, "broadcast", mesh, mesh_dim, t.options(), t.numel(),
                                   [&](IssuedCollective& c) { c.root = root; });
  wait_work(issue_bound("broadcast", rec, [&] { return pg.broadcast(ts, opts); }), "broadcast", &mesh, mesh_dim);
  return stage ? t.to(tensor.device()) : t;
}

at::Tensor scatter_v(const at::Tensor& full, int64_t root, int64_t dim, const std::vector<int64_t>& extents,
                     const std::vector<int64_t>& full_shape, const at::TensorOptions& options, const Mesh& mesh,
                     int64_t mesh_dim) {
  const auto n = mesh.size(mesh_dim);
  const auto me = mesh.coordinate(mesh_dim);
  if (n == 1) return full;
  if (at::isComplexType(c10::typeMetaToScalarType(options.dtype()))) {
    auto real_shape = full_shape;
    real_shape.push_back(2);
    auto real_opts = options.dtype(c10::toRealValueType(c10::typeMetaToScalarType(options.dtype())));
    return at::view_as_complex(scatter_v(me == root ? real_view(full) : full, root, dim, extents, real_shape,
                                         real_opts, mesh, mesh_dim));
  }
  if (auto wire = wire_dtype(at::empty({0}, options))) {
    return scatter_v(me == root ? full.view(*wire) : full, root, dim, extents, full_shape, options.dtype(*wire), mesh,
                     mesh_dim)
        .view(c10::typeMetaToScalarType(options.dtype()));
  }
  if (use_functional(me == root ? full : at::empty({0}, options))) {
    // No functional scatter: an all-to-all in which only the root sends (chunk j to coordinate j).
    auto my_shape = full_shape;
    my_shape[dim] = extents[me];
    int64_t my_numel = 1;
    for (auto v : my_shape) my_numel *= v;
    std::vector<at::Tensor> flat;
    std::vector<int64_t> send(n, 0), recv(n, 0);
    int64_t off = 0, max_extent = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (me == root) {
        flat.push_back(full.narrow(dim, off, extents[j]).reshape({-1}));
        send[j] = flat.back().numel();
      }
      off += extents[j];
      max_extent = std::max(max_extent, extents[j]);
    }
    recv[root] = my_numel;
    auto input = me == root ? at::cat(flat) : at::empty({0}, options);
    // Counted as the ProcessGroup scatter counts: the root's padded chunks.
    int64_t chunk = max_extent;
    for (size_t d = 0; d < full_shape.size(); ++d)
      if (static_cast<int64_t>(d) != dim) chunk *= full_shape[d];
    const int64_t bytes = me == root ? chunk * n * input.element_size() : 0;
    auto out = functional::wait(functional::all_to_all_single_start(input, recv, send, mesh, mesh_dim, "scatter", bytes));
    return out.view(my_shape).clone();
  }
  auto& pg = *mesh.group(mesh_dim);
  GilReleased no_gil; // see comm/wait.h
  // c10d scatter needs equal sizes: pad every chunk to the largest extent, trim after.
  int64_t max_extent = 0;
  for (auto e : extents) max_extent = std::max(max_extent, e);
  auto padded_shape = full_shape;
  padded_shape[dim] = max_extent;
  auto opts = me == root ? full.options() : options;
  const bool stage = needs_host_staging(pg, at::empty({0}, opts));
  auto host_opts = stage ? opts.device(at::kCPU) : opts;
  auto out = at::empty(padded_shape, host_opts);
  std::vector<at::Tensor> outputs{out};
  std::vector<std::vector<at::Tensor>> inputs;
  if (me == root) {
    std::vector<at::Tensor> chunks;
    int64_t off = 0;
    for (auto e : extents) {
      auto chunk = at::zeros(padded_shape, host_opts);
      chunk.narrow(dim, 0, e).copy_(full.narrow(dim, off, e));
      chunks.push_back(chunk);
      off += e;
    }
    inputs.push_back(chunks);
  }
  c10d::ScatterOptions so;
  so.rootRank = root;
  record_collective("scatter", me == root ? out.numel() * out.element_size() * n : 0);
  const auto rec = record_if_timed(IssuedCollective::Op::Scatter, "scatter", mesh, mesh_dim, out.options(), out.numel(),
                                   [&](IssuedCollective& c) { c.root = root; });
  wait_work(issue_bound("scatter", rec, [&] { return pg.scatter(outputs, inputs, so); }), "scatter", &mesh, mesh_dim);
  auto mine = out.narrow(dim, 0, extents[me]).clone();
  return stage ? mine.to(opts.device()) : mine;
}

at::Tensor mirror_ranks(const at::Tensor& local, at::IntArrayRef partner_shape, const Mesh& mesh, int64_t mesh_dim) {
  const auto n = mesh.size(mesh_dim);
  const auto me = mesh.coordinate(mesh_dim);
  if (n == 1) return local;
  // One all-to-all with a single non-empty split each way (the partner's shape comes from the layout).
  const auto partner = n - 1 - me;
  std::vector<at::Tensor> send;
  std::vector<int64_t> recv(n, 0);
  int64_t k = 1;
  for (auto s : partner_shape) k *= s;
  for (int64_t j = 0; j < n; ++j) send.push_back(j == partner ? local : local.new_empty({0}));
  recv[partner] = k;
  auto chunks = flat_all_to_all(send, recv, local.options(), mesh, mesh_dim);
  return chunks[partner].view(partner_shape).clone();
}

namespace {
constexpr const char* kRingPass = "ring send/recv";

// What the point-to-point posts of one exchange (a ring pass, a peer exchange) share: the works to wait, the buffers
// to keep alive until then, and the messages for the replay of comm/comm_timing.h (null while it is off).
struct PairPosts {
  c10d::ProcessGroup& pg;
  const char* kind;
  std::vector<c10::intrusive_ptr<c10d::Work>>& works;
  std::vector<at::Tensor>& keep_alive;
  std::vector<IssuedCollective::Message>* replay;
  shm::Channels* shm = nullptr;  // this group's shared-memory rings (comm/shm_transport.h), when it has them
};


// Posts this rank's side of one pair under `tag`: `out` to `to`, and a receive into `in` from `from`. `out` and `in`
// are wire tensors (contiguous, host-staged, real views); an undefined one posts nothing that way, unless
// `placeholder` (NCCL's coalesced groups: every rank posts every pair, collectives.h) sends or receives a
// one-element stand-in of `placeholder_opts` instead. Returns the buffer sent (undefined when nothing was).
at::Tensor post_pair(PairPosts& p, const at::Tensor& out, int to, const at::Tensor& in, int from, int tag,
                     bool placeholder, const at::TensorOptions& placeholder_opts) {
  at::Tensor buf;
  if (out.defined() || placeholder) {
    buf = out.defined() ? out : at::zeros({1}, placeholder_opts);
    p.keep_alive.push_back(buf);
    if (p.replay) p.replay->push_back({true, to, buf.numel(), tag, buf.scalar_type(), p.shm != nullptr});
    p.works.push_back(timed_issue(p.kind, [&] { return shm::post(p.shm, p.pg, buf, to, /*send=*/true, tag); }));
  }
  if (in.defined() || placeholder) {
    auto target = in.defined() ? in : at::empty({1}, placeholder_opts);
    p.keep_alive.push_back(target);
    if (p.replay) p.replay->push_back({false, from, target.numel(), tag, target.scalar_type(), p.shm != nullptr});
    p.works.push_back(timed_issue(p.kind, [&] { return shm::post(p.shm, p.pg, target, from, /*send=*/false, tag); }));
  }
  return buf;
}
} // namespace

RingExchange ring_pass_start(const std::vector<at::Tensor>& send, const std::vector<std::vector<int64_t>>& recv_shapes,
                             const Mesh& mesh, int64_t mesh_dim, int tag_base, bool backward) {
  TORCH_INTERNAL_ASSERT(send.size() == recv_shapes.size(), "ring_pass: one receive shape per sent tensor");
  RingExchange ex;
  const auto n = mesh.size(mesh_dim);
  if (n == 1) {
    ex.done_ = send;
    return ex;
  }
  const auto me = mesh.coordinate(mesh_dim);
  int next = static_cast<int>((me + 1) % n), prev = static_cast<int>((me - 1 + n) % n);
  if (backward) std::swap(next, prev);
  if (!send.empty() && use_functional(send[0])) {
    // Functional: one all-to-all per tensor with a single non-empty split each way (a permute), waited in wait().
    ex.functional_ = true;
    int64_t bytes = 0;
    for (size_t i = 0; i < send.size(); ++i) {
      const bool as_real = travels_as_real(send[i]);
      auto wire = (as_real ? real_view(send[i]) : send[i]).reshape({-1});
      int64_t recv_numel = as_real ? 2 : 1;
      for (auto v : recv_shapes[i]) recv_numel *= v;
      std::vector<int64_t> send_splits(n, 0), recv_splits(n, 0);
      send_splits[next] = wire.numel();
      recv_splits[prev] = recv_numel;
      ex.recv_.push_back(functional::all_to_all_single_start(wire, recv_splits, send_splits, mesh, mesh_dim, nullptr));
      ex.shapes_.push_back(recv_shapes[i]);
      ex.complex_.push_back(as_real);
      bytes += send[i].numel() * send[i].element_size();
    }
    record_collective("ring_pass", bytes, static_cast<int64_t>(send.size()));  // one ring step, as the ProcessGroup path counts it
    return ex;
  }
  auto& pg = *mesh.group(mesh_dim);
  GilReleased no_gil; // see comm/wait.h
  if (!send.empty()) {
    ex.device_ = send[0].device();
    ex.staged_ = needs_host_staging(pg, send[0]);
  }
  const bool coalesce = !ex.staged_ && ex.device_.is_cuda();
  if (coalesce) pg.startCoalescing(c10::DeviceType::CUDA);
  // On the coalesced (NCCL) path every rank posts one send and one receive per tensor in every step, an empty
  // block as a one-element placeholder: a rank whose blocks are all empty still joins the step (the first one
  // creates the communicator, collectively), and a pair's placeholder matches on both sides because every rank
  // knows every extent. Gloo skips empty blocks on both sides alike.
  int64_t bytes = 0, messages = 0;
  const bool timed = comm_timing_on();
  IssuedCollective replay;
  if (timed) replay.posted_s = steady_seconds();
  PairPosts posts{pg, kRingPass, ex.works_, ex.keep_alive_, timed ? &replay.messages : nullptr,
                  send.empty() ? nullptr : host_channels(pg, mesh, !coalesce && (ex.staged_ || ex.device_.is_cpu()))};
  for (size_t i = 0; i < send.size(); ++i) {
    auto opts = send[i].options().device(ex.staged_ ? c10::Device(c10::kCPU) : ex.device_);
    ex.recv_.push_back(at::empty(recv_shapes[i], opts));
    const int tag = tag_base + static_cast<int>(i);
    const auto out = send[i].numel() == 0 ? at::Tensor() : ex.staged_ ? send[i].cpu().contiguous() : send[i].contiguous();
    const auto in = ex.recv_.back().numel() > 0 ? ex.recv_.back() : at::Tensor();
    auto buf = post_pair(posts, out, next, in, prev, tag, coalesce, opts);
    if (buf.defined()) {
      bytes += send[i].numel() * buf.element_size();
      ++messages;
    }
  }
  if (coalesce) {
    auto w = pg.endCoalescing(c10::DeviceType::CUDA);
    ex.works_.clear();
    if (w) ex.works_.push_back(w);
  }
  if (timed) {
    const auto rec = record_if_timed(IssuedCollective::Op::PointToPoint, kRingPass, mesh, mesh_dim,
                                     at::TensorOptions().device(ex.staged_ ? c10::Device(c10::kCPU) : ex.device_), 0,
                                     [&](IssuedCollective& c) {
                                       c.messages = std::move(replay.messages);
                                       c.coalesced = coalesce;
                                       c.posted_s = replay.posted_s;
                                     });
    for (const auto& w : ex.works_) bind_work(w, rec);
  }
  record_collective("ring_pass", bytes, messages);
  return ex;
}

std::vector<at::Tensor> RingExchange::wait() {
  if (functional_) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < recv_.size(); ++i) {
      auto r = functional::wait(recv_[i]);
      out.push_back(complex_[i] ? at::view_as_complex(r.view({-1, 2})).view(shapes_[i]) : r.view(shapes_[i]));
    }
    recv_.clear();
    functional_ = false;
    return out;
  }
  for (auto& w : works_) wait_work(w, kRingPass);
  works_.clear();
  keep_alive_.clear();
  if (!done_.empty()) return std::move(done_);
  std::vector<at::Tensor> out;
  for (auto& r : recv_) out.push_back(staged_ && r.numel() > 0 ? r.to(device_) : r);
  recv_.clear();
  return out;
}

PeerExchange peer_exchange_start(const std::vector<at::Tensor>& send,
                                 const std::vector<std::vector<int64_t>>& recv_shapes, const at::Tensor& like,
                                 const Mesh& mesh, int64_t mesh_dim, const char* kind) {
  const auto opts = like.options();
  const auto n = mesh.size(mesh_dim);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(send.size()) == n && static_cast<int64_t>(recv_shapes.size()) == n,
                        "peer exchange: one piece and one receive shape per coordinate");
  PeerExchange ex;
  ex.shapes_ = recv_shapes;
  ex.device_ = opts.device();
  if (n == 1) return ex;  // nothing to a coordinate's self
  const auto me = mesh.coordinate(mesh_dim);
  auto numel = [](const std::vector<int64_t>& shape) {
    int64_t k = 1;
    for (auto v : shape) k *= v;
    return k;
  };
  const auto& probe = like;
  if (use_functional(probe)) {
    // No functional send/recv: one all-to-all whose splits are empty except between the pairs that move rows.
    std::vector<int64_t> recv_numels;
    int64_t messages = 0;
    for (int64_t j = 0; j < n; ++j) {
      recv_numels.push_back(numel(recv_shapes[j]));
      messages += j != me && send[j].numel() > 0;
    }
    ex.functional_ = start_flat_all_to_all(send, recv_numels, opts, mesh, mesh_dim, kind, messages);
    ex.use_functional_ = true;
    return ex;
  }
  auto& pg = *mesh.group(mesh_dim);
  RECORD_FUNCTION_WITH_SCOPE(at::RecordScope::USER_SCOPE, std::string("shardtensor::post ") + kind,
                             c10::ArrayRef<const c10::IValue>{});
  GilReleased no_gil; // see comm/wait.h
  ex.staged_ = needs_host_staging(pg, probe);
  const auto wire_opts = opts.device(ex.staged_ ? c10::Device(c10::kCPU) : ex.device_);
  const bool coalesce = !ex.staged_ && ex.device_.is_cuda();
  // Real views on the wire (NCCL has no complex type); one-element placeholders of that type.
  auto wire = [](const at::Tensor& t) { return travels_as_real(t) ? at::view_as_real(t) : t; };
  const auto placeholder_opts = travels_as_real(probe) ? wire_opts.dtype(c10::toRealValueType(probe.scalar_type()))
                                                       : wire_opts;
  const int64_t next = (me + 1) % n, prev = (me - 1 + n) % n;
  if (coalesce) pg.startCoalescing(c10::DeviceType::CUDA);
  int64_t bytes = 0, messages = 0;
  // Peers with nothing to send here (all but the neighbours, usually) share an empty receive of their shape: a
  // tensor op per peer would make a simulated rank's host work grow with P. (Shapes differ when a rank holds no
  // elements along another dim; the callers copy such pieces, so each keeps its shape.)
  std::vector<at::Tensor> nothing;
  const bool timed = comm_timing_on();
  std::vector<IssuedCollective::Message> replay;
  const double posted = timed ? steady_seconds() : 0;
  PairPosts posts{pg, kind, ex.works_, ex.keep_alive_, timed ? &replay : nullptr,
                  host_channels(pg, mesh, !coalesce && wire_opts.device().is_cpu())};
  for (int64_t j = 0; j < n; ++j) {
    if (numel(recv_shapes[j]) == 0) {
      auto same = std::find_if(nothing.begin(), nothing.end(),
                               [&](const at::Tensor& t) { return t.sizes() == at::IntArrayRef(recv_shapes[j]); });
      if (same == nothing.end()) same = nothing.insert(nothing.end(), at::empty(recv_shapes[j], wire_opts));
      ex.recv_.push_back(*same);
    } else {
      ex.recv_.push_back(at::empty(recv_shapes[j], wire_opts));
    }
    if (j == me) continue;
    // See collectives.h: on NCCL a ring neighbour gets a placeholder when there is nothing for it.
    const bool joins = coalesce && (j == next || j == prev);
    const auto peer = static_cast<int>(j);
    const auto out = send[j].numel() == 0 ? at::Tensor()
                     : ex.staged_        ? wire(send[j].cpu().contiguous())
                                         : wire(send[j].contiguous());
    const auto in = ex.recv_.back().numel() > 0 ? wire(ex.recv_.back()) : at::Tensor();
    auto buf = post_pair(posts, out, peer, in, peer, kPeerExchangeTag, joins, placeholder_opts);
    if (buf.defined()) {
      bytes += buf.numel() * buf.element_size();
      ++messages;
    }
  }
  if (coalesce) {
    auto w = pg.endCoalescing(c10::DeviceType::CUDA);
    ex.works_.clear();
    if (w) ex.works_.push_back(w);
  }
  if (timed) {
    const auto rec = record_if_timed(IssuedCollective::Op::PointToPoint, kind, mesh, mesh_dim, placeholder_opts, 0,
                                     [&](IssuedCollective& c) {
                                       c.messages = std::move(replay);
                                       c.coalesced = coalesce;
                                       c.posted_s = posted;
                                     });
    for (const auto& w : ex.works_) bind_work(w, rec);
  }
  record_collective(kind, bytes, messages);
  ex.kind_ = kind;
  return ex;
}

std::vector<at::Tensor> PeerExchange::wait() {
  std::vector<at::Tensor> out;
  if (use_functional_) {
    auto chunks = finish_all_to_all(functional_);
    use_functional_ = false;
    for (size_t j = 0; j < chunks.size(); ++j) out.push_back(chunks[j].view(shapes_[j]));
    return out;
  }
  for (auto& w : works_) wait_work(w, kind_);
  works_.clear();
  keep_alive_.clear();
  if (recv_.empty()) {  // a mesh dim of one coordinate: nothing arrives
    for (const auto& s : shapes_) out.push_back(at::empty(s, at::TensorOptions().device(device_)));
    return out;
  }
  for (auto& r : recv_) out.push_back(staged_ && r.numel() > 0 ? r.to(device_) : r);
  recv_.clear();
  return out;
}

std::vector<at::Tensor> ring_pass(const std::vector<at::Tensor>& send,
                                  const std::vector<std::vector<int64_t>>& recv_shapes, const Mesh& mesh,
                                  int64_t mesh_dim, bool backward) {
  return ring_pass_start(send, recv_shapes, mesh, mesh_dim, 0, backward).wait();
}

namespace {
// Small metadata: on a CUDA-only backend it must travel on the device.
at::Tensor metadata_tensor(const std::vector<int64_t>& values, c10d::ProcessGroup& pg) {
  auto local = at::tensor(values, at::TensorOptions().dtype(at::kLong));
  bool cuda = false;
  try {
    cuda = pg.getBackend(c10::DeviceType::CPU) == nullptr;
  } catch (const std::exception&) {
    cuda = true;
  }
  return cuda ? local.cuda() : local;
}
} // namespace

std::vector<int64_t> all_reduce_min_ints(const std::vector<int64_t>& values, const Mesh& mesh) {
  if (tracing(at::Tensor())) refuse_host_read_while_tracing("the agreement check (from_local/distribute_tensor with check=True)");
  HostMetadataGuard host; // see comm/host_metadata.h
  std::vector<int64_t> out = values;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (mesh.size(m) == 1) continue;
    auto& pg = *mesh.group(m);
    GilReleased no_gil; // see comm/wait.h
    std::vector<at::Tensor> ts{metadata_tensor(out, pg)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MIN;
    record_collective("all_reduce", ts[0].numel() * ts[0].element_size());
    const auto rec = record_if_timed(IssuedCollective::Op::AllReduce, "all_reduce (agreement check)", mesh, m,
                                     ts[0].options(), ts[0].numel(), [&](IssuedCollective& c) { c.reduce = opts.reduceOp; });
    wait_work(issue_all_reduce(pg, mesh, ts[0], opts, "all_reduce (agreement check)", rec),
              "all_reduce (agreement check)", &mesh, m);
    auto c = ts[0].cpu();
    out.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  return out;
}

std::vector<std::vector<int64_t>> all_gather_ints(const std::vector<int64_t>& values, const Mesh& mesh,
                                                  int64_t mesh_dim, const char* what) {
  const auto n = mesh.size(mesh_dim);
  if (n == 1) return {values};
  if (tracing(at::Tensor())) refuse_host_read_while_tracing("an exchange of extents or shapes (from_local(\"infer\"), a flip's shapes)");
  // Under the fake process group every slot would hold this rank's own values: a wrong answer, not a garbage one.
  TORCH_CHECK_NOT_IMPLEMENTED(!simulating(), what, ": needs the values of other ranks (an all-gather of ",
                              values.size(), " ints along mesh dim ", mesh_dim,
                              "), which a simulation (shardtensor.simulate) does not have: its process group would "
                              "return this rank's own values for every rank (docs/simulation.md lists what works)");
  HostMetadataGuard host; // see comm/host_metadata.h
  auto& pg = *mesh.group(mesh_dim);
  GilReleased no_gil; // see comm/wait.h
  at::Tensor in = metadata_tensor(values, pg);
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < n; ++i) outs.push_back(at::empty_like(in));
  std::vector<std::vector<at::Tensor>> out_lists{outs};
  std::vector<at::Tensor> in_list{in};
  record_collective("all_gather", in.numel() * in.element_size() * n);
  const auto rec = record_if_timed(IssuedCollective::Op::AllGather, "all_gather (metadata)", mesh, mesh_dim,
                                   in.options(), in.numel());
  wait_work(issue_bound("all_gather (metadata)", rec, [&] { return pg.allgather(out_lists, in_list); }),
            "all_gather (metadata)", &mesh, mesh_dim);
  std::vector<std::vector<int64_t>> result;
  for (auto& t : out_lists[0]) {
    auto c = t.cpu();
    result.emplace_back(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  return result;
}

} // namespace shardtensor::comm
