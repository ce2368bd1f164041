// The differentiable public API: from_local, to_local, full_tensor, redistribute, distribute_tensor,
// scatter_tensor. Each backward runs the adjoint placement transition.
#include "comm/agreement.h"
#include "comm/collectives.h"
#include "comm/host_metadata.h"
#include "comm/redistribute.h"
#include "comm/spec_holder.h"
#include "dispatch/registry.h"

#include <ATen/ATen.h>
#include <shardtensor/simulation.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/autograd.h>

#include <sstream>

namespace shardtensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool needs_graph(const at::Tensor& t) {
  return at::GradMode::is_enabled() && t.requires_grad();
}

at::Tensor local_of(const at::Tensor& shard) {
  return shard_impl(shard)->local();
}

// Under create_graph a gradient has a graph of its own; the backwards below then make the same placement
// transitions through these Functions again (defined after them), so a higher derivative sees them. The raw
// transitions would cut the graph and drop that order's terms silently.
at::Tensor recorded_from_local(const at::Tensor& local, SpecPtr spec);
at::Tensor recorded_to_local(const at::Tensor& shard);

struct FromLocalFn : torch::autograd::Function<FromLocalFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, SpecPtr spec) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["spec"] = spec_ivalue(spec);
    return make_shard_tensor(local.detach(), std::move(spec));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    auto spec = spec_from_ivalue(ctx->saved_data["spec"]);
    if (needs_graph(grads[0])) return {recorded_to_local(recorded_grad_to_spec(grads[0], spec)), at::Tensor()};
    return {local_of(grad_to_spec(grads[0], spec)), at::Tensor()};
  }
};

struct ToLocalFn : torch::autograd::Function<ToLocalFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& shard) {
    ctx->set_materialize_grads(false);
    auto& impl = *shard_impl(shard);
    ctx->saved_data["spec"] = spec_ivalue(impl.spec());
    return impl.local().detach();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    auto spec = without_partial(spec_from_ivalue(ctx->saved_data["spec"]));
    TORCH_CHECK(!is_shard_tensor(grads[0]), "to_local: the gradient of a local tensor must be a plain tensor");
    if (needs_graph(grads[0])) return {recorded_from_local(grads[0], spec)};
    return {make_shard_tensor(grads[0], spec)};
  }
};

struct RedistributeFn : torch::autograd::Function<RedistributeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& shard, SpecPtr dst) {
    ctx->set_materialize_grads(false);
    auto& impl = *shard_impl(shard);
    ctx->saved_data["spec"] = spec_ivalue(impl.spec());
    auto out = redistribute_to(shard, dst);
    // Outputs of a custom Function must not be its inputs.
    return out.is_same(shard) ? make_shard_tensor(impl.local(), impl.spec()) : out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    auto spec = spec_from_ivalue(ctx->saved_data["spec"]);
    if (needs_graph(grads[0])) return {recorded_grad_to_spec(grads[0], spec), at::Tensor()};
    return {grad_to_spec(grads[0], spec), at::Tensor()};
  }
};

at::Tensor recorded_from_local(const at::Tensor& local, SpecPtr spec) {
  return FromLocalFn::apply(local, std::move(spec));
}

at::Tensor recorded_to_local(const at::Tensor& shard) {
  return ToLocalFn::apply(shard);
}

} // namespace

// grad_to_spec through the Functions above.
at::Tensor recorded_grad_to_spec(const at::Tensor& grad, const SpecPtr& spec) {
  auto g = is_shard_tensor(grad)
               ? grad
               : recorded_from_local(grad, ShardSpec::make(spec->mesh, Placements(spec->mesh->ndim(),
                                                                                  Placement::replicate()),
                                                           spec->global_shape));
  return RedistributeFn::apply(g, without_partial(spec));
}

namespace {

std::string shown(c10::IntArrayRef v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

std::vector<int64_t> flat_shapes(const ShardingShapes& shapes) {
  std::vector<int64_t> flat;
  for (const auto& [m, ext] : shapes) {
    flat.push_back(m);
    flat.push_back(static_cast<int64_t>(ext.size()));
    flat.insert(flat.end(), ext.begin(), ext.end());
  }
  return flat;
}

std::string shown(const ShardingShapes& shapes) {
  std::ostringstream os;
  os << "{";
  for (const auto& [m, ext] : shapes) os << (m == shapes.begin()->first ? "" : ", ") << m << ": " << c10::IntArrayRef(ext);
  os << "}";
  return os.str();
}

const char* mode_name(ShapeInference mode) {
  return mode == ShapeInference::Infer ? "infer" : mode == ShapeInference::Even ? "even" : "explicit";
}

// What every rank must agree on before from_local communicates or wraps: the arguments as given.
std::vector<comm::AgreementField> from_local_inputs(const at::Tensor& local, const Mesh& mesh, const Placements& placements,
                                                    ShapeInference mode, const ShardingShapes& shapes,
                                                    const std::optional<std::vector<int64_t>>& global_shape) {
  const auto ndim = local.dim();
  std::vector<comm::AgreementField> f;
  f.push_back({"mesh shape", comm::digest(mesh.shape()), shown(mesh.shape())});
  f.push_back({"ndim", ndim, std::to_string(ndim)});
  f.push_back({"dtype", static_cast<int64_t>(local.scalar_type()), c10::toString(local.scalar_type())});
  f.push_back({"device type", static_cast<int64_t>(local.device().type()), c10::DeviceTypeName(local.device().type())});
  f.push_back({"placements", comm::digest(to_string(placements)), to_string(placements)});
  f.push_back({"sharding_shapes mode", static_cast<int64_t>(mode), mode_name(mode)});
  // Every field is present in every mode (a placeholder where it does not apply): the agreement message must have
  // one size whatever the arguments, or ranks passing different modes would mismatch inside the all-reduce itself.
  if (mode == ShapeInference::Explicit) {
    f.push_back({"sharding_shapes", comm::digest(flat_shapes(shapes)), shown(shapes)});
  } else {
    f.push_back({"sharding_shapes", -1, mode_name(mode)});
  }
  if (global_shape) {
    f.push_back({"global_shape", comm::digest(*global_shape), shown(*global_shape)});
  } else {
    f.push_back({"global_shape", -1, "None"});
  }
  if (mode == ShapeInference::Infer) {
    // Dims no placement shards must have the same size everywhere.
    std::vector<int64_t> whole = local.sizes().vec();
    for (const auto& p : placements) {
      if (!p.is_shard()) continue;
      const auto d = p.dim < 0 ? p.dim + ndim : p.dim;
      if (d >= 0 && d < ndim) whole[d] = -1;
    }
    f.push_back({"local sizes of unsharded dims", comm::digest(whole), shown(whole) + " (-1: sharded)"});
  } else {
    f.push_back({"local sizes of unsharded dims", -1, "not compared (sharding_shapes is not 'infer')"});
  }
  return f;
}

// The layout `local` declares. Infer mode gathers the extents (one small all-gather per sharded mesh dim, issued on
// every rank even when a check fails, so a rank-dependent failure cannot leave peers waiting).
SpecPtr local_spec(const at::Tensor& local, const MeshPtr& mesh, Placements placements, ShapeInference mode,
                   const ShardingShapes& sharding_shapes, const std::optional<std::vector<int64_t>>& global_shape) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(placements.size()) == mesh->ndim(), "from_local: got ",
                    placements.size(), " placements ", to_string(placements), " for a ", mesh->ndim(),
                    "-d mesh");
  const auto ndim = local.dim();
  for (auto& p : placements) {
    if (!p.is_shard()) continue;
    if (p.dim < 0) p.dim += ndim;
    TORCH_CHECK_VALUE(p.dim >= 0 && p.dim < ndim, "from_local: ", to_string(placements),
                      " shards a dim out of range for a ", ndim, "-d local tensor");
  }
  std::vector<int64_t> global = local.sizes().vec();
  ShardingShapes shapes;
  switch (mode) {
    case ShapeInference::Infer: {
      // One small all-gather of the full local shape per sharded mesh dim; every rank sees every shape of its
      // line, so a mismatch raises on all ranks of the line alike.
      std::string error;
      for (int64_t m = 0; m < mesh->ndim(); ++m) {
        if (!placements[m].is_shard()) continue;
        const auto d = placements[m].dim;
        auto all = comm::all_gather_ints(local.sizes().vec(), *mesh, m, "from_local(sharding_shapes='infer')");
        std::vector<int64_t> ext;
        for (size_t r = 0; r < all.size(); ++r) {
          for (int64_t i = 0; i < ndim && error.empty(); ++i) {
            if (i != d && all[r][i] != all[0][i])
              error = c10::str("from_local: local shapes differ in unsharded dim ", i, " along mesh dim ", m, " (",
                               all[0][i], " vs ", all[r][i], ") for placements ", to_string(placements));
          }
          ext.push_back(all[r][d]);
        }
        int64_t total = 0;
        for (auto e : ext) total += e;
        global[d] = total;
        shapes[m] = std::move(ext);
      }
      TORCH_CHECK_VALUE(error.empty(), error);
      if (global_shape) {
        TORCH_CHECK_VALUE(*global_shape == global, "from_local: global_shape ", shown(*global_shape),
                          " does not match the global shape ", shown(global),
                          " the local shapes add up to (sharding_shapes='infer'); pass the right global_shape or "
                          "none");
      }
      break;
    }
    case ShapeInference::Even: {
      TORCH_CHECK_VALUE(global_shape.has_value(), "from_local: sharding_shapes='even' needs global_shape");
      global = *global_shape;
      TORCH_CHECK_VALUE(static_cast<int64_t>(global.size()) == ndim, "from_local: global_shape has ",
                        global.size(), " dims but the local tensor has ", ndim);
      break;
    }
    case ShapeInference::Explicit: {
      shapes = sharding_shapes;
      for (int64_t m = 0; m < mesh->ndim(); ++m) {
        if (!placements[m].is_shard()) continue;
        auto it = shapes.find(m);
        TORCH_CHECK_VALUE(it != shapes.end(), "from_local: explicit sharding_shapes lack mesh dim ", m, " (",
                          placements[m].str(), ")");
        int64_t total = 0;
        for (auto e : it->second) total += e;
        global[placements[m].dim] = total;
      }
      if (global_shape) {
        TORCH_CHECK_VALUE(*global_shape == global, "from_local: global_shape ", shown(*global_shape),
                          " does not match the sharding shapes (global shape ", shown(global), ")");
      }
      break;
    }
  }
  auto spec = ShardSpec::make(mesh, placements, global, shapes);
  TORCH_CHECK_VALUE(local.sizes() == c10::IntArrayRef(spec->local_shape), "from_local: local shape ",
                    local.sizes(), " does not match the expected local shape ", shown(spec->local_shape), " for ",
                    spec->str());
  return spec;
}

} // namespace

at::Tensor from_local(const at::Tensor& local, MeshPtr mesh, Placements placements, ShapeInference mode,
                      const ShardingShapes& sharding_shapes, std::optional<std::vector<int64_t>> global_shape,
                      bool check) {
  dispatch::bind_new_ops(); // ops of libraries imported since (see dispatch/registry.h)
  TORCH_CHECK_TYPE(local.defined() && !is_shard_tensor(local),
                   "from_local: expected a plain local tensor, got ", local.defined() ? "a ShardTensor" : "None");
  TORCH_CHECK_VALUE(mesh, "from_local: mesh is null");
  TORCH_CHECK_NOT_IMPLEMENTED(mode != ShapeInference::Infer || !simulating(),
                              "from_local(sharding_shapes='infer') under simulation (shardtensor.simulate): other "
                              "ranks' extents cannot be gathered (the fake process group returns this rank's own "
                              "shape for every rank); pass sharding_shapes='even' with global_shape, or the extents "
                              "{mesh_dim: [extent of coordinate 0, ...]}");
  SpecPtr spec;
  if (!check) {
    spec = local_spec(local, mesh, placements, mode, sharding_shapes, global_shape);
  } else {
    // Ranks that disagree raise together: the arguments are compared before anything else communicates (infer's
    // all-gather needs equal ndim and placements), with the resulting layouts and whether each local fits its
    // layout. Even and explicit modes know their layout without communicating and need one round; infer compares
    // placeholders for the layout in that round (so the first message has the same fields in every mode) and, on
    // a multi-dim mesh, compares the inferred layouts in a second round (a 1-D mesh's ranks all saw every shape).
    auto fields = from_local_inputs(local, *mesh, placements, mode, sharding_shapes, global_shape);
    std::string error;
    auto compute = [&] {
      try {
        spec = local_spec(local, mesh, placements, mode, sharding_shapes, global_shape);
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      }
    };
    auto add_layout = [&] {
      fields.push_back({"whether the local tensor fits the layout", error.empty(),
                        error.empty() ? "fits" : "does not fit: " + error});
      std::vector<int64_t> layout;
      if (spec) {
        layout = spec->global_shape;
        auto flat = flat_shapes(spec->sharding_shapes());
        layout.insert(layout.end(), flat.begin(), flat.end());
      }
      fields.push_back({"layout (global shape and sharding shapes)", spec ? comm::digest(layout) : -1,
                        spec ? spec->str() : "none"});
    };
    if (mode == ShapeInference::Infer) {
      fields.push_back({"whether the local tensor fits the layout", 1, "not known yet (inferred after)"});
      fields.push_back({"layout (global shape and sharding shapes)", -2, "not known yet (inferred after)"});
      comm::check_agreement(*mesh, fields, "from_local");
      fields.clear();
      compute();
      if (mesh->ndim() > 1) {
        add_layout();
        comm::check_agreement(*mesh, fields, "from_local");
      }
    } else {
      compute();
      add_layout();
      comm::check_agreement(*mesh, fields, "from_local");
    }
    TORCH_CHECK_VALUE(error.empty(), error);
  }
  if (needs_graph(local)) return FromLocalFn::apply(local, spec);
  return make_shard_tensor(local.detach(), spec);
}

at::Tensor to_local(const at::Tensor& shard) {
  auto& impl = checked_shard_impl(shard, "to_local");
  if (needs_graph(shard)) return ToLocalFn::apply(shard);
  return impl.local();
}

at::Tensor redistribute(const at::Tensor& shard, Placements placements, const ShardingShapes& sharding_shapes) {
  auto& impl = checked_shard_impl(shard, "redistribute");
  for (const auto& p : placements) {
    TORCH_CHECK_VALUE(!p.is_partial() || impl.spec()->placements.size() != placements.size() ||
                          std::find(impl.spec()->placements.begin(), impl.spec()->placements.end(), p) !=
                              impl.spec()->placements.end(),
                      "redistribute: a Partial target ", to_string(placements),
                      " is for internal use; redistribute to Replicate() or Shard(d)");
  }
  auto dst = redistribute_target_spec(*impl.spec(), placements, sharding_shapes);
  if (needs_graph(shard)) return RedistributeFn::apply(shard, dst);
  return redistribute_to(shard, dst);
}

at::Tensor full_tensor(const at::Tensor& shard) {
  auto& impl = checked_shard_impl(shard, "full_tensor");
  Placements rep(impl.spec()->mesh->ndim(), Placement::replicate());
  return to_local(redistribute(shard, rep));
}

at::Tensor distribute_tensor(const at::Tensor& full, MeshPtr mesh, Placements placements,
                             const ShardingShapes& sharding_shapes) {
  dispatch::bind_new_ops(); // ops of libraries imported since (see dispatch/registry.h)
  TORCH_CHECK_VALUE(mesh, "distribute_tensor: mesh is null");
  TORCH_CHECK_TYPE(full.defined() && !is_shard_tensor(full), "distribute_tensor: expected a plain tensor, got ",
                   full.defined() ? "a ShardTensor" : "None");
  // Each rank slices its shard from its own copy, so ranks passing different placements or extents would build
  // silently inconsistent shards (Shard(0) on one rank, Shard(1) on another). One round compares what they pass.
  comm::check_agreement(
      *mesh,
      {{"mesh shape", comm::digest(mesh->shape()), shown(mesh->shape())},
       {"global shape", comm::digest(full.sizes().vec()), shown(full.sizes().vec())},
       {"dtype", static_cast<int64_t>(full.scalar_type()), c10::toString(full.scalar_type())},
       {"device type", static_cast<int64_t>(full.device().type()), c10::DeviceTypeName(full.device().type())},
       {"placements", comm::digest(to_string(placements)), to_string(placements)},
       {"sharding_shapes", comm::digest(flat_shapes(sharding_shapes)), shown(sharding_shapes)}},
      "distribute_tensor");
  Placements rep(mesh->ndim(), Placement::replicate());
  auto replicated = from_local(full, mesh, rep, ShapeInference::Even, {}, full.sizes().vec(), /*check=*/false);
  return redistribute(replicated, std::move(placements), sharding_shapes);
}

namespace {
// The current CUDA device for a CUDA mesh (each rank has set its own), else the CPU.
at::Device scatter_device(const Mesh& mesh) {
  if (mesh.device_type() != c10::DeviceType::CUDA) return at::Device(at::kCPU);
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
}
} // namespace

at::Tensor scatter_tensor(const at::Tensor& full, int64_t src, MeshPtr mesh, Placements placements,
                          const ShardingShapes& sharding_shapes) {
  dispatch::bind_new_ops(); // ops of libraries imported since (see dispatch/registry.h)
  TORCH_CHECK_VALUE(mesh, "scatter_tensor: mesh is null");
  // The metadata broadcast below follows src's coordinates: every rank must pass the same src, placements and
  // sharding shapes, compared first so a disagreement raises everywhere instead of hanging.
  comm::check_agreement(*mesh,
                        {{"mesh shape", comm::digest(mesh->shape()), shown(mesh->shape())},
                         {"src", src, std::to_string(src)},
                         {"placements", comm::digest(to_string(placements)), to_string(placements)},
                         {"sharding_shapes", comm::digest(flat_shapes(sharding_shapes)), shown(sharding_shapes)}},
                        "scatter_tensor");
  auto src_coord = mesh->coordinate_of(src);
  TORCH_CHECK_VALUE(!src_coord.empty(), "scatter_tensor: src rank ", src, " is not in the mesh ", mesh->str());
  const auto& me = mesh->coordinates();
  const bool is_src = me == src_coord;
  for (const auto& p : placements)
    TORCH_CHECK_VALUE(!p.is_partial(), "scatter_tensor: Partial placements cannot be scattered; use Replicate()");
  // Metadata (status, ndim, dtype, shape) travels from src along each mesh dim in turn. A problem with src's tensor
  // travels as the status, so every rank raises it (instead of src raising alone and the others waiting).
  constexpr int64_t kMaxDims = 16;
  enum Status : int64_t { kOk = 0, kNoTensor = 1, kShardTensor = 2, kTooManyDims = 3 };
  std::vector<int64_t> meta(kMaxDims + 3, 0);
  if (is_src) {
    meta[0] = !full.defined() ? kNoTensor : is_shard_tensor(full) ? kShardTensor : full.dim() > kMaxDims ? kTooManyDims : kOk;
    if (meta[0] == kOk || meta[0] == kTooManyDims) {
      meta[1] = full.dim();
      meta[2] = static_cast<int64_t>(full.scalar_type());
      for (int64_t i = 0; i < std::min(full.dim(), kMaxDims); ++i) meta[3 + i] = full.size(i);
    }
  }
  // The mesh decides where every rank's shard lives (as DTensor's distribute_tensor does): ranks without the
  // tensor know nothing else, so a src tensor on another device (a CPU image for a CUDA mesh) moves there.
  const auto device = scatter_device(*mesh);
  // Metadata walks the mesh dims from last to first: at step m the ranks whose coords on dims < m equal
  // src's receive it along dim m from the one that holds it.
  std::vector<int64_t> mv;
  {
    comm::HostMetadataGuard host; // see comm/host_metadata.h
    auto meta_t = at::tensor(meta, at::kLong);
    for (int64_t m = mesh->ndim() - 1; m >= 0; --m) {
      bool take_part = true;
      for (int64_t k = 0; k < m; ++k)
        if (me[k] != src_coord[k]) take_part = false;
      if (take_part)
        meta_t = comm::broadcast(device.is_cuda() ? meta_t.to(device) : meta_t, src_coord[m], *mesh, m).cpu();
    }
    mv.assign(meta_t.data_ptr<int64_t>(), meta_t.data_ptr<int64_t>() + meta_t.numel());
  }
  if (simulating() && !is_src) {
    // The broadcast above moved nothing (a simulation's process group moves no data): this rank takes the global
    // shape and dtype from the tensor it passed instead (the tensor itself or a stand-in, e.g. on the meta device).
    TORCH_CHECK_NOT_IMPLEMENTED(full.defined() && !is_shard_tensor(full) && full.dim() <= kMaxDims,
                                "scatter_tensor under simulation (shardtensor.simulate): this rank is not the src rank ",
                                src, " and passed no tensor, so it cannot learn the global shape and dtype (the fake "
                                "process group moves no data); pass the global tensor, or a stand-in of its shape "
                                "and dtype such as torch.empty(shape, dtype=dtype, device='meta'), on every rank");
    mv[0] = kOk;
    mv[1] = full.dim();
    mv[2] = static_cast<int64_t>(full.scalar_type());
    for (int64_t i = 0; i < full.dim(); ++i) mv[3 + i] = full.size(i);
  }
  TORCH_CHECK_VALUE(mv[0] != kNoTensor, "scatter_tensor: the src rank ", src,
                    " passed no tensor (None or not a tensor); it must pass the full tensor");
  TORCH_CHECK_VALUE(mv[0] != kShardTensor, "scatter_tensor: the src rank ", src,
                    " passed a ShardTensor; pass a plain tensor (x.full_tensor()) or use x.redistribute(...)");
  TORCH_CHECK_VALUE(mv[0] != kTooManyDims, "scatter_tensor: the src rank ", src, " passed a ", mv[1],
                    "-d tensor; at most ", kMaxDims, " dims");
  std::vector<int64_t> shape(mv.begin() + 3, mv.begin() + 3 + mv[1]);
  auto dtype = static_cast<at::ScalarType>(mv[2]);
  auto spec = ShardSpec::make(mesh, placements, shape, sharding_shapes);
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  // Data: for mesh dims from first to last, ranks whose coords on later dims equal src's hold a slab
  // (the part of the tensor that their coords on earlier dims select) and pass it along dim m.
  at::Tensor data = is_src ? full.to(device).contiguous() : at::Tensor();
  std::vector<int64_t> cur_shape = shape;
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    bool take_part = true;
    for (int64_t k = m + 1; k < mesh->ndim(); ++k)
      if (me[k] != src_coord[k]) take_part = false;
    const auto& p = spec->placements[m];
    if (take_part) {
      const bool holder = me[m] == src_coord[m];
      if (p.is_shard()) {
        data = comm::scatter_v(holder ? data : at::empty({0}, opts), src_coord[m], p.dim, spec->extents[m],
                               cur_shape, opts, *mesh, m);
      } else {
        data = comm::broadcast(holder ? data : at::empty(cur_shape, opts), src_coord[m], *mesh, m);
      }
    }
    if (p.is_shard()) cur_shape[p.dim] = spec->extents[m][me[m]];
  }
  return make_shard_tensor(data, spec);
}

} // namespace shardtensor
