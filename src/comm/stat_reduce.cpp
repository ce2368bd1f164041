#include "comm/stat_reduce.h"

#include "comm/collectives.h"

#include <ATen/ATen.h>

#include <limits>

namespace shardtensor::comm {

size_t StatReduce::add(Kind kind, std::vector<at::Tensor> parts) {
  bool defined = true;
  for (const auto& p : parts) defined = defined && p.defined();
  for (auto& p : parts) {
    if (!defined) {
      p = at::Tensor();
      continue;
    }
    TORCH_INTERNAL_ASSERT(p.sizes() == parts[0].sizes(), "StatReduce: a term's parts differ in shape (", p.sizes(),
                          " vs ", parts[0].sizes(), ")");
  }
  terms_.push_back({kind, std::move(parts)});
  return terms_.size() - 1;
}

size_t StatReduce::moments(const at::Tensor& count, const at::Tensor& mean, const at::Tensor& m2) {
  if (!mean.defined()) return add(Kind::Moments, {at::Tensor(), at::Tensor(), at::Tensor()});
  return add(Kind::Moments, {count.to(mean.scalar_type()).expand(mean.sizes()), mean, m2});
}

size_t StatReduce::log_sum_exp_over(const at::Tensor& x, const std::vector<int64_t>& dims) {
  constexpr auto inf = std::numeric_limits<double>::infinity();
  auto shape = x.sizes().vec();
  bool empty = false;
  for (auto d : dims) {
    empty = empty || shape[d] == 0;
    shape[d] = 1;
  }
  auto local_max = empty ? at::full(shape, -inf, x.options()) : at::amax(x, dims, /*keepdim=*/true);
  auto base = at::where(at::isinf(local_max), at::zeros({}, x.options()), local_max);
  return log_sum_exp(local_max, at::sum(at::exp(x - base), dims, /*keepdim=*/true));
}

void StatReduce::run(const Mesh& mesh, const std::vector<int64_t>& mesh_dims) {
  for (const auto& t : terms_)
    TORCH_INTERNAL_ASSERT(t.kind != Kind::Gathered || mesh_dims.size() <= 1,
                          "StatReduce: a gathered term over several mesh dims");
  for (auto m : mesh_dims) run_dim(mesh, m);
}

namespace {

// The combined value of one term from its parts gathered over the group ([n, shape...] each).
std::vector<at::Tensor> combine(StatReduce::Kind kind, const std::vector<at::Tensor>& g) {
  using Kind = StatReduce::Kind;
  switch (kind) {
    case Kind::Sum:
      return {g[0].sum(0)};
    case Kind::Max:
      return {g[0].amax(0)};
    case Kind::Min:
      return {g[0].amin(0)};
    case Kind::Moments: {
      const auto &c = g[0], &mu = g[1], &m2 = g[2];
      auto total = c.sum(0);
      auto mean = (c * mu).sum(0) / total.clamp_min(1);
      auto dev = m2.sum(0) + (c * (mu - mean.unsqueeze(0)).square()).sum(0);
      return {total, mean, dev};
    }
    case Kind::ArgMax:
    case Kind::ArgMin: {
      // The first coordinate holding the extreme value: the smallest global index, as on one device.
      // (argmax refuses bool: max.dim of a mask, e.g. the first zero in cumprod's backward, compares it as bytes.)
      const auto v = g[0].scalar_type() == at::kBool ? g[0].to(at::kByte) : g[0];
      auto pick = kind == Kind::ArgMax ? at::argmax(v, 0, true) : at::argmin(v, 0, true);
      return {g[0].gather(0, pick).squeeze(0), g[1].gather(0, pick).squeeze(0)};
    }
    case Kind::Gathered:
      return g;
    case Kind::LogSumExp: {
      const auto &m = g[0], &s = g[1];
      auto top = m.amax(0);
      // A rank without elements (max -inf) adds nothing; top - (-inf) would make exp(nan) otherwise.
      auto scaled = at::where(m == -std::numeric_limits<double>::infinity(), at::zeros({}, s.options()),
                              s * (m - top.unsqueeze(0)).exp());
      return {top, scaled.sum(0)};
    }
  }
  TORCH_INTERNAL_ASSERT(false, "StatReduce: unknown kind");
}

// A fresh row-major copy: reinterpreting bytes as another dtype needs unit stride, aligned offsets and strides (a
// size-1 dim counts as contiguous whatever its stride, so contiguous() may keep one that is not). Statistics are small.
at::Tensor dense(const at::Tensor& t) {
  return t.clone(at::MemoryFormat::Contiguous);
}

} // namespace

void StatReduce::run_dim(const Mesh& mesh, int64_t mesh_dim) {
  bool any = false, all_sum = true, all_max = true, all_min = true;
  at::ScalarType dtype = at::kFloat;
  for (const auto& t : terms_) {
    if (!t.parts[0].defined()) continue;
    all_sum = all_sum && t.kind == Kind::Sum;
    all_max = all_max && t.kind == Kind::Max;
    all_min = all_min && t.kind == Kind::Min;
    for (const auto& p : t.parts) {
      dtype = any ? at::promote_types(dtype, p.scalar_type()) : p.scalar_type();
      any = true;
    }
  }
  if (!any) return;  // no defined term: nothing travels (the same on every rank)
  // Reductions the backend does element-wise travel in one dtype (the terms' promoted one); the rest travel as their
  // bytes (no promotion: indices stay exact beside float values), gathered and combined here.
  const bool elementwise = all_sum || all_max || all_min;
  std::vector<at::Tensor> flat;
  for (const auto& t : terms_)
    for (const auto& p : t.parts)
      if (p.defined())
        flat.push_back(elementwise ? p.reshape({-1}).to(dtype) : dense(p.reshape({-1})).view(at::kByte));
  auto packed = flat.size() == 1 ? flat[0] : at::cat(flat);
  if (packed.numel() == 0) {
    // Every term is empty (a rank whose block along another mesh dim has no rows; the shapes agree across the
    // group, so no rank communicates): the results still take their shapes, a gathered term's [n, shape...].
    if (elementwise) return;
    for (auto& t : terms_) {
      if (!t.parts[0].defined()) continue;
      std::vector<at::Tensor> gathered;
      for (const auto& p : t.parts) {
        auto shape = p.sizes().vec();
        shape.insert(shape.begin(), mesh.size(mesh_dim));
        gathered.push_back(at::empty(shape, p.options()));
      }
      t.parts = combine(t.kind, gathered);
    }
    return;
  }
  at::Tensor all;
  if (elementwise)
    all = all_reduce(packed, all_sum ? ReduceOp::Sum : all_max ? ReduceOp::Max : ReduceOp::Min, mesh, mesh_dim);
  else
    all = all_gather_v(packed.unsqueeze(0), 0, std::vector<int64_t>(mesh.size(mesh_dim), 1), mesh, mesh_dim);
  int64_t off = 0;
  for (auto& t : terms_) {
    if (!t.parts[0].defined()) continue;
    std::vector<at::Tensor> gathered;
    for (const auto& p : t.parts) {
      if (elementwise) {
        gathered.push_back(all.narrow(0, off, p.numel()).view(p.sizes()).to(p.scalar_type()));
        off += p.numel();
      } else {
        const auto bytes = p.numel() * static_cast<int64_t>(p.element_size());
        auto shape = p.sizes().vec();
        shape.insert(shape.begin(), all.size(0));
        gathered.push_back(dense(all.narrow(1, off, bytes)).view(p.scalar_type()).view(shape));
        off += bytes;
      }
    }
    t.parts = elementwise ? gathered : combine(t.kind, gathered);
  }
}

} // namespace shardtensor::comm
