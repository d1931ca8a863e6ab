// What the TCP transport promises beyond the Transport contract (which
// tests/rpc/transport_test.cpp covers for every backend): its addresses,
// frames at the edges of the format, order with several io threads, and
// connections that meet the transport's shutdown before they started.

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

TEST(TcpTransport, AddressesAndBadAddresses) {
  detail::TcpTransport server(testOptions("server"));
  Acceptor acceptor(server);
  EXPECT_EQ(server.address().rfind("tcp://127.0.0.1:", 0), 0u);
  EXPECT_GT(portOf(server.address()), 0);
  for (const std::string& address :
       {std::string("uv://127.0.0.1:1"),
        std::string("tcp://127.0.0.1"),
        std::string("tcp://nonsense:12"),
        std::string("tcp://127.0.0.1:99999")}) {
    SCOPED_TRACE(address);
    auto connection = server.connect(address);
    auto inbox = startWithInbox(connection);
    ASSERT_TRUE(inbox->waitForError());
    EXPECT_EQ(inbox->errors()[0].code, ErrorCode::kWorkerUnavailable);
  }
  detail::TcpTransportOptions bad = testOptions("bad");
  bad.listenAddress = "not an ip";
  detail::TcpTransport unbound(bad);
  EXPECT_THROW(unbound.listen([](std::shared_ptr<Connection>) {}), c10::Error);
}

TEST(TcpTransport, ZeroLengthAndManyTensors) {
  detail::TcpTransport server(testOptions("server"));
  detail::TcpTransport client(testOptions("client"));
  Acceptor acceptor(server);
  auto connection = client.connect(server.address());
  startWithInbox(connection);
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 300; ++i) {
    tensors.push_back(
        i % 3 == 0 ? at::empty({0}) : at::full({i}, i, at::kFloat));
  }
  connection->send(makeMessage("", tensors), [](const TransportError*) {});
  auto accepted = acceptor.waitFor(0);
  ASSERT_NE(accepted.connection, nullptr);
  ASSERT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
  auto message = accepted.inbox->messages()[0];
  ASSERT_EQ(message.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    ASSERT_EQ(size_t(message.tensors[i].numel()), tensors[i].nbytes());
    EXPECT_TRUE(message.tensors[i].view(at::kFloat).equal(tensors[i]));
  }
}

TEST(TcpTransport, SeveralIoThreadsKeepOrderBothWays) {
  auto options = testOptions("server");
  options.ioThreads = 2;
  detail::TcpTransport server(options);
  options.name = "client";
  detail::TcpTransport client(options);
  Acceptor acceptor(server);
  constexpr int kCount = 500;
  std::vector<std::shared_ptr<Connection>> connections;
  std::vector<std::shared_ptr<Inbox>> inboxes;
  for (int c = 0; c < 3; ++c) {
    connections.push_back(client.connect(server.address()));
    inboxes.push_back(startWithInbox(connections.back()));
  }
  // Senders on several threads at once, each on its own connection.
  std::vector<std::thread> senders;
  for (int c = 0; c < 3; ++c) {
    senders.emplace_back([&, c]() {
      for (int i = 0; i < kCount; ++i) {
        int64_t size = i % 50 == 0 ? 200000 : 1 + i % 5;
        connections[c]->send(
            makeMessage(std::to_string(i), {at::full({size}, i, at::kInt)}),
            [](const TransportError*) {});
      }
    });
  }
  for (auto& sender : senders) {
    sender.join();
  }
  for (int c = 0; c < 3; ++c) {
    auto accepted = acceptor.waitFor(c);
    ASSERT_NE(accepted.connection, nullptr);
    ASSERT_TRUE(accepted.inbox->waitForMessages(kCount, kTimeout));
    auto messages = accepted.inbox->messages();
    for (int i = 0; i < kCount; ++i) {
      ASSERT_EQ(messages[i].header, std::to_string(i));
      ASSERT_EQ(messages[i].tensors[0].view(at::kInt)[-1].item<int>(), i);
    }
  }
}

// A connection that the transport's shutdown (or the user's close()) meets
// before its io thread started it never connects: a start after close()
// would open a socket and arm a handshake timer that nobody waits for, and
// one queued after join() would stay in a loop nobody runs, holding the
// connection and, through it, the transport's io_context for good.
TEST(TcpTransport, AConnectionClosedBeforeItStartedNeverConnects) {
  SilentListener listener;
  ASSERT_TRUE(listener.ok());
  auto options = testOptions("client");
  options.handshakeTimeout = std::chrono::seconds(60);
  constexpr int kAttempts = 40;
  int errorsSeen = 0;
  for (int i = 0; i < kAttempts; ++i) {
    detail::TcpTransport client(options);
    auto connection = client.connect(listener.address());
    auto inbox = startWithInbox(connection);
    if (i % 2 == 0) {
      connection->close();
    }
    const auto started = std::chrono::steady_clock::now();
    client.join();
    // Nothing holds the io threads: join() does not wait for a handshake.
    EXPECT_LT(
        std::chrono::steady_clock::now() - started,
        std::chrono::seconds(4));
    errorsSeen += inbox->waitForError() ? 1 : 0;
  }
  EXPECT_EQ(errorsSeen, kAttempts);
  // An io thread that wakes within the microsecond between connect() and
  // close() may start a connection legitimately; that is rare, not the rule.
  EXPECT_LE(listener.drain(std::chrono::milliseconds(200)), kAttempts / 10);
}

// connect() on several threads while join() runs on another: whichever
// phase of the shutdown a connection meets, it fails with an error its user
// sees and join() is not held up. (The narrowest phase, a connection that
// passed close() but is started only after join(), is hit here only by
// chance; TcpConnectionStart covers it directly.)
TEST(TcpTransport, ConnectingWhileTheTransportJoinsLeavesNothingBehind) {
  SilentListener listener;
  ASSERT_TRUE(listener.ok());
  auto options = testOptions("client");
  options.handshakeTimeout = std::chrono::seconds(60);
  constexpr int kRounds = 20;
  // More connecting threads than this machine has cores, so that some are
  // preempted inside connect() while join() runs.
  constexpr int kConnectors = 4;
  constexpr int kMaxConnectsPerThread = 500;
  for (int round = 0; round < kRounds; ++round) {
    detail::TcpTransport client(options);
    std::atomic<bool> joined{false};
    std::vector<std::vector<std::shared_ptr<Connection>>> connections(
        kConnectors);
    std::vector<std::vector<std::shared_ptr<Inbox>>> inboxes(kConnectors);
    std::vector<std::thread> connectors;
    for (int c = 0; c < kConnectors; ++c) {
      connectors.emplace_back([&, c]() {
        while (!joined.load() &&
               int(connections[c].size()) < kMaxConnectsPerThread) {
          connections[c].push_back(client.connect(listener.address()));
          inboxes[c].push_back(startWithInbox(connections[c].back()));
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50 * (round % 8)));
    const auto started = std::chrono::steady_clock::now();
    client.join();
    EXPECT_LT(
        std::chrono::steady_clock::now() - started,
        std::chrono::seconds(4));
    joined.store(true);
    for (auto& connector : connectors) {
      connector.join();
    }
    for (const auto& threadInboxes : inboxes) {
      for (const auto& inbox : threadInboxes) {
        ASSERT_TRUE(inbox->waitForError());
      }
    }
    listener.drain(std::chrono::milliseconds(0));
  }
}

} // namespace
} // namespace rpc
} // namespace torchrpc
