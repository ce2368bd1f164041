// torch-harmonics' discrete-continuous (DISCO) convolutions on the sphere, over a field split along latitude: the
// kernels `disco_kernels::forward` (contraction: (B, C, Hi, Wi) -> (B, C, K, Ho, Wo)) and `disco_kernels::backward`
// (its transpose: (B, C, K, Hi, Wi) -> (B, C, Ho, Wo)), and the custom ops wrapping them
// (`_disco_s2_contraction_optimized`, `_disco_s2_transpose_contraction_optimized`), bound when torch-harmonics
// defines them. Its local spherical neural operators, spherical U-Net and the DISCO encoders/decoders of spherical
// transformers are built from them.
//
// The filter tensor psi is a sparse matrix in CSR form: each CSR row is one (kernel index k, latitude row h) of the
// five-dimensional side, its entries name positions (row * W + longitude) of the four-dimensional side, and the
// kernel applies every entry at all longitudes by a shift. A filter has compact support (a geodesic disc), so a
// latitude row of the five-dimensional side reads a contiguous band of the other side's rows: with the field split
// along latitude, each rank computes its own rows of the five-dimensional side from the band its rows read (its
// window: one neighbour exchange of the rows it lacks, comm/halo_plan.h), or, in the transpose, writes its window
// of the four-dimensional side and sends the rows other ranks own home, summed (the adjoint). The kernel runs on
// a psi cut to the rank's CSR rows, its rows and columns renumbered to its block and window (built once per psi
// and layout, cached). Rows of the output side are owned in proportion to the input's split (the same split when
// both grids are alike). Longitude must stay whole (the shift wraps around it): a split longitude declines to the
// fallback, and so do torch-harmonics' fused and k-packed CUDA variants, which take psi in other layouts.
#include "comm/halo_plan.h"
#include "dispatch/registry.h"
#include "dispatch/rule_family.h"
#include "ops/common.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <list>
#include <mutex>

namespace shardtensor::ops {

namespace {

// The CSR operands, in the kernels' argument order (arguments 1-5).
struct Psi {
  at::Tensor roff, ker, row, col, vals;
};

// Rows of the output side per coordinate, in proportion to the input side's split: the boundary before coordinate
// c at floor(offset_c * to / from), so equal grids keep the split and a halving grid halves it.
std::vector<int64_t> proportional_extents(const std::vector<int64_t>& extents, int64_t from, int64_t to) {
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

// One split contraction: the windows every coordinate's CSR rows read on the four-dimensional side, the exchange
// that moves them, and this rank's psi.
struct DiscoPlan {
  std::vector<int64_t> csr_extents;    // rows of the five-dimensional side per coordinate
  std::vector<int64_t> dense_extents;  // rows of the four-dimensional side per coordinate
  comm::HaloPlan halo;
  int64_t window_rows = 0;
  Psi local;
};

struct PlanEntry {
  std::vector<const void*> psi;  // the psi tensors' TensorImpls (kept alive by `keep`, so never reused)
  std::vector<uint32_t> versions;
  std::vector<int64_t> key;      // sizes and layout
  Psi keep;
  std::shared_ptr<const DiscoPlan> plan;
};

DiscoPlan make_plan(const Psi& psi, int64_t dense_rows, int64_t dense_width, int64_t csr_rows,
                    const std::vector<int64_t>& csr_extents, const std::vector<int64_t>& dense_extents,
                    int64_t mesh_dim, int64_t dense_dim, const std::vector<int64_t>& coordinates, c10::Device device) {
  DiscoPlan plan;
  plan.csr_extents = csr_extents;
  plan.dense_extents = dense_extents;
  const auto roff = psi.roff.to(at::kCPU, at::kLong).contiguous();
  const auto row = psi.row.to(at::kCPU, at::kLong).contiguous();
  const auto col = psi.col.to(at::kCPU, at::kLong).contiguous();
  const auto* roff_p = roff.data_ptr<int64_t>();
  const auto* row_p = row.data_ptr<int64_t>();
  const auto* col_p = col.data_ptr<int64_t>();
  const auto nnr = roff.numel() - 1;
  // The band of four-dimensional rows each five-dimensional row reads.
  std::vector<int64_t> lo(csr_rows, std::numeric_limits<int64_t>::max()), hi(csr_rows, -1);
  for (int64_t r = 0; r < nnr; ++r) {
    if (roff_p[r] == roff_p[r + 1]) continue;
    const auto h = row_p[roff_p[r]];
    TORCH_CHECK_VALUE(h >= 0 && h < csr_rows, "DISCO convolution: psi names row ", h, " of ", csr_rows);
    for (auto z = roff_p[r]; z < roff_p[r + 1]; ++z) {
      const auto d = col_p[z] / dense_width;
      TORCH_CHECK_VALUE(d >= 0 && d < dense_rows, "DISCO convolution: psi names row ", d, " of ", dense_rows);
      lo[h] = std::min(lo[h], d);
      hi[h] = std::max(hi[h], d);
    }
  }
  const auto me = coordinates[mesh_dim];
  comm::RowRequests want(csr_extents.size());
  int64_t first = 0, my_first = 0, my_lo = 0;
  for (size_t c = 0; c < csr_extents.size(); ++c) {
    int64_t band_lo = std::numeric_limits<int64_t>::max(), band_hi = -1;
    for (auto h = first; h < first + csr_extents[c]; ++h) band_lo = std::min(band_lo, lo[h]), band_hi = std::max(band_hi, hi[h]);
    for (auto d = band_lo; d <= band_hi; ++d) want[c].push_back(d);
    if (static_cast<int64_t>(c) == me) my_first = first, my_lo = band_hi >= 0 ? band_lo : 0;
    first += csr_extents[c];
  }
  plan.window_rows = static_cast<int64_t>(want[me].size());
  plan.halo = comm::HaloPlan({comm::HaloDim{dense_dim, mesh_dim, dense_extents, std::move(want)}}, coordinates, device);
  // This rank's CSR rows, renumbered: rows from its first, columns from its window's first row.
  std::vector<int64_t> new_roff{0}, new_ker, new_row, new_col, keep;
  const auto ker = psi.ker.to(at::kCPU, at::kLong).contiguous();
  const auto* ker_p = ker.data_ptr<int64_t>();
  for (int64_t r = 0; r < nnr; ++r) {
    if (roff_p[r] == roff_p[r + 1]) continue;
    const auto h = row_p[roff_p[r]];
    if (h < my_first || h >= my_first + csr_extents[me]) continue;
    for (auto z = roff_p[r]; z < roff_p[r + 1]; ++z) {
      new_ker.push_back(ker_p[z]);
      new_row.push_back(row_p[z] - my_first);
      new_col.push_back(col_p[z] - my_lo * dense_width);
      keep.push_back(z);
    }
    new_roff.push_back(static_cast<int64_t>(new_ker.size()));
  }
  auto index = [&](const std::vector<int64_t>& v, const at::Tensor& like) {
    return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(like.device(), like.scalar_type());
  };
  plan.local.roff = index(new_roff, psi.roff);
  plan.local.ker = index(new_ker, psi.ker);
  plan.local.row = index(new_row, psi.row);
  plan.local.col = index(new_col, psi.col);
  plan.local.vals = psi.vals.index_select(0, index(keep, psi.vals).to(at::kLong));
  return plan;
}

// Plans by psi and layout; the psi tensors are held, so an entry's identity is never another tensor's.
std::shared_ptr<const DiscoPlan> cached_disco_plan(const Psi& psi, std::vector<int64_t> key,
                                                   const std::function<DiscoPlan()>& make) {
  static std::mutex mutex;
  static std::list<PlanEntry> entries;
  constexpr size_t kCapacity = 32;
  const std::vector<const at::Tensor*> tensors{&psi.roff, &psi.ker, &psi.row, &psi.col, &psi.vals};
  std::vector<const void*> ids;
  std::vector<uint32_t> versions;
  for (const auto* t : tensors) {
    ids.push_back(t->unsafeGetTensorImpl());
    versions.push_back(t->_version());
  }
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = entries.begin(); it != entries.end(); ++it)
    if (it->psi == ids && it->versions == versions && it->key == key) {
      entries.splice(entries.begin(), entries, it);
      return it->plan;
    }
  auto plan = std::make_shared<const DiscoPlan>(make());
  entries.push_front(PlanEntry{std::move(ids), std::move(versions), std::move(key), psi, plan});
  if (entries.size() > kCapacity) entries.pop_back();
  return plan;
}

const c10::OperatorHandle& kernel_op(bool forward) {
  static const auto fwd = c10::Dispatcher::singleton().findSchemaOrThrow("disco_kernels::forward", "");
  static const auto bwd = c10::Dispatcher::singleton().findSchemaOrThrow("disco_kernels::backward", "");
  return forward ? fwd : bwd;
}

at::Tensor call_kernel(bool forward, const at::Tensor& t, const Psi& psi, int64_t K, int64_t H, int64_t W) {
  torch::jit::Stack stack{t, psi.roff, psi.ker, psi.row, psi.col, psi.vals, K, H, W};
  kernel_op(forward).callBoxed(&stack);
  return stack.back().toTensor();
}

// disco_kernels::forward / backward(Tensor inp, Tensor roff_idx, Tensor ker_idx, Tensor row_idx, Tensor col_idx,
//                                   Tensor vals, int K, int Ho, int Wo) -> Tensor
void contraction(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool forward) {
  const auto base = stack->size() - 9;
  auto at_arg = [&](size_t i) -> c10::IValue& { return (*stack)[base + i]; };
  for (size_t i = 1; i <= 5; ++i)
    if (shard_impl(at_arg(i).toTensor()))
      dispatch::not_implemented(op, stack, "psi (roff_idx, ker_idx, row_idx, col_idx, vals) is a ShardTensor; the "
                                           "filter is a module buffer, pass it plain");
  auto input = at_arg(0).toTensor();
  TORCH_CHECK_VALUE(shard_impl(input), dispatch::qualified_name(op), ": expected the input to be the ShardTensor");
  TORCH_CHECK_VALUE(input.dim() == (forward ? 4 : 5), dispatch::qualified_name(op), ": expected a ",
                    forward ? 4 : 5, "-D input, got ", input.dim(), "-D");
  // The split dims the kernel allows: batch and channels (local), latitude (the band exchange). Longitude and the
  // kernel index decline.
  const auto row_dim = forward ? 2 : 3;
  const auto& in_spec = *shard_impl(input)->spec();
  int64_t mesh_dim = -1;
  for (size_t m = 0; m < in_spec.placements.size(); ++m) {
    const auto& p = in_spec.placements[m];
    if (!p.is_shard() || p.dim <= 1) continue;
    if (p.dim != row_dim || mesh_dim >= 0)
      dispatch::not_implemented(op, stack, "a DISCO convolution splits batch, channels and latitude only (longitude "
                                           "wraps around in the kernel); redistribute that dim to Replicate()");
    mesh_dim = static_cast<int64_t>(m);
  }
  const Psi psi{at_arg(1).toTensor(), at_arg(2).toTensor(), at_arg(3).toTensor(), at_arg(4).toTensor(),
                at_arg(5).toTensor()};
  const auto K = at_arg(6).toInt(), Ho = at_arg(7).toInt(), Wo = at_arg(8).toInt();
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  if (in_spec.has_partial()) input = resolve_partial(input);
  const auto& spec = *shard_impl(input)->spec();
  const auto& local = shard_impl(input)->local();
  // The output: (B, C, K, Ho, Wo) forward, (B, C, Ho, Wo) backward; batch and channel shards carry over.
  std::vector<int64_t> out_shape{spec.global_shape[0], spec.global_shape[1]};
  if (forward) out_shape.push_back(K);
  out_shape.push_back(Ho);
  out_shape.push_back(Wo);
  Placements out_pl;
  for (const auto& p : spec.placements) out_pl.push_back(p.is_shard() && p.dim <= 1 ? p : Placement::replicate());
  DimExtents out_ext;
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_shard() && spec.placements[m].dim <= 1) out_ext[spec.placements[m].dim] = spec.extents[m];
  if (mesh_dim < 0) {
    auto out = call_kernel(forward, local.contiguous(), psi, K, Ho, Wo);
    stack->emplace_back(wrap(out, spec.mesh, out_pl, out_shape, out_ext));
    return;
  }
  // Forward: the input is the four-dimensional (dense) side, split as given; the output's rows follow. Backward:
  // the input's rows are the CSR side; the output's rows (the dense side) follow.
  const auto& in_ext = spec.extents[mesh_dim];
  const auto dense_rows = forward ? spec.global_shape[2] : Ho;
  const auto dense_width = forward ? spec.global_shape[3] : Wo;
  const auto csr_rows = forward ? Ho : spec.global_shape[3];
  const auto csr_ext = forward ? proportional_extents(in_ext, dense_rows, csr_rows) : in_ext;
  const auto dense_ext = forward ? in_ext : proportional_extents(in_ext, csr_rows, dense_rows);
  std::vector<int64_t> key{forward ? 1 : 0,
                           dense_rows,
                           dense_width,
                           csr_rows,
                           mesh_dim,
                           static_cast<int64_t>(local.device().type()),
                           static_cast<int64_t>(local.device().index()),
                           spec.mesh->coordinate(mesh_dim)};
  key.insert(key.end(), in_ext.begin(), in_ext.end());
  auto plan = cached_disco_plan(psi, key, [&] {
    return make_plan(psi, dense_rows, dense_width, csr_rows, csr_ext, dense_ext, mesh_dim, 2,
                     spec.mesh->coordinates(), local.device());
  });
  const auto me = spec.mesh->coordinate(mesh_dim);
  if (forward) {
    auto window = plan->halo.gather(local, *spec.mesh);
    auto out = call_kernel(true, window.contiguous(), plan->local, K, plan->csr_extents[me], Wo);
    out_pl[mesh_dim] = Placement::shard(3);
    out_ext[3] = plan->csr_extents;
    stack->emplace_back(wrap(out, spec.mesh, out_pl, out_shape, out_ext));
    return;
  }
  auto out_window = call_kernel(false, local.contiguous(), plan->local, K, plan->window_rows, Wo);
  auto out = plan->halo.scatter_add(out_window, *spec.mesh, /*consume=*/true);
  out_pl[mesh_dim] = Placement::shard(2);
  out_ext[2] = plan->dense_extents;
  stack->emplace_back(wrap(out, spec.mesh, out_pl, out_shape, out_ext));
}

// The custom ops torch-harmonics wraps the kernels in (its Python body: the kernel with psi's values in the compute
// dtype, fp32 for half inputs, and the result in the input's dtype): the same on ShardTensors, the kernel's rule.
void contraction_op(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool forward) {
  const auto base = stack->size() - 9;
  const auto input = (*stack)[base].toTensor();
  const auto itype = input.scalar_type();
  const auto ctype = itype == at::kHalf || itype == at::kBFloat16 ? at::kFloat : itype;
  auto& vals = (*stack)[base + 5];
  if (vals.isTensor() && !shard_impl(vals.toTensor())) vals = vals.toTensor().to(ctype);
  kernel_op(forward).callBoxed(stack);
  auto& out = stack->back();
  if (out.toTensor().scalar_type() != itype) out = out.toTensor().to(itype);
  (void)op;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(torch_harmonics_disco) {
  dispatch::set_handler_when_defined(
      "disco_kernels::forward", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { contraction(op, s, true); });
  dispatch::set_handler_when_defined(
      "disco_kernels::backward", [](const c10::OperatorHandle& op, torch::jit::Stack* s) { contraction(op, s, false); });
  dispatch::set_handler_when_defined(
      "disco_kernels::_disco_s2_contraction_optimized",
      [](const c10::OperatorHandle& op, torch::jit::Stack* s) { contraction_op(op, s, true); });
  dispatch::set_handler_when_defined(
      "disco_kernels::_disco_s2_transpose_contraction_optimized",
      [](const c10::OperatorHandle& op, torch::jit::Stack* s) { contraction_op(op, s, false); });
}

} // namespace shardtensor::ops
