// Latitude bands of torch-harmonics' sparse operators on the sphere (DISCO convolutions, neighbourhood attention):
// a matrix in CSR form whose rows belong to latitude rows of one grid (the "row side") and whose column indices name
// positions (row * width + longitude) of the other grid (the "column side"). A filter or neighbourhood has compact
// support, so the rows of one side read a contiguous band of the other side's rows: with both grids split along
// latitude, a coordinate's rows need the band of column-side rows they name, and its operator is the CSR rows of its
// own block with rows and columns renumbered to its block and band.
#pragma once

#include "comm/halo.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <vector>

namespace shardtensor::ops {

// Rows of one grid per coordinate in proportion to another grid's split (`extents` over `from` rows, `to` rows): the
// boundary before coordinate c at floor(offset_c * to / from), so equal grids keep the split and a halving grid
// halves it.
inline std::vector<int64_t> proportional_extents(const std::vector<int64_t>& extents, int64_t from, int64_t to) {
  std::vector<int64_t> out;
  int64_t offset = 0, prev = 0;
  for (size_t c = 0; c < extents.size(); ++c) {
    offset += extents[c];
    const auto bound = c + 1 == extents.size() ? to : (from > 0 ? offset * to / from : 0);
    out.push_back(bound - prev);
    prev = bound;
  }
  return out;
}

// An operator's renumbered indices as a tensor of `like`'s dtype on its device (int64 on the host first, so no
// index passes through a narrower type).
inline at::Tensor index_tensor_like(const std::vector<int64_t>& v, const at::Tensor& like) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(like.device(), like.scalar_type());
}

// One coordinate's share of a CSR operator split along its row side.
struct BandCut {
  comm::RowRequests want;         // per coordinate: the column-side rows its band holds, in order
  int64_t band_first = 0;         // this coordinate's first band row
  int64_t block_first = 0;        // this coordinate's first row-side row
  std::vector<int64_t> kept_rows;  // this coordinate's CSR rows, in order
  std::vector<int64_t> entries;    // their entries (indices into the CSR arrays), in order
  std::vector<int64_t> roff;       // the kept rows' offsets into `entries` (kept_rows.size() + 1)
};

// `row_of(r)`: the row-side row of CSR row r, or -1 to drop it (an empty row of an operator that names its rows per
// entry). `extents`: the row-side rows per coordinate; `me`: this coordinate.
inline BandCut cut_bands(const int64_t* roff, int64_t nnr, const std::function<int64_t(int64_t)>& row_of,
                         const int64_t* col, int64_t width, int64_t column_rows, int64_t rows,
                         const std::vector<int64_t>& extents, int64_t me) {
  std::vector<int64_t> lo(rows, std::numeric_limits<int64_t>::max()), hi(rows, -1);
  for (int64_t r = 0; r < nnr; ++r) {
    const auto h = row_of(r);
    if (h < 0) continue;
    TORCH_CHECK_VALUE(h < rows, "a sparse operator on the sphere names row ", h, " of ", rows);
    for (auto z = roff[r]; z < roff[r + 1]; ++z) {
      const auto d = col[z] / width;
      TORCH_CHECK_VALUE(d >= 0 && d < column_rows, "a sparse operator on the sphere names row ", d, " of ",
                        column_rows);
      lo[h] = std::min(lo[h], d);
      hi[h] = std::max(hi[h], d);
    }
  }
  BandCut cut;
  cut.want.resize(extents.size());
  int64_t first = 0;
  for (size_t c = 0; c < extents.size(); ++c) {
    int64_t band_lo = std::numeric_limits<int64_t>::max(), band_hi = -1;
    for (auto h = first; h < first + extents[c]; ++h) {
      band_lo = std::min(band_lo, lo[h]);
      band_hi = std::max(band_hi, hi[h]);
    }
    for (auto d = band_lo; d <= band_hi; ++d) cut.want[c].push_back(d);
    if (static_cast<int64_t>(c) == me) cut.block_first = first, cut.band_first = band_hi >= 0 ? band_lo : 0;
    first += extents[c];
  }
  cut.roff.push_back(0);
  for (int64_t r = 0; r < nnr; ++r) {
    const auto h = row_of(r);
    if (h < cut.block_first || h >= cut.block_first + extents[me]) continue;
    cut.kept_rows.push_back(r);
    for (auto z = roff[r]; z < roff[r + 1]; ++z) cut.entries.push_back(z);
    cut.roff.push_back(static_cast<int64_t>(cut.entries.size()));
  }
  return cut;
}

// Plans made from an operator's index tensors (module buffers) and a layout, cached: keyed by the tensors' identity
// and version and by `key` (sizes, layout, coordinate). The tensors are held by the entry, so no other tensor can
// take an identity a live entry names. A small LRU per plan type.
template <class Plan>
std::shared_ptr<const Plan> cached_for_tensors(const std::vector<at::Tensor>& held, std::vector<int64_t> key,
                                               const std::function<Plan()>& make) {
  struct Entry {
    std::vector<const void*> ids;
    std::vector<uint32_t> versions;
    std::vector<int64_t> key;
    std::vector<at::Tensor> held;
    std::shared_ptr<const Plan> plan;
  };
  static std::mutex mutex;
  static std::list<Entry> entries;
  constexpr size_t kCapacity = 32;
  // Inference tensors keep no version (and may change in place inside inference mode): plans made from them are
  // not cached (the same decision on every rank: the tensors are the module's, alike everywhere).
  for (const auto& t : held)
    if (t.is_inference()) return std::make_shared<const Plan>(make());
  std::vector<const void*> ids;
  std::vector<uint32_t> versions;
  for (const auto& t : held) {
    ids.push_back(t.unsafeGetTensorImpl());
    versions.push_back(t._version());
  }
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = entries.begin(); it != entries.end(); ++it)
    if (it->ids == ids && it->versions == versions && it->key == key) {
      entries.splice(entries.begin(), entries, it);
      return it->plan;
    }
  auto plan = std::make_shared<const Plan>(make());
  entries.push_front(Entry{std::move(ids), std::move(versions), std::move(key), held, plan});
  if (entries.size() > kCapacity) entries.pop_back();
  return plan;
}

} // namespace shardtensor::ops
