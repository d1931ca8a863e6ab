// Note [Sends held for one write] (rpc/transport/tcp/connection.h): while
// the process awaits many replies, small frames sent from outside the loop
// wait for the loop's next turn and go out in one write; anything else
// that writes, and close(), takes them along in order. The client's only io
// thread is held in a callback, so that nothing but the test's own drive
// (or a write that does not hold) can write them.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/held_tcp_client.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;

// The client polls after traffic for a second (holding needs polling, so
// that the loop's next turn is near); the server does not poll, so that
// the client's is the one loop a test's drive runs.
constexpr std::chrono::microseconds kLongPoll = std::chrono::seconds(1);
constexpr std::chrono::microseconds kNoPoll{0};
// Options with heartbeats far apart: a heartbeat read on `talk` would
// write held frames too (a read loop writes what its connection queued).
// No shared rings: held sends are the socket's (a ring frame is written at
// once), and a ring offer arriving during a test is one more read.
detail::TcpTransportOptions quietOptions(
    std::string name,
    std::chrono::microseconds poll) {
  auto options = pollingOptions(std::move(name), poll);
  options.heartbeatInterval = std::chrono::seconds(60);
  options.peerTimeout = std::chrono::seconds(120);
  options.sharedRingBytes = 0;
  return options;
}

// A HeldClient whose transports send no heartbeat during a test.
struct QuietHeldClient : HeldClient {
  QuietHeldClient(
      std::chrono::microseconds poll,
      std::chrono::microseconds serverPoll)
      : HeldClient(
            quietOptions("client", poll),
            quietOptions("server", serverPoll)) {}
};

// How long a test watches for frames that must not arrive: the io thread
// is held, so only a write that should not happen could bring them.
constexpr auto kQuiet = std::chrono::milliseconds(100);

// Tells the client's transport that `count` replies are due.
std::shared_ptr<std::atomic<int64_t>> awaitReplies(
    HeldClient& c,
    int64_t count) {
  auto awaited = std::make_shared<std::atomic<int64_t>>(count);
  c.client.watchAwaitedReplies(awaited);
  return awaited;
}

// Sends "<prefix><i>" for i in [from, to) on the client's `talk`, counting
// the writes that completed.
void sendNumbered(
    HeldClient& c,
    const std::string& prefix,
    int from,
    int to,
    std::atomic<int>& written) {
  for (int i = from; i < to; ++i) {
    c.talk->send(
        makeMessage(prefix + std::to_string(i)),
        [&written](const TransportError* error) {
          if (error == nullptr) {
            written.fetch_add(1);
          }
        });
  }
}

// The server's messages on `talk` after its first ("talk").
std::vector<std::string> receivedAfterHello(HeldClient& c) {
  std::vector<std::string> headers;
  auto messages = c.serverTalkInbox->messages();
  for (size_t i = 1; i < messages.size(); ++i) {
    headers.push_back(messages[i].header);
  }
  return headers;
}

std::vector<std::string> numbered(const std::string& prefix, int from, int to) {
  std::vector<std::string> out;
  for (int i = from; i < to; ++i) {
    out.push_back(prefix + std::to_string(i));
  }
  return out;
}

TEST(TcpHeldSends, FramesWaitForTheLoopsNextTurnAndGoOutInOneWrite) {
  QuietHeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  auto awaited = awaitReplies(c, 64);
  c.holdIoThread();
  const uint64_t readsBefore = c.server.stats().reads;
  std::atomic<int> written{0};
  sendNumbered(c, "r", 0, 10, written);
  // Held: the loop's only thread is busy, and nobody drives.
  std::this_thread::sleep_for(kQuiet);
  EXPECT_EQ(c.serverTalkInbox->messages().size(), 1u);
  EXPECT_EQ(written.load(), 0);
  // A wait drives the loop: the posted flush writes all ten at once.
  ASSERT_TRUE(driveUntil(
      [&]() { return c.serverTalkInbox->messages().size() == 11; },
      kTimeout));
  EXPECT_EQ(receivedAfterHello(c), numbered("r", 0, 10));
  EXPECT_TRUE(torchrpc::testing::eventually(
      [&]() { return written.load() == 10; },
      kTimeout));
  // One sendmsg of ten frames lands in the server's socket as one read.
  EXPECT_EQ(c.server.stats().reads - readsBefore, 1u);
  c.gate.open();
}

TEST(TcpHeldSends, FramesAreWrittenAtOnceWhileFewRepliesAreAwaited) {
  QuietHeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  // A loop of synchronous calls awaits one reply at a time.
  auto awaited = awaitReplies(c, 1);
  c.holdIoThread();
  std::atomic<int> written{0};
  sendNumbered(c, "s", 0, 10, written);
  ASSERT_TRUE(c.serverTalkInbox->waitForMessages(11, kTimeout));
  EXPECT_EQ(receivedAfterHello(c), numbered("s", 0, 10));
  EXPECT_EQ(written.load(), 10);
  c.gate.open();
}

TEST(TcpHeldSends, FramesAreWrittenAtOnceWithoutPolling) {
  // Without polling, the loop's next turn may be far: nothing is held.
  QuietHeldClient c(kNoPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  auto awaited = awaitReplies(c, 64);
  c.holdIoThread();
  std::atomic<int> written{0};
  sendNumbered(c, "p", 0, 10, written);
  ASSERT_TRUE(c.serverTalkInbox->waitForMessages(11, kTimeout));
  EXPECT_EQ(receivedAfterHello(c), numbered("p", 0, 10));
  c.gate.open();
}

TEST(TcpHeldSends, TheIoThreadWritesThemWhenNobodyWaits) {
  QuietHeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  auto awaited = awaitReplies(c, 64);
  std::atomic<int> written{0};
  sendNumbered(c, "q", 0, 10, written);
  // No drive: the io thread's next turn of the loop writes them.
  ASSERT_TRUE(c.serverTalkInbox->waitForMessages(11, kTimeout));
  EXPECT_EQ(receivedAfterHello(c), numbered("q", 0, 10));
  EXPECT_TRUE(torchrpc::testing::eventually(
      [&]() { return written.load() == 10; },
      kTimeout));
}

TEST(TcpHeldSends, ABigFrameTakesTheHeldOnesAlongInOrder) {
  QuietHeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  auto awaited = awaitReplies(c, 64);
  c.holdIoThread();
  std::atomic<int> written{0};
  sendNumbered(c, "b", 0, 5, written);
  // 64 KiB: too big to hold, below the same-host zero-copy threshold.
  at::Tensor big = at::arange(16384, at::kFloat);
  c.talk->send(makeMessage("big", {big}), [&written](const TransportError* e) {
    if (e == nullptr) {
      written.fetch_add(1);
    }
  });
  ASSERT_TRUE(c.serverTalkInbox->waitForMessages(7, kTimeout));
  auto expected = numbered("b", 0, 5);
  expected.push_back("big");
  EXPECT_EQ(receivedAfterHello(c), expected);
  expectReceived(c.serverTalkInbox->messages()[6].tensors.at(0), big);
  EXPECT_EQ(written.load(), 6);
  c.gate.open();
}

TEST(TcpHeldSends, AtMostThirtyTwoFramesWaitTheRestOfABurstIsWritten) {
  QuietHeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  auto awaited = awaitReplies(c, 64);
  c.holdIoThread();
  std::atomic<int> written{0};
  sendNumbered(c, "m", 0, 100, written);
  // The 32nd, 64th and 96th frames each write the 32 queued; the last four
  // are held again.
  ASSERT_TRUE(c.serverTalkInbox->waitForMessages(97, kTimeout));
  std::this_thread::sleep_for(kQuiet);
  EXPECT_EQ(c.serverTalkInbox->messages().size(), 97u);
  ASSERT_TRUE(driveUntil(
      [&]() { return c.serverTalkInbox->messages().size() == 101; },
      kTimeout));
  EXPECT_EQ(receivedAfterHello(c), numbered("m", 0, 100));
  c.gate.open();
}

TEST(TcpHeldSends, CloseWritesTheHeldFramesFirst) {
  QuietHeldClient c(kLongPoll, kNoPoll);
  ASSERT_NE(c.serverTalk, nullptr);
  auto awaited = awaitReplies(c, 64);
  c.holdIoThread();
  std::atomic<int> written{0};
  sendNumbered(c, "c", 0, 5, written);
  c.talk->close();
  // All five were written (close() ran their done) and arrive before the
  // connection's end.
  EXPECT_EQ(written.load(), 5);
  ASSERT_TRUE(c.serverTalkInbox->waitForMessages(6, kTimeout));
  EXPECT_EQ(receivedAfterHello(c), numbered("c", 0, 5));
  EXPECT_TRUE(c.serverTalkInbox->waitForError(kTimeout));
  c.gate.open();
}

} // namespace
} // namespace rpc
} // namespace torchrpc
