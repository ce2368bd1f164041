#include "ops/attention_seq.h"

#include <shardtensor/attention.h>
#include <shardtensor/shard_tensor.h>

namespace shardtensor::ops::attention {

namespace {

SeqLayout contiguous_layout(const std::vector<int64_t>& ext) {
  SeqLayout s;
  s.ext = ext;
  int64_t off = 0;
  for (auto e : ext) {
    s.segments.push_back({Segment{0, e, off}});
    off += e;
  }
  s.contiguous_ext = ext;
  return s;
}

SeqLayout zigzag_layout(int64_t seq, const std::vector<int64_t>& contiguous_ext) {
  const auto n = static_cast<int64_t>(contiguous_ext.size());
  SeqLayout s;
  s.zigzag = true;
  s.contiguous_ext = contiguous_ext;
  auto chunk = default_split(seq, 2 * n);
  std::vector<int64_t> chunk_off(2 * n + 1, 0);
  for (int64_t j = 0; j < 2 * n; ++j) chunk_off[j + 1] = chunk_off[j] + chunk[j];
  // Position of every global row in the zigzag order (coordinate by coordinate, early chunk first).
  std::vector<int64_t> zig_pos(seq);
  int64_t pos = 0;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t a = c, b = 2 * n - 1 - c;
    s.segments.push_back({Segment{0, chunk[a], chunk_off[a]}, Segment{chunk[a], chunk[b], chunk_off[b]}});
    s.ext.push_back(chunk[a] + chunk[b]);
    std::vector<int64_t> want;
    for (auto j : {a, b})
      for (int64_t g = chunk_off[j]; g < chunk_off[j + 1]; ++g) {
        want.push_back(g);
        zig_pos[g] = pos++;
      }
    s.to_zigzag.push_back(std::move(want));
  }
  int64_t g = 0;
  for (int64_t c = 0; c < n; ++c) {
    std::vector<int64_t> want;
    for (int64_t i = 0; i < contiguous_ext[c]; ++i) want.push_back(zig_pos[g++]);
    s.to_contiguous.push_back(std::move(want));
  }
  return s;
}

// A permutation by gather_rows, whose adjoint is the gather in the other direction. Tensors of one dtype travel
// together: each is viewed sequence-major as rows (S, rest) and the rows are concatenated.
std::vector<at::Tensor> permute_seq(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& from_ext,
                                    const comm::RowRequests& want, const Layout& l) {
  const auto d = l.nd - 2;
  std::vector<at::Tensor> out(ts.size());
  std::vector<bool> done(ts.size(), false);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (done[i]) continue;
    std::vector<size_t> group;
    std::vector<at::Tensor> rows;
    for (size_t j = i; j < ts.size(); ++j)
      if (!done[j] && ts[j].scalar_type() == ts[i].scalar_type()) {
        group.push_back(j);
        done[j] = true;
        rows.push_back(ts[j].movedim(d, 0).flatten(1));
      }
    std::vector<int64_t> widths;
    for (const auto& r : rows) widths.push_back(r.size(1));
    auto packed = rows.size() == 1 ? rows[0] : at::cat(rows, 1);
    rows.clear();  // the packed copy is all that travels: free the per-tensor row views' copies now
    auto moved = comm::gather_rows(packed, 0, from_ext, want, *l.mesh, l.seq_mesh_dim);
    packed.reset();
    int64_t col = 0;
    for (size_t g = 0; g < group.size(); ++g) {
      auto shape = ts[group[g]].movedim(d, 0).sizes().vec();
      shape[0] = moved.size(0);
      // A view into the received buffer (the kernels and the ring take strided tensors).
      out[group[g]] = moved.narrow(1, col, widths[g]).view(shape).movedim(0, d);
      col += widths[g];
    }
  }
  return out;
}

} // namespace

Layout layout_of(const at::Tensor& q, const at::Tensor& k) {
  Layout l;
  const auto& qs = *shard_impl(q)->spec();
  const auto& ks = *shard_impl(k)->spec();
  l.mesh = qs.mesh;
  l.nd = q.dim();
  for (int64_t m = 0; m < l.mesh->ndim(); ++m) {
    const bool qq = qs.placements[m].is_shard(l.nd - 2), kk = ks.placements[m].is_shard(l.nd - 2);
    if (qq || kk) {
      l.seq_mesh_dim = m;
      l.q_seq = qq;
      l.kv_ring = kk;
    }
  }
  return l;
}

std::vector<int64_t> with_dim(at::IntArrayRef shape, int64_t d, int64_t v) {
  auto s = shape.vec();
  s[d] = v;
  return s;
}

bool use_zigzag(const Layout& l, const ShardSpec& qs, const ShardSpec& ks, bool causal, bool has_mask) {
  if (!causal || has_mask || !l.q_seq || !l.kv_ring) return false;
  if (l.mesh->size(l.seq_mesh_dim) < 2 || attention_strategy() == AttentionStrategy::RingContiguous) return false;
  const auto d = l.nd - 2;
  return qs.global_shape[d] == ks.global_shape[d] && qs.extents[l.seq_mesh_dim] == ks.extents[l.seq_mesh_dim];
}

SeqLayout seq_layout(const Layout& l, const ShardSpec& ks, bool zigzag) {
  const auto d = l.nd - 2;
  if (zigzag) return zigzag_layout(ks.global_shape[d], ks.extents[l.seq_mesh_dim]);
  if (l.kv_ring) return contiguous_layout(ks.extents[l.seq_mesh_dim]);
  return contiguous_layout({ks.global_shape[d]});  // k/v whole: one block
}

std::vector<at::Tensor> to_zigzag(const std::vector<at::Tensor>& ts, const SeqLayout& s, const Layout& l) {
  return permute_seq(ts, s.contiguous_ext, s.to_zigzag, l);
}

std::vector<at::Tensor> to_contiguous(const std::vector<at::Tensor>& ts, const SeqLayout& s, const Layout& l) {
  return permute_seq(ts, s.ext, s.to_contiguous, l);
}

} // namespace shardtensor::ops::attention
