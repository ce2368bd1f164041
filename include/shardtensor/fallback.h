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

} // namespace shardtensor
