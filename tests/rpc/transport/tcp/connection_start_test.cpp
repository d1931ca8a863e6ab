// How a TCP connection starts when the transport's shutdown got there first
// (tcp/connection.h, startConnecting/startAccepted). Built on the
// transport's own context, so that the moment "the io threads were joined"
// is set by hand instead of raced for.

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "tests/support/tcp_peers.h"
#include "torchrpc/rpc/transport/tcp/connection.h"
#include "torchrpc/rpc/transport/tcp/context.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;
using detail::tcp::Endpoint;
using detail::tcp::Role;
using detail::tcp::Socket;
using detail::tcp::Strand;
using detail::tcp::TcpConnectionImpl;
using detail::tcp::TcpContext;

std::vector<Endpoint> loopback(int port) {
  return {Endpoint(boost::asio::ip::tcp::endpoint(
      boost::asio::ip::make_address("127.0.0.1"),
      static_cast<unsigned short>(port)))};
}

// A client connection on a context of its own, with no io thread: the
// test runs the loop (io.poll()) where an io thread would.
class TcpConnectionStart : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(listener_.ok());
    Strand strand = boost::asio::make_strand(context_->io);
    connection_ = std::make_shared<TcpConnectionImpl>(
        context_,
        Role::kClient,
        1,
        strand,
        Socket(strand),
        "silent listener");
  }

  SilentListener listener_;
  std::shared_ptr<TcpContext> context_ =
      std::make_shared<TcpContext>(testOptions("client"));
  std::shared_ptr<TcpConnectionImpl> connection_;
};

// What join() leaves: no io thread, `joined` set, every connection it knew
// closed. A connect() that passed close() and starts only now must neither
// queue a handler on the loop nobody runs (it would hold the connection,
// and through it the context and its io_context, for good) nor connect.
TEST_F(TcpConnectionStart, AfterJoinNothingIsQueuedAndNothingConnects) {
  connection_->close("closed: transport client is shutting down");
  ASSERT_EQ(context_->io.poll(), 1u); // the report, as the io threads would
  context_->joined.store(true);

  connection_->startConnecting(loopback(listener_.port()));

  EXPECT_EQ(context_->io.poll(), 0u);
  EXPECT_EQ(connection_.use_count(), 1);
  EXPECT_EQ(listener_.drain(std::chrono::milliseconds(200)), 0);
}

// Closed before its queued start ran (the io threads still running): the
// start does nothing, so no socket is opened and no timer is left armed.
TEST_F(TcpConnectionStart, ClosedBeforeItsStartRanNothingStarts) {
  connection_->startConnecting(loopback(listener_.port()));
  connection_->close("closed by its user");

  // Runs the start and the report queued behind it, as an io thread would.
  EXPECT_EQ(context_->io.poll(), 2u);
  EXPECT_EQ(context_->io.poll(), 0u);
  EXPECT_EQ(connection_.use_count(), 1);
  EXPECT_EQ(listener_.drain(std::chrono::milliseconds(200)), 0);
}

// The same start on a connection still open does connect: the two tests
// above see nothing because nothing started, not because nothing could.
TEST_F(TcpConnectionStart, AnOpenConnectionConnects) {
  connection_->startConnecting(loopback(listener_.port()));
  EXPECT_GE(context_->io.poll(), 1u);
  EXPECT_EQ(listener_.drain(std::chrono::seconds(5)), 1);
  connection_->close("done");
  // The report closes the socket and cancels the timer; their handlers end.
  for (int i = 0; i < 100 && connection_.use_count() > 1; ++i) {
    context_->io.poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(connection_.use_count(), 1);
}

} // namespace
} // namespace rpc
} // namespace torchrpc
