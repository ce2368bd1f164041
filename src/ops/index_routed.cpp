// Routed reads of a sharded dim by a whole index (ops/index_routed.h).
#include "ops/index_routed.h"

#include "comm/collectives.h"
#include "comm/functional.h"
#include "ops/element_routing.h"

#include <shardtensor/simulation.h>

#include <ATen/ATen.h>
#include <shardtensor/mesh.h>

namespace shardtensor::ops {

namespace {

int64_t start_of(const RoutedRead& r, int64_t q) {
  int64_t s = 0;
  for (int64_t c = 0; c < q; ++c) s += r.take[c];
  return s;
}

// Reader q's part of index k: the index broadcast to the whole shape, narrowed along j to q's extent (a view).
at::Tensor part(const RoutedRead& r, int64_t k, int64_t q) {
  return r.idx[k].expand(r.shape).narrow(r.j, start_of(r, q), r.take[q]);
}

// The coordinate owning each entry of reader q's part.
at::Tensor owners(const RoutedRead& r, const DimLayout& l, int64_t q) {
  return owner_of(l, part(r, r.d, q).contiguous());
}

// The read tensor's dims in the order the owner reads them: the indexed dims first, then the others.
std::vector<int64_t> read_order(const RoutedRead& r) {
  std::vector<int64_t> order;
  for (int64_t k = 0; k < static_cast<int64_t>(r.idx.size()); ++k)
    if (r.idx[k].defined()) order.push_back(k);
  for (int64_t k = 0; k < static_cast<int64_t>(r.idx.size()); ++k)
    if (!r.idx[k].defined()) order.push_back(k);
  return order;
}

// The owner's local indices (one per indexed dim, in read order) of the entries of reader q's part at `coords`
// ([c, shape.size()], from nonzero); `off` is the owner's first row of dim d.
c10::List<std::optional<at::Tensor>> local_entries(const RoutedRead& r, int64_t q, const at::Tensor& coords,
                                                   int64_t off) {
  c10::List<std::optional<at::Tensor>> at_coords;
  for (const auto& c : coords.unbind(1)) at_coords.push_back(c);
  c10::List<std::optional<at::Tensor>> out;
  for (int64_t k = 0; k < static_cast<int64_t>(r.idx.size()); ++k) {
    if (!r.idx[k].defined()) continue;
    auto v = at::index(part(r, k, q), at_coords);
    out.push_back(k == r.d ? v - off : v);
  }
  return out;
}

// The sizes of the dims not indexed (their local extents), in order.
std::vector<int64_t> rest_shape(const RoutedRead& r, const at::Tensor& local) {
  std::vector<int64_t> rest;
  for (int64_t k = 0; k < local.dim(); ++k)
    if (!r.idx[k].defined()) rest.push_back(local.size(k));
  return rest;
}

std::vector<int64_t> part_shape(const RoutedRead& r, int64_t q) {
  auto s = r.shape;
  s[r.j] = r.take[q];
  return s;
}

// `rest` with a leading dim of `count` rows (explicit: with an empty row, -1 would be ambiguous).
std::vector<int64_t> rows_of(int64_t count, const std::vector<int64_t>& rest) {
  auto shape = rest;
  shape.insert(shape.begin(), count);
  return shape;
}

// How many entries of this rank's part each coordinate owns.
std::vector<int64_t> counts_by_owner(const at::Tensor& owner, int64_t n) {
  auto c = at::bincount(owner.reshape({-1}), {}, n).cpu();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + n};
}

} // namespace

void check_same_index(const std::vector<at::Tensor>& index, const Mesh& mesh, int64_t m, const std::string& what) {
  std::vector<int64_t> fp;
  for (const auto& t : index) {
    if (!t.defined()) continue;
    const auto flat = t.reshape({-1}).to(at::kLong);
    const auto weights = at::arange(flat.numel(), flat.options()).mul_(2).add_(1);
    fp.push_back(flat.numel());
    fp.push_back(flat.add(1).mul_(weights).sum().item<int64_t>());  // wraps on overflow, alike on every rank
  }
  const auto all = comm::all_gather_ints(fp, mesh, m, "a whole index's agreement check");
  for (const auto& row : all)
    TORCH_CHECK_VALUE(row == fp, "ShardTensor: ", what, ": the index holds different values on different ranks of "
                      "mesh dim ", m, "; a plain index tensor must be the same on every rank (seed random draws "
                      "alike on every rank, or pass the index as a ShardTensor)");
}

bool routed_reads_possible(const at::Tensor& local) {
  return !simulating() && !comm::tracing(local);
}

at::Tensor routed_read(const RoutedRead& r, const at::Tensor& local_in) {
  const auto& mesh = *r.spec->mesh;
  const auto n = mesh.size(r.m), me = mesh.coordinate(r.m);
  // Bool values travel as bytes (the transports move numbers).
  const bool is_bool = local_in.scalar_type() == at::kBool;
  const auto local = is_bool ? local_in.to(at::kByte) : local_in;
  check_same_index(r.idx, mesh, r.m, "a read by a whole index along split dim " + std::to_string(r.d));
  const auto l = dim_layout(*r.spec, r.m, r.idx[r.d].device());
  const auto off = r.spec->offset_of(r.m, me);
  const auto rest = rest_shape(r, local);
  const auto rest_numel = c10::multiply_integers(rest);
  const auto reader = local.permute(read_order(r));
  // As owner: what each reader's part names in this rank's rows, read from the block.
  std::vector<at::Tensor> send(n);
  at::Tensor own;
  for (int64_t q = 0; q < n; ++q) {
    auto coords = at::nonzero(owners(r, l, q) == me);
    auto vals = at::index(reader, local_entries(r, q, coords, off));
    if (q == me) {
      own = vals;
      send[q] = vals.new_empty({0});
    } else {
      send[q] = vals.contiguous().reshape({-1});
    }
  }
  // As reader: how many entries each owner sends, and where they go in this rank's part.
  const auto mine = owners(r, l, me).reshape({-1});
  const auto counts = counts_by_owner(mine, n);
  std::vector<int64_t> recv(n, 0);
  for (int64_t s = 0; s < n; ++s)
    if (s != me) recv[s] = counts[s] * rest_numel;
  const auto got = comm::all_to_all_flat(send, recv, local.options(), mesh, r.m);
  auto block = at::empty(rows_of(mine.numel(), rest), local.options());
  for (int64_t s = 0; s < n; ++s) {
    if (counts[s] == 0) continue;
    auto pos = at::nonzero(mine == s).select(1, 0);
    block.index_copy_(0, pos, s == me ? own : got[s].view(rows_of(counts[s], rest)));
  }
  auto shape = part_shape(r, me);
  shape.insert(shape.end(), rest.begin(), rest.end());
  block = block.view(shape);
  return is_bool ? block.to(at::kBool) : block;
}

void routed_accumulate(const RoutedRead& r, const at::Tensor& grad, at::Tensor& out) {
  const auto& mesh = *r.spec->mesh;
  const auto n = mesh.size(r.m), me = mesh.coordinate(r.m);
  const auto l = dim_layout(*r.spec, r.m, r.idx[r.d].device());
  const auto off = r.spec->offset_of(r.m, me);
  const auto rest = rest_shape(r, out);
  const auto rest_numel = c10::multiply_integers(rest);
  // As reader: each entry's gradient goes back to the owner of the entry it read.
  const auto mine = owners(r, l, me).reshape({-1});
  const auto counts = counts_by_owner(mine, n);
  const auto rows = grad.reshape(rows_of(mine.numel(), rest));
  std::vector<at::Tensor> send(n);
  at::Tensor own;
  for (int64_t s = 0; s < n; ++s) {
    auto vals = rows.index_select(0, at::nonzero(mine == s).select(1, 0));
    if (s == me) {
      own = vals;
      send[s] = vals.new_empty({0});
    } else {
      send[s] = vals.contiguous().reshape({-1});
    }
  }
  // As owner: what each reader sends back, for the entries of its part this rank owns (known from the index).
  std::vector<at::Tensor> coords(n);
  std::vector<int64_t> recv(n, 0);
  for (int64_t q = 0; q < n; ++q) {
    coords[q] = at::nonzero(owners(r, l, q) == me);
    if (q != me) recv[q] = coords[q].size(0) * rest_numel;
  }
  const auto got = comm::all_to_all_flat(send, recv, grad.options(), mesh, r.m);
  auto target = out.permute(read_order(r));
  for (int64_t q = 0; q < n; ++q) {
    if (coords[q].size(0) == 0) continue;
    target.index_put_(local_entries(r, q, coords[q], off),
                      q == me ? own : got[q].view(rows_of(coords[q].size(0), rest)),
                      /*accumulate=*/true);
  }
}

} // namespace shardtensor::ops
