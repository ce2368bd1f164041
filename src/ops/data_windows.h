// Data-dependent windows: the input rows an op reads depend on values (grid_sample's points, a deformable
// convolution's offsets), not on the layout alone, so each rank finds the range of rows its own points read along
// each split dim, the ranges are all-gathered (one small collective per split dim) and the rows travel as a halo
// exchange (comm::HaloPlan: only between the ranks that hold them).
//
// Over a 2-D mesh a dim exchanged before another is widened to the union over the later dim's group first: the second
// exchange moves rows that already hold the first dim's window, so every rank of that group must hold the same rows
// along it (the corners of a 2-D mesh come along).
#pragma once

#include "comm/halo_plan.h"

#include <shardtensor/mesh.h>

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace shardtensor::ops {

// One split input dim of a data-dependent window.
struct DataWindowDim {
  int64_t dim = 0;       // tensor dim
  int64_t mesh_dim = 0;  // the mesh dim that splits it
  std::vector<int64_t> extents;
};

// [lo, hi): the rows of a dim of `size` rows read by taps at floor(p) - below ... floor(p) + above for every finite
// point p (pixel coordinates, double), at least min(min_rows, size) rows ([0, min(min_rows, size)) when no tap reads a
// row: empty for min_rows 0).
// Pixel coordinates computed in another dtype by the kernel may round the other way at an integer: the caller's
// `below` / `above` carry a row of margin.
std::pair<int64_t, int64_t> rows_read(const at::Tensor& pixels, int64_t size, int64_t below, int64_t above,
                                      int64_t min_rows);

// The window's rows of coordinate `coord` along dims[k] (global rows in window order; -1: a filled row), given its
// range [lo, hi) after widening.
using WindowRows = std::function<std::vector<int64_t>(size_t k, int64_t coord, int64_t lo, int64_t hi)>;

struct DataWindows {
  comm::HaloPlan plan;
  std::vector<std::pair<int64_t, int64_t>> range;  // per dim: this rank's [lo, hi) after widening
};

// The plan of windows along `dims` (in exchange order) from this rank's ranges (an empty range, lo >= hi: no row
// read; a union ignores it) (`ranges[k]` along dims[k]): every
// rank calls it with the same dims (a collective per dim, two per earlier dim of a 2-D mesh). `rows`: the window of
// a coordinate from its range (default: the rows lo .. hi - 1).
DataWindows plan_data_windows(const std::vector<DataWindowDim>& dims, std::vector<std::pair<int64_t, int64_t>> ranges,
                              const Mesh& mesh, const c10::Device& device, const char* what,
                              const WindowRows& rows = {});

// The windows of the last forward calls, for their backward: the same data tensor (a grid, offsets: the tensor
// autograd saved, not modified since: its version), input and parameters give the same ranges, so the backward skips
// the range pass and its all-gathers. Weak references: an entry whose tensors died never matches a new tensor at the
// same address. Entries are added and dropped in program order, which every rank shares, so every rank hits or
// misses alike. One thread-local cache of 16 entries per window type W; `make` builds W on a miss (a collective).
template <class W>
std::shared_ptr<const W> cached_windows(const at::Tensor& data, const at::Tensor& input, std::vector<int64_t> params,
                                        const std::function<std::shared_ptr<const W>()>& make) {
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> data, input;
    uint32_t data_version = 0, input_version = 0;
    std::vector<int64_t> params;
    std::shared_ptr<const W> windows;
  };
  // Inference tensors keep no version (and may change in place inside inference mode): no backward reuses their
  // windows anyway, so they are not cached (every rank runs the same mode, so every rank misses alike).
  if (data.is_inference() || input.is_inference()) return make();
  thread_local std::deque<Entry> recent;
  constexpr size_t kEntries = 16;
  for (const auto& e : recent) {
    auto d = e.data.lock(), x = e.input.lock();
    if (d && x && d.get() == data.unsafeGetTensorImpl() && x.get() == input.unsafeGetTensorImpl() &&
        e.data_version == data._version() && e.input_version == input._version() && e.params == params)
      return e.windows;
  }
  auto w = make();
  if (recent.size() == kEntries) recent.pop_front();
  recent.push_back({c10::weak_intrusive_ptr<c10::TensorImpl>(data.getIntrusivePtr()),
                    c10::weak_intrusive_ptr<c10::TensorImpl>(input.getIntrusivePtr()),
                    static_cast<uint32_t>(data._version()), static_cast<uint32_t>(input._version()), std::move(params),
                    w});
  return w;
}

} // namespace shardtensor::ops
