// A 1-D FFT along a sharded dim that no other dim can take the shard from (a long signal split along its only
// dim, or with batch and channel dims smaller than the mesh dim): the four-step (Bailey) algorithm on ShardTensors.
// The transformed dim of length N = N1 * N2 is viewed as an (N1, N2) matrix of rows; an FFT of length N1 down the
// columns (the pencil moves the split to the N2 dim), a twiddle factor exp(-+2 pi i k1 n2 / N) on the local
// block, an FFT of length N2 along the rows (the split moves back to the N1 dim), and the transpose the output
// index k1 + N1 k2 needs. Three all-to-alls of the signal (one when the split already has the row alignment it needs
// fewer), never the signal whole on a rank, every rank transforming 1/P of it. A length with no such factorization
// (a prime) goes through Bluestein's algorithm: a convolution of the chirped signal, computed by three four-steps of
// a power-of-two length.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace shardtensor::ops {

// The c2c transform of `x` along `dim` (normalization and direction as aten's `_fft_c2c`), or nullopt when the
// four-step does not apply: `dim` not sharded by exactly one mesh dim, or another dim at least as large as that mesh
// dim (the pencil transpose is cheaper). N with no factorization N1 * N2 with both factors at least the mesh dim's
// size (a prime length) runs Bluestein's algorithm. The result is split along `dim` (extents in multiples of N1;
// Bluestein's: the default split).
std::optional<at::Tensor> four_step_c2c(const at::Tensor& x, int64_t dim, int64_t normalization, bool forward);

// r2c (`_fft_r2c`) through four_step_c2c of the complex signal: the one-sided result is its first N / 2 + 1 entries.
std::optional<at::Tensor> four_step_r2c(const at::Tensor& x, int64_t dim, int64_t normalization, bool onesided);

// c2r (`_fft_c2r`, output length n): 2 Re(ifft(Z)) of the half spectrum zero-padded to n with its DC (and, for
// even n, Nyquist) entry halved -- the Hermitian extension's inverse without building the mirrored half.
std::optional<at::Tensor> four_step_c2r(const at::Tensor& x, int64_t dim, int64_t normalization, int64_t n);

} // namespace shardtensor::ops
