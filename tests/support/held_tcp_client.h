#pragma once

// A TCP client whose one io thread a test can hold in a callback, for tests
// of what happens while the loop's own thread is busy (Note [Waiting
// callers drive the transport] in rpc/detail/wait_drivers.h, Note [Sends
// held for one write] in rpc/transport/tcp/connection.h).

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "tests/support/gate.h"
#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/detail/wait_drivers.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace harness {

inline detail::TcpTransportOptions pollingOptions(
    std::string name,
    std::chrono::microseconds poll) {
  auto options = testOptions(std::move(name));
  options.pollAfterTraffic = poll;
  options.pollWhileAwaiting = std::chrono::microseconds(0);
  return options;
}

inline std::chrono::microseconds pollFor(bool poll) {
  return poll ? std::chrono::microseconds(1000) : std::chrono::microseconds(0);
}

// The client's two connections to one server: messages on `held` block the
// client's io thread in their callback until the gate opens; messages on
// `talk` are counted with the thread that read them.
struct HeldClient {
  explicit HeldClient(bool poll) : HeldClient(pollFor(poll), pollFor(poll)) {}
  HeldClient(
      std::chrono::microseconds poll,
      std::chrono::microseconds serverPoll)
      : HeldClient(
            pollingOptions("client", poll),
            pollingOptions("server", serverPoll)) {}
  HeldClient(
      detail::TcpTransportOptions clientOptions,
      detail::TcpTransportOptions serverOptions)
      : server(std::move(serverOptions)),
        client(std::move(clientOptions)),
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
      if (accepted.inbox->messages()[0].header == "held") {
        serverHeld = accepted.connection;
      } else {
        serverTalk = accepted.connection;
        serverTalkInbox = accepted.inbox;
      }
    }
  }

  // Blocks the client's io thread in `held`'s callback.
  void holdIoThread() {
    serverHeld->send(makeMessage("hold"), [](const TransportError*) {});
    EXPECT_TRUE(gate.waitForWaiting(1));
  }

  torchrpc::testing::Gate gate;
  torchrpc::testing::OpenOnExit opener{gate};
  detail::TcpTransport server;
  detail::TcpTransport client;
  Acceptor acceptor;
  std::shared_ptr<Connection> held;
  std::shared_ptr<Connection> talk;
  std::shared_ptr<Connection> serverHeld;
  std::shared_ptr<Connection> serverTalk;
  // What the server received on serverTalk ("talk" first).
  std::shared_ptr<Inbox> serverTalkInbox;
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

} // namespace harness
} // namespace rpc
} // namespace torchrpc
