// The functional collectives path: the library's primitives issued as `_c10d_functional` ops through the dispatcher
// (`all_reduce`, `all_gather_into_tensor`, `all_to_all_single`, `broadcast`), each completed by `wait_tensor` where
// its result is first needed. These ops have FX forms: a rule traced by torch.compile (its local tensors fake or
// functional) records real collective nodes, while the ProcessGroup path would be captured as effectful c10d calls
// whose Work is never waited — a silently wrong graph. collectives.cpp takes this path whenever a tensor is being
// traced, and for eager runs when selected (`shardtensor::set_comm_backend`, <shardtensor/comm_backend.h>; Python
// `st.set_comm_backend("functional")`; `SHARDTENSOR_COMM_BACKEND=functional`).
//
// One seam: collectives.cpp asks `use_functional(t)` at the top of each primitive; the rules never choose.
#pragma once

#include <shardtensor/comm_backend.h>
#include <shardtensor/mesh.h>
#include <shardtensor/placement.h>

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace shardtensor::comm {

// Is `t` being traced: a fake or functional tensor (its key set has Python or Functionalize), or a tracer's mode
// active on this thread (fake tensors, proxy tracing, functionalization). A user's own dispatch mode is not tracing.
bool tracing(const at::Tensor& t);
// The path for collectives on `t`: functional when tracing or when selected.
bool use_functional(const at::Tensor& t);

// Raised (NotImplementedError) by primitives that read communicated values on the host (extent negotiation,
// agreement checks) when called while tracing: names `what` and the remedy.
[[noreturn]] void refuse_host_read_while_tracing(const char* what);

namespace functional {

// The registered name of the mesh dim's group (c10d resolves functional collectives by name).
const std::string& group_name(const Mesh& mesh, int64_t mesh_dim);

// Wait for a functional collective's result (identity when it is already complete).
at::Tensor wait(const at::Tensor& t);

// Not waited: the caller waits (`wait`) where it first needs the result.
at::Tensor all_reduce_start(const at::Tensor& t, ReduceOp op, const Mesh& mesh, int64_t mesh_dim);
// Flat all-to-all: `input` 1-D, `send_splits[j]` elements to coordinate j, `recv_splits[j]` from coordinate j.
// Counted as `kind` with `bytes` (default: what leaves this rank), so a primitive built on it (scatter) counts as the
// ProcessGroup path counts it; `kind == nullptr`: not counted (the caller counts).
at::Tensor all_to_all_single_start(const at::Tensor& input, const std::vector<int64_t>& recv_splits,
                                   const std::vector<int64_t>& send_splits, const Mesh& mesh, int64_t mesh_dim,
                                   const char* kind = "all_to_all", int64_t bytes = -1);

// Complete primitives (waited), same semantics as their collectives.h counterparts, except that all_reduce of Avg
// returns the sum (collectives.cpp divides, as on its ProcessGroup path).
at::Tensor all_reduce(const at::Tensor& t, ReduceOp op, const Mesh& mesh, int64_t mesh_dim);
at::Tensor all_gather_v(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& extents, const Mesh& mesh,
                        int64_t mesh_dim);
at::Tensor broadcast(const at::Tensor& t, int64_t root, const Mesh& mesh, int64_t mesh_dim);

} // namespace functional
} // namespace shardtensor::comm
