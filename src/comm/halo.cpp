#include "comm/halo.h"

#include "comm/collectives.h"

#include <ATen/ATen.h>

namespace shardtensor::comm {

namespace {

std::vector<int64_t> offsets_of(const std::vector<int64_t>& extents) {
  std::vector<int64_t> off(extents.size() + 1, 0);
  for (size_t i = 0; i < extents.size(); ++i) off[i + 1] = off[i] + extents[i];
  return off;
}

// Positions in `want_r` (and the local row of each) whose row coordinate `o` owns.
void owned_by(const std::vector<int64_t>& want_r, int64_t lo, int64_t hi, std::vector<int64_t>& positions,
              std::vector<int64_t>& local_rows) {
  for (size_t p = 0; p < want_r.size(); ++p) {
    const auto g = want_r[p];
    if (g >= lo && g < hi) {
      positions.push_back(static_cast<int64_t>(p));
      local_rows.push_back(g - lo);
    }
  }
}

at::Tensor index_tensor(const std::vector<int64_t>& v, const at::Tensor& like) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(like.device());
}

std::vector<int64_t> shape_with(at::IntArrayRef shape, int64_t dim, int64_t n) {
  auto s = shape.vec();
  s[dim] = n;
  return s;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

// True when every coordinate's requests name only its own rows (or -1): a decision every rank makes alike.
bool self_contained(const RowRequests& want, const std::vector<int64_t>& off) {
  for (size_t r = 0; r < want.size(); ++r)
    for (auto g : want[r])
      if (g >= 0 && (g < off[r] || g >= off[r + 1])) return false;
  return true;
}

// True when positions and rows are both consecutive runs (the common halo case: own rows in one block).
bool consecutive(const std::vector<int64_t>& pos, const std::vector<int64_t>& rows) {
  for (size_t i = 1; i < pos.size(); ++i)
    if (pos[i] != pos[i - 1] + 1 || rows[i] != rows[i - 1] + 1) return false;
  return true;
}

// out[pos] = src[rows] along dim (copy), without temporaries for a consecutive run.
void copy_rows(at::Tensor& out, const at::Tensor& src, int64_t dim, const std::vector<int64_t>& pos,
               const std::vector<int64_t>& rows) {
  if (pos.empty()) return;
  const auto n = static_cast<int64_t>(pos.size());
  if (consecutive(pos, rows)) {
    out.narrow(dim, pos[0], n).copy_(src.narrow(dim, rows[0], n));
  } else {
    out.index_copy_(dim, index_tensor(pos, out), src.index_select(dim, index_tensor(rows, src)));
  }
}

// out[rows] += src[pos] along dim.
void add_rows(at::Tensor& out, const at::Tensor& src, int64_t dim, const std::vector<int64_t>& rows,
              const std::vector<int64_t>& pos) {
  if (pos.empty()) return;
  const auto n = static_cast<int64_t>(pos.size());
  if (consecutive(pos, rows)) {
    out.narrow(dim, rows[0], n).add_(src.narrow(dim, pos[0], n));
  } else {
    out.index_add_(dim, index_tensor(rows, out), src.index_select(dim, index_tensor(pos, src)));
  }
}

} // namespace

at::Tensor gather_rows(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                       const RowRequests& want, const Mesh& mesh, int64_t mesh_dim, double fill) {
  const auto n = mesh.size(mesh_dim);
  const auto me = mesh.coordinate(mesh_dim);
  const auto off = offsets_of(extents);
  if (self_contained(want, off)) {
    std::vector<int64_t> pos, rows;
    owned_by(want[me], off[me], off[me + 1], pos, rows);
    auto out = at::full(shape_with(local.sizes(), dim, static_cast<int64_t>(want[me].size())), fill, local.options());
    copy_rows(out, local, dim, pos, rows);
    return out;
  }
  // Own rows never travel: they are copied straight into the window; only halo rows are exchanged.
  std::vector<at::Tensor> send;
  for (int64_t r = 0; r < n; ++r) {
    std::vector<int64_t> pos, rows;
    if (r != me) owned_by(want[r], off[me], off[me + 1], pos, rows);
    send.push_back(rows.empty() ? local.narrow(dim, 0, 0) : local.index_select(dim, index_tensor(rows, local)));
  }
  std::vector<int64_t> recv_numels;
  std::vector<std::vector<int64_t>> recv_pos;
  for (int64_t o = 0; o < n; ++o) {
    std::vector<int64_t> pos, rows;
    if (o != me) owned_by(want[me], off[o], off[o + 1], pos, rows);
    recv_numels.push_back(numel_of(shape_with(local.sizes(), dim, static_cast<int64_t>(pos.size()))));
    recv_pos.push_back(pos);
  }
  auto chunks = all_to_all_flat(send, recv_numels, local.options(), mesh, mesh_dim);
  auto out = at::full(shape_with(local.sizes(), dim, static_cast<int64_t>(want[me].size())), fill, local.options());
  {
    std::vector<int64_t> pos, rows;
    owned_by(want[me], off[me], off[me + 1], pos, rows);
    copy_rows(out, local, dim, pos, rows);
  }
  for (int64_t o = 0; o < n; ++o) {
    if (recv_pos[o].empty()) continue;
    auto piece = chunks[o].view(shape_with(local.sizes(), dim, static_cast<int64_t>(recv_pos[o].size())));
    out.index_copy_(dim, index_tensor(recv_pos[o], out), piece);
  }
  return out;
}

at::Tensor scatter_add_rows(const at::Tensor& window, int64_t dim, const std::vector<int64_t>& extents,
                            const RowRequests& want, const Mesh& mesh, int64_t mesh_dim) {
  const auto n = mesh.size(mesh_dim);
  const auto me = mesh.coordinate(mesh_dim);
  const auto off = offsets_of(extents);
  if (self_contained(want, off)) {
    std::vector<int64_t> pos, rows;
    owned_by(want[me], off[me], off[me + 1], pos, rows);
    auto out = at::zeros(shape_with(window.sizes(), dim, extents[me]), window.options());
    add_rows(out, window, dim, rows, pos);
    return out;
  }
  std::vector<at::Tensor> send;
  for (int64_t o = 0; o < n; ++o) {
    std::vector<int64_t> pos, rows;
    if (o != me) owned_by(want[me], off[o], off[o + 1], pos, rows);
    send.push_back(pos.empty() ? window.narrow(dim, 0, 0) : window.index_select(dim, index_tensor(pos, window)));
  }
  std::vector<int64_t> recv_numels;
  std::vector<std::vector<int64_t>> recv_rows;
  for (int64_t r = 0; r < n; ++r) {
    std::vector<int64_t> pos, rows;
    if (r != me) owned_by(want[r], off[me], off[me + 1], pos, rows);
    recv_numels.push_back(numel_of(shape_with(window.sizes(), dim, static_cast<int64_t>(rows.size()))));
    recv_rows.push_back(rows);
  }
  auto chunks = all_to_all_flat(send, recv_numels, window.options(), mesh, mesh_dim);
  auto out = at::zeros(shape_with(window.sizes(), dim, extents[me]), window.options());
  {
    std::vector<int64_t> pos, rows;
    owned_by(want[me], off[me], off[me + 1], pos, rows);
    add_rows(out, window, dim, rows, pos);
  }
  for (int64_t r = 0; r < n; ++r) {
    if (recv_rows[r].empty()) continue;
    auto piece = chunks[r].view(shape_with(window.sizes(), dim, static_cast<int64_t>(recv_rows[r].size())));
    out.index_add_(dim, index_tensor(recv_rows[r], out), piece);
  }
  return out;
}

int64_t padded_index(int64_t pos, int64_t size, const std::string& mode) {
  if (pos >= 0 && pos < size) return pos;
  if (mode == "zeros" || mode == "constant" || size == 0) return -1;
  if (mode == "replicate") return pos < 0 ? 0 : size - 1;
  if (mode == "circular") return ((pos % size) + size) % size;
  // reflect (edge not repeated): period 2*(size-1)
  if (size == 1) return 0;
  const auto period = 2 * (size - 1);
  auto q = ((pos % period) + period) % period;
  return q < size ? q : period - q;
}

} // namespace shardtensor::comm
