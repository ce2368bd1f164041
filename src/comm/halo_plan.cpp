#include "comm/halo_plan.h"

#include "comm/dtype_limits.h"
#include "comm/functional.h"
#include "comm/host_metadata.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <list>
#include <mutex>
#include <unordered_map>

namespace shardtensor::comm {

// ---- padding ----------------------------------------------------------------------------------------------------

int64_t padded_index(int64_t pos, int64_t L, PadMode mode) {
  if (pos >= 0 && pos < L) return pos;
  switch (mode) {
    case PadMode::None:
      TORCH_INTERNAL_ASSERT(false, "halo plan: window position ", pos, " outside a dim of size ", L,
                            " without a padding mode");
      return -1;
    case PadMode::Zeros:
    case PadMode::Constant:
    case PadMode::NegInf: return -1;
    case PadMode::Replicate: return L == 0 ? -1 : (pos < 0 ? 0 : L - 1);
    case PadMode::Circular: return L == 0 ? -1 : ((pos % L) + L) % L;
    case PadMode::Reflect: {
      if (L == 0) return -1;
      if (L == 1) return 0;
      const auto period = 2 * (L - 1);  // the edge row is not repeated
      const auto q = ((pos % period) + period) % period;
      return q < L ? q : period - q;
    }
  }
  return -1;
}

double fill_value(PadMode mode, double constant) {
  switch (mode) {
    case PadMode::Constant: return constant;
    case PadMode::NegInf: return -std::numeric_limits<double>::infinity();
    default: return 0.0;
  }
}

// The fill as a value of dtype `t`: max pooling's -inf padding is the dtype's lowest value for integral tensors
// (torch's integer max pooling reads only the input's rows, and the lowest value never wins a window that holds
// one), +inf its largest. Filling an integral tensor with an infinity raises (on the ranks with padding rows only).
namespace {

at::Scalar fill_scalar(at::ScalarType t, double fill) {
  if (!std::isinf(fill) || at::isFloatingType(t) || at::isComplexType(t)) return fill;
  return dtype_limit(t, fill < 0);
}

} // namespace

// ---- the window partition rule ------------------------------------------------------------------------------------

namespace {

std::vector<int64_t> offsets_of(const std::vector<int64_t>& extents) {
  std::vector<int64_t> off(extents.size() + 1, 0);
  for (size_t i = 0; i < extents.size(); ++i) off[i + 1] = off[i] + extents[i];
  return off;
}

int64_t div_floor(int64_t a, int64_t b) {
  auto q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

} // namespace

int64_t WindowPartition::out_begin(int64_t coord) const {
  int64_t b = 0;
  for (int64_t c = 0; c < coord; ++c) b += out_extents[c];
  return b;
}

int64_t conv_output_size(int64_t L, const SlidingWindow& w) {
  return std::max<int64_t>((L + 2 * w.padding - w.span()) / w.stride + 1, 0);
}

int64_t pool_output_size(int64_t L, const SlidingWindow& w) {
  const auto s = w.stride;
  auto out = div_floor(L + 2 * w.padding - w.span() + (w.ceil_mode ? s - 1 : 0), s) + 1;
  if (w.ceil_mode && (out - 1) * s >= L + w.padding) --out;
  return out;
}

int64_t first_output_centred_at(int64_t a, const SlidingWindow& w) {
  const int64_t num = a + w.padding - (w.span() - 1) / 2;
  const auto s = w.stride;
  return num >= 0 ? (num + s - 1) / s : -((-num) / s);
}

WindowPartition sliding_window_partition(const std::vector<int64_t>& in_extents, int64_t L, int64_t out_size,
                                         const SlidingWindow& w, PadMode mode) {
  const auto n = static_cast<int64_t>(in_extents.size());
  out_size = std::max<int64_t>(out_size, 0);
  std::vector<int64_t> bounds(n + 1, 0);
  bounds[n] = out_size;
  int64_t a = 0;
  for (int64_t c = 1; c < n; ++c) {
    a += in_extents[c - 1];
    bounds[c] = std::clamp<int64_t>(first_output_centred_at(a, w), bounds[c - 1], out_size);
  }
  WindowPartition part;
  for (int64_t c = 0; c < n; ++c) {
    part.out_extents.push_back(bounds[c + 1] - bounds[c]);
    std::vector<int64_t> rows;
    if (bounds[c + 1] > bounds[c]) {
      const auto start = bounds[c] * w.stride - w.padding;
      const auto end = (bounds[c + 1] - 1) * w.stride - w.padding + w.span();
      for (auto pos = start; pos < end; ++pos) rows.push_back(padded_index(pos, L, mode));
    }
    part.want.push_back(std::move(rows));
  }
  return part;
}

WindowPartition transposed_window_partition(const std::vector<int64_t>& in_extents, int64_t L, const SlidingWindow& w,
                                            int64_t output_padding) {
  const auto s = w.stride, p = w.padding;
  const auto lout = (L - 1) * s - 2 * p + w.span() + output_padding;
  const auto n = static_cast<int64_t>(in_extents.size());
  // Ownership follows the inputs: the boundary before a coordinate whose first input row is a sits at a*s - shift,
  // shift = floor((2p + s - span) / 2), which centres the rows its inputs produce (a*s - p ... over span - s more
  // rows than the s per input) on its own: the rows cropped on its left and right differ by 0 or 1, so its main
  // call crops them with padding and output padding (transposed_direct) and no window is built. Rows before the
  // first coordinate holding inputs belong to it, rows after the last one's to that one; equal splits of a
  // stride-s upsampling come out as the default split (`s * e` rows each), and uneven ones keep the input's
  // proportions (a U-Net's skip connection, split like the encoder's input, lines up).
  const auto shift = div_floor(2 * p + s - w.span(), 2);
  WindowPartition part;
  std::vector<int64_t> bounds(n + 1, lout);
  bounds[0] = 0;
  int64_t a = 0;
  for (int64_t c = 1; c < n; ++c) {
    a += in_extents[c - 1];
    bounds[c] = a == 0 ? 0 : a == L ? lout : std::clamp<int64_t>(a * s - shift, bounds[c - 1], lout);
  }
  for (int64_t c = 0; c < n; ++c) part.out_extents.push_back(bounds[c + 1] - bounds[c]);
  a = 0;
  for (auto e : in_extents) {
    std::vector<int64_t> rows;
    const auto width = e > 0 ? (e - 1) * s + w.span() : 0;
    for (int64_t u = 0; u < width; ++u) {
      const auto j = a * s - p + u;
      rows.push_back(j >= 0 && j < lout ? j : -1);
    }
    part.want.push_back(std::move(rows));
    a += e;
  }
  return part;
}

WindowPartition padding_partition(const std::vector<int64_t>& in_extents, int64_t L, int64_t left, int64_t right,
                                  PadMode mode) {
  const auto n = static_cast<int64_t>(in_extents.size());
  const auto lout = L + left + right;
  const auto off = offsets_of(in_extents);
  WindowPartition part{std::vector<int64_t>(n, 0), RowRequests(n)};
  // The owner of output position o: the coordinate holding source row o - left; pads before the first row go to
  // the first coordinate holding rows, pads after the last row to the last one (the first / last coordinate when
  // none holds any).
  auto owner = [&](int64_t src) {
    if (src < 0) {
      for (int64_t c = 0; c < n; ++c)
        if (in_extents[c] > 0 || c == n - 1) return c;
    }
    for (int64_t c = 0; c < n; ++c)
      if (src >= off[c] && src < off[c + 1]) return c;
    for (int64_t c = n - 1; c >= 0; --c)
      if (in_extents[c] > 0 || c == 0) return c;
    return n - 1;
  };
  for (int64_t o = 0; o < lout; ++o) {
    const auto src = o - left;
    const auto c = owner(src);
    part.out_extents[c] += 1;
    part.want[c].push_back(padded_index(src, L, mode));
  }
  return part;
}

WindowPartition primary_row_partition(const std::vector<int64_t>& in_extents, const std::vector<int64_t>& primary,
                                      const std::vector<int64_t>& first, const std::vector<int64_t>& last) {
  const auto n = static_cast<int64_t>(in_extents.size());
  const auto out_size = static_cast<int64_t>(primary.size());
  std::vector<int64_t> bounds(n + 1, 0);
  bounds[n] = out_size;
  int64_t off = 0, o = 0;
  for (int64_t c = 1; c < n; ++c) {
    off += in_extents[c - 1];
    while (o < out_size && primary[o] < off) ++o;
    bounds[c] = o;
  }
  WindowPartition part;
  for (int64_t c = 0; c < n; ++c) {
    part.out_extents.push_back(bounds[c + 1] - bounds[c]);
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
    for (auto q = bounds[c]; q < bounds[c + 1]; ++q) {
      lo = std::min(lo, first[q]);
      hi = std::max(hi, last[q]);
    }
    std::vector<int64_t> rows;
    for (auto r = lo; r <= hi; ++r) rows.push_back(r);
    part.want.push_back(std::move(rows));
  }
  return part;
}

// ---- the exchange -----------------------------------------------------------------------------------------------

namespace {

bool consecutive(const std::vector<int64_t>& v) {
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] != v[i - 1] + 1) return false;
  return true;
}

std::vector<int64_t> shape_with(at::IntArrayRef shape, int64_t dim, int64_t n) {
  auto s = shape.vec();
  s[dim] = n;
  return s;
}

} // namespace

HaloPlan::RowMap HaloPlan::row_map(std::vector<int64_t> pos, std::vector<int64_t> rows, c10::Device device) {
  RowMap m;
  m.run = consecutive(pos) && consecutive(rows);
  // Built once per plan: the exchange itself copies no indices from the host. On the CPU runs need none (narrow);
  // CUDA tensors always go through the halo kernels (strided slabs packed in one launch).
  if (!pos.empty() && (!m.run || device.is_cuda())) {
    comm::HostMetadataGuard host; // host-side index/weight tensors stay real (comm/host_metadata.h)
    const auto opts = at::TensorOptions().dtype(at::kLong);
    m.pos_t = at::tensor(pos, opts).to(device);
    m.rows_t = at::tensor(rows, opts).to(device);
  }
  m.pos = std::move(pos);
  m.rows = std::move(rows);
  return m;
}

HaloPlan::HaloPlan(const std::vector<HaloDim>& dims, const std::vector<int64_t>& coordinates, c10::Device device,
                   double fill)
    : fill_(fill) {
  for (const auto& d : dims) {
    Step s;
    s.geometry = d;
    const auto n = static_cast<int64_t>(d.extents.size());
    TORCH_INTERNAL_ASSERT(n >= 1 && static_cast<int64_t>(d.want.size()) == n, "halo plan: one request list per coordinate");
    s.me = d.mesh_dim < 0 ? 0 : coordinates.at(d.mesh_dim);
    const auto off = offsets_of(d.extents);
    for (const auto& w : d.want)
      for (auto g : w) TORCH_INTERNAL_ASSERT(g >= -1 && g < off[n], "halo plan: row ", g, " outside [0, ", off[n], ")");
    // Positions in want[r] that coordinate o owns, and o's local row of each.
    auto owned = [&](int64_t r, int64_t o, std::vector<int64_t>& pos, std::vector<int64_t>& rows) {
      for (size_t p = 0; p < d.want[r].size(); ++p) {
        const auto g = d.want[r][p];
        if (g >= off[o] && g < off[o + 1]) {
          pos.push_back(static_cast<int64_t>(p));
          rows.push_back(g - off[o]);
        }
      }
    };
    for (int64_t r = 0; r < n && !s.exchange; ++r)
      for (auto g : d.want[r])
        if (g >= 0 && (g < off[r] || g >= off[r + 1])) {
          s.exchange = true;
          break;
        }
    const auto& mine = d.want[s.me];
    s.window_rows = static_cast<int64_t>(mine.size());
    s.own_extent = d.extents[s.me];
    // The filled positions as runs (a sliding window's padding: at most one at each end); scattered ones (requests
    // that are not windows) as an index tensor.
    for (int64_t p = 0; p < s.window_rows; ++p) {
      if (mine[p] != -1) continue;
      if (!s.fill_runs.empty() && s.fill_runs.back().first + s.fill_runs.back().second == p) ++s.fill_runs.back().second;
      else s.fill_runs.emplace_back(p, 1);
    }
    if (s.fill_runs.size() > kMaxFillRuns) {
      std::vector<int64_t> pos;
      for (int64_t p = 0; p < s.window_rows; ++p)
        if (mine[p] == -1) pos.push_back(p);
      comm::HostMetadataGuard host;
      s.fill_t = at::tensor(pos, at::TensorOptions().dtype(at::kLong)).to(device);
    }
    {
      std::vector<int64_t> pos, rows;
      owned(s.me, s.me, pos, rows);
      s.own = row_map(std::move(pos), std::move(rows), device);
    }
    s.to.resize(n);
    s.from.resize(n);
    if (s.exchange) {
      for (int64_t r = 0; r < n; ++r) {
        if (r == s.me) continue;
        std::vector<int64_t> pos, rows;
        owned(r, s.me, pos, rows);
        s.to[r] = row_map(std::move(pos), std::move(rows), device);
        std::vector<int64_t> pos2, rows2;
        owned(s.me, r, pos2, rows2);
        s.from[r] = row_map(std::move(pos2), std::move(rows2), device);
      }
    }
    s.runs = s.own.run && !s.fill_t.defined();
    for (const auto& m : s.to) s.runs = s.runs && m.run;
    for (const auto& m : s.from) s.runs = s.runs && m.run;
    steps_.push_back(std::move(s));
  }
}

at::Tensor HaloPlan::own_window(size_t i, const at::Tensor& local) const {
  const auto& s = steps_.at(i);
  const auto dim = s.geometry.dim;
  TORCH_INTERNAL_ASSERT(local.size(dim) == s.own_extent, "halo plan: the local tensor has ", local.size(dim),
                        " rows along dim ", dim, ", the plan ", s.own_extent);
  auto shape = shape_with(local.sizes(), dim, s.window_rows);
  // Only the padding rows are filled; the own rows are copied below and the peers' rows arrive in `receive`.
  auto window = at::empty(shape, local.options());
  if (s.fill_t.defined()) {
    window.index_fill_(dim, comm::plan_constant(s.fill_t, window), fill_scalar(window.scalar_type(), fill_));
  } else {
    for (const auto& [p, n] : s.fill_runs) window.narrow(dim, p, n).fill_(fill_scalar(window.scalar_type(), fill_));
  }
  const auto& o = s.own;
  if (o.size() == 0) return window;
  if (o.run) {
    window.narrow(dim, o.pos[0], o.size()).copy_(local.narrow(dim, o.rows[0], o.size()));
  } else {
    window.index_copy_(dim, comm::plan_constant(o.pos_t, window),
                       local.index_select(dim, comm::plan_constant(o.rows_t, local)));
  }
  return window;
}

PeerExchange HaloPlan::post(size_t i, const at::Tensor& local, const Mesh& mesh) const {
  const auto& s = steps_.at(i);
  if (!s.exchange) return {};
  return peer_exchange_start(sends(i, local), recv_shapes(i, local.sizes()), local, mesh, s.geometry.mesh_dim);
}

PeerExchange HaloPlan::post(size_t i, const std::vector<at::Tensor>& parts, const Mesh& mesh) const {
  TORCH_INTERNAL_ASSERT(!parts.empty(), "halo plan: post of no tensors");
  if (parts.size() == 1) return post(i, parts[0], mesh);
  const auto& s = steps_.at(i);
  TORCH_INTERNAL_ASSERT(s.geometry.dim != parts[0].dim() - 1, "halo plan: tensors packed on the split dim");
  if (!s.exchange) return {};
  std::vector<std::vector<at::Tensor>> by_part;
  int64_t last = 0;
  for (const auto& p : parts) {
    by_part.push_back(sends(i, p));
    last += p.size(-1);
  }
  std::vector<at::Tensor> packed;
  for (size_t r = 0; r < s.to.size(); ++r) {
    if (s.to[r].size() == 0) {
      packed.push_back(by_part[0][r]);
      continue;
    }
    std::vector<at::Tensor> rows;
    for (auto& b : by_part) rows.push_back(b[r]);
    packed.push_back(at::cat(rows, -1));
  }
  auto shape = parts[0].sizes().vec();
  shape.back() = last;
  return peer_exchange_start(packed, recv_shapes(i, shape), parts[0], mesh, s.geometry.mesh_dim);
}

PeerExchange HaloPlan::post_rows(size_t i, const std::function<at::Tensor(int64_t, int64_t)>& rows,
                                 at::IntArrayRef shape, const at::Tensor& like, const Mesh& mesh) const {
  const auto& s = steps_.at(i);
  TORCH_INTERNAL_ASSERT(s.runs, "halo plan: post_rows needs runs");
  if (!s.exchange) return {};
  std::vector<at::Tensor> send;
  at::Tensor none;
  for (const auto& m : s.to) {
    if (m.size() == 0) {
      if (!none.defined()) none = at::empty(shape_with(shape, s.geometry.dim, 0), like.options());
      send.push_back(none);
    } else {
      send.push_back(rows(m.rows[0], m.size()));
    }
  }
  return peer_exchange_start(send, recv_shapes(i, shape), like, mesh, s.geometry.mesh_dim);
}

std::vector<std::vector<at::Tensor>> HaloPlan::split_parts(const std::vector<at::Tensor>& pieces,
                                                           const std::vector<int64_t>& last_dims) {
  if (last_dims.size() == 1) return {pieces};  // nothing packed (the split dim may be the last one)
  std::vector<std::vector<at::Tensor>> out(last_dims.size());
  for (const auto& p : pieces) {
    int64_t at = 0;
    for (size_t k = 0; k < last_dims.size(); ++k) {
      out[k].push_back(p.defined() && p.numel() > 0 ? p.narrow(-1, at, last_dims[k]) : p);
      at += last_dims[k];
    }
  }
  return out;
}

PeerExchange HaloPlan::post_returns(size_t i, const std::vector<std::pair<int64_t, at::Tensor>>& slices,
                                    at::IntArrayRef shape, const at::Tensor& like, const Mesh& mesh) const {
  const auto& s = steps_.at(i);
  if (!s.exchange) return {};
  TORCH_INTERNAL_ASSERT(s.runs, "halo plan: returns from window slices need runs");
  const auto dim = s.geometry.dim;
  std::vector<at::Tensor> back;
  at::Tensor none;
  for (const auto& f : s.from) {
    const auto n = f.size();
    if (n == 0) {
      if (!none.defined()) none = at::empty(shape_with(shape, dim, 0), like.options());
      back.push_back(none);
      continue;
    }
    const auto p = f.pos[0];
    // Usually one slice holds the peer's whole run: its rows go as they are.
    at::Tensor piece;
    for (const auto& [b, t] : slices)
      if (b <= p && p + n <= b + t.size(dim)) piece = t.narrow(dim, p - b, n);
    if (!piece.defined()) {
      piece = at::zeros(shape_with(shape, dim, n), like.options());
      for (const auto& [b, t] : slices) {
        const auto lo = std::max(p, b), hi = std::min(p + n, b + t.size(dim));
        if (hi > lo) piece.narrow(dim, lo - p, hi - lo).copy_(t.narrow(dim, lo - b, hi - lo));
      }
    }
    back.push_back(piece);
  }
  return peer_exchange_start(back, return_shapes(i, shape), like, mesh, s.geometry.mesh_dim);
}

std::tuple<int64_t, int64_t, int64_t> HaloPlan::own_run(size_t i) const {
  const auto& o = steps_.at(i).own;
  TORCH_INTERNAL_ASSERT(o.run, "halo plan: the own rows are not one run");
  if (o.size() == 0) return {0, 0, 0};
  return {o.pos[0], o.rows[0], o.size()};
}

at::Tensor HaloPlan::window_slice(size_t i, const at::Tensor& local, const std::vector<at::Tensor>& received,
                                  int64_t begin, int64_t len, int64_t local_first) const {
  const auto& s = steps_.at(i);
  const auto dim = s.geometry.dim;
  TORCH_INTERNAL_ASSERT(s.runs && begin >= 0 && len >= 0 && begin + len <= s.window_rows,
                        "halo plan: window slice [", begin, ", ", begin + len, ") of ", s.window_rows, " rows");
  auto out = at::empty(shape_with(local.sizes(), dim, len), local.options());
  const auto end = begin + len;
  // The part of the run of window positions [p, p + n) inside the slice: rows from `src` (its row r0 at p), or
  // `value` when there is no source.
  auto place = [&](int64_t p, int64_t n, const at::Tensor* src, int64_t r0, double value) {
    const auto lo = std::max(p, begin), hi = std::min(p + n, end);
    if (hi <= lo) return;
    auto dst = out.narrow(dim, lo - begin, hi - lo);
    if (src) dst.copy_(src->narrow(dim, r0 + lo - p, hi - lo));
    else dst.fill_(fill_scalar(dst.scalar_type(), value));
  };
  for (const auto& [p, n] : s.fill_runs) place(p, n, nullptr, 0, fill_);
  const auto& o = s.own;
  if (o.size() > 0) place(o.pos[0], o.size(), &local, o.rows[0] - local_first, 0.0);
  for (size_t r = 0; r < s.from.size(); ++r) {
    const auto& f = s.from[r];
    if (f.size() > 0) place(f.pos[0], f.size(), received.empty() ? nullptr : &received.at(r), 0, 0.0);
  }
  return out;
}

std::vector<at::Tensor> HaloPlan::pieces(const at::Tensor& t, int64_t dim, const std::vector<RowMap>& maps,
                                         bool by_rows) {
  std::vector<at::Tensor> out;
  // Peers without rows (all but the neighbours, usually) share one empty piece: per-peer tensor ops would make a
  // step's host time grow with the mesh size (every op costs a Python dispatch on a simulation's fake tensors).
  at::Tensor none;
  for (const auto& m : maps) {
    const auto& index = by_rows ? m.rows : m.pos;
    if (m.size() == 0) out.push_back(none.defined() ? none : (none = t.narrow(dim, 0, 0)));
    else if (m.packs_by_narrow(t)) out.push_back(t.narrow(dim, index[0], m.size()));
    else out.push_back(pack_rows(t, dim, comm::plan_constant(by_rows ? m.rows_t : m.pos_t, t)));
  }
  return out;
}

std::vector<at::Tensor> HaloPlan::sends(size_t i, const at::Tensor& local) const {
  const auto& s = steps_.at(i);
  return pieces(local, s.geometry.dim, s.to, true);
}

void HaloPlan::receive(size_t i, at::Tensor& window, const std::vector<at::Tensor>& pieces) const {
  const auto& s = steps_.at(i);
  const auto dim = s.geometry.dim;
  for (size_t r = 0; r < s.from.size(); ++r) {
    const auto& f = s.from[r];
    if (f.size() == 0) continue;
    if (f.run) window.narrow(dim, f.pos[0], f.size()).copy_(pieces[r]);
    else window.index_copy_(dim, comm::plan_constant(f.pos_t, window), pieces[r]);
  }
}

at::Tensor HaloPlan::own_sum(size_t i, const at::Tensor& window, bool reuse) const {
  const auto& s = steps_.at(i);
  const auto dim = s.geometry.dim;
  TORCH_INTERNAL_ASSERT(window.size(dim) == s.window_rows, "halo plan: the window has ", window.size(dim),
                        " rows along dim ", dim, ", the plan ", s.window_rows);
  const auto& o = s.own;
  // The own rows, each once and in order, covering the local extent: they are the sum already.
  if (reuse && o.run && o.size() == s.own_extent && o.size() > 0 && o.rows[0] == 0)
    return window.narrow(dim, o.pos[0], o.size());
  auto out = at::zeros(shape_with(window.sizes(), dim, s.own_extent), window.options());
  if (o.size() == 0) return out;
  if (o.run) {
    out.narrow(dim, o.rows[0], o.size()).add_(window.narrow(dim, o.pos[0], o.size()));
  } else {
    // Rows may repeat (reflect / replicate padding of an unsharded dim): index_add_ sums them.
    out.index_add_(dim, comm::plan_constant(o.rows_t, out),
                   window.index_select(dim, comm::plan_constant(o.pos_t, window)));
  }
  return out;
}

std::vector<at::Tensor> HaloPlan::returns(size_t i, const at::Tensor& window) const {
  const auto& s = steps_.at(i);
  return pieces(window, s.geometry.dim, s.from, false);
}

void HaloPlan::add_returns(size_t i, at::Tensor& out, const std::vector<at::Tensor>& pieces) const {
  const auto& s = steps_.at(i);
  const auto dim = s.geometry.dim;
  for (size_t r = 0; r < s.to.size(); ++r) {
    const auto& t = s.to[r];
    if (t.size() == 0) continue;
    if (t.packs_by_narrow(out)) out.narrow(dim, t.rows[0], t.size()).add_(pieces[r]);
    else add_rows_into(out, dim, comm::plan_constant(t.rows_t, out), pieces[r]);  // rows may repeat (reflect padding)
  }
}

std::vector<std::vector<int64_t>> HaloPlan::recv_shapes(size_t i, at::IntArrayRef window_shape) const {
  const auto& s = steps_.at(i);
  std::vector<std::vector<int64_t>> out;
  for (const auto& f : s.from) out.push_back(shape_with(window_shape, s.geometry.dim, f.size()));
  return out;
}

std::vector<std::vector<int64_t>> HaloPlan::return_shapes(size_t i, at::IntArrayRef window_shape) const {
  const auto& s = steps_.at(i);
  std::vector<std::vector<int64_t>> out;
  for (const auto& t : s.to) out.push_back(shape_with(window_shape, s.geometry.dim, t.size()));
  return out;
}

PendingHalo HaloPlan::start(const at::Tensor& local, const Mesh& mesh) const {
  PendingHalo p;
  if (steps_.empty()) {
    p.window = local;
    return p;
  }
  const auto& s = steps_[0];
  // Own rows never travel: only halo rows are exchanged, with the peers that hold or need them, posted first so
  // they travel while the own rows are copied into the window.
  if (s.exchange) {
    p.exchange = post(0, local, mesh);
    p.posted = true;
  }
  p.window = own_window(0, local);
  return p;
}

at::Tensor HaloPlan::finish(PendingHalo& p, const Mesh& mesh) const {
  if (steps_.empty()) return p.window;
  if (p.posted) {
    auto pieces = p.exchange.wait();
    p.posted = false;
    receive(0, p.window, pieces);
  }
  auto x = p.window;
  for (size_t i = 1; i < steps_.size(); ++i) x = gather_step(i, x, mesh);
  return x;
}

at::Tensor HaloPlan::gather_step(size_t i, const at::Tensor& local, const Mesh& mesh) const {
  const auto& s = steps_[i];
  // The halo travels while the own rows are copied into the window.
  auto posted = post(i, local, mesh);
  auto window = own_window(i, local);
  if (!s.exchange) return window;
  receive(i, window, posted.wait());
  return window;
}

at::Tensor HaloPlan::assemble(const at::Tensor& local, const std::vector<std::vector<at::Tensor>>& received,
                              size_t steps, int64_t rows_first, int64_t rows_count, const at::Tensor& into,
                              bool own_written) const {
  // Along dims of steps < `steps`: window positions; the dim of step `steps` (when it exists): local rows
  // [rows_first, rows_first + rows_count); the other dims: local rows.
  const bool restrict = steps < steps_.size();
  auto base = restrict ? local.narrow(steps_[steps].geometry.dim, rows_first, rows_count) : local;
  auto shape = base.sizes().vec();
  for (size_t j = 0; j < steps; ++j) shape[steps_[j].geometry.dim] = steps_[j].window_rows;
  TORCH_INTERNAL_ASSERT(!into.defined() || into.sizes() == at::IntArrayRef(shape), "halo plan: assemble into ",
                        into.sizes(), ", the window is ", at::IntArrayRef(shape));
  auto out = into.defined() ? into : at::empty(shape, local.options());
  // The block of `out` at dim j's positions [p, p + n), the own positions along dims j+1 .. steps-1 and everything
  // along earlier dims (whose windows the pieces of step j already hold).
  auto block = [&](size_t j, int64_t p, int64_t n) {
    auto t = out.narrow(steps_[j].geometry.dim, p, n);
    for (size_t i = j + 1; i < steps; ++i) {
      const auto& o = steps_[i].own;
      t = t.narrow(steps_[i].geometry.dim, o.size() > 0 ? o.pos[0] : 0, o.size());
    }
    return t;
  };
  // A received piece of step j, cut like `block` along the later dims (it holds the sender's local rows there,
  // which are this rank's: the peer differs only along j's mesh dim).
  auto cut = [&](size_t j, at::Tensor t) {
    for (size_t i = j + 1; i < steps; ++i) {
      const auto& o = steps_[i].own;
      t = t.narrow(steps_[i].geometry.dim, o.size() > 0 ? o.rows[0] : 0, o.size());
    }
    if (restrict) t = t.narrow(steps_[steps].geometry.dim, rows_first, rows_count);
    return t;
  };
  for (size_t j = 0; j < steps; ++j) {
    const auto& s = steps_[j];
    for (const auto& [p, n] : s.fill_runs) block(j, p, n).fill_(fill_scalar(out.scalar_type(), fill_));
    for (size_t r = 0; r < s.from.size(); ++r) {
      const auto& f = s.from[r];
      if (f.size() > 0) block(j, f.pos[0], f.size()).copy_(cut(j, received.at(j).at(r)));
    }
  }
  if (!own_written) write_own_rows(out, base, steps);
  return out;
}

void HaloPlan::write_own_rows(const at::Tensor& out, const at::Tensor& base, size_t steps) const {
  // The own rows: once, wherever they sit in every dim's window.
  auto dst = out;
  auto src = base;
  for (size_t i = 0; i < steps; ++i) {
    const auto& o = steps_[i].own;
    if (o.size() == 0) return;
    dst = dst.narrow(steps_[i].geometry.dim, o.pos[0], o.size());
    src = src.narrow(steps_[i].geometry.dim, o.rows[0], o.size());
  }
  dst.copy_(src);
}

std::vector<std::vector<at::Tensor>> HaloPlan::exchange_all(const at::Tensor& local, const Mesh& mesh,
                                                       const std::function<void()>& while_first) const {
  std::vector<std::vector<at::Tensor>> received(steps_.size());
  for (size_t k = 0; k < steps_.size(); ++k) {
    auto shape = local.sizes().vec();
    for (size_t j = 0; j < k; ++j) shape[steps_[j].geometry.dim] = steps_[j].window_rows;
    auto posted = post_rows(
        k, [&](int64_t first, int64_t count) { return assemble(local, received, k, first, count); }, shape, local,
        mesh);
    if (k == 0 && while_first) while_first();
    received[k] = posted.wait();
  }
  return received;
}

at::Tensor HaloPlan::gather(const at::Tensor& local, const Mesh& mesh) const {
  if (steps_.size() >= 2 && all_runs()) {
    // Several dims: the same messages as dim-by-dim windows (each later dim's rows carry the earlier dims'
    // halo, so the corners come along), but the window is written once, not once per dim.
    // The own rows are written while the first dim's halo travels.
    auto shape = local.sizes().vec();
    for (const auto& s : steps_) shape[s.geometry.dim] = s.window_rows;
    auto window = at::empty(shape, local.options());
    auto received = exchange_all(local, mesh, [&] { write_own_rows(window, local, steps_.size()); });
    return assemble(local, received, steps_.size(), 0, 0, window, /*own_written=*/true);
  }
  auto x = local;
  for (size_t i = 0; i < steps_.size(); ++i) x = gather_step(i, x, mesh);
  return x;
}

at::Tensor HaloPlan::scatter_add(const at::Tensor& window, const Mesh& mesh, bool consume) const {
  auto g = window;
  for (size_t k = steps_.size(); k-- > 0;) {
    const auto& s = steps_[k];
    // The adjoint exchange: my window's halo rows go back to their owners; I receive my rows named by peers. It is
    // posted before the own rows are summed (a reused window is summed into in place: the sends are packed first,
    // and they are contiguous copies of rows the own sum never touches).
    PeerExchange back;
    if (s.exchange) back = peer_exchange_start(returns(k, g), return_shapes(k, g.sizes()), g, mesh, s.geometry.mesh_dim);
    auto out = own_sum(k, g, consume);
    if (s.exchange) {
      auto pieces = back.wait();
      add_returns(k, out, pieces);
    }
    g = out;
  }
  return g;
}

std::vector<std::vector<at::Tensor>> HaloPlan::zero_pieces(const at::Tensor& local) const {
  return zero_pieces(local.sizes(), local.options());
}

std::vector<std::vector<at::Tensor>> HaloPlan::zero_pieces(at::IntArrayRef local_shape,
                                                           const at::TensorOptions& options) const {
  TORCH_INTERNAL_ASSERT(all_runs(), "halo plan: gradient pieces need runs");
  std::vector<std::vector<at::Tensor>> out(steps_.size());
  for (size_t k = 0; k < steps_.size(); ++k) {
    auto shape = local_shape.vec();
    for (size_t j = 0; j < k; ++j) shape[steps_[j].geometry.dim] = steps_[j].window_rows;
    at::Tensor none;
    for (const auto& s : recv_shapes(k, shape)) {
      if (s[steps_[k].geometry.dim] > 0) out[k].push_back(at::zeros(s, options));
      else out[k].push_back(none.defined() ? none : (none = at::empty(s, options)));
    }
  }
  return out;
}

at::Tensor HaloPlan::region(const at::Tensor& local, const std::vector<std::vector<at::Tensor>>& received,
                            const std::vector<std::pair<int64_t, int64_t>>& ranges, size_t stop, bool zero_own) const {
  const auto n = steps_.size();
  TORCH_INTERNAL_ASSERT(ranges.size() == n && stop <= n && received.size() >= stop,
                        "halo plan: a region needs one range per step");
  // Per step: the local rows the region holds (its own part along a windowed dim), and where they start.
  std::vector<std::pair<int64_t, int64_t>> own(n);
  for (size_t d = 0; d < n; ++d) {
    const auto [b, l] = ranges[d];
    if (d >= stop) {
      own[d] = {b, l};
      continue;
    }
    const auto [p, r0, cnt] = own_run(d);
    const auto lo = std::max(b, p), hi = std::min(b + l, p + cnt);
    own[d] = hi > lo ? std::make_pair(r0 + lo - p, hi - lo) : std::make_pair<int64_t, int64_t>(0, 0);
  }
  auto t = local;
  for (size_t d = 0; d < n; ++d) t = t.narrow(steps_[d].geometry.dim, own[d].first, own[d].second);
  if (zero_own) t = at::zeros(t.sizes(), t.options());  // the halo alone (a few rows: the region's own part)
  for (size_t k = 0; k < stop; ++k) {
    const auto dim = steps_[k].geometry.dim;
    std::vector<at::Tensor> pieces;
    for (const auto& piece : received[k]) {
      if (!piece.defined() || piece.dim() == 0 || piece.size(dim) == 0) {
        pieces.push_back(piece);
        continue;
      }
      // A step-k piece holds window positions along the earlier steps' dims and local rows along the later ones.
      auto q = piece;
      for (size_t d = 0; d < n; ++d) {
        if (d == k) continue;
        const auto [f, c] = d < k ? ranges[d] : own[d];
        q = q.narrow(steps_[d].geometry.dim, f, c);
      }
      pieces.push_back(q);
    }
    t = window_slice(k, t, pieces, ranges[k].first, ranges[k].second, own[k].first);
  }
  return t;
}

void HaloPlan::add_region(at::Tensor& own, std::vector<std::vector<at::Tensor>>& halo, size_t steps,
                          const std::vector<std::pair<int64_t, int64_t>>& ranges, const at::Tensor& grad,
                          bool skip_own, bool skip_halo) const {
  TORCH_INTERNAL_ASSERT(ranges.size() == steps_.size() && steps <= steps_.size() && halo.size() == steps_.size(),
                        "halo plan: a region needs one range per step");
  // Per step before `steps`: the parts of the range's window positions that rows hold — this rank's own (source -1,
  // `row` a local row) or a peer's (source r, `row` a row of its piece) — at offset `at` of the region.
  struct Segment {
    int64_t source, at, row, count;
  };
  std::vector<std::vector<Segment>> segments(steps);
  for (size_t j = 0; j < steps; ++j) {
    const auto& s = steps_[j];
    TORCH_INTERNAL_ASSERT(s.runs, "halo plan: gradient pieces need runs");
    const auto [b, l] = ranges[j];
    auto part = [&](int64_t source, int64_t p, int64_t n, int64_t row) {
      const auto lo = std::max(p, b), hi = std::min(p + n, b + l);
      if (hi > lo) segments[j].push_back({source, lo - b, row + lo - p, hi - lo});
    };
    if (s.own.size() > 0) part(-1, s.own.pos[0], s.own.size(), s.own.rows[0]);
    for (size_t r = 0; r < s.from.size(); ++r)
      if (s.from[r].size() > 0) part(static_cast<int64_t>(r), s.from[r].pos[0], s.from[r].size(), 0);
    if (segments[j].empty()) return;  // only padding
  }
  // Every combination of one segment per step: the element belongs to the piece of the last step whose segment is
  // a peer's (the own rows if none); along earlier steps that piece holds window positions, along later ones local
  // rows (the combination's segments there are own ones).
  std::vector<size_t> pick(steps, 0);
  while (true) {
    int64_t last = -1;
    for (size_t j = 0; j < steps; ++j)
      if (segments[j][pick[j]].source >= 0) last = static_cast<int64_t>(j);
    if (last >= 0 ? !skip_halo : !skip_own) {
      auto dst = last < 0 ? own : halo[last][segments[last][pick[last]].source];
      auto src = grad;
      for (size_t j = 0; j < steps_.size(); ++j) {
        const auto dim = steps_[j].geometry.dim;
        if (j >= steps) {
          dst = dst.narrow(dim, ranges[j].first, ranges[j].second);
          continue;
        }
        const auto& sg = segments[j][pick[j]];
        src = src.narrow(dim, sg.at, sg.count);
        dst = dst.narrow(dim, static_cast<int64_t>(j) < last ? ranges[j].first + sg.at : sg.row, sg.count);
      }
      dst.add_(src);
    }
    size_t j = 0;
    for (; j < steps; ++j) {
      if (++pick[j] < segments[j].size()) break;
      pick[j] = 0;
    }
    if (j == steps) break;
  }
}

void HaloPlan::scatter_pieces(at::Tensor& own, std::vector<std::vector<at::Tensor>>& halo, const Mesh& mesh) const {
  TORCH_INTERNAL_ASSERT(all_runs() && halo.size() == steps_.size(), "halo plan: gradient pieces need runs");
  for (size_t k = steps_.size(); k-- > 0;) {
    if (!steps_[k].exchange) continue;
    auto back = post_pieces(k, own, halo, mesh).wait();
    add_piece_returns(k, own, halo, back);
  }
}

PeerExchange HaloPlan::post_pieces(size_t k, const at::Tensor& own, const std::vector<std::vector<at::Tensor>>& halo,
                                   const Mesh& mesh) const {
  return post_pieces(k, own.sizes(), own, halo, mesh);
}

PeerExchange HaloPlan::post_pieces(size_t k, at::IntArrayRef own_shape, const at::Tensor& like,
                                   const std::vector<std::vector<at::Tensor>>& halo, const Mesh& mesh) const {
  const auto& s = steps_.at(k);
  if (!s.exchange) return {};
  auto shape = own_shape.vec();
  for (size_t j = 0; j < k; ++j) shape[steps_[j].geometry.dim] = steps_[j].window_rows;
  return peer_exchange_start(halo.at(k), return_shapes(k, shape), like, mesh, s.geometry.mesh_dim);
}

void HaloPlan::add_piece_returns(size_t k, at::Tensor& own, std::vector<std::vector<at::Tensor>>& halo,
                                 const std::vector<at::Tensor>& back) const {
  const auto& s = steps_.at(k);
  for (size_t r = 0; r < s.to.size(); ++r) {
    const auto& t = s.to[r];
    if (t.size() == 0) continue;
    // Peer r's gradient of the rows this rank sent it at step k: window positions along the earlier steps' dims.
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (size_t j = 0; j < steps_.size(); ++j) {
      if (j < k) ranges.emplace_back(0, steps_[j].window_rows);
      else if (j == k) ranges.emplace_back(t.rows[0], t.size());
      else ranges.emplace_back(0, own.size(steps_[j].geometry.dim));
    }
    add_region(own, halo, k, ranges, back.at(r), false);
  }
}

// ---- plan caching -----------------------------------------------------------------------------------------------

PlanKey& PlanKey::add_ints(at::IntArrayRef v) {
  v_.push_back(static_cast<int64_t>(v.size()));
  v_.insert(v_.end(), v.begin(), v.end());
  return *this;
}

PlanKey& PlanKey::add_double(double v) {
  int64_t bits;
  static_assert(sizeof(bits) == sizeof(v));
  std::memcpy(&bits, &v, sizeof(v));
  v_.push_back(bits);
  return *this;
}

PlanKey& PlanKey::add_spec(const ShardSpec& spec) {
  add_ints(spec.mesh->shape());
  add_ints(spec.mesh->coordinates());
  for (const auto& p : spec.placements) {
    add(static_cast<int64_t>(p.kind));
    add(p.is_shard() ? p.dim : p.is_partial() ? static_cast<int64_t>(p.op) : -1);
  }
  add_ints(spec.global_shape);
  for (const auto& e : spec.extents) add_ints(e);
  return *this;
}

PlanKey& PlanKey::add_device(c10::Device device) {
  add(static_cast<int64_t>(device.type()));
  add(static_cast<int64_t>(device.index()));
  return *this;
}

size_t PlanKey::hash() const {
  size_t h = 1469598103934665603ull;
  for (auto x : v_) h = (h ^ std::hash<int64_t>{}(x)) * 1099511628211ull;
  return h;
}

namespace {

// A plan's key and type: plans of different types never share an entry.
struct StoreKey {
  PlanKey key;
  std::type_index type;
  bool operator==(const StoreKey& o) const { return type == o.type && key == o.key; }
};

struct StoreKeyHash {
  size_t operator()(const StoreKey& k) const { return k.key.hash() ^ (k.type.hash_code() * 31); }
};

// Least-recently-used order in a list; the map points into it.
class PlanStore {
 public:
  std::shared_ptr<const void> find(const StoreKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) {
      ++misses_;
      return nullptr;
    }
    lru_.splice(lru_.begin(), lru_, it->second);
    ++hits_;
    return it->second->plan;
  }

  void store(const StoreKey& key, std::shared_ptr<const void> plan) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) {  // built twice concurrently: keep one
      lru_.splice(lru_.begin(), lru_, it->second);
      return;
    }
    lru_.push_front(Entry{key, std::move(plan)});
    index_.emplace(key, lru_.begin());
    while (lru_.size() > capacity_) {
      index_.erase(lru_.back().key);
      lru_.pop_back();
    }
  }

  PlanCacheStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {hits_, misses_, static_cast<int64_t>(lru_.size()), static_cast<int64_t>(capacity_)};
  }

  void reset_stats() {
    std::lock_guard<std::mutex> lock(mu_);
    hits_ = misses_ = 0;
  }

  void reset(size_t capacity) {
    std::lock_guard<std::mutex> lock(mu_);
    index_.clear();
    lru_.clear();
    capacity_ = std::max<size_t>(capacity, 1);
  }

 private:
  struct Entry {
    StoreKey key;
    std::shared_ptr<const void> plan;
  };
  std::mutex mu_;
  std::list<Entry> lru_;
  std::unordered_map<StoreKey, std::list<Entry>::iterator, StoreKeyHash> index_;
  // Plans are small (index lists and index tensors); a model has a few dozen distinct layer geometries.
  size_t capacity_ = 1024;
  int64_t hits_ = 0, misses_ = 0;
};

// Never destroyed: plans may hold CUDA index tensors, which must not be freed after CUDA shuts down at exit.
PlanStore& store() {
  static auto* s = new PlanStore();
  return *s;
}

} // namespace

namespace detail {
std::shared_ptr<const void> find_plan(const PlanKey& key, std::type_index type) {
  return store().find(StoreKey{key, type});
}
void store_plan(const PlanKey& key, std::type_index type, std::shared_ptr<const void> plan) {
  store().store(StoreKey{key, type}, std::move(plan));
}
} // namespace detail

PlanCacheStats plan_cache_stats() {
  return store().stats();
}

void reset_plan_cache_stats() {
  store().reset_stats();
}

void set_plan_cache_capacity(size_t capacity) {
  store().reset(capacity);
}

} // namespace shardtensor::comm
