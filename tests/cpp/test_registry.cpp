// The one registration path: every rule (above and below autograd, built-in and registered) is listed, typed
// handlers run through c10's boxing, and replacing a rule while other threads dispatch the op is safe.
#include <shardtensor/fallback.h>
#include <shardtensor/handler_registry.h>
#include <shardtensor/shard_tensor.h>


#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>

using namespace shardtensor;

namespace {

MeshPtr one_rank_mesh() {
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups{c10::make_intrusive<c10d::ProcessGroup>(0, 1)};
  return std::make_shared<const Mesh>(std::vector<int64_t>{1}, groups, std::vector<int64_t>{0},
                                      std::vector<std::string>{}, c10::DeviceType::CPU, std::vector<int64_t>{0});
}

// Two rules for aten::roll (local on a one-rank mesh), told apart by their results.
at::Tensor roll_once(const at::Tensor& self, c10::SymIntArrayRef shifts, at::IntArrayRef dims) {
  auto* impl = shard_impl(self);
  return make_shard_tensor(at::roll_symint(impl->local(), shifts, dims), impl->spec());
}

at::Tensor roll_doubled(const at::Tensor& self, c10::SymIntArrayRef shifts, at::IntArrayRef dims) {
  auto* impl = shard_impl(self);
  return make_shard_tensor(at::roll_symint(impl->local(), shifts, dims) * 2, impl->spec());
}

bool listed(const std::vector<std::string>& names, const std::string& n) {
  return std::find(names.begin(), names.end(), n) != names.end();
}

} // namespace

TEST(Registry, ListsEveryRuleAboveAndBelowAutograd) {
  auto names = registered_handlers();
  for (const char* n : {"aten::linear", "aten::matmul", "aten::scaled_dot_product_attention", "aten::batch_norm",
                        "aten::_pad_circular", "aten::max_pool1d", "aten::index_select_backward", "aten::upsample_bilinear2d.vec",
                        "aten::upsample_nearest1d.vec", "shardtensor::knn", "shardtensor::radius_search",
                        "shardtensor::neighborhood_attention", "aten::add.Tensor", "aten::convolution"})
    EXPECT_TRUE(listed(names, n)) << n << " is not listed";
  EXPECT_TRUE(has_handler("linear"));
  EXPECT_TRUE(has_handler("shardtensor::knn"));
}

TEST(Registry, RegisteredHandlersCannotReplaceRulesAboveAutograd) {
  // A registered handler runs below autograd; the built-in linear rule records its own backward.
  EXPECT_THROW(register_handler("aten::linear", [](const c10::OperatorHandle&, torch::jit::Stack*) {}),
               c10::NotImplementedError);
}

TEST(Registry, TypedHandlerAndAtomicSwap) {
  auto mesh = one_rank_mesh();
  auto spec = ShardSpec::make(mesh, {Placement::shard(0)}, {4, 3});
  auto x = make_shard_tensor(at::arange(12, at::kFloat).reshape({4, 3}), spec);
  const auto once = at::roll(at::arange(12, at::kFloat).reshape({4, 3}), {1}, {1});

  register_handler("aten::roll", typed_handler(&roll_once));
  EXPECT_TRUE(at::equal(to_local(at::roll(x, {1}, {1})), once));

  // Swap the rule back and forth while another thread dispatches: every result is one rule's, never a crash.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> calls{0}, wrong{0};
  std::thread user([&] {
    while (!stop.load()) {
      auto y = to_local(at::roll(x, {1}, {1}));
      if (!at::equal(y, once) && !at::equal(y, once * 2)) wrong.fetch_add(1);
      calls.fetch_add(1);
    }
  });
  for (int i = 0; i < 2000 || calls.load() < 200; ++i)
    register_handler("aten::roll", typed_handler(i % 2 ? &roll_once : &roll_doubled));
  stop = true;
  user.join();
  EXPECT_EQ(wrong.load(), 0);
  // The last rule registered is the one that runs.
  register_handler("aten::roll", typed_handler(&roll_once));
  EXPECT_TRUE(at::equal(to_local(at::roll(x, {1}, {1})), once));
}

namespace {
// A typed rule that runs another sharded op first (its own rule runs and returns), then refuses the layout.
at::Tensor roll_refusing(const at::Tensor& self, c10::SymIntArrayRef, at::IntArrayRef) {
  auto negated = at::neg(self);
  (void)negated;
  shardtensor::not_implemented("rolling along a sharded dim is refused by this test rule");
}
} // namespace

TEST(Registry, TypedRuleRaisesNamingItsOpAndPlacements) {
  auto mesh = one_rank_mesh();
  auto x = make_shard_tensor(at::ones({4, 3}), ShardSpec::make(mesh, {Placement::shard(0)}, {4, 3}));
  register_handler("aten::roll", typed_handler(&roll_refusing));
  const bool was_strict = set_strict(true); // else the refusal runs the fallback (Registry.DeclinedRuleFallsBack)
  try {
    at::roll(x, {1}, {0});
    ADD_FAILURE() << "the rule did not raise";
  } catch (const c10::NotImplementedError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("aten::roll"), std::string::npos) << msg; // the running rule's op, not the nested neg
    EXPECT_EQ(msg.find("aten::neg"), std::string::npos) << msg;
    EXPECT_NE(msg.find("self: (Shard(0)) global [4, 3]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("refused by this test rule"), std::string::npos) << msg;
  }
  set_strict(was_strict);
  register_handler("aten::roll", typed_handler(&roll_once));
  // Outside any rule there is no running op to name.
  EXPECT_THROW(shardtensor::not_implemented("nothing runs"), c10::NotImplementedError);
}

namespace {
// A typed rule for an op with an optional tensor argument, which c10's boxing moves out of its stack slot: the
// refusal must still name it (typed_handler runs the rule on copies, so the op's arguments stay on the stack).
at::Tensor bincount_refusing(const at::Tensor& self, const std::optional<at::Tensor>& weights, int64_t minlength) {
  shardtensor::not_implemented("bincount over a sharded input is refused by this test rule");
}
} // namespace

TEST(Registry, TypedRuleErrorNamesOptionalAndListArguments) {
  auto mesh = one_rank_mesh();
  auto x = make_shard_tensor(at::arange(4, at::kLong), ShardSpec::make(mesh, {Placement::shard(0)}, {4}));
  register_handler("aten::bincount", typed_handler(&bincount_refusing));
  const bool was_strict = set_strict(true);
  try {
    at::bincount(x, at::ones({4}), 0);
    ADD_FAILURE() << "the rule did not raise";
  } catch (const c10::NotImplementedError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("self: (Shard(0)) global [4]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("weights: plain [4]"), std::string::npos) << msg;
  }
  set_strict(was_strict);
}

// Without strict mode a rule's refusal runs the gather-compute fallback on the op's arguments, which the typed
// adapter left on the stack (a Tensor? among them): the result is the op's on the full tensors, laid out like the
// input when the shapes agree.
TEST(Registry, DeclinedRuleFallsBack) {
  auto mesh = one_rank_mesh();
  const auto full = at::arange(12, at::kFloat).reshape({4, 3});
  auto x = make_shard_tensor(full.clone(), ShardSpec::make(mesh, {Placement::shard(0)}, {4, 3}));
  const bool was_strict = set_strict(false);
  register_handler("aten::roll", typed_handler(&roll_refusing));
  auto rolled = at::roll(x, {1}, {0});
  ASSERT_NE(shard_impl(rolled), nullptr);
  EXPECT_TRUE(at::equal(shard_impl(rolled)->local(), at::roll(full, {1}, {0})));
  EXPECT_EQ(shard_impl(rolled)->spec()->placements, shard_impl(x)->spec()->placements);
  register_handler("aten::roll", typed_handler(&roll_once));

  auto idx = make_shard_tensor(at::tensor({0, 2, 2, 3}, at::kLong), ShardSpec::make(mesh, {Placement::shard(0)}, {4}));
  const auto w = at::tensor({1.0, 2.0, 3.0, 4.0}, at::kDouble);
  register_handler("aten::bincount", typed_handler(&bincount_refusing));
  auto counts = at::bincount(idx, w, 6);
  ASSERT_NE(shard_impl(counts), nullptr);
  EXPECT_TRUE(at::equal(shard_impl(counts)->local(), at::bincount(shard_impl(idx)->local(), w, 6)));
  EXPECT_TRUE(shard_impl(counts)->spec()->all_replicate()); // another shape than every sharded argument
  set_strict(was_strict);
}

// An op without any rule runs through the fallback; in strict mode it raises.
TEST(Registry, NoRuleFallsBackUnlessStrict) {
  auto mesh = one_rank_mesh();
  const auto full = at::arange(10, at::kFloat).reshape({5, 2});
  auto x = make_shard_tensor(full.clone(), ShardSpec::make(mesh, {Placement::shard(0)}, {5, 2}));
  const bool was_strict = set_strict(false);
  // _pdist_forward has no rule (median and diag_embed, the former examples here, have one now).
  auto distances = at::_pdist_forward(x, 2.0);
  ASSERT_NE(shard_impl(distances), nullptr);
  EXPECT_TRUE(at::equal(shard_impl(distances)->local(), at::_pdist_forward(full, 2.0)));
  set_strict(true);
  EXPECT_THROW(at::_pdist_forward(x, 2.0), c10::NotImplementedError);
  set_strict(was_strict);
}
