// The callee's table of cancelled requests (tier 1).

#include <gtest/gtest.h>

#include <chrono>

#include "torchrpc/rpc/detail/cancelled_requests.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using rpc::detail::CancelledRequests;
using Clock = CancelledRequests::Clock;

TEST(CancelledRequests, RemembersACancelUntilItIsTaken) {
  CancelledRequests table;
  EXPECT_FALSE(table.isCancelled(7));
  EXPECT_FALSE(table.take(7));
  table.add(7, Clock::now() + 60s);
  EXPECT_TRUE(table.isCancelled(7));
  EXPECT_FALSE(table.isCancelled(8));
  EXPECT_EQ(table.size(), 1u);
  EXPECT_TRUE(table.take(7));
  EXPECT_FALSE(table.isCancelled(7));
  EXPECT_FALSE(table.take(7));
  EXPECT_EQ(table.size(), 0u);
}

// A cancel that crossed its answer is never taken; it goes when the next
// cancel comes after its time.
TEST(CancelledRequests, ForgetsEntriesWhoseTimeHasCome) {
  CancelledRequests table;
  table.add(1, Clock::now() - 1ms);
  table.add(2, Clock::now() + 60s);
  EXPECT_FALSE(table.isCancelled(1));
  EXPECT_TRUE(table.isCancelled(2));
  EXPECT_EQ(table.size(), 1u);
}

// A peer flooding cancels with long timeouts cannot grow the table.
TEST(CancelledRequests, IgnoresCancelsOverTheCap) {
  CancelledRequests table;
  auto later = Clock::now() + 60s;
  for (uint64_t id = 0; id < CancelledRequests::kMaxEntries; ++id) {
    EXPECT_TRUE(table.add(id, later));
  }
  EXPECT_FALSE(table.add(CancelledRequests::kMaxEntries, later));
  EXPECT_FALSE(table.isCancelled(CancelledRequests::kMaxEntries));
  EXPECT_EQ(table.size(), CancelledRequests::kMaxEntries);
  // Taking one out makes room again.
  EXPECT_TRUE(table.take(0));
  EXPECT_TRUE(table.add(CancelledRequests::kMaxEntries, later));
  EXPECT_TRUE(table.isCancelled(CancelledRequests::kMaxEntries));
}

} // namespace
} // namespace torchrpc
