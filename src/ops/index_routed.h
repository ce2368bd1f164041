// Reads of a sharded dim addressed by a whole index, kept divided: `x[idx]`, `gather` and `index_select` along the
// dim a mesh dim shards, when the index is whole on every rank (a plain tensor: a masked autoencoder's kept
// patches, PointNet++'s sampled points, a token selection, a graph's edge endpoints). The result is sharded along
// one dim of the index's own shape (the default split), and each rank receives exactly the entries its part names,
// from their owners. Every rank reads the whole index, as the single-device op does, so every rank knows what every
// other rank needs from it: one all-to-all of the values, no counts negotiated, nothing whole on any rank. The
// reverse (a gradient sent home and accumulated at the entries read) is the same exchange the other way.
#pragma once

#include <shardtensor/spec.h>

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace shardtensor::ops {

struct RoutedRead {
  SpecPtr spec;            // the read tensor's layout (its block on this rank is `local` below)
  int64_t m = -1;          // the mesh dim sharding dim `d`
  int64_t d = -1;          // the sharded dim read (its index holds global rows)
  int64_t j = -1;          // the dim of `shape` the result is split along
  std::vector<at::Tensor> idx;  // per dim of the read tensor: its index (broadcasting to `shape`), or undefined
                                // where the dim is not indexed (its whole local extent comes along)
  std::vector<int64_t> shape;   // the index's broadcast shape
  std::vector<int64_t> take;    // extents of shape[j] per coordinate of mesh dim m (the default split)
};

// Whether a routed read can run: it sizes its messages from the index's values on the host, which neither a trace
// (torch.compile: the owners' picks and one all-reduce are kept, which a graph can hold) nor a simulation (no values
// to agree on) has. `local`: the read tensor's block (a traced one carries the tracer's key).
bool routed_reads_possible(const at::Tensor& local);

// Raises the same ValueError on every rank of mesh dim `m` when the ranks hold different values of `index` (plain
// tensors every rank reads whole and sizes its messages from: ranks that disagree would post mismatched sizes and
// wait on each other forever). One small all-gather of a fingerprint (sizes, a position-weighted sum of values).
void check_same_index(const std::vector<at::Tensor>& index, const Mesh& mesh, int64_t m, const std::string& what);

// The reader's block: [shape with dim j narrowed to this rank's extent..., the dims not indexed (local extents, in
// order)...]. Indices must be in range (non-negative, global rows along `d`). One all-to-all over mesh dim m.
at::Tensor routed_read(const RoutedRead& r, const at::Tensor& local);

// The reverse of routed_read: adds `grad` (a reader's block, shaped as routed_read returns it) at the entries it was
// read from, into `out` (this rank's block of the read tensor). One all-to-all over mesh dim m.
void routed_accumulate(const RoutedRead& r, const at::Tensor& grad, at::Tensor& out);

} // namespace shardtensor::ops
