// Multi-rank C++ tests over real Gloo process groups: ranks are threads of this process sharing a c10d HashStore
// (the in-tree c10d tests do the same).
#pragma once

#include <shardtensor/distributed.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace shardtensor::testing {

// Run `body(world)` on `n` threads, each a rank of a fresh Gloo world; a rank's exception fails the test.
inline void run_ranks(int n, const std::function<void(const World&)>& body) {
  static std::atomic<int> job_id{0};
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto prefix = "job" + std::to_string(job_id++);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        World w;
        w.store = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
        w.rank = r;
        w.size = n;
        w.group = make_process_group(w.store, r, n, c10::DeviceType::CPU, std::chrono::seconds(30));
        body(w);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

} // namespace shardtensor::testing
