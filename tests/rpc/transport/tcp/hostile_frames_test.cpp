// A TCP listener under hostile peers (Note [TCP transport wire format],
// rpc/transport/tcp/frame.h): garbage, lies about lengths, half-open and
// churning connections, bad data frames after a good handshake. After each,
// the established connection and a fresh one still work. Each test runs
// against the TCP port and against the local socket beside it (Note [Local
// sockets for peers on this host]). The worker-level counterpart is
// tests/rpc/hostile_peer_test.cpp.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;

// The parameter: whether the hostile peer comes through the local socket.
class TcpHostilePeerTest : public TcpListenerFixture,
                           public ::testing::WithParamInterface<bool> {
 protected:
  RawTarget target() const {
    RawTarget target{port_, ""};
    if (GetParam()) {
      target.localSocket = localSocketOf(server_->address());
    }
    return target;
  }
};

TEST_P(TcpHostilePeerTest, RandomBytesAreDropped) {
  RawPeer peer(target());
  ASSERT_TRUE(peer.connected());
  peer.write(randomBytes(1024, 1));
  EXPECT_TRUE(peer.waitClosedByServer());
  expectListenerHealthy();
}

TEST_P(TcpHostilePeerTest, ValidHeaderWithGarbageBodyIsDropped) {
  RawPeer peer(target());
  ASSERT_TRUE(peer.connected());
  peer.write(rawFrameHeader(kHello, 100, 0) + randomBytes(100, 2));
  EXPECT_TRUE(peer.waitClosedByServer());
  expectListenerHealthy();
}

TEST_P(TcpHostilePeerTest, HugeLengthsAreRefusedBeforeAllocating) {
  for (uint32_t count : {0u, 0xffffffffu}) {
    RawPeer peer(target());
    ASSERT_TRUE(peer.connected());
    peer.write(rawFrameHeader(kHello, 0xffffffffu, count));
    EXPECT_TRUE(peer.waitClosedByServer());
  }
  expectListenerHealthy();
}

TEST_P(TcpHostilePeerTest, TruncatedHandshakeHeldOpenIsDroppedAtTheDeadline) {
  RawPeer peer(target());
  ASSERT_TRUE(peer.connected());
  peer.write(rawHello("slow", false).substr(0, 10));
  auto start = Clock::now();
  // While it hangs, everyone else is served.
  expectListenerHealthy();
  EXPECT_TRUE(peer.waitClosedByServer(kHandshakeTimeout + 2s));
  EXPECT_GE(Clock::now() - start, kHandshakeTimeout - 50ms);
  expectListenerHealthy();
}

TEST_P(TcpHostilePeerTest, ConnectThenCloseOnce) {
  {
    RawPeer peer(target());
    ASSERT_TRUE(peer.connected());
  }
  expectListenerHealthy();
}

TEST_P(TcpHostilePeerTest, FiftyConnectThenCloseInARow) {
  for (int i = 0; i < 50; ++i) {
    RawPeer peer(target());
    ASSERT_TRUE(peer.connected());
  }
  expectListenerHealthy();
}

TEST_P(TcpHostilePeerTest, ManyHalfOpenConnectionsEvictTheOldest) {
  // More silent peers than the transport keeps in their handshake.
  std::vector<std::unique_ptr<RawPeer>> peers;
  for (int i = 0; i < 100; ++i) {
    peers.push_back(std::make_unique<RawPeer>(target()));
    ASSERT_TRUE(peers.back()->connected());
  }
  expectListenerHealthy();
  EXPECT_TRUE(peers.front()->waitClosedByServer(1s));
}

TEST_P(TcpHostilePeerTest, BadDataFramesFailOnlyTheirConnection) {
  struct Case {
    std::string what;
    std::string bytes;
  };
  std::string oneHugeTensor = rawFrameHeader(kData, 1, 1);
  putLe(oneHugeTensor, uint64_t(1) << 60, 8);
  std::vector<Case> cases = {
      {"too many tensors", rawFrameHeader(kData, 0, 0x7fffffff)},
      {"huge header", rawFrameHeader(kData, 0xffffffffu, 0)},
      {"huge tensor", oneHugeTensor},
      {"unknown type", rawFrameHeader(77, 0, 0)},
      {"garbage", randomBytes(64, 3)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    size_t index = acceptor_->count();
    RawPeer peer(target());
    ASSERT_TRUE(peer.connected());
    // A proper handshake first: the server then hands the connection over.
    ASSERT_TRUE(peer.write(rawHello("raw", false)));
    std::string welcome = peer.read(16);
    ASSERT_EQ(welcome.size(), 16u);
    ASSERT_EQ(welcome.substr(0, 4), "TRPC");
    auto accepted = acceptor_->waitFor(index);
    ASSERT_NE(accepted.connection, nullptr);
    peer.write(c.bytes);
    ASSERT_TRUE(accepted.inbox->waitForError());
    EXPECT_EQ(accepted.inbox->errors()[0].code, ErrorCode::kMalformedMessage);
    EXPECT_TRUE(accepted.inbox->messages().empty());
    EXPECT_TRUE(peer.waitClosedByServer());
  }
  expectListenerHealthy();
}

INSTANTIATE_TEST_SUITE_P(
    TcpAndLocalSocket,
    TcpHostilePeerTest,
    ::testing::Bool(),
    [](const ::testing::TestParamInfo<bool>& info) {
      return info.param ? "LocalSocket" : "Tcp";
    });

// The limit on connections in their handshake counts both acceptors'
// together: silent peers on the TCP port, then as many on the local socket,
// evict the oldest TCP ones.
TEST_F(TcpListenerFixture, HalfOpenPeersOfBothSocketsShareOneLimit) {
  const std::string local = localSocketOf(server_->address());
  ASSERT_FALSE(local.empty());
  std::vector<std::unique_ptr<RawPeer>> peers;
  for (int i = 0; i < 100; ++i) {
    peers.push_back(
        std::make_unique<RawPeer>(RawTarget{port_, i < 50 ? "" : local}));
    ASSERT_TRUE(peers.back()->connected());
  }
  expectListenerHealthy();
  EXPECT_TRUE(peers.front()->waitClosedByServer(1s));
}

} // namespace
} // namespace rpc
} // namespace torchrpc
