// A small 2-D conv net (torch::nn modules) trained for a few steps on a synthetic field sharded along its
// height, on every rank of a torchrun-style job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 also trains
// the same net on the whole field in one process and checks the losses match.
//
//   torchrun --nproc-per-node 2 --no-python ./train_conv     (or examples/cpp/run_ranks.sh 2 ./train_conv)
#include <shardtensor/shardtensor.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace nn = torch::nn;
using namespace shardtensor;

namespace {

nn::Sequential make_net() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(2, 8, 3).padding(1)), nn::GELU(),
                        nn::Conv2d(nn::Conv2dOptions(8, 8, 3).padding(2).dilation(2)), nn::GELU(),
                        nn::Conv2d(nn::Conv2dOptions(8, 8, 4).stride(2).padding(1)), nn::GELU(),
                        nn::Conv2d(nn::Conv2dOptions(8, 1, 1)));
}

// Smooth multi-scale field and target, the same on every rank.
std::pair<at::Tensor, at::Tensor> make_data(int64_t h, int64_t w) {
  auto y = torch::linspace(0, 1, h).view({h, 1});
  auto x = torch::linspace(0, 1, w).view({1, w});
  auto u = torch::sin(6.28 * x + 3.0 * y) + 0.3 * torch::cos(17.0 * x * y);
  auto v = torch::cos(4.0 * y - 2.0 * x) * torch::exp(-x);
  auto field = torch::stack({u, v}).unsqueeze(0);                                            // [1, 2, h, w]
  auto target = (u * v).index({torch::indexing::Slice(0, torch::indexing::None, 2), torch::indexing::Slice(0, torch::indexing::None, 2)})
                    .unsqueeze(0).unsqueeze(0);                                                // [1, 1, h/2, w/2]
  return {field, target};
}

std::vector<double> train(nn::Sequential net, const at::Tensor& x, const at::Tensor& target, int steps) {
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto loss = torch::nn::functional::mse_loss(net->forward(x), target);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>()); // a collective on ShardTensors: every rank calls it
  }
  return losses;
}

} // namespace

int main() {
  if (!can_create_gloo()) {
    std::printf("skipped: this ShardTensor build cannot create Gloo groups in C++ (no gloo headers at build time)\n");
    return 77;
  }
  const int steps = 5;
  auto world = init_from_env(c10::DeviceType::CPU, std::chrono::seconds(60));
  auto mesh = init_device_mesh(world, {world.size}, {"domain"});
  torch::manual_seed(0);
  auto net = make_net();
  auto reference = std::dynamic_pointer_cast<nn::SequentialImpl>(net->clone());
  auto [field, target] = make_data(42, 32);
  // Uneven shards on purpose: the first rank takes three rows more than the default split.
  auto rows = default_split(42, world.size);
  if (world.size > 1) {
    rows.front() += 3;
    rows.back() -= 3;
  }

  // Only rank 0 needs the data; each rank receives its rows.
  auto x = scatter_tensor(world.rank == 0 ? field : at::Tensor(), 0, mesh, {Placement::shard(2)}, {{0, rows}});
  auto t = scatter_tensor(world.rank == 0 ? target : at::Tensor(), 0, mesh, {Placement::shard(2)});
  auto losses = train(net, x, t, steps);

  int failed = 0;
  if (world.rank == 0) {
    auto ref_losses = train(nn::Sequential(reference), field, target, steps);
    std::printf("step  sharded (%lld ranks)  single process  rel. error\n", static_cast<long long>(world.size));
    for (int s = 0; s < steps; ++s) {
      const double err = std::abs(losses[s] - ref_losses[s]) / std::max(std::abs(ref_losses[s]), 1e-12);
      std::printf("%4d  %18.8f  %14.8f  %10.2e\n", s, losses[s], ref_losses[s], err);
      if (err > 1e-4) failed = 1;
    }
    std::printf(failed ? "MISMATCH\n" : "OK: sharded training matches the single-process run\n");
  }
  // Every rank learns the verdict (a small collective), so all exit alike.
  auto verdict = distribute_tensor(at::full({1}, static_cast<double>(failed)), mesh, {Placement::replicate()});
  auto any_failed = full_tensor(redistribute(make_shard_tensor(to_local(verdict), ShardSpec::make(mesh, {Placement::partial(ReduceOp::Max)}, {1})), {Placement::replicate()}));
  return any_failed.item<double>() > 0 ? 1 : 0;
}
