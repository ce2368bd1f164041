// Ops along one dim: softmax / log_softmax and their backward ops. Over an unsharded dim they are local; over a
// sharded dim they use the global max and sum of exponentials (one collective of (max, sum) pairs), and the
// backward a global sum of grad*output. glu and its backward: local along an unsharded dim (each rank's rows hold both
// halves); along a sharded dim each rank gathers the two row ranges its output rows read (glu_layout).
#include "comm/halo.h"
#include "comm/stat_reduce.h"
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// Sum `t` over the mesh dim of `spec` that shards `dim`.
at::Tensor sum_over(at::Tensor t, const ShardSpec& spec, int64_t dim) {
  auto m = spec.mesh_dim_of(dim);
  return m < 0 ? t : sum_over_mesh_dims(std::move(t), {m}, *spec.mesh);
}

enum class Softmax { plain, log, safe };

// softmax (or log_softmax, or _safe_softmax: rows whose every element is -inf give 0, not nan) of `self_arg` along
// `dim_arg`; `dtype`: _safe_softmax's conversion of the input first.
at::Tensor softmax_along(const at::Tensor& self_arg, int64_t dim_arg, bool half_to_float, Softmax kind,
                         std::optional<at::ScalarType> dtype = std::nullopt) {
  const bool log = kind == Softmax::log;
  auto self = resolve_partial(self_arg);
  const auto dim = wrap_dim(dim_arg, std::max<int64_t>(self.dim(), 1));
  auto spec = shard_impl(self)->spec();
  const auto& local = shard_impl(self)->local();
  at::Tensor out;
  if (spec->mesh_dim_of(dim) < 0) {
    out = kind == Softmax::safe ? at::_safe_softmax(local, dim, dtype)
          : log                 ? at::_log_softmax(local, dim, half_to_float)
                                : at::_softmax(local, dim, half_to_float);
  } else {
    const auto x = dtype ? local.to(*dtype) : local;
    // The local kernel refuses integral inputs; the sharded formula below (exp promotes) would not, so refuse as it.
    TORCH_CHECK_NOT_IMPLEMENTED(at::isFloatingType(x.scalar_type()), "\"", log ? "log_softmax" : "softmax",
                                "_lastdim_kernel_impl\" not implemented for '", c10::toString(x.scalar_type()), "'");
    // Half and bfloat16 are computed in float and rounded once at the end, as torch's kernels do.
    const auto out_type = half_to_float ? at::kFloat : x.scalar_type();
    const bool reduced = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
    auto xf = half_to_float || reduced ? x.to(at::kFloat) : x;
    // Each rank's (max, sum of exp relative to it) over its rows, combined in one collective (comm/stat_reduce.h);
    // a rank without rows, or whose rows are all -inf, adds nothing.
    comm::StatReduce r;
    const auto lse = r.log_sum_exp_over(xf, {dim});
    r.run(*spec->mesh, {spec->mesh_dim_of(dim)});
    auto shifted = xf - r.result(lse)[0];
    const auto& gsum = r.result(lse)[1];
    // Into a contiguous buffer, as torch's softmax kernels lay out their output whatever the input's strides: a
    // strided output would differ between ranks holding rows and a rank holding none, and reach local kernels that
    // insist on contiguity (nll_loss2d's backward) on some ranks only.
    auto buf = at::empty(xf.sizes(), xf.options().dtype(out_type));
    out = log ? at::sub_out(buf, shifted, gsum.log()) : at::div_out(buf, shifted.exp_(), gsum);
    if (kind == Softmax::safe)  // the global max is -inf exactly where every element of the row is
      out = at::where(r.result(lse)[0] == -std::numeric_limits<double>::infinity(), at::zeros({}, out.options()), out);
  }
  return make_shard_tensor(out, ShardSpec::make(spec->mesh, spec->placements, spec->global_shape,
                                                spec->sharding_shapes()));
}

// _softmax(Tensor self, int dim, bool half_to_float)
at::Tensor softmax_rule(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return softmax_along(self, dim, half_to_float, Softmax::plain);
}

// _safe_softmax(Tensor self, int dim, ScalarType? dtype=None): scaled_dot_product_attention's math form (a fully
// masked row gives zeros); its backward is _softmax_backward_data's.
at::Tensor safe_softmax_rule(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  return softmax_along(self, dim, /*half_to_float=*/false, Softmax::safe, dtype);
}

// _log_softmax(Tensor self, int dim, bool half_to_float)
at::Tensor log_softmax_rule(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return softmax_along(self, dim, half_to_float, Softmax::log);
}

// The input gradient of softmax (or, with `log`, log_softmax) from its output; `op_name` names the op in errors.
at::Tensor softmax_backward_along(const char* op_name, const at::Tensor& grad_output, const at::Tensor& output_arg,
                                  int64_t dim_arg, at::ScalarType input_dtype, bool log) {
  auto mesh = dispatch::common_mesh(op_name, {grad_output, output_arg});
  // A plain output (a softmax of plain values: ConViT's positional attention) whose gradient comes back sharded,
  // because it met ShardTensors afterwards (in compiled code, where no promotion turned it back plain first):
  // Replicate, as every plain tensor mixed with ShardTensors (dispatch::as_shard: this rule runs below autograd).
  auto output = resolve_partial(dispatch::as_shard(output_arg, mesh));
  auto spec = shard_impl(output)->spec();
  auto g = local_aligned(resolve_partial(grad_output), mesh, output.sizes(), spec->placements, spec->dim_extents());
  const auto dim = wrap_dim(dim_arg, std::max<int64_t>(output.dim(), 1));
  const auto& y = shard_impl(output)->local();
  at::Tensor gin;
  if (spec->mesh_dim_of(dim) < 0) {
    gin = log ? at::_log_softmax_backward_data(g, y, dim, input_dtype) : at::_softmax_backward_data(g, y, dim, input_dtype);
  } else if (log) {
    auto s = sum_over(g.sum(dim, true), *spec, dim);
    gin = (g - y.exp() * s).to(input_dtype);
  } else {
    auto s = sum_over((g * y).sum(dim, true), *spec, dim);
    gin = (y * (g - s)).to(input_dtype);
  }
  return make_shard_tensor(gin, spec);
}

// _softmax_backward_data(Tensor grad_output, Tensor output, int dim, ScalarType input_dtype)
at::Tensor softmax_backward_rule(const at::Tensor& grad_output, const at::Tensor& output, int64_t dim,
                                 at::ScalarType input_dtype) {
  return softmax_backward_along("aten::_softmax_backward_data", grad_output, output, dim, input_dtype, /*log=*/false);
}

// _log_softmax_backward_data(Tensor grad_output, Tensor output, int dim, ScalarType input_dtype)
at::Tensor log_softmax_backward_rule(const at::Tensor& grad_output, const at::Tensor& output, int64_t dim,
                                     at::ScalarType input_dtype) {
  return softmax_backward_along("aten::_log_softmax_backward_data", grad_output, output, dim, input_dtype,
                                /*log=*/true);
}

// glu along `dim` pairs row j with row j + L/2. Along an unsharded dim that is local. Along a sharded dim the output
// (L/2 rows) takes the default split, and each rank gathers the two input row ranges its output rows read (their
// owners send them: a neighbour exchange of as many rows as the output block has, twice; comm::gather_rows), then
// runs glu on them; the backward sends the window's gradient rows home (scatter_add_rows, the adjoint).
struct GluLayout {
  int64_t dim = 0, mesh_dim = -1;
  SpecPtr out;
  comm::RowRequests want;  // [coordinate]: the input rows its output rows read (first halves, then second)
};

GluLayout glu_layout(const char* op, const at::Tensor& self, const ShardSpec& spec, int64_t dim_arg) {
  GluLayout g;
  g.dim = wrap_dim(dim_arg, self.dim());
  const auto L = self.size(g.dim);
  TORCH_CHECK_VALUE(L % 2 == 0, op, ": halving dimension must be even, but dimension ", g.dim, " is size ", L);
  auto shape = spec.global_shape;
  shape[g.dim] = L / 2;
  auto ext = spec.dim_extents();
  g.mesh_dim = spec.mesh_dim_of(g.dim);
  if (g.mesh_dim >= 0) {
    const auto n = spec.mesh->size(g.mesh_dim);
    ext[g.dim] = default_split(L / 2, n);
    int64_t first = 0;
    for (int64_t c = 0; c < n; ++c) {
      std::vector<int64_t> rows;
      for (int64_t half : {int64_t{0}, L / 2})
        for (int64_t j = first; j < first + ext[g.dim][c]; ++j) rows.push_back(half + j);
      first += ext[g.dim][c];
      g.want.push_back(std::move(rows));
    }
  }
  g.out = ShardSpec::make_with_dim_extents(spec.mesh, spec.placements, shape, ext);
  return g;
}

// The input rows this rank's glu output reads, along the layout's dim (the local rows when it is unsharded).
at::Tensor glu_window(const GluLayout& g, const ShardSpec& spec, const at::Tensor& local) {
  if (g.mesh_dim < 0) return local;
  return comm::gather_rows(local, g.dim, spec.extents[g.mesh_dim], g.want, *spec.mesh, g.mesh_dim);
}

// glu(Tensor self, int dim=-1)
at::Tensor glu_rule(const at::Tensor& self_arg, int64_t dim_arg) {
  auto self = resolve_partial(self_arg);
  const auto& spec = *shard_impl(self)->spec();
  const auto g = glu_layout("glu", self, spec, dim_arg);
  return make_shard_tensor(at::glu(glu_window(g, spec, shard_impl(self)->local()), g.dim), g.out);
}

// glu_backward(Tensor grad_output, Tensor self, int dim)
at::Tensor glu_backward_rule(const at::Tensor& grad_output, const at::Tensor& self_arg, int64_t dim_arg) {
  auto self = resolve_partial(self_arg);
  auto spec = shard_impl(self)->spec();
  const auto g = glu_layout("glu_backward", self, *spec, dim_arg);
  auto mesh = dispatch::common_mesh("aten::glu_backward", {grad_output, self_arg});
  auto go = local_aligned(resolve_partial(grad_output), mesh, g.out->global_shape, g.out->placements,
                          g.out->dim_extents());
  auto gw = at::glu_backward(go, glu_window(g, *spec, shard_impl(self)->local()), g.dim);
  if (g.mesh_dim >= 0)
    gw = comm::scatter_add_rows(gw, g.dim, spec->extents[g.mesh_dim], g.want, *spec->mesh, g.mesh_dim);
  return make_shard_tensor(gw, spec);
}

} // namespace

SHARDTENSOR_RULE_FAMILY(softmax) {
  dispatch::set_handler("aten::glu", typed_handler(&glu_rule));
  dispatch::set_handler("aten::glu_backward", typed_handler(&glu_backward_rule));
  dispatch::set_handler("aten::_softmax", typed_handler(&softmax_rule));
  dispatch::set_handler("aten::_log_softmax", typed_handler(&log_softmax_rule));
  dispatch::set_handler("aten::_safe_softmax", typed_handler(&safe_softmax_rule));
  dispatch::set_handler("aten::_softmax_backward_data", typed_handler(&softmax_backward_rule));
  dispatch::set_handler("aten::_log_softmax_backward_data", typed_handler(&log_softmax_backward_rule));
}

} // namespace shardtensor::ops
