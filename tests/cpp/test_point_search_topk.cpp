// The candidate selection of the CUDA point search kernel (csrc_cuda/point_search_topk.cuh), run on the host: the
// register list (fixed capacity) and the row list (any k) must keep the k best candidates ordered by (distance,
// index), and the radius test must decide the boundary on the rounded distance. No GPU needed.
#include "point_search_topk.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

namespace {

using shardtensor::cuda::topk::accept;
using shardtensor::cuda::topk::RegisterList;
using shardtensor::cuda::topk::RowList;

// Squared distances with many exact ties (small integer coordinates) and a few NaNs.
std::vector<double> squared_distances(int n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> coord(0, 3);
  std::vector<double> d2(n);
  for (int j = 0; j < n; ++j) {
    double s = 0;
    for (int c = 0; c < 3; ++c) {
      const double diff = coord(gen) - 1.5;
      s += diff * diff;
    }
    d2[j] = (j % 17 == 5) ? std::nan("") : s;
  }
  return d2;
}

// Brute force: (d2, index) sorted lexicographically, NaN and out-of-radius dropped, first k, padded.
std::pair<std::vector<double>, std::vector<int64_t>> reference(const std::vector<double>& d2, int64_t k, double radius) {
  std::vector<std::pair<double, int64_t>> c;
  for (size_t j = 0; j < d2.size(); ++j)
    if (!std::isnan(d2[j]) && std::sqrt(d2[j]) <= radius) c.emplace_back(d2[j], static_cast<int64_t>(j));
  std::sort(c.begin(), c.end());
  std::vector<double> d(k, INFINITY);
  std::vector<int64_t> i(k, -1);
  for (int64_t s = 0; s < k && s < static_cast<int64_t>(c.size()); ++s) {
    d[s] = std::sqrt(c[s].first);
    i[s] = c[s].second;
  }
  return {d, i};
}

template <int KMAX>
void check_register_list(const std::vector<double>& d2, int64_t k, double radius) {
  const bool bounded = std::isfinite(radius);
  const double r2 = bounded ? radius * radius * (1.0 + 1e-4) + 1e-30 : 0.0;
  RegisterList<double, KMAX> reg;
  reg.init();
  for (size_t j = 0; j < d2.size(); ++j)
    if (accept(d2[j], bounded, bounded ? radius : 0.0, r2)) reg.insert(d2[j], static_cast<int64_t>(j));
  auto [rd, ri] = reference(d2, k, radius);
  for (int64_t s = 0; s < k; ++s) {
    EXPECT_EQ(reg.i[s], ri[s]) << "register list KMAX=" << KMAX << " k=" << k << " slot " << s;
    EXPECT_EQ(std::sqrt(reg.d[s]), rd[s]) << "slot " << s;
  }
}

void check_row_list(const std::vector<double>& d2, int64_t k, double radius) {
  const bool bounded = std::isfinite(radius);
  const double r2 = bounded ? radius * radius * (1.0 + 1e-4) + 1e-30 : 0.0;
  std::vector<double> d(k);
  std::vector<int64_t> i(k);
  RowList<double> row{d.data(), i.data(), k};
  for (size_t j = 0; j < d2.size(); ++j)
    if (accept(d2[j], bounded, bounded ? radius : 0.0, r2)) row.insert(d2[j], static_cast<int64_t>(j));
  row.finish();
  auto [rd, ri] = reference(d2, k, radius);
  EXPECT_EQ(i, ri) << "row list k=" << k;
  EXPECT_EQ(d, rd) << "row list k=" << k;
}

} // namespace

TEST(PointSearchTopk, RegisterListKeepsBestWithTies) {
  for (unsigned seed = 0; seed < 5; ++seed) {
    auto d2 = squared_distances(60, seed);
    for (int64_t k : {1, 3, 8}) check_register_list<8>(d2, k, INFINITY);
    for (int64_t k : {9, 16}) check_register_list<16>(d2, k, INFINITY);
    check_register_list<32>(d2, 32, INFINITY);
    check_register_list<16>(d2, 16, 1.6583123951777);  // sqrt(2.75): boundary distances included
    check_register_list<8>(d2, 8, 0.9);
  }
}

TEST(PointSearchTopk, RowListAnyK) {
  for (unsigned seed = 0; seed < 5; ++seed) {
    auto d2 = squared_distances(50, seed);
    for (int64_t k : {1, 4, 33, 50, 70}) check_row_list(d2, k, INFINITY);
    for (int64_t k : {2, 40}) check_row_list(d2, k, 1.6583123951777);
    check_row_list(d2, 5, 0.0);
  }
}

TEST(PointSearchTopk, RadiusBoundaryUsesRoundedDistance) {
  const float r = 0.3f;
  const float d2 = r * r;  // sqrt(d2) rounds to r (or just below) in float: inside the radius
  EXPECT_EQ(accept<float>(d2, true, r, r * r * (1.0f + 1e-4f)), std::sqrt(d2) <= r);
  EXPECT_FALSE(accept<float>(std::nanf(""), false, 0.f, 0.f));
  EXPECT_FALSE(accept<double>(4.0001, true, 2.0, 4.0 * (1 + 1e-4)));
  EXPECT_TRUE(accept<double>(4.0, true, 2.0, 4.0 * (1 + 1e-4)));
}
