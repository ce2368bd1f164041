// Uses only the installed public headers: a size-1 mesh over a real c10d::ProcessGroup (no collective is
// ever issued on a size-1 mesh), a ShardTensor from from_local, two ops dispatched through the library and one
// through a typed handler registered here.
#include <shardtensor/handler_registry.h>
#include <shardtensor/shard_tensor.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdio>
#include <exception>

namespace {

// A rule for aten::roll along unsharded dims, written as a typed function (schema order).
at::Tensor roll_rule(const at::Tensor& self, c10::SymIntArrayRef shifts, at::IntArrayRef dims) {
  auto* impl = shardtensor::shard_impl(self);
  return shardtensor::make_shard_tensor(at::roll_symint(impl->local(), shifts, dims), impl->spec());
}

} // namespace

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

    shardtensor::register_handler("aten::roll", shardtensor::typed_handler(&roll_rule));
    at::Tensor r = at::roll(x, {1}, {1});
    if (!shardtensor::is_shard_tensor(r) || !at::equal(shardtensor::to_local(r), at::roll(local, {1}, {1}))) {
      std::fprintf(stderr, "typed handler for roll: wrong result\n");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer failed: %s\n", e.what());
    return 1;
  }
  std::printf("consumer OK\n");
  return 0;
}
