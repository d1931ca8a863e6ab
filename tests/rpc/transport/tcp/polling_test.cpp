// The io threads' polling (Note [Polling after traffic],
// rpc/transport/tcp/polling.h): the slot that lets one io thread per
// process poll, the policy paused by copies into shared memory, and
// polling observed by thread state after traffic and
// while replies are due.

#include <ATen/ATen.h>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <gtest/gtest.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/no_contention_backoff.h"
#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/polling.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;

// ---- The polling slot ----

TEST(TcpPollingSlot, OneHolderPerProcessAndReleasedOnDestruction) {
  detail::tcp::PollingSlot first;
  EXPECT_TRUE(first.take());
  EXPECT_TRUE(first.take()) << "taking again keeps it";
  {
    detail::tcp::PollingSlot second;
    EXPECT_FALSE(second.take());
    first.release();
    EXPECT_TRUE(second.take());
  }
  EXPECT_TRUE(first.take()) << "the destructor gave it back";
  first.release();
}

// ---- The policy as a value ----

TEST(TcpIoPolling, NoPollingWhileASenderCopiesALargeTensorIn) {
  boost::asio::io_context io;
  detail::tcp::IoPolling polling(
      io,
      std::chrono::seconds(10),
      std::chrono::seconds(10));
  polling.noteTraffic();
  EXPECT_TRUE(polling.keepPolling());
  // Two senders copying at once: polling resumes after the last.
  polling.beginBulkCopy();
  polling.beginBulkCopy();
  EXPECT_FALSE(polling.keepPolling());
  polling.endBulkCopy();
  EXPECT_FALSE(polling.keepPolling());
  polling.endBulkCopy();
  EXPECT_TRUE(polling.keepPolling());
  // The scope the sender uses: only when active, and ended by a throw.
  {
    detail::tcp::BulkCopyScope inactive(polling, false);
    EXPECT_TRUE(polling.keepPolling());
  }
  try {
    detail::tcp::BulkCopyScope active(polling, true);
    EXPECT_FALSE(polling.keepPolling());
    throw std::runtime_error("copy failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(polling.keepPolling());
}

// Note [Waiting callers drive the transport]: while waiters drive, the io
// thread stands by and checks whether they are done; during a stretch of
// waits (a loop of calls) less and less often, since each check wakes it,
// on a small machine on the CPU a waiter spins on.

// The policy with an io thread of its own, as a transport runs it.
class TcpStandBy : public ::testing::Test {
 protected:
  TcpStandBy() : polling_(io_, std::chrono::seconds(1), 0us) {
    polling_.watchAwaitedReplies(awaited_);
    ioThread_ = std::thread([this]() { polling_.run(); });
  }
  ~TcpStandBy() override {
    stopLoop();
    work_.reset();
    io_.stop();
    ioThread_.join();
  }

  // A loop of calls on another thread: drives for 100 µs, ends, drives
  // again at once.
  void startLoop() {
    looping_ = true;
    loop_ = std::thread([this]() {
      while (looping_.load()) {
        polling_.beginDriving();
        const auto until = Clock::now() + 100us;
        while (Clock::now() < until) {
        }
        polling_.endDriving(/*answered=*/true);
      }
    });
  }
  void stopLoop() {
    looping_ = false;
    if (loop_.joinable()) {
      loop_.join();
    }
  }
  // How long a message nobody waits for, posted now, takes to be read
  // (run by the io thread or a driver); 10 s if it never is.
  std::chrono::microseconds readDelay() {
    const auto posted = Clock::now();
    auto delay = std::make_shared<std::atomic<int64_t>>(-1);
    boost::asio::post(io_, [posted, delay]() {
      delay->store(std::chrono::duration_cast<std::chrono::microseconds>(
                       Clock::now() - posted)
                       .count());
    });
    if (!torchrpc::testing::eventually(
            [&]() { return delay->load() >= 0; },
            10s)) {
      return 10s;
    }
    return std::chrono::microseconds(delay->load());
  }
  // Waits until the period is `period`; a caller sends before it waits,
  // which wakes an io thread asleep in the loop (sent again in case the
  // first came before it slept).
  bool periodBecomes(std::chrono::nanoseconds period) {
    return torchrpc::testing::eventually(
        [&]() {
          polling_.noteSend();
          return polling_.standByPeriod() == period;
        },
        10s);
  }

  torchrpc::testing::NoContentionBackoff noBackoff_;
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type>
      work_ = boost::asio::make_work_guard(io_);
  std::shared_ptr<std::atomic<int64_t>> awaited_ =
      std::make_shared<std::atomic<int64_t>>(0);
  detail::tcp::IoPolling polling_;
  std::thread ioThread_;
  std::atomic<bool> looping_{false};
  std::thread loop_;
};

TEST_F(TcpStandBy, ChecksThinOutDuringALoopOfCallsAndResetAfter) {
  EXPECT_EQ(polling_.standByPeriod(), 200us);
  for (int stretch = 0; stretch < 2; ++stretch) {
    startLoop();
    // 200, 400, 800, then 1000 µs: the period stops growing there.
    ASSERT_TRUE(periodBecomes(1000us))
        << "stretch " << stretch << ": period "
        << polling_.standByPeriod().count() << " ns";
    const uint64_t before = polling_.standBys();
    const auto start = Clock::now();
    std::this_thread::sleep_for(100ms);
    const uint64_t checks = polling_.standBys() - before;
    const auto elapsedMs =
        std::chrono::duration_cast<std::chrono::milliseconds>(
            Clock::now() - start)
            .count();
    // At most one check a millisecond (every 200 µs would be 5).
    EXPECT_LE(checks, static_cast<uint64_t>(elapsedMs + 10))
        << "stretch " << stretch << ", " << elapsedMs << " ms";
    EXPECT_EQ(polling_.standByPeriod(), 1000us);
    // The loop ends without telling the io thread: it notices within the
    // period and the linger and takes the loop, so a message nobody waits
    // for is read (1 ms at most; asserted loosely, as the machine may be
    // loaded), and the period is back to its start.
    stopLoop();
    EXPECT_LT(readDelay(), 20ms) << "stretch " << stretch;
    ASSERT_TRUE(torchrpc::testing::eventually(
        [&]() { return polling_.standByPeriod() == 200us; },
        10s))
        << "stretch " << stretch;
  }
}

TEST_F(TcpStandBy, OneLongWaitKeepsTheShortChecks) {
  polling_.beginDriving();
  const uint64_t before = polling_.standBys();
  ASSERT_TRUE(torchrpc::testing::eventually(
      [&]() {
        polling_.noteSend();
        return polling_.standBys() >= before + 5;
      },
      10s));
  // No drive ended meanwhile: a message nobody waits for is read within
  // 0.2 ms of this wait's end, however long it was.
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(polling_.standByPeriod(), 200us);
  polling_.endDriving(/*answered=*/true);
}

TEST_F(TcpStandBy, AHeldSendBringsTheShortChecksBackAndKeepsThem) {
  startLoop();
  ASSERT_TRUE(periodBecomes(1000us));
  // Note [Sends held for one write]: a held frame waits for the loop's
  // next turn, so the checks go back to 200 µs at once and stay there
  // while sends are held (8 replies due).
  awaited_->store(8);
  ASSERT_TRUE(polling_.holdsSends());
  polling_.noteHeldSend();
  EXPECT_EQ(polling_.standByPeriod(), 200us);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(polling_.standByPeriod(), 200us);
  stopLoop();
  awaited_->store(0);
}

TEST_F(TcpStandBy, AWaiterThatGivesUpBringsTheShortChecksBack) {
  startLoop();
  ASSERT_TRUE(periodBecomes(1000us));
  // This waiter gives up driving and will sleep on its future while the
  // loop's waiter still drives: whoever reads its answer next must come
  // as soon as before, whether the other waiter reads it or ends first.
  polling_.beginDriving();
  polling_.endDriving(/*answered=*/false);
  EXPECT_EQ(polling_.standByPeriod(), 200us);
  stopLoop();
}

TEST_F(TcpStandBy, AfterAWaiterAsleepInTheLoopTheIoThreadTakesItSoon) {
  // A waiter sleeps in the loop (the io thread then stands by with a 50 ms
  // timeout) until its answer comes, then ends its drive answered.
  std::atomic<bool> registered{false};
  std::atomic<bool> answered{false};
  std::atomic<bool> sleptForIt{false};
  std::thread sleeper([&]() {
    polling_.beginDriving();
    const auto deadline = Clock::now() + 10s;
    while (!answered.load() && Clock::now() < deadline) {
      // Refused while the io thread is asleep in the loop: again.
      if (polling_.driveBlocking(1s, [&]() {
            registered = true;
            return answered.load();
          })) {
        sleptForIt = sleptForIt.load() || registered.load();
      } else {
        std::this_thread::sleep_for(1ms);
      }
    }
    polling_.endDriving(/*answered=*/true);
  });
  ASSERT_TRUE(torchrpc::testing::eventually(
      [&]() {
        polling_.noteSend();
        return registered.load();
      },
      10s));
  std::this_thread::sleep_for(5ms);
  answered = true;
  boost::asio::post(io_, []() {}); // the answer wakes the sleeper
  sleeper.join();
  EXPECT_TRUE(sleptForIt.load());
  // A message nobody waits for, right after: read once the linger ends,
  // not when the io thread's 50 ms timeout would have.
  EXPECT_LT(readDelay(), 20ms);
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

// These tests measure the polling policy itself: no back-off on a busy
// machine meanwhile.
class TcpTransportPolling : public ::testing::Test {
 private:
  torchrpc::testing::NoContentionBackoff noBackoff_;
};

TEST_F(TcpTransportPolling, PollsAfterTrafficThenSleeps) {
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

TEST_F(TcpTransportPolling, PollsWhileRepliesAreDueAndNotOtherwise) {
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

TEST_F(TcpTransportPolling, OneIoThreadPerProcessPollsAtATime) {
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

} // namespace
} // namespace rpc
} // namespace torchrpc
