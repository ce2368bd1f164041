// How the library's collectives are issued. `process_group` (the default): c10d ProcessGroup calls, waited on their
// Work. `functional`: the `_c10d_functional` ops through the dispatcher, waited by `wait_tensor` — the form
// torch.compile can trace. The functional form is used automatically whenever the tensors are being traced (fake or
// functional tensors, or a tracer's fake/proxy/functional mode active); this setting selects it for eager runs too (to measure it,
// or to debug a compiled run eagerly). Process-wide; set it alike on every rank. `SHARDTENSOR_COMM_BACKEND=functional`
// in the environment selects it at start-up.
#pragma once

#include <cstdint>

namespace shardtensor {

enum class CommBackend { process_group, functional };

// Returns the previous setting.
CommBackend set_comm_backend(CommBackend backend);
CommBackend comm_backend();

// Neighbour exchanges (halos, ring passes), all-reduces, all-to-alls and all-gathers of CPU tensors between ranks of
// one host travel through shared-memory rings instead of the process group's collectives (docs/halo-exchange.md, "Transport"): `bytes` per ring, one ring
// per ordered pair of ranks, for process groups whose first exchange comes after the call; 0 turns it off for them.
// Default 1 MiB, or `SHARDTENSOR_SHM_BYTES` at start-up. Messages larger than a ring use the process group. Ranks
// may differ (a group uses the smallest value, off if any rank has it off). Returns the previous value.
int64_t set_shm_capacity(int64_t bytes);
int64_t shm_capacity();

} // namespace shardtensor
