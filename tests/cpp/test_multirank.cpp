// Multi-rank tests of the C++ core over real Gloo process groups (ranks are threads: run_ranks.h). Skipped when the
// build could not include gloo's headers (then the Python suite covers multi-rank behaviour over Python-created
// groups).
#include <shardtensor/distributed.h>
#include <shardtensor/ring.h>
#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "run_ranks.h"

using namespace shardtensor;
using shardtensor::testing::run_ranks;

namespace {

at::Tensor global_tensor(std::vector<int64_t> shape) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return at::arange(n, at::kFloat).reshape(shape).sin();
}

} // namespace

class MultiRank : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!can_create_gloo()) GTEST_SKIP() << "built without gloo headers: C++ cannot create Gloo groups";
    setenv("SHARDTENSOR_GLOO_HOST", "127.0.0.1", 1);
  }
};

TEST_P(MultiRank, RedistributeRoundTripsUneven) {
  run_ranks(GetParam(), [](const World& w) {
    auto mesh = init_device_mesh(w, {w.size});
    auto full = global_tensor({7, 5});
    std::vector<int64_t> ext(w.size, 0);
    ext[0] = 7 - (w.size - 1); // uneven, with the default rule elsewhere
    for (int64_t i = 1; i < w.size; ++i) ext[i] = 1;
    auto x = distribute_tensor(full, mesh, {Placement::shard(0)}, {{0, ext}});
    TORCH_CHECK(at::allclose(full_tensor(x), full), "shard(0) round trip");
    auto y = redistribute(x, {Placement::shard(1)});
    TORCH_CHECK(at::allclose(full_tensor(y), full), "shard(0)->shard(1)");
    auto s = x.sum(0);
    TORCH_CHECK(shard_impl(s)->spec()->placements[0].is_partial(), "sum over the sharded dim is Partial");
    TORCH_CHECK(at::allclose(full_tensor(s), full.sum(0), 1e-5, 1e-5), "partial sum");
    TORCH_CHECK(at::allclose(full_tensor(x * 2 + 1), full * 2 + 1), "elementwise");
  });
}

TEST_P(MultiRank, ScatterFromAnyRank) {
  run_ranks(GetParam(), [](const World& w) {
    auto mesh = init_device_mesh(w, {w.size});
    auto full = global_tensor({5, 3});
    const int64_t src = w.size - 1;
    auto x = scatter_tensor(w.rank == src ? full : at::Tensor(), src, mesh, {Placement::shard(0)});
    TORCH_CHECK(at::allclose(full_tensor(x), full), "scatter");
  });
}

TEST_P(MultiRank, RingPassBothWaysAndItsGradient) {
  run_ranks(GetParam(), [](const World& w) {
    auto mesh = init_device_mesh(w, {w.size});
    const int64_t n = w.size, me = w.rank;
    auto rows = [](int64_t r) { return r % 2 + 1; };  // uneven blocks: the receiver names the sender's shape
    for (auto dir : {RingDirection::Forward, RingDirection::Backward}) {
      const int64_t from = dir == RingDirection::Forward ? (me - 1 + n) % n : (me + 1) % n;
      const int64_t to = dir == RingDirection::Forward ? (me + 1) % n : (me - 1 + n) % n;
      auto mine = at::full({rows(me), 2}, static_cast<double>(me), at::kFloat).requires_grad_(true);
      auto got = ring_pass({mine, at::arange(3, at::kLong) + me}, mesh, 0, {{rows(from), 2}, {3}}, dir);
      TORCH_CHECK(at::equal(got[0], at::full({rows(from), 2}, static_cast<double>(from), at::kFloat)), "block");
      TORCH_CHECK(at::equal(got[1], at::arange(3, at::kLong) + from), "int block");
      // The gradient of what this rank received goes back to its sender.
      (got[0] * static_cast<double>(me + 1)).sum().backward();
      TORCH_CHECK(at::equal(mine.grad(), at::full({rows(me), 2}, static_cast<double>(to + 1), at::kFloat)), "grad");
    }
    bool refused = false;
    try {
      ring_pass({at::ones({2})}, mesh, 0, {{2}, {2}});
    } catch (const c10::ValueError&) {
      refused = true;  // a local check: every rank raises alike, nothing was sent
    }
    TORCH_CHECK(refused, "two receive shapes for one tensor must raise ValueError");
  });
}

TEST(MultiRank2D, MeshOfFour) {
  if (!can_create_gloo()) GTEST_SKIP() << "built without gloo headers";
  setenv("SHARDTENSOR_GLOO_HOST", "127.0.0.1", 1);
  run_ranks(4, [](const World& w) {
    auto mesh = init_device_mesh(w, {2, 2}, {"a", "b"});
    auto full = global_tensor({5, 6, 3});
    auto x = distribute_tensor(full, mesh, {Placement::shard(0), Placement::shard(1)});
    auto y = redistribute(x, {Placement::shard(1), Placement::shard(0)});
    TORCH_CHECK(at::allclose(full_tensor(y), full), "2-D transpose of placements");
    TORCH_CHECK(at::allclose(full_tensor(x.mean(1)), full.mean(1), 1e-5, 1e-6), "2-D mean");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, MultiRank, ::testing::Values(1, 2, 3));
