#include "comm/functional.h"

#include "comm/comm_stats.h"
#include "comm/wait.h"

#include <shardtensor/simulation.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace shardtensor::comm {

namespace {

CommBackend initial_backend() {
  const char* v = std::getenv("SHARDTENSOR_COMM_BACKEND");
  return v && std::strcmp(v, "functional") == 0 ? CommBackend::functional : CommBackend::process_group;
}

std::atomic<CommBackend>& backend_setting() {
  static std::atomic<CommBackend> b{initial_backend()};
  return b;
}

c10::OperatorHandle functional_op(const char* name) {
  // Looked up on first use: the _c10d_functional library registers with torch's distributed module.
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor call(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  GilReleased no_gil; // eager: the op issues (and wait_tensor waits on) c10d work; see comm/wait.h
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return "sum";  // avg: a sum, divided here (Gloo has no avg)
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "sum";
}

} // namespace

bool tracing(const at::Tensor& t) {
  // The tracers' infra modes (fake tensors, proxy tracing, functionalization); a user's own dispatch mode (a FLOP
  // counter, a debug mode) runs eagerly and keeps the ProcessGroup path.
  using c10::impl::TorchDispatchModeKey;
  using c10::impl::TorchDispatchModeTLS;
  for (auto key : {TorchDispatchModeKey::FAKE, TorchDispatchModeKey::PROXY, TorchDispatchModeKey::FUNCTIONAL})
    if (TorchDispatchModeTLS::get_mode(key).has_value()) return true;
  if (!t.defined()) return false;
  const auto ks = t.key_set();
  return ks.has(c10::DispatchKey::Python) || ks.has(c10::DispatchKey::Functionalize);
}

bool use_functional(const at::Tensor& t) {
  if (backend_setting().load() == CommBackend::functional) return true;
  // A meta simulation's fake locals are not a trace: it measures the eager ProcessGroup path (over the fake group).
  return !simulating() && tracing(t);
}

void refuse_host_read_while_tracing(const char* what) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "ShardTensor: ", what,
                              " reads communicated values on the host, which a traced graph cannot do (torch.compile, "
                              "make_fx). Give the layout explicitly instead: from_local(..., sharding_shapes={mesh_dim: "
                              "[extents]}) or sharding_shapes=\"even\" with check=False, or build the ShardTensor "
                              "before the compiled region");
}

at::Tensor plan_constant(const at::Tensor& host, const at::Tensor& like) {
  auto t = host;
  if (tracing(like)) t = at::lift_fresh(host);
  return t.device() == like.device() ? t : t.to(like.device());
}

namespace functional {

const std::string& group_name(const Mesh& mesh, int64_t mesh_dim) {
  const auto& name = mesh.group(mesh_dim)->getGroupName();
  TORCH_CHECK_VALUE(!name.empty(), "ShardTensor: mesh dim ", mesh_dim,
                    "'s process group has no registered name; functional collectives resolve groups by name (groups "
                    "from torch.distributed and shardtensor::init_device_mesh have one)");
  return name;
}

namespace {
thread_local std::vector<at::Tensor> traced_receives;
thread_local std::vector<at::Tensor> anchor_inputs;  // the running rule's inputs (see set_trace_anchor)
thread_local at::Tensor anchor_zero;                 // their zero, computed at the rule's first collective

thread_local int64_t anchored_count = 0;

// `t` + 0, the zero depending on the running rule's inputs (see set_trace_anchor): a sum over an empty slice of each,
// no data read. Scaled by a count unique to this collective, so no two collectives' inputs are the same expression:
// AOTAutograd's common subexpression elimination would otherwise merge two identical collectives on a rank where
// their inputs coincide (two empty pieces) and not on the others.
at::Tensor anchored(const at::Tensor& t) {
  if (anchor_inputs.empty() || !tracing(t)) return t;
  if (!anchor_zero.defined()) {
    at::NoGradGuard no_grad; // a data dependency only, never a gradient path
    for (const auto& x : anchor_inputs) {
      auto empty = x.reshape({-1}).narrow(0, 0, 0);
      auto term = (empty.is_complex() ? at::view_as_real(empty) : empty).sum(at::kFloat);
      anchor_zero = anchor_zero.defined() ? anchor_zero + term : term;
    }
  }
  return t + anchor_zero.mul(static_cast<double>(++anchored_count)).to(t.scalar_type());
}
} // namespace

std::vector<at::Tensor> set_trace_anchor(std::vector<at::Tensor> inputs) {
  anchor_zero = at::Tensor();
  return std::exchange(anchor_inputs, std::move(inputs));
}

at::Tensor wait(const at::Tensor& t) {
  static const auto op = functional_op("_c10d_functional::wait_tensor");
  auto r = call(op, {t});
  if (tracing(r)) traced_receives.push_back(r);
  return r;
}

std::vector<at::Tensor> take_traced_receives() {
  return std::exchange(traced_receives, {});
}

at::Tensor all_reduce_start(const at::Tensor& t, ReduceOp op, const Mesh& mesh, int64_t mesh_dim) {
  static const auto h = functional_op("_c10d_functional::all_reduce");
  auto in = anchored(t).contiguous();
  record_collective("all_reduce", in.numel() * in.element_size());
  return call(h, {in, std::string(op_name(op)), group_name(mesh, mesh_dim)});
}

at::Tensor all_reduce(const at::Tensor& t, ReduceOp op, const Mesh& mesh, int64_t mesh_dim) {
  return wait(all_reduce_start(t, op, mesh, mesh_dim));
}

at::Tensor all_to_all_single_start(const at::Tensor& input, const std::vector<int64_t>& recv_splits,
                                   const std::vector<int64_t>& send_splits, const Mesh& mesh, int64_t mesh_dim,
                                   const char* kind, int64_t bytes) {
  static const auto h = functional_op("_c10d_functional::all_to_all_single");
  if (kind && bytes < 0) {
    const auto me = mesh.coordinate(mesh_dim);
    int64_t sent = 0;
    for (size_t j = 0; j < send_splits.size(); ++j)
      if (static_cast<int64_t>(j) != me) sent += send_splits[j];
    bytes = sent * input.element_size();
  }
  if (kind) record_collective(kind, bytes);
  return call(h, {anchored(input).contiguous(), recv_splits, send_splits, group_name(mesh, mesh_dim)});
}

at::Tensor all_gather_v(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents, const Mesh& mesh,
                        int64_t mesh_dim) {
  static const auto h = functional_op("_c10d_functional::all_gather_into_tensor");
  const auto n = mesh.size(mesh_dim);
  int64_t max_extent = 0;
  bool even = true;
  for (auto e : extents) {
    max_extent = std::max(max_extent, e);
    even = even && e == extents[0];
  }
  // all_gather_into_tensor stacks equal pieces along dim 0: pad `dim` to the largest extent, move it first.
  auto input = local;
  if (!even && local.size(dim) != max_extent) {
    auto pad_shape = local.sizes().vec();
    pad_shape[dim] = max_extent - local.size(dim);
    input = at::cat({local, at::zeros(pad_shape, local.options())}, dim);
  }
  auto first = anchored(input).movedim(dim, 0).contiguous();
  record_collective("all_gather", first.numel() * first.element_size() * n);
  auto gathered = wait(call(h, {first, n, group_name(mesh, mesh_dim)}));
  std::vector<at::Tensor> pieces;
  for (int64_t i = 0; i < n; ++i) {
    auto piece = gathered.narrow(0, i * max_extent, max_extent);
    pieces.push_back(even ? piece : piece.narrow(0, 0, extents[i]));
  }
  return at::cat(pieces, 0).movedim(0, dim);
}

at::Tensor broadcast(const at::Tensor& t, int64_t root, const Mesh& mesh, int64_t mesh_dim) {
  static const auto h = functional_op("_c10d_functional::broadcast");
  auto in = anchored(t).contiguous();
  record_collective("broadcast", in.numel() * in.element_size());
  return wait(call(h, {in, root, group_name(mesh, mesh_dim)}));
}

} // namespace functional
} // namespace shardtensor::comm

namespace shardtensor {

CommBackend set_comm_backend(CommBackend backend) {
  return comm::backend_setting().exchange(backend);
}

CommBackend comm_backend() {
  return comm::backend_setting().load();
}

} // namespace shardtensor
