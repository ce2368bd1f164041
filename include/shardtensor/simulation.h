// Simulation mode: this process runs as one rank of a larger world over a process group that moves no data (torch's
// "fake" backend, c10d::FakeProcessGroup), to measure what that rank allocates, computes and sends. Every value it
// computes is garbage by design. What the library would otherwise learn from other ranks' *values* cannot work then:
// with the flag set, those places raise NotImplementedError naming the remedy instead of silently using this rank's
// own data as everyone's (see docs/simulation.md for the list).
#pragma once

#include <cstdint>

namespace shardtensor {

// Process-wide; returns the previous setting. Set by shardtensor.simulate() in Python.
bool set_simulating(bool on);
bool simulating();

// The id of the simulation running now (each one gets a new id when the flag turns on), 0 outside one. A mesh
// records it when it is built, so tensors made inside a simulation are recognised after it ended.
uint64_t simulation_epoch();

class Mesh;
// Raises ValueError when `mesh` was built inside a simulation that is no longer running: a ShardTensor made inside
// `st.simulate` and used after the block would compute garbage silently over the fake process group.
void check_simulation_alive(const Mesh& mesh, const char* what);

} // namespace shardtensor
