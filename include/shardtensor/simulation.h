// Simulation mode: this process runs as one rank of a larger world over a process group that moves no data (torch's
// "fake" backend, c10d::FakeProcessGroup), to measure what that rank allocates, computes and sends. Every value it
// computes is garbage by design. What the library would otherwise learn from other ranks' *values* cannot work then:
// with the flag set, those places raise NotImplementedError naming the remedy instead of silently using this rank's
// own data as everyone's (see docs/simulation.md for the list).
#pragma once

namespace shardtensor {

// Process-wide; returns the previous setting. Set by shardtensor.simulate() in Python.
bool set_simulating(bool on);
bool simulating();

} // namespace shardtensor
