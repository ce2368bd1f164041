// The exact neighbour search on local tensors. CPU: one task per query (at::parallel_for), a bounded max-heap of
// (squared distance, index) pairs. CUDA tensors go to csrc_cuda/point_search.cu.
#include "ops/point_search_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>

#ifdef SHARDTENSOR_HAVE_CUDA
#include "point_search.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace shardtensor::ops::points {

void check_inputs(const std::string& op, const at::Tensor& points, const at::Tensor& queries) {
  const auto nd = points.dim();
  TORCH_CHECK_VALUE((nd == 2 || nd == 3) && queries.dim() == nd, op,
                    ": points and queries must both be [N, C] / [M, C] or both [B, N, C] / [B, M, C], got points ",
                    points.sizes(), " and queries ", queries.sizes());
  TORCH_CHECK_VALUE(points.size(-1) == queries.size(-1), op, ": points have ", points.size(-1),
                    " coordinates but queries have ", queries.size(-1));
  TORCH_CHECK_VALUE(nd == 2 || points.size(0) == queries.size(0), op, ": batch sizes differ (points ",
                    points.sizes(), ", queries ", queries.sizes(), "); broadcasting is not supported");
  TORCH_CHECK_VALUE(points.scalar_type() == queries.scalar_type() &&
                        (points.scalar_type() == at::kFloat || points.scalar_type() == at::kDouble),
                    op, ": points and queries must share one dtype, float32 or float64, got ", points.scalar_type(),
                    " and ", queries.scalar_type(), " (convert with .float())");
}

namespace {

template <typename scalar_t>
void search_cpu(const at::Tensor& points, const at::Tensor& queries, int64_t k, double radius, at::Tensor& idx,
                at::Tensor& dist) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = points.size(0), N = points.size(1), C = points.size(2), M = queries.size(1);
  const scalar_t* P = points.data_ptr<scalar_t>();
  const scalar_t* Q = queries.data_ptr<scalar_t>();
  int64_t* I = idx.data_ptr<int64_t>();
  scalar_t* D = dist.data_ptr<scalar_t>();
  const bool bounded = std::isfinite(radius);
  const scalar_t r_out = static_cast<scalar_t>(radius);
  // The squared-distance prefilter has slack: the boundary is decided on the returned (rounded) distance, the
  // value a user compares with the radius.
  const acc_t r2 = bounded ? static_cast<acc_t>(radius * radius * (1.0 + 1e-4) + 1e-30) : acc_t(0);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, N * std::max<int64_t>(C, 1)));
  at::parallel_for(0, B * M, grain, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<acc_t, int64_t>> heap;  // max-heap: the worst kept candidate on top
    heap.reserve(static_cast<size_t>(k));
    for (int64_t qi = begin; qi < end; ++qi) {
      const scalar_t* q = Q + qi * C;
      const scalar_t* pb = P + (qi / std::max<int64_t>(M, 1)) * N * C;
      heap.clear();
      for (int64_t j = 0; j < N; ++j) {
        const scalar_t* p = pb + j * C;
        acc_t d2 = 0;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t diff = static_cast<acc_t>(q[c]) - static_cast<acc_t>(p[c]);
          d2 += diff * diff;
        }
        if (std::isnan(d2)) continue;  // NaN coordinates never match
        if (bounded && (d2 > r2 || static_cast<scalar_t>(std::sqrt(d2)) > r_out)) continue;
        const std::pair<acc_t, int64_t> cand{d2, j};
        if (static_cast<int64_t>(heap.size()) < k) {
          heap.push_back(cand);
          std::push_heap(heap.begin(), heap.end());
        } else if (cand < heap.front()) {  // lexicographic: (distance, index)
          std::pop_heap(heap.begin(), heap.end());
          heap.back() = cand;
          std::push_heap(heap.begin(), heap.end());
        }
      }
      std::sort_heap(heap.begin(), heap.end());
      int64_t* irow = I + qi * k;
      scalar_t* drow = D + qi * k;
      for (int64_t s = 0; s < k; ++s) {
        const bool used = s < static_cast<int64_t>(heap.size());
        irow[s] = used ? heap[s].second : -1;
        drow[s] = used ? static_cast<scalar_t>(std::sqrt(heap[s].first)) : std::numeric_limits<scalar_t>::infinity();
      }
    }
  });
}

} // namespace

std::tuple<at::Tensor, at::Tensor> search(const at::Tensor& points_in, const at::Tensor& queries_in, int64_t k,
                                          double radius) {
  TORCH_INTERNAL_ASSERT(points_in.dim() == 3 && queries_in.dim() == 3 && k >= 0);
  auto points = points_in.contiguous(), queries = queries_in.contiguous();
  const int64_t B = queries.size(0), M = queries.size(1);
  auto idx = at::empty({B, M, k}, queries.options().dtype(at::kLong));
  auto dist = at::empty({B, M, k}, queries.options());
  if (idx.numel() == 0) return {idx, dist};
  if (queries.is_cuda()) {
#ifdef SHARDTENSOR_HAVE_CUDA
    const bool dbl = queries.scalar_type() == at::kDouble;
    c10::cuda::CUDAGuard guard(queries.device());
    TORCH_CHECK_VALUE(queries.size(2) <= cuda::point_search_max_channels(dbl),
                      "knn/radius_search on CUDA: at most ", cuda::point_search_max_channels(dbl),
                      " coordinates per point, got ", queries.size(2), " (search on CPU or reduce the coordinates)");
    cuda::point_search(points.data_ptr(), queries.data_ptr(), idx.data_ptr<int64_t>(), dist.data_ptr(), B,
                       points.size(1), M, queries.size(2), k, radius, dbl,
                       c10::cuda::getCurrentCUDAStream(queries.device().index()).stream());
    return {idx, dist};
#else
    TORCH_CHECK_NOT_IMPLEMENTED(false, "knn/radius_search: this build of ShardTensor has no CUDA kernels; move the "
                                       "tensors to the CPU or rebuild with the CUDA toolkit");
#endif
  }
  TORCH_CHECK_NOT_IMPLEMENTED(queries.device().is_cpu(), "knn/radius_search: no kernel for device ", queries.device(),
                              "; use CPU or CUDA tensors");
  AT_DISPATCH_FLOATING_TYPES(queries.scalar_type(), "point_search_cpu",
                             [&] { search_cpu<scalar_t>(points, queries, k, radius, idx, dist); });
  return {idx, dist};
}

std::tuple<at::Tensor, at::Tensor> merge(const at::Tensor& idx_a, const at::Tensor& dist_a, const at::Tensor& idx_b,
                                         const at::Tensor& dist_b, int64_t k) {
  auto idx = at::cat({idx_a, idx_b}, -1);
  auto dist = at::cat({dist_a, dist_b}, -1);
  // Two stable sorts give the lexicographic order: by index (empty slots last), then by distance.
  auto key = at::where(idx < 0, at::scalar_tensor(std::numeric_limits<int64_t>::max(), idx.options()), idx);
  auto by_index = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/-1, /*descending=*/false));
  idx = idx.gather(-1, by_index);
  dist = dist.gather(-1, by_index);
  auto by_dist = std::get<1>(at::sort(dist, /*stable=*/true, /*dim=*/-1, /*descending=*/false));
  const auto keep = std::min<int64_t>(k, idx.size(-1));
  by_dist = by_dist.narrow(-1, 0, keep);
  return {idx.gather(-1, by_dist), dist.gather(-1, by_dist)};
}

void distance_backward(const at::Tensor& grad, const at::Tensor& idx, const at::Tensor& queries,
                       const at::Tensor& points, int64_t offset, at::Tensor& dq, at::Tensor* dp) {
  const int64_t B = queries.size(0), M = queries.size(1), C = queries.size(2), N = points.size(1), k = idx.size(-1);
  if (N == 0 || M == 0 || k == 0) return;
  auto local = idx - offset;
  auto valid = (idx >= 0).logical_and_(local >= 0).logical_and_(local < N);
  auto base = at::arange(B, idx.options()).mul_(N).view({B, 1, 1});
  auto flat = (local.clamp(0, N - 1) + base).reshape({-1});
  auto neighbours = points.reshape({B * N, C}).index_select(0, flat).view({B, M, k, C});
  auto diff = queries.unsqueeze(2) - neighbours;
  auto d = diff.pow(2).sum(-1).sqrt();
  // d dist / d q = (q - p) / dist, defined as 0 at dist 0 (and for entries outside this block or empty).
  auto use = valid.logical_and_(d > 0);
  auto coef = at::where(use, grad.to(d.scalar_type()) / at::where(use, d, at::ones_like(d)), at::zeros_like(d));
  auto contrib = diff * coef.unsqueeze(-1);
  dq.add_(contrib.sum(2));
  if (dp) dp->view({B * N, C}).index_add_(0, flat, contrib.reshape({B * M * k, C}).neg());
}

} // namespace shardtensor::ops::points
