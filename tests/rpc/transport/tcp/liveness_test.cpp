// Liveness of TCP connections (Note [TCP transport wire format],
// guarantee 2): heartbeats keep an idle connection up and detect a stopped
// peer within peerTimeout + heartbeatInterval; a killed peer fails the
// connection at once.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <iostream>
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

detail::TcpTransportOptions fastLiveness(std::string name) {
  auto options = testOptions(std::move(name));
  options.heartbeatInterval = 200ms;
  options.peerTimeout = 800ms;
  return options;
}

TEST(TcpTransportLiveness, StoppedPeerIsDetectedByHeartbeats) {
  auto options = fastLiveness("client");
  ChildServer child(ChildServer::Kind::kTcp, fastLiveness("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(options);
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  // Heartbeats keep an idle, live connection up past peerTimeout.
  std::this_thread::sleep_for(options.peerTimeout * 2);
  ASSERT_TRUE(inbox->errors().empty());

  child.kill(SIGSTOP);
  auto stopped = Clock::now();
  ASSERT_TRUE(inbox->waitForError(kTimeout));
  auto elapsed = Clock::now() - stopped;
  auto error = inbox->errors()[0];
  EXPECT_EQ(error.code, ErrorCode::kWorkerUnavailable);
  EXPECT_NE(error.detail.find("no heartbeat for"), std::string::npos)
      << error.detail;
  EXPECT_LT(elapsed, options.peerTimeout + options.heartbeatInterval + 500ms);
  EXPECT_GE(elapsed, options.peerTimeout - options.heartbeatInterval - 50ms);
  std::cout
      << "[ detected ] SIGSTOPped peer after "
      << std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count()
      << " ms (peerTimeout " << options.peerTimeout.count() << " ms, interval "
      << options.heartbeatInterval.count() << " ms)" << std::endl;
  child.kill(SIGKILL);
  child.reap();
}

TEST(TcpTransportLiveness, KilledPeerFailsTheConnectionPromptly) {
  ChildServer child(ChildServer::Kind::kTcp, testOptions("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(testOptions("client"));
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  std::atomic<int> sendErrors{0};
  child.kill(SIGKILL);
  auto killed = Clock::now();
  ASSERT_TRUE(inbox->waitForError(kTimeout));
  auto elapsed = Clock::now() - killed;
  EXPECT_EQ(inbox->errors()[0].code, ErrorCode::kWorkerUnavailable);
  EXPECT_LT(elapsed, 1s);
  child.reap();
  connection->send(makeMessage("late"), [&](const TransportError* e) {
    if (e != nullptr) {
      ++sendErrors;
    }
  });
  EXPECT_EQ(sendErrors.load(), 1);
}

} // namespace
} // namespace rpc
} // namespace torchrpc
