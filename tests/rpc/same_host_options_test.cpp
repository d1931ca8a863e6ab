// The Runtime's same-host options (Options::sameHostTransfers,
// sharedMemoryMaxBytes, copyHelperMinBytes, sharedRingBytes) reach the TCP
// transport (tier 2): two workers in this process, so on one host. Each
// test sends a large tensor and checks where the callee found it (in a
// shared segment or not), that it arrived exactly, and what the sender's
// metrics say its copy helper did and which connections went over a local
// socket; or sends small calls and counts those that came through a
// shared ring.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "tests/support/allowed_cpus.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/metrics.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/transport/tcp/shared_segments.h"

namespace torchrpc {
namespace {

using testing::LocalCluster;

// Above the 256 KiB of same-host transfers and the copy helper's default
// 1 MiB; an odd length, so that the last chunk of a copy is a short one.
constexpr int64_t kBigElements = (8 << 20) / 4 + 5;

at::Tensor bigTensor(int seed) {
  return at::arange(kBigElements, at::kInt) * 7 + seed;
}

std::unique_ptr<LocalCluster> cluster(
    std::function<void(int, rpc::Options&)> configure) {
  return std::make_unique<LocalCluster>(
      rpc::TransportKind::kTcp,
      2,
      std::move(configure),
      [](int, rpc::Runtime& rt) {
        // Whether the argument's storage is a shared segment mapped here.
        rt.functions().add("views_segment", [](at::Tensor t) {
          return rpc::detail::tcp::viewsSharedSegment(t);
        });
        rt.functions().add("echo", [](at::Tensor t) { return t; });
      });
}

// Sends bigTensor() from worker0 to worker1 until worker0's copy helper has
// copied bytes or `rounds` were sent; checks that each one arrives exactly
// and lands in a segment, or not, as `inSegment` says. Returns worker0's
// helperCopiedBytes.
uint64_t sendBigTensors(LocalCluster& c, int rounds, bool inSegment) {
  // A connection settles what its peers share after its first message each
  // way (Note [TCP same-host zero copy]): a small call, before the big ones.
  EXPECT_FALSE(c[0].rpcSync<bool>("worker1", "views_segment", at::ones({4})));
  for (int i = 0; i < rounds; ++i) {
    const at::Tensor sent = bigTensor(i);
    EXPECT_EQ(c[0].rpcSync<bool>("worker1", "views_segment", sent), inSegment)
        << i;
    EXPECT_TRUE(
        at::equal(c[0].rpcSync<at::Tensor>("worker1", "echo", sent), sent))
        << i;
    if (c[0].metrics().transport.helperCopiedBytes > 0) {
      break;
    }
  }
  return c[0].metrics().transport.helperCopiedBytes;
}

TEST(SameHostOptions, ByDefaultBigTensorsTravelInSharedMemory) {
  auto c = cluster(nullptr);
  // The helper needs a second CPU (Note [Copies into shared memory on two
  // cores]); with one allowed, the sender copies alone.
  uint64_t helped = sendBigTensors(*c, 100, /*inSegment=*/true);
  const int cpus = testing::allowedCpuCount();
  ASSERT_GT(cpus, 0);
  if (cpus > 1) {
    EXPECT_GT(helped, 0u);
  } else {
    EXPECT_EQ(helped, 0u);
  }
  // What an operator sees of it.
  rpc::Metrics m = (*c)[0].metrics();
  EXPECT_LE(m.transport.helperCopiedBytes, m.transport.copiedBytes);
  EXPECT_NE(
      rpc::formatPrometheus(m).find(
          "torchrpc_transport_helper_copied_bytes_total{worker=\"worker0\","
          "transport=\"tcp\"} " +
          std::to_string(m.transport.helperCopiedBytes)),
      std::string::npos);
  EXPECT_NE(
      rpc::formatMetricsText(m).find(
          "(by the copy helper " +
          std::to_string(m.transport.helperCopiedBytes) + ")"),
      std::string::npos);
  // Its connections go over local sockets (Note [Local sockets for peers on
  // this host]).
  for (int rank : {0, 1}) {
    rpc::Metrics r = (*c)[rank].metrics();
    EXPECT_GE(r.transport.connectionsOpen, 1u) << rank;
    EXPECT_EQ(r.transport.localConnectionsOpen, r.transport.connectionsOpen)
        << rank;
  }
  const std::string open = std::to_string(m.transport.localConnectionsOpen);
  EXPECT_NE(
      rpc::formatPrometheus(m).find(
          "torchrpc_transport_local_connections_open{worker=\"worker0\","
          "transport=\"tcp\"} " +
          open),
      std::string::npos);
  EXPECT_NE(
      rpc::formatMetricsText(m).find(
          "connections (" + open + " over local sockets)"),
      std::string::npos);
}

TEST(SameHostOptions, SameHostTransfersOffOnEitherSideSendOverTcp) {
  for (int off : {0, 1}) {
    auto c = cluster([off](int rank, rpc::Options& options) {
      options.sameHostTransfers = rank != off;
    });
    EXPECT_EQ(sendBigTensors(*c, 3, /*inSegment=*/false), 0u) << off;
    // Nor is a local socket offered or tried: both go over TCP.
    for (int rank : {0, 1}) {
      rpc::Metrics m = (*c)[rank].metrics();
      EXPECT_GE(m.transport.connectionsOpen, 1u) << off << rank;
      EXPECT_EQ(m.transport.localConnectionsOpen, 0u) << off << rank;
    }
  }
}

TEST(SameHostOptions, NoSharedMemoryBudgetOnEitherSideMeansNoSegments) {
  for (int off : {0, 1}) {
    auto c = cluster([off](int rank, rpc::Options& options) {
      if (rank == off) {
        options.sharedMemoryMaxBytes = 0;
      }
    });
    EXPECT_EQ(sendBigTensors(*c, 3, /*inSegment=*/false), 0u) << off;
  }
}

TEST(SameHostOptions, WithoutTheCopyHelperTheSenderCopiesAlone) {
  auto c = cluster([](int rank, rpc::Options& options) {
    if (rank == 0) {
      options.copyHelperMinBytes = 0;
    }
  });
  EXPECT_EQ(sendBigTensors(*c, 20, /*inSegment=*/true), 0u);
  // Its copies into segments still count.
  EXPECT_GE(
      (*c)[0].metrics().transport.copiedBytes,
      uint64_t(20) * 4 * kBigElements);
}

// Small calls, as many as `calls`, from worker0 to worker1; returns how
// many messages each worker received through a shared ring.
std::pair<uint64_t, uint64_t> ringMessagesAfterCalls(
    LocalCluster& c,
    int calls) {
  for (int i = 0; i < calls; ++i) {
    const at::Tensor sent = at::full({3}, i, at::kFloat);
    EXPECT_TRUE(
        at::equal(c[0].rpcSync<at::Tensor>("worker1", "echo", sent), sent))
        << i;
  }
  return {
      c[0].metrics().transport.ringMessages,
      c[1].metrics().transport.ringMessages};
}

TEST(SameHostOptions, ByDefaultSmallMessagesTravelThroughSharedRings) {
  auto c = cluster(nullptr);
  const auto [before0, before1] = ringMessagesAfterCalls(*c, 5);
  const auto [after0, after1] = ringMessagesAfterCalls(*c, 50);
  // Once the rings are offered (the first calls settle it), each request
  // and each reply takes one.
  EXPECT_GE(after1 - before1, 50u);
  EXPECT_GE(after0 - before0, 50u);
  rpc::Metrics m = (*c)[1].metrics();
  EXPECT_NE(
      rpc::formatPrometheus(m).find(
          "torchrpc_transport_ring_messages_total{worker=\"worker1\","
          "transport=\"tcp\"} " +
          std::to_string(m.transport.ringMessages)),
      std::string::npos);
  EXPECT_NE(
      rpc::formatMetricsText(m).find(
          "ring messages " + std::to_string(m.transport.ringMessages)),
      std::string::npos);
}

TEST(SameHostOptions, ARingIsOnlyWhereItsReaderPollsAndAllowsOne) {
  // worker1 gives no ring (sharedRingBytes 0), worker0's io thread does
  // not poll: neither receives through one.
  auto c = cluster([](int rank, rpc::Options& o) {
    if (rank == 1) {
      o.sharedRingBytes = 0;
    } else {
      o.ioPollAfterTraffic = std::chrono::microseconds(0);
      o.ioPollWhileAwaiting = std::chrono::microseconds(0);
    }
  });
  const auto [ring0, ring1] = ringMessagesAfterCalls(*c, 30);
  EXPECT_EQ(ring0, 0u);
  EXPECT_EQ(ring1, 0u);
}

} // namespace
} // namespace torchrpc
