// pixel_shuffle / pixel_unshuffle (super-resolution upsamplers, space-to-depth) and channel_shuffle (ShuffleNet).
// Each moves data only within a spatial position's channels, or within an r x r block of positions: with the batch
// or spatial dims sharded every rank transforms its own rows, no communication. pixel_shuffle turns a rank's h rows
// into h * r; pixel_unshuffle needs every rank's rows in whole blocks of r (otherwise a block spans two ranks: the
// boundaries are first rounded to multiples of r, one all-to-all of the rows that move). A sharded channel dim: local for
// pixel_unshuffle (each channel becomes r^2 adjacent ones) and for pixel_shuffle when every rank holds whole groups
// of r^2 channels; otherwise (and for channel_shuffle, whose permutation spans every channel) the split moves to the
// largest other dim first (one all-to-all).
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include <functional>

namespace shardtensor::ops {

namespace {

// `x` with its channel dim (dim -3 for the pixel ops, dim 1 for channel_shuffle) whole: a split of it moves to the
// largest other dim (one all-to-all; an output's channels come from input channels on other ranks otherwise).
at::Tensor channels_whole(const at::Tensor& x, int64_t channel_dim, const char* op) {
  if (shard_impl(x)->spec()->mesh_dim_of(channel_dim) < 0) return x;
  auto moved = split_moved_off(x, channel_dim);
  if (!moved)
    dispatch::not_implemented(std::string(op) + " with the channel dim (" + std::to_string(channel_dim) +
                              ") sharded and no other dim as large as the mesh dim to take the split: an output's "
                              "channels come from input channels on other ranks; shard the batch or a spatial dim");
  return *moved;
}

// Does every rank's part of the channel dim hold whole groups of `group` channels?
bool channels_in_groups(const ShardSpec& spec, int64_t channel_dim, int64_t group) {
  const auto m = spec.mesh_dim_of(channel_dim);
  if (m < 0) return true;
  for (auto e : spec.extents[m])
    if (e % group != 0) return false;
  return true;
}

// The output of a pixel op on `x` (resolved) whose last two dims scale by `num` / `den` and dim -3 by den^2 / num^2:
// `op` on the local tensor. torch's CPU kernels hand an empty input back unreshaped, so a rank without elements
// (a zero extent) makes its empty output itself.
at::Tensor pixel_op(const at::Tensor& x, int64_t num, int64_t den,
                    const std::function<at::Tensor(const at::Tensor&)>& op) {
  const auto& spec = *shard_impl(x)->spec();
  const auto nd = x.dim();
  auto shape = spec.global_shape;
  shape[nd - 3] = shape[nd - 3] * den * den / (num * num);
  DimExtents ext = spec.dim_extents();
  if (auto it = ext.find(nd - 3); it != ext.end())  // a channel split of whole groups (channels_in_groups)
    for (auto& e : it->second) e = e * den * den / (num * num);
  for (auto d : {nd - 2, nd - 1}) {
    shape[d] = shape[d] * num / den;
    if (auto it = ext.find(d); it != ext.end())
      for (auto& e : it->second) e = e * num / den;
  }
  auto out_spec = ShardSpec::make_with_dim_extents(spec.mesh, spec.placements, shape, ext);
  const auto& local = shard_impl(x)->local();
  auto out = local.numel() == 0 ? at::empty(out_spec->local_shape, local.options()) : op(local);
  return make_shard_tensor(out, out_spec);
}

// pixel_shuffle(Tensor self, int upscale_factor)
at::Tensor pixel_shuffle_rule(const at::Tensor& self_arg, int64_t r) {
  TORCH_CHECK_VALUE(self_arg.dim() >= 3, "pixel_shuffle expects input to have at least 3 dimensions, but got input with ",
                    self_arg.dim(), " dimension(s)");
  TORCH_CHECK_VALUE(r > 0, "pixel_shuffle expects a positive upscale_factor, but got ", r);
  const auto c = self_arg.size(-3);
  TORCH_CHECK_VALUE(c % (r * r) == 0, "pixel_shuffle expects its input's 'channel' dimension to be divisible by the "
                    "square of upscale_factor, but input.size(-3)=", c, " is not divisible by ", r * r);
  auto self = resolve_partial(self_arg);
  // Channels split in whole groups of r^2 (one output channel each) stay split; otherwise the split moves off them.
  if (!channels_in_groups(*shard_impl(self)->spec(), self.dim() - 3, r * r))
    self = channels_whole(self, self.dim() - 3, "pixel_shuffle");
  return pixel_op(self, r, 1, [r](const at::Tensor& t) { return at::pixel_shuffle(t, r); });
}

// pixel_unshuffle(Tensor self, int downscale_factor)
at::Tensor pixel_unshuffle_rule(const at::Tensor& self_arg, int64_t r) {
  TORCH_CHECK_VALUE(self_arg.dim() >= 3, "pixel_unshuffle expects input to have at least 3 dimensions, but got input "
                    "with ", self_arg.dim(), " dimension(s)");
  TORCH_CHECK_VALUE(r > 0, "pixel_unshuffle expects a positive downscale_factor, but got ", r);
  TORCH_CHECK_VALUE(self_arg.size(-2) % r == 0, "pixel_unshuffle expects height to be divisible by downscale_factor, "
                    "but input.size(-2)=", self_arg.size(-2), " is not divisible by ", r);
  TORCH_CHECK_VALUE(self_arg.size(-1) % r == 0, "pixel_unshuffle expects width to be divisible by downscale_factor, "
                    "but input.size(-1)=", self_arg.size(-1), " is not divisible by ", r);
  // A split channel dim stays split: each input channel becomes r^2 adjacent output channels. A split spatial dim
  // whose extents are not multiples of r (a block of r rows would span two ranks) is re-laid out first with each
  // shard boundary rounded to the nearest multiple of r (one all-to-all of the rows that move, at most r/2 per
  // boundary); the gradient returns to the input's layout through the same re-layout's backward.
  auto self = resolve_partial(self_arg);
  const auto& spec = *shard_impl(self)->spec();
  auto ext = spec.dim_extents();
  bool aligned = true;
  for (auto d : {self.dim() - 2, self.dim() - 1}) {
    auto it = ext.find(d);
    if (it == ext.end()) continue;
    auto rounded = nearest_aligned(it->second, self.size(d), r);
    aligned = aligned && rounded == it->second;
    it->second = std::move(rounded);
  }
  if (!aligned) self = to_layout(self, spec.placements, ext);
  return pixel_op(self, 1, r, [r](const at::Tensor& t) { return at::pixel_unshuffle(t, r); });
}

// channel_shuffle(Tensor self, SymInt groups) and native_channel_shuffle: a permutation of dim 1.
at::Tensor channel_shuffle_on(const char* op, const at::Tensor& self_arg, int64_t groups) {
  TORCH_CHECK_VALUE(self_arg.dim() > 2, "channel_shuffle expects input to have at least 3 dimensions, but got input "
                    "with ", self_arg.dim(), " dimension(s)");
  TORCH_CHECK_VALUE(groups > 0, "Number of groups to divide channels in must be positive. Value of groups:", groups);
  TORCH_CHECK_VALUE(self_arg.size(1) % groups == 0, "Number of channels must be divisible by groups. Got ",
                    self_arg.size(1), " channels and ", groups, " groups.");
  auto self = channels_whole(resolve_partial(self_arg), 1, op);
  auto spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  return make_shard_tensor(std::string(op) == "native_channel_shuffle" ? at::native_channel_shuffle(x, groups)
                                                                       : at::channel_shuffle(x, groups),
                           spec);
}

at::Tensor channel_shuffle_rule(const at::Tensor& self, c10::SymInt groups) {
  return channel_shuffle_on("channel_shuffle", self, concrete_int(groups));
}

at::Tensor native_channel_shuffle_rule(const at::Tensor& self, c10::SymInt groups) {
  return channel_shuffle_on("native_channel_shuffle", self, concrete_int(groups));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(pixel_shuffle) {
  dispatch::set_handler("aten::pixel_shuffle", typed_handler(&pixel_shuffle_rule));
  dispatch::set_handler("aten::pixel_unshuffle", typed_handler(&pixel_unshuffle_rule));
  dispatch::set_handler("aten::channel_shuffle", typed_handler(&channel_shuffle_rule));
  dispatch::set_handler("aten::native_channel_shuffle", typed_handler(&native_channel_shuffle_rule));
}

} // namespace shardtensor::ops
