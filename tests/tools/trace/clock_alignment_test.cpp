#include "clock_alignment.h"

#include <gtest/gtest.h>

namespace torchrpc {
namespace trace {
namespace {

// A call from `caller` to `callee` at true time `at`, with the given
// one-way delays, stamped on clocks offset by `offsets` (clock - true).
Exchange exchange(
    const std::vector<double>& offsets,
    std::size_t caller,
    std::size_t callee,
    double at,
    double requestDelay,
    double replyDelay,
    bool withReply = true) {
  static int next = 0;
  Exchange x;
  x.caller = caller;
  x.callee = callee;
  x.call = "c#" + std::to_string(++next);
  x.tSend = at + offsets[caller];
  x.tRecv = at + requestDelay + offsets[callee];
  if (withReply) {
    x.tSendReply = at + requestDelay + 10 + offsets[callee];
    x.tReply = at + requestDelay + 10 + replyDelay + offsets[caller];
  }
  return x;
}

const std::vector<std::string> kTwo = {"a", "b"};
const std::vector<std::string> kThree = {"a", "b", "c"};

TEST(ClockAlignment, SymmetricDelaysGiveTheExactOffset) {
  std::vector<double> truth = {1000, 1000 + 5e6};
  auto result = alignClocks(kTwo, {exchange(truth, 0, 1, 100, 70, 70)});
  EXPECT_EQ(result.offsets[0], 0);
  EXPECT_NEAR(result.offsets[1], 5e6, 1e-6);
  EXPECT_TRUE(result.feasible);
  ASSERT_EQ(result.pairs.size(), 1u);
  EXPECT_EQ(result.pairs[0].samples, 1u);
  EXPECT_NEAR(*result.pairs[0].minDelay, 140, 1e-6);
}

// Only calls from b to a: the sample's theta is a's clock minus b's, and
// must be flipped into b - a.
TEST(ClockAlignment, CallsTheOtherWayCountForThePair) {
  std::vector<double> truth = {0, -3e6};
  auto result = alignClocks(
      kTwo,
      {exchange(truth, 1, 0, 100, 50, 50), exchange(truth, 1, 0, 900, 60, 60)});
  EXPECT_NEAR(result.offsets[1], -3e6, 1e-6);
  EXPECT_EQ(result.pairs[0].samples, 2u);
}

TEST(ClockAlignment, PrefersTheLeastDelaySample) {
  std::vector<double> truth = {0, 2e6};
  // Lopsided slow calls each way would pull the estimate off by 200 us;
  // the quick symmetric one is exact.
  auto result = alignClocks(
      kTwo,
      {exchange(truth, 0, 1, 100, 500, 100),
       exchange(truth, 1, 0, 2000, 100, 500),
       exchange(truth, 0, 1, 5000, 20, 20),
       exchange(truth, 0, 1, 9000, 900, 20)});
  EXPECT_NEAR(result.offsets[1], 2e6, 1e-6);
  EXPECT_NEAR(*result.pairs[0].minDelay, 40, 1e-6);
  EXPECT_EQ(result.pairs[0].samples, 4u);
}

// a-b only has a slow lopsided sample (200 us off); a-c and c-b quick
// exact ones. The tree must go a-c-b, not take a-b because it came first.
TEST(ClockAlignment, TheTreeTakesTheQuickestLinks) {
  std::vector<double> truth = {0, 2e6, -1e6};
  auto result = alignClocks(
      kThree,
      {exchange(truth, 0, 1, 100, 500, 100),
       exchange(truth, 0, 2, 1000, 20, 20),
       exchange(truth, 2, 1, 2000, 20, 20)});
  EXPECT_TRUE(result.feasible);
  EXPECT_NEAR(result.offsets[1], 2e6, 1e-6);
  EXPECT_NEAR(result.offsets[2], -1e6, 1e-6);
  EXPECT_FALSE(result.pairs[0].inTree); // a-b
  EXPECT_TRUE(result.pairs[1].inTree); // a-c
  EXPECT_TRUE(result.pairs[2].inTree); // b-c
}

TEST(ClockAlignment, AFeasibleEstimateIsNotMoved) {
  std::vector<double> truth = {0, 2e6, -1e6};
  // Lopsided but consistent: the estimate is off by (90 - 10) / 2 and
  // still inside every bound, so it must stay exactly where NTP put it.
  auto result = alignClocks(
      kThree,
      {exchange(truth, 0, 1, 100, 90, 10),
       exchange(truth, 0, 2, 1000, 10, 90),
       exchange(truth, 1, 2, 5000, 300, 300)});
  EXPECT_TRUE(result.feasible);
  EXPECT_DOUBLE_EQ(result.offsets[1], 2e6 + 40);
  EXPECT_DOUBLE_EQ(result.offsets[2], -1e6 - 40);
}

TEST(ClockAlignment, OneWayCallsBoundButGiveNoSample) {
  std::vector<double> truth = {0, 7e6};
  auto result = alignClocks(
      kTwo,
      {exchange(truth, 0, 1, 100, 5, 0, false),
       exchange(truth, 1, 0, 900, 5, 0, false)});
  EXPECT_EQ(result.pairs[0].samples, 0u);
  EXPECT_FALSE(result.pairs[0].estimate);
  EXPECT_NEAR(result.pairs[0].lo, 7e6 - 5, 1e-6);
  EXPECT_NEAR(result.pairs[0].hi, 7e6 + 5, 1e-6);
  EXPECT_NEAR(result.offsets[1], 7e6, 5);
  EXPECT_TRUE(result.connected[1]);
}

TEST(ClockAlignment, ContradictoryCallsOfOnePairAreNamed) {
  std::vector<double> truth = {0, 0};
  auto result = alignClocks(
      kTwo,
      {exchange(truth, 0, 1, 100, 40, 40),
       exchange(truth, 0, 1, 1000, -500, 40)});
  EXPECT_FALSE(result.feasible);
  ASSERT_EQ(result.conflicts.size(), 1u);
  EXPECT_NE(result.conflicts[0].find("a <-> b"), std::string::npos)
      << result.conflicts[0];
}

TEST(ClockAlignment, UnlinkedWorkersKeepTheirClock) {
  std::vector<double> truth = {0, 5, 9e6, 9e6 + 3e6};
  auto result = alignClocks(
      {"a", "b", "c", "d"},
      {exchange(truth, 0, 1, 100, 40, 40), exchange(truth, 3, 2, 100, 40, 40)});
  EXPECT_TRUE(result.connected[1]);
  EXPECT_FALSE(result.connected[2]);
  EXPECT_FALSE(result.connected[3]);
  // c and d are aligned with each other, c (the lower) unshifted.
  EXPECT_EQ(result.offsets[2], 0);
  EXPECT_NEAR(result.offsets[3], 3e6, 1e-6);
}

} // namespace
} // namespace trace
} // namespace torchrpc
