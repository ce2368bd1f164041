// Row primitives of the halo exchange, and single-use row gathers.
//
// Halo exchange is "gather rows by global index": along a dim sharded by one mesh dim, every rank asks for a list
// of global row indices (its window), computed from specs on every rank, so nothing is negotiated. Windows of
// convolutions, pooling, padding, interpolation and neighbourhood attention are planned once per layout by
// comm/halo_plan.h, which also keeps their index tensors on the device; this header holds what that plan runs on
// (packing rows for the collective, adding received rows back) and a plan-free gather for requests that are not
// windows (the attention's zigzag permutation).
#pragma once

#include <shardtensor/mesh.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace shardtensor::comm {

// `want[c]`: the global rows coordinate c needs, in window order (-1: a filled row).
using RowRequests = std::vector<std::vector<int64_t>>;

// Slices of `t` along `dim` at `index` (int64 on t's device), packed contiguously for a collective. CUDA tensors use
// the halo pack kernel of csrc_cuda/.
at::Tensor pack_rows(const at::Tensor& t, int64_t dim, const at::Tensor& index);

// out[index] += piece along `dim` (rows may repeat). CUDA float/double tensors use the atomic add kernel.
void add_rows_into(at::Tensor& out, int64_t dim, const at::Tensor& index, const at::Tensor& piece);

// This rank's window: slices along `dim` are the rows `want[me]` of the global tensor; rows named -1 are `fill`.
// Builds a one-off plan (comm::HaloPlan) for requests that are not cached windows.
at::Tensor gather_rows(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                       const RowRequests& want, const Mesh& mesh, int64_t mesh_dim, double fill = 0.0);

// Adjoint of gather_rows: `window` has this rank's rows `want[me]`; returns the local tensor (extent
// extents[me] along `dim`) holding, for each owned row, the sum of every rank's window rows that name it.
at::Tensor scatter_add_rows(const at::Tensor& window, int64_t dim, const std::vector<int64_t>& extents,
                            const RowRequests& want, const Mesh& mesh, int64_t mesh_dim);

} // namespace shardtensor::comm
