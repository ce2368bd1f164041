// Parameter-gradient reductions deferred into buckets and overlapped with the rest of the backward.
//
// A plain parameter used with sharded inputs gets, from each rule, a per-rank term of its gradient: a pending sum
// over the mesh dims that shard the tokens (dispatch/promote.h completes it). Done at once, each layer's sum blocks
// the backward for a round trip. Instead, while a backward that accumulates into `.grad` runs, the term is handed to
// this module: terms gather in buckets (one per mesh, mesh dims and dtype) until a bucket holds
// `grad_bucket_bytes()`, then the bucket is flattened into one buffer and its all-reduce is issued asynchronously;
// the backward goes on meanwhile. An autograd final callback of the backward (run before `backward()` returns)
// issues what is left, waits, and accumulates each sum into its parameter through the parameter's own gradient
// accumulator, exactly as autograd would have.
//
// Deferred only when nothing can observe the gradient before the end of the backward: a leaf parameter whose
// accumulator has no hooks (DDP, FSDP1, a tensor hook, a post-accumulate hook: reduced at once instead), a backward
// without create_graph and without `inputs=` (torch.autograd.grad: at once), not traced. FSDP2 reads `.grad` in its
// own post-backward, mid-backward: `wait_grad_reductions()` runs first there (python/shardtensor/_patches.py).
//
// Every rank runs the same backward, so the terms, buckets and collectives come in the same order on every rank.
#pragma once

#include <shardtensor/mesh.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch::autograd {
struct Edge;
}

namespace shardtensor::dispatch {

// Bytes a bucket gathers before its all-reduce is issued; 0 turns deferral off (every parameter gradient is
// reduced where its rule produces it). Initial value: SHARDTENSOR_GRAD_BUCKET_BYTES, else 1 MiB.
int64_t grad_bucket_bytes();
int64_t set_grad_bucket_bytes(int64_t bytes);  // returns the previous value

// Whether the running backward may defer parameter-gradient reductions at all (see above).
bool backward_defers_grad_reductions();

// Whether the gradient sent along `edge` (to a parameter) may be deferred: a hook-free leaf accumulator in a
// backward that defers.
bool grad_edge_deferrable(const torch::autograd::Edge& edge);

// Defers the sum of `term` over `mesh_dims` into the bucket, to be accumulated into the parameter of `edge` by the
// end of the backward. False (nothing done) when it cannot: the caller reduces at once.
bool defer_grad_reduction(const torch::autograd::Edge& edge, const at::Tensor& term, const MeshPtr& mesh,
                          const std::vector<int64_t>& mesh_dims);

// Issues, waits and accumulates every deferred reduction now (all ranks call it at the same point of the backward).
void wait_grad_reductions();

// Counters since the last reset: buckets and bytes reduced; seconds the backward's thread spent blocked on bucket
// all-reduces (their exposed part) and issuing them (flatten + issue).
std::map<std::string, double> grad_reduction_stats();
void reset_grad_reduction_stats();

} // namespace shardtensor::dispatch
