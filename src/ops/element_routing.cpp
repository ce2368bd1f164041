// Element routing (ops/element_routing.h).
#include "ops/element_routing.h"

#include "comm/collectives.h"

#include <ATen/ATen.h>

namespace shardtensor::ops {

DimLayout dim_layout(const ShardSpec& spec, int64_t m, const c10::Device& device) {
  DimLayout l;
  const auto n = spec.mesh->size(m);
  for (int64_t c = 0; c < n; ++c) l.starts.push_back(spec.offset_of(m, c));
  auto opts = at::TensorOptions().dtype(at::kLong);
  l.starts_t = at::tensor(l.starts, opts).to(device);
  l.extents_t = at::tensor(spec.extents[m], opts).to(device);
  return l;
}

at::Tensor owner_of(const DimLayout& l, const at::Tensor& rows) {
  // The last coordinate starting at or before the row.
  return at::searchsorted(l.starts_t, rows, /*out_int32=*/false, /*right=*/true).sub_(1);
}

std::pair<at::Tensor, at::Tensor> route_elements(const at::Tensor& values, const at::Tensor& ints,
                                                 const at::Tensor& dest, const Mesh& mesh, int64_t m, const char* what,
                                                 bool invalid, const std::string& error) {
  const auto n = mesh.size(m), me = mesh.coordinate(m);
  const auto cols = ints.size(1);
  const bool with_values = values.defined();
  auto order = std::get<1>(dest.sort(/*stable=*/std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  // An invalid rank's destinations may be out of range: it sends nothing, and nobody sends after the raise.
  auto counts_t = invalid ? at::zeros({n}, at::kLong) : at::bincount(dest, {}, n).cpu();
  std::vector<int64_t> counts(counts_t.data_ptr<int64_t>(), counts_t.data_ptr<int64_t>() + n);
  counts.push_back(invalid ? 1 : 0);
  // Bool values travel as bytes (the transports move numbers).
  at::Tensor wire;
  if (with_values) wire = (values.scalar_type() == at::kBool ? values.to(at::kByte) : values).index_select(0, order);
  auto row_shape = with_values ? values.sizes().vec() : std::vector<int64_t>{0};
  const auto row_numel = c10::multiply_integers(row_shape.begin() + 1, row_shape.end());
  auto i = ints.index_select(0, order);
  const auto all = comm::all_gather_ints(counts, mesh, m, what);
  for (const auto& row : all) TORCH_CHECK_INDEX(row[n] == 0, error);
  std::vector<at::Tensor> send_v(n), send_i(n);
  at::Tensor own_v, own_i;
  std::vector<int64_t> recv_v(n, 0), recv_i(n, 0);
  int64_t first = 0;
  for (int64_t d = 0; d < n; ++d) {
    auto pi = i.narrow(0, first, counts[d]);
    at::Tensor pv = with_values ? wire.narrow(0, first, counts[d]) : at::Tensor();
    first += counts[d];
    if (d == me) {
      own_v = pv;
      own_i = pi;
      if (with_values) send_v[d] = pv.narrow(0, 0, 0).reshape({-1});
      send_i[d] = pi.narrow(0, 0, 0).reshape({-1});
      continue;
    }
    if (with_values) send_v[d] = pv.contiguous().reshape({-1});
    send_i[d] = pi.contiguous().reshape({-1});
    recv_v[d] = all[d][me] * row_numel;
    recv_i[d] = all[d][me] * cols;
  }
  std::vector<at::Tensor> got_v;
  if (with_values) got_v = comm::all_to_all_flat(send_v, recv_v, wire.options(), mesh, m);
  auto got_i = comm::all_to_all_flat(send_i, recv_i, ints.options(), mesh, m);
  std::vector<at::Tensor> out_v, out_i;
  for (int64_t s = 0; s < n; ++s) {
    if (with_values) {
      row_shape[0] = all[s][me];
      out_v.push_back(s == me ? own_v : got_v[s].view(row_shape));
    }
    out_i.push_back(s == me ? own_i : got_i[s].view({-1, cols}));
  }
  at::Tensor rv;
  if (with_values) {
    rv = at::cat(out_v);
    if (values.scalar_type() == at::kBool) rv = rv.to(at::kBool);
  }
  return {rv, at::cat(out_i)};
}

} // namespace shardtensor::ops
