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

// A plan tensor built on the host (halo index lists, pooling divisors and averaging matrices, element counts; real,
// built under HostMetadataGuard and possibly cached across calls) for use with `like`, on `like`'s device. While
// `like` is traced the tensor becomes a graph constant (`lift_fresh`, as torch.tensor(...) does in traced Python
// code): the fake and proxy modes then see a tensor they own instead of a real one they would refuse.
at::Tensor plan_constant(const at::Tensor& host, const at::Tensor& like);

namespace functional {

// The registered name of the mesh dim's group (c10d resolves functional collectives by name).
const std::string& group_name(const Mesh& mesh, int64_t mesh_dim);

// Wait for a functional collective's result (identity when it is already complete).
at::Tensor wait(const at::Tensor& t);

// The results waited while tracing since the last call, taken (and cleared) at a rule's boundary. A rank may have
// no use for what it receives (an edge rank's empty halo, the blocks a rank without queries still passes round the
// ring), but its collective still sends this rank's data: unused, AOTAutograd's partitioner would remove it from
// this rank's graph only (it drops dead collectives assuming every rank's graph is the same) and the peers would
// wait forever. python/shardtensor/_traced.py ties these results into the rule's output.
std::vector<at::Tensor> take_traced_receives();

// The other half: while a traced rule runs, every collective's input is made to depend on the rule's inputs
// (`inputs`: their local tensors, set by _traced.py at the rule's boundary; empty: none), through a 0-dim zero
// computed from them at the rule's first collective (a rule without collectives adds nothing to the graph).
// A rank's contribution may not depend on the rule's inputs (the zero gradient blocks a rank without queries passes
// round the ring); AOTAutograd's partitioner would then move that collective into the forward graph on that rank
// alone. Each collective's zero is unique (no two collectives' inputs may be merged as a common subexpression).
// Returns the previous inputs.
std::vector<at::Tensor> set_trace_anchor(std::vector<at::Tensor> inputs);

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
