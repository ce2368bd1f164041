// Single-process tests of placements, the split rule, spec validation and shape propagation.
#include <shardtensor/attention.h>
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

namespace {

// A mesh whose process groups carry only rank and size: spec math never communicates, so no backend is
// attached (calling a collective on these groups would throw, which these tests never do).
MeshPtr grid(std::vector<int64_t> shape, std::vector<int64_t> coord) {
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  for (size_t i = 0; i < shape.size(); ++i)
    groups.push_back(c10::make_intrusive<c10d::ProcessGroup>(static_cast<int>(coord[i]), static_cast<int>(shape[i])));
  std::vector<int64_t> ranks;
  int64_t n = 1;
  for (auto s : shape) n *= s;
  for (int64_t r = 0; r < n; ++r) ranks.push_back(r);
  return std::make_shared<const Mesh>(shape, groups, coord, std::vector<std::string>{}, c10::DeviceType::CPU, ranks);
}

} // namespace

TEST(Mesh, CoordinatesAndValidation) {
  auto m = grid({2, 3}, {1, 2});
  EXPECT_EQ(m->numel(), 6);
  EXPECT_EQ(m->coordinate_of(5), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(m->coordinate_of(3), (std::vector<int64_t>{1, 0}));
  EXPECT_TRUE(m->coordinate_of(9).empty());
  EXPECT_EQ(m->dim_names()[1], "dim1");
  auto g = c10::make_intrusive<c10d::ProcessGroup>(0, 2);
  // The coordinate must equal the rank in the mesh dim's group.
  EXPECT_THROW(Mesh({2}, {g}, {1}, {}, c10::DeviceType::CPU), c10::ValueError);
}

TEST(ShardSpec, DefaultAndExplicitExtents) {
  auto m = grid({4}, {1});
  auto s = ShardSpec::make(m, {Placement::shard(0)}, {10, 3});
  EXPECT_EQ(s->extents[0], (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(s->local_shape, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(s->local_offset(0), 3);
  auto u = ShardSpec::make(m, {Placement::shard(-1)}, {2, 5}, {{0, {0, 4, 0, 1}}});
  EXPECT_EQ(u->placements[0], Placement::shard(1)); // negative dims normalized
  EXPECT_EQ(u->local_shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(u->offset_of(0, 3), 4);
  EXPECT_TRUE(u->has_shard());
  EXPECT_FALSE(u->has_partial());
}

TEST(ShardSpec, RejectsBadInput) {
  auto m = grid({2, 2}, {0, 1});
  EXPECT_THROW(ShardSpec::make(m, {Placement::shard(0)}, {4}), c10::ValueError);                    // count
  EXPECT_THROW(ShardSpec::make(m, {Placement::shard(2), Placement::replicate()}, {4, 4}), c10::ValueError);
  EXPECT_THROW(ShardSpec::make(m, {Placement::shard(0), Placement::replicate()}, {4, 4}, {{0, {1, 1}}}),
               c10::ValueError);                                                                     // sum
  EXPECT_THROW(ShardSpec::make(m, {Placement::shard(0), Placement::replicate()}, {4, 4}, {{1, {2, 2}}}),
               c10::ValueError);                                                                     // not sharded
  EXPECT_THROW(ShardSpec::make(m, {Placement::shard(0), Placement::shard(0)}, {4, 4}), c10::NotImplementedError);
}

TEST(ShardSpec, TwoDimensionalMesh) {
  auto m = grid({2, 3}, {1, 2});
  auto s = ShardSpec::make(m, {Placement::shard(0), Placement::shard(2)}, {5, 4, 7});
  EXPECT_EQ(s->extents[0], (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(s->extents[1], (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(s->local_shape, (std::vector<int64_t>{2, 4, 2}));
  EXPECT_EQ(s->local_offset(0), 3);
  EXPECT_EQ(s->local_offset(2), 5);
  EXPECT_EQ(s->mesh_dim_of(2), 1);
  EXPECT_EQ(s->mesh_dim_of(1), -1);
}

TEST(ShardTensor, WrapsLocalWithGlobalMetadata) {
  auto m = grid({2}, {1});
  auto s = ShardSpec::make(m, {Placement::shard(0)}, {5, 3});
  auto t = make_shard_tensor(at::ones({2, 3}), s);
  EXPECT_TRUE(is_shard_tensor(t));
  EXPECT_EQ(t.sizes(), at::IntArrayRef({5, 3}));
  EXPECT_EQ(t.strides(), at::IntArrayRef({3, 1}));
  EXPECT_EQ(t.device(), at::Device(at::kCPU));
  EXPECT_THROW(t.data_ptr(), c10::Error);
  EXPECT_EQ(to_local(t).sizes(), at::IntArrayRef({2, 3}));
  EXPECT_THROW(to_local(at::ones({2})), c10::TypeError);
  auto d = t.detach();
  EXPECT_TRUE(is_shard_tensor(d));
  EXPECT_EQ(shard_impl(d)->spec().get(), s.get());
}

#include "comm/redistribute.h"

TEST(Redistribute, TargetSpecKeepsOrChoosesExtents) {
  auto m = grid({3}, {0});
  auto src = ShardSpec::make(m, {Placement::shard(0)}, {7, 2}, {{0, {0, 5, 2}}});
  // Same shard dim: extents kept. New dim: default split. Explicit: as given.
  EXPECT_EQ(redistribute_target_spec(*src, {Placement::shard(0)})->extents[0], (std::vector<int64_t>{0, 5, 2}));
  EXPECT_EQ(redistribute_target_spec(*src, {Placement::shard(1)})->extents[0], (std::vector<int64_t>{1, 1, 0}));
  EXPECT_EQ(redistribute_target_spec(*src, {Placement::shard(0)}, {{0, {3, 3, 1}}})->extents[0],
            (std::vector<int64_t>{3, 3, 1}));
  EXPECT_TRUE(redistribute_target_spec(*src, {Placement::replicate()})->all_replicate());
  auto p = ShardSpec::make(m, {Placement::partial(ReduceOp::Max)}, {4});
  EXPECT_TRUE(without_partial(p)->all_replicate());
}

TEST(Mesh, WithoutGlobalRanksUsesPositions) {
  auto g = c10::make_intrusive<c10d::ProcessGroup>(1, 3);
  auto m = Mesh::from_group(g, c10::DeviceType::CPU);
  EXPECT_EQ(m->coordinate_of(2), (std::vector<int64_t>{2}));
  EXPECT_TRUE(m->coordinate_of(3).empty());
}

TEST(AttentionStrategy, TypedSettingAndNames) {
  for (auto s : {AttentionStrategy::Auto, AttentionStrategy::Ring, AttentionStrategy::RingContiguous,
                 AttentionStrategy::AllToAll})
    EXPECT_EQ(parse_attention_strategy(to_string(s)), s);
  EXPECT_THROW(parse_attention_strategy("zigzag"), c10::ValueError);
  auto before = set_attention_strategy(AttentionStrategy::RingContiguous);
  EXPECT_EQ(attention_strategy(), AttentionStrategy::RingContiguous);
  EXPECT_EQ(set_attention_strategy(before), AttentionStrategy::RingContiguous);
  EXPECT_EQ(attention_strategy(), before);
}
