// The `_copy` variants of view ops (transpose_copy, view_copy, unbind_copy, ...: what functionalization and
// torch.export write instead of a view) and the `unsafe_` splits: the view op's own rule on the same arguments, then
// each result cloned (an unsafe split keeps its views, as on one device). One boxed rule serves them all, since each
// variant's schema is its view op's with the aliasing annotations dropped. The view rules decide layouts and
// communication from specs alone, so these do too. A view rule's refusal (a re-layout it cannot do) becomes this
// functional op's decline: the gather fallback, or NotImplementedError in strict mode.
//
// The `_scatter` ops are the other direction (slice_scatter, select_scatter, diagonal_scatter: how
// functionalization and torch.compile write `x[..., a:b] = y` and its kin): `self` cloned, the view's rule on the
// clone, `src` copied into the view (copy_'s rule brings `src` to the view's layout). A slice of a sharded dim is a
// view of each rank's own rows, so every rank writes only the part of the slice it holds and nothing travels but
// what `src` needs to match. select_scatter writes through a one-wide slice (select along a sharded dim would move
// the row to every rank first).
#include "ops/common.h"
#include "ops/concrete_ints.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

namespace shardtensor::ops {

namespace {

// {copy variant, its view op, whether the results are cloned}.
struct ViewVariant {
  const char* variant;
  const char* overload;
  const char* view_op;
  bool clone;
};

constexpr ViewVariant kVariants[] = {
    {"aten::alias_copy", "", "aten::alias", true},
    {"aten::detach_copy", "", "aten::detach", true},
    {"aten::expand_copy", "", "aten::expand", true},
    {"aten::t_copy", "", "aten::t", true},
    {"aten::transpose_copy", "int", "aten::transpose", true},
    {"aten::permute_copy", "", "aten::permute", true},
    {"aten::unsqueeze_copy", "", "aten::unsqueeze", true},
    {"aten::squeeze_copy", "", "aten::squeeze", true},
    {"aten::squeeze_copy", "dim", "aten::squeeze", true},
    {"aten::squeeze_copy", "dims", "aten::squeeze", true},
    {"aten::view_copy", "", "aten::view", true},
    {"aten::view_copy", "dtype", "aten::view", true},
    {"aten::_reshape_alias_copy", "", "aten::_reshape_alias", true},
    {"aten::select_copy", "int", "aten::select", true},
    {"aten::slice_copy", "Tensor", "aten::slice", true},
    {"aten::unfold_copy", "", "aten::unfold", true},
    {"aten::unbind_copy", "int", "aten::unbind", true},
    {"aten::split_copy", "Tensor", "aten::split", true},
    {"aten::split_with_sizes_copy", "", "aten::split_with_sizes", true},
    {"aten::narrow_copy", "", "aten::narrow", true},
    {"aten::unsafe_split", "Tensor", "aten::split", false},
    {"aten::unsafe_split_with_sizes", "", "aten::split_with_sizes", false},
};

c10::IValue cloned(const c10::IValue& v) {
  if (v.isTensor()) return at::clone(v.toTensor(), at::MemoryFormat::Contiguous);
  if (v.isTensorList()) {
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorVector()) out.push_back(at::clone(t, at::MemoryFormat::Contiguous));
    return out;
  }
  return v;
}

BoxedHandler variant_handler(const ViewVariant& variant) {
  return [variant](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    auto view_op = c10::Dispatcher::singleton().findSchemaOrThrow(variant.view_op, variant.overload);
    const auto n = op.schema().arguments().size();
    // The view op runs on a copy of the arguments: the originals stay on the stack for a decline.
    torch::jit::Stack call(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    try {
      view_op.callBoxed(&call);
    } catch (const c10::NotImplementedError& e) {
      dispatch::not_implemented(op, stack, std::string(variant.view_op) + "'s rule refused: " +
                                               e.what_without_backtrace());
    }
    torch::jit::drop(*stack, n);
    for (auto& v : call) stack->push_back(variant.clone ? cloned(v) : v);
  };
}

// `self` cloned (a pending sum completed: the write replaces its values), `write(view of the clone)` run under the
// view rules, `src` copied into it; a refusal of either becomes the op's decline.
template <typename ViewOf>
at::Tensor scatter_into_clone(const at::Tensor& self, const at::Tensor& src, const char* view_name, ViewOf view_of) {
  if (!shard_impl(self))
    dispatch::not_implemented("the written tensor is a plain tensor and the source a ShardTensor; distribute the "
                              "written tensor too");
  auto out = at::clone(resolve_partial(self));
  try {
    view_of(out).copy_(src);
  } catch (const c10::NotImplementedError& e) {
    dispatch::not_implemented(std::string(view_name) + " of the written tensor, or the copy of the source into it, "
                              "refused: " + e.what_without_backtrace());
  }
  return out;
}

// slice_scatter(Tensor self, Tensor src, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1)
at::Tensor slice_scatter_rule(const at::Tensor& self, const at::Tensor& src, int64_t dim,
                              std::optional<c10::SymInt> start, std::optional<c10::SymInt> end, c10::SymInt step) {
  return scatter_into_clone(self, src, "slice", [&](const at::Tensor& t) {
    return at::slice_symint(t, dim, start, end, step);
  });
}

// select_scatter(Tensor self, Tensor src, int dim, SymInt index)
at::Tensor select_scatter_rule(const at::Tensor& self, const at::Tensor& src, int64_t dim_arg, c10::SymInt index_arg) {
  const auto dim = c10::maybe_wrap_dim(dim_arg, self.dim());
  auto index = concrete_int(index_arg);
  TORCH_CHECK_INDEX(index >= -self.size(dim) && index < self.size(dim), "select_scatter: index ", index,
                    " out of range for dim ", dim, " of size ", self.size(dim));
  if (index < 0) index += self.size(dim);
  return scatter_into_clone(self, src.unsqueeze(dim), "select", [&](const at::Tensor& t) {
    return t.slice(dim, index, index + 1);
  });
}

// diagonal_scatter(Tensor self, Tensor src, int offset=0, int dim1=0, int dim2=1)
at::Tensor diagonal_scatter_rule(const at::Tensor& self, const at::Tensor& src, int64_t offset, int64_t dim1,
                                 int64_t dim2) {
  return scatter_into_clone(self, src, "diagonal", [&](const at::Tensor& t) {
    return t.diagonal(offset, dim1, dim2);
  });
}

} // namespace

SHARDTENSOR_RULE_FAMILY(view_copy) {
  dispatch::set_handler("aten::slice_scatter", typed_handler(&slice_scatter_rule));
  dispatch::set_handler("aten::select_scatter", typed_handler(&select_scatter_rule));
  dispatch::set_handler("aten::diagonal_scatter", typed_handler(&diagonal_scatter_rule));
  for (const auto& v : kVariants) {
    auto h = c10::Dispatcher::singleton().findOp({v.variant, v.overload});
    TORCH_INTERNAL_ASSERT(h.has_value(), "view_copy family: ", v.variant, ".", v.overload, " is not an aten op");
    dispatch::set_handler(h->operator_name(), variant_handler(v));
  }
}

} // namespace shardtensor::ops
