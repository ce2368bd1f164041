// Creating c10d process groups from C++. Gloo's headers are not in the torch wheel; when the build finds them
// (Debian's libgloo-dev) this file is compiled with USE_C10D_GLOO and creates Gloo backends that run inside
// libtorch's own Gloo. NCCL needs CUDA and nccl.h (USE_C10D_NCCL).
#include <shardtensor/distributed.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <atomic>
#include <cstdlib>
#include <string>

namespace shardtensor {

bool can_create_gloo() {
#ifdef USE_C10D_GLOO
  return true;
#else
  return false;
#endif
}

bool can_create_nccl() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                          int64_t size, c10::DeviceType device_type,
                                                          std::chrono::milliseconds timeout) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(rank), static_cast<int>(size));
#ifdef USE_C10D_GLOO
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = timeout;
  const char* host = std::getenv("SHARDTENSOR_GLOO_HOST");
  opts->devices.push_back(host ? c10d::ProcessGroupGloo::createDeviceForHostname(host)
                               : c10d::ProcessGroupGloo::createDefaultDevice());
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo", store),
                                                          static_cast<int>(rank), static_cast<int>(size), opts);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
#else
  TORCH_CHECK_NOT_IMPLEMENTED(device_type == c10::DeviceType::CUDA,
                              "shardtensor::make_process_group: this build has no Gloo headers, so C++ cannot create "
                              "a CPU process group. Install gloo's headers (Debian: libgloo-dev) and rebuild, or "
                              "create the groups in Python and pass them by name (Mesh::from_group_names).");
#endif
  if (device_type == c10::DeviceType::CUDA) {
#ifdef USE_C10D_NCCL
    auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
    nccl_opts->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("nccl", store),
                                                            static_cast<int>(rank), static_cast<int>(size), nccl_opts);
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#else
    TORCH_CHECK_NOT_IMPLEMENTED(false, "shardtensor::make_process_group: this build has no NCCL support "
                                       "(built without CUDA or nccl.h)");
#endif
  }
  return pg;
}

namespace {
int64_t env_int(const char* name, int64_t fallback, bool required) {
  const char* v = std::getenv(name);
  TORCH_CHECK_VALUE(v || !required, "shardtensor::init_from_env: ", name,
                    " is not set; launch with torchrun or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  return v ? std::atoll(v) : fallback;
}
} // namespace

World init_from_env(c10::DeviceType device_type, std::chrono::milliseconds timeout) {
  World w;
  w.rank = env_int("RANK", 0, true);
  w.size = env_int("WORLD_SIZE", 1, true);
  w.local_rank = env_int("LOCAL_RANK", w.rank, false);
  w.device_type = device_type;
  const char* addr = std::getenv("MASTER_ADDR");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(env_int("MASTER_PORT", 29500, true));
  // Under torchrun the agent already serves the store on MASTER_PORT: every rank connects as a client, under
  // the per-attempt prefix torch's own env:// rendezvous uses.
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool use_agent_store = agent_store && std::string(agent_store) == "True";
  opts.isServer = w.rank == 0 && !use_agent_store;
  opts.numWorkers = static_cast<int>(w.size);
  opts.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(addr ? addr : "127.0.0.1", opts);
  if (use_agent_store) {
    w.store = c10::make_intrusive<c10d::PrefixStore>(
        "/worker/attempt_" + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0, false)), tcp);
  } else {
    w.store = tcp;
  }
#ifdef USE_C10D_NCCL
  if (device_type == c10::DeviceType::CUDA) c10::cuda::set_device(static_cast<c10::DeviceIndex>(w.local_rank));
#endif
  w.group = make_process_group(w.store, w.rank, w.size, device_type, timeout);
  // Named, so functional collectives (comm/functional.h) resolve it.
  w.group->setGroupName("shardtensor_world");
  c10d::register_process_group("shardtensor_world", w.group);
  return w;
}

MeshPtr init_device_mesh(const World& world, std::vector<int64_t> shape, std::vector<std::string> dim_names) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  TORCH_CHECK_VALUE(n == world.size, "shardtensor::init_device_mesh: a mesh of ", n, " ranks over a world of ",
                    world.size);
  const auto ndim = static_cast<int64_t>(shape.size());
  std::vector<int64_t> coord(ndim);
  auto rest = world.rank;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    coord[d] = rest % shape[d];
    rest /= shape[d];
  }
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  static std::atomic<int64_t> meshes_built{0};
  const auto mesh_id = meshes_built++;
  for (int64_t d = 0; d < ndim; ++d) {
    if (ndim == 1) {
      groups.push_back(world.group);
      break;
    }
    // The line through this rank along mesh dim d: its key is the coordinate with dim d blanked.
    std::string key = "mesh" + std::to_string(d) + ":";
    for (int64_t k = 0; k < ndim; ++k) key += (k == d ? std::string("*") : std::to_string(coord[k])) + ",";
    groups.push_back(make_process_group(c10::make_intrusive<c10d::PrefixStore>(key, world.store), coord[d], shape[d],
                                        world.device_type));
    // A registered name per group (functional collectives resolve groups by name); meshes built again get new ones.
    const auto name = "shardtensor_mesh" + std::to_string(mesh_id) + "_" + key;
    groups.back()->setGroupName(name);
    c10d::register_process_group(name, groups.back());
  }
  std::vector<int64_t> ranks(n);
  for (int64_t r = 0; r < n; ++r) ranks[r] = r;
  return std::make_shared<const Mesh>(shape, groups, coord, std::move(dim_names), world.device_type, ranks);
}

} // namespace shardtensor
