// Single-process tests of placements, the split rule, spec validation and shape propagation.
#include <shardtensor/shard_tensor.h>

#include <gtest/gtest.h>


using namespace shardtensor;

TEST(Placement, EqualityAndStrings) {
  EXPECT_EQ(Placement::shard(1), Placement::shard(1));
  EXPECT_NE(Placement::shard(1), Placement::shard(0));
  EXPECT_NE(Placement::partial(ReduceOp::Sum), Placement::partial(ReduceOp::Max));
  EXPECT_EQ(Placement::replicate().str(), "Replicate()");
  EXPECT_EQ(Placement::partial(ReduceOp::Avg).str(), "Partial(avg)");
  EXPECT_EQ(to_string(Placements{Placement::shard(2), Placement::replicate()}), "(Shard(2), Replicate())");
  EXPECT_EQ(reduce_op_from_string("max"), ReduceOp::Max);
  EXPECT_THROW(reduce_op_from_string("prod"), c10::ValueError);
}

TEST(SplitRule, MatchesTensorSplit) {
  EXPECT_EQ(default_split(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(default_split(3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  EXPECT_EQ(default_split(0, 2), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(default_split(8, 1), (std::vector<int64_t>{8}));
}
