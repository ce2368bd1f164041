// A peer exchange with its reverse as the backward (comm/peer_exchange_fn.h).
#include "comm/peer_exchange_fn.h"

#include "comm/collectives.h"
#include "comm/shape_lists.h"
#include "comm/spec_holder.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace shardtensor::comm {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The exchange with fresh tensors for every coordinate: the transport shares one empty receive among peers that
// send nothing, and outputs of a custom Function must be distinct tensors that alias no input.
std::vector<at::Tensor> exchange(const std::vector<at::Tensor>& send, const std::vector<std::vector<int64_t>>& shapes,
                                 const at::Tensor& like, const Mesh& mesh, int64_t mesh_dim) {
  std::vector<at::Tensor> got;
  if (mesh.size(mesh_dim) > 1) got = peer_exchange_start(send, shapes, like, mesh, mesh_dim, "halo").wait();
  std::vector<at::Tensor> out;
  for (size_t j = 0; j < shapes.size(); ++j) {
    const bool arrived = j < got.size() && got[j].numel() > 0;
    out.push_back(arrived ? got[j] : at::empty(shapes[j], like.options()));
  }
  return out;
}

struct PeerExchangeFn : torch::autograd::Function<PeerExchangeFn> {
  static variable_list forward(AutogradContext* ctx, at::TensorList send, const at::Tensor& like, MeshPtr mesh,
                               int64_t mesh_dim, std::vector<std::vector<int64_t>> recv_shapes) {
    ctx->set_materialize_grads(true);
    at::NoGradGuard no_grad;
    std::vector<std::vector<int64_t>> send_shapes;
    for (const auto& t : send) send_shapes.push_back(t.sizes().vec());
    ctx->saved_data["mesh"] = mesh_ivalue(mesh);
    ctx->saved_data["mesh_dim"] = mesh_dim;
    ctx->saved_data["send_shapes"] = flatten_shapes(send_shapes);
    return exchange({send.begin(), send.end()}, recv_shapes, like, *mesh, mesh_dim);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto mesh = mesh_from_ivalue(ctx->saved_data["mesh"]);
    const auto mesh_dim = ctx->saved_data["mesh_dim"].toInt();
    const auto send_shapes = unflatten_shapes(ctx->saved_data["send_shapes"].toIntVector());
    // The gradients (materialized: one per coordinate) have the received pieces' dtype and device, like the
    // forward's `like`; nothing of the forward is kept for the backward but shapes.
    const auto me = static_cast<size_t>(mesh->coordinate(mesh_dim));
    std::vector<at::Tensor> g;
    for (size_t j = 0; j < grads.size(); ++j) g.push_back(j == me ? grads[j].new_empty({0}) : grads[j]);
    auto back = exchange(g, send_shapes, grads[me], *mesh, mesh_dim);
    variable_list out(back.begin(), back.end());
    out.resize(back.size() + 4);  // like, mesh, mesh_dim, recv_shapes
    return out;
  }
};

} // namespace

std::vector<at::Tensor> differentiable_peer_exchange(const std::vector<at::Tensor>& send,
                                                     const std::vector<std::vector<int64_t>>& recv_shapes,
                                                     const at::Tensor& like, const MeshPtr& mesh, int64_t mesh_dim) {
  TORCH_INTERNAL_ASSERT(mesh != nullptr && static_cast<int64_t>(send.size()) == mesh->size(mesh_dim) &&
                            send.size() == recv_shapes.size(),
                        "peer exchange: one piece and one receive shape per coordinate");
  return PeerExchangeFn::apply(at::TensorList(send), like.detach(), mesh, mesh_dim, recv_shapes);
}

} // namespace shardtensor::comm
