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
#include "ops/sphere_bands.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>


namespace shardtensor::ops {

namespace {

// The CSR operands, in the kernels' argument order (arguments 1-5).
struct Psi {
  at::Tensor roff, ker, row, col, vals;
};

// One split contraction: the exchange of the band of four-dimensional rows this rank's CSR rows read (dim 2 of that
// side's tensor, split as `dense_extents`), and this rank's psi.
struct DiscoPlan {
  comm::HaloPlan halo;
  Psi local;
};

DiscoPlan make_plan(const Psi& psi, int64_t dense_rows, int64_t dense_width, int64_t csr_rows,
                    const std::vector<int64_t>& csr_extents, const std::vector<int64_t>& dense_extents,
                    int64_t mesh_dim, const std::vector<int64_t>& coordinates, c10::Device device) {
  DiscoPlan plan;
  const auto roff = psi.roff.to(at::kCPU, at::kLong).contiguous();
  const auto row = psi.row.to(at::kCPU, at::kLong).contiguous();
  const auto col = psi.col.to(at::kCPU, at::kLong).contiguous();
  const auto ker = psi.ker.to(at::kCPU, at::kLong).contiguous();
  const auto* roff_p = roff.data_ptr<int64_t>();
  const auto* row_p = row.data_ptr<int64_t>();
  const auto* col_p = col.data_ptr<int64_t>();
  const auto* ker_p = ker.data_ptr<int64_t>();
  // A CSR row is one (kernel index, row); its row is named by its entries (an empty row names none: dropped).
  auto row_of = [&](int64_t r) { return roff_p[r] == roff_p[r + 1] ? int64_t{-1} : row_p[roff_p[r]]; };
  auto cut = cut_bands(roff_p, roff.numel() - 1, row_of, col_p, dense_width, dense_rows, csr_rows, csr_extents,
                       coordinates[mesh_dim]);
  plan.halo = comm::HaloPlan({comm::HaloDim{2, mesh_dim, dense_extents, std::move(cut.want)}}, coordinates, device);
  // This rank's CSR rows, renumbered: rows from its block's first, columns from its band's first row.
  std::vector<int64_t> new_ker, new_row, new_col;
  for (auto z : cut.entries) {
    new_ker.push_back(ker_p[z]);
    new_row.push_back(row_p[z] - cut.block_first);
    new_col.push_back(col_p[z] - cut.band_first * dense_width);
  }
  plan.local.roff = index_tensor_like(cut.roff, psi.roff);
  plan.local.ker = index_tensor_like(new_ker, psi.ker);
  plan.local.row = index_tensor_like(new_row, psi.row);
  plan.local.col = index_tensor_like(new_col, psi.col);
  plan.local.vals =
      psi.vals.index_select(0, at::tensor(cut.entries, at::TensorOptions().dtype(at::kLong)).to(psi.vals.device()));
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
  auto plan = cached_for_tensors<DiscoPlan>({psi.roff, psi.ker, psi.row, psi.col, psi.vals}, key, [&] {
    return make_plan(psi, dense_rows, dense_width, csr_rows, csr_ext, dense_ext, mesh_dim, spec.mesh->coordinates(),
                     local.device());
  });
  const auto me = spec.mesh->coordinate(mesh_dim);
  if (forward) {
    auto window = plan->halo.gather(local, *spec.mesh);
    auto out = call_kernel(true, window.contiguous(), plan->local, K, csr_ext[me], Wo);
    out_pl[mesh_dim] = Placement::shard(3);
    out_ext[3] = csr_ext;
    stack->emplace_back(wrap(out, spec.mesh, out_pl, out_shape, out_ext));
    return;
  }
  auto out_window = call_kernel(false, local.contiguous(), plan->local, K, plan->halo.window_rows(0), Wo);
  auto out = plan->halo.scatter_add(out_window, *spec.mesh, /*consume=*/true);
  out_pl[mesh_dim] = Placement::shard(2);
  out_ext[2] = dense_ext;
  stack->emplace_back(wrap(out, spec.mesh, out_pl, out_shape, out_ext));
}

// The custom ops torch-harmonics wraps the kernels in (its Python body: the kernel with psi's values in the compute
// dtype, fp32 for half inputs, and the result in the input's dtype): the same on ShardTensors, the kernel's rule.
void contraction_op(torch::jit::Stack* stack, bool forward) {
  const auto base = stack->size() - 9;
  const auto input = (*stack)[base].toTensor();
  const auto itype = input.scalar_type();
  const auto ctype = itype == at::kHalf || itype == at::kBFloat16 ? at::kFloat : itype;
  auto& vals = (*stack)[base + 5];
  if (vals.isTensor() && !shard_impl(vals.toTensor())) vals = vals.toTensor().to(ctype);
  kernel_op(forward).callBoxed(stack);
  auto& out = stack->back();
  if (out.toTensor().scalar_type() != itype) out = out.toTensor().to(itype);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(torch_harmonics_disco) {
  for (bool forward : {true, false})
    dispatch::set_handler_when_defined(forward ? "disco_kernels::forward" : "disco_kernels::backward",
                                       [forward](const c10::OperatorHandle& op, torch::jit::Stack* s) {
                                         contraction(op, s, forward);
                                       });
  dispatch::set_handler_when_defined(
      "disco_kernels::_disco_s2_contraction_optimized",
      [](const c10::OperatorHandle&, torch::jit::Stack* s) { contraction_op(s, true); });
  dispatch::set_handler_when_defined(
      "disco_kernels::_disco_s2_transpose_contraction_optimized",
      [](const c10::OperatorHandle&, torch::jit::Stack* s) { contraction_op(s, false); });
}

} // namespace shardtensor::ops
