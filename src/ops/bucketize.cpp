// bucketize, searchsorted and isin: a lookup per element, so each rank looks up its own elements and the result is laid out
// like the input. The sorted sequence (bucketize's boundaries, a 1-D searchsorted sequence) is a lookup table every
// rank needs whole: plain or replicated, no communication; split, it is gathered (it is small next to the values it
// sorts, a table, not the field). An N-D sequence's leading dims pair with the input's: along those it is brought to
// the input's layout (cut or redistributed; never gathered), its last dim whole; a plain input with a sharded
// sequence gives a Replicate result.
#include "comm/collectives.h"
#include "ops/common.h"

namespace shardtensor::ops {

namespace {

// The local sequence (or sorter) for an input laid out as `x_pl` on `mesh`: along each mesh dim that splits one of
// the input's leading dims (an N-D sequence pairs them) the same split, else whole.
at::Tensor sequence_for(const at::Tensor& seq, int64_t x_dim, const MeshPtr& mesh, const Placements& x_pl,
                        const DimExtents& x_ext) {
  Placements pl(mesh->ndim(), Placement::replicate());
  DimExtents ext;
  if (seq.dim() > 1)
    for (size_t m = 0; m < x_pl.size(); ++m)
      if (x_pl[m].is_shard() && x_pl[m].dim < x_dim - 1) {
        pl[m] = x_pl[m];
        ext[x_pl[m].dim] = x_ext.at(x_pl[m].dim);
      }
  return local_in(seq, mesh, pl, ext);
}

// The input's layout (a plain input: Replicate) and local tensor.
struct Lookup {
  MeshPtr mesh;
  SpecPtr spec;
  at::Tensor local;
};

Lookup lookup_input(const char* op, const at::Tensor& self, std::initializer_list<at::Tensor> others) {
  std::vector<at::Tensor> all{self};
  for (const auto& t : others)
    if (t.defined()) all.push_back(t);
  Lookup l;
  l.mesh = dispatch::common_mesh(op, all);
  auto x = resolve_partial(dispatch::as_shard(self, l.mesh));
  l.spec = shard_impl(x)->spec();
  l.local = shard_impl(x)->local();
  return l;
}

// bucketize.Tensor(Tensor self, Tensor boundaries, *, bool out_int32=False, bool right=False)
at::Tensor bucketize_rule(const at::Tensor& self, const at::Tensor& boundaries, bool out_int32, bool right) {
  TORCH_CHECK_VALUE(boundaries.dim() == 1, "boundaries tensor must be 1 dimension, but got dim(", boundaries.dim(),
                    ")");
  auto l = lookup_input("aten::bucketize", self, {boundaries});
  auto b = sequence_for(boundaries, self.dim(), l.mesh, l.spec->placements, l.spec->dim_extents());
  return make_shard_tensor(at::bucketize(l.local, b, out_int32, right), l.spec);
}

// searchsorted.Tensor(Tensor sorted_sequence, Tensor self, *, bool out_int32=False, bool right=False,
//                     str? side=None, Tensor? sorter=None)
at::Tensor searchsorted_rule(const at::Tensor& sorted_sequence, const at::Tensor& self, bool out_int32, bool right,
                             std::optional<c10::string_view> side, const std::optional<at::Tensor>& sorter) {
  const auto sorter_t = sorter && sorter->defined() ? *sorter : at::Tensor();
  if (sorted_sequence.dim() > 1)
    TORCH_CHECK_VALUE(sorted_sequence.dim() == self.dim() &&
                          sorted_sequence.sizes().slice(0, self.dim() - 1) == self.sizes().slice(0, self.dim() - 1),
                      "torch.searchsorted(): boundaries tensor should be 1 dimension or the first N-1 dimensions of "
                      "boundaries tensor and input value tensor must match, but we got boundaries tensor ",
                      sorted_sequence.sizes(), " and input value tensor ", self.sizes());
  auto l = lookup_input("aten::searchsorted", self, {sorted_sequence, sorter_t});
  const auto ext = l.spec->dim_extents();
  auto seq = sequence_for(sorted_sequence, self.dim(), l.mesh, l.spec->placements, ext);
  std::optional<at::Tensor> sort_idx;
  if (sorter_t.defined()) sort_idx = sequence_for(sorter_t, self.dim(), l.mesh, l.spec->placements, ext);
  return make_shard_tensor(at::searchsorted(seq, l.local, out_int32, right, side, sort_idx), l.spec);
}

// isin.Tensor_Tensor(Tensor elements, Tensor test_elements, *, bool assume_unique=False, bool invert=False):
// membership of each element in a set every rank needs whole (gathered when split, like a lookup table); the
// result is laid out like the elements.
at::Tensor isin_rule(const at::Tensor& elements, const at::Tensor& test_elements, bool assume_unique, bool invert) {
  auto l = lookup_input("aten::isin", elements, {test_elements});
  return make_shard_tensor(at::isin(l.local, whole_value(test_elements), assume_unique, invert), l.spec);
}

// isin.Tensor_Scalar(Tensor elements, Scalar test_element, *, bool assume_unique=False, bool invert=False): local.
at::Tensor isin_scalar_rule(const at::Tensor& elements, const at::Scalar& test_element, bool assume_unique,
                            bool invert) {
  auto l = lookup_input("aten::isin", elements, {});
  return make_shard_tensor(at::isin(l.local, test_element, assume_unique, invert), l.spec);
}

// isin.Scalar_Tensor(Scalar element, Tensor test_elements, *, bool assume_unique=False, bool invert=False): whether
// one value is among split test elements: each rank asks its own part, one small all-reduce (max) per splitting mesh
// dim answers for the whole, then the inversion; a 0-dim Replicate result.
at::Tensor isin_in_split_rule(const at::Scalar& element, const at::Tensor& test_elements, bool assume_unique,
                              bool invert) {
  auto t = resolve_partial(test_elements);
  const auto& spec = *shard_impl(t)->spec();
  auto found = at::isin(element, shard_impl(t)->local(), assume_unique, false).to(at::kLong).reshape({1});
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_shard()) found = comm::all_reduce(found, ReduceOp::Max, *spec.mesh, static_cast<int64_t>(m));
  auto out = found.reshape({}).to(at::kBool);
  if (invert) out = out.logical_not();
  return wrap(out, spec.mesh, Placements(spec.mesh->ndim(), Placement::replicate()), {}, {});
}

} // namespace

SHARDTENSOR_RULE_FAMILY(bucketize) {
  dispatch::set_handler("aten::isin.Tensor_Tensor", typed_handler(&isin_rule));
  dispatch::set_handler("aten::isin.Tensor_Scalar", typed_handler(&isin_scalar_rule));
  dispatch::set_handler("aten::isin.Scalar_Tensor", typed_handler(&isin_in_split_rule));
  dispatch::set_handler("aten::bucketize.Tensor", typed_handler(&bucketize_rule));
  dispatch::set_handler("aten::searchsorted.Tensor", typed_handler(&searchsorted_rule));
}

} // namespace shardtensor::ops
