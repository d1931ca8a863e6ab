// What only the TCP transport promises (see Note [TCP transport wire format]
// in rpc/transport/tcp/tcp_transport.h): a listener that survives hostile peers,
// shared-secret authentication, heartbeats that detect stopped and killed
// peers, and a micro-measurement against TensorPipe. The conformance suite
// in transport_test.cpp covers the Transport contract itself.

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/tensorpipe/tensorpipe_transport.h"
#include "torchrpc/rpc/transport/transport.h"
#include "tests/support/transport_harness.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using namespace harness;

constexpr auto kHandshakeTimeout = 300ms;

detail::TcpTransportOptions testOptions(std::string name) {
  detail::TcpTransportOptions options;
  options.name = std::move(name);
  options.handshakeTimeout = kHandshakeTimeout;
  return options;
}

int portOf(const std::string& address) {
  return std::stoi(address.substr(address.rfind(':') + 1));
}

// ---- Raw peers ----

// A plain TCP client to 127.0.0.1, closed on destruction.
class RawPeer {
 public:
  explicit RawPeer(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in peer{};
    peer.sin_family = AF_INET;
    peer.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, "127.0.0.1", &peer.sin_addr);
    connected_ = fd_ >= 0 &&
        ::connect(fd_, reinterpret_cast<sockaddr*>(&peer), sizeof(peer)) == 0;
  }
  ~RawPeer() {
    close();
  }

  bool connected() const {
    return connected_;
  }

  bool write(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n =
          ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) {
        return false;
      }
      done += static_cast<size_t>(n);
    }
    return true;
  }

  // Reads exactly `count` bytes, or returns what came before EOF/timeout.
  std::string read(size_t count, std::chrono::milliseconds timeout = kTimeout) {
    std::string out;
    auto deadline = Clock::now() + timeout;
    while (out.size() < count) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now());
      pollfd p{fd_, POLLIN, 0};
      if (left.count() <= 0 ||
          ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
        break;
      }
      char buffer[4096];
      ssize_t n =
          ::recv(fd_, buffer, std::min(sizeof(buffer), count - out.size()), 0);
      if (n <= 0) {
        break;
      }
      out.append(buffer, static_cast<size_t>(n));
    }
    return out;
  }

  // True once the server closed its end (EOF or reset) within `timeout`.
  bool waitClosedByServer(std::chrono::milliseconds timeout = kTimeout) {
    auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now());
      if (::poll(&p, 1, std::max<int>(1, static_cast<int>(left.count()))) <=
          0) {
        continue;
      }
      char buffer[4096];
      ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n <= 0) {
        return true;
      }
    }
    return false;
  }

  void close() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

// Frames as Note [TCP transport wire format] describes them.
void putLe(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
}

std::string rawFrameHeader(uint8_t type, uint32_t body, uint32_t count) {
  std::string out = "TRPC";
  out.push_back(1); // version
  out.push_back(static_cast<char>(type));
  putLe(out, 0, 2);
  putLe(out, body, 4);
  putLe(out, count, 4);
  return out;
}

constexpr uint8_t kHello = 1;
constexpr uint8_t kData = 4;

std::string rawHello(const std::string& name, bool auth) {
  std::string body(1, auth ? '\1' : '\0');
  if (auth) {
    body += std::string(32, 'n');
  }
  putLe(body, name.size(), 2);
  body += name;
  return rawFrameHeader(kHello, static_cast<uint32_t>(body.size()), 0) + body;
}

std::string randomBytes(size_t count, uint32_t seed) {
  std::mt19937 random(seed);
  std::string out(count, '\0');
  for (char& c : out) {
    c = static_cast<char>(random());
  }
  return out;
}

// ---- Hostile peers ----

// A listening server with one legitimate connection already open; after
// each hostile act, that connection and a brand-new one must still work.
class TcpHostilePeerTest : public testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<detail::TcpTransport>(serverOptions());
    client_ = std::make_unique<detail::TcpTransport>(clientOptions());
    acceptor_ = std::make_unique<Acceptor>(*server_);
    port_ = portOf(server_->address());
    established_ = client_->connect(server_->address());
    establishedInbox_ = startWithInbox(established_);
    established_->send(makeMessage("first"), [](const TransportError*) {});
    accepted_ = acceptor_->waitFor(0);
    ASSERT_NE(accepted_.connection, nullptr);
    ASSERT_TRUE(accepted_.inbox->waitForMessages(1, kTimeout));
  }

  virtual detail::TcpTransportOptions serverOptions() {
    return testOptions("server");
  }
  virtual detail::TcpTransportOptions clientOptions() {
    return testOptions("client");
  }

  void expectListenerHealthy() {
    // The established connection, both ways.
    size_t before = accepted_.inbox->messages().size();
    established_->send(
        makeMessage("still there", {at::arange(10)}),
        [](const TransportError*) {});
    ASSERT_TRUE(accepted_.inbox->waitForMessages(before + 1, kTimeout));
    EXPECT_EQ(accepted_.inbox->messages().back().header, "still there");
    size_t back = establishedInbox_->messages().size();
    accepted_.connection->send(makeMessage("pong"), [](const TransportError*) {
    });
    ASSERT_TRUE(establishedInbox_->waitForMessages(back + 1, kTimeout));
    EXPECT_TRUE(accepted_.inbox->errors().empty());
    EXPECT_TRUE(establishedInbox_->errors().empty());

    // A brand-new connection.
    size_t index = acceptor_->count();
    auto fresh = client_->connect(server_->address());
    auto freshInbox = startWithInbox(fresh);
    fresh->send(makeMessage("fresh"), [](const TransportError*) {});
    auto accepted = acceptor_->waitFor(index);
    ASSERT_NE(accepted.connection, nullptr);
    ASSERT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
    EXPECT_EQ(accepted.inbox->messages()[0].header, "fresh");
    EXPECT_TRUE(freshInbox->errors().empty());
  }

  std::unique_ptr<detail::TcpTransport> server_;
  std::unique_ptr<detail::TcpTransport> client_;
  std::unique_ptr<Acceptor> acceptor_;
  int port_ = 0;
  std::shared_ptr<Connection> established_;
  std::shared_ptr<Inbox> establishedInbox_;
  Acceptor::Accepted accepted_;
};

TEST_F(TcpHostilePeerTest, RandomBytesAreDropped) {
  RawPeer peer(port_);
  ASSERT_TRUE(peer.connected());
  peer.write(randomBytes(1024, 1));
  EXPECT_TRUE(peer.waitClosedByServer());
  expectListenerHealthy();
}

TEST_F(TcpHostilePeerTest, ValidHeaderWithGarbageBodyIsDropped) {
  RawPeer peer(port_);
  ASSERT_TRUE(peer.connected());
  peer.write(rawFrameHeader(kHello, 100, 0) + randomBytes(100, 2));
  EXPECT_TRUE(peer.waitClosedByServer());
  expectListenerHealthy();
}

TEST_F(TcpHostilePeerTest, HugeLengthsAreRefusedBeforeAllocating) {
  for (uint32_t count : {0u, 0xffffffffu}) {
    RawPeer peer(port_);
    ASSERT_TRUE(peer.connected());
    peer.write(rawFrameHeader(kHello, 0xffffffffu, count));
    EXPECT_TRUE(peer.waitClosedByServer());
  }
  expectListenerHealthy();
}

TEST_F(TcpHostilePeerTest, TruncatedHandshakeHeldOpenIsDroppedAtTheDeadline) {
  RawPeer peer(port_);
  ASSERT_TRUE(peer.connected());
  peer.write(rawHello("slow", false).substr(0, 10));
  auto start = Clock::now();
  // While it hangs, everyone else is served.
  expectListenerHealthy();
  EXPECT_TRUE(peer.waitClosedByServer(kHandshakeTimeout + 2s));
  EXPECT_GE(Clock::now() - start, kHandshakeTimeout - 50ms);
  expectListenerHealthy();
}

TEST_F(TcpHostilePeerTest, ConnectThenCloseOnce) {
  {
    RawPeer peer(port_);
    ASSERT_TRUE(peer.connected());
  }
  expectListenerHealthy();
}

TEST_F(TcpHostilePeerTest, FiftyConnectThenCloseInARow) {
  for (int i = 0; i < 50; ++i) {
    RawPeer peer(port_);
    ASSERT_TRUE(peer.connected());
  }
  expectListenerHealthy();
}

TEST_F(TcpHostilePeerTest, ManyHalfOpenConnectionsEvictTheOldest) {
  // More silent peers than the transport keeps in their handshake.
  std::vector<std::unique_ptr<RawPeer>> peers;
  for (int i = 0; i < 100; ++i) {
    peers.push_back(std::make_unique<RawPeer>(port_));
    ASSERT_TRUE(peers.back()->connected());
  }
  expectListenerHealthy();
  EXPECT_TRUE(peers.front()->waitClosedByServer(1s));
}

TEST_F(TcpHostilePeerTest, BadDataFramesFailOnlyTheirConnection) {
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
    RawPeer peer(port_);
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

class TcpSecretTest : public TcpHostilePeerTest {
 protected:
  detail::TcpTransportOptions serverOptions() override {
    auto options = testOptions("server");
    options.sharedSecret = "correct horse battery staple";
    return options;
  }
  detail::TcpTransportOptions clientOptions() override {
    return serverOptions();
  }

  // A client with `secret` must fail with kWorkerUnavailable and never be
  // handed to the server's onAccept.
  void expectRefused(const std::string& secret) {
    auto options = testOptions("intruder");
    options.sharedSecret = secret;
    detail::TcpTransport intruder(options);
    size_t before = acceptor_->count();
    auto connection = intruder.connect(server_->address());
    auto inbox = startWithInbox(connection);
    std::atomic<int> sendErrors{0};
    connection->send(makeMessage("let me in"), [&](const TransportError* e) {
      if (e != nullptr) {
        ++sendErrors;
      }
    });
    ASSERT_TRUE(inbox->waitForError());
    EXPECT_EQ(inbox->errors()[0].code, ErrorCode::kWorkerUnavailable);
    EXPECT_TRUE(inbox->messages().empty());
    intruder.close();
    intruder.join();
    EXPECT_EQ(sendErrors.load(), 1);
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(acceptor_->count(), before);
  }
};

TEST_F(TcpSecretTest, WrongSecretIsRefused) {
  expectRefused("wrong");
  expectListenerHealthy();
}

TEST_F(TcpSecretTest, MissingSecretIsRefused) {
  expectRefused("");
  expectListenerHealthy();
}

TEST_F(TcpSecretTest, CorrectSecretIsAccepted) {
  // SetUp's connection used it already; and a fresh one.
  expectListenerHealthy();
}

TEST_F(TcpSecretTest, DataBeforeTheProofIsDropped) {
  RawPeer peer(port_);
  ASSERT_TRUE(peer.connected());
  ASSERT_TRUE(peer.write(rawHello("raw", true)));
  std::string welcome = peer.read(16);
  ASSERT_EQ(welcome.size(), 16u);
  size_t before = acceptor_->count();
  // Skip the proof and go straight to data.
  peer.write(rawFrameHeader(kData, 5, 0) + "hello");
  EXPECT_TRUE(peer.waitClosedByServer());
  EXPECT_EQ(acceptor_->count(), before);
  expectListenerHealthy();
}

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

// ---- Peers in other processes ----

// A TcpTransport or TensorPipeTransport echo server in a forked child. The
// child echoes each message back, except "ack" messages, answered with an
// empty one. Killed (and reaped) by the destructor on every path.
class ChildServer {
 public:
  enum class Kind { kTcp, kTensorPipe };

  ChildServer(Kind kind, detail::TcpTransportOptions tcpOptions) {
    int fds[2];
    if (::pipe(fds) != 0) {
      return;
    }
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(fds[0]);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::alarm(120); // never outlive a stuck test
      runChild(kind, tcpOptions, fds[1]);
      ::_exit(0);
    }
    ::close(fds[1]);
    char buffer[256];
    std::string address;
    pollfd p{fds[0], POLLIN, 0};
    auto deadline = Clock::now() + kTimeout;
    while (address.find('\n') == std::string::npos && Clock::now() < deadline) {
      if (::poll(&p, 1, 100) <= 0) {
        continue;
      }
      ssize_t n = ::read(fds[0], buffer, sizeof(buffer));
      if (n <= 0) {
        break;
      }
      address.append(buffer, static_cast<size_t>(n));
    }
    ::close(fds[0]);
    if (address.find('\n') != std::string::npos) {
      address_ = address.substr(0, address.find('\n'));
    }
  }

  ~ChildServer() {
    kill(SIGKILL);
    reap();
  }

  const std::string& address() const {
    return address_;
  }
  pid_t pid() const {
    return pid_;
  }

  void kill(int signal) {
    if (pid_ > 0) {
      ::kill(pid_, signal);
    }
  }

  void reap() {
    if (pid_ > 0) {
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
    }
  }

 private:
  static void runChild(
      Kind kind,
      const detail::TcpTransportOptions& tcpOptions,
      int addressFd) {
    std::unique_ptr<Transport> transport;
    if (kind == Kind::kTcp) {
      transport = std::make_unique<detail::TcpTransport>(tcpOptions);
    } else {
      transport = std::make_unique<detail::TensorPipeTransport>(
          detail::TensorPipeTransportOptions{});
    }
    auto keep = std::make_shared<std::vector<std::shared_ptr<Connection>>>();
    auto mutex = std::make_shared<std::mutex>();
    transport->listen([keep, mutex](std::shared_ptr<Connection> connection) {
      std::weak_ptr<Connection> weak = connection;
      connection->start(
          [weak](Message&& message) {
            auto self = weak.lock();
            if (!self) {
              return;
            }
            if (message.header == "ack") {
              self->send(makeMessage("acked"), [](const TransportError*) {});
            } else {
              self->send(std::move(message), [](const TransportError*) {});
            }
          },
          [](const TransportError&) {});
      std::lock_guard<std::mutex> lock(*mutex);
      keep->push_back(std::move(connection));
    });
    std::string line = transport->address() + "\n";
    if (::write(addressFd, line.data(), line.size()) < 0) {
      return;
    }
    ::close(addressFd);
    while (true) {
      ::pause();
    }
  }

  pid_t pid_ = -1;
  std::string address_;
};

detail::TcpTransportOptions fastLiveness(std::string name) {
  auto options = testOptions(std::move(name));
  options.heartbeatInterval = 200ms;
  options.peerTimeout = 800ms;
  return options;
}

// Connects and checks one echo; returns the connection's inbox.
std::shared_ptr<Inbox> connectAndEcho(
    Transport& client,
    const std::string& address,
    std::shared_ptr<Connection>& connection) {
  connection = client.connect(address);
  auto inbox = startWithInbox(connection);
  connection->send(makeMessage("hello"), [](const TransportError*) {});
  EXPECT_TRUE(inbox->waitForMessages(1, kTimeout));
  return inbox;
}

// ---- Same-host zero copy (process_vm_readv) ----

constexpr size_t kZeroCopyMin = size_t(256) << 10;

// Distinct bytes per tensor, so a swapped or shifted tensor shows.
at::Tensor patterned(size_t nbytes, int seed) {
  auto tensor = at::empty({static_cast<int64_t>(nbytes)}, at::kByte);
  auto* data = tensor.data_ptr<uint8_t>();
  for (size_t i = 0; i < nbytes; ++i) {
    data[i] = static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
  }
  return tensor;
}

bool sameBytes(const at::Tensor& got, const at::Tensor& want) {
  return got.nbytes() == want.nbytes() &&
      std::memcmp(got.data_ptr(), want.data_ptr(), want.nbytes()) == 0;
}

std::vector<size_t> zeroCopySizes() {
  return {
      kZeroCopyMin - 1,
      kZeroCopyMin,
      kZeroCopyMin + 1,
      size_t(1) << 20,
      size_t(4) << 20,
      size_t(64) << 20};
}

// Each message mixes small and large tensors; the sender keeps only a
// clone, so the transport alone keeps the sent tensors alive until acked.
void sendMixed(Connection& connection, std::vector<Message>& expected) {
  int seed = 0;
  for (size_t size : zeroCopySizes()) {
    std::vector<at::Tensor> tensors = {
        patterned(100, ++seed),
        patterned(size, ++seed),
        patterned(3, ++seed)};
    Message want = makeMessage("m" + std::to_string(seed));
    for (const at::Tensor& tensor : tensors) {
      want.tensors.push_back(tensor.clone());
    }
    expected.push_back(std::move(want));
    connection.send(
        makeMessage("m" + std::to_string(seed), std::move(tensors)),
        [](const TransportError* error) { EXPECT_EQ(error, nullptr); });
    // A small message between large ones must keep its place.
    expected.push_back(makeMessage("small" + std::to_string(seed)));
    connection.send(
        makeMessage("small" + std::to_string(seed)),
        [](const TransportError*) {});
  }
}

void expectMessages(Inbox& inbox, const std::vector<Message>& expected) {
  ASSERT_TRUE(inbox.waitForMessages(expected.size(), kTimeout));
  auto got = inbox.messages();
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(got[i].header, expected[i].header);
    ASSERT_EQ(got[i].tensors.size(), expected[i].tensors.size());
    for (size_t t = 0; t < expected[i].tensors.size(); ++t) {
      EXPECT_TRUE(sameBytes(got[i].tensors[t], expected[i].tensors[t]))
          << "message " << i << " tensor " << t;
    }
  }
  EXPECT_TRUE(inbox.errors().empty());
}

TEST(TcpZeroCopy, LargeTensorsArriveByteExactWithinAProcess) {
  detail::TcpTransport server(testOptions("server"));
  detail::TcpTransport client(testOptions("client"));
  Acceptor acceptor(server);
  auto connection = client.connect(server.address());
  auto clientInbox = startWithInbox(connection);
  // One round trip first, so the zero-copy probe has completed.
  connection->send(makeMessage("hello"), [](const TransportError*) {});
  auto accepted = acceptor.waitFor(0);
  ASSERT_TRUE(accepted.connection);
  ASSERT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
  accepted.connection->send(makeMessage("hi"), [](const TransportError*) {});
  ASSERT_TRUE(clientInbox->waitForMessages(1, kTimeout));

  std::vector<Message> expected = {makeMessage("hello")};
  sendMixed(*connection, expected);
  expectMessages(*accepted.inbox, expected);
  // And the other way.
  std::vector<Message> back = {makeMessage("hi")};
  sendMixed(*accepted.connection, back);
  expectMessages(*clientInbox, back);
}

TEST(TcpZeroCopy, LargeTensorsRoundTripByteExactBetweenProcesses) {
  ChildServer child(ChildServer::Kind::kTcp, testOptions("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(testOptions("client"));
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  // The child echoes: each large tensor crosses twice, by address.
  std::vector<Message> expected = {makeMessage("hello")};
  sendMixed(*connection, expected);
  expectMessages(*inbox, expected);
}

TEST(TcpZeroCopy, DisabledZeroCopyStillCarriesTheBytes) {
  auto options = testOptions("client");
  options.sameHostZeroCopy = false;
  ChildServer child(ChildServer::Kind::kTcp, testOptions("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(options);
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  std::vector<Message> expected = {makeMessage("hello")};
  sendMixed(*connection, expected);
  expectMessages(*inbox, expected);
}

TEST(TcpZeroCopy, PeerDyingMidTransferFailsTheConnection) {
  ChildServer child(ChildServer::Kind::kTcp, testOptions("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(testOptions("client"));
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  for (int i = 0; i < 4; ++i) {
    connection->send(
        makeMessage("big", {patterned(size_t(64) << 20, i)}),
        [](const TransportError*) {});
  }
  child.kill(SIGKILL);
  child.reap();
  auto start = Clock::now();
  EXPECT_TRUE(inbox->waitForError(kTimeout));
  EXPECT_LT(Clock::now() - start, kTimeout);
  auto errors = inbox->errors();
  ASSERT_FALSE(errors.empty());
  EXPECT_EQ(errors[0].code, ErrorCode::kWorkerUnavailable);
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

// ---- Polling after traffic (Note [Polling after traffic]) ----
//
// A polling io thread is always running or runnable (state R in
// /proc/self/task/*/stat), a sleeping one is not; unlike CPU time, that
// holds on a loaded machine too, where a thread that yields gets little.

// For each sample taken every 2 ms over `window`: how many threads of this
// process other than the calling one were in state R.
std::vector<int> runnableOtherThreadsOver(std::chrono::milliseconds window) {
  const std::string self = std::to_string(::syscall(SYS_gettid));
  std::vector<int> samples;
  auto end = Clock::now() + window;
  while (Clock::now() < end) {
    int runnable = 0;
    for (const auto& task :
         std::filesystem::directory_iterator("/proc/self/task")) {
      if (task.path().filename() == self) {
        continue;
      }
      std::ifstream stat(task.path() / "stat");
      std::string content((std::istreambuf_iterator<char>(stat)), {});
      auto close = content.rfind(')');
      if (close != std::string::npos && close + 2 < content.size() &&
          content[close + 2] == 'R') {
        ++runnable;
      }
    }
    samples.push_back(runnable);
    std::this_thread::sleep_for(2ms);
  }
  return samples;
}

// The share of samples with at least `threads` other threads in state R.
double shareWithRunnable(const std::vector<int>& samples, int threads) {
  if (samples.empty()) {
    return 0;
  }
  auto count = std::count_if(samples.begin(), samples.end(), [&](int n) {
    return n >= threads;
  });
  return static_cast<double>(count) / samples.size();
}

double pollingShareOver(std::chrono::milliseconds window) {
  return shareWithRunnable(runnableOtherThreadsOver(window), 1);
}

detail::TcpTransportOptions quietOptions(std::string name) {
  auto options = testOptions(std::move(name));
  options.heartbeatInterval = 10s; // no frames but ours
  options.peerTimeout = 30s;
  return options;
}

TEST(TcpTransportPolling, PollsAfterTrafficThenSleeps) {
  auto options = quietOptions("server");
  options.pollAfterTraffic = 400ms;
  detail::TcpTransport server(options);
  detail::TcpTransport client(quietOptions("client")); // never polls
  Acceptor acceptor(server);
  auto connection = client.connect(server.address());
  startWithInbox(connection);
  auto accepted = acceptor.waitFor(0);
  ASSERT_NE(accepted.connection, nullptr);
  // The handshake is not traffic.
  EXPECT_LT(pollingShareOver(200ms), 0.2) << "after the handshake";

  auto received = Clock::now();
  connection->send(makeMessage("x"), [](const TransportError*) {});
  ASSERT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
  EXPECT_GT(pollingShareOver(200ms), 0.8) << "within the window";
  std::this_thread::sleep_until(received + 500ms); // past the window
  EXPECT_LT(pollingShareOver(300ms), 0.2) << "after the window";
  EXPECT_TRUE(accepted.inbox->errors().empty());
}

TEST(TcpTransportPolling, PollsWhileRepliesAreDueAndNotOtherwise) {
  auto options = quietOptions("client");
  options.pollWhileAwaiting = 1s;
  detail::TcpTransport client(options);
  auto awaited = std::make_shared<std::atomic<int64_t>>(0);
  client.watchAwaitedReplies(awaited);
  EXPECT_THROW(client.watchAwaitedReplies(awaited), c10::Error);
  detail::TcpTransport server(quietOptions("server"));
  Acceptor acceptor(server);
  auto connection = client.connect(server.address());
  startWithInbox(connection);
  auto accepted = acceptor.waitFor(0);
  ASSERT_NE(accepted.connection, nullptr);

  // Traffic, but nothing awaited: the client sleeps.
  connection->send(makeMessage("a"), [](const TransportError*) {});
  ASSERT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
  EXPECT_LT(pollingShareOver(200ms), 0.2) << "with no reply due";

  // A reply due: it polls, and stops as soon as nothing is due any more.
  awaited->store(1);
  auto sent = Clock::now();
  connection->send(makeMessage("b"), [](const TransportError*) {});
  ASSERT_TRUE(accepted.inbox->waitForMessages(2, kTimeout));
  EXPECT_GT(pollingShareOver(200ms), 0.8) << "while a reply is due";
  awaited->store(0);
  std::this_thread::sleep_for(20ms);
  EXPECT_LT(pollingShareOver(200ms), 0.2) << "once nothing is due";

  // Still due, but the window since the last message has passed.
  awaited->store(1);
  std::this_thread::sleep_until(sent + 1100ms);
  EXPECT_LT(pollingShareOver(200ms), 0.2) << "after the window";
  awaited->store(0);
}

TEST(TcpTransportPolling, OneIoThreadPerProcessPollsAtATime) {
  auto options = quietOptions("a");
  options.pollAfterTraffic = 1s;
  detail::TcpTransport a(options);
  options.name = "b";
  detail::TcpTransport b(options);
  Acceptor acceptor(b);
  auto connection = a.connect(b.address());
  startWithInbox(connection);
  auto accepted = acceptor.waitFor(0);
  ASSERT_NE(accepted.connection, nullptr);
  // Traffic on both transports: each would poll on its own.
  connection->send(makeMessage("x"), [](const TransportError*) {});
  ASSERT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
  auto samples = runnableOtherThreadsOver(200ms);
  EXPECT_GT(shareWithRunnable(samples, 1), 0.8) << "no io thread polls";
  EXPECT_LT(shareWithRunnable(samples, 2), 0.2) << "both io threads poll";
}

// ---- Micro-measurement (prints, asserts nothing about speed) ----

double cpuSecondsOf(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), {});
  // Fields after the command name (which may contain spaces).
  std::istringstream rest(content.substr(content.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) { // utime, stime
      ticks += std::stod(field);
    }
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

struct Measurement {
  double rttMedianUs = 0;
  double rttP90Us = 0;
  double bigMs = 0;
  double idleCores = 0;
  double idleChildCores = 0;
};

Measurement measure(ChildServer::Kind kind) {
  Measurement result;
  ChildServer child(kind, testOptions("child"));
  EXPECT_FALSE(child.address().empty());
  if (child.address().empty()) {
    return result;
  }
  std::unique_ptr<Transport> client;
  if (kind == ChildServer::Kind::kTcp) {
    client = std::make_unique<detail::TcpTransport>(testOptions("client"));
  } else {
    client = std::make_unique<detail::TensorPipeTransport>(
        detail::TensorPipeTransportOptions{});
  }
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(*client, child.address(), connection);

  // Small round trips: the caller waits as rpcSync does.
  at::Tensor small = at::arange(4, at::kFloat);
  std::vector<double> samples;
  size_t expected = 1;
  for (int i = 0; i < 3000; ++i) {
    auto start = Clock::now();
    connection->send(
        makeMessage(std::string(64, 'r'), {small}),
        [](const TransportError*) {});
    if (!inbox->waitForMessages(++expected, kTimeout)) {
      ADD_FAILURE() << "round trip " << i << " timed out";
      return result;
    }
    if (i >= 500) { // warm-up
      samples.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - start)
              .count());
    }
  }
  std::sort(samples.begin(), samples.end());
  result.rttMedianUs = samples[samples.size() / 2];
  result.rttP90Us = samples[samples.size() * 9 / 10];

  // 64 MiB one way, acknowledged by a small message; best of 5.
  at::Tensor big = at::ones({64 << 20}, at::kByte);
  result.bigMs = 1e9;
  for (int i = 0; i < 5; ++i) {
    auto start = Clock::now();
    connection->send(makeMessage("ack", {big}), [](const TransportError*) {});
    if (!inbox->waitForMessages(++expected, kTimeout)) {
      ADD_FAILURE() << "64 MiB transfer timed out";
      return result;
    }
    result.bigMs = std::min(
        result.bigMs,
        std::chrono::duration<double, std::milli>(Clock::now() - start)
            .count());
  }

  // Idle CPU of a connected pair.
  constexpr auto kIdle = 3s;
  double selfBefore = cpuSecondsOf(::getpid());
  double childBefore = cpuSecondsOf(child.pid());
  std::this_thread::sleep_for(kIdle);
  double seconds = std::chrono::duration<double>(kIdle).count();
  result.idleCores = (cpuSecondsOf(::getpid()) - selfBefore) / seconds;
  result.idleChildCores = (cpuSecondsOf(child.pid()) - childBefore) / seconds;
  EXPECT_TRUE(inbox->errors().empty());
  return result;
}

TEST(TcpTransportMeasurement, RoundTripBandwidthAndIdleCpuVsTensorPipe) {
  for (auto kind : {ChildServer::Kind::kTcp, ChildServer::Kind::kTensorPipe}) {
    Measurement m = measure(kind);
    std::cout << "[ measured ] "
              << (kind == ChildServer::Kind::kTcp ? "TcpTransport       "
                                                  : "TensorPipeTransport")
              << "  small RTT median " << m.rttMedianUs << " us, p90 "
              << m.rttP90Us << " us;  64 MiB one-way " << m.bigMs << " ms ("
              << (64.0 / 1024) / (m.bigMs / 1000) << " GiB/s);  idle cores "
              << m.idleCores << " (client) " << m.idleChildCores << " (server)"
              << std::endl;
    if (kind == ChildServer::Kind::kTcp) {
      // Heartbeats only: an idle pair must use (almost) nothing.
      EXPECT_LT(m.idleCores + m.idleChildCores, 0.02);
    }
  }
}

} // namespace
} // namespace rpc
} // namespace torchrpc
