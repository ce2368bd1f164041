// bucketize and searchsorted of a sharded tensor into a sorted sequence that every rank holds whole (a plain or
// replicated 1-D boundaries tensor): a lookup per element, so each rank looks up its own elements and the result is
// laid out like the input, no communication. A sharded or batched (N-D) sequence is declined: the fallback, or
// NotImplementedError in strict mode.
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// The local tensor of a sequence every rank must hold whole (plain, or a ShardTensor replicated everywhere).
at::Tensor whole_sequence(const char* op, const at::Tensor& seq, const char* what) {
  auto* impl = shard_impl(seq);
  if (!impl) return seq;
  auto resolved = resolve_partial(seq);
  if (!shard_impl(resolved)->spec()->all_replicate())
    dispatch::not_implemented(std::string(op) + " with a sharded " + what + ": every rank needs the whole sequence; "
                              "redistribute it to Replicate() first");
  return shard_impl(resolved)->local();
}

at::Tensor local_input(const at::Tensor& self) {
  return shard_impl(resolve_partial(self))->local();
}

// bucketize.Tensor(Tensor self, Tensor boundaries, *, bool out_int32=False, bool right=False)
at::Tensor bucketize_rule(const at::Tensor& self, const at::Tensor& boundaries, bool out_int32, bool right) {
  if (!shard_impl(self))
    dispatch::not_implemented("bucketize of a plain input into sharded boundaries: every rank needs the whole "
                              "boundaries tensor; redistribute it to Replicate() first");
  TORCH_CHECK_VALUE(boundaries.dim() == 1, "boundaries tensor must be 1 dimension, but got dim(", boundaries.dim(),
                    ")");
  auto b = whole_sequence("bucketize", boundaries, "boundaries tensor");
  auto x = resolve_partial(self);
  return make_shard_tensor(at::bucketize(shard_impl(x)->local(), b, out_int32, right), shard_impl(x)->spec());
}

// searchsorted.Tensor(Tensor sorted_sequence, Tensor self, *, bool out_int32=False, bool right=False,
//                     str? side=None, Tensor? sorter=None)
at::Tensor searchsorted_rule(const at::Tensor& sorted_sequence, const at::Tensor& self, bool out_int32, bool right,
                             std::optional<c10::string_view> side, const std::optional<at::Tensor>& sorter) {
  if (!shard_impl(self))
    dispatch::not_implemented("searchsorted of a plain input in a sharded sorted_sequence: every rank needs the whole "
                              "sequence; redistribute it to Replicate() first");
  if (sorted_sequence.dim() != 1)
    dispatch::not_implemented("searchsorted with an N-D sorted_sequence (its leading dims pair with the input's): "
                              "only a 1-D sequence is looked up locally; redistribute the input to Replicate() first");
  auto seq = whole_sequence("searchsorted", sorted_sequence, "sorted_sequence");
  std::optional<at::Tensor> sort_idx;
  if (sorter && sorter->defined()) sort_idx = whole_sequence("searchsorted", *sorter, "sorter");
  auto x = resolve_partial(self);
  return make_shard_tensor(at::searchsorted(seq, shard_impl(x)->local(), out_int32, right, side, sort_idx),
                           shard_impl(x)->spec());
}

} // namespace

SHARDTENSOR_RULE_FAMILY(bucketize) {
  dispatch::set_handler("aten::bucketize.Tensor", typed_handler(&bucketize_rule));
  dispatch::set_handler("aten::searchsorted.Tensor", typed_handler(&searchsorted_rule));
}

} // namespace shardtensor::ops
