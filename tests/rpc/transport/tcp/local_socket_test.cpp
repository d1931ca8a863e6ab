// The TCP transport's local sockets (Note [Local sockets for peers on this
// host], rpc/transport/tcp/endpoints.h): how an address names one, that
// peers in this network namespace use it, and every case that must go over
// TCP instead. Hostile bytes on it are tests/rpc/transport/tcp/
// hostile_frames_test.cpp's LocalSocket cases.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/endpoints.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;
using detail::tcp::SplitAddress;

const std::string kName = "0123456789abcdef0123456789abcdef";

// What /proc says of this process: "<boot id>.<network namespace inode>".
std::string networkFromProc() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  std::getline(in, bootId);
  struct stat info {};
  EXPECT_EQ(::stat("/proc/self/ns/net", &info), 0);
  return bootId + "." + std::to_string(info.st_ino);
}

TEST(LocalSocketAddress, NamesItsNetworkAndNameAndParsesBack) {
  const std::string network =
      detail::tcp::localNetwork(detail::tcp::localHostIdentity());
  EXPECT_EQ(network, networkFromProc());

  const std::string address =
      detail::tcp::withLocalSocket("tcp://127.0.0.1:4567", network, kName);
  EXPECT_EQ(address, "tcp://127.0.0.1:4567?local=" + network + "." + kName);
  SplitAddress split;
  ASSERT_TRUE(detail::tcp::splitAddress(address, split));
  EXPECT_EQ(split.tcp, "tcp://127.0.0.1:4567");
  EXPECT_EQ(split.network, network);
  EXPECT_EQ(split.name, kName);
  // The port still reads as before, for tools that only want it.
  EXPECT_EQ(portOf(address), 4567);

  ASSERT_TRUE(detail::tcp::splitAddress("tcp://[::1]:80", split));
  EXPECT_EQ(split.tcp, "tcp://[::1]:80");
  EXPECT_FALSE(split.network.has_value());
  EXPECT_FALSE(split.name.has_value());

  const std::string a = detail::tcp::newLocalSocketName();
  const std::string b = detail::tcp::newLocalSocketName();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, b);
}

TEST(LocalSocketAddress, AnythingElseAfterTheSuffixIsRefused) {
  const std::string tcp = "tcp://127.0.0.1:4567?local=";
  for (const std::string& rest : std::vector<std::string>{
           "",
           "0a-1b.12",
           "0a-1b." + kName,
           "0a-1b..12." + kName,
           "0a-1b.12x." + kName,
           "0a-1b.12." + kName.substr(1),
           "0a-1b.12." + kName + "0",
           "0A-1B.12." + kName,
           "0a:1b.12." + kName,
           "0a-1b.12.0123456789ABCDEF0123456789abcdef",
           "0a-1b.123456789012345678901." + kName,
           std::string(65, 'a') + ".12." + kName,
           "0a-1b.12.0123456789abcdef0123456789abcde/"}) {
    SCOPED_TRACE(rest);
    SplitAddress split;
    EXPECT_FALSE(detail::tcp::splitAddress(tcp + rest, split));
  }
  SplitAddress split;
  EXPECT_TRUE(detail::tcp::splitAddress(tcp + "0a-1b.12." + kName, split));
}

// Both ends of a connection.
struct Ends {
  std::shared_ptr<Connection> client;
  Acceptor::Accepted server;
};

// One message each way between a client and a server transport, checked
// exactly; returns both ends, open.
Ends exchange(
    detail::TcpTransport& server,
    Acceptor& acceptor,
    detail::TcpTransport& client,
    const std::string& address) {
  auto connection = client.connect(address);
  auto inbox = startWithInbox(connection);
  const at::Tensor small = at::arange(10, at::kInt);
  // Above the 256 KiB of same-host transfers (they start after the first
  // message each way, Note [TCP same-host zero copy]).
  const at::Tensor big = at::arange(1 << 20, at::kFloat);
  connection->send(makeMessage("ping", {small, big}), nullptr);
  auto accepted = acceptor.waitFor(0);
  EXPECT_NE(accepted.connection, nullptr);
  if (!accepted.connection) {
    return {connection, accepted};
  }
  EXPECT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
  // A copy: messages() returns one.
  const std::vector<Message> received = accepted.inbox->messages();
  if (received.empty()) {
    return {connection, accepted};
  }
  const Message& ping = received[0];
  EXPECT_EQ(ping.header, "ping");
  EXPECT_EQ(ping.tensors.size(), 2u);
  if (ping.tensors.size() == 2) {
    expectReceived(ping.tensors[0], small);
    expectReceived(ping.tensors[1], big);
  }
  accepted.connection->send(makeMessage("pong", {small}), nullptr);
  EXPECT_TRUE(inbox->waitForMessages(1, kTimeout));
  if (!inbox->messages().empty()) {
    EXPECT_EQ(inbox->messages()[0].header, "pong");
  }
  EXPECT_TRUE(inbox->errors().empty());
  EXPECT_TRUE(accepted.inbox->errors().empty());
  return {connection, accepted};
}

TEST(TcpLocalSocket, PeersInOneNetworkNamespaceUseIt) {
  detail::TcpTransport server(testOptions("server"));
  Acceptor acceptor(server);
  detail::TcpTransport client(testOptions("client"));
  const std::string address = server.address();
  EXPECT_NE(
      address.find("?local=" + networkFromProc() + "."),
      std::string::npos)
      << address;

  Ends ends = exchange(server, acceptor, client, address);
  ASSERT_NE(ends.server.connection, nullptr);
  EXPECT_EQ(
      ends.server.connection->describe(),
      "'client' (local peer (pid " + std::to_string(::getpid()) + "))");
  EXPECT_EQ(server.stats().connectionsOpen, 1u);
  EXPECT_EQ(server.stats().localConnectionsOpen, 1u);
  EXPECT_EQ(client.stats().connectionsOpen, 1u);
  EXPECT_EQ(client.stats().localConnectionsOpen, 1u);
}

void expectOverTcp(
    detail::TcpTransport& server,
    Acceptor& acceptor,
    detail::TcpTransport& client,
    const std::string& address) {
  Ends ends = exchange(server, acceptor, client, address);
  ASSERT_NE(ends.server.connection, nullptr);
  EXPECT_EQ(
      ends.server.connection->describe().rfind(
          "'client' (peer at 127.0.0.1:",
          0),
      0u)
      << ends.server.connection->describe();
  EXPECT_EQ(server.stats().connectionsOpen, 1u);
  EXPECT_EQ(server.stats().localConnectionsOpen, 0u);
  EXPECT_EQ(client.stats().connectionsOpen, 1u);
  EXPECT_EQ(client.stats().localConnectionsOpen, 0u);
}

// A server and a client with the default options, and the server's
// address split.
class TcpLocalSocketFallback : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(detail::tcp::splitAddress(server_.address(), split_));
    ASSERT_TRUE(split_.network.has_value());
    ASSERT_TRUE(split_.name.has_value());
  }
  // The server's address with its local socket replaced.
  std::string addressWith(const std::string& network, const std::string& name) {
    return detail::tcp::withLocalSocket(split_.tcp, network, name);
  }

  detail::TcpTransport server_{testOptions("server")};
  Acceptor acceptor_{server_};
  detail::TcpTransport client_{testOptions("client")};
  SplitAddress split_;
};

TEST(TcpLocalSocket, AServerWithoutOneIsReachedOverTcp) {
  detail::TcpTransportOptions options = testOptions("server");
  options.localSockets = false;
  detail::TcpTransport server(options);
  Acceptor acceptor(server);
  detail::TcpTransport client(testOptions("client"));
  EXPECT_EQ(server.address().find("?local="), std::string::npos);
  expectOverTcp(server, acceptor, client, server.address());
}

TEST(TcpLocalSocket, AClientWithoutThemConnectsOverTcp) {
  detail::TcpTransport server(testOptions("server"));
  Acceptor acceptor(server);
  detail::TcpTransportOptions options = testOptions("client");
  options.localSockets = false;
  detail::TcpTransport client(options);
  ASSERT_NE(server.address().find("?local="), std::string::npos);
  expectOverTcp(server, acceptor, client, server.address());
}

// An address from another network namespace (a container, another host
// with the same boot id) names a socket that is not ours to reach.
TEST_F(TcpLocalSocketFallback, AnAddressOfAnotherNamespaceConnectsOverTcp) {
  const std::string& network = *split_.network;
  const uint64_t inode = std::stoull(network.substr(network.find('.') + 1));
  expectOverTcp(
      server_,
      acceptor_,
      client_,
      addressWith(
          network.substr(0, network.find('.')) + "." +
              std::to_string(inode + 1),
          *split_.name));
}

// The local connect fails (no such socket): the connection goes on over
// TCP rather than failing.
TEST_F(TcpLocalSocketFallback, ALocalSocketThatIsGoneFallsBackToTcp) {
  ASSERT_NE(*split_.name, kName);
  expectOverTcp(
      server_,
      acceptor_,
      client_,
      addressWith(*split_.network, kName));
}

// A local socket whose listener takes no more connections (its backlog is
// full: the kernel refuses a non-blocking connect with EAGAIN rather than
// queueing it as TCP would): the connection goes on over TCP.
TEST_F(TcpLocalSocketFallback, AFullLocalSocketFallsBackToTcp) {
  // A listener under our own name that never accepts, its backlog full.
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un where{};
  where.sun_family = AF_UNIX;
  const std::string path = "torchrpc." + kName;
  std::copy(path.begin(), path.end(), where.sun_path + 1);
  const auto length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size());
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&where), length), 0);
  ASSERT_EQ(::listen(listener, 0), 0);
  std::vector<int> queued;
  for (int i = 0; i < 16; ++i) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ASSERT_GE(fd, 0);
    queued.push_back(fd);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&where), length) != 0) {
      ASSERT_EQ(errno, EAGAIN);
      break;
    }
  }
  ASSERT_LT(queued.size(), 16u) << "the backlog never filled";

  expectOverTcp(
      server_,
      acceptor_,
      client_,
      addressWith(*split_.network, kName));
  for (int fd : queued) {
    ::close(fd);
  }
  ::close(listener);
}

TEST(TcpLocalSocket, AMalformedSuffixFailsTheConnectionNamingTheAddress) {
  detail::TcpTransport server(testOptions("server"));
  Acceptor acceptor(server);
  detail::TcpTransport client(testOptions("client"));
  const std::string bad = server.address() + "x";
  auto connection = client.connect(bad);
  auto inbox = startWithInbox(connection);
  ASSERT_TRUE(inbox->waitForError());
  EXPECT_EQ(inbox->errors()[0].code, ErrorCode::kWorkerUnavailable);
  EXPECT_NE(inbox->errors()[0].detail.find("'" + bad + "'"), std::string::npos)
      << inbox->errors()[0].detail;
  EXPECT_EQ(acceptor.count(), 0u);
}

// The name goes with the transport: once it closed, nobody answers there.
TEST(TcpLocalSocket, ClosingTheTransportReleasesIt) {
  auto server = std::make_unique<detail::TcpTransport>(testOptions("server"));
  Acceptor acceptor(*server);
  const RawTarget local{0, localSocketOf(server->address())};
  ASSERT_FALSE(local.localSocket.empty());
  EXPECT_TRUE(RawPeer(local).connected());
  server->close();
  server->join();
  EXPECT_FALSE(RawPeer(local).connected());
}

} // namespace
} // namespace rpc
} // namespace torchrpc
