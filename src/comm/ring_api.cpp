// The public ring pass (include/shardtensor/ring.h): comm::ring_pass on plain tensors, differentiable by the
// reverse ring.
#include <shardtensor/ring.h>
#include <shardtensor/shard_tensor.h>

#include "comm/agreement.h"
#include "comm/collectives.h"
#include "comm/functional.h"
#include "comm/shape_lists.h"
#include "comm/spec_holder.h"

#include <ATen/ATen.h>
#include <shardtensor/simulation.h>
#include <torch/autograd.h>

#include <sstream>

namespace shardtensor {

namespace {

using comm::flatten_shapes;
using comm::unflatten_shapes;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<std::vector<int64_t>> shapes_of(at::TensorList ts) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& t : ts) out.push_back(t.sizes().vec());
  return out;
}

struct RingPassFn : torch::autograd::Function<RingPassFn> {
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors, MeshPtr mesh, int64_t mesh_dim,
                               std::vector<std::vector<int64_t>> recv_shapes, bool backward_dir) {
    // Every received gradient is sent back, zeros where a rank has none, so the backward ring is issued alike on
    // every rank.
    ctx->set_materialize_grads(true);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> send(tensors.begin(), tensors.end());
    auto out = comm::ring_pass(send, recv_shapes, *mesh, mesh_dim, backward_dir);
    // A size-1 dim hands the inputs back; outputs of a custom Function must not alias its inputs.
    for (size_t i = 0; i < out.size(); ++i)
      if (out[i].is_same(send[i])) out[i] = send[i].clone();
    ctx->saved_data["mesh"] = mesh_ivalue(mesh);
    ctx->saved_data["mesh_dim"] = mesh_dim;
    ctx->saved_data["backward_dir"] = backward_dir;
    ctx->saved_data["send_shapes"] = flatten_shapes(shapes_of(tensors));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto mesh = mesh_from_ivalue(ctx->saved_data["mesh"]);
    const auto mesh_dim = ctx->saved_data["mesh_dim"].toInt();
    const bool backward_dir = ctx->saved_data["backward_dir"].toBool();
    const auto send_shapes = unflatten_shapes(ctx->saved_data["send_shapes"].toIntVector());
    std::vector<at::Tensor> g(grads.begin(), grads.end());
    // The gradient of what this rank received goes back to its sender: the ring the other way round.
    auto back = comm::ring_pass(g, send_shapes, *mesh, mesh_dim, !backward_dir);
    variable_list out(back.begin(), back.end());
    out.resize(back.size() + 4);  // mesh, mesh_dim, recv_shapes, direction
    return out;
  }
};

// What every rank of the ring says about its call before any data moves: one fixed-size all-gather of these
// fields along the ring's mesh dim (so ranks that disagree cannot mismatch inside the exchange itself).
enum HeaderField : size_t {
  kStatus,        // 0, or the ArgProblem this rank found in its own arguments
  kCount,         // number of tensors
  kDirection,     // 0 forward, 1 backward
  kDtypes,        // digest of the tensors' dtypes and device types
  kSendLen,       // length of the flattened send shapes
  kSendDigest,    // digest of the send shapes
  kRecvGiven,     // 1 when recv_shapes were given
  kRecvDigest,    // digest of the given recv shapes
  kRecvLen,       // length of the flattened recv shapes (0 when none were given)
  kHeaderSize,
};

enum ArgProblem : int64_t {
  kOk = 0,
  kShapeCount = 1,
  kUndefined = 2,
  kShardTensor = 3,
  kDevices = 4,
  kNegative = 5,
};

const char* problem_text(int64_t p) {
  switch (p) {
    case kShapeCount: return "gave a number of receive shapes different from the number of tensors (give one per tensor, or none)";
    case kUndefined: return "passed an undefined tensor";
    case kShardTensor: return "passed a ShardTensor (ring_pass moves plain local tensors: pass its to_local())";
    case kDevices: return "passed tensors on different devices (pass tensors on one device)";
    case kNegative: return "gave a receive shape with a negative size";
  }
  return "passed invalid arguments";
}

std::string shapes_str(const std::vector<std::vector<int64_t>>& shapes) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shapes.size(); ++i) os << (i ? ", " : "") << c10::IntArrayRef(shapes[i]);
  os << "]";
  return os.str();
}

int64_t dtype_digest(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> v;
  for (const auto& t : tensors) {
    v.push_back(t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1);
    v.push_back(t.defined() ? static_cast<int64_t>(t.device().type()) : -1);
  }
  return comm::digest(v);
}

// The receive shapes every rank of the ring agreed on: each rank's given shapes are checked against what its
// sender sends (the same verdict on every rank, which sees every header), and a rank that gave none takes its
// sender's shapes. A problem raises ValueError on every rank of the ring before any data moves.
std::vector<std::vector<int64_t>> agreed_recv_shapes(const std::vector<at::Tensor>& tensors, const Mesh& mesh,
                                                     int64_t mesh_dim, const std::vector<std::vector<int64_t>>& recv_shapes,
                                                     bool backward_dir, int64_t problem) {
  const auto send = shapes_of(tensors);
  const auto flat_send = flatten_shapes(send);
  std::vector<int64_t> header(kHeaderSize, 0);
  header[kStatus] = problem;
  header[kCount] = static_cast<int64_t>(tensors.size());
  header[kDirection] = backward_dir;
  header[kDtypes] = dtype_digest(tensors);
  header[kSendLen] = static_cast<int64_t>(flat_send.size());
  header[kSendDigest] = comm::digest(flat_send);
  header[kRecvGiven] = !recv_shapes.empty();
  const auto flat_recv = flatten_shapes(recv_shapes);
  header[kRecvDigest] = recv_shapes.empty() ? -1 : comm::digest(flat_recv);
  header[kRecvLen] = static_cast<int64_t>(flat_recv.size());
  const auto all = comm::all_gather_ints(header, mesh, mesh_dim, "ring_pass (agreeing on the shapes)");
  const auto n = static_cast<int64_t>(all.size());
  const auto where = c10::str("ring_pass along mesh dim ", mesh_dim, " (", n, " ranks)");
  for (int64_t c = 0; c < n; ++c)
    TORCH_CHECK_VALUE(all[c][kStatus] == kOk, where, ": the rank at coordinate ", c, " ",
                      problem_text(all[c][kStatus]), "; no data was moved");
  for (auto [field, name] : {std::pair<size_t, const char*>{kCount, "the number of tensors"},
                             {kDirection, "the direction"},
                             {kDtypes, "the tensors' dtypes and devices"}}) {
    for (int64_t c = 1; c < n; ++c)
      TORCH_CHECK_VALUE(all[c][field] == all[0][field], where, ": ranks disagree on ", name,
                        " (coordinates 0 and ", c, " differ); every rank of the ring must pass as many tensors, of "
                        "the same dtypes, in the same direction");
  }
  // The coordinate whose tensors coordinate c receives.
  auto sender = [&](int64_t c) { return backward_dir ? (c + 1) % n : (c - 1 + n) % n; };
  bool all_given = true, consistent = true;
  for (int64_t c = 0; c < n; ++c) {
    if (!all[c][kRecvGiven]) all_given = false;
    else if (all[c][kRecvDigest] != all[sender(c)][kSendDigest]) consistent = false;
  }
  const auto me = mesh.coordinate(mesh_dim);
  if (all_given && consistent) return recv_shapes;
  // Some rank needs its sender's shapes, or given shapes differ from them: every rank learns every rank's send
  // and given receive shapes (each padded to the longest, so the exchange has one size everywhere).
  int64_t longest_send = 0, longest_recv = 0;
  for (const auto& h : all) {
    longest_send = std::max(longest_send, h[kSendLen]);
    longest_recv = std::max(longest_recv, h[kRecvLen]);
  }
  auto padded = flat_send;
  padded.resize(static_cast<size_t>(longest_send), 0);
  padded.insert(padded.end(), flat_recv.begin(), flat_recv.end());
  padded.resize(static_cast<size_t>(longest_send + longest_recv), 0);
  const auto flats = comm::all_gather_ints(padded, mesh, mesh_dim, "ring_pass (agreeing on the shapes)");
  auto send_of = [&](int64_t c) {
    return unflatten_shapes({flats[c].begin(), flats[c].begin() + all[c][kSendLen]});
  };
  auto recv_of = [&](int64_t c) {
    return unflatten_shapes({flats[c].begin() + longest_send, flats[c].begin() + longest_send + all[c][kRecvLen]});
  };
  for (int64_t c = 0; c < n; ++c) {
    if (!all[c][kRecvGiven] || all[c][kRecvDigest] == all[sender(c)][kSendDigest]) continue;
    TORCH_CHECK_VALUE(false, where, ": the rank at coordinate ", c, " expects to receive shapes ",
                      shapes_str(recv_of(c)), " but coordinate ", sender(c), " sends ", shapes_str(send_of(sender(c))),
                      "; pass recv_shapes equal to the sender's shapes, or leave them out (they are then taken from "
                      "the sender); no data was moved");
  }
  return recv_shapes.empty() ? send_of(sender(me)) : recv_shapes;
}

} // namespace

std::vector<at::Tensor> ring_pass(const std::vector<at::Tensor>& tensors, const MeshPtr& mesh, int64_t mesh_dim,
                                  const std::vector<std::vector<int64_t>>& recv_shapes, RingDirection direction) {
  TORCH_CHECK_VALUE(mesh != nullptr, "ring_pass: mesh is null");
  if (mesh_dim < 0) mesh_dim += mesh->ndim();
  TORCH_CHECK_VALUE(mesh_dim >= 0 && mesh_dim < mesh->ndim(), "ring_pass: mesh_dim ", mesh_dim,
                    " is out of range for a ", mesh->ndim(), "-d mesh");
  // Problems with this rank's own arguments travel in the shape agreement, so every rank raises them.
  int64_t problem = kOk;
  if (!recv_shapes.empty() && recv_shapes.size() != tensors.size()) problem = kShapeCount;
  for (size_t i = 0; i < tensors.size() && problem == kOk; ++i) {
    if (!tensors[i].defined()) problem = kUndefined;
    else if (is_shard_tensor(tensors[i])) problem = kShardTensor;
    else if (tensors[i].device() != tensors[0].device()) problem = kDevices;
  }
  for (const auto& shape : recv_shapes)
    for (auto s : shape)
      if (s < 0 && problem == kOk) problem = kNegative;
  const bool backward_dir = direction == RingDirection::Backward;
  std::vector<std::vector<int64_t>> shapes;
  if (simulating() || comm::tracing(at::Tensor())) {
    // Nothing can be learned from other ranks here (a simulation's process group moves no data; a traced graph
    // cannot read host values): the shapes are the given ones, else this rank's own.
    TORCH_CHECK_VALUE(problem == kOk, "ring_pass: this rank ", problem_text(problem));
    shapes = recv_shapes.empty() ? shapes_of(tensors) : recv_shapes;
  } else {
    shapes = agreed_recv_shapes(tensors, *mesh, mesh_dim, recv_shapes, backward_dir, problem);
  }
  if (tensors.empty()) return {};
  return RingPassFn::apply(at::TensorList(tensors), mesh, mesh_dim, std::move(shapes), backward_dir);
}

} // namespace shardtensor
