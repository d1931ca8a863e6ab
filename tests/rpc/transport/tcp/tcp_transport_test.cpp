// What the TCP transport promises beyond the Transport contract (which
// tests/rpc/transport_test.cpp covers for every backend): its addresses,
// frames at the edges of the format, order with several io threads, a
// listener out of file descriptors, and connections that meet the
// transport's shutdown before they started.

#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <sstream>
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

// A client whose handshake would wait far longer than any test: a join()
// held up by one shows as a join() that takes seconds.
detail::TcpTransportOptions patientClientOptions() {
  auto options = testOptions("client");
  options.handshakeTimeout = std::chrono::seconds(60);
  return options;
}

// A connection that the transport's shutdown (or the user's close()) meets
// before its io thread started it never connects: a start after close()
// would open a socket and arm a handshake timer that nobody waits for, and
// one queued after join() would stay in a loop nobody runs, holding the
// connection and, through it, the transport's io_context for good.
TEST(TcpTransport, AConnectionClosedBeforeItStartedNeverConnects) {
  SilentListener listener;
  ASSERT_TRUE(listener.ok());
  const auto options = patientClientOptions(); // one io thread
  constexpr int kAttempts = 40;
  int errorsSeen = 0;
  for (int i = 0; i < kAttempts; ++i) {
    detail::TcpTransport client(options);
    // The io thread is held in another connection's error callback, so
    // the start that connect() queues runs only after the close below.
    std::promise<void> inCallback;
    std::promise<void> release;
    std::shared_future<void> released = release.get_future().share();
    auto blocker = client.connect("tcp://127.0.0.1:99999"); // fails at once
    blocker->start(
        [](Message&&) {},
        [&inCallback, released](const TransportError&) {
          inCallback.set_value();
          released.wait();
        });
    ASSERT_EQ(
        inCallback.get_future().wait_for(kTimeout),
        std::future_status::ready);

    auto connection = client.connect(listener.address());
    auto inbox = startWithInbox(connection);
    if (i % 2 == 0) {
      connection->close(); // the user's close
    } else {
      client.close(); // the transport's
    }
    release.set_value();
    const auto started = std::chrono::steady_clock::now();
    client.join();
    // Nothing holds the io threads: join() does not wait for a handshake.
    EXPECT_LT(
        std::chrono::steady_clock::now() - started,
        std::chrono::seconds(4));
    errorsSeen += inbox->waitForError() ? 1 : 0;
  }
  EXPECT_EQ(errorsSeen, kAttempts);
  EXPECT_EQ(listener.drain(std::chrono::milliseconds(200)), 0);
}

// connect() on several threads while join() runs on another: whichever
// phase of the shutdown a connection meets, it fails with an error its user
// sees and join() is not held up. (The narrowest phase, a connection that
// passed close() but is started only after join(), is hit here only by
// chance; TcpConnectionStart covers it directly.)
TEST(TcpTransport, ConnectingWhileTheTransportJoinsLeavesNothingBehind) {
  SilentListener listener;
  ASSERT_TRUE(listener.ok());
  const auto options = patientClientOptions();
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

// The CPU time a process has used (utime + stime), in clock ticks.
long cpuTicks(pid_t pid) {
  int fd = ::open(("/proc/" + std::to_string(pid) + "/stat").c_str(), O_RDONLY);
  std::string stat = readUntil(fd, "\n", std::chrono::milliseconds(1000));
  ::close(fd);
  // Fields after the command name, which ends with the last ')'.
  std::istringstream fields(stat.substr(stat.rfind(')') + 2));
  std::string field;
  long utime = 0;
  long stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) {
      utime = std::stol(field);
    } else if (i == 15) {
      stime = std::stol(field);
    }
  }
  return utime + stime;
}

// A listener whose process has no file descriptor left cannot accept: it
// says so, waits before it tries again instead of spinning on the failing
// accept, and accepts the waiting connection once descriptors are free.
// The server runs in a child process, whose descriptor limit it lowers.
TEST(TcpTransport, AListenerOutOfDescriptorsBacksOffAndRecovers) {
  int logPipe[2];
  ASSERT_EQ(::pipe(logPipe), 0);
  // The child's log, read as it comes (its writes never block) until the
  // child is gone. Declared before the child, so that on every path the
  // child dies first and the read ends; started after the fork, which
  // ThreadSanitizer refuses in a process with threads of its own.
  std::future<std::string> log;
  ChildServer child(ChildServer::Kind::kTcp, testOptions("server"), [&]() {
    ::dup2(logPipe[1], STDERR_FILENO);
    // No descriptor left: the soft limit just above the highest one open,
    // and every free number below it taken.
    int highest = ::dup(STDERR_FILENO);
    rlimit limit{};
    ::getrlimit(RLIMIT_NOFILE, &limit);
    limit.rlim_cur = static_cast<rlim_t>(highest + 1);
    ::setrlimit(RLIMIT_NOFILE, &limit);
    std::vector<int> fillers{highest};
    for (int i = 0; i < 100000; ++i) {
      int fd = ::dup(STDERR_FILENO);
      if (fd < 0) {
        break;
      }
      fillers.push_back(fd);
    }
    // The parent connects once the child is ready: its connection waits
    // in the backlog, the listener failing to accept it, for 600 ms.
    std::thread([fillers]() {
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
      for (int fd : fillers) {
        ::close(fd);
      }
    }).detach();
  });
  ::close(logPipe[1]);
  log = std::async(std::launch::async, [fd = logPipe[0]]() {
    std::string text = readUntil(fd, "\x01", std::chrono::seconds(30));
    ::close(fd);
    return text;
  });
  ASSERT_FALSE(child.address().empty());

  auto options = testOptions("client");
  options.handshakeTimeout = std::chrono::seconds(10); // outlasts the 600 ms
  detail::TcpTransport client(options);
  const long ticksBefore = cpuTicks(child.pid());
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  const long ticksDuring = cpuTicks(child.pid()) - ticksBefore;
  ASSERT_TRUE(inbox->errors().empty());

  // Asleep between tries: a spinning accept uses a good part of the 600 ms.
  EXPECT_LT(ticksDuring, ::sysconf(_SC_CLK_TCK) / 10) << "clock ticks";

  child.kill(SIGKILL);
  child.reap();
  const std::string text = log.get();
  // Each failed accept is logged, naming the cause; one try every 50 ms
  // makes about 12 in the 600 ms (a spinning accept made 24 k here).
  const std::string failed = "accept failed (Too many open files); retrying";
  int failures = 0;
  for (size_t at = text.find(failed);
       at != std::string::npos && failures < 1000;
       at = text.find(failed, at + 1)) {
    ++failures;
  }
  EXPECT_GE(failures, 2) << text.substr(0, 2000);
  EXPECT_LE(failures, 60) << text.substr(0, 2000);
}

} // namespace
} // namespace rpc
} // namespace torchrpc
