// torch-harmonics' neighbourhood attention on the sphere (custom ops
// `attention_kernels::_neighborhood_s2_attention_torch` and `_neighborhood_s2_attention_optimized`: keys and values
// (B, heads * C, Hin, Win), queries (B, heads * C, Hout, Wout), the quadrature weights of the input latitudes, the
// neighbourhoods as CSR rows per output latitude whose columns name input positions row * Win + longitude), bound
// above autograd when torch-harmonics defines them: the attention layers of its spherical Segformer and transformer.
//
// With the field split along latitude, each rank attends from its own query rows to the band of key/value rows their
// neighbourhoods reach (ops/sphere_bands.h: one neighbour exchange of the rows it lacks), with torch-harmonics' own
// kernel on neighbourhoods cut to its rows and renumbered to its band, and the quadrature weights of its band. The
// output keeps the queries' layout; nothing is gathered. The op's own backward (registered with torch.library) runs
// on the local call's graph; the band's key and value gradients go home, summed (the exchange's adjoint). Batch
// splits are local. Upsampling attention (CSR rows per input latitude) and split channels decline to the fallback.
#include "comm/halo_plan.h"
#include "dispatch/args.h"
#include "dispatch/registry.h"
#include "dispatch/rule_family.h"
#include "ops/common.h"
#include "ops/sphere_bands.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

namespace shardtensor::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One rank's share of a neighbourhood attention split along latitude.
struct AttentionPlan {
  comm::HaloPlan halo;  // key/value bands
  at::Tensor col, roff, quad;
};

// The attention's split: the mesh dim that splits the queries' latitude (-1: none), the extents of queries and
// keys/values along it.
struct LatitudeSplit {
  int64_t mesh_dim = -1;
  std::vector<int64_t> q_extents, kv_extents;
};

std::shared_ptr<const AttentionPlan> attention_plan(const at::Tensor& col, const at::Tensor& roff,
                                                    const at::Tensor& quad, const LatitudeSplit& split,
                                                    int64_t nlat_in, int64_t nlon_in, int64_t nlat_out,
                                                    const Mesh& mesh, c10::Device device) {
  std::vector<int64_t> key{nlat_in, nlon_in, nlat_out, split.mesh_dim, mesh.coordinate(split.mesh_dim),
                           static_cast<int64_t>(device.type()), static_cast<int64_t>(device.index())};
  key.insert(key.end(), split.q_extents.begin(), split.q_extents.end());
  key.insert(key.end(), split.kv_extents.begin(), split.kv_extents.end());
  return cached_for_tensors<AttentionPlan>({col, roff, quad}, key, [&] {
    const auto roff_c = roff.to(at::kCPU, at::kLong).contiguous();
    const auto col_c = col.to(at::kCPU, at::kLong).contiguous();
    const auto* roff_p = roff_c.data_ptr<int64_t>();
    const auto* col_p = col_c.data_ptr<int64_t>();
    TORCH_CHECK_VALUE(roff_c.numel() == nlat_out + 1, "neighbourhood attention on the sphere: ", roff_c.numel(),
                      " row offsets for ", nlat_out, " output latitudes");
    // CSR row r is output latitude r.
    auto cut = cut_bands(roff_p, nlat_out, [](int64_t r) { return r; }, col_p, nlon_in, nlat_in, nlat_out,
                         split.q_extents, mesh.coordinate(split.mesh_dim));
    AttentionPlan plan;
    const auto& band = cut.want[mesh.coordinate(split.mesh_dim)];
    std::vector<int64_t> new_col;
    for (auto z : cut.entries) new_col.push_back(col_p[z] - cut.band_first * nlon_in);
    plan.col = index_tensor_like(new_col, col);
    plan.roff = index_tensor_like(cut.roff, roff);
    plan.quad = quad.narrow(0, cut.band_first, static_cast<int64_t>(band.size())).contiguous();
    plan.halo = comm::HaloPlan({comm::HaloDim{2, split.mesh_dim, split.kv_extents, std::move(cut.want)}},
                               mesh.coordinates(), device);
    return plan;
  });
}

struct NeighborhoodAttentionFn : torch::autograd::Function<NeighborhoodAttentionFn> {
  // `k`, `v`, `q` laid out for the split; `args`: the op's arguments after the three tensors.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q,
                            const c10::OperatorHandle& op, std::vector<c10::IValue> args, int64_t mesh_dim,
                            std::vector<int64_t> q_extents, std::vector<int64_t> kv_extents) {
    const auto& q_spec = *shard_impl(q)->spec();
    const auto& mesh = *q_spec.mesh;
    at::Tensor kl = shard_impl(k)->local().detach(), vl = shard_impl(v)->local().detach();
    at::Tensor ql = shard_impl(q)->local().detach();
    const auto nlat_in = k.size(2), nlon_in = args[4].toInt(), nlat_out = args[5].toInt();
    const auto orig_quad = args[0].toTensor(), orig_col = args[1].toTensor(), orig_roff = args[2].toTensor();
    std::shared_ptr<const AttentionPlan> plan;
    if (mesh_dim >= 0) {
      LatitudeSplit split{mesh_dim, q_extents, kv_extents};
      plan = attention_plan(args[1].toTensor(), args[2].toTensor(), args[0].toTensor(), split, nlat_in, nlon_in,
                            nlat_out, mesh, ql.device());
      kl = plan->halo.gather(kl, mesh);
      vl = plan->halo.gather(vl, mesh);
      args[0] = plan->quad;
      args[1] = plan->col;
      args[2] = plan->roff;
      args[5] = ql.size(2);
    }
    const bool grad = k.requires_grad() || v.requires_grad() || q.requires_grad();
    at::Tensor out;
    if (ql.size(2) == 0 || kl.size(2) == 0) {
      // A rank without query rows (or whose rows reach no key) has no output rows to compute; torch-harmonics'
      // kernel cannot fold heads into an empty latitude dim. Its arguments were checked on the global shapes.
      out = at::zeros({ql.size(0), vl.size(1), ql.size(2), ql.size(3)}, ql.options());
    } else {
      at::AutoGradMode local_graph(grad); // the local call's own graph is the backward's
      if (grad) kl.requires_grad_(), vl.requires_grad_(), ql.requires_grad_();
      torch::jit::Stack stack{kl, vl, ql};
      stack.insert(stack.end(), args.begin(), args.end());
      op.callBoxed(&stack);
      out = stack.back().toTensor();
    }
    ctx->saved_data["k"] = k;
    ctx->saved_data["v"] = v;
    ctx->saved_data["q"] = q;
    // The backward finds the plan again in the cache (the op's index tensors are held there).
    ctx->saved_data["mesh_dim"] = mesh_dim;
    ctx->saved_data["q_extents"] = q_extents;
    ctx->saved_data["kv_extents"] = kv_extents;
    ctx->saved_data["index"] = c10::List<at::Tensor>({orig_quad, orig_col, orig_roff});
    ctx->saved_data["sizes"] = std::vector<int64_t>{nlat_in, nlon_in, nlat_out};
    if (grad && out.requires_grad()) {
      ctx->saved_data["out"] = out;
      ctx->saved_data["locals"] = c10::List<at::Tensor>({kl, vl, ql});
    }
    auto shape = q_spec.global_shape;
    shape[1] = out.size(1);
    DimExtents ext = q_spec.dim_extents();
    ext.erase(1);
    return wrap(out.detach(), q_spec.mesh, q_spec.placements, shape, ext);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto k = ctx->saved_data["k"].toTensor(), v = ctx->saved_data["v"].toTensor(), q = ctx->saved_data["q"].toTensor();
    const auto& q_spec = *shard_impl(q)->spec();
    const auto mesh_dim = ctx->saved_data["mesh_dim"].toInt();
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    std::shared_ptr<const AttentionPlan> plan;
    if (mesh_dim >= 0) {
      auto index = ctx->saved_data["index"].toTensorList();
      LatitudeSplit split{mesh_dim, ctx->saved_data["q_extents"].toIntVector(),
                          ctx->saved_data["kv_extents"].toIntVector()};
      plan = attention_plan(index.get(1), index.get(2), index.get(0), split, sizes[0], sizes[1], sizes[2],
                            *q_spec.mesh, shard_impl(q)->local().device());
    }
    // The local inputs' gradients: through the local call's graph (none when its output needs none: a rank
    // without query rows).
    std::vector<at::Tensor> local_grads(3);
    // The incoming gradient in the output's layout: a collective when it differs, so every rank takes it.
    DimExtents ext = q_spec.dim_extents();
    ext.erase(1);
    auto g = local_in(grads[0], q_spec.mesh, q_spec.placements, ext);
    if (ctx->saved_data.count("out")) {
      auto out = ctx->saved_data["out"].toTensor();
      auto locals = ctx->saved_data["locals"].toTensorList();
      std::vector<at::Tensor> inputs{locals.get(0), locals.get(1), locals.get(2)};
      local_grads = torch::autograd::grad({out}, inputs, {g.contiguous()}, /*retain_graph=*/false,
                                          /*create_graph=*/false, /*allow_unused=*/true);
    }
    const std::vector<at::Tensor> like{k, v, q};
    for (size_t i = 0; i < 3; ++i) {
      if (local_grads[i].defined()) continue;
      // The shape the local input had in the call: the band for keys and values, the own rows for queries.
      auto shape = shard_impl(like[i])->local().sizes().vec();
      if (plan && i < 2) shape[2] = plan->halo.window_rows(0);
      local_grads[i] = at::zeros(shape, shard_impl(like[i])->local().options());
    }
    if (plan) {
      local_grads[0] = plan->halo.scatter_add(local_grads[0], *q_spec.mesh, /*consume=*/true);
      local_grads[1] = plan->halo.scatter_add(local_grads[1], *q_spec.mesh, /*consume=*/true);
    }
    auto as_like = [](const at::Tensor& grad_local, const at::Tensor& like) {
      const auto& spec = *shard_impl(like)->spec();
      return wrap(grad_local, spec.mesh, spec.placements, spec.global_shape, spec.dim_extents());
    };
    return {as_like(local_grads[0], k), as_like(local_grads[1], v), as_like(local_grads[2], q), {}, {}, {}, {}, {}};
  }
};

// _neighborhood_s2_attention_*(Tensor kw, Tensor vw, Tensor qw, Tensor quad_weights, Tensor col_idx,
//                              Tensor row_off, int nh, int nlon_in, int nlat_out, int nlon_out) -> Tensor
void neighborhood_attention_handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto base = stack->size() - 10;
  auto arg = [&](size_t i) -> c10::IValue& { return (*stack)[base + i]; };
  for (size_t i = 3; i <= 5; ++i)
    if (shard_impl(arg(i).toTensor()))
      dispatch::not_implemented(op, stack, "the quadrature weights and neighbourhoods are module buffers; pass them "
                                           "plain");
  auto q = arg(2).toTensor();
  if (!shard_impl(q)) dispatch::not_implemented(op, stack, "the queries are a plain tensor beside ShardTensors");
  const auto nlon_in = arg(7).toInt(), nlon_out = arg(9).toInt();
  if (nlon_out == 0 || nlon_in % nlon_out != 0)
    dispatch::not_implemented(op, stack, "upsampling attention (output longitudes a multiple of the input's): its "
                                         "neighbourhoods are listed per input latitude");
  const auto& q_spec = *shard_impl(q)->spec();
  const auto mesh = q_spec.mesh;
  LatitudeSplit split;
  for (size_t m = 0; m < q_spec.placements.size(); ++m) {
    const auto& p = q_spec.placements[m];
    if (!p.is_shard() || p.dim == 0) continue;
    if (p.dim != 2 || split.mesh_dim >= 0)
      dispatch::not_implemented(op, stack, "neighbourhood attention on the sphere splits batch and latitude only "
                                           "(channels hold the heads' dot products, longitude wraps around); "
                                           "redistribute that dim to Replicate()");
    split.mesh_dim = static_cast<int64_t>(m);
    split.q_extents = q_spec.extents[m];
  }
  std::vector<c10::IValue> rest(stack->begin() + static_cast<std::ptrdiff_t>(base + 3), stack->end());
  auto k_in = arg(0).toTensor(), v_in = arg(1).toTensor();
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  q = resolve_partial_diff(q);
  // Keys and values follow the queries' batch split and take the latitude split in proportion to theirs.
  const auto nlat_in = k_in.size(2), nlat_out = q.size(2);
  if (split.mesh_dim >= 0) split.kv_extents = proportional_extents(split.q_extents, nlat_out, nlat_in);
  auto layout_for = [&](const at::Tensor& t) {
    auto s = resolve_partial_diff(as_shard_input(t, mesh));
    const auto& spec = *shard_impl(q)->spec();
    DimExtents ext;
    for (size_t m = 0; m < spec.placements.size(); ++m)
      if (spec.placements[m].is_shard() && spec.placements[m].dim == 0) ext[0] = spec.extents[m];
    if (split.mesh_dim >= 0) ext[2] = split.kv_extents;
    return to_layout(s, spec.placements, ext);
  };
  auto k = layout_for(k_in), v = layout_for(v_in);
  stack->emplace_back(NeighborhoodAttentionFn::apply(k, v, q, op, std::move(rest), split.mesh_dim, split.q_extents,
                                                     split.kv_extents));
}

} // namespace

SHARDTENSOR_RULE_FAMILY(torch_harmonics_attention) {
  for (const char* name : {"attention_kernels::_neighborhood_s2_attention_torch",
                           "attention_kernels::_neighborhood_s2_attention_optimized"})
    dispatch::set_handler_when_defined(name, &neighborhood_attention_handler, dispatch::RuleLevel::above_autograd);
}

} // namespace shardtensor::ops
