// Composite ops that read an argument tensor's values on the host: tensor_split's index tensor, ctc_loss's length
// tensors. Their decompositions take a data pointer, which a ShardTensor has not (it has no storage of its own),
// so a split or pending index raised "Cannot access data pointer". The rules run above autograd, before the
// decomposition: the argument's whole value (a few integers, gathered once) replaces it, and the composite runs on
// the rest as it would (the sharded tensor it splits, or the log-probabilities of the loss, keep their layouts).
#include "ops/common.h"

#include <ATen/ops/ctc_loss_native.h>
#include <ATen/ops/tensor_split_native.h>

namespace shardtensor::ops {

namespace {

// tensor_split.tensor_indices_or_sections(Tensor(a -> *) self, Tensor tensor_indices_or_sections, int dim=0)
std::vector<at::Tensor> tensor_split_rule(const at::Tensor& self, const at::Tensor& tensor_indices_or_sections,
                                          int64_t dim) {
  return at::native::tensor_split(self, whole_value(tensor_indices_or_sections), dim);
}

// ctc_loss.Tensor(Tensor log_probs, Tensor targets, Tensor input_lengths, Tensor target_lengths, int blank=0,
//                 int reduction=Mean, bool zero_infinity=False)
at::Tensor ctc_loss_rule(const at::Tensor& log_probs, const at::Tensor& targets, const at::Tensor& input_lengths,
                         const at::Tensor& target_lengths, int64_t blank, int64_t reduction, bool zero_infinity) {
  return at::native::ctc_loss(log_probs, targets, whole_value(input_lengths), whole_value(target_lengths), blank, reduction,
                              zero_infinity);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(host_args) {
  const auto above = dispatch::RuleLevel::above_autograd;
  dispatch::set_handler("aten::tensor_split.tensor_indices_or_sections", typed_handler(&tensor_split_rule), above);
  dispatch::set_handler("aten::ctc_loss.Tensor", typed_handler(&ctc_loss_rule), above);
}

} // namespace shardtensor::ops
