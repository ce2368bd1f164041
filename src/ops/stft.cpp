// torch.stft of a signal split along time (a long audio or sensor record across ranks).
//
// aten::stft is composite-implicit: its decomposition frames the signal with as_strided, which a ShardTensor
// cannot honour (it has no global storage). The rule runs above autograd and composes the transform from ops that
// have rules, so autograd records their backwards: the frames are Tensor.unfold(time, n_fft, hop) (a windowed read:
// each rank owns the frames that start in its rows, and reads the rows they need from its next neighbours through
// the halo plan), times the window (padded to n_fft), a one-sided or full FFT along the frame (local), and the
// frame / frequency dims swapped. With `center` the reflect (or other) padding of n_fft / 2 at the signal's two ends
// is the pad rule's. The frames dim of the result keeps the time shard; nothing is gathered. Arguments are checked
// by aten's own stft on meta tensors of the global shapes, so a bad argument raises torch's error on every rank.
#include "ops/common.h"

#include <ATen/ops/fft_fft.h>
#include <ATen/ops/fft_rfft.h>
#include <ATen/ops/stft.h>

namespace shardtensor::ops {

namespace {

at::Tensor meta_like(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kMeta));
}

// stft(Tensor self, int n_fft, int? hop_length=None, int? win_length=None, Tensor? window=None,
//      bool normalized=False, bool? onesided=None, bool? return_complex=None, bool? align_to_window=None) -> Tensor
at::Tensor stft_rule(const at::Tensor& self, int64_t n_fft, std::optional<int64_t> hop_length,
                     std::optional<int64_t> win_length, const std::optional<at::Tensor>& window, bool normalized,
                     std::optional<bool> onesided, std::optional<bool> return_complex,
                     std::optional<bool> align_to_window) {
  const bool has_window = window && window->defined();
  // torch's checks and its output shape (a 1-D or 2-D signal, 0 < n_fft <= length, a window of win_length, ...).
  const auto meta = at::stft(meta_like(self), n_fft, hop_length, win_length,
                             has_window ? std::optional<at::Tensor>(meta_like(*window)) : std::nullopt, normalized,
                             onesided, return_complex, align_to_window);
  const auto hop = hop_length.value_or(n_fft / 4);
  const auto win = win_length.value_or(n_fft);
  const auto left = (n_fft - win) / 2;
  // The window of win_length placed at offset `left` of each n_fft frame. align_to_window: frames of win_length
  // start every hop (the window's start, not the frame's), zero-extended to n_fft around it.
  const bool aligned = align_to_window.value_or(false);
  at::Tensor frames = self.unfold(-1, aligned ? win : n_fft, hop);
  const auto n_frames = meta.size(self.dim()); // (batch?, freq, frames[, 2])
  TORCH_INTERNAL_ASSERT(frames.size(-2) == n_frames, "stft: ", frames.size(-2), " frames, aten has ", n_frames);
  if (aligned) {
    if (has_window) frames = frames * *window;
    if (win != n_fft) frames = at::constant_pad_nd(frames, {left, n_fft - win - left}, 0);
  } else if (has_window) {
    frames = frames * (win == n_fft ? *window : at::constant_pad_nd(*window, {left, n_fft - win - left}, 0));
  }
  const bool complex_in = self.is_complex() || (has_window && window->is_complex());
  const std::string_view norm = normalized ? "ortho" : "backward";
  auto spectrum = onesided.value_or(!complex_in) ? at::fft_rfft(frames, std::nullopt, -1, norm)
                                                 : at::fft_fft(frames, std::nullopt, -1, norm);
  spectrum = spectrum.transpose(-1, -2);
  const bool want_complex = return_complex.value_or(complex_in);
  return want_complex ? spectrum : at::view_as_real(spectrum);
}

// stft.center(..., bool center=True, str pad_mode="reflect", ...): torch.stft's centering, n_fft / 2 of padding
// at both ends of the signal (through a 3-D view, as the pad kernels want), then the frames above.
at::Tensor stft_center_rule(const at::Tensor& self, int64_t n_fft, std::optional<int64_t> hop_length,
                            std::optional<int64_t> win_length, const std::optional<at::Tensor>& window, bool center,
                            c10::string_view pad_mode, bool normalized, std::optional<bool> onesided,
                            std::optional<bool> return_complex, std::optional<bool> align_to_window) {
  TORCH_CHECK_VALUE(!(center && align_to_window.has_value()),
                    "stft align_to_window should only be set when center = false");
  at::Tensor signal = self;
  if (center) {
    const auto d = self.dim();
    TORCH_CHECK_VALUE(d == 1 || d == 2, "stft: expected a 1D or 2D tensor, got ", d, "D");
    auto x3 = d == 1 ? self.reshape({1, 1, -1}) : self.unsqueeze(0);
    const auto pad = n_fft / 2;
    x3 = at::pad(x3, {pad, pad}, pad_mode);
    signal = d == 1 ? x3.reshape({-1}) : x3.squeeze(0);
  }
  return stft_rule(signal, n_fft, hop_length, win_length, window, normalized, onesided, return_complex,
                   align_to_window);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(stft) {
  const auto above = dispatch::RuleLevel::above_autograd;
  dispatch::set_handler("aten::stft", typed_handler(&stft_rule), above);
  dispatch::set_handler("aten::stft.center", typed_handler(&stft_center_rule), above);
}

} // namespace shardtensor::ops
