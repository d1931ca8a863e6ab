// Same-host shared memory (Note [TCP same-host shared memory],
// rpc/transport/tcp/shared_segments.h): segments as values (reuse, budget,
// what a receiver refuses to map), then large tensors through segments
// within a process and between processes: byte-exact, never overwritten
// while held, falling back to addresses when the budget is spent, and a
// negotiated peer that announces a bad segment failing only its connection,
// and the copy helper sharing the copy in (or turned off).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tests/support/allowed_cpus.h"
#include "tests/support/negotiated_raw_peer.h"
#include "tests/support/patterned_bytes.h"
#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/tcp/handshake.h"
#include "torchrpc/rpc/transport/tcp/same_host.h"
#include "torchrpc/rpc/transport/tcp/shared_segments.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;
using detail::tcp::SegmentPlacement;
using detail::tcp::SegmentReceiver;
using detail::tcp::SegmentSender;
using detail::tcp::viewsSharedSegment;

constexpr size_t kMiB = size_t(1) << 20;
// The largest tensor the receivers of these tests accept.
constexpr size_t kMaxTensor = 64 * kMiB;

std::shared_ptr<std::atomic<size_t>> budget() {
  return std::make_shared<std::atomic<size_t>>(0);
}

// ---- Segments as values ----

TEST(SharedSegments, ReceiverViewsWhatTheSenderCopiedAndReusesItOnceDropped) {
  auto charged = budget();
  SegmentSender sender(charged, 64 * kMiB);
  SegmentReceiver receiver(kMaxTensor);
  const at::Tensor want = patterned(3 * kMiB, 1);

  auto first = sender.copyIn(want);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->segment, 1u);
  at::Tensor got;
  ASSERT_EQ(receiver.view(::getpid(), *first, want.nbytes(), got), "");
  EXPECT_TRUE(viewsSharedSegment(got));
  EXPECT_FALSE(viewsSharedSegment(want));
  EXPECT_TRUE(sameBytes(got, want));
  EXPECT_EQ(got.scalar_type(), at::kByte);
  EXPECT_EQ(got.dim(), 1);

  // Held: the next copy takes a new segment, and the first keeps its bytes.
  const at::Tensor other = patterned(3 * kMiB, 2);
  auto second = sender.copyIn(other);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->segment, 2u);
  EXPECT_TRUE(sameBytes(got, want));
  at::Tensor got2;
  ASSERT_EQ(receiver.view(::getpid(), *second, other.nbytes(), got2), "");
  EXPECT_TRUE(sameBytes(got2, other));

  // Dropped: its segment serves again, seen through the same mapping.
  void* firstData = got.data_ptr();
  got = at::Tensor();
  auto third = sender.copyIn(patterned(3 * kMiB - 100, 3));
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->segment, 1u);
  at::Tensor got3;
  ASSERT_EQ(receiver.view(::getpid(), *third, 3 * kMiB - 100, got3), "");
  EXPECT_EQ(got3.data_ptr(), firstData);
  EXPECT_TRUE(sameBytes(got3, patterned(3 * kMiB - 100, 3)));
  EXPECT_EQ(sender.segmentCount(), 2u);
  EXPECT_EQ(charged->load(), sender.segmentBytes());
  EXPECT_EQ(receiver.mappedCount(), 2u);
}

TEST(SharedSegments, AReceivedTensorOutlivesSenderAndReceiver) {
  const at::Tensor want = patterned(kMiB, 4);
  at::Tensor got;
  auto charged = budget();
  {
    SegmentSender sender(charged, 8 * kMiB);
    SegmentReceiver receiver(kMaxTensor);
    auto placed = sender.copyIn(want);
    ASSERT_TRUE(placed.has_value());
    ASSERT_EQ(receiver.view(::getpid(), *placed, want.nbytes(), got), "");
  }
  EXPECT_EQ(charged->load(), 0u);
  EXPECT_TRUE(sameBytes(got, want));
  // Still writable, as any received tensor.
  got.fill_(7);
  EXPECT_EQ(got[12345].item<uint8_t>(), 7);
}

TEST(SharedSegments, TheBudgetBoundsSegmentsAndIdleOnesMakeRoom) {
  // The default the README states: at most 1 GiB of segments per worker.
  EXPECT_EQ(
      detail::TcpTransportOptions().sharedMemoryMaxBytes,
      size_t(1) << 30);
  auto charged = budget();
  // Room for two 1 MiB segments (each with its header page), not three.
  SegmentSender sender(charged, 2 * kMiB + 2 * 4096 + 100);
  SegmentReceiver receiver(kMaxTensor);
  auto a = sender.copyIn(patterned(kMiB, 1));
  auto b = sender.copyIn(patterned(kMiB, 2));
  ASSERT_TRUE(a && b);
  at::Tensor heldA;
  at::Tensor heldB;
  ASSERT_EQ(receiver.view(::getpid(), *a, kMiB, heldA), "");
  ASSERT_EQ(receiver.view(::getpid(), *b, kMiB, heldB), "");
  EXPECT_FALSE(sender.copyIn(patterned(kMiB, 3)).has_value());
  EXPECT_LE(charged->load(), 2 * kMiB + 2 * 4096 + 100);

  // Both idle: a 2 MiB tensor fits once the two small segments are freed.
  heldA = at::Tensor();
  heldB = at::Tensor();
  auto big = sender.copyIn(patterned(2 * kMiB, 4));
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(big->segment, 3u);
  EXPECT_EQ(sender.segmentCount(), 1u);
  at::Tensor got;
  ASSERT_EQ(receiver.view(::getpid(), *big, 2 * kMiB, got), "");
  EXPECT_TRUE(sameBytes(got, patterned(2 * kMiB, 4)));
  // The receiver's idle mappings of the two retired segments are gone too
  // (they would keep the memory alive).
  EXPECT_EQ(receiver.mappedCount(), 1u);
}

TEST(SharedSegments, TheReceiverRefusesWhatCouldFaultOrIsNotASegment) {
  SegmentReceiver receiver(kMaxTensor);
  at::Tensor out;
  const pid_t self = ::getpid();

  int pipeFds[2];
  ASSERT_EQ(::pipe(pipeFds), 0);
  EXPECT_EQ(
      receiver.view(self, SegmentPlacement{1, pipeFds[0]}, 10, out),
      "shared segment is not a memfd on tmpfs");
  ::close(pipeFds[0]);
  ::close(pipeFds[1]);

  // A memfd its owner could shrink under our mapping (SIGBUS).
  int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 1 << 20), 0);
  EXPECT_EQ(
      receiver.view(self, SegmentPlacement{2, unsealed}, 10, out),
      "shared segment is not sealed against shrinking");
  ::close(unsealed);

  // A sealed memfd, but larger than a segment for the largest tensor the
  // receiver accepts.
  int huge = ::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(huge, 0);
  ASSERT_EQ(
      ::ftruncate(huge, off_t(detail::tcp::segmentBytesFor(kMaxTensor)) + 4096),
      0);
  ASSERT_EQ(::fcntl(huge, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  EXPECT_EQ(
      receiver.view(self, SegmentPlacement{5, huge}, 10, out),
      "shared segment is larger than any tensor this connection accepts");
  ::close(huge);

  EXPECT_EQ(
      receiver.view(self, SegmentPlacement{3, 1 << 30}, 10, out),
      "cannot open the peer's shared segment: No such file or directory");
  EXPECT_EQ(
      receiver.view(self, SegmentPlacement{4, -1}, 10, out),
      "bad shared segment descriptor");

  auto charged = budget();
  SegmentSender sender(charged, 16 * kMiB);
  auto placed = sender.copyIn(patterned(kMiB, 5));
  ASSERT_TRUE(placed.has_value());
  // A tensor longer than the segment.
  EXPECT_EQ(
      receiver.view(self, *placed, 64 * kMiB, out),
      "tensor exceeds its shared segment");
  // A segment sent again while our tensor still views it.
  at::Tensor held;
  ASSERT_EQ(receiver.view(self, *placed, kMiB, held), "");
  EXPECT_EQ(
      receiver.view(self, *placed, kMiB, out),
      "shared segment reused while a received tensor still views it");
  EXPECT_FALSE(out.defined());
  EXPECT_TRUE(sameBytes(held, patterned(kMiB, 5)));
}

TEST(SharedSegments, IdleMappingsAreBounded) {
  auto charged = budget();
  SegmentSender sender(charged, 256 * kMiB);
  SegmentReceiver receiver(kMaxTensor);
  std::vector<at::Tensor> held;
  // Held mappings all stay; idle ones beyond the bound are dropped.
  const size_t count = detail::tcp::kMaxIdleMappings + 8;
  for (size_t i = 0; i < count; ++i) {
    auto placed = sender.copyIn(patterned(256 << 10, static_cast<int>(i)));
    ASSERT_TRUE(placed.has_value());
    at::Tensor got;
    ASSERT_EQ(receiver.view(::getpid(), *placed, 256 << 10, got), "");
    held.push_back(got);
  }
  EXPECT_EQ(receiver.mappedCount(), count);
  for (size_t i = 0; i < count; ++i) {
    EXPECT_TRUE(sameBytes(held[i], patterned(256 << 10, static_cast<int>(i))));
  }
  held.clear();
  // The next new segment trims the idle ones.
  auto placed = sender.copyIn(patterned(8 * kMiB, 99));
  ASSERT_TRUE(placed.has_value());
  at::Tensor got;
  ASSERT_EQ(receiver.view(::getpid(), *placed, 8 * kMiB, got), "");
  EXPECT_EQ(receiver.mappedCount(), detail::tcp::kMaxIdleMappings);
}

// ---- Over connections ----

// A connected pair after one message each way (so the same-host
// negotiation has completed).
using Pair = ConnectedPair;

TEST(TcpSharedMemory, LargeTensorsArriveInSegmentsAndSmallOnesInline) {
  Pair pair;
  std::vector<at::Tensor> sent = {
      patterned(kMiB, 1),
      patterned(100, 2),
      patterned(5 * kMiB + 3, 3),
      patterned((256 << 10) - 1, 4)};
  std::vector<at::Tensor> copies;
  for (const at::Tensor& t : sent) {
    copies.push_back(t.clone());
  }
  pair.connection->send(
      makeMessage("mixed", sent),
      [](const TransportError* error) { EXPECT_EQ(error, nullptr); });
  ASSERT_TRUE(pair.accepted.inbox->waitForMessages(2, kTimeout));
  Message got = pair.accepted.inbox->messages()[1];
  EXPECT_EQ(got.header, "mixed");
  ASSERT_EQ(got.tensors.size(), copies.size());
  for (size_t i = 0; i < copies.size(); ++i) {
    EXPECT_TRUE(sameBytes(got.tensors[i], copies[i])) << i;
  }
  // zeroCopyMinBytes (256 KiB) decides.
  EXPECT_TRUE(viewsSharedSegment(got.tensors[0]));
  EXPECT_FALSE(viewsSharedSegment(got.tensors[1]));
  EXPECT_TRUE(viewsSharedSegment(got.tensors[2]));
  EXPECT_FALSE(viewsSharedSegment(got.tensors[3]));
  // The sender's tensors are untouched, and those copied into segments
  // were not kept (an address's would be, until the ack).
  for (size_t i = 0; i < sent.size(); ++i) {
    EXPECT_TRUE(sameBytes(sent[i], copies[i]));
  }
  EXPECT_EQ(sent[0].use_count(), 1);
  EXPECT_EQ(sent[2].use_count(), 1);
  EXPECT_TRUE(pair.accepted.inbox->errors().empty());
}

TEST(TcpSharedMemory, HeldTensorsKeepTheirBytesAndDroppedOnesFreeTheirSegment) {
  Pair pair;
  constexpr int kMessages = 8;
  for (int i = 0; i < kMessages; ++i) {
    pair.connection->send(
        makeMessage("m", {patterned(kMiB, i)}),
        [](const TransportError*) {});
  }
  ASSERT_TRUE(pair.accepted.inbox->waitForMessages(1 + kMessages, kTimeout));
  auto got = pair.accepted.inbox->messages();
  std::set<void*> firstRound;
  for (int i = 0; i < kMessages; ++i) {
    const at::Tensor& tensor = got[1 + i].tensors.at(0);
    EXPECT_TRUE(viewsSharedSegment(tensor)) << i;
    EXPECT_TRUE(sameBytes(tensor, patterned(kMiB, i))) << i;
    firstRound.insert(tensor.data_ptr());
  }
  // All held at once: eight segments.
  EXPECT_EQ(firstRound.size(), size_t(kMessages));
  got.clear();
  pair.accepted.inbox->releaseTensors();

  // Each received and dropped before the next: the same segments serve.
  for (int i = 0; i < kMessages; ++i) {
    pair.connection->send(
        makeMessage("again", {patterned(kMiB, 100 + i)}),
        [](const TransportError*) {});
    ASSERT_TRUE(
        pair.accepted.inbox->waitForMessages(1 + kMessages + 1 + i, kTimeout));
    auto messages = pair.accepted.inbox->messages();
    const at::Tensor& tensor = messages.back().tensors.at(0);
    EXPECT_TRUE(sameBytes(tensor, patterned(kMiB, 100 + i))) << i;
    EXPECT_EQ(firstRound.count(tensor.data_ptr()), 1u) << i;
    messages.clear();
    pair.accepted.inbox->releaseTensors();
  }
  EXPECT_TRUE(pair.accepted.inbox->errors().empty());
}

TEST(TcpSharedMemory, ASpentBudgetSendsByAddressInstead) {
  auto clientOptions = testOptions("client");
  clientOptions.sharedMemoryMaxBytes = 2 * kMiB + 2 * 4096;
  Pair pair(testOptions("server"), clientOptions);
  for (int i = 0; i < 5; ++i) {
    pair.connection->send(
        makeMessage("m", {patterned(kMiB, i)}),
        [](const TransportError*) {});
  }
  ASSERT_TRUE(pair.accepted.inbox->waitForMessages(6, kTimeout));
  auto got = pair.accepted.inbox->messages();
  int inSegments = 0;
  for (int i = 0; i < 5; ++i) {
    const at::Tensor& tensor = got[1 + i].tensors.at(0);
    EXPECT_TRUE(sameBytes(tensor, patterned(kMiB, i))) << i;
    inSegments += viewsSharedSegment(tensor) ? 1 : 0;
  }
  // Two segments fit; the rest went by address (process_vm_readv).
  EXPECT_EQ(inSegments, 2);
  EXPECT_TRUE(pair.accepted.inbox->errors().empty());
}

TEST(TcpSharedMemory, EitherSideTurningItOffMeansNoSegments) {
  for (int off = 0; off < 2; ++off) {
    SCOPED_TRACE(off == 0 ? "receiver off" : "sender off");
    auto serverOptions = testOptions("server");
    auto clientOptions = testOptions("client");
    (off == 0 ? serverOptions : clientOptions).sharedMemoryMaxBytes = 0;
    Pair pair(serverOptions, clientOptions);
    pair.connection->send(
        makeMessage("m", {patterned(2 * kMiB, 9)}),
        [](const TransportError*) {});
    ASSERT_TRUE(pair.accepted.inbox->waitForMessages(2, kTimeout));
    const at::Tensor tensor = pair.accepted.inbox->messages()[1].tensors.at(0);
    EXPECT_TRUE(sameBytes(tensor, patterned(2 * kMiB, 9)));
    EXPECT_FALSE(viewsSharedSegment(tensor));
  }
}

// Sends large tensors over a same-host pair until the transport reports
// helper-copied bytes (at most `rounds`); every one must arrive intact in a
// segment. Returns the sender's helperCopiedBytes.
uint64_t sendLargeTensors(detail::TcpTransportOptions client, int rounds) {
  Pair pair(testOptions("server"), std::move(client));
  const at::Tensor sent = patterned(8 * kMiB + 5, 9);
  const at::Tensor copy = sent.clone();
  int received = 0;
  for (int i = 0; i < rounds; ++i) {
    pair.connection->send(
        makeMessage("big", {sent}),
        [](const TransportError* error) { EXPECT_EQ(error, nullptr); });
    // Every message is checked and dropped before the next is sent, so the
    // sender reuses one warm segment.
    received = i + 2; // the harness's first message is the hello
    if (!pair.accepted.inbox->waitForMessages(received, kTimeout)) {
      ADD_FAILURE() << "message " << i << " did not arrive";
      break;
    }
    Message got = pair.accepted.inbox->messages()[received - 1];
    EXPECT_TRUE(sameBytes(got.tensors.at(0), copy)) << i;
    EXPECT_TRUE(viewsSharedSegment(got.tensors.at(0))) << i;
    got = Message();
    pair.accepted.inbox->releaseTensors();
    if (pair.client.stats().helperCopiedBytes > 0) {
      break;
    }
  }
  return pair.client.stats().helperCopiedBytes;
}

TEST(TcpSharedMemory, LargeTensorsAreCopiedInOnTwoThreads) {
  const int cpus = testing::allowedCpuCount();
  ASSERT_GT(cpus, 0);
  if (cpus < 2) {
    // The helper stays off the sender's one CPU (parallel_copier_test.cpp).
    EXPECT_EQ(sendLargeTensors(testOptions("client"), 20), 0u);
    return;
  }
  EXPECT_GT(sendLargeTensors(testOptions("client"), 200), 0u);
}

TEST(TcpSharedMemory, WithoutTheCopyHelperTheSenderCopiesAlone) {
  auto options = testOptions("client");
  options.parallelCopyMinBytes = 0;
  EXPECT_EQ(sendLargeTensors(options, 20), 0u);
}

TEST(TcpSharedMemory, TensorsCrossProcessesAndOutliveTheSender) {
  ChildServer child(ChildServer::Kind::kTcp, testOptions("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(testOptions("client"));
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  // The child echoes: each tensor crosses twice, in a segment each way.
  for (int i = 0; i < 4; ++i) {
    connection->send(
        makeMessage("big", {patterned(4 * kMiB + i, i), patterned(64, i)}),
        [](const TransportError*) {});
  }
  ASSERT_TRUE(inbox->waitForMessages(5, kTimeout));
  auto got = inbox->messages();
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(got[1 + i].tensors.size(), 2u);
    EXPECT_TRUE(viewsSharedSegment(got[1 + i].tensors[0])) << i;
    EXPECT_TRUE(sameBytes(got[1 + i].tensors[0], patterned(4 * kMiB + i, i)));
    EXPECT_TRUE(sameBytes(got[1 + i].tensors[1], patterned(64, i)));
  }
  // The child's segments hold our tensors' storage; they survive it.
  child.kill(SIGKILL);
  child.reap();
  EXPECT_TRUE(inbox->waitForError(kTimeout));
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(sameBytes(got[1 + i].tensors[0], patterned(4 * kMiB + i, i)));
  }
}

// ---- A negotiated peer that lies ----

// One tensor of `length` bytes announced in segment 1 at our fd `fd`.
std::string sharedFrame(int fd, uint64_t length) {
  using namespace detail::tcp;
  std::string prefix = encodeDataPrefix(
      0,
      {static_cast<size_t>(length)},
      1,
      {static_cast<uint64_t>(fd)},
      {1});
  return prefix;
}

class TcpSharedMemoryHostile : public TcpListenerFixture {};

TEST_F(TcpSharedMemoryHostile, BadSegmentsFailOnlyTheirConnection) {
  int pipeFds[2];
  ASSERT_EQ(::pipe(pipeFds), 0);
  int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 1 << 20), 0);
  auto charged = budget();
  SegmentSender sender(charged, 16 * kMiB);
  auto good = sender.copyIn(patterned(kMiB, 1));
  ASSERT_TRUE(good.has_value());

  struct Case {
    std::string what;
    std::string frame;
    std::string reason;
  };
  std::vector<Case> cases = {
      {"pipe", sharedFrame(pipeFds[0], 10), "not a memfd on tmpfs"},
      {"unsealed memfd",
       sharedFrame(unsealed, 10),
       "not sealed against shrinking"},
      {"no such fd", sharedFrame(1 << 30, 10), "cannot open"},
      {"longer than the segment",
       sharedFrame(good->fd, 2 * kMiB),
       "tensor exceeds its shared segment"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    size_t index = acceptor_->count();
    NegotiatedRawPeer peer(port_);
    ASSERT_TRUE(peer.negotiate());
    auto accepted = acceptor_->waitFor(index);
    ASSERT_NE(accepted.connection, nullptr);
    ASSERT_TRUE(peer.raw().write(c.frame));
    ASSERT_TRUE(accepted.inbox->waitForError());
    const TransportError error = accepted.inbox->errors()[0];
    EXPECT_EQ(error.code, ErrorCode::kMalformedMessage);
    EXPECT_NE(error.detail.find(c.reason), std::string::npos) << error.detail;
    EXPECT_TRUE(accepted.inbox->messages().empty());
    EXPECT_TRUE(peer.raw().waitClosedByServer());
  }
  // And a good one, to show the peer itself was not what failed.
  size_t index = acceptor_->count();
  NegotiatedRawPeer peer(port_);
  ASSERT_TRUE(peer.negotiate());
  auto accepted = acceptor_->waitFor(index);
  ASSERT_NE(accepted.connection, nullptr);
  ASSERT_TRUE(peer.raw().write(sharedFrame(good->fd, kMiB)));
  ASSERT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
  const at::Tensor got = accepted.inbox->messages()[0].tensors.at(0);
  EXPECT_TRUE(viewsSharedSegment(got));
  EXPECT_TRUE(sameBytes(got, patterned(kMiB, 1)));
  ::close(pipeFds[0]);
  ::close(pipeFds[1]);
  ::close(unsealed);
  expectListenerHealthy();
}

TEST_F(TcpSharedMemoryHostile, SegmentsWithoutNegotiationAreRefused) {
  size_t index = acceptor_->count();
  RawPeer peer(port_);
  ASSERT_TRUE(peer.connected());
  ASSERT_TRUE(peer.write(rawHello("raw", false)));
  ASSERT_EQ(peer.read(16).size(), 16u);
  auto accepted = acceptor_->waitFor(index);
  ASSERT_NE(accepted.connection, nullptr);
  ASSERT_TRUE(peer.write(sharedFrame(0, 10)));
  ASSERT_TRUE(accepted.inbox->waitForError());
  EXPECT_EQ(accepted.inbox->errors()[0].code, ErrorCode::kMalformedMessage);
  EXPECT_NE(
      accepted.inbox->errors()[0].detail.find(
          "unexpected zero-copy data frame"),
      std::string::npos);
  EXPECT_TRUE(peer.waitClosedByServer());
  expectListenerHealthy();
}

} // namespace
} // namespace rpc
} // namespace torchrpc
