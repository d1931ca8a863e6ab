#pragma once

// Harness for the TCP transport's tests (tests/rpc/transport/tcp/): raw
// peers that speak bytes, a listener that never answers, hand-written
// frames, a listener fixture with one legitimate connection, and an echo
// server in a forked child. The bench
// (bench/transport_microbench.cpp) uses the child server too.

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/tensorpipe/tensorpipe_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace harness {

using Clock = std::chrono::steady_clock;

constexpr auto kHandshakeTimeout = 300ms;

inline detail::TcpTransportOptions testOptions(std::string name) {
  detail::TcpTransportOptions options;
  options.name = std::move(name);
  options.handshakeTimeout = kHandshakeTimeout;
  return options;
}

inline int portOf(const std::string& address) {
  return std::stoi(address.substr(address.rfind(':') + 1));
}

// ---- Raw peers ----

// The local socket a TcpTransport's address names (Note [Local sockets for
// peers on this host]): the name after the address's last '.', empty if
// it names none.
inline std::string localSocketOf(const std::string& address) {
  if (address.find("?local=") == std::string::npos) {
    return "";
  }
  return address.substr(address.rfind('.') + 1);
}

// Where a raw peer connects: a TCP port of 127.0.0.1, or a local socket by
// name (localSocketOf).
struct RawTarget {
  int port = 0;
  std::string localSocket;
};

// A plain client of 127.0.0.1's TCP port or of a local socket, closed on
// destruction.
class RawPeer {
 public:
  explicit RawPeer(int port) : RawPeer(RawTarget{port, ""}) {}
  explicit RawPeer(const RawTarget& target) {
    if (!target.localSocket.empty()) {
      fd_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un peer{};
      peer.sun_family = AF_UNIX;
      // Abstract: a NUL, then the name, and no terminator.
      const std::string path = "torchrpc." + target.localSocket;
      std::copy(path.begin(), path.end(), peer.sun_path + 1);
      const auto length = static_cast<socklen_t>(
          offsetof(sockaddr_un, sun_path) + 1 + path.size());
      connected_ = fd_ >= 0 &&
          ::connect(fd_, reinterpret_cast<sockaddr*>(&peer), length) == 0;
      return;
    }
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in peer{};
    peer.sin_family = AF_INET;
    peer.sin_port = htons(static_cast<uint16_t>(target.port));
    ::inet_pton(AF_INET, "127.0.0.1", &peer.sin_addr);
    connected_ = fd_ >= 0 &&
        ::connect(fd_, reinterpret_cast<sockaddr*>(&peer), sizeof(peer)) == 0;
  }
  RawPeer(const RawPeer&) = delete;
  RawPeer& operator=(const RawPeer&) = delete;
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

// Frames as Note [TCP transport wire format] (rpc/transport/tcp/frame.h)
// describes them, written by hand so that the tests do not trust the
// transport's own encoder.
inline void putLe(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
}

inline std::string rawFrameHeader(uint8_t type, uint32_t body, uint32_t count) {
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

inline std::string rawHello(const std::string& name, bool auth) {
  std::string body(1, auth ? '\1' : '\0');
  if (auth) {
    body += std::string(32, 'n');
  }
  putLe(body, name.size(), 2);
  body += name;
  return rawFrameHeader(kHello, static_cast<uint32_t>(body.size()), 0) + body;
}

inline std::string randomBytes(size_t count, uint32_t seed) {
  std::mt19937 random(seed);
  std::string out(count, '\0');
  for (char& c : out) {
    c = static_cast<char>(random());
  }
  return out;
}

// A listening socket on loopback that never answers: counts the
// connections that reached it.
class SilentListener {
 public:
  SilentListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    ::inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
    socklen_t length = sizeof(address);
    ok_ = fd_ >= 0 &&
        ::bind(fd_, reinterpret_cast<sockaddr*>(&address), length) == 0 &&
        ::listen(fd_, 512) == 0 &&
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) == 0;
    port_ = ntohs(address.sin_port);
  }
  ~SilentListener() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }
  bool ok() const {
    return ok_;
  }
  int port() const {
    return port_;
  }
  std::string address() const {
    return "tcp://127.0.0.1:" + std::to_string(port_);
  }
  // Accepts (and closes) what is queued, waiting up to `wait` for the
  // first; returns how many there were.
  int drain(std::chrono::milliseconds wait) {
    int count = 0;
    for (int i = 0; i < 10000; ++i) {
      pollfd ready{fd_, POLLIN, 0};
      if (::poll(&ready, 1, count == 0 ? int(wait.count()) : 0) <= 0) {
        break;
      }
      int accepted = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (accepted < 0) {
        break;
      }
      ::close(accepted);
      ++count;
    }
    return count;
  }

 private:
  int fd_ = -1;
  int port_ = 0;
  bool ok_ = false;
};

// ---- A listener under attack ----

// A listening server with one legitimate connection already open; after
// each hostile act, that connection and a brand-new one must still work.
class TcpListenerFixture : public ::testing::Test {
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

// ---- Peers in other processes ----

// Reads what `fd` holds until `marker` arrives, the writer closes it or
// `timeout` passes.
inline std::string readUntil(
    int fd,
    const std::string& marker,
    std::chrono::milliseconds timeout) {
  std::string out;
  char buffer[4096];
  const auto deadline = Clock::now() + timeout;
  while (out.find(marker) == std::string::npos && Clock::now() < deadline) {
    pollfd ready{fd, POLLIN, 0};
    if (::poll(&ready, 1, 50) <= 0) {
      continue;
    }
    ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n <= 0) {
      break;
    }
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

// A connected pair of TCP transports in this process, after `exchanges`
// messages each way ("hello" from the client, "hi" back), so that what a
// connection settles after its handshake (same-host zero copy, shared
// memory, shared rings) has settled.
struct ConnectedPair {
  explicit ConnectedPair(
      detail::TcpTransportOptions serverOptions = testOptions("server"),
      detail::TcpTransportOptions clientOptions = testOptions("client"),
      size_t exchanges = 1)
      : server(std::move(serverOptions)),
        client(std::move(clientOptions)),
        acceptor(server) {
    connection = client.connect(server.address());
    clientInbox = startWithInbox(connection);
    for (size_t i = 1; i <= exchanges; ++i) {
      connection->send(makeMessage("hello"), [](const TransportError*) {});
      if (i == 1) {
        accepted = acceptor.waitFor(0);
        EXPECT_TRUE(accepted.connection);
        if (!accepted.connection) {
          return;
        }
      }
      EXPECT_TRUE(accepted.inbox->waitForMessages(i, kTimeout));
      accepted.connection->send(makeMessage("hi"), [](const TransportError*) {
      });
      EXPECT_TRUE(clientInbox->waitForMessages(i, kTimeout));
    }
  }

  detail::TcpTransport server;
  detail::TcpTransport client;
  Acceptor acceptor;
  std::shared_ptr<Connection> connection;
  std::shared_ptr<Inbox> clientInbox;
  Acceptor::Accepted accepted;
};

// A TcpTransport or TensorPipeTransport echo server in a forked child. The
// child echoes each message back, except "ack" messages, answered with an
// empty one. `beforeReady`, if given, runs in the child once it listens and
// before the constructor returns (e.g. to take the child's descriptors
// away). Killed (and reaped) by the destructor on every path.
class ChildServer {
 public:
  enum class Kind { kTcp, kTensorPipe };

  ChildServer(
      Kind kind,
      detail::TcpTransportOptions tcpOptions,
      std::function<void()> beforeReady = nullptr) {
    int fds[2];
    if (::pipe(fds) != 0) {
      return;
    }
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(fds[0]);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::alarm(120); // never outlive a stuck test
      runChild(kind, tcpOptions, beforeReady, fds[1]);
      ::_exit(0);
    }
    ::close(fds[1]);
    std::string address = readUntil(fds[0], "\n", kTimeout);
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
      const std::function<void()>& beforeReady,
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
    if (beforeReady) {
      beforeReady();
    }
    if (::write(addressFd, line.data(), line.size()) < 0) {
      return;
    }
    // addressFd stays open: closing it would give back a descriptor that
    // beforeReady may have taken away on purpose.
    while (true) {
      ::pause();
    }
  }

  pid_t pid_ = -1;
  std::string address_;
};

// Connects and checks one echo; returns the connection's inbox.
inline std::shared_ptr<Inbox> connectAndEcho(
    Transport& client,
    const std::string& address,
    std::shared_ptr<Connection>& connection) {
  connection = client.connect(address);
  auto inbox = startWithInbox(connection);
  connection->send(makeMessage("hello"), [](const TransportError*) {});
  EXPECT_TRUE(inbox->waitForMessages(1, kTimeout));
  return inbox;
}

} // namespace harness
} // namespace rpc
} // namespace torchrpc
