// Tier 2: G6 of Note [RRef fork protocol] (rref/rref_context.h). A lost
// worker gives nothing back; the others take back what it held.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "tests/support/eventually.h"
#include "tests/support/rref_cluster.h"
#include "torchrpc/rref/rref.h"

namespace torchrpc {
namespace testing {
namespace {

using namespace std::chrono_literals;

class RRefWorkerLost : public ::testing::TestWithParam<rpc::TransportKind> {};

TEST_P(RRefWorkerLost, TheOthersTakeBackWhatALostWorkerHeld) {
  RRefCluster c(GetParam(), 3, [](int, rpc::Runtime& rt) {
    rt.functions().add("scale", [](at::Tensor x, double f) { return x * f; });
  });
  // worker1 holds a fork of an RRef that worker0 owns ...
  auto held =
      rref::remote<at::Tensor>(c[1], "worker0", "scale", at::ones({4}), 2.0);
  ASSERT_TRUE(at::equal(held.toHere(), at::full({4}, 2.0)));
  // ... and owns one that worker2 holds a fork of.
  auto owned =
      rref::remote<at::Tensor>(c[2], "worker1", "scale", at::ones({2}), 3.0);
  ASSERT_TRUE(at::equal(owned.toHere(), at::full({2}, 3.0)));
  ASSERT_EQ(c.context(0).counters().ownerRRefs, 1u);
  ASSERT_EQ(c.context(2).counters().userRRefs, 1u);

  // The application hears of the loss after the layers let go of it.
  std::promise<size_t> ownerRRefsWhenTold;
  c[0].onWorkerLost([&](const rpc::WorkerInfo&, const std::string&) {
    ownerRRefsWhenTold.set_value(c.context(0).counters().ownerRRefs);
  });
  auto told = ownerRRefsWhenTold.get_future();

  c[1].shutdown(/*graceful=*/false); // dies as a crash would
  ASSERT_EQ(told.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(told.get(), 0u);

  // The owner frees the value worker1 held; worker2 drops its fork of a
  // value that is gone.
  EXPECT_TRUE(eventually([&] {
    return c.context(0).counters().ownerRRefs == 0;
  })) << describeCounters(c.context(0).counters());
  EXPECT_TRUE(eventually([&] {
    return c.context(2).counters().userRRefs == 0;
  })) << describeCounters(c.context(2).counters());
  try {
    owned.toHere();
    ADD_FAILURE() << "fetched a value whose owner was lost";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.code(), rpc::ErrorCode::kWorkerUnavailable) << e.what();
    EXPECT_EQ(e.worker(), "worker1");
    EXPECT_NE(std::string(e.what()).find("lost"), std::string::npos)
        << e.what();
  }
  // The survivors give back everything else and end with empty tables.
  // Concurrently, as separate processes would (worker1's own shutdown
  // already returned).
  EXPECT_TRUE(c.shutdownAll());
  EXPECT_TRUE(allZero(c.context(0).leftAtClose()))
      << describeCounters(c.context(0).leftAtClose());
  EXPECT_TRUE(allZero(c.context(2).leftAtClose()))
      << describeCounters(c.context(2).leftAtClose());
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    RRefWorkerLost,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    testing::transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
