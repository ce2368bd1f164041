// The ring executor (comm/ring_loop.h) on real Gloo groups (ranks as threads, run_ranks.h): every rank visits
// every block once, in ring order, with the block its owner holds, and each block's accumulator comes home holding
// every rank's term; uneven extents with an empty rank in the middle.
#include <shardtensor/distributed.h>

#include "comm/ring_loop.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "run_ranks.h"

using namespace shardtensor;
using shardtensor::testing::run_ranks;

namespace {

const std::vector<int64_t> kExtents = {3, 0, 4};

// Coordinate c's block: [2, extent, 3] of value 100 c + the row's global index.
at::Tensor block_of(int64_t c) {
  int64_t first = 0;
  for (int64_t r = 0; r < c; ++r) first += kExtents[r];
  auto rows = at::arange(first, first + kExtents[c], at::kDouble).add(100.0 * c);
  return rows.view({1, -1, 1}).expand({2, kExtents[c], 3}).contiguous();
}

} // namespace

class RingLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!can_create_gloo()) GTEST_SKIP() << "built without gloo headers: C++ cannot create Gloo groups";
    setenv("SHARDTENSOR_GLOO_HOST", "127.0.0.1", 1);
  }
};

TEST_F(RingLoopTest, VisitsEveryBlockAndBringsAccumulatorsHome) {
  run_ranks(3, [](const World& w) {
    auto mesh = init_device_mesh(w, {w.size});
    const auto ring = comm::Ring::along(*mesh, 0, 1, kExtents);
    std::vector<int64_t> owners;
    auto home = comm::ring_loop(
        ring, {block_of(w.rank), block_of(w.rank).to(at::kFloat)}, {at::zeros({2, kExtents[w.rank], 3}, at::kDouble)},
        [&](int64_t step, int64_t owner, const std::vector<at::Tensor>& blocks, std::vector<at::Tensor>& acc) {
          TORCH_CHECK(static_cast<int64_t>(owners.size()) == step, "step ", step, " out of order");
          owners.push_back(owner);
          TORCH_CHECK(at::equal(blocks[0], block_of(owner)), "rank ", w.rank, " step ", step, ": block of ", owner);
          TORCH_CHECK(blocks[1].scalar_type() == at::kFloat && at::equal(blocks[1], block_of(owner).to(at::kFloat)),
                      "second block tensor keeps its dtype");
          acc[0].add_(1000.0 * (w.rank + 1));  // every rank adds its term to the visiting block's accumulator
        });
    const std::vector<int64_t> expected_owners = {w.rank, (w.rank + 2) % 3, (w.rank + 1) % 3};
    TORCH_CHECK(owners == expected_owners, "rank ", w.rank, " visited the owners out of ring order");
    TORCH_CHECK(home.size() == 1 && at::equal(home[0], at::full({2, kExtents[w.rank], 3}, 6000.0, at::kDouble)),
                "rank ", w.rank, ": the accumulator did not come home with all three terms: ", home[0]);
  });
}

TEST_F(RingLoopTest, LocalRingRunsOneStepWithoutPassing) {
  int64_t steps = 0;
  auto out = comm::ring_loop(comm::Ring::local(), {at::ones({2})}, {at::zeros({2})},
                             [&](int64_t step, int64_t owner, const std::vector<at::Tensor>& blocks,
                                 std::vector<at::Tensor>& acc) {
                               EXPECT_EQ(step, 0);
                               EXPECT_EQ(owner, 0);
                               acc[0].add_(blocks[0]);
                               ++steps;
                             });
  EXPECT_EQ(steps, 1);
  EXPECT_TRUE(at::equal(out[0], at::ones({2})));
}
