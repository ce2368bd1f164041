// The shared-memory rings of comm/shm_transport.h, where Python cannot force the order: ranks are threads
// (run_ranks.h), so one rank can post all its sends before the other receives anything.
#include <shardtensor/comm_backend.h>
#include <shardtensor/distributed.h>

#include "comm/shm_transport.h"
#include "run_ranks.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using namespace shardtensor;
using shardtensor::testing::run_ranks;

namespace {

class ShmTransport : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!can_create_gloo()) GTEST_SKIP() << "built without gloo headers: C++ cannot create Gloo groups";
    setenv("SHARDTENSOR_GLOO_HOST", "127.0.0.1", 1);
    previous_ = set_shm_capacity(64 * 1024);  // 3 messages of 16 KiB fill a ring
  }
  void TearDown() override { set_shm_capacity(previous_); }
  int64_t previous_ = 0;
};

void barrier(const World& w) {
  w.group->barrier()->wait();
}

} // namespace

// Rank 0 sends ten 16 KiB messages while rank 1 receives nothing: three fill the ring, seven wait for its helper,
// and every send completes at once. Rank 1 then receives all ten, in order, intact; and answers through the other
// ring.
TEST_F(ShmTransport, SendsTheRingCannotTakeArriveInOrder) {
  run_ranks(2, [](const World& w) {
    auto* ch = comm::shm::channels(*w.group);
    ASSERT_NE(ch, nullptr) << "two ranks of one process share a host";
    constexpr int kMessages = 10;
    if (w.rank == 0) {
      const auto before = comm::shm::shm_stats().deferred;
      for (int i = 0; i < kMessages; ++i) {
        auto work = comm::shm::send(*ch, at::full({4096}, static_cast<double>(i)), 1);
        EXPECT_TRUE(work->isCompleted()) << "a send never waits for the receiver";
      }
      EXPECT_EQ(comm::shm::shm_stats().deferred - before, kMessages - 3);
      barrier(w);
      auto back = at::empty({kMessages});
      comm::shm::recv(*ch, back, 1)->wait();
      EXPECT_TRUE(at::equal(back, at::arange(kMessages, at::kFloat) * 2));
    } else {
      barrier(w);
      auto sums = at::empty({kMessages});
      for (int i = 0; i < kMessages; ++i) {
        auto got = at::empty({4096});
        comm::shm::recv(*ch, got, 0)->wait();
        EXPECT_TRUE(at::equal(got, at::full({4096}, static_cast<double>(i)))) << "message " << i;
        sums[i] = got[0] * 2;
      }
      comm::shm::send(*ch, sums, 0);
    }
  });
}

// A receive posted before its message arrives completes when it does; several posted receives complete in order
// even when the later one is waited first.
TEST_F(ShmTransport, PostedReceivesCompleteInOrder) {
  run_ranks(2, [](const World& w) {
    auto* ch = comm::shm::channels(*w.group);
    ASSERT_NE(ch, nullptr);
    if (w.rank == 1) {
      auto a = at::empty({3}), b = at::empty({5});
      auto wa = comm::shm::recv(*ch, a, 0);
      auto wb = comm::shm::recv(*ch, b, 0);
      barrier(w);
      wb->wait();
      EXPECT_TRUE(wa->isCompleted());
      EXPECT_TRUE(at::equal(a, at::full({3}, 1.0)) && at::equal(b, at::full({5}, 2.0)));
    } else {
      barrier(w);
      comm::shm::send(*ch, at::full({3}, 1.0), 1);
      comm::shm::send(*ch, at::full({5}, 2.0), 1);
    }
  });
}

// Ranks that issue different exchanges: the receiver finds a message of another size and raises, naming both sizes.
TEST_F(ShmTransport, MessageOfAnotherSizeRaises) {
  run_ranks(2, [](const World& w) {
    auto* ch = comm::shm::channels(*w.group);
    ASSERT_NE(ch, nullptr);
    if (w.rank == 0) {
      comm::shm::send(*ch, at::ones({4}), 1);
      return;
    }
    auto got = at::empty({8});
    try {
      comm::shm::recv(*ch, got, 0)->wait();
      ADD_FAILURE() << "a 16-byte message received as 32 bytes";
    } catch (const c10::DistBackendError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("holds 16 bytes where this rank expects 32"), std::string::npos) << msg;
    }
  });
}

// Many small messages back and forth, each receive posted before or after its message arrives depending on timing:
// a message written between a receiver's last look and its sleep must still wake it (a lost wake-up hangs until the
// group's 30 s timeout and fails the test).
TEST_F(ShmTransport, PingPongLosesNoMessage) {
  run_ranks(2, [](const World& w) {
    auto* ch = comm::shm::channels(*w.group);
    ASSERT_NE(ch, nullptr);
    const int other = 1 - static_cast<int>(w.rank);
    auto got = at::empty({1});
    for (int i = 0; i < 100000; ++i) {
      if ((i + w.rank) % 2 == 0) {
        comm::shm::send(*ch, at::full({1}, static_cast<double>(i)), other);
      } else {
        comm::shm::recv(*ch, got, other)->wait();
        ASSERT_EQ(got.item<float>(), static_cast<float>(i)) << "message " << i;
      }
    }
  });
}

// A group's rings are unmapped once the group is gone (at the next group's set-up), so programs and tests that make
// many groups do not keep every segment's pages reserved.
TEST_F(ShmTransport, RingsOfDeadGroupsAreReleased) {
  run_ranks(2, [](const World& w) { ASSERT_NE(comm::shm::channels(*w.group), nullptr); });
  const auto before = comm::shm::shm_stats().released;
  run_ranks(2, [](const World& w) { ASSERT_NE(comm::shm::channels(*w.group), nullptr); });
  EXPECT_GE(comm::shm::shm_stats().released - before, 2) << "both ranks' channels of the first world";
}
