// segment_reduce (torch._segment_reduce) and its backward: runs of consecutive rows along `axis` reduced to one row
// each (sum, mean, amax/max, amin/min, prod), the runs given by lengths or offsets per index of the dims before the
// axis. PyG's `segment` (a per-graph readout over sorted nodes, `ptr`) runs through it when torch_scatter is absent.
//
// Dims other than the axis keep their splits and each rank reduces its own rows, no communication: a split dim before
// the axis cuts the lengths / offsets to the rank's block of that dim. A split axis (the nodes, the points): each rank
// reduces the part of every segment that lies in its rows (the segment boundaries clipped to its rows), then one
// collective over that mesh dim combines the parts -- an all-reduce for sum, max and min (mean: a sum, then divided by
// the whole segment's length), an all-gather of the ranks' products for prod -- and the result, one row per segment,
// is Replicate along that mesh dim. `initial` is applied once, after the combination. The backward spreads each
// segment's gradient over the rows the rank holds; the ties of max / min and the zeros of prod are counted over the
// whole segment (one small all-reduce), so the gradient is one device's.
#include "comm/collectives.h"
#include "ops/common.h"

#include <limits>

namespace shardtensor::ops {

namespace {

enum class SegmentReduction { Sum, Mean, Max, Min, Prod };

SegmentReduction segment_reduction(c10::string_view reduce) {
  if (reduce == "sum") return SegmentReduction::Sum;
  if (reduce == "mean") return SegmentReduction::Mean;
  if (reduce == "max" || reduce == "amax") return SegmentReduction::Max;
  if (reduce == "min" || reduce == "amin") return SegmentReduction::Min;
  if (reduce == "prod") return SegmentReduction::Prod;
  TORCH_CHECK(false, "reduce argument must be either sum, prod, mean, amax or amin, got ", reduce);
}

// The segments of one call as this rank runs them.
struct Segments {
  MeshPtr mesh;
  SpecPtr spec;                // the data's layout (no pending sum)
  at::Tensor local;            // the data's local tensor
  int64_t axis = 0;
  int64_t axis_mesh_dim = -1;  // the mesh dim that splits the axis, or -1
  at::Tensor bounds;           // whole segments' offsets (lead..., S + 1), cut to this rank's block of the lead dims
  at::Tensor local_bounds;     // the same clipped to this rank's rows of the axis, relative to them
  Placements out_placements;
  DimExtents out_extents;
  std::vector<int64_t> out_shape;
};

// The segments' offsets (lead..., S + 1), whole: from `lengths` (cumulative sums after a zero) or `offsets`.
// Validated as one device validates them, on the whole tensors, so every rank raises alike.
at::Tensor whole_bounds(const at::Tensor& data, const std::optional<at::Tensor>& lengths,
                        const std::optional<at::Tensor>& offsets, int64_t axis, bool unsafe, bool check) {
  TORCH_CHECK((lengths && lengths->defined()) || (offsets && offsets->defined()),
              "segment_reduce(): Either lengths or offsets must be defined.");
  at::Tensor bounds;
  if (lengths && lengths->defined()) {
    const auto len = whole_value(*lengths).to(at::kLong);
    if (check) {
      TORCH_CHECK(len.dim() == axis + 1, "segment_reduce(): expected lengths of ", axis + 1, " dims for axis ", axis,
                  ", got ", len.dim());
      TORCH_CHECK(!len.lt(0).any().item<bool>(), "lengths contains negative value!");
      TORCH_CHECK(unsafe || len.sum(-1).eq(data.size(axis)).all().item<bool>(),
                  "segment_reduce(): Expected all rows of lengths along axis to sum to data.size(lengths.dim()-1) "
                  "when !unsafe.");
    }
    auto lead = len.sizes().vec();
    lead.back() = 1;
    bounds = at::cat({at::zeros(lead, len.options()), len.cumsum(-1)}, -1);
  } else {
    bounds = whole_value(*offsets).to(at::kLong);
    if (check) {
      TORCH_CHECK(bounds.dim() == axis + 1 && bounds.size(-1) >= 1, "segment_reduce(): expected offsets of ", axis + 1,
                  " dims for axis ", axis, ", got ", bounds.sizes());
      TORCH_CHECK(!bounds.diff(1, -1).lt(0).any().item<bool>(),
                  "Expected segment_length >= 0 to be true, but got false.");
    }
  }
  if (check)
    TORCH_CHECK(bounds.sizes().slice(0, axis) == data.sizes().slice(0, axis),
                "segment_reduce(): the lengths / offsets' leading dims ", bounds.sizes().slice(0, axis),
                " must equal the data's dims before the axis ", data.sizes().slice(0, axis));
  return bounds;
}

Segments segments_of(const char* op, const at::Tensor& data, const std::optional<at::Tensor>& lengths,
                     const std::optional<at::Tensor>& offsets, int64_t axis_arg, bool unsafe, bool check,
                     std::initializer_list<at::Tensor> others = {}) {
  std::vector<at::Tensor> all{data};
  for (const auto& t : others)
    if (t.defined()) all.push_back(t);
  if (lengths && lengths->defined()) all.push_back(*lengths);
  if (offsets && offsets->defined()) all.push_back(*offsets);
  Segments s;
  s.mesh = dispatch::common_mesh(op, all);
  auto x = resolve_partial(dispatch::as_shard(data, s.mesh));
  s.spec = shard_impl(x)->spec();
  s.local = shard_impl(x)->local();
  s.axis = wrap_dim(axis_arg, data.dim());
  s.axis_mesh_dim = s.spec->mesh_dim_of(s.axis);
  const auto whole = whole_bounds(data, lengths, offsets, s.axis, unsafe, check);
  // The bounds' lead dims are the data's dims before the axis: cut to this rank's block of those.
  Placements pl(s.mesh->ndim(), Placement::replicate());
  DimExtents ext;
  const auto data_ext = s.spec->dim_extents();
  for (size_t m = 0; m < pl.size(); ++m) {
    const auto& p = s.spec->placements[m];
    if (p.is_shard() && p.dim < s.axis) {
      pl[m] = p;
      ext[p.dim] = data_ext.at(p.dim);
    }
  }
  s.bounds = local_in(whole, s.mesh, pl, ext);
  s.local_bounds = s.bounds;
  if (s.axis_mesh_dim >= 0) {
    const auto first = s.spec->local_offset(s.axis);
    s.local_bounds = (s.bounds - first).clamp(0, s.local.size(s.axis));
  }
  s.out_shape = data.sizes().vec();
  s.out_shape[s.axis] = whole.size(-1) - 1;
  s.out_placements = s.spec->placements;
  s.out_extents = data_ext;
  if (s.axis_mesh_dim >= 0) {
    s.out_placements[s.axis_mesh_dim] = Placement::replicate();
    s.out_extents.erase(s.axis);
  }
  return s;
}

// Per-segment values (lead..., S, trailing...) spread over this rank's rows: each row takes its segment's value,
// rows outside every segment zero (the sum's backward kernel does exactly this).
at::Tensor spread(const Segments& s, const at::Tensor& per_segment) {
  return at::_segment_reduce_backward(per_segment, per_segment, s.local, "sum", std::nullopt, s.local_bounds, s.axis,
                                      std::nullopt);
}

// A per-segment count or length (lead..., S) shaped to broadcast over the result's trailing dims.
at::Tensor over_trailing(const Segments& s, const at::Tensor& per_segment) {
  auto shape = per_segment.sizes().vec();
  shape.resize(s.out_shape.size(), 1);
  return per_segment.reshape(shape);
}

// Every rank's `part` multiplied together over the axis's mesh dim (no product reduction in the collectives: the
// parts, one row of segments each, are gathered).
at::Tensor product_over_axis(const Segments& s, const at::Tensor& part) {
  const auto n = s.mesh->size(s.axis_mesh_dim);
  auto all = comm::all_gather_v(part.unsqueeze(0).contiguous(), 0, std::vector<int64_t>(n, 1), *s.mesh,
                                s.axis_mesh_dim);
  return all.prod(0);
}

// segment_reduce(Tensor data, str reduce, *, Tensor? lengths=None, Tensor? indices=None, Tensor? offsets=None,
//                int axis=0, bool unsafe=False, Scalar? initial=None)
at::Tensor segment_reduce_rule(const at::Tensor& data, c10::string_view reduce,
                               const std::optional<at::Tensor>& lengths, const std::optional<at::Tensor>& indices,
                               const std::optional<at::Tensor>& offsets, int64_t axis, bool unsafe,
                               const std::optional<at::Scalar>& initial) {
  TORCH_CHECK(!indices || !indices->defined(), "segment_reduce(): indices based reduction is not supported yet.");
  const auto how = segment_reduction(reduce);
  auto s = segments_of("aten::segment_reduce", data, lengths, offsets, axis, unsafe, /*check=*/true);
  const auto wrap_out = [&](at::Tensor local) {
    return wrap(std::move(local), s.mesh, s.out_placements, s.out_shape, s.out_extents);
  };
  if (s.axis_mesh_dim < 0)
    return wrap_out(at::segment_reduce(s.local, reduce, std::nullopt, std::nullopt, s.local_bounds, s.axis,
                                       /*unsafe=*/true, initial));
  const auto m = s.axis_mesh_dim;
  const auto part = [&](c10::string_view r) {
    return at::segment_reduce(s.local, r, std::nullopt, std::nullopt, s.local_bounds, s.axis, /*unsafe=*/true,
                              std::nullopt);
  };
  at::Tensor out;
  switch (how) {
    case SegmentReduction::Sum:
      out = comm::all_reduce(part("sum"), ReduceOp::Sum, *s.mesh, m);
      if (initial) out = out + *initial;
      break;
    case SegmentReduction::Mean: {
      // One device's mean is (initial + sum) / length, and initial (NaN without one) for an empty segment.
      auto sum = comm::all_reduce(part("sum"), ReduceOp::Sum, *s.mesh, m);
      const auto len = over_trailing(s, s.bounds.diff(1, -1));
      if (initial) sum = sum + *initial;
      const auto empty = initial ? at::full({}, *initial, sum.options())
                                 : at::full({}, std::numeric_limits<double>::quiet_NaN(), sum.options());
      out = at::where(len.eq(0), empty, sum / len.to(sum.scalar_type()));
      break;
    }
    case SegmentReduction::Max:
      out = comm::all_reduce(part("amax"), ReduceOp::Max, *s.mesh, m);
      if (initial) out = at::maximum(out, at::full({}, *initial, out.options()));
      break;
    case SegmentReduction::Min:
      out = comm::all_reduce(part("amin"), ReduceOp::Min, *s.mesh, m);
      if (initial) out = at::minimum(out, at::full({}, *initial, out.options()));
      break;
    case SegmentReduction::Prod:
      out = product_over_axis(s, part("prod"));
      if (initial) out = out * *initial;
      break;
  }
  return wrap_out(out);
}

// _segment_reduce_backward(Tensor grad, Tensor output, Tensor data, str reduce, *, Tensor? lengths=None,
//                          Tensor? offsets=None, int axis=0, Scalar? initial=None)
at::Tensor segment_reduce_backward_rule(const at::Tensor& grad, const at::Tensor& output, const at::Tensor& data,
                                        c10::string_view reduce, const std::optional<at::Tensor>& lengths,
                                        const std::optional<at::Tensor>& offsets, int64_t axis,
                                        const std::optional<at::Scalar>& initial) {
  const auto how = segment_reduction(reduce);
  auto s = segments_of("aten::_segment_reduce_backward", data, lengths, offsets, axis, /*unsafe=*/true,
                       /*check=*/false, {grad, output});
  const auto g = local_in(grad, s.mesh, s.out_placements, s.out_extents);
  const auto out = local_in(output, s.mesh, s.out_placements, s.out_extents);
  const auto wrap_grad = [&](at::Tensor local) {
    return wrap(std::move(local), s.mesh, s.spec->placements, data.sizes().vec(), s.spec->dim_extents());
  };
  if (s.axis_mesh_dim < 0)
    return wrap_grad(at::_segment_reduce_backward(g, out, s.local, reduce, std::nullopt, s.local_bounds, s.axis,
                                                  initial));
  const auto m = s.axis_mesh_dim;
  const auto local_sum = [&](const at::Tensor& rows) {
    return at::segment_reduce(rows, "sum", std::nullopt, std::nullopt, s.local_bounds, s.axis, /*unsafe=*/true,
                              std::nullopt);
  };
  const auto zero = at::zeros({}, g.options());
  switch (how) {
    case SegmentReduction::Sum:
      return wrap_grad(spread(s, g));
    case SegmentReduction::Mean: {
      const auto len = over_trailing(s, s.bounds.diff(1, -1)).to(g.scalar_type());
      return wrap_grad(spread(s, at::where(len.gt(0), g / len, zero)));
    }
    case SegmentReduction::Max:
    case SegmentReduction::Min: {
      // aten's kernels: every row equal to its segment's result (or NaN) takes the segment's gradient, divided by
      // their count where the gradient is positive and they are two or more (the kernels divide only positive
      // gradients); the count is the whole segment's.
      const auto hit = s.local.isnan().logical_or(s.local.eq(spread(s, out)));
      const auto count = comm::all_reduce(local_sum(hit.to(g.scalar_type())), ReduceOp::Sum, *s.mesh, m);
      const auto share = at::where(g.gt(0).logical_and(count.ge(2)), g / count, g);
      return wrap_grad(at::where(hit, spread(s, share), zero));
    }
    case SegmentReduction::Prod: {
      // aten's kernels: a row that is neither zero nor NaN takes grad * result / row; a zero or NaN row takes grad
      // times the product of the segment's other rows and initial -- NaN when another row is NaN, zero when another
      // is zero, else the product of the rows that are neither, counted and multiplied over the whole segment.
      const auto special = s.local.eq(0).logical_or(s.local.isnan());
      const auto counts = fused_sum({local_sum(s.local.eq(0).to(g.scalar_type())),
                                     local_sum(s.local.isnan().to(g.scalar_type()))}, {m}, *s.mesh);
      const auto& zeros = counts[0];
      const auto& nans = counts[1];
      auto rest = product_over_axis(
          s, at::segment_reduce(at::where(special, at::ones({}, s.local.options()), s.local), "prod", std::nullopt,
                                std::nullopt, s.local_bounds, s.axis, /*unsafe=*/true, std::nullopt));
      if (initial) rest = rest * *initial;
      const auto other_zeros = spread(s, zeros) - s.local.eq(0).to(g.scalar_type());
      const auto other_nans = spread(s, nans) - s.local.isnan().to(g.scalar_type());
      const auto nan = at::full({}, std::numeric_limits<double>::quiet_NaN(), g.options());
      const auto exclusive =
          at::where(other_nans.gt(0), nan, at::where(other_zeros.gt(0), zero, spread(s, g * rest)));
      return wrap_grad(at::where(special, exclusive, spread(s, g * out) / s.local));
    }
  }
  TORCH_INTERNAL_ASSERT(false, "segment_reduce: unhandled reduction");
}

} // namespace

SHARDTENSOR_RULE_FAMILY(segment_reduce) {
  dispatch::set_handler("aten::segment_reduce", typed_handler(&segment_reduce_rule));
  dispatch::set_handler("aten::_segment_reduce_backward", typed_handler(&segment_reduce_backward_rule));
}

} // namespace shardtensor::ops
