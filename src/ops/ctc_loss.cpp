// CTC loss (`F.ctc_loss`, `nn.CTCLoss`: `_ctc_loss` and `_ctc_loss_backward`, both overloads) with the batch split.
// The loss of one sample reads only that sample's frames, target and lengths, so with log_probs [T, N, C] split along
// N each rank runs aten's kernel on its own samples: its rows of the targets (a [N, S] matrix) or its samples' run of
// the concatenated 1-D targets, its entries of the two length lists. No communication: the per-sample losses come
// out split like the batch, and ctc_loss's reduction (the mean over samples of loss / target length) runs on them
// through the reduction rules. The frames (T) split, or the classes, decline to the fallback: the alpha recursion
// runs along T (a scan the kernel cannot resume) and normalizes over C.
#include "ops/common.h"
#include "ops/describe.h"

#include <limits>

namespace shardtensor::ops {

namespace {

constexpr const char* kForward = "aten::_ctc_loss";
constexpr const char* kBackward = "aten::_ctc_loss_backward";

// One rank's part of a CTC call: its samples of every argument.
struct CtcPart {
  MeshPtr mesh;
  SpecPtr spec;               // log_probs' layout (the batch, dim 1, split by at most one mesh dim)
  int64_t batch_mesh_dim = -1;
  std::vector<int64_t> batch_extents;  // extents of N along batch_mesh_dim (empty: N whole)
  at::Tensor log_probs;       // local [T, n, C]
  at::Tensor targets;         // local rows / run
  std::vector<int64_t> input_lengths, target_lengths;  // local entries
  int64_t global_max_target = 0;  // sizes log_alpha's last dim as one device's
};

std::vector<int64_t> host_lengths(const at::Tensor& lengths, const char* op, const char* what) {
  auto whole = whole_value(lengths);
  TORCH_CHECK_VALUE(at::isIntegralType(whole.scalar_type(), /*includeBool=*/false), op, ": ", what,
                    " must be integral");
  auto l = whole.to(at::kCPU, at::kLong).contiguous().reshape({-1});
  return {l.const_data_ptr<int64_t>(), l.const_data_ptr<int64_t>() + l.numel()};
}

// Checks the global arguments as aten's kernel does (before any rank cuts its part, so a bad argument is refused on
// every rank alike) and cuts this rank's samples.
CtcPart ctc_part(const char* op, const at::Tensor& log_probs, const at::Tensor& targets,
                 const std::vector<int64_t>& input_lengths, const std::vector<int64_t>& target_lengths,
                 int64_t blank) {
  CtcPart part;
  part.mesh = dispatch::common_mesh(op, {log_probs, targets});
  auto lp = resolve_partial(dispatch::as_shard(log_probs, part.mesh));
  part.spec = shard_impl(lp)->spec();
  const auto& spec = *part.spec;
  TORCH_CHECK_VALUE(lp.dim() == 3, op, ": log_probs must be [T, N, C], got ", describe_spec(lp));
  const int64_t n = spec.global_shape[1], t_max = spec.global_shape[0];
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    if (!spec.placements[m].is_shard()) continue;
    if (spec.placements[m].dim != 1)
      dispatch::not_implemented(c10::str(op, " with log_probs ", describe_spec(lp), ": only the batch (dim 1) may be ",
                                         "split (the loss recurses along the frames and normalizes over the classes); ",
                                         "split the batch, or redistribute the frames to Replicate() before the loss"));
    part.batch_mesh_dim = static_cast<int64_t>(m);
    part.batch_extents = spec.extents[m];
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(input_lengths.size()) == n, op, ": input_lengths must have one entry per ",
                    "sample (", n, "), got ", input_lengths.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(target_lengths.size()) == n, op, ": target_lengths must have one entry per ",
                    "sample (", n, "), got ", target_lengths.size());
  TORCH_CHECK_VALUE(blank >= 0 && blank < spec.global_shape[2], op, ": blank must be in label range [0, ",
                    spec.global_shape[2], "), got ", blank);
  auto tg = whole_value(targets);
  TORCH_CHECK_VALUE(at::isIntegralType(tg.scalar_type(), /*includeBool=*/false), op, ": targets must be integral, got ",
                    tg.scalar_type());
  int64_t total_targets = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(input_lengths[i] >= 0 && input_lengths[i] <= t_max, op, ": input_lengths[", i, "] = ",
                      input_lengths[i], " is outside [0, ", t_max, "]");
    TORCH_CHECK_VALUE(target_lengths[i] >= 0, op, ": target_lengths[", i, "] = ", target_lengths[i], " is negative");
    part.global_max_target = std::max(part.global_max_target, target_lengths[i]);
    total_targets += target_lengths[i];
  }
  TORCH_CHECK_VALUE(tg.dim() == 1 || tg.dim() == 2, op, ": targets must be 1-D (concatenated) or [N, S], got ",
                    tg.sizes());
  if (tg.dim() == 2) {
    TORCH_CHECK_VALUE(tg.size(0) == n && tg.size(1) >= part.global_max_target, op, ": targets ", tg.sizes(),
                      " must be [N = ", n, ", S >= ", part.global_max_target, "]");
  } else {
    TORCH_CHECK_VALUE(tg.size(0) >= total_targets, op, ": the concatenated targets hold ", tg.size(0),
                      " labels, fewer than the target lengths' sum ", total_targets);
  }
  int64_t first = 0, count = n;
  if (part.batch_mesh_dim >= 0) {
    first = spec.offset_of(part.batch_mesh_dim, spec.mesh->coordinate(part.batch_mesh_dim));
    count = spec.local_shape[1];
  }
  part.log_probs = shard_impl(lp)->local();
  part.input_lengths.assign(input_lengths.begin() + first, input_lengths.begin() + first + count);
  part.target_lengths.assign(target_lengths.begin() + first, target_lengths.begin() + first + count);
  if (tg.dim() == 2) {
    part.targets = tg.narrow(0, first, count);
  } else {
    int64_t start = 0, len = 0;
    for (int64_t i = 0; i < first; ++i) start += target_lengths[i];
    for (int64_t i = first; i < first + count; ++i) len += target_lengths[i];
    part.targets = tg.narrow(0, start, len);
  }
  return part;
}

// The layout of a per-sample tensor (the losses, log_alpha, their gradients): Shard(0) on the batch's mesh dim,
// Replicate elsewhere.
std::pair<Placements, DimExtents> per_sample_layout(const CtcPart& part) {
  Placements pl(part.mesh->ndim(), Placement::replicate());
  DimExtents ext;
  if (part.batch_mesh_dim >= 0) {
    pl[part.batch_mesh_dim] = Placement::shard(0);
    ext[0] = part.batch_extents;
  }
  return {pl, ext};
}

at::Tensor wrap_per_sample(at::Tensor local, const CtcPart& part, std::vector<int64_t> global) {
  auto [pl, ext] = per_sample_layout(part);
  return wrap(std::move(local), part.mesh, std::move(pl), std::move(global), ext);
}

// aten's kernel refuses an empty log_probs; a rank whose batch shard is empty (more ranks than samples) has nothing
// to compute. An empty global batch still reaches the kernel on every rank, which refuses it as one device does.
bool no_samples_here(const CtcPart& part) {
  return part.log_probs.size(1) == 0 && part.spec->global_shape[1] > 0 && part.spec->global_shape[0] > 0 &&
      part.spec->global_shape[2] > 0;
}

int64_t local_max(const std::vector<int64_t>& lengths) {
  int64_t m = 0;
  for (auto v : lengths) m = std::max(m, v);
  return m;
}

std::tuple<at::Tensor, at::Tensor> ctc_forward(const at::Tensor& log_probs, const at::Tensor& targets,
                                               const std::vector<int64_t>& input_lengths,
                                               const std::vector<int64_t>& target_lengths, int64_t blank,
                                               bool zero_infinity) {
  auto part = ctc_part(kForward, log_probs, targets, input_lengths, target_lengths, blank);
  at::Tensor nll, log_alpha;
  if (no_samples_here(part)) {
    nll = at::empty({0}, part.log_probs.options());
    log_alpha = at::empty({0, part.log_probs.size(0), 1}, part.log_probs.options());
  } else {
    std::tie(nll, log_alpha) = at::_ctc_loss(part.log_probs, part.targets.to(part.log_probs.device(), at::kLong),
                                             part.input_lengths, part.target_lengths, blank, zero_infinity);
  }
  // The kernel sizes log_alpha by the longest target it sees; one device's by the longest of the batch. The states
  // past a sample's own 2 * length + 1 are never read (the backward cuts them off again); one device holds -inf there.
  const int64_t states = 2 * part.global_max_target + 1;
  if (log_alpha.size(2) < states)
    log_alpha = at::constant_pad_nd(log_alpha, {0, states - log_alpha.size(2)},
                                    -std::numeric_limits<double>::infinity());
  const auto& g = part.spec->global_shape;
  auto n = g[1];
  return {wrap_per_sample(nll, part, {n}), wrap_per_sample(log_alpha, part, {n, g[0], states})};
}

at::Tensor ctc_backward(const at::Tensor& grad, const at::Tensor& log_probs, const at::Tensor& targets,
                        const std::vector<int64_t>& input_lengths, const std::vector<int64_t>& target_lengths,
                        const at::Tensor& neg_log_likelihood, const at::Tensor& log_alpha, int64_t blank,
                        bool zero_infinity) {
  auto part = ctc_part(kBackward, log_probs, targets, input_lengths, target_lengths, blank);
  const auto [pl, ext] = per_sample_layout(part);
  auto g = local_in(grad, part.mesh, pl, ext);
  auto nll = local_in(neg_log_likelihood, part.mesh, pl, ext);
  auto alpha = local_in(log_alpha, part.mesh, pl, ext).narrow(2, 0, 2 * local_max(part.target_lengths) + 1);
  if (no_samples_here(part)) return make_shard_tensor(at::zeros_like(part.log_probs), part.spec);
  auto gi = at::_ctc_loss_backward(g, part.log_probs, part.targets.to(part.log_probs.device(), at::kLong),
                                   part.input_lengths, part.target_lengths, nll, alpha, blank, zero_infinity);
  return make_shard_tensor(gi, part.spec);
}

// _ctc_loss(Tensor log_probs, Tensor targets, int[] input_lengths, int[] target_lengths, int blank=0,
//           bool zero_infinity=False) -> (Tensor, Tensor)
std::tuple<at::Tensor, at::Tensor> ctc_loss_rule(const at::Tensor& log_probs, const at::Tensor& targets,
                                                 at::IntArrayRef input_lengths, at::IntArrayRef target_lengths,
                                                 int64_t blank, bool zero_infinity) {
  return ctc_forward(log_probs, targets, input_lengths.vec(), target_lengths.vec(), blank, zero_infinity);
}

// _ctc_loss.Tensor: the lengths as tensors (small: read whole on the host, as aten's own overload does)
std::tuple<at::Tensor, at::Tensor> ctc_loss_tensor_rule(const at::Tensor& log_probs, const at::Tensor& targets,
                                                        const at::Tensor& input_lengths,
                                                        const at::Tensor& target_lengths, int64_t blank,
                                                        bool zero_infinity) {
  return ctc_forward(log_probs, targets, host_lengths(input_lengths, kForward, "input_lengths"),
                     host_lengths(target_lengths, kForward, "target_lengths"), blank, zero_infinity);
}

// _ctc_loss_backward(Tensor grad, Tensor log_probs, Tensor targets, int[] input_lengths, int[] target_lengths,
//                    Tensor neg_log_likelihood, Tensor log_alpha, int blank, bool zero_infinity=False) -> Tensor
at::Tensor ctc_loss_backward_rule(const at::Tensor& grad, const at::Tensor& log_probs, const at::Tensor& targets,
                                  at::IntArrayRef input_lengths, at::IntArrayRef target_lengths,
                                  const at::Tensor& neg_log_likelihood, const at::Tensor& log_alpha, int64_t blank,
                                  bool zero_infinity) {
  return ctc_backward(grad, log_probs, targets, input_lengths.vec(), target_lengths.vec(), neg_log_likelihood,
                      log_alpha, blank, zero_infinity);
}

at::Tensor ctc_loss_backward_tensor_rule(const at::Tensor& grad, const at::Tensor& log_probs,
                                         const at::Tensor& targets, const at::Tensor& input_lengths,
                                         const at::Tensor& target_lengths, const at::Tensor& neg_log_likelihood,
                                         const at::Tensor& log_alpha, int64_t blank, bool zero_infinity) {
  return ctc_backward(grad, log_probs, targets, host_lengths(input_lengths, kBackward, "input_lengths"),
                      host_lengths(target_lengths, kBackward, "target_lengths"), neg_log_likelihood, log_alpha,
                      blank, zero_infinity);
}

// _use_cudnn_ctc_loss / _use_miopen_ctc_loss (CUDA only): ctc_loss asks them before choosing a kernel. On a
// ShardTensor the answer is no: the native kernel is the one the rule above runs per rank (cuDNN's needs the
// targets on the host and every input length equal to T, a property of the whole batch).
bool no_accelerated_ctc(const at::Tensor&, const at::Tensor&, at::IntArrayRef, at::IntArrayRef, int64_t) {
  return false;
}
bool no_accelerated_ctc_tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  return false;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(ctc_loss) {
  dispatch::set_handler("aten::_ctc_loss", typed_handler(&ctc_loss_rule));
  dispatch::set_handler("aten::_ctc_loss.Tensor", typed_handler(&ctc_loss_tensor_rule));
  dispatch::set_handler("aten::_ctc_loss_backward", typed_handler(&ctc_loss_backward_rule));
  dispatch::set_handler("aten::_ctc_loss_backward.Tensor", typed_handler(&ctc_loss_backward_tensor_rule));
  dispatch::set_handler("aten::_use_cudnn_ctc_loss", typed_handler(&no_accelerated_ctc));
  dispatch::set_handler("aten::_use_cudnn_ctc_loss.Tensor", typed_handler(&no_accelerated_ctc_tensor));
  dispatch::set_handler("aten::_use_miopen_ctc_loss", typed_handler(&no_accelerated_ctc));
  dispatch::set_handler("aten::_use_miopen_ctc_loss.Tensor", typed_handler(&no_accelerated_ctc_tensor));
}

} // namespace shardtensor::ops
