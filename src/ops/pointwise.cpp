// Elementwise ops (every aten op tagged `pointwise`, plus activations' backward ops, random elementwise ops and
// PReLU's kernels, and every in-place / out= variant of those, derived from the schemas): broadcast global shapes,
// pick the output layout from the sharded inputs (the written tensor's, for in-place and out=), bring inputs to it,
// run the op on local tensors. Partial inputs stay Partial only through ops that are linear in them.
#include "ops/common.h"
#include "ops/schema_util.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ExpandUtils.h>
#include <c10/core/GradMode.h>

#include <optional>
#include <unordered_set>
#include <unordered_map>

namespace shardtensor::ops {

namespace {

// How an op treats Partial(sum/avg) inputs.
enum class PartialRule { None, AllSame, OneFactor, Numerator, Unary };

const std::unordered_map<std::string, PartialRule>& partial_rules() {
  static const std::unordered_map<std::string, PartialRule> rules = {
      {"aten::add.Tensor", PartialRule::AllSame},   {"aten::add_.Tensor", PartialRule::AllSame},
      {"aten::add.out", PartialRule::AllSame},      {"aten::sub.Tensor", PartialRule::AllSame},
      {"aten::sub_.Tensor", PartialRule::AllSame},  {"aten::sub.out", PartialRule::AllSame},
      {"aten::mul.Tensor", PartialRule::OneFactor}, {"aten::mul_.Tensor", PartialRule::OneFactor},
      {"aten::mul.out", PartialRule::OneFactor},    {"aten::div.Tensor", PartialRule::Numerator},
      {"aten::div_.Tensor", PartialRule::Numerator}, {"aten::div.out", PartialRule::Numerator},
      {"aten::mul.Scalar", PartialRule::Unary},     {"aten::mul_.Scalar", PartialRule::Unary},
      {"aten::div.Scalar", PartialRule::Unary},     {"aten::div_.Scalar", PartialRule::Unary},
      {"aten::neg", PartialRule::Unary},            {"aten::neg_", PartialRule::Unary},
      {"aten::neg.out", PartialRule::Unary},
      // clone (.contiguous() of a non-contiguous tensor) of a pending sum: the terms' clones.
      {"aten::clone", PartialRule::Unary},          {"aten::clone.out", PartialRule::Unary},
      // complex(real, imag) of two pending sums is the sum of the terms' complex values (a spherical harmonic
      // transform's two Legendre contractions over a split latitude).
      {"aten::complex", PartialRule::AllSame},      {"aten::complex.out", PartialRule::AllSame},
  };
  return rules;
}

struct TensorArg {
  size_t index;     // argument index
  at::Tensor value;
  bool written;
  bool scalar_like; // wrapped number or 0-dim plain tensor
};

bool linear_partial(ReduceOp op) {
  return op == ReduceOp::Sum || op == ReduceOp::Avg;
}

// May mesh dim `m` keep a Partial placement through this op?
std::optional<Placement> partial_output(PartialRule rule, const std::vector<TensorArg>& inputs, size_t m,
                                        const MeshPtr& mesh) {
  if (rule == PartialRule::None) return std::nullopt;
  std::optional<Placement> partial;
  int n_partial = 0;
  bool any_plain_full = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& a = inputs[i];
    auto p = placements_of(a.value, mesh)[m];
    if (p.is_partial()) {
      if (!linear_partial(p.op)) return std::nullopt;
      if (partial && *partial != p) return std::nullopt;
      partial = p;
      ++n_partial;
      if (rule == PartialRule::Numerator && i != 0) return std::nullopt;
    } else if (rule == PartialRule::AllSame || !a.scalar_like || shard_impl(a.value)) {
      // A sum of partial terms plus a complete value (even a scalar) would add it once per rank.
      any_plain_full = true;
    }
  }
  if (!partial) return std::nullopt;
  switch (rule) {
    case PartialRule::AllSame: return any_plain_full ? std::nullopt : partial;
    case PartialRule::OneFactor:
    case PartialRule::Numerator: return n_partial == 1 ? partial : std::nullopt;
    case PartialRule::Unary: return n_partial == 1 && inputs.size() == 1 ? partial : std::nullopt;
    case PartialRule::None: break;
  }
  return std::nullopt;
}

// A sum of pending Partial(sum) terms plus (or minus) complete tensors — a Linear's bias added in place after its
// matmul (at::linear of a non-contiguous input: matmul, then `add_(bias)`), a residual — stays pending when only the
// first rank along mesh dim `m` adds the complete operands (the others add zeros), as a contraction's bias does:
// no communication, where completing it would all-reduce the whole result. Only when every pending operand already
// has the output's shape (so a rank that drops the complete ones still produces it) and no operand is sharded
// along `m` (that layout wins, above); scalars keep the old rule (completed).
std::optional<Placement> owner_adds_complete(PartialRule rule, const std::vector<TensorArg>& inputs, size_t m,
                                             const MeshPtr& mesh, c10::IntArrayRef out_shape) {
  if (rule != PartialRule::AllSame) return std::nullopt;
  std::optional<Placement> partial;
  bool any_complete = false;
  for (const auto& a : inputs) {
    if (a.scalar_like) return std::nullopt;
    const auto p = placements_of(a.value, mesh)[m];
    if (p.is_shard()) return std::nullopt;
    if (!p.is_partial()) {
      any_complete = true;
      continue;
    }
    if (p.op != ReduceOp::Sum || (partial && *partial != p) || a.value.sizes() != out_shape) return std::nullopt;
    partial = p;
  }
  return any_complete ? partial : std::nullopt;
}

// Results smaller than this (global elements) complete a pending sum by an all-reduce into a whole value; larger ones
// by a reduce-scatter into a split (split_for_pending_sum). Below it sit squeeze-excitation gates and a classifier's
// logits ((B, C) from a global pooling): a consumer usually needs them whole (`x * gate` with x split on H), so a
// split would cost a reduce-scatter and an all-gather where one all-reduce of a few kilobytes does, for no memory
// that matters. Above it sit activations (a token MLP's hidden layer, B x C x 4N).
constexpr int64_t kSplitPendingMinElements = int64_t{1} << 14;

// The output dim that mesh dim `m` splits when this op completes a pending sum over `m` that no sharded operand
// places: a dim not yet claimed, as large as the mesh dim, that a pending input holds at full size (so that the
// reduce-scatter moves 1/P of it). An outer dim (the largest) is preferred to the last: a Linear or a 1x1
// convolution usually follows an activation and contracts the last dim, which then stays local instead of
// leaving another pending sum. None: the result stays whole (all-reduce), as before.
std::optional<int64_t> split_for_pending_sum(const std::vector<TensorArg>& inputs, c10::IntArrayRef out_shape,
                                             size_t m, const MeshPtr& mesh, const std::vector<bool>& claimed) {
  const auto out_ndim = static_cast<int64_t>(out_shape.size());
  if (out_ndim == 0 || c10::multiply_integers(out_shape) < kSplitPendingMinElements) return std::nullopt;
  std::vector<bool> held(out_ndim, false);  // a pending input holds this output dim at full size
  bool pending = false;
  for (const auto& a : inputs) {
    if (a.scalar_like || !shard_impl(a.value) || !placements_of(a.value, mesh)[m].is_partial()) continue;
    pending = true;
    const auto shift = out_ndim - a.value.dim();
    for (int64_t d = 0; d < a.value.dim(); ++d)
      if (a.value.size(d) == out_shape[d + shift] && out_shape[d + shift] > 1) held[d + shift] = true;
  }
  if (!pending) return std::nullopt;
  const auto P = mesh->size(static_cast<int64_t>(m));
  const auto last = out_ndim - 1;
  auto best = largest_dim_for_split(out_shape, P, [&](int64_t d) { return d < last && held[d] && !claimed[d]; });
  if (best < 0 && held[last] && !claimed[last] && out_shape[last] >= P) best = last;
  return best < 0 ? std::nullopt : std::optional<int64_t>(best);
}

// `rule` is looked up once, when the op is bound (not per call).
void pointwise_handler(PartialRule rule, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  const auto base = stack->size() - n;
  auto mesh = dispatch::common_mesh(op, stack);

  std::vector<TensorArg> inputs;
  std::vector<TensorArg> writes; // in-place `self`, out= tensors, rrelu's noise
  for (size_t i = 0; i < n; ++i) {
    const auto& v = (*stack)[base + i];
    if (!v.isTensor()) {
      TORCH_CHECK_NOT_IMPLEMENTED(!v.isTensorList() && !(v.isList() && !v.toListRef().empty() &&
                                                         v.toListRef()[0].isTensor()),
                                  "ShardTensor: ", dispatch::qualified_name(op), " takes a tensor list; "
                                  "elementwise ops on tensor lists are not domain-parallel");
      continue;
    }
    const auto& t = v.toTensor();
    if (!t.defined()) continue;
    TensorArg a{i, t, is_written(schema.arguments()[i]),
                !shard_impl(t) && (t.dim() == 0 || t.unsafeGetTensorImpl()->is_wrapped_number())};
    if (a.written) writes.push_back(a);
    else inputs.push_back(a);
  }
  // The written tensor that sets the layout: `self` of an in-place op, else the first one (out0 of a two-output
  // out= op). The others are written with it and must be laid out alike (checked below).
  std::optional<TensorArg> written;
  for (const auto& w : writes)
    if (!written || schema.arguments()[w.index].name() == "self") written = w;
  // The global output shape: the broadcast of every input's global shape.
  c10::DimVector out_shape;
  bool first = true;
  for (const auto& a : inputs) {
    out_shape = first ? c10::DimVector(a.value.sizes()) : at::infer_size_dimvector(out_shape, a.value.sizes());
    first = false;
  }
  if (written) {
    // In-place and out=: the written tensor's shape; inputs must broadcast to it.
    const auto wsize = c10::DimVector(written->value.sizes());
    TORCH_CHECK_NOT_IMPLEMENTED(first || at::is_expandable_to(out_shape, wsize), "ShardTensor: ",
                                dispatch::qualified_name(op), " would resize its output ", written->value.sizes(),
                                " to the inputs' broadcast shape ", c10::IntArrayRef(out_shape),
                                "; resizing tensors written by an op on ShardTensors is not supported");
    out_shape = wsize;
  }
  // A plain tensor written from ShardTensors (neuraloperator's `out = torch.zeros(...); out[..., :m] = spectrum`)
  // receives the full value; under autograd its gradient reaches the ShardTensor inputs as a plain global-size
  // tensor, which the rules downstream read as Replicate: right values (the zoo checks every gradient), not divided.
  const auto out_ndim = static_cast<int64_t>(out_shape.size());
  const auto mesh_ndim = static_cast<size_t>(mesh->ndim());

  // Output layout.
  at::Tensor completed_local; // a Partial written tensor completed for a non-linear op
  SpecPtr completed_spec;
  SpecPtr written_layout; // the written ShardTensor's layout (after completing a pending sum), if it is one
  std::vector<size_t> owner_only; // mesh dims whose pending sum the first rank adds the complete operands to
  Placements target(mesh_ndim, Placement::replicate());
  DimExtents target_ext;
  if (written && shard_impl(written->value)) {
    auto* wimpl = shard_impl(written->value);
    auto wspec = wimpl->spec();
    bool keep_partial = true;
    for (size_t m = 0; m < mesh_ndim; ++m) {
      if (!wspec->placements[m].is_partial()) continue;
      std::vector<TensorArg> all = inputs;
      all.insert(all.begin(), *written);
      auto p = partial_output(rule, all, m, mesh);
      if (!p && (p = owner_adds_complete(rule, all, m, mesh, out_shape))) owner_only.push_back(m);
      keep_partial = keep_partial && p && *p == wspec->placements[m];
    }
    if (!keep_partial) owner_only.clear();
    if (!keep_partial) {
      // Complete the pending reduction and run the op on the complete value; the result is stored back into the
      // written tensor's own buffer as Partial terms (below), so views sharing that buffer see the update.
      auto full = resolve_partial(written->value);
      completed_local = shard_impl(full)->local();
      completed_spec = shard_impl(full)->spec();
      wspec = completed_spec;
    }
    target = wspec->placements;
    target_ext = wspec->dim_extents();
    written_layout = wspec;
  } else if (!written) {
    std::vector<bool> claimed(out_ndim, false);
    // A shard of an output dim wins over keeping a pending sum: keeping it would gather the sharded operand (a
    // full-size product on every rank, SwiftFormer's `attn * key`); completing the pending operand instead costs
    // an all-reduce of its own (usually broadcast, small) size and keeps the work divided.
    for (size_t m = 0; m < mesh_ndim; ++m) {
      for (const auto& a : inputs) {
        auto* impl = shard_impl(a.value);
        if (!impl) continue;
        const auto& p = impl->spec()->placements[m];
        if (!p.is_shard()) continue;
        const auto d_out = p.dim + (out_ndim - a.value.dim());
        if (a.value.size(p.dim) != out_shape[d_out] || claimed[d_out]) continue;
        target[m] = Placement::shard(d_out);
        target_ext[d_out] = impl->spec()->extents[m];
        claimed[d_out] = true;
        break;
      }
      if (target[m].is_shard()) continue;
      if (auto p = partial_output(rule, inputs, m, mesh)) {
        target[m] = *p;
      } else if (auto q = owner_adds_complete(rule, inputs, m, mesh, out_shape)) {
        target[m] = *q;
        owner_only.push_back(m);
      }
    }
    // A pending sum this op must complete (it is not linear in it) and no sharded operand places: reduce-scatter it
    // into a split of the output rather than all-reduce it into a whole value on which every rank would compute this
    // op and what follows in full (MLP-Mixer's and gMLP's token MLPs: fc1 contracts the split tokens into a pending
    // sum, GELU completes it, fc2 would run whole on every rank). Decided from the specs and global shapes only, so
    // every rank issues the same collective.
    for (size_t m = 0; m < mesh_ndim; ++m) {
      if (!target[m].is_replicate()) continue;
      if (auto d = split_for_pending_sum(inputs, out_shape, m, mesh, claimed)) {
        target[m] = Placement::shard(*d);
        claimed[*d] = true;
      }
    }
  }

  // Tensors written beside the layout-setting one (rrelu's noise, out1 of a two-output out= op) are written by the
  // same local kernel, so they need its shape and layout; anything else would have to be redistributed back into
  // their own buffers.
  for (const auto& w : writes) {
    if (w.index == written->index) continue;
    auto* impl = shard_impl(w.value);
    const bool alike = w.value.sizes() == written->value.sizes() &&
        (written_layout ? impl && impl->spec()->same_layout(*written_layout) : !impl || impl->spec()->all_replicate());
    TORCH_CHECK_NOT_IMPLEMENTED(alike, "ShardTensor: ", dispatch::qualified_name(op), " writes '",
                                schema.arguments()[w.index].name(), "' ", impl ? impl->spec()->str() : "(plain)",
                                " beside '", schema.arguments()[written->index].name(), "' ",
                                written_layout ? written_layout->str() : "(plain)",
                                "; tensors written together must have one shape and layout (redistribute first)");
  }

  // Bring every input to the output layout (aligned to its own dims; broadcast dims stay Replicate).
  // Every collective runs before the stack changes, so a failing one can still name the op's arguments.
  std::vector<at::Tensor> aligned;
  for (const auto& a : inputs)
    aligned.push_back(a.scalar_like ? at::Tensor() : local_aligned(a.value, mesh, out_shape, target, target_ext));
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!aligned[i].defined()) continue;
    // A complete operand of a pending sum kept by owner_adds_complete is added by the first rank along those mesh
    // dims only; elsewhere it is a zero of its own rank and dtype (so type promotion and broadcasting are unchanged).
    bool dropped = false;
    for (auto m : owner_only)
      dropped = dropped || (!placements_of(inputs[i].value, mesh)[m].is_partial() &&
                            mesh->coordinate(static_cast<int64_t>(m)) != 0);
    (*stack)[base + inputs[i].index] =
        dropped ? at::zeros(std::vector<int64_t>(aligned[i].dim(), 1), aligned[i].options()) : aligned[i];
  }
  for (const auto& a : inputs)
    if (a.scalar_like && shard_impl(a.value)) (*stack)[base + a.index] = shard_impl(a.value)->local();
  for (const auto& w : writes)
    (*stack)[base + w.index] = w.index == written->index && completed_local.defined() ? completed_local
                                                                                      : dispatch::local_or_self(w.value);

  op.callBoxed(stack);

  if (completed_local.defined()) {
    auto* wimpl = shard_impl(written->value);
    auto terms = redistribute_local(completed_local, *completed_spec, *wimpl->spec());
    if (!terms.is_same(wimpl->local())) wimpl->local().copy_(terms);
  }

  // Wrap results.
  const auto& returns = schema.returns();
  const auto nret = returns.size();
  for (size_t r = 0; r < nret; ++r) {
    auto& out = (*stack)[stack->size() - nret + r];
    if (!out.isTensor()) continue;
    if (returns[r].alias_info() && returns[r].alias_info()->isWrite()) {
      // The written argument this return aliases (the same alias set), returned as the caller's tensor.
      bool found = false;
      for (const auto& w : writes) {
        if (schema.arguments()[w.index].alias_info()->beforeSets() != returns[r].alias_info()->beforeSets()) continue;
        out = w.value;
        found = true;
      }
      TORCH_INTERNAL_ASSERT(found, dispatch::qualified_name(op), ": a written return aliases no written argument");
      continue;
    }
    const auto& local = out.toTensor();
    for (size_t m = 0; m < mesh_ndim; ++m)
      if (target[m].is_shard() && !target_ext.count(target[m].dim))
        target_ext[target[m].dim] = default_split(out_shape[target[m].dim], mesh->size(m));
    out = wrap(local, mesh, target, std::vector<int64_t>(out_shape.begin(), out_shape.end()), target_ext);
  }
}

// The functional op that `name` is the in-place or out= variant of, read from its schema (not from a list):
// - in-place: `foo_` (overload kept) whose `self` is written and returned, with foo's arguments (rrelu_with_noise_
//   also writes `noise`, as its functional does);
// - out=: `foo.out` or `foo.<overload>_out`, which adds written keyword-only arguments (`out`, `out0, out1`) to
//   foo's (or foo.<overload>'s) arguments and returns them.
std::optional<c10::OperatorName> functional_of(const c10::OperatorName& name, const c10::FunctionSchema& s) {
  auto& d = c10::Dispatcher::singleton();
  if (!returns_written(s)) return std::nullopt;
  if (ends_with(name.name, "_") && !ends_with(name.name, "__")) {
    const auto& args = s.arguments();
    if (args.empty() || args[0].name() != "self" || !is_written(args[0])) return std::nullopt;
    c10::OperatorName f{name.name.substr(0, name.name.size() - 1), name.overload_name};
    auto h = d.findOp(f);
    if (!h) return std::nullopt;
    const bool self_only = same_arguments(s, h->schema(), [](const c10::Argument&) { return false; });
    return self_only ? std::optional(f) : std::nullopt;
  }
  const auto& ov = name.overload_name;
  if (ov != "out" && !ends_with(ov, "_out")) return std::nullopt;
  c10::OperatorName f{name.name, ov == "out" ? "" : ov.substr(0, ov.size() - 4)};
  auto h = d.findOp(f);
  if (!h) return std::nullopt;
  const bool adds_outs =
      same_arguments(s, h->schema(), [](const c10::Argument& a) { return a.kwarg_only() && is_written(a); });
  return adds_outs ? std::optional(f) : std::nullopt;
}

} // namespace

SHARDTENSOR_RULE_FAMILY(pointwise) {
  // Elementwise ops that carry no `pointwise` tag. Their in-place and out= variants are derived below.
  static const char* extra[] = {
      "aten::leaky_relu",        "aten::leaky_relu_backward", "aten::hardtanh_backward",   "aten::elu_backward",
      "aten::softplus_backward", "aten::mish_backward",       "aten::hardswish",           "aten::hardswish_backward",
      "aten::hardsigmoid_backward", "aten::native_dropout",   "aten::rrelu_with_noise",    "aten::bernoulli_",
      "aten::bernoulli",         "aten::uniform_",            "aten::normal_",             "aten::exponential_",
      "aten::log_sigmoid_forward", "aten::log_sigmoid_backward", "aten::masked_fill_",     "aten::fill_",
      "aten::zero_",             "aten::hardshrink_backward", "aten::softshrink_backward", "aten::logit_backward",
      "aten::where",             "aten::copy_",               "aten::rrelu_with_noise_backward",
      // PReLU: aten::prelu (composite) reshapes the weight to [1, C, 1, ...] (or one value) and calls the kernel,
      // an elementwise op broadcasting the weight over the input. Its backward returns both gradients at the input's
      // shape (the weight's is summed to the weight's shape by autograd, a reduction rule: Partial over the sharded
      // dims the weight broadcasts along, completed once by the promote kernel's backward or the leaf's hook).
      "aten::_prelu_kernel",     "aten::_prelu_kernel_backward",
      // Elementwise without the tag: rsub (other - alpha * self), complex(real, imag), polar(abs, angle), fill (the
      // functional fill: every element the value).
      "aten::rsub",              "aten::complex",             "aten::polar",               "aten::fill",
      // floor_divide (Tensor and Scalar): elementwise, untagged. _conj_physical: conj_physical's kernel (the
      // Hermitian FFTs' ihfft2/ihfftn call it on their complex output).
      "aten::floor_divide",      "aten::_conj_physical",
      // masked_fill.Tensor (the value a 0-dim tensor: `x.masked_fill(mask, torch.tensor(v))`) has no tag, unlike
      // its .Scalar overload; the value broadcasts like any 0-dim operand.
      "aten::masked_fill",
  };
  auto& d = c10::Dispatcher::singleton();
  auto bindable = [&](const c10::OperatorName& name) -> std::optional<c10::OperatorHandle> {
    if (!starts_with(name.name, "aten::")) return std::nullopt;
    auto h = d.findOp(name);
    if (!h || dispatch::decomposes_before_shard_key(*h)) return std::nullopt;
    return h;
  };
  const auto names = d.getAllOpNames();
  // The functional (or listed) pointwise ops, then every in-place / out= variant of one of them.
  std::unordered_set<c10::OperatorName> pointwise;
  for (const auto& name : names) {
    auto h = bindable(name);
    if (!h) continue;
    bool match = h->hasTag(at::Tag::pointwise);
    for (const char* e : extra)
      if (name.name == e) match = true;
    // equal carries the tag but answers one bool for the whole tensors (its own rule agrees across ranks,
    // factory.cpp).
    if (name.name == "aten::equal") match = false;
    if (match) pointwise.insert(name);
  }
  std::vector<c10::OperatorName> variants;
  for (const auto& name : names) {
    auto h = bindable(name);
    if (!h || pointwise.count(name)) continue;
    if (auto f = functional_of(name, h->schema()); f && pointwise.count(*f)) variants.push_back(name);
  }
  pointwise.insert(variants.begin(), variants.end());
  for (const auto& name : pointwise) {
    const auto full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    const auto it = partial_rules().find(full);
    const auto rule = it == partial_rules().end() ? PartialRule::None : it->second;
    dispatch::set_handler(name, [rule](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
      pointwise_handler(rule, op, stack);
    });
  }
}

} // namespace shardtensor::ops
