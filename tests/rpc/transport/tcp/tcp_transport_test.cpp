// What the TCP transport promises beyond the Transport contract (which
// tests/rpc/transport_test.cpp covers for every backend): its addresses,
// frames at the edges of the format, and order with several io threads.

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

} // namespace
} // namespace rpc
} // namespace torchrpc
