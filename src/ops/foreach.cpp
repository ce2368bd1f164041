// Ops on lists of tensors, as optimizers and gradient utilities issue them: every aten::_foreach_* op, the fused
// optimizer steps (_fused_adam(w)(_), _fused_sgd(_), _fused_adagrad(_)) and AMP's unscale check. torch.optim uses
// them by default on GPU (foreach=True, or fused=True), clip_grad_norm_ and GradScaler too.
//
// Each list index is an independent computation over tensors of one shape (a parameter, its gradient, its
// optimizer states), so index i runs on local shards: the first ShardTensor at index i (in argument order) sets
// that index's layout, the other lists' tensors at i are brought to it (the same layout: its local tensor; a plain
// tensor of the same shape: sliced like it; another layout: redistributed, when it is only read), and the op runs
// ONCE on the local lists (one multi-tensor kernel, as on one device). Plain 0-d tensors (step counters, scalars)
// pass unchanged. Written tensors must already have the index's layout: the op writes the local buffers in place.
//
// Per-tensor reductions (_foreach_norm, _foreach_max, _foreach_powsum) need the shards' terms combined: local terms
// of every sharded index, one all-reduce per (sharded mesh dims, dtype) group per mesh dim, and the results are
// Replicate. AMP's found_inf is a max over every rank holding a shard: each rank checks only its own shards, and
// ranks that disagree on skipping a step would diverge.
#include "comm/collectives.h"
#include "comm/stat_reduce.h"
#include "ops/common.h"
#include "ops/schema_util.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>
#include <map>
#include <optional>

namespace shardtensor::ops {

namespace {

bool is_tensor_list(const c10::Argument& a) {
  auto list = a.type()->cast<c10::ListType>();
  return list && list->getElementType()->kind() == c10::TypeKind::TensorType;
}

std::string layout_of(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  std::ostringstream os;
  if (impl) os << impl->spec()->str();
  else os << "plain " << t.sizes();
  return os.str();
}

[[noreturn]] void refuse(const c10::OperatorHandle& op, const std::string& why) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "ShardTensor: ", dispatch::qualified_name(op), " refused: ", why);
}

// The tensor list arguments of one call, with the layout that each index takes.
struct Lists {
  struct Arg {
    size_t index;  // argument index
    std::vector<at::Tensor> items;
    bool written;
  };
  std::vector<Arg> args;
  std::vector<SpecPtr> layout;  // per list index: the first ShardTensor's spec there, or null (a plain index)
};

Lists read_lists(const c10::OperatorHandle& op, const torch::jit::Stack* stack, size_t base) {
  const auto& schema = op.schema();
  Lists lists;
  size_t len = 0;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    if (!is_tensor_list(schema.arguments()[i])) continue;
    const auto& v = (*stack)[base + i];
    lists.args.push_back({i, v.toTensorVector(), is_written(schema.arguments()[i])});
    len = std::max(len, lists.args.back().items.size());
  }
  lists.layout.resize(len);
  for (size_t k = 0; k < len; ++k)
    for (const auto& a : lists.args)
      if (k < a.items.size() && a.items[k].defined())
        if (auto* impl = shard_impl(a.items[k])) {
          lists.layout[k] = impl->spec();
          break;
        }
  for (size_t k = 0; k < len; ++k)
    if (lists.layout[k] && lists.layout[k]->has_partial())
      refuse(op, "list index " + std::to_string(k) + " is " + lists.layout[k]->str() +
                     ": a pending reduction (Partial) in a list op; redistribute it to Replicate first");
  return lists;
}

// `t` (argument `arg` at list index k) as a local tensor of index k's layout `want`.
at::Tensor localize(const c10::OperatorHandle& op, const at::Tensor& t, const ShardSpec& want, const MeshPtr& mesh,
                    const std::string& arg, size_t k, bool written) {
  auto* impl = shard_impl(t);
  if (impl && impl->spec()->same_layout(want)) return impl->local();
  const bool same_shape = t.sizes() == c10::IntArrayRef(want.global_shape);
  if (!impl && t.dim() == 0 && want.ndim() != 0) return t;  // a step counter or a scalar: the same on every rank
  auto where = [&] {
    return "'" + arg + "'[" + std::to_string(k) + "] " + layout_of(t) + " at an index laid out as " + want.str();
  };
  if (written)
    refuse(op, where() + ": a tensor written by a list op must have its index's layout (create optimizer states "
                         "with torch.zeros_like of the parameter, or redistribute it)");
  if (!same_shape) {
    if (impl && t.dim() == 0) return shard_impl(resolve_partial(t))->local();
    refuse(op, where() + ": list ops on ShardTensors need one global shape per index");
  }
  // Read-only: a plain tensor of the same shape is Replicate (sliced locally); another layout is redistributed,
  // decided from the specs alone (the same on every rank).
  return local_as(t, mesh, want.placements, want.dim_extents());
}

c10::IValue as_list(const std::vector<at::Tensor>& items) {
  c10::List<at::Tensor> list;
  list.reserve(items.size());
  for (const auto& t : items) list.push_back(t);
  return c10::IValue(std::move(list));
}

// Put local lists and local scalar tensors on the stack. Returns the lists (for the reductions and wrapping).
Lists localize_arguments(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t base, const MeshPtr& mesh) {
  const auto& schema = op.schema();
  auto lists = read_lists(op, stack, base);
  for (auto& a : lists.args) {
    auto local = a.items;
    for (size_t k = 0; k < local.size(); ++k)
      if (lists.layout[k] && local[k].defined())
        local[k] = localize(op, local[k], *lists.layout[k], mesh, schema.arguments()[a.index].name(), k, a.written);
    (*stack)[base + a.index] = as_list(local);
  }
  // Single tensor arguments (a Tensor scalar of _foreach_mul_.Tensor, a Tensor lr, grad_scale, found_inf): a
  // ShardTensor there must be a 0-d value, taken complete.
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    auto& v = (*stack)[base + i];
    if (!v.isTensor()) continue;
    const auto t = v.toTensor();
    auto* impl = shard_impl(t);
    if (!impl) continue;
    if (is_written(schema.arguments()[i]) || t.dim() != 0)
      refuse(op, "'" + schema.arguments()[i].name() + "' is " + impl->spec()->str() +
                     ": list ops take ShardTensors in their tensor lists only (a single tensor argument must be a "
                     "plain tensor or a 0-d value)");
    v = shard_impl(resolve_partial(t))->local();
  }
  return lists;
}

// Wrap the local tensors of returned lists: index k of a returned list has index k's layout when its local shape
// is that layout's (0-d step counters stay plain).
void wrap_returns(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Lists& lists) {
  const auto nret = op.schema().returns().size();
  for (size_t r = 0; r < nret; ++r) {
    auto& out = (*stack)[stack->size() - nret + r];
    if (!out.isTensorList()) continue;
    auto items = out.toTensorVector();
    for (size_t k = 0; k < items.size() && k < lists.layout.size(); ++k) {
      const auto& want = lists.layout[k];
      if (!want || !items[k].defined() || items[k].sizes() != c10::IntArrayRef(want->local_shape)) continue;
      items[k] = make_shard_tensor(items[k], want);
    }
    out = as_list(items);
  }
}

void elementwise_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto base = stack->size() - op.schema().arguments().size();
  auto mesh = dispatch::common_mesh(op, stack);
  auto lists = localize_arguments(op, stack, base, mesh);
  op.callBoxed(stack);
  wrap_returns(op, stack, lists);
}

// AMP: the found_inf flag written by the unscale check is the max over every rank holding a shard of any
// gradient (mesh dims decided from the specs alone, so every rank issues the same all-reduces).
void amp_unscale_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto base = stack->size() - op.schema().arguments().size();
  auto mesh = dispatch::common_mesh(op, stack);
  const auto found_inf = (*stack)[base + 1].toTensor();
  TORCH_CHECK_NOT_IMPLEMENTED(!shard_impl(found_inf), "ShardTensor: ", dispatch::qualified_name(op),
                              " refused: found_inf is a ShardTensor; it must be the plain flag GradScaler creates");
  auto lists = localize_arguments(op, stack, base, mesh);
  std::vector<bool> sharded(mesh->ndim(), false);
  for (const auto& spec : lists.layout)
    if (spec)
      for (int64_t m = 0; m < mesh->ndim(); ++m) sharded[m] = sharded[m] || spec->placements[m].is_shard();
  op.callBoxed(stack);
  std::vector<int64_t> mesh_dims;
  for (int64_t m = 0; m < mesh->ndim(); ++m)
    if (sharded[m]) mesh_dims.push_back(m);
  if (!mesh_dims.empty()) {
    comm::StatReduce r;
    const auto i = r.max(found_inf);
    r.run(*mesh, mesh_dims);
    found_inf.copy_(r.result(i)[0]);
  }
}

// Per-tensor reductions: which one, and how its local terms combine.
enum class ListReduction { Norm, Max, PowSum };

struct Combine {
  ReduceOp op;
  double identity;  // the term of a rank holding no elements
};

Combine combine_for(ListReduction kind, double ord) {
  if (kind == ListReduction::Max) return {ReduceOp::Max, -std::numeric_limits<double>::infinity()};
  if (kind == ListReduction::Norm && std::isinf(ord))
    return ord > 0 ? Combine{ReduceOp::Max, 0.0} : Combine{ReduceOp::Min, std::numeric_limits<double>::infinity()};
  return {ReduceOp::Sum, 0.0};  // sum of |x|^p (p-norms, powsum) or a count (the 0-"norm")
}

// This rank's term of one tensor's reduction, in `dtype`.
at::Tensor local_term(ListReduction kind, const at::Tensor& local, double ord, at::ScalarType dtype,
                      const Combine& c) {
  if (local.numel() == 0) return at::full({}, c.identity, local.options().dtype(dtype));
  if (kind == ListReduction::Max) return local.max().to(dtype);
  auto a = local.abs().to(dtype);
  if (c.op == ReduceOp::Max) return a.max();
  if (c.op == ReduceOp::Min) return a.min();
  if (ord == 0) return (a != 0).sum().to(dtype);
  return ord == 1 ? a.sum() : a.pow(ord).sum();
}

at::Tensor finish_term(ListReduction kind, const at::Tensor& combined, double ord, const Combine& c) {
  if (kind != ListReduction::Norm || c.op != ReduceOp::Sum || ord == 0 || ord == 1) return combined;
  return ord == 2 ? combined.sqrt() : combined.pow(1.0 / ord);
}

void reduction_handler(ListReduction kind, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  const auto base = stack->size() - n;
  auto mesh = dispatch::common_mesh(op, stack);
  TORCH_CHECK_NOT_IMPLEMENTED(schema.returns().size() == 1, "ShardTensor: ", dispatch::qualified_name(op),
                              " refused: the out= form of a per-tensor reduction on ShardTensors is not supported; "
                              "call the functional form");
  auto lists = read_lists(op, stack, base);
  const auto& self = lists.args.at(0).items;
  double ord = 2;
  std::optional<at::ScalarType> dtype;
  if (kind != ListReduction::Max) {
    ord = (*stack)[base + 1].toScalar().toDouble();
    if (!(*stack)[base + 2].isNone()) dtype = (*stack)[base + 2].toScalarType();
    TORCH_CHECK_NOT_IMPLEMENTED(kind != ListReduction::PowSum || std::isfinite(ord), "ShardTensor: ",
                                dispatch::qualified_name(op), " refused: powsum with ord ", ord,
                                " on ShardTensors (finite orders only)");
  }
  const auto c = combine_for(kind, ord);

  // Plain indices: the op itself on the plain sub-list (one multi-tensor kernel, the single-device numbers).
  std::vector<at::Tensor> result(self.size());
  std::vector<size_t> plain_idx;
  std::vector<at::Tensor> plain;
  for (size_t k = 0; k < self.size(); ++k)
    if (!lists.layout[k]) {
      plain_idx.push_back(k);
      plain.push_back(self[k]);
    }
  if (!plain.empty()) {
    torch::jit::Stack sub(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
    sub[0] = as_list(plain);
    op.callBoxed(&sub);
    auto out = sub.back().toTensorVector();
    for (size_t j = 0; j < plain_idx.size(); ++j) result[plain_idx[j]] = out[j];
  }

  // Sharded indices: local terms grouped by (mesh dims to combine over, dtype).
  struct Group {
    std::vector<size_t> indices;
    std::vector<at::Tensor> terms;
  };
  std::map<std::pair<std::vector<bool>, at::ScalarType>, Group> groups;
  for (size_t k = 0; k < self.size(); ++k) {
    const auto& spec = lists.layout[k];
    if (!spec) continue;
    const auto& local = shard_impl(self[k])->local();
    const auto out_dtype = dtype.value_or(at::typeMetaToScalarType(local.dtype()));
    const auto term_dtype = c10::isComplexType(out_dtype) ? c10::toRealValueType(out_dtype) : out_dtype;
    std::vector<bool> dims(mesh->ndim());
    for (int64_t m = 0; m < mesh->ndim(); ++m) dims[m] = spec->placements[m].is_shard();
    auto& g = groups[{dims, term_dtype}];
    g.indices.push_back(k);
    g.terms.push_back(local_term(kind, local, ord, term_dtype, c));
  }
  // The statistics executor sends every dtype's terms of one set of mesh dims in one collective per mesh dim.
  std::map<std::vector<bool>, comm::StatReduce> by_dims;
  std::map<std::pair<std::vector<bool>, at::ScalarType>, size_t> term_of;
  for (auto& [key, g] : groups) {
    auto& r = by_dims[key.first];
    auto stacked = at::stack(g.terms);
    term_of[key] = c.op == ReduceOp::Sum ? r.sum(stacked) : c.op == ReduceOp::Max ? r.max(stacked) : r.min(stacked);
  }
  for (auto& [dims, r] : by_dims) {
    std::vector<int64_t> mesh_dims;
    for (int64_t m = 0; m < mesh->ndim(); ++m)
      if (dims[m]) mesh_dims.push_back(m);
    r.run(*mesh, mesh_dims);
  }
  for (auto& [key, g] : groups) {
    auto combined = finish_term(kind, by_dims[key.first].result(term_of[key])[0], ord, c);
    for (size_t j = 0; j < g.indices.size(); ++j)
      result[g.indices[j]] = make_shard_tensor(combined[static_cast<int64_t>(j)].clone(),
                                               dispatch::replicate_spec(mesh, {}));
  }
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  stack->emplace_back(as_list(result));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(foreach) {
  auto& d = c10::Dispatcher::singleton();
  const std::map<std::string, ListReduction> reductions = {
      {"aten::_foreach_norm", ListReduction::Norm},
      {"aten::_foreach_max", ListReduction::Max},
      {"aten::_foreach_powsum", ListReduction::PowSum},
  };
  for (const auto& name : d.getAllOpNames()) {
    const auto& base = name.name;
    const bool fused_step = base == "aten::_fused_adam" || base == "aten::_fused_adam_" ||
                            base == "aten::_fused_adamw" || base == "aten::_fused_adamw_" ||
                            base == "aten::_fused_sgd" || base == "aten::_fused_sgd_" ||
                            base == "aten::_fused_adagrad" || base == "aten::_fused_adagrad_";
    if (!starts_with(base, "aten::_foreach_") && !fused_step) continue;
    auto h = d.findOp(name);
    if (!h || h->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    if (auto it = reductions.find(base); it != reductions.end()) {
      const auto kind = it->second;
      dispatch::set_handler(name, [kind](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
        reduction_handler(kind, op, stack);
      });
    } else {
      dispatch::set_handler(name, elementwise_handler);
    }
  }
  dispatch::set_handler("aten::_amp_foreach_non_finite_check_and_unscale_", amp_unscale_handler);
}

} // namespace shardtensor::ops
