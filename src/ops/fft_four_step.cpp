// The four-step 1-D FFT along a sharded dim (see fft_four_step.h). Every step is an op on ShardTensors that has a
// rule (reshape, the pencil FFT of fft.cpp, transpose, redistribute), so the layouts and collectives come from
// those rules and depend on the spec only; the one local step is the twiddle factor, computed from each rank's
// global offsets.
#include "ops/fft_four_step.h"

#include "comm/redistribute.h"
#include "ops/common.h"

#include <ATen/ops/_fft_c2c.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/polar.h>
#include <ATen/ops/real.h>
#include <ATen/ops/reshape.h>
#include <ATen/ops/slice.h>

#include <c10/util/MathConstants.h>

#include <cmath>

namespace shardtensor::ops {

namespace {

struct Plan {
  int64_t mesh_dim = -1;
  int64_t ranks = 1;
  int64_t rows = 0;     // N1
  int64_t columns = 0;  // N2
};

// The rows N1 of the (N1, N2) view: the divisor of n nearest sqrt(n) (N1 <= N2) with both factors at least `p`,
// so each of the two FFT stages has a free dim to hold the split. 0 when there is none (a prime n, n < p * p).
int64_t row_count(int64_t n, int64_t p) {
  for (auto a = static_cast<int64_t>(std::sqrt(static_cast<double>(n))); a >= p; --a)
    if (n % a == 0 && n / a >= p) return a;
  return 0;
}

// When the four-step applies to a transform of `x` along `dim` with `n` points; decided from the spec alone.
std::optional<Plan> plan_for(const at::Tensor& x, int64_t dim, int64_t n) {
  auto* impl = shard_impl(x);
  if (!impl) return std::nullopt;
  const auto& spec = *impl->spec();
  if (spec.has_partial()) return std::nullopt;
  Plan plan;
  int64_t count = 0;
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_shard() && spec.placements[m].dim == dim) {
      plan.mesh_dim = static_cast<int64_t>(m);
      ++count;
    }
  if (count != 1) return std::nullopt;
  plan.ranks = spec.mesh->size(plan.mesh_dim);
  // Another dim that can hold the split: the pencil transpose (one all-to-all) is cheaper.
  for (int64_t d = 0; d < x.dim(); ++d)
    if (d != dim && spec.mesh_dim_of(d) < 0 && x.size(d) >= plan.ranks) return std::nullopt;
  plan.rows = row_count(n, plan.ranks);
  plan.columns = plan.rows > 0 ? n / plan.rows : 0;  // rows == 0: no factorization (a prime length): Bluestein
  return plan;
}

// `x` with the plan's mesh dim splitting `dim` by `extents`, the rest of its layout kept.
at::Tensor split_along(const at::Tensor& x, const Plan& plan, int64_t dim, std::vector<int64_t> extents) {
  const auto& spec = *shard_impl(x)->spec();
  auto placements = spec.placements;
  auto ext = spec.dim_extents();
  const auto& old = placements[plan.mesh_dim];
  if (old.is_shard() && old.dim == dim && ext[dim] == extents) return x;
  if (old.is_shard()) ext.erase(old.dim);
  placements[plan.mesh_dim] = Placement::shard(dim);
  ext[dim] = std::move(extents);
  return redistribute_to(x, ShardSpec::make_with_dim_extents(spec.mesh, placements, x.sizes().vec(), ext));
}

std::vector<int64_t> times(std::vector<int64_t> v, int64_t f) {
  for (auto& e : v) e *= f;
  return v;
}

// exp(-+2 pi i k1 n2 / N) on this rank's block of the (.., N1, N2, ..) matrix `b`, in place of its local values.
at::Tensor twiddle(const at::Tensor& b, int64_t dim, int64_t n, bool forward) {
  const auto& spec = shard_impl(b)->spec();
  const auto& local = shard_impl(b)->local();
  const auto opts = at::TensorOptions().dtype(at::kLong);
  auto k1 = at::arange(local.size(dim), opts) + spec->local_offset(dim);
  auto n2 = at::arange(local.size(dim + 1), opts) + spec->local_offset(dim + 1);
  // k1 * n2 mod N in integers, so the angle keeps full precision for long signals.
  auto angle = (k1.unsqueeze(1) * n2.unsqueeze(0)).remainder(n).to(at::kDouble) *
               ((forward ? -2.0 : 2.0) * c10::pi<double> / static_cast<double>(n));
  auto factor = at::polar(at::ones_like(angle), angle).to(local.scalar_type());
  std::vector<int64_t> shape(local.dim(), 1);
  shape[dim] = local.size(dim);
  shape[dim + 1] = local.size(dim + 1);
  return make_shard_tensor(local * factor.view(shape), spec);
}

at::Tensor four_step(const at::Tensor& x_in, int64_t dim, int64_t normalization, bool forward, const Plan& plan) {
  const auto n = x_in.size(dim);
  // 1. Whole rows of the (N1, N2) view on each rank: the split in multiples of N2.
  auto x = split_along(x_in, plan, dim, times(default_split(plan.rows, plan.ranks), plan.columns));
  auto shape = x.sizes().vec();
  shape[dim] = plan.columns;
  shape.insert(shape.begin() + dim, plan.rows);
  // 2. Length-N1 transforms down the columns (the pencil moves the split to the N2 dim), 3. the twiddle,
  // 4. length-N2 transforms along the rows (the split moves back to the N1 dim). Each stage normalizes its own
  // length, so the product is the requested normalization of N.
  auto b = at::_fft_c2c(at::reshape(x, shape), {dim}, normalization, forward);
  auto c = at::_fft_c2c(twiddle(b, dim, n, forward), {dim + 1}, normalization, forward);
  // 5. Output k = k1 + N1 * k2: the transpose, split along k2, flattened.
  auto y = split_along(c.transpose(dim, dim + 1), plan, dim, default_split(plan.columns, plan.ranks));
  return at::reshape(y, x_in.sizes());
}

// exp(sign * pi i j^2 / n) for the integers j (complex double); j^2 taken mod 2n in integers, so the angle keeps
// full precision for long signals.
at::Tensor chirp_values(const at::Tensor& j, int64_t n, double sign) {
  auto angle = (j * j).remainder(2 * n).to(at::kDouble) * (sign * c10::pi<double> / static_cast<double>(n));
  return at::polar(at::ones_like(angle), angle);
}

// chirp_values for this rank's indices along `dim` of `t` (its global offsets), shaped to broadcast over the block.
at::Tensor chirp(const at::Tensor& t, int64_t dim, int64_t n, double sign) {
  const auto& local = shard_impl(t)->local();
  auto j = at::arange(local.size(dim), at::TensorOptions().dtype(at::kLong)) + shard_impl(t)->spec()->local_offset(dim);
  std::vector<int64_t> shape(local.dim(), 1);
  shape[dim] = local.size(dim);
  return chirp_values(j, n, sign).to(local.scalar_type()).view(shape);
}

// Bluestein's algorithm for a length n that has no four-step factorization (a prime): with w_j = exp(s pi i j^2 / n)
// (s = -1 forward), X_k = w_k sum_j (x_j w_j) conj(w)_{k-j}, a linear convolution, computed as a circular one of a
// length M >= 2n - 1 that the four-step can take (a power of two): the chirped signal zero-padded to M, its four-step
// transform times that of the chirp filter, the four-step inverse, the first n entries chirped again. Every step is a
// rule on ShardTensors (pad, four-step, pointwise, slice, redistribution): nothing whole on a rank; the filter's
// transform is computed split like the signal's. The result is split along `dim` by the default split.
at::Tensor bluestein(const at::Tensor& x, int64_t dim, int64_t normalization, bool forward, const Plan& plan) {
  const auto n = x.size(dim);
  const double sign = forward ? -1.0 : 1.0;
  int64_t m = 1;
  while (m < 2 * n - 1) m *= 2;
  Plan big = plan;
  for (;; m *= 2) {
    big.rows = row_count(m, plan.ranks);
    if (big.rows > 0) break;
  }
  big.columns = m / big.rows;
  const auto& xs = shard_impl(x)->spec();
  auto a = make_shard_tensor(shard_impl(x)->local() * chirp(x, dim, n, sign), xs);
  std::vector<int64_t> pad(2 * (x.dim() - dim), 0);
  pad.back() = m - n;  // after `dim`; constant_pad_nd lists the last dim first
  auto fa = four_step(at::constant_pad_nd(a, pad, 0), dim, /*normalization=*/0, true, big);
  // The filter conj(w)_q for q in (-n, n), circular over M, laid out like the signal along `dim` (each rank its
  // block of the default split of M), other dims of size 1.
  std::vector<int64_t> fshape(x.dim(), 1);
  fshape[dim] = m;
  auto fspec = ShardSpec::make_with_dim_extents(xs->mesh, [&] {
    Placements pl(xs->mesh->ndim(), Placement::replicate());
    pl[plan.mesh_dim] = Placement::shard(dim);
    return pl;
  }(), fshape, {{dim, default_split(m, plan.ranks)}});
  const auto first = fspec->local_offset(dim), count = fspec->local_shape[dim];
  auto q = at::arange(count, at::TensorOptions().dtype(at::kLong)) + first;
  auto lag = at::where(q < n, q, m - q);  // the circular lag; entries with n <= lag are zero
  auto filter = (chirp_values(lag, n, -sign) * (lag < n).to(at::kDouble))
                    .to(shard_impl(x)->local().scalar_type())
                    .view(fspec->local_shape);
  auto ff = four_step(make_shard_tensor(filter, fspec), dim, 0, true, big);
  auto conv = four_step(fa * ff, dim, /*normalization=*/2, false, big);  // by 1/M: the circular convolution
  auto head = at::slice(conv, dim, 0, n);
  auto y = split_along(head, plan, dim, default_split(n, plan.ranks));
  const auto& ys = shard_impl(y)->spec();
  auto out = shard_impl(y)->local() * chirp(y, dim, n, sign);
  if (normalization == 1) out = out / std::sqrt(static_cast<double>(n));
  if (normalization == 2) out = out / static_cast<double>(n);
  return make_shard_tensor(out, ys);
}

at::Tensor run(const at::Tensor& x, int64_t dim, int64_t normalization, bool forward, const Plan& plan) {
  return plan.rows > 0 ? four_step(x, dim, normalization, forward, plan)
                       : bluestein(x, dim, normalization, forward, plan);
}

} // namespace

std::optional<at::Tensor> four_step_c2c(const at::Tensor& x, int64_t dim, int64_t normalization, bool forward) {
  const auto plan = plan_for(x, dim, x.size(dim));
  if (!plan) return std::nullopt;
  return run(x, dim, normalization, forward, *plan);
}

std::optional<at::Tensor> four_step_r2c(const at::Tensor& x, int64_t dim, int64_t normalization, bool onesided) {
  const auto n = x.size(dim);
  const auto plan = plan_for(x, dim, n);
  if (!plan) return std::nullopt;
  auto full = run(x.to(c10::toComplexType(x.scalar_type())), dim, normalization, true, *plan);
  return onesided ? at::slice(full, dim, 0, n / 2 + 1) : full;
}

std::optional<at::Tensor> four_step_c2r(const at::Tensor& x, int64_t dim, int64_t normalization, int64_t n) {
  const auto plan = plan_for(x, dim, n);
  if (!plan) return std::nullopt;
  const auto half = n / 2 + 1;
  auto z = x.size(dim) > half ? at::slice(x, dim, 0, half) : x;
  std::vector<int64_t> pad(2 * (x.dim() - dim), 0);
  pad.back() = n - z.size(dim);  // after `dim`; constant_pad_nd lists the last dim first
  z = at::constant_pad_nd(z, pad, 0);
  // The DC entry (and Nyquist's for even n) counts once in the Hermitian extension, every other entry twice.
  const auto& spec = shard_impl(z)->spec();
  auto local = shard_impl(z)->local();
  auto weight = at::ones({local.size(dim)}, local.options().dtype(c10::toRealValueType(local.scalar_type())));
  const auto offset = spec->local_offset(dim);
  for (int64_t g : {int64_t{0}, n % 2 == 0 ? n / 2 : int64_t{-1}})
    if (g >= offset && g < offset + local.size(dim)) weight[g - offset] = 0.5;
  std::vector<int64_t> shape(local.dim(), 1);
  shape[dim] = local.size(dim);
  z = make_shard_tensor(local * weight.view(shape), spec);
  return at::real(run(z, dim, normalization, false, *plan)) * 2;
}

} // namespace shardtensor::ops
