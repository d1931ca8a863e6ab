#pragma once

// One TCP connection: its write queue (written from the sending thread),
// its read state machine on a strand (handshake, control and data frames),
// heartbeats, and the first error that sticks. connection.cpp implements
// all but the read state machine, which is connection_reader.cpp.

#include <c10/util/Exception.h>

#include <boost/asio/basic_stream_socket.hpp>
#include <boost/asio/basic_waitable_timer.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torchrpc/rpc/transport/tcp/context.h"
#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/tcp/handshake.h"
#include "torchrpc/rpc/transport/tcp/same_host.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

using Clock = std::chrono::steady_clock;
using Strand = boost::asio::strand<boost::asio::io_context::executor_type>;
using Socket = boost::asio::basic_stream_socket<boost::asio::ip::tcp, Strand>;
using Timer = boost::asio::
    basic_waitable_timer<Clock, boost::asio::wait_traits<Clock>, Strand>;
using AsioError = boost::system::error_code;

// Opens every TcpConnectionImpl method named ...FromLoop: it runs on the
// connection's strand, or inline once the io threads were joined (see
// runOnStrand). Debug builds only.
#define TORCHRPC_ASSERT_IN_LOOP()   \
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY( \
      inLoop(),                     \
      "TcpConnection ",             \
      id_,                          \
      ": ",                         \
      __func__,                     \
      " runs off its strand")

// "ip:port", IPv6 in brackets.
std::string endpointString(const boost::asio::ip::tcp::endpoint& endpoint);

// One connection's socket and state. Internal: the user holds a
// TcpConnection handle, whose destruction closes this; asynchronous
// operations hold a shared_ptr to this until they complete.
//
// Reads, timers and the user's onMessage/onError run on strand_ (methods
// named ...FromLoop, which assert it in debug builds; once the transport
// joined its io threads they run inline instead). Writes run on whichever
// thread sends, under mutex_ (see Note [TCP transport wire format] for
// why). The fd is closed only under mutex_, after failed_ is set, so a
// writer never writes to a reused fd.
class TcpConnectionImpl
    : public std::enable_shared_from_this<TcpConnectionImpl> {
 public:
  TcpConnectionImpl(
      std::shared_ptr<TcpContext> context,
      Role role,
      uint64_t id,
      Strand strand,
      Socket socket,
      std::string peer);

  // ---- Any thread ----

  // Throws c10::Error if called twice. onError runs (on the strand) if the
  // connection failed already.
  void start(
      Connection::ReceiveCallback onMessage,
      Connection::ErrorCallback onError);
  // See TcpTransport for where `done` runs.
  void send(Message&& message, Connection::SendCallback done);
  // Fails the connection; tells the peer with a kClose frame when that can
  // go out without waiting.
  void close(const std::string& why);
  std::string describe() const;
  uint64_t heartbeatMisses() const {
    return heartbeatMisses_.load(std::memory_order_relaxed);
  }
  // The first error sticks: pending sends fail with it, the socket shuts
  // down (which ends the pending read), onError runs on the strand.
  // Returns the error that stuck.
  TransportError fail(const TransportError& error);

  // ---- Starting, on the strand ----

  void connectFromLoop(const boost::asio::ip::tcp::endpoint& endpoint);
  void acceptFromLoop();

 private:
  bool authenticates() const {
    return !context_->options.sharedSecret.empty();
  }
  // On strand_, or inline once the io threads were joined.
  bool inLoop() const;
  // Runs `task` on the strand, or inline once no io thread is left.
  template <typename Task>
  void runOnStrand(Task task);
  void scheduleReport();
  bool setUpSocketFromLoop();
  // Closes the socket, stops the timers and runs onError once (if started).
  void reportFromLoop();

  // ---- Writing, on any thread ----

  void enqueue(OutFrame frame, bool isData);
  void finishWrites(std::vector<OutFrame>& completed, int writeErrno);
  // flushLocked(), and when the socket is full, marks that the rest waits
  // for writability (*mustWait: the caller arms the wait once unlocked).
  // Returns 0 or the errno of a failed write.
  int flushOrAwaitLocked(std::vector<OutFrame>& completed, bool* mustWait);
  // Writes what the socket takes without blocking. Returns 0 when the
  // queue is empty, EAGAIN when the socket is full, else the errno.
  int flushLocked(std::vector<OutFrame>& completed);

  // ---- Writing, on the strand (only when the socket was full) ----

  void awaitWritableFromLoop();
  void onWritableFromLoop(const AsioError& ec);

  // ---- Reading, on the strand ----

  struct ReadProgress;
  void readFrameHeaderFromLoop();
  // Reads a body of `bytes` into body_, then runs `then` on the strand.
  template <typename Then>
  void readBodyFromLoop(size_t bytes, Then then);
  void beginReadingFromLoop();
  void failFromNetworkFromLoop(const AsioError& ec);
  void violationFromLoop(const std::string& what);
  void handshakeFailedFromLoop(const std::string& what);
  void onFrameHeaderFromLoop(const AsioError& ec);
  void onControlFrameFromLoop(const FrameHeader& header);
  void onDataFrameFromLoop(const FrameHeader& header);
  void onLengthsFromLoop();
  // Whether tensor `i` of the frame being read comes by address.
  bool byAddressFromLoop(size_t i) const;
  // Allocates the message the lengths (already validated) describe and
  // reads its inline parts.
  void readPayloadFromLoop();
  // Copies the tensors that came by address out of the peer, acks them so
  // the peer may free them, and delivers.
  void finishPayloadFromLoop(Message&& message);
  void deliverFromLoop(Message&& message);

  // ---- Handshake, on the strand (Note [TCP transport handshake]) ----

  void armHandshakeTimerFromLoop();
  void sendHelloFromLoop();
  void onHandshakeFrameFromLoop(const FrameHeader& header);
  void onHelloFromLoop();
  void onWelcomeFromLoop();
  void onProofFromLoop();
  // Parses body_ as `type`, records the peer's name and host section.
  // False (the handshake failed) if it is refused.
  bool readGreetingFromLoop(FrameType type, Greeting& greeting);
  void completeHandshakeFromLoop();
  void handOverFromLoop();

  // ---- Same-host zero copy, on the strand ----

  // kCmaProbe, kCmaResult or kAck, whose body is in body_.
  void onCmaBodyFromLoop(FrameType type);
  void onAckFromLoop();
  void onCmaProbeFromLoop();
  void onCmaResultFromLoop();

  // ---- Liveness, on the strand ----

  void armHeartbeatFromLoop();
  void onHeartbeatTimerFromLoop();

  const std::shared_ptr<TcpContext> context_;
  const uint64_t id_;
  Strand strand_;
  Socket socket_;
  Timer handshakeTimer_;
  Timer heartbeatTimer_;

  // Strand only.
  unsigned char frameHeader_[kFrameHeaderBytes];
  size_t bodyBytes_ = 0;
  std::vector<uint64_t> lengths_;
  std::string body_; // handshake and control bodies
  HandshakeState handshake_;
  bool reading_ = false;
  std::string peerName_;
  Clock::time_point lastReceive_ = Clock::now();
  // Written on the strand, read by metrics on any thread.
  std::atomic<uint64_t> heartbeatMisses_{0};
  SameHostState sameHost_;
  bool dataCma_ = false; // the frame being read is kDataCma
  std::vector<uint64_t> cmaWords_; // its id, then an address per tensor

  mutable std::mutex mutex_;
  std::string describe_;
  bool open_ = false; // handshake passed: data frames may go out
  bool started_ = false;
  bool failed_ = false;
  bool reported_ = false;
  bool socketClosed_ = false;
  TransportError error_;
  int fd_ = -1; // the socket's fd while it may be written to
  std::deque<OutFrame> queue_; // being written, in order
  std::deque<OutFrame> pendingData_; // sent before the handshake passed
  bool waitingWritable_ = false; // an io thread finishes the queue
  bool wroteSinceTick_ = false;
  bool peerReadsUs_ = false; // we may send kDataCma
  uint64_t nextCmaId_ = 0;
  // Tensors the peer reads from our memory, by message id, until its ack.
  std::map<uint64_t, std::vector<at::Tensor>> awaitingAck_;
  // Touched on the strand only once started.
  Connection::ReceiveCallback onMessage_;
  Connection::ErrorCallback onError_;
};

// What the user holds: dropping it closes the connection, as with a socket.
class TcpConnection : public Connection {
 public:
  explicit TcpConnection(std::shared_ptr<TcpConnectionImpl> impl)
      : impl_(std::move(impl)) {}

  ~TcpConnection() override;

  void start(ReceiveCallback onMessage, ErrorCallback onError) override;
  void send(Message&& message, SendCallback done) override;
  void close() override;
  std::string describe() const override;
  uint64_t heartbeatMisses() const override;

 private:
  const std::shared_ptr<TcpConnectionImpl> impl_;
};

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
