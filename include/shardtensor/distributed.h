// Process groups and meshes from C++ (torchrun-style environments), without Python.
#pragma once

#include <shardtensor/mesh.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace shardtensor {

struct World {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group; // all ranks
  int64_t rank = 0;
  int64_t size = 1;
  int64_t local_rank = 0;
  c10::DeviceType device_type = c10::DeviceType::CPU;
};

// Which backends this build can create: Gloo needs gloo's headers at build time (the torch wheel ships none;
// Debian's libgloo-dev provides them), NCCL needs CUDA and nccl.h.
bool can_create_gloo();
bool can_create_nccl();

// A process group over `store` for ranks [0, size): Gloo for CPU tensors, plus NCCL for CUDA tensors when
// `device_type` is CUDA. Raises NotImplementedError when this build cannot create the needed backend.
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                          int64_t size, c10::DeviceType device_type,
                                                          std::chrono::milliseconds timeout = std::chrono::minutes(5));

// torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK). Creates the TCP store and
// the world group (registered in c10d as "shardtensor_world"); on CUDA it sets the device to LOCAL_RANK.
World init_from_env(c10::DeviceType device_type = c10::DeviceType::CPU,
                    std::chrono::milliseconds timeout = std::chrono::minutes(5));

// An N-d mesh over the world (row-major ranks): one process group per line of every mesh dim, built from the
// world's store. Collective over the world: every rank must call it with the same arguments.
MeshPtr init_device_mesh(const World& world, std::vector<int64_t> shape, std::vector<std::string> dim_names = {});

} // namespace shardtensor
