// Note [Waiting callers drive the transport] (rpc/detail/wait_drivers.h) at
// the transport: while the client's only io thread is held in a callback,
// a thread driving the loop reads the next message itself.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "tests/support/eventually.h"
#include "tests/support/gate.h"
#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/detail/wait_drivers.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;
using torchrpc::testing::Gate;
using torchrpc::testing::OpenOnExit;

detail::TcpTransportOptions pollingOptions(std::string name, bool poll) {
  auto options = testOptions(std::move(name));
  options.pollAfterTraffic =
      poll ? std::chrono::microseconds(1000) : std::chrono::microseconds(0);
  options.pollWhileAwaiting = std::chrono::microseconds(0);
  return options;
}

// The client's two connections to one server: messages on `held` block the
// client's io thread in their callback until the gate opens; messages on
// `talk` are counted with the thread that read them.
struct HeldClient {
  explicit HeldClient(bool poll)
      : server(pollingOptions("server", poll)),
        client(pollingOptions("client", poll)),
        acceptor(server) {
    held = client.connect(server.address());
    held->start(
        [this](Message&&) { gate.pass(std::chrono::seconds(30)); },
        [](const TransportError&) {});
    talk = client.connect(server.address());
    talk->start(
        [this](Message&&) {
          readBy = std::this_thread::get_id();
          received.fetch_add(1);
        },
        [](const TransportError&) {});
    // The server tells the two apart by their first message.
    held->send(makeMessage("held"), [](const TransportError*) {});
    talk->send(makeMessage("talk"), [](const TransportError*) {});
    for (size_t i = 0; i < 2; ++i) {
      auto accepted = acceptor.waitFor(i);
      EXPECT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
      (accepted.inbox->messages()[0].header == "held" ? serverHeld
                                                      : serverTalk) =
          accepted.connection;
    }
  }

  // Blocks the client's io thread in `held`'s callback.
  void holdIoThread() {
    serverHeld->send(makeMessage("hold"), [](const TransportError*) {});
    EXPECT_TRUE(gate.waitForWaiting(1));
  }

  Gate gate;
  OpenOnExit opener{gate};
  detail::TcpTransport server;
  detail::TcpTransport client;
  Acceptor acceptor;
  std::shared_ptr<Connection> held;
  std::shared_ptr<Connection> talk;
  std::shared_ptr<Connection> serverHeld;
  std::shared_ptr<Connection> serverTalk;
  std::atomic<int> received{0};
  std::thread::id readBy;
};

// Drives every registered loop until `done` or the deadline.
template <typename Done>
bool driveUntil(Done done, std::chrono::milliseconds limit) {
  detail::DrivingScope driving;
  const auto deadline = Clock::now() + limit;
  while (!done() && Clock::now() < deadline) {
    if (!driving.driveOnce()) {
      std::this_thread::yield();
    }
  }
  driving.end(done());
  return done();
}

TEST(TcpWaitDriver, AWaitingThreadReadsWhileTheIoThreadIsHeld) {
  HeldClient c(/*poll=*/true);
  ASSERT_NE(c.serverHeld, nullptr);
  ASSERT_NE(c.serverTalk, nullptr);
  c.holdIoThread();
  for (int i = 1; i <= 20; ++i) {
    c.serverTalk->send(makeMessage("answer"), [](const TransportError*) {});
    ASSERT_TRUE(driveUntil([&]() { return c.received.load() == i; }, kTimeout));
    EXPECT_EQ(c.readBy, std::this_thread::get_id());
  }
  c.gate.open();
}

TEST(TcpWaitDriver, TheIoThreadReadsAgainOnceNoOneDrives) {
  HeldClient c(/*poll=*/true);
  ASSERT_NE(c.serverTalk, nullptr);
  // A wait drives until its answer came (read by whichever thread got to
  // it first: the io thread may still be polling when the wait begins)...
  c.serverTalk->send(makeMessage("answer"), [](const TransportError*) {});
  ASSERT_TRUE(driveUntil([&]() { return c.received.load() == 1; }, kTimeout));
  // ... then nobody drives: the io thread stops standing by (after the
  // linger) and reads the next message itself.
  c.serverTalk->send(makeMessage("unasked"), [](const TransportError*) {});
  ASSERT_TRUE(torchrpc::testing::eventually(
      [&]() { return c.received.load() == 2; },
      kTimeout));
  EXPECT_NE(c.readBy, std::this_thread::get_id());
}

TEST(TcpWaitDriver, WithoutPollingTheIoThreadKeepsTheLoop) {
  // Polling off: the io thread sleeps in epoll, which holds the reactor a
  // driver would need, so waiting threads do not drive.
  HeldClient c(/*poll=*/false);
  ASSERT_NE(c.serverTalk, nullptr);
  c.holdIoThread();
  c.serverTalk->send(makeMessage("answer"), [](const TransportError*) {});
  EXPECT_FALSE(driveUntil(
      [&]() { return c.received.load() == 1; },
      std::chrono::milliseconds(300)));
  c.gate.open();
  EXPECT_TRUE(driveUntil([&]() { return c.received.load() == 1; }, kTimeout));
  EXPECT_NE(c.readBy, std::this_thread::get_id());
}

} // namespace
} // namespace rpc
} // namespace torchrpc
