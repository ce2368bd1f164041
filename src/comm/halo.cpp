#include "comm/halo.h"

#include "comm/halo_plan.h"

#include <ATen/ATen.h>

#ifdef SHARDTENSOR_HAVE_CUDA
#include "halo_pack.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace shardtensor::comm {

namespace {

#ifdef SHARDTENSOR_HAVE_CUDA
std::vector<int64_t> shape_with(at::IntArrayRef shape, int64_t dim, int64_t n) {
  auto s = shape.vec();
  s[dim] = n;
  return s;
}

// [outer, dim, inner] factorization of a shape around `dim`.
std::pair<int64_t, int64_t> outer_inner(at::IntArrayRef shape, int64_t dim) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) (d < dim ? outer : inner) *= d == dim ? 1 : shape[d];
  return {outer, inner};
}
#endif

} // namespace

at::Tensor pack_rows(const at::Tensor& t, int64_t dim, const at::Tensor& index) {
  if (index.numel() == 0) return t.narrow(dim, 0, 0);
#ifdef SHARDTENSOR_HAVE_CUDA
  // The kernel reads a contiguous [outer, dim, inner] block; a strided shard (channels-last, a transposed view)
  // goes through index_select, which reads its strides, instead of copying the whole shard to pack a few rows.
  if (t.is_cuda() && t.is_contiguous()) {
    c10::cuda::CUDAGuard guard(t.device());
    const auto& src = t;
    auto idx = index.device() == src.device() ? index : index.to(src.device());
    auto out = at::empty(shape_with(src.sizes(), dim, idx.numel()), src.options());
    auto [outer, inner] = outer_inner(src.sizes(), dim);
    cuda::pack_rows(src.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>(), idx.numel(), outer, src.size(dim), inner,
                    static_cast<int64_t>(src.element_size()),
                    c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
    return out;
  }
#endif
  return t.index_select(dim, index);
}

void add_rows_into(at::Tensor& out, int64_t dim, const at::Tensor& index, const at::Tensor& piece) {
#ifdef SHARDTENSOR_HAVE_CUDA
  if (out.is_cuda() && out.is_contiguous() &&
      (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble)) {
    c10::cuda::CUDAGuard guard(out.device());
    auto src = piece.contiguous().to(out.scalar_type());
    auto idx = index.device() == out.device() ? index : index.to(out.device());
    auto [outer, inner] = outer_inner(out.sizes(), dim);
    cuda::add_rows(src.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>(), idx.numel(), outer, out.size(dim), inner,
                   out.scalar_type() == at::kDouble, c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
    return;
  }
#endif
  out.index_add_(dim, index, piece);
}

at::Tensor gather_rows(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                       const RowRequests& want, const Mesh& mesh, int64_t mesh_dim, double fill) {
  HaloPlan plan({HaloDim{dim, mesh_dim, extents, want}}, mesh.coordinates(), local.device(), fill);
  return plan.gather(local, mesh);
}

at::Tensor scatter_add_rows(const at::Tensor& window, int64_t dim, const std::vector<int64_t>& extents,
                            const RowRequests& want, const Mesh& mesh, int64_t mesh_dim) {
  HaloPlan plan({HaloDim{dim, mesh_dim, extents, want}}, mesh.coordinates(), window.device());
  return plan.scatter_add(window, mesh);
}

} // namespace shardtensor::comm
