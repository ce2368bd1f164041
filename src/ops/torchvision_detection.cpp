// torchvision's detection ops on split inputs: roi_align (the box and mask heads of Faster / Mask R-CNN, MultiScaleRoIAlign) on a feature map split
// along H and/or W (and channels), bound above autograd when torchvision defines `torchvision::roi_align`.
//
// A bilinear sample is a weighted sum of four taps and every bin averages a fixed number of samples (the count comes
// from the box's size), so the output is the sum over ranks of roi_align on each rank's own rows with every other
// row zero. Each rank runs torchvision's kernel on its block, the boxes shifted into its frame, with one zero row
// added on each side that borders another rank: a sample straddling the border takes its own tap and zero for the
// neighbour's, one beyond it reads nothing; the global image edges keep torchvision's clamping (no zero row there).
// No communication: the result is a pending sum (Partial) over the mesh dims that split H or W, completed when read
// (K x C x ph x pw values, not the feature map). Split channels are local (the output split alike). Backward: the
// kernel's own backward on the same window's geometry, the zero rows dropped; the incoming gradient is completed
// first; linear in the features, so differentiable again (ops/once_differentiable.h's LinearMap).
// A split batch declines (boxes name their image by index): the fallback, or NotImplementedError in strict mode.
// Whole features with the boxes split along their list (Mask R-CNN cutting its ground-truth masks to its
// proposals): each rank cuts its own boxes. And nms (below).
#include "comm/redistribute.h"
#include "dispatch/args.h"
#include "dispatch/registry.h"
#include "dispatch/rule_family.h"
#include "ops/common.h"
#include "ops/once_differentiable.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Zero rows added before and after this rank's block along each of H (dim 2) and W (dim 3), and the global index
// of the padded block's first row.
struct Window {
  int64_t before[2] = {0, 0}, after[2] = {0, 0}, first[2] = {0, 0};
  bool empty = false;
};

Window window_of(const ShardSpec& spec) {
  Window w;
  for (int64_t i = 0; i < 2; ++i) {
    const auto d = 2 + i;
    const auto m = spec.mesh_dim_of(d);
    if (m < 0) continue;
    const auto coord = spec.mesh->coordinate(m);
    const auto offset = spec.offset_of(m, coord), extent = spec.extents[m][coord];
    if (extent == 0) w.empty = true;
    w.before[i] = offset > 0 ? 1 : 0;
    w.after[i] = offset + extent < spec.global_shape[d] ? 1 : 0;
    w.first[i] = offset - w.before[i];
  }
  return w;
}

// rois (K, 5) = (batch index, x1, y1, x2, y2) in image coordinates: moved into the window's frame.
at::Tensor shifted_rois(const at::Tensor& rois, const Window& w, double spatial_scale) {
  if (w.first[0] == 0 && w.first[1] == 0) return rois;
  auto r = rois.clone();
  const auto dx = static_cast<double>(w.first[1]) / spatial_scale, dy = static_cast<double>(w.first[0]) / spatial_scale;
  if (dx != 0) r.select(1, 1).sub_(dx), r.select(1, 3).sub_(dx);
  if (dy != 0) r.select(1, 2).sub_(dy), r.select(1, 4).sub_(dy);
  return r;
}

// The output's layout: Partial over the mesh dims that split H or W, channels split alike, Replicate otherwise.
SpecPtr output_spec(const ShardSpec& in, int64_t boxes, int64_t ph, int64_t pw) {
  Placements p(in.placements.size(), Placement::replicate());
  DimExtents ext;
  for (size_t m = 0; m < p.size(); ++m) {
    const auto& pl = in.placements[m];
    if (!pl.is_shard()) continue;
    if (pl.dim == 1) {
      p[m] = Placement::shard(1);
      ext[1] = in.extents[m];
    } else {
      p[m] = Placement::partial();
    }
  }
  return ShardSpec::make_with_dim_extents(in.mesh, p, {boxes, in.global_shape[1], ph, pw}, ext);
}

// roi_align is linear in the features (the boxes fixed): the forward runs torchvision's kernel on this rank's window,
// the backward (the adjoint) torchvision's backward kernel on the same window's geometry with the zero rows dropped
// -- nothing of the features kept for it -- and a second derivative records the one with the other.
struct RoiAlignMap : LinearMap {
  c10::OperatorHandle op;  // torchvision::roi_align
  SpecPtr spec;            // the (completed) features' layout
  at::Tensor rois;         // every box, whole, in image coordinates
  double spatial_scale;
  int64_t ph, pw, sampling_ratio;
  bool aligned;
  RoiAlignMap(c10::OperatorHandle o, SpecPtr s, at::Tensor r, double sc, int64_t h, int64_t w, int64_t sr, bool al)
      : op(o), spec(std::move(s)), rois(std::move(r)), spatial_scale(sc), ph(h), pw(w), sampling_ratio(sr),
        aligned(al) {}
  SpecPtr out_spec() const { return output_spec(*spec, rois.size(0), ph, pw); }
  at::Tensor apply(const at::Tensor& x) const override {
    const auto local = shard_impl(grad_to_spec(x, spec))->local();
    const auto w = window_of(*spec);
    const auto os = out_spec();
    if (w.empty || rois.size(0) == 0) return make_shard_tensor(at::zeros(os->local_shape, local.options()), os);
    auto padded = at::constant_pad_nd(local, {w.before[1], w.after[1], w.before[0], w.after[0]}, 0);
    torch::jit::Stack stack{padded, shifted_rois(rois, w, spatial_scale), spatial_scale, ph, pw, sampling_ratio,
                            aligned};
    op.callBoxed(&stack);
    return make_shard_tensor(stack.back().toTensor(), os);
  }
  at::Tensor adjoint(const at::Tensor& grad) const override {
    // Every rank's taps need the whole (completed) gradient of every box, laid out by channels like the output.
    const auto want = without_partial(out_spec());
    auto g = local_in(grad, spec->mesh, want->placements, want->dim_extents());
    const auto& shape = spec->local_shape;
    const auto w = window_of(*spec);
    if (w.empty || rois.size(0) == 0) return make_shard_tensor(at::zeros(shape, g.options()), spec);
    static const auto backward_op =
        c10::Dispatcher::singleton().findSchemaOrThrow("torchvision::_roi_align_backward", "");
    torch::jit::Stack stack{g.contiguous(), shifted_rois(rois, w, spatial_scale), spatial_scale, ph, pw, shape[0],
                            shape[1], shape[2] + w.before[0] + w.after[0], shape[3] + w.before[1] + w.after[1],
                            sampling_ratio, aligned};
    backward_op.callBoxed(&stack);
    auto gl = stack.back().toTensor().narrow(2, w.before[0], shape[2]).narrow(3, w.before[1], shape[3]);
    return make_shard_tensor(gl.contiguous(), spec);
  }
};

struct RoiAlignFn : torch::autograd::Function<RoiAlignFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& rois,
                            const c10::OperatorHandle& op, double spatial_scale, int64_t ph, int64_t pw,
                            int64_t sampling_ratio, bool aligned) {
    ctx->set_materialize_grads(false);
    auto map = c10::make_intrusive<RoiAlignMap>(op, shard_impl(input)->spec(), rois, spatial_scale, ph, pw,
                                                sampling_ratio, aligned);
    auto out = map->apply(input);
    ctx->saved_data["map"] = map_ivalue(std::move(map));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_map_backward(ctx, grads, 8);
  }
};

// roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width,
//           int sampling_ratio, bool aligned) -> Tensor
void roi_align_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto base = stack->size() - 7;
  auto arg = [&](size_t i) -> c10::IValue& { return (*stack)[base + i]; };
  auto input = arg(0).toTensor();
  auto* rois_impl = shard_impl(arg(1).toTensor());
  const bool input_split = shard_impl(input) && shard_impl(input)->spec()->has_shard();
  if (!input_split) {
    // Whole features (Mask R-CNN's ground-truth masks cut to its proposals) with the boxes split along their list:
    // each rank cuts its own boxes, the output split alike.
    bool boxes_split = rois_impl && rois_impl->spec()->mesh_dim_of(0) >= 0 && !rois_impl->spec()->has_partial();
    for (const auto& p : boxes_split ? rois_impl->spec()->placements : Placements{})
      boxes_split = boxes_split && (!p.is_shard() || p.dim == 0);  // whole boxes (not their coordinates) per rank
    if (!boxes_split || input.requires_grad())
      dispatch::not_implemented(op, stack, "whole features with boxes that are not split along their list (or "
                                           "features that need a gradient); split the features along H or W");
    const auto& rspec = rois_impl->spec();
    const auto mesh = rspec->mesh;
    const auto features = shard_impl(input) ? resolve_partial(input) : input;
    const auto whole = shard_impl(features) ? shard_impl(features)->local() : features;
    torch::jit::Stack local{whole, rois_impl->local(), arg(2), arg(3), arg(4), arg(5), arg(6)};
    op.callBoxed(&local);
    const auto out = local.back().toTensor();
    Placements p(rspec->placements.size(), Placement::replicate());
    DimExtents ext;
    for (size_t m = 0; m < p.size(); ++m)
      if (rspec->placements[m].is_shard() && rspec->placements[m].dim == 0) {
        p[m] = Placement::shard(0);
        ext[0] = rspec->extents[m];
      }
    stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
    stack->emplace_back(wrap(out, mesh, p, {rspec->global_shape[0], out.size(1), out.size(2), out.size(3)}, ext));
    return;
  }
  const auto& spec = *shard_impl(input)->spec();
  for (const auto& p : spec.placements)
    if (p.is_shard() && p.dim == 0)
      dispatch::not_implemented(op, stack, "a split batch (each box names its image by index); redistribute the "
                                           "batch dim to Replicate() or split H / W instead");
  TORCH_CHECK_VALUE(input.dim() == 4, "torchvision::roi_align: the input must be (N, C, H, W), got ", input.sizes());
  const auto spatial_scale = arg(2).toDouble();
  const auto ph = arg(3).toInt(), pw = arg(4).toInt(), sampling_ratio = arg(5).toInt();
  const auto aligned = arg(6).toBool();
  // The boxes are a handful of numbers every rank needs whole.
  auto rois = arg(1).toTensor();
  if (shard_impl(rois)) rois = whole_value(rois);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  input = resolve_partial_diff(input);
  stack->emplace_back(RoiAlignFn::apply(input, rois.detach(), op, spatial_scale, ph, pw, sampling_ratio, aligned));
}

// nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor: suppression compares every box with every other,
// and a detector's box list is small (thousands of boxes, not the image): the boxes and scores are completed whole
// on every rank (an all-gather of a list split along its boxes), torchvision's kernel runs on them, and the kept
// indices are the same on every rank (Replicate).
void nms_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto base = stack->size() - 3;
  MeshPtr mesh;
  for (size_t i = 0; i < 2; ++i) {
    auto t = (*stack)[base + i].toTensor();
    if (auto* impl = shard_impl(t)) {
      mesh = impl->spec()->mesh;
      (*stack)[base + i] = whole_value(t);
    }
  }
  op.callBoxed(stack);
  auto keep = stack->back().toTensor();
  stack->back() = make_shard_tensor(keep, dispatch::replicate_spec(mesh, keep.sizes()));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(torchvision_detection) {
  dispatch::set_handler_when_defined("torchvision::roi_align", &roi_align_handler,
                                     dispatch::RuleLevel::above_autograd);
  dispatch::set_handler_when_defined("torchvision::nms", &nms_handler, dispatch::RuleLevel::above_autograd);
}

} // namespace shardtensor::ops
