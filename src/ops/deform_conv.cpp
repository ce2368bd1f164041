// torchvision's deformable convolution (`torchvision.ops.deform_conv2d`, `DeformConv2d`: DCNv1, and DCNv2 with its
// modulation mask) on an input split along H and/or W and the batch, bound below autograd to
// `torchvision::deform_conv2d` and `torchvision::_deform_conv2d_backward` when torchvision defines them (its own
// autograd kernel records the backward; plain weights are promoted and get single-device gradients).
//
// Output position o's tap i reads the input bilinearly at o * stride - pad + i * dilation + offset: where depends on
// the offsets, so the input rows a rank needs are a data-dependent window (ops/data_windows.h, as grid_sample's): the
// output is laid out like the offsets (their split; a whole offset tensor is cut by the convolution's centre
// ownership), each rank finds the rows its taps read from its offsets (a row of margin each side for rounding), the
// ranges are all-gathered and the rows travel as a halo exchange between the ranks that hold them.
//
// torchvision's kernel then runs on the window. It places taps relative to its own input, with its output size fixed
// by the input's height, its padding and the stride, so the window is framed: the frame starts at the first row read
// or at the rank's undeformed window start, whichever is lower (rows of it that no tap reads are zeros, not moved);
// the kernel's padding p' and `before` extra output rows (offsets zero, discarded) shift the frame's origin to the
// rank's first output exactly in integers (before * stride - p' = undeformed start - frame start), and the frame is
// long enough that the kernel's output covers the rank's outputs (`after` extra rows at the end). Offsets reaching
// far beyond the undeformed window cost extra output rows and window rows as far as they reach; a rank's
// undisturbed case moves the convolution's own halo plus the margin.
//
// Backward: torchvision's backward kernel on the same window and frame (the incoming gradient zero on the extra rows);
// the window's input gradient goes home through the plan's adjoint; offset and mask gradients are local; weight and
// bias gradients are sums over the mesh dims that split the batch or the positions (deferred into the gradient
// buckets where they may be).
//
// Declined (the fallback; strict mode: NotImplementedError naming the remedy): the input's channels split, a split
// weight, offsets or mask split where the input is whole, or along another dim than the input, a dim split by two
// mesh dims. The ranges are data: under st.simulate a spatial split refuses.
#include "ops/common.h"
#include "ops/data_windows.h"
#include "ops/describe.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>

namespace shardtensor::ops {

namespace {

constexpr const char* kOp = "torchvision::deform_conv2d";

// The non-tensor arguments (stride_h .. use_mask), in the schema's order after the five tensors.
struct Params {
  int64_t stride[2] = {1, 1}, pad[2] = {0, 0}, dil[2] = {1, 1};
  int64_t groups = 1, offset_groups = 1;
  bool use_mask = false;

  static Params from(const torch::jit::Stack& stack, size_t first) {
    Params p;
    for (int64_t i = 0; i < 2; ++i) {
      p.stride[i] = stack[first + i].toInt();
      p.pad[i] = stack[first + 2 + i].toInt();
      p.dil[i] = stack[first + 4 + i].toInt();
    }
    p.groups = stack[first + 6].toInt();
    p.offset_groups = stack[first + 7].toInt();
    p.use_mask = stack[first + 8].toBool();
    return p;
  }
  // The kernel's window along input dim 2 + i.
  comm::SlidingWindow window(int64_t i, int64_t kernel) const { return {kernel, stride[i], pad[i], dil[i]}; }
};

// A split input dim (2: H, 3: W).
struct WindowDim {
  int64_t dim = 0, mesh_dim = 0;
};

// The layouts of one call, decided from the specs and global shapes alone.
struct DeformLayout {
  MeshPtr mesh;
  Placements in_pl, out_pl, mask_pl;  // out_pl: the output's and the offsets' (and a used mask's)
  DimExtents in_ext, out_ext, mask_ext;
  std::vector<WindowDim> windows;     // in dim order
  std::vector<int64_t> param_dims;    // mesh dims splitting the batch or the positions
  std::vector<int64_t> out_shape;
};

[[noreturn]] void decline(const at::Tensor& input, const at::Tensor& offset, const std::string& why) {
  dispatch::not_implemented(c10::str(kOp, " with input ", describe_spec(input), " and offset ", describe_spec(offset),
                                     ": ", why));
}

DimExtents extents_of(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  return impl ? impl->spec()->dim_extents() : DimExtents{};
}

DeformLayout deform_layout(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& offset,
                           const at::Tensor& mask, const Params& p) {
  TORCH_CHECK_VALUE(input.dim() == 4 && weight.dim() == 4 && offset.dim() == 4, kOp,
                    ": input, weight and offset must be 4-D, got global shapes ", input.sizes(), ", ",
                    weight.sizes(), ", ", offset.sizes());
  DeformLayout l;
  l.mesh = dispatch::common_mesh(kOp, {input, weight, offset, mask});
  const auto nm = l.mesh->ndim();
  int64_t out_size[2];
  for (int64_t i = 0; i < 2; ++i) {
    out_size[i] = comm::conv_output_size(input.size(2 + i), p.window(i, weight.size(2 + i)));
    TORCH_CHECK_VALUE(offset.size(2 + i) == out_size[i], kOp, ": the offset's positions ", offset.sizes(),
                      " do not match the output size (", out_size[0], ", ", out_size[1],
                      ") of the global input ", input.sizes(), " and weight ", weight.sizes());
  }
  l.out_shape = {input.size(0), weight.size(0), out_size[0], out_size[1]};
  const auto in_pl = placements_of(input, l.mesh), off_pl = placements_of(offset, l.mesh),
             mask_pl = placements_of(mask, l.mesh), w_pl = placements_of(weight, l.mesh);
  const auto in_ext = extents_of(input), off_ext = extents_of(offset), mask_ext = extents_of(mask);
  l.in_pl = l.out_pl = l.mask_pl = Placements(nm, Placement::replicate());
  for (int64_t m = 0; m < nm; ++m) {
    const auto &ip = in_pl[m], &op = off_pl[m], &mp = mask_pl[m];
    if (w_pl[m].is_shard())
      decline(input, offset, "the weight is split (redistribute it to Replicate())");
    if (ip.is_shard(0) || op.is_shard(0) || mp.is_shard(0)) {
      for (const auto* q : {&ip, &op, &mp})
        if (q->is_shard() && !q->is_shard(0))
          decline(input, offset, "one mesh dim splits the batch of one argument and another dim of another (split "
                                 "input, offset and mask along the batch alike)");
      const auto& ext = ip.is_shard(0) ? in_ext.at(0) : op.is_shard(0) ? off_ext.at(0) : mask_ext.at(0);
      l.in_pl[m] = l.out_pl[m] = l.mask_pl[m] = Placement::shard(0);
      l.in_ext[0] = l.out_ext[0] = l.mask_ext[0] = ext;
      l.param_dims.push_back(m);
      continue;
    }
    if (ip.is_shard(1)) decline(input, offset, "the input's channels are split (split H or W instead)");
    if (!ip.is_shard()) {
      if (op.is_shard() || (p.use_mask && mp.is_shard()))
        decline(input, offset, "the offsets or the mask are split where the input is whole (split the input like them)");
      continue;
    }
    const auto s = ip.dim;
    if ((op.is_shard() && op.dim != s) || (p.use_mask && mp.is_shard() && mp.dim != s))
      decline(input, offset, "the offsets or the mask are split along another dim than the input (split them alike)");
    for (const auto& wd : l.windows)
      if (wd.dim == s) decline(input, offset, "a dim split by two mesh dims (split H and W by one mesh dim each)");
    l.in_pl[m] = Placement::shard(s);
    l.in_ext[s] = in_ext.at(s);
    std::vector<int64_t> out_ext;
    if (op.is_shard(s)) {
      out_ext = off_ext.at(s);
    } else if (p.use_mask && mp.is_shard(s)) {
      out_ext = mask_ext.at(s);
    } else {
      // Whole offsets: the convolution's own cut of its outputs.
      out_ext = comm::sliding_window_partition(l.in_ext[s], input.size(s), out_size[s - 2],
                                               p.window(s - 2, weight.size(s)), comm::PadMode::Zeros)
                    .out_extents;
    }
    l.out_pl[m] = Placement::shard(s);
    l.out_ext[s] = out_ext;
    if (p.use_mask) {
      l.mask_pl[m] = Placement::shard(s);
      l.mask_ext[s] = std::move(out_ext);
    }
    l.windows.push_back({s, m});
    l.param_dims.push_back(m);
  }
  std::sort(l.windows.begin(), l.windows.end(), [](const WindowDim& a, const WindowDim& b) { return a.dim < b.dim; });
  return l;
}

// How torchvision's kernel runs along one windowed dim: the window holds global rows [start, start + rows) (rows
// no tap reads are zeros), the kernel pads it by `pad` and computes `before` + the rank's outputs + `after` rows.
struct Frame {
  int64_t start = 0, rows = 0, pad = 0, before = 0, after = 0;
};

// The frame of a coordinate whose outputs [o0, o0 + outputs) read rows [lo, hi) (none when hi <= lo).
Frame frame_of(int64_t o0, int64_t outputs, int64_t lo, int64_t hi, const comm::SlidingWindow& w) {
  Frame f;
  if (outputs == 0) return f;
  const auto natural = o0 * w.stride - w.padding;  // the undeformed window's first row
  if (hi <= lo) lo = hi = natural;
  f.start = std::min(lo, natural);
  const auto shift = natural - f.start;           // >= 0: before * stride - pad == shift
  f.before = (shift + w.stride - 1) / w.stride;
  f.pad = f.before * w.stride - shift;
  const auto end = std::max(hi, f.start - 2 * f.pad + (f.before + outputs - 1) * w.stride + w.span());
  f.rows = end - f.start;
  f.after = (f.rows + 2 * f.pad - w.span()) / w.stride + 1 - f.before - outputs;
  return f;
}

int64_t offset_of(const std::vector<int64_t>& extents, int64_t coord) {
  int64_t o = 0;
  for (int64_t c = 0; c < coord; ++c) o += extents[c];
  return o;
}

// Tap positions along input dim `dim` (2: H, 3: W) in global pixels, computed as the kernel computes them (the
// integer part plus the offset in the offsets' dtype), then in double.
at::Tensor tap_pixels(const at::Tensor& off, int64_t dim, int64_t o0, const Params& p, int64_t kh, int64_t kw,
                      int64_t offset_groups) {
  const auto i = dim - 2;
  auto o = off.reshape({off.size(0), offset_groups, kh, kw, 2, off.size(2), off.size(3)}).select(4, i);
  const auto n_out = off.size(dim), k = i == 0 ? kh : kw;
  auto opts = off.options().dtype(at::kLong);
  auto base_out = (at::arange(n_out, opts) + o0) * p.stride[i] - p.pad[i];
  auto base_tap = at::arange(k, opts) * p.dil[i];
  std::vector<int64_t> out_shape(6, 1), tap_shape(6, 1);
  out_shape[4 + i] = n_out;
  tap_shape[2 + i] = k;
  auto base = (base_out.view(out_shape) + base_tap.view(tap_shape)).to(off.scalar_type());
  return (base + o).to(at::kDouble);
}

// This rank's windows and frames.
struct Windows {
  DataWindows data;
  std::vector<Frame> frame;  // per layout window, this rank's
};

Windows plan_windows(const DeformLayout& l, const Params& p, const at::Tensor& input, const at::Tensor& weight,
                     const at::Tensor& off_local) {
  Windows w;
  const auto& mesh = *l.mesh;
  std::vector<DataWindowDim> dims;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<comm::SlidingWindow> sw;
  for (const auto& wd : l.windows) {
    const auto& ext = l.out_ext.at(wd.dim);
    const auto me = mesh.coordinate(wd.mesh_dim);
    const auto size = input.size(wd.dim);
    sw.push_back(p.window(wd.dim - 2, weight.size(wd.dim)));
    // Bilinear taps at floor(y) and floor(y) + 1, a row of margin each side.
    ranges.push_back(rows_read(tap_pixels(off_local, wd.dim, offset_of(ext, me), p, weight.size(2), weight.size(3),
                                          p.offset_groups),
                               size, 1, 2, 0));
    dims.push_back({wd.dim, wd.mesh_dim, l.in_ext.at(wd.dim)});
  }
  auto rows = [&](size_t k, int64_t coord, int64_t lo, int64_t hi) {
    const auto& ext = l.out_ext.at(l.windows[k].dim);
    const auto f = frame_of(offset_of(ext, coord), ext[coord], lo, hi, sw[k]);
    std::vector<int64_t> r(f.rows);
    for (int64_t j = 0; j < f.rows; ++j) {
      const auto g = f.start + j;
      r[j] = g >= lo && g < hi ? g : -1;
    }
    return r;
  };
  w.data = plan_data_windows(dims, std::move(ranges), mesh, off_local.device(),
                             "torchvision::deform_conv2d over a split input (windows)", rows);
  for (size_t k = 0; k < l.windows.size(); ++k) {
    const auto& ext = l.out_ext.at(l.windows[k].dim);
    const auto me = mesh.coordinate(l.windows[k].mesh_dim);
    w.frame.push_back(frame_of(offset_of(ext, me), ext[me], w.data.range[k].first, w.data.range[k].second, sw[k]));
  }
  return w;
}

// The windows of a call, reused by its backward (cached_windows: the same offsets and input, not modified since).
std::shared_ptr<const Windows> windows_for(const DeformLayout& l, const Params& p, const at::Tensor& input,
                                           const at::Tensor& weight, const at::Tensor& offset,
                                           const at::Tensor& off_local) {
  return cached_windows<Windows>(offset, input,
                                 {p.stride[0], p.stride[1], p.pad[0], p.pad[1], p.dil[0], p.dil[1], p.offset_groups,
                                  weight.size(2), weight.size(3)},
                                 [&] {
                                   return std::make_shared<const Windows>(plan_windows(l, p, input, weight, off_local));
                                 });
}

// One call's local pieces: the window, the offsets / mask with the frames' extra rows, the kernel's padding.
struct LocalCall {
  at::Tensor x, weight, offset, mask, bias;
  int64_t pad[2] = {0, 0};
  int64_t before[2] = {0, 0}, after[2] = {0, 0}, outputs[2] = {0, 0};  // the frames' extra rows, the rank's own
  bool empty = false;  // no output position here: the kernel is not run
  std::shared_ptr<const Windows> windows;
};

// Zero rows before / after along dims 2 and 3 (nothing copied when there are none).
at::Tensor padded(const at::Tensor& t, const int64_t before[2], const int64_t after[2]) {
  if (before[0] == 0 && before[1] == 0 && after[0] == 0 && after[1] == 0) return t;
  return at::constant_pad_nd(t, {before[1], after[1], before[0], after[0]}, 0);
}

LocalCall local_call(const DeformLayout& l, const Params& p, const at::Tensor& input_in, const at::Tensor& weight,
                     const at::Tensor& offset_in, const at::Tensor& mask, const at::Tensor& bias) {
  LocalCall c;
  const auto& mesh = l.mesh;
  const Placements rep(mesh->ndim(), Placement::replicate());
  c.x = local_in(input_in, mesh, l.in_pl, l.in_ext);
  c.offset = local_in(offset_in, mesh, l.out_pl, l.out_ext);
  c.mask = local_in(mask, mesh, l.mask_pl, l.mask_ext);
  c.weight = local_in(weight, mesh, rep, {});
  c.bias = local_in(bias, mesh, rep, {});
  for (int64_t i = 0; i < 2; ++i) {
    c.pad[i] = p.pad[i];
    c.outputs[i] = c.offset.size(2 + i);
    c.empty = c.empty || c.outputs[i] == 0;
  }
  if (l.windows.empty()) return c;
  c.windows = windows_for(l, p, input_in, weight, offset_in, c.offset);
  c.x = c.windows->data.plan.gather(c.x, *mesh);
  for (size_t k = 0; k < l.windows.size(); ++k) {
    const auto i = l.windows[k].dim - 2;
    const auto& f = c.windows->frame[k];
    c.pad[i] = f.pad;
    c.before[i] = f.before;
    c.after[i] = f.after;
  }
  if (c.empty) return c;
  c.offset = padded(c.offset, c.before, c.after);
  if (p.use_mask) c.mask = padded(c.mask, c.before, c.after);  // an unused mask is (N, 1)
  return c;
}

// The kernel's output rows that are the rank's (dropping the frames' extra rows).
at::Tensor own_rows(const at::Tensor& t, const LocalCall& c) {
  auto r = t;
  for (int64_t i = 0; i < 2; ++i)
    if (r.size(2 + i) != c.outputs[i]) r = r.narrow(2 + i, c.before[i], c.outputs[i]);
  return r;
}

std::vector<c10::IValue> scalar_args(const LocalCall& c, const Params& p) {
  return {p.stride[0], p.stride[1], c.pad[0],     c.pad[1], p.dil[0],
          p.dil[1],    p.groups,    p.offset_groups, p.use_mask};
}

// deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, SymInt
// stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups,
// bool use_mask) -> Tensor
void deform_conv2d_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto base = stack->size() - 14;
  auto arg = [&](size_t i) { return (*stack)[base + i].toTensor(); };
  const auto input = arg(0), weight = arg(1), offset = arg(2), mask = arg(3), bias = arg(4);
  const auto p = Params::from(*stack, base + 5);
  const auto l = deform_layout(input, weight, offset, mask, p);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  const auto c = local_call(l, p, input, weight, offset, mask, bias);
  at::Tensor out;
  if (c.empty) {
    out = at::zeros({c.x.size(0), weight.size(0), c.outputs[0], c.outputs[1]}, c.x.options());
  } else {
    torch::jit::Stack local{c.x, c.weight, c.offset, c.mask, c.bias};
    for (auto& v : scalar_args(c, p)) local.push_back(std::move(v));
    op.callBoxed(&local);
    out = own_rows(local.back().toTensor(), c);
  }
  stack->emplace_back(wrap(out, l.mesh, l.out_pl, l.out_shape, l.out_ext));
}

// _deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, ...)
// -> (grad_input, grad_weight, grad_offset, grad_mask, grad_bias)
void deform_conv2d_backward_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto base = stack->size() - 15;
  auto arg = [&](size_t i) { return (*stack)[base + i].toTensor(); };
  const auto grad = arg(0), input = arg(1), weight = arg(2), offset = arg(3), mask = arg(4), bias = arg(5);
  const auto p = Params::from(*stack, base + 6);
  const auto l = deform_layout(input, weight, offset, mask, p);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  const auto c = local_call(l, p, input, weight, offset, mask, bias);
  at::Tensor gi, gw, goff, gmask, gb;
  if (c.empty) {
    gi = at::zeros_like(c.x);
    gw = at::zeros_like(c.weight);
    goff = at::zeros_like(c.offset);
    gmask = at::zeros_like(c.mask);
    gb = at::zeros_like(c.bias);
  } else {
    auto g = padded(local_in(grad, l.mesh, l.out_pl, l.out_ext), c.before, c.after);
    torch::jit::Stack local{g, c.x, c.weight, c.offset, c.mask, c.bias};
    for (auto& v : scalar_args(c, p)) local.push_back(std::move(v));
    op.callBoxed(&local);
    gi = local[0].toTensor();
    gw = local[1].toTensor();
    goff = own_rows(local[2].toTensor(), c);
    gmask = p.use_mask ? own_rows(local[3].toTensor(), c) : local[3].toTensor();
    gb = local[4].toTensor();
  }
  if (c.windows) gi = c.windows->data.plan.scatter_add(gi, *l.mesh, /*consume=*/true);
  // Weight and bias: this rank's terms, summed over the mesh dims that split the batch or the positions (left
  // pending when the gradient buckets take them).
  std::vector<at::Tensor> terms{gw, gb};
  const bool pending = sum_param_grads(terms, {weight, weight}, l.param_dims, *l.mesh);
  Placements pp(l.mesh->ndim(), Placement::replicate());
  if (pending)
    for (auto m : l.param_dims) pp[m] = Placement::partial();
  stack->emplace_back(wrap(gi, l.mesh, l.in_pl, input.sizes().vec(), l.in_ext));
  stack->emplace_back(wrap(terms[0], l.mesh, pp, weight.sizes().vec(), {}));
  stack->emplace_back(wrap(goff, l.mesh, l.out_pl, offset.sizes().vec(), l.out_ext));
  stack->emplace_back(wrap(gmask, l.mesh, l.mask_pl, mask.sizes().vec(), l.mask_ext));
  stack->emplace_back(wrap(terms[1], l.mesh, pp, bias.sizes().vec(), {}));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(deform_conv) {
  dispatch::set_handler_when_defined("torchvision::deform_conv2d", &deform_conv2d_handler);
  dispatch::set_handler_when_defined("torchvision::_deform_conv2d_backward", &deform_conv2d_backward_handler);
}

} // namespace shardtensor::ops
