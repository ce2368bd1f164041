// torch.rot90 (DLWP's cubed-sphere faces): a flip and a transpose of the two rotated dims, on the ShardTensor so
// each part takes its own rule. The transpose moves a shard from one rotated dim to the other without
// communication; only a flip of a sharded dim moves data (one all-to-all mirrors the rows). For k = 1 that is the
// second dim's flip, k = 3 the first's, k = 2 both.
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// rot90(Tensor self, int k=1, int[] dims=[0, 1]) -> Tensor
at::Tensor rot90_rule(const at::Tensor& self, int64_t k, at::IntArrayRef dims) {
  // torch's own checks, from global sizes.
  TORCH_CHECK_VALUE(dims.size() == 2, "expected total rotation dims == 2, but got dims = ", dims.size());
  TORCH_CHECK_VALUE(self.dim() >= 2, "expected total dims >= 2, but got total dims = ", self.dim());
  const auto d0 = wrap_dim(dims[0], self.dim()), d1 = wrap_dim(dims[1], self.dim());
  TORCH_CHECK_VALUE(d0 != d1, "expected rotation dims to be different, but got dim0 = ", dims[0],
                    " and dim1 = ", dims[1]);
  switch (((k % 4) + 4) % 4) {
    case 1: return self.flip({d1}).transpose(d0, d1);
    case 2: return self.flip({d0, d1});
    case 3: return self.flip({d0}).transpose(d0, d1);
    default: return self.clone();
  }
}

} // namespace

SHARDTENSOR_RULE_FAMILY(rot90) {
  dispatch::set_handler("aten::rot90", typed_handler(&rot90_rule));
}

} // namespace shardtensor::ops
