// Replications: an op that turns a tensor sharded along a large dim into a replicated one (a rule that gathers, the
// gather-compute fallback, a view that must gather) stops dividing the work from there on. Each one is counted in
// CommStats::replications / replicated_bytes per op; a rule's replication also warns once per op and Python call
// site ("the work is no longer divided"), and in strict mode raises NotImplementedError instead, on every rank
// alike (the decision depends only on the layout and these settings, which agree across ranks). The fallback's own
// gathers are counted, and warned about or refused by the fallback itself (include/shardtensor/fallback.h).
// Explicit requests (full_tensor, redistribute) are not replications of an op: no count, no warning.
//
// "Large": the gathered tensor dim is longer than the mesh dim (each rank could hold rows of it) and the tensor has
// at least `replication_threshold()` elements, so statistics, losses and other small tensors never count.
#pragma once

#include <cstdint>

namespace shardtensor {

// The element count from which a replication counts (default 16384; SHARDTENSOR_REPLICATION_MIN_NUMEL, read once,
// sets the initial value). Process-wide; set it alike on every rank (in strict mode it decides whether ranks raise).
// Returns the previous setting.
int64_t set_replication_threshold(int64_t numel);
int64_t replication_threshold();

// Forget which ops and call sites have warned (for tests).
void reset_replication_warnings();

} // namespace shardtensor
