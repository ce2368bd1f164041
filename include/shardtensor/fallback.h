// The gather-compute fallback for ops without a domain-parallel rule, and strict mode, which turns it off.
//
// A functional op (no aliasing or written arguments, no out= overload, not random) that has no rule, or whose
// rule declines (shardtensor::not_implemented), runs on the full tensors: every ShardTensor argument is gathered to
// Replicate, the op runs locally on every rank, and each tensor output is laid out like the first sharded argument
// of its global shape (a local slice), else Replicate. A one-time warning per op names the op and the bytes moved;
// the collectives are counted under "fallback_<kind>" (comm_stats). Strict mode raises NotImplementedError instead.
#pragma once

namespace shardtensor {

// Process-wide; the initial value is SHARDTENSOR_STRICT=1 (read once). Returns the previous setting. Set it alike
// on every rank: the setting decides whether a rank gathers or raises.
bool set_strict(bool strict);
bool strict();

// Forget which ops have warned, so the next fallback of each op warns again (for tests).
void reset_fallback_warnings();

// The size guard of the fallback. Before gathering, every rank estimates the bytes the call would hold (each
// ShardTensor argument that is not Replicate at its global size, plus the largest of them again as room for the
// result: from the specs, so the same on every rank) and the ranks of the mesh agree (one small all-reduce) on the
// smallest budget; above it the call raises NotImplementedError on every rank, naming the op, the bytes and this
// setting, before anything is gathered. The same round compares strict mode, so a rank in strict mode and one not
// both raise instead of one waiting in the other's gather.
// `bytes` >= 0: a fixed budget; -1 (the default): automatic, the memory available on the arguments' device (CPU:
// the system's available memory; CUDA: free device memory plus what torch's caching allocator holds unused), so a
// gather that cannot fit never starts. The initial value is SHARDTENSOR_FALLBACK_MAX_BYTES (bytes; unset or
// "auto": automatic), read once. Returns the previous setting.
int64_t set_fallback_budget(int64_t bytes);
int64_t fallback_budget();

} // namespace shardtensor
