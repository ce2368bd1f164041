// The library's start-up, in one translation unit so its order is fixed: first the `shardtensor::` operator
// schemas and classes (every custom op of the project is declared here; its CPU/CUDA/Meta/Autograd kernels live
// beside their code in src/ops), then the installer, which installs the built-in rule families (src/ops/*:
// SHARDTENSOR_RULE_FAMILY, dispatch/rule_family.h) and binds every remaining operator to the ShardTensor dispatch
// keys. Static objects of one translation unit are constructed in order, so every schema exists when a rule is
// registered for it.
#include "comm/spec_holder.h"
#include "dispatch/promote.h"
#include "dispatch/registry.h"
#include "dispatch/rule_family.h"

#include <torch/library.h>

TORCH_LIBRARY(shardtensor, m) {
  // The differentiable API keeps specs and meshes in autograd contexts (comm/api.cpp, comm/ring_api.cpp).
  m.class_<shardtensor::SpecHolder>("_SpecHolder");
  m.class_<shardtensor::MeshHolder>("_MeshHolder");  // the ring pass's context (comm/ring_api.cpp)

  // Plain tensors meeting ShardTensors inside torch.func transforms (src/dispatch/promote.cpp): plain -> Replicate,
  // and a ShardTensor's whole value as a plain tensor (the promotion's backward, st.full_tensor there; each the
  // other's backward); the mesh beneath functorch's wrappers.
  m.def("promote_plain(Tensor plain, __torch__.torch.classes.shardtensor._MeshHolder mesh) -> Tensor");
  m.def("full_plain(Tensor shard) -> Tensor");
  m.def("mesh_of(Tensor shard) -> __torch__.torch.classes.shardtensor._MeshHolder");

  // Point search (src/ops/point_search*.cpp, python/shardtensor/ops).
  m.def("knn(Tensor points, Tensor queries, int k) -> (Tensor indices, Tensor distances)");
  m.def("radius_search(Tensor points, Tensor queries, float radius, int max_neighbors) -> (Tensor indices, Tensor "
        "distances)");

  // Neighbourhood attention (src/ops/neighborhood_attention.cpp): the op, and the forward/backward kernels its
  // sharded rule calls on local tensors.
  m.def("neighborhood_attention(Tensor query, Tensor key, Tensor value, int[] kernel_size, int[]? dilation=None, "
        "float? scale=None) -> Tensor");
  m.def("neighborhood_attention_forward(Tensor query, Tensor key, Tensor value, int[] kernel_size, int[] dilation, "
        "int[] query_offset, int[] key_offset, int[] extent, float scale) -> (Tensor out, Tensor lse)");
  m.def("neighborhood_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
        "Tensor lse, int[] kernel_size, int[] dilation, int[] query_offset, int[] key_offset, int[] extent, "
        "float scale) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
}

namespace shardtensor {
namespace {

// Runs when the library loads (on `import shardtensor`, or when a C++ program linking it starts); every aten op
// is registered by then (libtorch loads first) and the schemas above exist.
// The rules first: an op whose rule runs above autograd is bound there once, before the blanket binding of every
// remaining aten op below autograd (which skips ops bound already).
struct Installer {
  Installer() {
    dispatch::register_transform_promotion_kernels();
    dispatch::install_rule_families();
    dispatch::install_dispatch();
  }
} installer;

} // namespace
} // namespace shardtensor
