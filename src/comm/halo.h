// Halo exchange as "gather rows by global index": along a dim sharded by one mesh dim, every rank asks for a
// list of global row indices (its window: own rows plus halos from neighbours, any number of ranks away, with
// -1 for rows outside the tensor that the op fills with zeros). Padding modes map outside positions to
// reflected, replicated or wrapped-around indices before asking. The lists are computed from specs on every
// rank, so nothing is negotiated and every rank issues the same collective. The backward is the adjoint:
// gradient rows travel back to their owners and are summed.
#pragma once

#include <shardtensor/mesh.h>

#include "comm/collectives.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace shardtensor::comm {

// `want[c]`: the global rows coordinate c needs, in window order (-1: a zero row).
using RowRequests = std::vector<std::vector<int64_t>>;

// This rank's window: slices along `dim` are the rows `want[me]` of the global tensor.
// Rows named -1 are filled with `fill`. When every rank only needs rows it owns (known on every rank), no
// collective is issued at all.
at::Tensor gather_rows(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                       const RowRequests& want, const Mesh& mesh, int64_t mesh_dim, double fill = 0.0);

// gather_rows in two steps, so the caller can compute what needs no halo while the exchange is in flight:
// start copies the own rows into the window and posts the exchange; finish waits and places the halo rows.
// Every rank must call both (start posts the collective; its order is the collective order).
struct PendingRows {
  at::Tensor window;
  int64_t dim = 0;
  std::vector<std::vector<int64_t>> from_peer_pos;
  PendingAllToAll exchange;
  bool posted = false;
};
PendingRows gather_rows_start(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                              const RowRequests& want, const Mesh& mesh, int64_t mesh_dim, double fill = 0.0);
at::Tensor gather_rows_finish(PendingRows& pending);

// Adjoint of gather_rows: `window` has this rank's rows `want[me]`; returns the local tensor (extent
// extents[me] along `dim`) holding, for each owned row, the sum of every rank's window rows that name it.
at::Tensor scatter_add_rows(const at::Tensor& window, int64_t dim, const std::vector<int64_t>& extents,
                            const RowRequests& want, const Mesh& mesh, int64_t mesh_dim);

// Global index of window position `pos` of a padded dim: `pos` in [-pad_left, size + pad_right) maps to a row
// of [0, size) by the mode ("zeros" -> -1 outside, "reflect", "replicate", "circular").
int64_t padded_index(int64_t pos, int64_t size, const std::string& mode);

} // namespace shardtensor::comm
