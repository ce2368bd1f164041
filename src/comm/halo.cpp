#include "comm/halo.h"

#include "comm/collectives.h"

#include <ATen/ATen.h>

#ifdef SHARDTENSOR_HAVE_CUDA
#include "halo_pack.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

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

// Who sends which rows to whom, from this rank's point of view (the same plan serves gather_rows and its adjoint).
struct ExchangePlan {
  bool local_only = false;             // no rank needs another rank's rows
  std::vector<int64_t> own_pos, own_rows;                 // this rank's window positions of its own rows
  std::vector<std::vector<int64_t>> to_peer_rows;          // [peer] my local rows that peer's window names
  std::vector<std::vector<int64_t>> from_peer_pos;         // [peer] my window positions that peer owns
};

ExchangePlan plan_exchange(const RowRequests& want, const std::vector<int64_t>& extents, int64_t me) {
  const auto off = offsets_of(extents);
  const auto n = static_cast<int64_t>(extents.size());
  ExchangePlan p;
  p.local_only = self_contained(want, off);
  owned_by(want[me], off[me], off[me + 1], p.own_pos, p.own_rows);
  p.to_peer_rows.resize(n);
  p.from_peer_pos.resize(n);
  if (p.local_only) return p;
  for (int64_t r = 0; r < n; ++r) {
    if (r == me) continue;
    std::vector<int64_t> pos, rows;
    owned_by(want[r], off[me], off[me + 1], pos, rows);
    p.to_peer_rows[r] = std::move(rows);
    std::vector<int64_t> pos2, rows2;
    owned_by(want[me], off[r], off[r + 1], pos2, rows2);
    p.from_peer_pos[r] = std::move(pos2);
  }
  return p;
}

// [outer, dim, inner] factorization of a shape around `dim`.
std::pair<int64_t, int64_t> outer_inner(at::IntArrayRef shape, int64_t dim) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) (d < dim ? outer : inner) *= d == dim ? 1 : shape[d];
  return {outer, inner};
}

// Slices of `t` along `dim` at `index` (an empty slice for no index), packed contiguously for the collective. CUDA
// tensors use the halo pack kernel of csrc_cuda/.
at::Tensor select_rows(const at::Tensor& t, int64_t dim, const std::vector<int64_t>& index) {
  if (index.empty()) return t.narrow(dim, 0, 0);
#ifdef SHARDTENSOR_HAVE_CUDA
  if (t.is_cuda()) {
    c10::cuda::CUDAGuard guard(t.device());
    auto src = t.contiguous();
    auto idx = index_tensor(index, src);
    auto out = at::empty(shape_with(src.sizes(), dim, static_cast<int64_t>(index.size())), src.options());
    auto [outer, inner] = outer_inner(src.sizes(), dim);
    cuda::pack_rows(src.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>(), static_cast<int64_t>(index.size()), outer,
                    src.size(dim), inner, static_cast<int64_t>(src.element_size()),
                    c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
    return out;
  }
#endif
  return t.index_select(dim, index_tensor(index, t));
}

// out[rows] += piece along `dim` (rows may repeat). CUDA float/double tensors use the atomic add kernel.
void add_into_rows(at::Tensor& out, int64_t dim, const std::vector<int64_t>& rows, const at::Tensor& piece) {
#ifdef SHARDTENSOR_HAVE_CUDA
  if (out.is_cuda() && out.is_contiguous() &&
      (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble)) {
    c10::cuda::CUDAGuard guard(out.device());
    auto src = piece.contiguous().to(out.scalar_type());
    auto idx = index_tensor(rows, out);
    auto [outer, inner] = outer_inner(out.sizes(), dim);
    cuda::add_rows(src.data_ptr(), out.data_ptr(), idx.data_ptr<int64_t>(), static_cast<int64_t>(rows.size()), outer,
                   out.size(dim), inner, out.scalar_type() == at::kDouble,
                   c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
    return;
  }
#endif
  out.index_add_(dim, index_tensor(rows, out), piece);
}

// One all-to-all: pieces[j] to peer j; returns what each peer sent, shaped like `like` with `counts[j]` rows.
std::vector<at::Tensor> exchange(const std::vector<at::Tensor>& pieces, const at::Tensor& like, int64_t dim,
                                 const std::vector<size_t>& counts, const Mesh& mesh, int64_t mesh_dim) {
  std::vector<int64_t> recv_numels;
  for (auto c : counts) recv_numels.push_back(numel_of(shape_with(like.sizes(), dim, static_cast<int64_t>(c))));
  auto chunks = all_to_all_flat(pieces, recv_numels, like.options(), mesh, mesh_dim);
  std::vector<at::Tensor> out;
  for (size_t j = 0; j < counts.size(); ++j)
    out.push_back(chunks[j].view(shape_with(like.sizes(), dim, static_cast<int64_t>(counts[j]))));
  return out;
}

} // namespace

PendingRows gather_rows_start(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                              const RowRequests& want, const Mesh& mesh, int64_t mesh_dim, double fill) {
  const auto me = mesh.coordinate(mesh_dim);
  auto plan = plan_exchange(want, extents, me);
  PendingRows p;
  p.dim = dim;
  p.window = at::full(shape_with(local.sizes(), dim, static_cast<int64_t>(want[me].size())), fill, local.options());
  // Own rows never travel: they are copied straight into the window; only halo rows are exchanged.
  copy_rows(p.window, local, dim, plan.own_pos, plan.own_rows);
  if (plan.local_only) return p;
  std::vector<at::Tensor> send;
  std::vector<int64_t> recv_numels;
  for (size_t r = 0; r < plan.to_peer_rows.size(); ++r) {
    send.push_back(select_rows(local, dim, plan.to_peer_rows[r]));
    recv_numels.push_back(numel_of(shape_with(local.sizes(), dim, static_cast<int64_t>(plan.from_peer_pos[r].size()))));
  }
  p.from_peer_pos = std::move(plan.from_peer_pos);
  p.exchange = all_to_all_flat_start(send, recv_numels, local.options(), mesh, mesh_dim);
  p.posted = true;
  return p;
}

at::Tensor gather_rows_finish(PendingRows& p) {
  if (!p.posted) return p.window;
  auto chunks = finish_all_to_all(p.exchange);
  p.posted = false;
  for (size_t o = 0; o < chunks.size(); ++o) {
    if (p.from_peer_pos[o].empty()) continue;
    auto piece = chunks[o].view(shape_with(p.window.sizes(), p.dim, static_cast<int64_t>(p.from_peer_pos[o].size())));
    p.window.index_copy_(p.dim, index_tensor(p.from_peer_pos[o], p.window), piece);
  }
  return p.window;
}

at::Tensor gather_rows(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents,
                       const RowRequests& want, const Mesh& mesh, int64_t mesh_dim, double fill) {
  auto pending = gather_rows_start(local, dim, extents, want, mesh, mesh_dim, fill);
  return gather_rows_finish(pending);
}

at::Tensor scatter_add_rows(const at::Tensor& window, int64_t dim, const std::vector<int64_t>& extents,
                            const RowRequests& want, const Mesh& mesh, int64_t mesh_dim) {
  const auto me = mesh.coordinate(mesh_dim);
  const auto plan = plan_exchange(want, extents, me);
  auto out = at::zeros(shape_with(window.sizes(), dim, extents[me]), window.options());
  add_rows(out, window, dim, plan.own_rows, plan.own_pos);
  if (plan.local_only) return out;
  // The adjoint exchange: my window's halo rows go back to their owners; I receive my rows named by peers.
  std::vector<at::Tensor> send;
  std::vector<size_t> counts;
  for (size_t o = 0; o < plan.from_peer_pos.size(); ++o) {
    send.push_back(select_rows(window, dim, plan.from_peer_pos[o]));
    counts.push_back(plan.to_peer_rows[o].size());
  }
  auto pieces = exchange(send, window, dim, counts, mesh, mesh_dim);
  for (size_t r = 0; r < pieces.size(); ++r)
    if (!plan.to_peer_rows[r].empty()) add_into_rows(out, dim, plan.to_peer_rows[r], pieces[r]);
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
