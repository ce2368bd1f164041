// F.unfold (im2col) and F.fold (col2im), VOLO's outlook attention: sliding blocks of an image as columns, and
// their sum back into an image.
//
// im2col over a sharded H is a convolution's window read: a rank owns the block rows centred in its image rows (the
// halo planner's sliding-window rule with the kernel, stride, padding and dilation along H), receives the halo rows
// they read and runs the local im2col on that window (H padding done by the plan's zero rows) -- without building
// it where the border split applies (comm/halo_borders.h: im2col of the own rows with a symmetric H padding, the
// border block rows redone from border windows once the halo has arrived). The blocks dim
// L = oh * ow is sharded in whole block rows (extents b * ow). A sharded W is moved onto H first (one all-to-all),
// or, when another mesh dim already shards H, onto an unsplit batch with a row per rank (else it is gathered): the
// blocks dim can carry one mesh dim. Batch and channel
// shards stay local (the channels are the outer factor of C * kh * kw). Under autograd im2col has its own backward
// (local col2im of the window, halo gradients home) so the input gradient keeps the input's extents.
//
// col2im is im2col's adjoint: the image rows get the extents whose im2col partition is the columns' block rows
// (their boundaries at the centre rows of the first block of each rank) when such extents exist, else the default
// split with the columns redistributed to its block rows; each rank sums its blocks into the window of rows they
// cover (local col2im) and the halo rows go home (scatter_add).
#include "comm/halo_borders.h"
#include "comm/halo_plan.h"
#include "comm/redistribute.h"
#include "comm/spec_holder.h"
#include "dispatch/args.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"
#include "ops/once_differentiable.h"

#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Blocks {
  std::vector<int64_t> kernel, dilation, padding, stride; // (h, w) each

  comm::SlidingWindow along_h() const {
    comm::SlidingWindow w;
    w.kernel = kernel[0];
    w.dilation = dilation[0];
    w.padding = padding[0];
    w.stride = stride[0];
    return w;
  }
  int64_t out_h(int64_t H) const { return comm::conv_output_size(H, along_h()); }
  int64_t out_w(int64_t W) const {
    comm::SlidingWindow w;
    w.kernel = kernel[1];
    w.dilation = dilation[1];
    w.padding = padding[1];
    w.stride = stride[1];
    return comm::conv_output_size(W, w);
  }
  int64_t k() const { return kernel[0] * kernel[1]; }
};

Blocks blocks_of(at::IntArrayRef kernel, at::IntArrayRef dilation, at::IntArrayRef padding, at::IntArrayRef stride) {
  TORCH_CHECK_VALUE(kernel.size() == 2 && dilation.size() == 2 && padding.size() == 2 && stride.size() == 2,
                    "im2col/col2im: kernel_size, dilation, padding and stride must have 2 elements each");
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK_VALUE(kernel[i] > 0 && dilation[i] > 0 && stride[i] > 0 && padding[i] >= 0,
                      "im2col/col2im: kernel_size, dilation and stride must be positive and padding non-negative, got "
                      "kernel_size=", kernel, " dilation=", dilation, " padding=", padding, " stride=", stride);
  }
  return {kernel.vec(), dilation.vec(), padding.vec(), stride.vec()};
}

// The halo plan of im2col over an image (N, C, H, W) laid out as `img` with H sharded by mesh dim m.
struct Im2colPlan {
  comm::HaloPlan halo;
  std::vector<int64_t> block_rows; // per coordinate along m
  comm::BorderSplit split;         // direct: the forward builds no window (comm/halo_borders.h)
};

std::shared_ptr<const Im2colPlan> im2col_plan(const ShardSpec& img, const Blocks& b, c10::Device device) {
  comm::PlanKey key;
  key.add_spec(img).add_ints(b.kernel).add_ints(b.dilation).add_ints(b.padding).add_ints(b.stride).add_device(device);
  return comm::cached_plan<Im2colPlan>(key, [&] {
    const auto m = img.mesh_dim_of(2);
    const auto H = img.global_shape[2];
    auto part = comm::sliding_window_partition(img.extents[m], H, b.out_h(H), b.along_h(), comm::PadMode::Zeros);
    Im2colPlan plan;
    plan.block_rows = part.out_extents;
    plan.halo = comm::HaloPlan({comm::HaloDim{2, m, img.extents[m], std::move(part.want)}}, img.mesh->coordinates(),
                               device, 0.0);
    if (plan.halo.runs(0))
      plan.split = comm::border_split(img.extents[m], plan.block_rows, img.mesh->coordinate(m), H, b.along_h());
    return plan;
  });
}

// The padding of the local kernels: H is padded by the plan when sharded.
std::vector<int64_t> local_padding(const Blocks& b, bool h_sharded) {
  return {h_sharded ? 0 : b.padding[0], b.padding[1]};
}

// The columns' layout for an image layout: batch and channel shards carried over (channels times the kernel
// size), H's mesh dim shards the blocks dim in whole block rows.
SpecPtr cols_spec(const ShardSpec& img, const Blocks& b, const std::vector<int64_t>* block_rows) {
  const auto N = img.global_shape[0], C = img.global_shape[1];
  const auto oh = b.out_h(img.global_shape[2]), ow = b.out_w(img.global_shape[3]);
  Placements pl = img.placements;
  DimExtents ext;
  for (size_t m = 0; m < pl.size(); ++m) {
    if (!pl[m].is_shard()) continue;
    const auto& e = img.extents[m];
    std::vector<int64_t> scaled;
    if (pl[m].dim == 0) {
      ext[0] = e;
    } else if (pl[m].dim == 1) {
      for (auto v : e) scaled.push_back(v * b.k());
      ext[1] = scaled;
    } else {
      TORCH_INTERNAL_ASSERT(pl[m].dim == 2 && block_rows, "im2col: W must not be sharded here");
      for (auto v : *block_rows) scaled.push_back(v * ow);
      pl[m] = Placement::shard(2);
      ext[2] = scaled;
    }
  }
  return ShardSpec::make_with_dim_extents(img.mesh, pl, {N, C * b.k(), oh * ow}, ext);
}

// The image layout im2col works on: no Partial, W unsharded (moved onto H when H is free, else onto the batch when
// it is free and holds a row per rank, else gathered).
SpecPtr im2col_layout(const ShardSpec& spec) {
  auto pl = spec.placements;
  auto ext = spec.dim_extents();
  const auto mw = spec.mesh_dim_of(3);
  if (mw >= 0) {
    ext.erase(3);
    if (spec.mesh_dim_of(2) < 0) {
      pl[mw] = Placement::shard(2);
      ext[2] = default_split(spec.global_shape[2], spec.mesh->size(mw));
    } else if (spec.mesh_dim_of(0) < 0 && spec.global_shape[0] >= spec.mesh->size(mw)) {
      // H is split already: the batch takes W's mesh dim (one all-to-all, as a view merging two split dims does),
      // so the columns stay divided over both mesh dims (TNT's, PiT's and T2T-ViT's nn.Unfold on a 2-D mesh).
      pl[mw] = Placement::shard(0);
      ext[0] = default_split(spec.global_shape[0], spec.mesh->size(mw));
    } else {
      pl[mw] = Placement::replicate();
    }
  }
  for (auto& p : pl)
    if (p.is_partial()) p = Placement::replicate();
  return ShardSpec::make_with_dim_extents(spec.mesh, pl, spec.global_shape, ext);
}

// im2col of a local image laid out as `img` (4-D, W whole): this rank's columns.
// (aten's kernels refuse empty batch-and-channel shards, which a rank may hold: those get an empty result.)
at::Tensor im2col_local(const at::Tensor& x, const ShardSpec& img, const Blocks& b) {
  const bool h_sharded = img.mesh_dim_of(2) >= 0;
  const auto ow = b.out_w(img.global_shape[3]);
  const bool empty = x.size(0) == 0 || x.size(1) == 0;
  if (!h_sharded) {
    if (empty) return at::empty({x.size(0), x.size(1) * b.k(), b.out_h(img.global_shape[2]) * ow}, x.options());
    return at::im2col(x, b.kernel, b.dilation, b.padding, b.stride);
  }
  auto plan = im2col_plan(img, b, x.device());
  const auto mine = plan->block_rows[img.mesh->coordinate(img.mesh_dim_of(2))];
  if (plan->split.direct && !empty) {
    // Without the window: im2col of the own rows with the split's padding on H gives every block row of this
    // rank; the border block rows are redone from border windows and written over theirs (a view of the columns
    // as [N, C*k, block rows, ow] puts them on dim 2, the split dim).
    auto kernel = [&](const at::Tensor& in, int64_t pad, int64_t) -> std::vector<at::Tensor> {
      auto cols = at::im2col(in, b.kernel, b.dilation, {pad, b.padding[1]}, b.stride);
      return {cols.view({cols.size(0), cols.size(1), -1, ow})};
    };
    auto cols = comm::border_forward(plan->halo, plan->split, x, *img.mesh, kernel)[0];
    return cols.view({x.size(0), x.size(1) * b.k(), mine * ow});
  }
  auto window = plan->halo.gather(x, *img.mesh);
  if (mine == 0 || empty) return at::empty({x.size(0), x.size(1) * b.k(), mine * ow}, x.options());
  return at::im2col(window, b.kernel, b.dilation, local_padding(b, true), b.stride);
}

// col2im of local columns (laid out as cols_spec(img)) into a local image laid out as `img`.
at::Tensor col2im_local(const at::Tensor& cols, const ShardSpec& img, const Blocks& b) {
  const bool h_sharded = img.mesh_dim_of(2) >= 0;
  const auto W = img.global_shape[3];
  const bool empty = cols.size(0) == 0 || cols.size(1) == 0;
  if (!h_sharded) {
    if (empty) return at::zeros({cols.size(0), cols.size(1) / b.k(), img.local_shape[2], W}, cols.options());
    return at::col2im(cols, {img.local_shape[2], W}, b.kernel, b.dilation, b.padding, b.stride);
  }
  auto plan = im2col_plan(img, b, cols.device());
  const auto rows = plan->halo.window_rows(0);
  at::Tensor window;
  if (cols.size(2) == 0 || empty) {
    window = at::zeros({cols.size(0), cols.size(1) / b.k(), rows, W}, cols.options());
  } else {
    window = at::col2im(cols, {rows, W}, b.kernel, b.dilation, local_padding(b, true), b.stride);
  }
  return plan->halo.scatter_add(window, *img.mesh, /*consume=*/true);
}

// im2col is linear in its input: the backward is col2im (the adjoint, the window's halo rows returned to their
// owners), whose own backward is im2col again.
struct Im2colMap : LinearMap {
  SpecPtr spec, img;  // the input's layout (Partial read as Replicate) and the one im2col runs in
  Blocks b;
  Im2colMap(SpecPtr s, SpecPtr i, Blocks bl) : spec(std::move(s)), img(std::move(i)), b(bl) {}
  SpecPtr cols(c10::Device device) const {
    const auto m = img->mesh_dim_of(2);
    std::vector<int64_t> rows;
    if (m >= 0) rows = im2col_plan(*img, b, device)->block_rows;
    return cols_spec(*img, b, m >= 0 ? &rows : nullptr);
  }
  at::Tensor apply(const at::Tensor& x) const override {
    const auto xl = shard_impl(grad_to_spec(x, img))->local();
    return make_shard_tensor(im2col_local(xl, *img, b), cols(xl.device()));
  }
  at::Tensor adjoint(const at::Tensor& grad) const override {
    auto cspec = cols(grad.device());
    auto g = local_in(grad, spec->mesh, cspec->placements, cspec->dim_extents());
    return redistribute_to(make_shard_tensor(col2im_local(g, *img, b), img), spec);
  }
};

struct Im2colFn : torch::autograd::Function<Im2colFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& self, Blocks b) {
    ctx->set_materialize_grads(false);
    const auto& spec = shard_impl(self)->spec();
    auto img = im2col_layout(*spec);
    auto x = local_as(self, spec->mesh, img->placements, img->dim_extents());
    auto map = c10::make_intrusive<Im2colMap>(without_partial(spec), img, b);
    auto out = make_shard_tensor(im2col_local(x, *img, b), map->cols(x.device()));
    ctx->saved_data["map"] = map_ivalue(std::move(map));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_map_backward(ctx, grads, 2);
  }
};

// 3-D (unbatched) inputs run as a batch of one.
at::Tensor im2col_any(const at::Tensor& self, const Blocks& b, bool differentiable) {
  TORCH_CHECK_VALUE(self.dim() == 3 || self.dim() == 4, "im2col: expected a 3-D or 4-D input, got ", self.dim(), "-D");
  if (self.dim() == 3) return im2col_any(self.unsqueeze(0), b, differentiable).squeeze(0);
  if (differentiable) return Im2colFn::apply(self, b);
  at::NoGradGuard no_grad;
  const auto& spec = shard_impl(self)->spec();
  auto img = im2col_layout(*spec);
  auto x = local_as(self, spec->mesh, img->placements, img->dim_extents());
  const auto m = img->mesh_dim_of(2);
  std::vector<int64_t> rows;
  if (m >= 0) rows = im2col_plan(*img, b, x.device())->block_rows;
  return make_shard_tensor(im2col_local(x, *img, b), cols_spec(*img, b, m >= 0 ? &rows : nullptr));
}

// im2col(Tensor self, int[2] kernel_size, int[2] dilation, int[2] padding, int[2] stride) -> Tensor
at::Tensor im2col_rule(const at::Tensor& self, at::IntArrayRef kernel_size, at::IntArrayRef dilation,
                       at::IntArrayRef padding, at::IntArrayRef stride) {
  return im2col_any(self, blocks_of(kernel_size, dilation, padding, stride), false);
}

bool im2col_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dispatch::NamedArgs args(op, stack);
  const auto self = args.tensor("self");
  if (!shard_impl(self) || !self.requires_grad()) return false;
  auto b = blocks_of(args["kernel_size"].toIntVector(), args["dilation"].toIntVector(), args["padding"].toIntVector(),
                     args["stride"].toIntVector());
  auto out = im2col_any(self, b, true);
  torch::jit::drop(*stack, args.all().size());
  torch::jit::push(*stack, std::move(out));
  return true;
}

// The image extents along H whose im2col partition has `block_rows` per coordinate: each boundary at the centre
// row of the first block of the next coordinate. Empty when the rule cannot produce them (a coordinate whose
// blocks would need rows another one owns).
std::vector<int64_t> image_rows_for(const std::vector<int64_t>& block_rows, int64_t H, const Blocks& b) {
  const auto w = b.along_h();
  std::vector<int64_t> ext;
  int64_t prev = 0, blocks = 0;
  for (size_t c = 0; c + 1 < block_rows.size(); ++c) {
    blocks += block_rows[c];
    const auto a = std::clamp<int64_t>(blocks * w.stride - w.padding + (w.span() - 1) / 2, prev, H);
    ext.push_back(a - prev);
    prev = a;
  }
  ext.push_back(H - prev);
  auto part = comm::sliding_window_partition(ext, H, b.out_h(H), w, comm::PadMode::Zeros);
  if (part.out_extents != block_rows) return {};
  return ext;
}

// col2im(Tensor self, SymInt[2] output_size, int[2] kernel_size, int[2] dilation, int[2] padding, int[2] stride)
at::Tensor col2im_rule(const at::Tensor& self_in, c10::SymIntArrayRef output_size, at::IntArrayRef kernel_size,
                       at::IntArrayRef dilation, at::IntArrayRef padding, at::IntArrayRef stride) {
  TORCH_CHECK_VALUE(self_in.dim() == 2 || self_in.dim() == 3, "col2im: expected a 2-D or 3-D input, got ",
                    self_in.dim(), "-D");
  if (self_in.dim() == 2)
    return col2im_rule(self_in.unsqueeze(0), output_size, kernel_size, dilation, padding, stride).squeeze(0);
  const auto b = blocks_of(kernel_size, dilation, padding, stride);
  const auto size = concrete_ints(output_size);
  TORCH_CHECK_VALUE(size.size() == 2, "col2im: output_size must have 2 elements");
  const auto H = size[0], W = size[1];
  const auto oh = b.out_h(H), ow = b.out_w(W);
  auto self = resolve_partial(self_in);
  const auto& spec = shard_impl(self)->spec();
  TORCH_CHECK_VALUE(self.size(1) % b.k() == 0, "col2im: expected the size of dim 1 of the input (", self.size(1),
                    ") to be divisible by the product of kernel_size (", b.k(), ")");
  TORCH_CHECK_VALUE(self.size(2) == oh * ow, "col2im: given output_size=", size, ", kernel_size=", b.kernel,
                    ", dilation=", b.dilation, ", padding=", b.padding, ", stride=", b.stride, ", expected size of "
                    "input's dimension 2 to match the calculated number of sliding blocks ", oh, " * ", ow, " = ",
                    oh * ow, ", but got input.size(2)=", self.size(2));
  const auto N = self.size(0), C = self.size(1) / b.k();
  // The image layout: batch shards carried over, whole channel blocks, the blocks dim's mesh dim onto H.
  Placements img_pl(spec->placements.size(), Placement::replicate());
  DimExtents img_ext;
  for (size_t m = 0; m < img_pl.size(); ++m) {
    const auto& p = spec->placements[m];
    if (!p.is_shard()) continue;
    const auto& e = spec->extents[m];
    if (p.dim == 0) {
      img_pl[m] = p;
      img_ext[0] = e;
    } else if (p.dim == 1) {
      std::vector<int64_t> ch;
      bool whole = true;
      for (auto v : e) {
        whole = whole && v % b.k() == 0;
        ch.push_back(v / b.k());
      }
      if (whole) {
        img_pl[m] = Placement::shard(1);
        img_ext[1] = ch;
      }
    } else {
      std::vector<int64_t> block_rows;
      bool aligned = ow > 0;
      for (auto v : e) {
        aligned = aligned && v % ow == 0;
        block_rows.push_back(ow > 0 ? v / ow : 0);
      }
      auto rows = aligned ? image_rows_for(block_rows, H, b) : std::vector<int64_t>();
      img_pl[m] = Placement::shard(2);
      img_ext[2] = rows.empty() ? default_split(H, spec->mesh->size(static_cast<int64_t>(m))) : rows;
    }
  }
  auto img = ShardSpec::make_with_dim_extents(spec->mesh, img_pl, {N, C, H, W}, img_ext);
  const auto m = img->mesh_dim_of(2);
  std::vector<int64_t> rows;
  if (m >= 0) rows = im2col_plan(*img, b, self.device())->block_rows;
  auto cspec = cols_spec(*img, b, m >= 0 ? &rows : nullptr);
  auto cols = local_as(self, spec->mesh, cspec->placements, cspec->dim_extents());
  return make_shard_tensor(col2im_local(cols, *img, b), img);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(im2col) {
  dispatch::set_handler("aten::im2col", typed_handler(&im2col_rule));
  dispatch::set_autograd_handler("aten::im2col", im2col_autograd);
  dispatch::set_handler("aten::col2im", typed_handler(&col2im_rule));
}

} // namespace shardtensor::ops
