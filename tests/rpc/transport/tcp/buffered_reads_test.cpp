// Note [Buffered frame reads] (rpc/transport/tcp/connection.h): frames that
// arrive together are parsed from one read, frames cut anywhere arrive
// intact, big tensors land in their storage without a copy and small ones
// are counted as copied. The peers write frames by hand, so nothing here
// trusts the transport's own encoder.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;

// A kData frame with `header` as its body and one tensor of `bytes`.
std::string rawDataFrame(const std::string& header, const std::string& bytes) {
  std::string out =
      rawFrameHeader(kData, static_cast<uint32_t>(header.size()), 1);
  putLe(out, bytes.size(), 8);
  return out + header + bytes;
}

std::string tensorBytes(const at::Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()), t.nbytes());
}

class TcpBufferedReadsTest : public TcpListenerFixture {
 protected:
  detail::TcpTransportOptions serverOptions() override {
    auto options = testOptions("server");
    // Same-process peers would otherwise read big tensors by address.
    options.sameHostZeroCopy = false;
    return options;
  }
  detail::TcpTransportOptions clientOptions() override {
    auto options = testOptions("client");
    options.sameHostZeroCopy = false;
    return options;
  }

  // A raw peer past its handshake, and the server's side of it.
  Acceptor::Accepted handshake(RawPeer& peer) {
    size_t index = acceptor_->count();
    EXPECT_TRUE(peer.connected());
    EXPECT_TRUE(peer.write(rawHello("raw", false)));
    EXPECT_EQ(peer.read(16).substr(0, 4), "TRPC"); // the welcome's header
    return acceptor_->waitFor(index);
  }
};

TEST_F(TcpBufferedReadsTest, FramesWrittenTogetherArriveFromAFewReads) {
  RawPeer peer(port_);
  auto accepted = handshake(peer);
  ASSERT_NE(accepted.connection, nullptr);
  constexpr int kFrames = 200;
  std::string burst;
  for (int i = 0; i < kFrames; ++i) {
    burst += rawDataFrame(
        "frame " + std::to_string(i),
        std::string(4 + i % 7, char('a' + i % 26)));
  }
  const uint64_t readsBefore = server_->stats().reads;
  ASSERT_TRUE(peer.write(burst)); // one send() of ~10 KB
  ASSERT_TRUE(accepted.inbox->waitForMessages(kFrames, kTimeout));
  const uint64_t reads = server_->stats().reads - readsBefore;

  auto messages = accepted.inbox->messages();
  ASSERT_EQ(messages.size(), size_t(kFrames));
  for (int i = 0; i < kFrames; ++i) {
    ASSERT_EQ(messages[i].header, "frame " + std::to_string(i));
    ASSERT_EQ(messages[i].tensors.size(), 1u);
    EXPECT_EQ(
        tensorBytes(messages[i].tensors[0]),
        std::string(4 + i % 7, char('a' + i % 26)));
  }
  // Read part by part, 200 frames took 600 reads. Loopback may deliver the
  // one send in a few pieces, and the fixture's established connection
  // may see a heartbeat meanwhile.
  EXPECT_GE(reads, 1u);
  EXPECT_LE(reads, 10u) << "reads for " << kFrames << " frames";
  EXPECT_TRUE(accepted.inbox->errors().empty());
  expectListenerHealthy();
}

TEST_F(TcpBufferedReadsTest, FramesCutAnywhereArriveIntact) {
  RawPeer peer(port_);
  auto accepted = handshake(peer);
  ASSERT_NE(accepted.connection, nullptr);
  // Small frames around one whose tensor (40 KiB) is read partly from the
  // buffer and the rest straight into its storage.
  std::vector<std::pair<std::string, std::string>> frames = {
      {"one", "x"},
      {"big", randomBytes(40 << 10, 7)},
      {"", std::string()},
      {"three", randomBytes(100, 8)},
  };
  std::string all;
  for (const auto& f : frames) {
    all += rawDataFrame(f.first, f.second);
  }
  std::mt19937 random(11);
  size_t offset = 0;
  while (offset < all.size()) {
    // Mostly tiny pieces, now and then a large one.
    size_t piece = random() % 8 == 0 ? 1 + random() % 20000 : 1 + random() % 7;
    piece = std::min(piece, all.size() - offset);
    ASSERT_TRUE(peer.write(all.substr(offset, piece)));
    offset += piece;
  }
  ASSERT_TRUE(accepted.inbox->waitForMessages(frames.size(), kTimeout));
  auto messages = accepted.inbox->messages();
  ASSERT_EQ(messages.size(), frames.size());
  for (size_t i = 0; i < frames.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(messages[i].header, frames[i].first);
    ASSERT_EQ(messages[i].tensors.size(), 1u);
    EXPECT_EQ(tensorBytes(messages[i].tensors[0]), frames[i].second);
  }
  EXPECT_TRUE(accepted.inbox->errors().empty());
}

TEST_F(TcpBufferedReadsTest, BadFrameAfterGoodOnesInOneReadFailsAfterThem) {
  RawPeer peer(port_);
  auto accepted = handshake(peer);
  ASSERT_NE(accepted.connection, nullptr);
  std::string burst = rawDataFrame("good 1", "a") +
      rawDataFrame("good 2", "b") + rawFrameHeader(kData, 0, 0x7fffffff) +
      rawDataFrame("never", "c");
  ASSERT_TRUE(peer.write(burst));
  ASSERT_TRUE(accepted.inbox->waitForError());
  EXPECT_EQ(accepted.inbox->errors()[0].code, ErrorCode::kMalformedMessage);
  auto messages = accepted.inbox->messages();
  ASSERT_EQ(messages.size(), 2u);
  EXPECT_EQ(messages[0].header, "good 1");
  EXPECT_EQ(messages[1].header, "good 2");
  EXPECT_TRUE(peer.waitClosedByServer());
  expectListenerHealthy();
}

TEST_F(TcpBufferedReadsTest, BigTensorsLandInTheirStorageSmallOnesAreCopied) {
  const auto before = server_->stats();
  auto big = at::arange(1 << 20, at::kInt); // 4 MiB
  auto small = at::arange(25, at::kInt); // 100 bytes
  size_t index = accepted_.inbox->messages().size();
  established_->send(
      makeMessage("big and small", {big, small}),
      [](const TransportError*) {});
  ASSERT_TRUE(accepted_.inbox->waitForMessages(index + 1, kTimeout));
  auto message = accepted_.inbox->messages()[index];
  ASSERT_EQ(message.tensors.size(), 2u);
  EXPECT_EQ(tensorBytes(message.tensors[0]), tensorBytes(big));
  EXPECT_EQ(tensorBytes(message.tensors[1]), tensorBytes(small));

  const auto after = server_->stats();
  const uint64_t zeroCopy = after.zeroCopyBytes - before.zeroCopyBytes;
  const uint64_t copied = after.copiedBytes - before.copiedBytes;
  EXPECT_EQ(zeroCopy + copied, big.nbytes() + small.nbytes());
  // At most one buffer's worth (64 KiB) of the big tensor came through
  // the read buffer with the frame's start.
  EXPECT_LE(copied, uint64_t(64) << 10);
  EXPECT_GE(zeroCopy, big.nbytes() + small.nbytes() - (uint64_t(64) << 10));
}

TEST_F(TcpBufferedReadsTest, SmallTensorsAloneAreCountedAsCopied) {
  const auto before = server_->stats();
  auto small = at::arange(250, at::kInt); // 1000 bytes
  size_t index = accepted_.inbox->messages().size();
  established_->send(makeMessage("small", {small}), [](const TransportError*) {
  });
  ASSERT_TRUE(accepted_.inbox->waitForMessages(index + 1, kTimeout));
  EXPECT_EQ(
      tensorBytes(accepted_.inbox->messages()[index].tensors[0]),
      tensorBytes(small));
  const auto after = server_->stats();
  EXPECT_EQ(after.copiedBytes - before.copiedBytes, small.nbytes());
  EXPECT_EQ(after.zeroCopyBytes - before.zeroCopyBytes, 0u);
}

// A TCP server that answers every message from its read callback, as a
// cheap function's reply is sent, and counts the replies whose write
// returned (their done ran) before that callback did: those were written
// by their own send, not after the read was parsed.
struct ReplyingServer {
  ReplyingServer() : transport(testOptions("server")) {
    transport.listen([this](std::shared_ptr<Connection> connection) {
      std::weak_ptr<Connection> weak = connection;
      connection->start(
          [this, weak](Message&& message) {
            auto self = weak.lock();
            if (!self) {
              return;
            }
            auto inside = std::make_shared<std::atomic<bool>>(true);
            self->send(
                makeMessage("re: " + message.header),
                [this, inside](const TransportError* error) {
                  if (error == nullptr) {
                    written.fetch_add(1);
                    if (inside->load()) {
                      writtenInsideCallback.fetch_add(1);
                    }
                  }
                });
            inside->store(false);
          },
          [](const TransportError&) {});
      std::lock_guard<std::mutex> lock(acceptedMutex);
      accepted.push_back(std::move(connection));
    });
  }

  std::atomic<int> written{0};
  std::atomic<int> writtenInsideCallback{0};
  std::mutex acceptedMutex;
  std::vector<std::shared_ptr<Connection>> accepted;
  // Last: destroyed first, while the counters it calls back into live.
  detail::TcpTransport transport;
};

TEST(TcpBufferedReads, RepliesSentWhileAReadIsParsedGoOutTogetherAfterIt) {
  ReplyingServer server;
  detail::TcpTransport client(testOptions("client"));
  auto connection = client.connect(server.transport.address());
  auto inbox = startWithInbox(connection);
  constexpr int kMessages = 100;
  for (int i = 0; i < kMessages; ++i) {
    connection->send(
        makeMessage("m" + std::to_string(i)),
        [](const TransportError*) {});
  }
  ASSERT_TRUE(inbox->waitForMessages(kMessages, kTimeout));
  auto replies = inbox->messages();
  ASSERT_EQ(replies.size(), size_t(kMessages));
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_EQ(replies[i].header, "re: m" + std::to_string(i));
  }
  // A reply's done runs once its write returned, which may be after the
  // client read it.
  EXPECT_TRUE(torchrpc::testing::eventually(
      [&]() { return server.written.load() == kMessages; },
      kTimeout));
  // Each went out once the read that brought its request was parsed, not
  // from inside the callback, unless it was the 32nd waiting: that one
  // writes the 32 (Note [Buffered frame reads]). The client sent each
  // message with its own write, so a read may bring many.
  EXPECT_LE(server.writtenInsideCallback.load(), kMessages / 32);
  EXPECT_TRUE(inbox->errors().empty());
  connection->close();
  client.join();
  server.transport.join();
}

TEST(TcpBufferedReads, RepliesToOneReadGoOutThirtyTwoAtATime) {
  ReplyingServer server;
  RawPeer peer(portOf(server.transport.address()));
  ASSERT_TRUE(peer.connected());
  ASSERT_TRUE(peer.write(rawHello("raw", false)));
  ASSERT_EQ(peer.read(16).substr(0, 4), "TRPC"); // the welcome's header
  constexpr int kRequests = 64;
  std::string burst;
  for (int i = 0; i < kRequests; ++i) {
    burst += rawDataFrame("m" + std::to_string(i), "x");
  }
  ASSERT_TRUE(peer.write(burst)); // one send() of about 2 KB: one read
  EXPECT_TRUE(torchrpc::testing::eventually(
      [&]() { return server.written.load() == kRequests; },
      kTimeout));
  // Held until the read was parsed, but not all 64: the 32nd and the 64th
  // reply each wrote the 32 waiting (Note [Buffered frame reads]).
  EXPECT_EQ(server.writtenInsideCallback.load(), 2);
  peer.close();
  server.transport.join();
}

} // namespace
} // namespace rpc
} // namespace torchrpc
