// Note [Waiting callers drive the transport] (rpc/detail/wait_drivers.h) at
// the transport: while the client's only io thread is held in a callback,
// a thread driving the loop reads the next message itself.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <time.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tests/support/eventually.h"
#include "tests/support/gate.h"
#include "tests/support/held_tcp_client.h"
#include "tests/support/no_contention_backoff.h"
#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/detail/wait_drivers.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;

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

// Note [A waiter leaves its next read to the loop] (tcp/connection.h): the
// read after a waiter's answer is posted, not started. With the io thread
// held, every answer is read by the waiter, so each one's next read is
// left to the loop: the waiter's next step starts it (a step that would
// find nothing to run had the answer's step started the read), and once
// no one waits, the io thread does, and nothing sent meanwhile is missed.
// Over the socket: an answer through a shared ring is no socket read.
TEST(TcpWaitDriver, AReadAWaiterLeftIsStartedByTheNextWaitOrTheIoThread) {
  auto withoutRing = [](std::string name) {
    auto options = pollingOptions(std::move(name), pollFor(true));
    options.sharedRingBytes = 0;
    return options;
  };
  HeldClient c(withoutRing("client"), withoutRing("server"));
  ASSERT_NE(c.serverTalk, nullptr);
  c.holdIoThread();
  for (int i = 1; i <= 3; ++i) {
    c.serverTalk->send(makeMessage("answer"), [](const TransportError*) {});
    ASSERT_TRUE(driveUntil([&]() { return c.received.load() == i; }, kTimeout));
    EXPECT_EQ(c.readBy, std::this_thread::get_id());
    if (i < 3) {
      detail::DrivingScope next;
      EXPECT_TRUE(next.driveOnce()) << "answer " << i;
      next.end(true);
    }
  }
  // Sent while no one reads this connection: the waiter is gone and the io
  // thread still held.
  c.serverTalk->send(makeMessage("unasked"), [](const TransportError*) {});
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(c.received.load(), 3);
  c.gate.open();
  ASSERT_TRUE(torchrpc::testing::eventually(
      [&]() { return c.received.load() == 4; },
      kTimeout));
  EXPECT_NE(c.readBy, std::this_thread::get_id());
}

// CPU time of the calling thread.
std::chrono::microseconds threadCpuTime() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return std::chrono::microseconds(
      int64_t(t.tv_sec) * 1000000 + t.tv_nsec / 1000);
}

// With polling after traffic for a second, the client's io thread never
// sleeps in epoll during these tests: it stands by while a waiter drives,
// so the reactor is the waiter's. The server polls not at all, so that
// the client's is the one loop a wait drives (a thread sleeps in one loop
// only).
constexpr std::chrono::microseconds kLongPoll = std::chrono::seconds(1);
constexpr std::chrono::microseconds kNoPoll{0};

TEST(TcpWaitDriver, AWaiterPastItsSpinSleepsInTheLoopAndReadsItsAnswer) {
  // The io thread must stay out of epoll, whose reactor the waiter needs.
  torchrpc::testing::NoContentionBackoff noBackoff;
  HeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  for (int i = 1; i <= 3; ++i) {
    std::function<void()> wake;
    detail::DrivingScope driving;
    std::thread answer([&]() {
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
      c.serverTalk->send(makeMessage("answer"), [](const TransportError*) {});
    });
    const auto cpuBefore = threadCpuTime();
    driving.blockUntil(
        [&]() { return c.received.load() == i; },
        [&](std::function<void()> w) { wake = std::move(w); });
    const auto cpu = threadCpuTime() - cpuBefore;
    driving.end(c.received.load() == i);
    answer.join();
    ASSERT_EQ(c.received.load(), i);
    // Read here, by the sleeping waiter, not by the io thread.
    EXPECT_EQ(c.readBy, std::this_thread::get_id());
    EXPECT_TRUE(static_cast<bool>(wake));
    // It slept for the 40 ms rather than spun.
    EXPECT_LT(cpu, std::chrono::milliseconds(20));
  }
}

// A client whose io thread polls for 1 ms after traffic and then sleeps in
// epoll, holding the reactor; no heartbeats, so that a quiet spell stays
// quiet. `ring`: the client gives the server a shared ring for its
// messages (Note [Shared rings for small frames]); without one, as between
// hosts, they come by socket only.
detail::TcpTransportOptions quietOptions(
    std::string name,
    bool poll,
    bool ring = false) {
  auto options = pollingOptions(
      std::move(name),
      poll ? std::chrono::microseconds(1000) : kNoPoll);
  options.heartbeatInterval = std::chrono::seconds(60);
  options.peerTimeout = std::chrono::seconds(600);
  if (!ring) {
    options.sharedRingBytes = 0;
  }
  return options;
}

TEST(TcpWaitDriver, AfterAQuietSpellAWaiterSeesAnAnswerThatCameInItsRing) {
  // README, "a caller waiting for a reply": a reply through a shared ring
  // needs no reactor, so a waiter's polls see it while the io thread
  // sleeps in epoll after a quiet spell. The drain they post also wakes
  // the io thread (Asio interrupts the thread in epoll for a post), so
  // either thread may read it: the waiter does not wait for that wake-up.
  torchrpc::testing::NoContentionBackoff noBackoff;
  HeldClient c(
      quietOptions("client", true, /*ring=*/true),
      quietOptions("server", false));
  ASSERT_NE(c.serverTalk, nullptr);
  for (int i = 1; i <= 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    const uint64_t before = c.client.stats().ringFrames;
    detail::DrivingScope driving;
    c.serverTalk->send(makeMessage("answer"), [](const TransportError*) {});
    const auto deadline = Clock::now() + kTimeout;
    while (c.received.load() < i && Clock::now() < deadline) {
      if (!driving.driveOnce()) {
        std::this_thread::yield();
      }
    }
    driving.end(c.received.load() == i);
    ASSERT_EQ(c.received.load(), i);
    EXPECT_EQ(c.client.stats().ringFrames - before, 1u) << "answer " << i;
  }
}

TEST(TcpWaitDriver, AfterAQuietSpellTheIoThreadReadsTheWaitersAnswer) {
  // README, "a caller waiting for a reply": after a quiet spell the io
  // thread sleeps in epoll, holding the reactor, so a waiter's polls read
  // nothing from the socket and it cannot sleep in the loop; the io thread
  // reads the answer (and would then wake the waiter).
  torchrpc::testing::NoContentionBackoff noBackoff;
  HeldClient c(quietOptions("client", true), quietOptions("server", false));
  ASSERT_NE(c.serverTalk, nullptr);
  // An answer that comes while the waiter polls.
  for (int i = 1; i <= 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    detail::DrivingScope driving;
    c.serverTalk->send(makeMessage("answer"), [](const TransportError*) {});
    const auto deadline = Clock::now() + kTimeout;
    while (c.received.load() < i && Clock::now() < deadline) {
      if (!driving.driveOnce()) {
        std::this_thread::yield();
      }
    }
    driving.end(c.received.load() == i);
    ASSERT_EQ(c.received.load(), i);
    EXPECT_NE(c.readBy, std::this_thread::get_id()) << "answer " << i;
  }
  // A waiter whose spin ended without its answer: blockUntil() does not
  // sleep in the loop but returns, and the answer, sent only then, is read
  // by the io thread.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  torchrpc::testing::Gate sendAnswer;
  std::thread answer([&]() {
    if (sendAnswer.pass()) {
      c.serverTalk->send(makeMessage("answer"), [](const TransportError*) {});
    }
  });
  std::function<void()> wake;
  const auto start = Clock::now();
  {
    // Bounded, so that a waiter that does sleep in the loop (the answer
    // comes only after it returns) fails the test instead of hanging it.
    const auto giveUp = start + std::chrono::seconds(2);
    detail::DrivingScope driving;
    driving.blockUntil(
        [&]() { return c.received.load() == 4 || Clock::now() > giveUp; },
        [&](std::function<void()> w) { wake = std::move(w); });
    driving.end(c.received.load() == 4);
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(1));
  EXPECT_TRUE(static_cast<bool>(wake));
  sendAnswer.open();
  answer.join();
  ASSERT_TRUE(torchrpc::testing::eventually(
      [&]() { return c.received.load() == 4; },
      kTimeout));
  EXPECT_NE(c.readBy, std::this_thread::get_id());
}

TEST(TcpWaitDriver, ASleepingWaiterWakesWhenDoneByAnotherThread) {
  // The io thread must stay out of epoll, whose reactor the waiter needs.
  torchrpc::testing::NoContentionBackoff noBackoff;
  HeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  std::atomic<bool> done{false};
  std::function<void()> wake;
  std::mutex wakeMutex;
  Clock::time_point doneAt;
  std::thread other([&]() {
    // Early in the sleeper's first kBlockingSlice: unwoken, it would sleep
    // about 45 ms more.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    doneAt = Clock::now();
    done.store(true);
    std::lock_guard<std::mutex> lock(wakeMutex);
    ASSERT_TRUE(static_cast<bool>(wake));
    wake();
  });
  {
    detail::DrivingScope driving;
    driving.blockUntil(
        [&]() { return done.load(); },
        [&](std::function<void()> w) {
          std::lock_guard<std::mutex> lock(wakeMutex);
          wake = std::move(w);
        });
    driving.end(done.load());
  }
  const auto woke = Clock::now();
  other.join();
  EXPECT_TRUE(done.load());
  // Woken by the call, not by the end of a kBlockingSlice (50 ms) sleep.
  EXPECT_LT(woke - doneAt, detail::kBlockingSlice / 2);
}

TEST(TcpWaitDriver, JoinWakesAWaiterSleepingInTheLoop) {
  // The io thread must stay out of epoll, whose reactor the waiter needs.
  torchrpc::testing::NoContentionBackoff noBackoff;
  HeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  std::atomic<bool> sleeping{false};
  std::atomic<bool> returned{false};
  std::thread waiter([&]() {
    detail::DrivingScope driving;
    driving.blockUntil(
        [&]() {
          sleeping.store(true);
          return false; // an answer that never comes
        },
        [](std::function<void()>) {});
    returned.store(true);
  });
  ASSERT_TRUE(torchrpc::testing::eventually(
      [&]() { return sleeping.load(); },
      kTimeout));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto start = Clock::now();
  c.client.join();
  // join() closed the loop to drivers and woke the sleeper: no 10 s wait.
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  ASSERT_TRUE(torchrpc::testing::eventually(
      [&]() { return returned.load(); },
      kTimeout));
  waiter.join();
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
