// Uses only the installed public headers: a size-1 mesh over a real c10d::ProcessGroup (no collective is
// ever issued on a size-1 mesh), a ShardTensor from from_local, and two ops dispatched through the library.
#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdio>
#include <exception>

int main() {
  try {
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto group = c10::make_intrusive<c10d::ProcessGroup>(store, /*rank=*/0, /*size=*/1);
    shardtensor::MeshPtr mesh = shardtensor::Mesh::from_group(group, c10::DeviceType::CPU);

    at::Tensor local = at::arange(6, at::kFloat).reshape({2, 3});
    at::Tensor x = shardtensor::from_local(local, mesh, {shardtensor::Placement::shard(0)},
                                           shardtensor::ShapeInference::Even, {},
                                           std::vector<int64_t>{2, 3});
    if (!shardtensor::is_shard_tensor(x) || x.sizes() != at::IntArrayRef({2, 3})) {
      std::fprintf(stderr, "from_local: not a [2, 3] ShardTensor\n");
      return 1;
    }

    at::Tensor y = x + 1;
    if (!shardtensor::is_shard_tensor(y) || !at::equal(shardtensor::to_local(y), local + 1)) {
      std::fprintf(stderr, "x + 1: wrong result\n");
      return 1;
    }

    at::Tensor s = x.sum();
    at::Tensor full = shardtensor::is_shard_tensor(s) ? shardtensor::full_tensor(s) : s;
    if (full.item<float>() != 15.0f) {
      std::fprintf(stderr, "x.sum(): %f, expected 15\n", full.item<float>());
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer failed: %s\n", e.what());
    return 1;
  }
  std::printf("consumer OK\n");
  return 0;
}
