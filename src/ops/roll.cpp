// torch.roll: out[o] = self[(o - shift) mod L] along each rolled dim (Swin's shifted windows, periodic boundaries,
// fft.fftshift / ifftshift). The output keeps the input's layout. Along an unsharded dim the roll is local. Along a
// sharded dim each rank's outputs read one contiguous, wrapped range of global rows, which spans a few ranks: a halo
// plan (comm/halo_plan.h) gathers exactly that range, so only the rows that change owner travel (one all-to-all per
// sharded rolled dim; own rows are copied locally). roll is linear, so Partial placements stay pending. Its backward
// (aten's formula: a roll by the negated shifts) comes back through this rule.
#include "comm/halo_plan.h"
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include <c10/core/SymIntArrayRef.h>

namespace shardtensor::ops {

namespace {

int64_t positive_mod(int64_t a, int64_t n) {
  return ((a % n) + n) % n;
}

// A roll's exchange over its sharded dims. Built from the layout and the shifts alone (the same on every rank's view)
// and cached, so the next step's forward and backward plan nothing.
struct RollPlan {
  comm::HaloPlan halo;
};

// Along one sharded dim split by `extents`: coordinate c owns output rows [b_c, b_c + E_c), which read the input rows
// (b_c - shift + k) mod L in that order.
comm::RowRequests wrapped_rows(const std::vector<int64_t>& extents, int64_t L, int64_t shift) {
  comm::RowRequests want(extents.size());
  int64_t begin = 0;
  for (size_t c = 0; c < extents.size(); ++c) {
    for (int64_t k = 0; k < extents[c]; ++k) want[c].push_back(positive_mod(begin + k - shift, L));
    begin += extents[c];
  }
  return want;
}

// `shifts`: per sharded dim, its net shift in (0, L).
std::shared_ptr<const RollPlan> roll_plan(const ShardSpec& spec, const std::vector<std::pair<int64_t, int64_t>>& shifts,
                                          c10::Device device) {
  comm::PlanKey key;
  key.add_spec(spec).add_device(device).add(0);  // 0: a roll along dims
  for (const auto& [d, s] : shifts) key.add(d).add(s);
  return comm::cached_plan<RollPlan>(key, [&] {
    std::vector<comm::HaloDim> dims;
    for (const auto& [d, s] : shifts) {
      const auto m = spec.mesh_dim_of(d);
      dims.push_back({d, m, spec.extents[m], wrapped_rows(spec.extents[m], spec.global_shape[d], s)});
    }
    return RollPlan{comm::HaloPlan(dims, spec.mesh->coordinates(), device)};
  });
}

// Flattened roll (no dims) of a tensor sharded along one dim `d` with only size-1 dims before it: every rank owns a
// contiguous range [b·I, (b+E)·I) of the flattened tensor (I: the product of the dims after d), which reads the
// wrapped flat range starting at (b·I - s) mod N. That range covers E rows (s a multiple of I) or E + 1 rows starting
// at row (b - q - 1) mod L (s = q·I + r, r > 0), read from offset I - r of the flattened window.
struct FlatRollPlan {
  comm::HaloPlan halo;
  int64_t offset = 0;  // into this rank's flattened window
};

std::shared_ptr<const FlatRollPlan> flat_roll_plan(const ShardSpec& spec, int64_t d, int64_t inner, int64_t s,
                                                   c10::Device device) {
  comm::PlanKey key;
  key.add_spec(spec).add_device(device).add(1).add(d).add(s);  // 1: a flattened roll
  return comm::cached_plan<FlatRollPlan>(key, [&] {
    const auto m = spec.mesh_dim_of(d);
    const auto& ext = spec.extents[m];
    const auto L = spec.global_shape[d];
    const auto q = s / inner, r = s % inner;
    comm::RowRequests want(ext.size());
    int64_t begin = 0;
    for (size_t c = 0; c < ext.size(); ++c) {
      const auto rows = ext[c] == 0 ? 0 : ext[c] + (r > 0 ? 1 : 0);
      const auto first = begin - q - (r > 0 ? 1 : 0);
      for (int64_t k = 0; k < rows; ++k) want[c].push_back(positive_mod(first + k, L));
      begin += ext[c];
    }
    FlatRollPlan plan;
    plan.halo = comm::HaloPlan({comm::HaloDim{d, m, ext, std::move(want)}}, spec.mesh->coordinates(), device);
    plan.offset = r > 0 ? inner - r : 0;
    return plan;
  });
}

at::Tensor flat_roll(const at::Tensor& self, int64_t shift) {
  const auto& spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  const auto N = self.numel();
  int64_t sharded = -1;
  for (const auto& p : spec->placements) {
    if (!p.is_shard()) continue;
    if (sharded >= 0 && p.dim != sharded)
      not_implemented("a flattened roll (no dims) of a tensor sharded along several dims; pass dims, or "
                      "redistribute to one sharded dim first");
    sharded = p.dim;
  }
  if (sharded < 0 || N == 0) return make_shard_tensor(at::roll(x, {shift}), spec);
  for (int64_t i = 0; i < sharded; ++i)
    if (self.size(i) != 1)
      not_implemented("a flattened roll (no dims) with sharded dim " + std::to_string(sharded) +
                      " behind a dim of size > 1: the shards are not contiguous ranges of the flattened tensor; pass "
                      "dims, or shard the outermost dim");
  const auto s = positive_mod(shift, N);
  if (s == 0) return make_shard_tensor(x.clone(), spec);
  const auto inner = N / self.size(sharded);
  auto plan = flat_roll_plan(*spec, sharded, inner, s, x.device());
  auto window = plan->halo.gather(x, *spec->mesh).reshape({-1});
  return make_shard_tensor(window.narrow(0, window.numel() == 0 ? 0 : plan->offset, x.numel()).view(x.sizes()), spec);
}

// roll(Tensor self, SymInt[1] shifts, int[1] dims=[]) -> Tensor
at::Tensor roll_rule(const at::Tensor& self, c10::SymIntArrayRef shifts_arg, at::IntArrayRef dims_arg) {
  const auto shifts = concrete_ints(shifts_arg);
  TORCH_CHECK_VALUE(!shifts.empty(), "roll: `shifts` required");
  if (dims_arg.empty()) {
    TORCH_CHECK_VALUE(shifts.size() == 1, "roll: shifts and dimensions must align. shifts: ", shifts.size(), ", dims:0");
    return flat_roll(self, shifts[0]);
  }
  TORCH_CHECK_VALUE(shifts.size() == dims_arg.size(), "roll: shifts and dimensions must align. shifts: ", shifts.size(),
                    ", dims:", dims_arg.size());
  const auto& spec = shard_impl(self)->spec();
  const auto& x = shard_impl(self)->local();
  // Net shift per dim in [0, L): repeated dims add up, as aten rolls them one after the other.
  std::map<int64_t, int64_t> net;
  for (size_t i = 0; i < shifts.size(); ++i) {
    const auto d = wrap_dim(dims_arg[i], self.dim());
    const auto L = self.size(d);
    if (L > 0) net[d] = positive_mod(net[d] + positive_mod(shifts[i], L), L);
  }
  std::vector<int64_t> local_shifts, local_dims;
  std::vector<std::pair<int64_t, int64_t>> sharded;
  for (const auto& [d, s] : net) {
    if (s == 0) continue;
    if (spec->mesh_dim_of(d) < 0) {
      local_shifts.push_back(s);
      local_dims.push_back(d);
    } else {
      sharded.emplace_back(d, s);
    }
  }
  // roll returns a new tensor, never the input's buffer.
  auto out = local_dims.empty() ? (sharded.empty() ? x.clone() : x) : at::roll(x, local_shifts, local_dims);
  if (!sharded.empty()) out = roll_plan(*spec, sharded, x.device())->halo.gather(out, *spec->mesh);
  return make_shard_tensor(out, spec);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(roll) {
  dispatch::set_handler("aten::roll", typed_handler(&roll_rule));
}

} // namespace shardtensor::ops
