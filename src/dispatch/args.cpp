#include "dispatch/args.h"

#include "comm/functional.h"

#include <shardtensor/simulation.h>

#include <sstream>

namespace shardtensor::dispatch {

const ShardTensorImpl* first_shard_arg(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  const ShardTensorImpl* found = nullptr;
  for (const auto& v : op_args(op, stack)) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!found) found = shard_impl(t);
    });
    if (found) break;
  }
  return found;
}

namespace {

// Folds `t` into the mesh found so far (none yet: null); a ShardTensor on another mesh raises, on every rank alike.
// `op_name()` names the op; it is called only to raise (a boxed rule's name is built from its handle).
template <typename OpName>
void join_mesh(MeshPtr& mesh, const at::Tensor& t, const OpName& op_name) {
  auto* impl = shard_impl(t);
  if (!impl) return;
  if (!mesh) {
    mesh = impl->spec()->mesh;
    return;
  }
  TORCH_CHECK_VALUE(mesh->same_as(*impl->spec()->mesh), "ShardTensor: ", op_name(),
                    " got ShardTensors on different meshes (", mesh->str(), " and ", impl->spec()->mesh->str(),
                    "); redistribute them onto one mesh first");
}

} // namespace

MeshPtr common_mesh(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  MeshPtr mesh;
  auto name = [&] { return qualified_name(op); };
  for (const auto& v : op_args(op, stack)) for_each_tensor(v, [&](const at::Tensor& t) { join_mesh(mesh, t, name); });
  TORCH_INTERNAL_ASSERT(mesh, "common_mesh: no ShardTensor argument for ", name());
  return mesh;
}

MeshPtr common_mesh(std::string_view op_name, at::ArrayRef<at::Tensor> tensors) {
  MeshPtr mesh;
  for (const auto& t : tensors) join_mesh(mesh, t, [&] { return op_name; });
  TORCH_INTERNAL_ASSERT(mesh, "common_mesh: no ShardTensor argument for ", op_name);
  return mesh;
}

std::string describe_shard_args(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  std::ostringstream os;
  os << "(";
  const auto& schema = op.schema();
  auto args = op_args(op, stack);
  bool first = true;
  for (size_t i = 0; i < args.size(); ++i) {
    bool any = false;
    std::ostringstream one;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (!t.defined()) return;
      if (any) one << ", ";
      any = true;
      if (auto* impl = shard_impl(t)) {
        one << to_string(impl->spec()->placements) << " global " << t.sizes();
        // The extents too: a rule may decline for uneven or empty shards, not for the placements.
        for (const auto& [m, ext] : impl->spec()->sharding_shapes()) one << " extents[mesh dim " << m << "]=" << c10::IntArrayRef(ext);
      } else if (t.key_set().has(c10::DispatchKey::Python)) {
        one << "tensor subclass (DTensor?) " << t.sizes();
      } else {
        one << "plain " << t.sizes();
      }
    });
    if (!any) continue;
    os << (first ? "" : ", ") << schema.arguments()[i].name() << ": " << one.str();
    first = false;
  }
  os << ")";
  return os.str();
}

void refuse_python_subclass_args(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  // Fake and functional tensors beside ShardTensors are expected while a tracer runs or in a meta simulation (its
  // parameters are fake tensors): only then are Python-dispatch tensors not DTensors-to-refuse.
  if (simulating() || comm::tracing(at::Tensor())) return;
  const auto& schema = op.schema();
  auto args = op_args(op, stack);
  for (size_t i = 0; i < args.size(); ++i) {
    bool foreign = false;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      foreign = foreign || (t.defined() && !shard_impl(t) && t.key_set().has(c10::DispatchKey::Python));
    });
    // NotImplementedError, not TypeError: torch turns a TypeError inside a binary operator (x + dt) into
    // NotImplemented, and Python then reports only "unsupported operand type(s)".
    TORCH_CHECK_NOT_IMPLEMENTED(!foreign, "ShardTensor: ", qualified_name(op), " got a DTensor (or another tensor subclass with ",
                     "its own __torch_dispatch__) as argument '", schema.arguments()[i].name(),
                     "' next to ShardTensors ", describe_shard_args(op, stack),
                     ". ShardTensors and DTensors do not mix in one op: convert the DTensor with "
                     "shardtensor.from_dtensor(dt), or the ShardTensor with shardtensor.to_dtensor(x), first (a module "
                     "with DTensor parameters fed ShardTensors: keep its parameters plain and use "
                     "shardtensor.sync_module, or convert them).");
  }
}

SpecPtr replicate_spec(const MeshPtr& mesh, at::IntArrayRef shape) {
  return ShardSpec::make(mesh, Placements(mesh->ndim(), Placement::replicate()), shape.vec());
}

at::Tensor as_shard(const at::Tensor& t, const MeshPtr& mesh) {
  if (shard_impl(t)) return t;
  // Below autograd (e.g. a module's weight under no_grad/inference_mode) the wrapper owns no history; the plain
  // tensor may still require grad.
  return make_shard_tensor(t.requires_grad() ? t.detach() : t, replicate_spec(mesh, t.sizes()));
}

c10::IValue& NamedArgs::slot(std::string_view name) const {
  auto i = index_of(name);
  TORCH_INTERNAL_ASSERT(i, "ShardTensor rule for ", qualified_name(op_), " reads argument '", name,
                        "', which its schema lacks");
  const auto n = op_.schema().arguments().size();
  return (*stack_)[stack_->size() - n + *i];
}

std::optional<at::ScalarType> NamedArgs::dtype() const {
  auto i = index_of("dtype");
  if (!i || args()[*i].isNone()) return std::nullopt;
  return args()[*i].toScalarType();
}

std::string qualified_name(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

} // namespace shardtensor::dispatch
