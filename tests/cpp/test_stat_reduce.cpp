// The statistics executor (comm/stat_reduce.h) on real Gloo groups (ranks as threads, run_ranks.h): every kind
// against the single-process computation over the concatenated rows, with uneven and empty ranks, several kinds in
// one run, and indices that a float would round.
#include <shardtensor/distributed.h>

#include "comm/stat_reduce.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "run_ranks.h"

using namespace shardtensor;
using shardtensor::testing::run_ranks;

namespace {

// Rank r's rows of a [rows, 4] tensor: extents 3, 0, 4 (a rank without rows in the middle).
constexpr int64_t kExtents[] = {3, 0, 4};

at::Tensor full_rows() {
  return at::arange(7 * 4, at::kDouble).reshape({7, 4}).mul(0.37).sin().mul(5);
}

at::Tensor rows_of(int rank) {
  int64_t first = 0;
  for (int r = 0; r < rank; ++r) first += kExtents[r];
  return full_rows().narrow(0, first, kExtents[rank]);
}

} // namespace

class StatReduceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!can_create_gloo()) GTEST_SKIP() << "built without gloo headers: C++ cannot create Gloo groups";
    setenv("SHARDTENSOR_GLOO_HOST", "127.0.0.1", 1);
  }
};

TEST_F(StatReduceTest, EveryKindInOneRunMatchesOneProcess) {
  run_ranks(3, [](const World& w) {
    auto mesh = init_device_mesh(w, {w.size});
    auto x = rows_of(w.rank);
    const auto full = full_rows();
    const auto n = static_cast<double>(x.size(0));
    const auto inf = std::numeric_limits<double>::infinity();
    comm::StatReduce r;
    // Moments: a rank without rows contributes count 0.
    auto mean = n > 0 ? x.mean(0) : at::zeros({4}, x.options());
    auto m2 = n > 0 ? (x - mean).square().sum(0) : at::zeros({4}, x.options());
    const auto mom = r.moments(at::scalar_tensor(n, x.options()), mean, m2);
    // Log-sum-exp: -inf max where a rank has no rows.
    auto mx = n > 0 ? x.amax(0) : at::full({4}, -inf, x.options());
    auto base = at::where(mx == -inf, at::zeros({}, x.options()), mx);
    const auto lse = r.log_sum_exp(mx, (x - base).exp().sum(0));
    // Arg-max with int64 indices beyond float precision; a tie across ranks goes to the first coordinate.
    auto tied = at::full({2}, 7.0, x.options());
    auto idx = at::full({2}, (int64_t{1} << 40) + w.rank, at::kLong);
    const auto am = r.arg_max(w.rank == 1 ? at::full({2}, -1.0, x.options()) : tied, idx);
    const auto sum = r.sum(x.sum(0));
    const auto gat = r.gathered(at::full({1}, static_cast<int64_t>(w.rank * 10), at::kLong));
    r.run(*mesh, {0});

    auto [v, m] = at::var_mean(full, 0, /*correction=*/0);
    TORCH_CHECK(at::equal(r.result(mom)[0], at::full({4}, 7.0, x.options())), "moments count");
    TORCH_CHECK(at::allclose(r.result(mom)[1], m), "moments mean");
    TORCH_CHECK(at::allclose(r.result(mom)[2], v * 7), "moments M2");
    auto top = r.result(lse)[0];
    TORCH_CHECK(at::equal(top, full.amax(0)), "log-sum-exp max");
    TORCH_CHECK(at::allclose(top + r.result(lse)[1].log(), at::logsumexp(full, 0)), "log-sum-exp");
    TORCH_CHECK(at::equal(r.result(am)[1], at::full({2}, int64_t{1} << 40, at::kLong)), "arg-max index: ",
                r.result(am)[1]);
    TORCH_CHECK(at::equal(r.result(am)[0], tied), "arg-max value");
    TORCH_CHECK(at::allclose(r.result(sum)[0], full.sum(0)), "sum");
    TORCH_CHECK(at::equal(r.result(gat)[0].flatten(), at::tensor(std::vector<int64_t>{0, 10, 20})), "gathered");
  });
}

TEST_F(StatReduceTest, SumsTravelAsOneAllReduceAndKeepDtypes) {
  run_ranks(2, [](const World& w) {
    auto mesh = init_device_mesh(w, {w.size});
    comm::StatReduce r;
    const auto a = r.sum(at::full({3}, 1.5 + w.rank, at::kFloat));
    const auto b = r.sum(at::Tensor());  // undefined: stays undefined, takes no bytes
    const auto c = r.sum(at::full({2, 2}, 2.0 * (w.rank + 1), at::kDouble));
    const auto mn = r.min(at::Tensor());
    r.run(*mesh, {0});
    TORCH_CHECK(at::equal(r.result(a)[0], at::full({3}, 4.0, at::kFloat)), "float sum");
    TORCH_CHECK(!r.result(b)[0].defined(), "undefined term");
    TORCH_CHECK(r.result(c)[0].scalar_type() == at::kDouble && at::equal(r.result(c)[0], at::full({2, 2}, 6.0, at::kDouble)),
                "double sum");
    TORCH_CHECK(!r.result(mn)[0].defined(), "undefined min");
  });
}
