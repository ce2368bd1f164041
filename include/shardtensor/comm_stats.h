// A communication counter: every collective the library issues is counted here (calls and bytes), per
// collective kind. Users read it like torch's CommDebugMode to check what an op communicates. Bytes per call on
// this rank: all_reduce / broadcast: the tensor; all_gather: the gathered result (n pieces); all_to_all and
// ring_pass: what this rank sends to other ranks (its piece for itself excluded); scatter: the root's pieces.
// Messages: the point-to-point messages this rank sends, for the kinds made of them: an all_to_all talks to every
// other rank of its group (n - 1), a halo exchange or a ring pass only to the peers it has rows for (plus, on
// NCCL, a one-element placeholder to a ring neighbour it has nothing for). Collectives whose message pattern is the
// backend's algorithm (all_reduce, all_gather, ...) count none.
// Replications: an op's rule (or the gather-compute fallback) that brought a tensor sharded along a large dim to
// Replicate on its own accord (see include/shardtensor/replication.h), per op: how often, and the bytes of the
// replicated tensor each time. Explicit requests (full_tensor, redistribute) are not counted.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace shardtensor {

struct CommStats {
  std::map<std::string, int64_t> calls;
  std::map<std::string, int64_t> bytes;
  std::map<std::string, int64_t> messages;
  std::map<std::string, int64_t> replications;
  std::map<std::string, int64_t> replicated_bytes;
  int64_t total_calls() const;
  int64_t total_bytes() const;
};

CommStats comm_stats();
void reset_comm_stats();

} // namespace shardtensor
