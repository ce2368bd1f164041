// The public ring pass (include/shardtensor/ring.h): comm::ring_pass on plain tensors, differentiable by the
// reverse ring.
#include <shardtensor/ring.h>
#include <shardtensor/shard_tensor.h>

#include "comm/collectives.h"
#include "comm/spec_holder.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace shardtensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<std::vector<int64_t>> shapes_of(at::TensorList ts) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& t : ts) out.push_back(t.sizes().vec());
  return out;
}

// Shapes saved as one int list: ndim, sizes..., ndim, sizes...
std::vector<int64_t> flatten_shapes(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<int64_t> flat;
  for (const auto& s : shapes) {
    flat.push_back(static_cast<int64_t>(s.size()));
    flat.insert(flat.end(), s.begin(), s.end());
  }
  return flat;
}

std::vector<std::vector<int64_t>> unflatten_shapes(const std::vector<int64_t>& flat) {
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < flat.size();) {
    const auto n = static_cast<size_t>(flat[i++]);
    out.emplace_back(flat.begin() + i, flat.begin() + i + n);
    i += n;
  }
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

} // namespace

std::vector<at::Tensor> ring_pass(const std::vector<at::Tensor>& tensors, const MeshPtr& mesh, int64_t mesh_dim,
                                  const std::vector<std::vector<int64_t>>& recv_shapes, RingDirection direction) {
  TORCH_CHECK_VALUE(mesh != nullptr, "ring_pass: mesh is null");
  if (mesh_dim < 0) mesh_dim += mesh->ndim();
  TORCH_CHECK_VALUE(mesh_dim >= 0 && mesh_dim < mesh->ndim(), "ring_pass: mesh_dim ", mesh_dim,
                    " is out of range for a ", mesh->ndim(), "-d mesh");
  TORCH_CHECK_VALUE(recv_shapes.empty() || recv_shapes.size() == tensors.size(), "ring_pass: ", recv_shapes.size(),
                    " receive shapes for ", tensors.size(), " tensors; give one per tensor (or none: same shapes)");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].defined(), "ring_pass: tensor ", i, " is undefined");
    TORCH_CHECK_VALUE(!is_shard_tensor(tensors[i]), "ring_pass: tensor ", i,
                      " is a ShardTensor; ring_pass moves plain local tensors: pass its to_local()");
    TORCH_CHECK_VALUE(i == 0 || tensors[i].device() == tensors[0].device(), "ring_pass: tensor ", i, " is on ",
                      tensors[i].device(), ", tensor 0 on ", tensors[0].device(), "; pass tensors on one device");
  }
  auto shapes = recv_shapes.empty() ? shapes_of(tensors) : recv_shapes;
  for (size_t i = 0; i < shapes.size(); ++i)
    for (auto s : shapes[i])
      TORCH_CHECK_VALUE(s >= 0, "ring_pass: receive shape ", i, " has a negative size ", c10::IntArrayRef(shapes[i]));
  if (tensors.empty()) return {};
  return RingPassFn::apply(at::TensorList(tensors), mesh, mesh_dim, std::move(shapes),
                           direction == RingDirection::Backward);
}

} // namespace shardtensor
