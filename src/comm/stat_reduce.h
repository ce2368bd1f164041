// The statistics executor: the collectives of the rule families that reduce (normalizations, softmax, losses, a
// contraction's partial sums, attention's fused gradient sums). A rule plans its statistics — per-rank terms, each
// with how its values combine across ranks — and the executor issues them: every term of one call travels in ONE
// collective per mesh dim, whatever their kinds and dtypes.
//
//   comm::StatReduce r;
//   const auto lse = r.log_sum_exp_over(x, {dim});   // softmax over a sharded dim: this rank's (max, sum exp)
//   r.run(mesh, {mesh_dim});
//   auto global_max = r.result(lse)[0], global_sum = r.result(lse)[1];
//
// Kinds: sums (an all-reduce of the packed terms when every term sums), max / min, moments (count, mean, M2:
// Chan's parallel formula, never E[x²] − E[x]²), log-sum-exp pairs (max, Σ exp(x − max): softmax's statistics
// in one collective instead of a max and then a sum), arg-extremes (value and index together) and plain gathers.
// When the kinds differ (or are not plain sums / all max / all min) the terms' bytes are all-gathered (each part in
// its own dtype) and every rank combines them in coordinate order, so every rank holds the same bits. Several mesh dims reduce one after the other (the combined terms of one are the next one's inputs).
//
// What a rule may rely on: the terms it gives are not modified; results have the terms' shapes and dtypes; a term
// that is undefined gives undefined results (and takes no bytes). What it must do: call run() on every rank of the
// mesh dims' groups with the same terms (kinds, shapes, dtypes) in the same order — a collective.
//
// Statistics are small and the rules that need them have no work that does not read them (a normalization's output,
// softmax's output and the backward's input gradient all do), so run() completes the collectives before it returns;
// the large partial sums that can wait (parameter gradients) go to the gradient buckets instead
// (dispatch/grad_buckets.h), which issue them asynchronously.
#pragma once

#include <shardtensor/mesh.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace shardtensor::comm {

class StatReduce {
 public:
  enum class Kind { Sum, Max, Min, Moments, LogSumExp, ArgMax, ArgMin, Gathered };

  // Each returns the term's index for result(). Parts must share one shape.
  size_t sum(const at::Tensor& t) { return add(Kind::Sum, {t}); }
  size_t max(const at::Tensor& t) { return add(Kind::Max, {t}); }
  size_t min(const at::Tensor& t) { return add(Kind::Min, {t}); }
  // A rank's element counts (broadcastable to `mean`), means and sums of squared deviations -> result {count, mean,
  // M2} of every rank's elements together.
  size_t moments(const at::Tensor& count, const at::Tensor& mean, const at::Tensor& m2);
  // A rank's max (-inf where it has no element) and Σ exp(x − max) -> result {max, Σ exp(x − max)} of every rank's
  // elements together.
  size_t log_sum_exp(const at::Tensor& max, const at::Tensor& sum_exp) { return add(Kind::LogSumExp, {max, sum_exp}); }
  // The same from the rank's elements of `x` over `dims` (kept as size 1): its max and Σ exp(x − max), with a
  // non-finite max read as 0 in the exponent (a rank without elements, or all -inf, adds nothing).
  size_t log_sum_exp_over(const at::Tensor& x, const std::vector<int64_t>& dims);

  // A rank's extreme values and their (global) indices -> result {value, index} of the first coordinate holding the
  // extreme (max / min's indices, as on one device).
  size_t arg_max(const at::Tensor& values, const at::Tensor& indices) { return add(Kind::ArgMax, {values, indices}); }
  size_t arg_min(const at::Tensor& values, const at::Tensor& indices) { return add(Kind::ArgMin, {values, indices}); }
  // Every coordinate's `t`, stacked on a new dim 0 (result {[n, shape...]}), for combinations a rule does itself
  // (a product, a prefix sum). With one mesh dim only.
  size_t gathered(const at::Tensor& t) { return add(Kind::Gathered, {t}); }

  // The collectives: one per mesh dim in `mesh_dims`, in order.
  void run(const Mesh& mesh, const std::vector<int64_t>& mesh_dims);

  const std::vector<at::Tensor>& result(size_t i) const { return terms_.at(i).parts; }

 private:
  struct Term {
    Kind kind;
    std::vector<at::Tensor> parts;
  };
  size_t add(Kind kind, std::vector<at::Tensor> parts);
  void run_dim(const Mesh& mesh, int64_t mesh_dim);
  std::vector<Term> terms_;
};

} // namespace shardtensor::comm
