// Built-in rule families register themselves when the library loads (this binary is a C++ program without Python:
// nothing else installs them), each op has one owning family, and a second family's rule for it is refused.
#include "dispatch/registry.h"
#include "dispatch/rule_family.h"

#include <shardtensor/handler_registry.h>
#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <map>

using namespace shardtensor;

namespace {

std::string label(const std::string& family) {
  return family + " (src/ops/" + family + ".cpp)";
}

// Family -> an op whose rule it owns. The file of group_norm is norm.cpp, of point_search point_search_shard.cpp;
// reduction_grad and selection_grad own autograd rules only (checked below).
const std::map<std::string, std::string>& owned_ops() {
  static const std::map<std::string, std::string> ops = {
      {"attention", "aten::scaled_dot_product_attention"},
      {"batch_norm", "aten::batch_norm"},
      {"bucketize", "aten::bucketize.Tensor"},
      {"segment_reduce", "aten::segment_reduce"},
      {"cdist", "aten::_cdist_forward"},
      {"ctc_loss", "aten::_ctc_loss"},
      {"conv", "aten::convolution"},
      {"cross", "aten::linalg_cross"},
      {"diagonal", "aten::trace"},
      {"embedding", "aten::embedding"},
      {"embedding_bag", "aten::_embedding_bag"},
      {"factory", "aten::_to_copy"},
      {"fft", "aten::_fft_r2c"},
      {"foreach", "aten::_amp_foreach_non_finite_check_and_unscale_"},
      {"grid_sample", "aten::grid_sampler_2d"},
      {"im2col", "aten::im2col"},
      {"histogram", "aten::histc"},
      {"indexing", "aten::index_select"},
      {"interpolate", "aten::upsample_nearest2d"},
      {"linalg_batched", "aten::linalg_inv_ex"},
      {"linear", "aten::linear"},
      {"loss", "aten::mse_loss"},
      {"neighborhood_attention", "shardtensor::neighborhood_attention"},
      {"norm", "aten::native_layer_norm"},
      {"pad", "aten::constant_pad_nd"},
      {"pixel_shuffle", "aten::pixel_shuffle"},
      {"pointwise", "aten::add.Tensor"},
      {"pool", "aten::max_pool2d_with_indices"},
      {"position_writes", "aten::masked_scatter"},
      {"host_args", "aten::tensor_split.tensor_indices_or_sections"},
      {"index_writes", "aten::index_add"},
      {"max_unpool", "aten::max_unpool2d"},
      {"reduction", "aten::sum"},
      {"roll", "aten::roll"},
      {"rot90", "aten::rot90"},
      {"softmax", "aten::_softmax"},
      {"sort_fft", "aten::sort"},
      {"transformer_fastpath", "aten::_native_multi_head_attention"},
      {"stft", "aten::stft"},
      {"trilinear", "aten::_trilinear"},
      {"unfold", "aten::unfold"},
      {"unique", "aten::_unique2"},
      {"view", "aten::view"},
      {"view_copy", "aten::transpose_copy.int"},
      {"view_inplace", "aten::squeeze_"},
  };
  return ops;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// A late family (announced after the installer ran: it registers at once) that takes an op another family owns.
void register_second_convolution_rule() {
  dispatch::set_handler("aten::convolution", [](const c10::OperatorHandle&, torch::jit::Stack*) {});
}

void register_second_sum_autograd_rule() {
  dispatch::set_autograd_handler("aten::sum", [](const c10::OperatorHandle&, torch::jit::Stack*) { return false; });
}

std::string registration_error(void (*register_rules)()) {
  try {
    dispatch::RuleFamily late("late_test_family", __FILE__, register_rules);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

} // namespace

TEST(RuleFamily, EveryFamilyInstalledAtLoad) {
  const auto installed = dispatch::installed_rule_families();
  for (const auto& [family, op] : owned_ops()) {
    EXPECT_TRUE(contains(installed, label(family))) << family << " is not installed";
    EXPECT_EQ(dispatch::rule_family_of(op), label(family)) << op;
    EXPECT_TRUE(has_handler(op)) << op;
  }
  // Families without an aten op of their own (physicsnemo_neighbors, physicsnemo_grid_derivatives,
  // torch_harmonics_disco, torch_harmonics_attention, torchvision_detection, deform_conv: rules for other libraries'
  // ops, bound when those are defined, so none here).
  for (const char* family : {"group_norm (src/ops/norm.cpp)", "point_search (src/ops/point_search_shard.cpp)",
                             "physicsnemo_neighbors (src/ops/physicsnemo_neighbors.cpp)",
                             "physicsnemo_grid_derivatives (src/ops/physicsnemo_grid_derivatives.cpp)",
                             "torch_harmonics_disco (src/ops/torch_harmonics_disco.cpp)",
                             "torch_harmonics_attention (src/ops/torch_harmonics_attention.cpp)",
                             "torchvision_detection (src/ops/torchvision_detection.cpp)",
                             "deform_conv (src/ops/deform_conv.cpp)",
                             "reduction_grad (src/ops/reduction_grad.cpp)",
                             "selection_grad (src/ops/selection_grad.cpp)",
                             "sort_sharded (src/ops/sort_sharded.cpp)"})
    EXPECT_TRUE(contains(installed, family)) << family << " is not installed";
  EXPECT_EQ(dispatch::rule_family_of("aten::native_group_norm"), "group_norm (src/ops/norm.cpp)");
  EXPECT_EQ(dispatch::rule_family_of("shardtensor::knn"), "point_search (src/ops/point_search_shard.cpp)");
  EXPECT_EQ(installed.size(), owned_ops().size() + 11);
  EXPECT_GT(registered_handlers().size(), 1000u);
}

// Ops two families once registered, the later one silently winning: each has one owner now.
TEST(RuleFamily, FormerlyDoubleRegisteredOpsHaveOneOwner) {
  EXPECT_EQ(dispatch::rule_family_of("aten::clone"), label("pointwise")); // it carries the pointwise tag
  for (const char* op : {"aten::_fft_r2c", "aten::_fft_c2r", "aten::_fft_c2c"})
    EXPECT_EQ(dispatch::rule_family_of(op), label("fft")) << op;
}

TEST(RuleFamily, SecondRuleForAnOpIsRefused) {
  const auto msg = registration_error(&register_second_convolution_rule);
  EXPECT_NE(msg.find("two built-in rules for aten::convolution"), std::string::npos) << msg;
  EXPECT_NE(msg.find(label("conv")), std::string::npos) << msg;
  EXPECT_NE(msg.find("the family late_test_family ("), std::string::npos) << msg;
  // The owner's rule stays, and a refused family is not listed as installed.
  EXPECT_EQ(dispatch::rule_family_of("aten::convolution"), label("conv"));
  for (const auto& family : dispatch::installed_rule_families())
    EXPECT_EQ(family.find("late_test_family"), std::string::npos) << family;
  EXPECT_TRUE(dispatch::registering_family().empty());
}

TEST(RuleFamily, SecondAutogradRuleForAnOpIsRefused) {
  const auto msg = registration_error(&register_second_sum_autograd_rule);
  EXPECT_NE(msg.find("two built-in autograd rules for aten::sum"), std::string::npos) << msg;
  EXPECT_NE(msg.find(label("reduction_grad")), std::string::npos) << msg;
}

namespace {

shardtensor::MeshPtr single_rank_mesh() {
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups{c10::make_intrusive<c10d::ProcessGroup>(0, 1)};
  return std::make_shared<const Mesh>(std::vector<int64_t>{1}, groups, std::vector<int64_t>{0},
                                      std::vector<std::string>{}, c10::DeviceType::CPU, std::vector<int64_t>{0});
}

} // namespace

// An autograd rule that declines through not_implemented gives the op back to its own derivative formula (whose
// forward reaches the op's rule below autograd): the call succeeds and the gradient is the op's, instead of an error
// raised where no fallback could answer. The rule installed here always declines, so the op behaves as without it
// for the rest of this binary.
TEST(RuleFamily, DecliningAutogradRuleTakesTheOpsFormula) {
  std::atomic<int> asked{0};
  dispatch::set_autograd_handler("aten::flip", [&asked](const c10::OperatorHandle&, torch::jit::Stack*) -> bool {
    ++asked;
    dispatch::not_implemented("this test's autograd rule declines every call");
  });
  auto mesh = single_rank_mesh();
  const auto full = at::arange(6, at::kFloat).reshape({3, 2});
  auto x = make_shard_tensor(full.clone(), ShardSpec::make(mesh, {Placement::shard(0)}, {3, 2})).requires_grad_(true);
  auto y = at::flip(x, {0});
  EXPECT_EQ(asked.load(), 1);
  ASSERT_NE(shard_impl(y), nullptr);
  EXPECT_TRUE(at::equal(shard_impl(y)->local(), at::flip(full, {0})));
  (y * at::arange(6, at::kFloat).reshape({3, 2})).sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(at::equal(shard_impl(x.grad())->local(), at::flip(at::arange(6, at::kFloat).reshape({3, 2}), {0})));
}
