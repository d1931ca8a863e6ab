#pragma once

// One TCP connection: its write queue (written from the sending thread),
// its read state machine on a strand (handshake, control and data frames),
// heartbeats, and the first error that sticks. connection.cpp implements
// all but the read state machine, which is connection_reader.cpp.

#include <c10/util/Exception.h>

#include <boost/asio/basic_stream_socket.hpp>
#include <boost/asio/basic_waitable_timer.hpp>
#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/io_context.hpp>
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
#include "torchrpc/rpc/transport/tcp/endpoints.h"
#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/tcp/handshake.h"
#include "torchrpc/rpc/transport/tcp/same_host.h"
#include "torchrpc/rpc/transport/tcp/shared_ring.h"
#include "torchrpc/rpc/transport/tcp/shared_segments.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

using Clock = std::chrono::steady_clock;
using Strand = boost::asio::strand<boost::asio::io_context::executor_type>;
// TCP or a local socket (Note [Local sockets for peers on this host]).
using Socket = boost::asio::
    basic_stream_socket<boost::asio::generic::stream_protocol, Strand>;
using Timer = boost::asio::
    basic_waitable_timer<Clock, boost::asio::wait_traits<Clock>, Strand>;
using AsioError = boost::system::error_code;

// Note [Shared rings for small frames]: the largest frame a connection
// writes to a ring of `capacity` bytes (a larger one goes by socket, where
// two copies cost no more), and the largest record a reader accepts.
inline size_t ringFrameMaxBytes(size_t capacity) {
  return capacity / 4;
}
// The largest ring a writer maps (address space, not memory).
constexpr size_t kMaxSharedRingBytes = size_t(16) << 20;

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

// Note [Buffered frame reads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A frame has up to five parts (header, tensor lengths, zero-copy words,
// body, tensors), and reading each with its own exact-size read cost a
// recvmsg and a strand hand-off per part: three to five per message, and
// as many again per message when pipelined replies queue up. Instead, a
// connection reads what the socket has into its read buffer (64 KiB once
// the handshake passed, enough for one handshake frame before) and parses
// every complete part in it, in a loop, before it reads again: a one-
// element call costs one read, and a read that brings forty replies
// delivers forty. Frames that the handlers send back on the same
// connection meanwhile (replies of cheap functions, acks) wait until the
// read is parsed and then go out in one write, so forty replies cost one
// sendmsg too, but never more than kCorkMaxFrames in one: a read of a
// whole window of pipelined requests would otherwise hold the first reply
// until the last request was handled, and the caller, with nothing to
// read meanwhile, would idle while we work and we while it works. Writing
// every kCorkMaxFrames replies lets both sides work at once. Only a part whose
// missing bytes are large (at least kDirectReadBytes) is read straight into its
// destination, so a big tensor still lands in its storage without a copy, while
// a small one is copied out of the buffer (counted as copied, not zero-copy,
// bytes).
//
// The caps of Note [TCP transport wire format] are checked as before,
// before anything a frame announces is allocated; the buffer itself is
// fixed, so a peer cannot make it grow. A socket read is issued only when
// the buffer is empty; bytes read ahead of where the reader stops (the
// handshake passed but the connection is not started yet) wait in it.

// Note [A waiter leaves its next read to the loop]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A caller that waits for its answer runs the loop itself (Note [Waiting
// callers drive the transport] in rpc/detail/wait_drivers.h), so the read
// that brings the answer runs on its thread. Once the read is parsed the
// connection asks for the next one, and Asio tries that read at once: on a
// socket just drained it finds nothing (a recvfrom returning EAGAIN), and
// before this note Asio's poll() then turned the reactor once more (an
// epoll_wait finding nothing) before the waiter could return. Both ran
// after the answer had come and before the caller got it: two system
// calls, 2.4 µs on a machine where one costs 1.1-1.3 µs (bench/RESULTS.md,
// "A kernel six to nine times dearer"). So a waiter runs one handler
// per step and checks its future in between, and when a read is parsed on
// a waiter's thread the next read is posted to the connection's strand
// rather than started: the waiter returns with its answer, and the read
// starts at the loop's next turn, run by the next waiter or by the io
// thread (as soon as it would read a message that arrives after a wait:
// Note [Waiting callers drive the transport]).
// Nothing is missed meanwhile: bytes that arrive while no read is queued
// stay in the socket, and Asio's reactor, which saw their readiness with
// no operation waiting, tries the posted read on the socket before it
// waits for readiness again. The io thread starts its reads at once, as
// before.

// Note [Sends held for one write]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A caller with many calls outstanding (a window of pipelined requests)
// wrote each request with its own sendmsg, and over loopback a sendmsg
// also runs the receiver's TCP input path on the sending thread: in a
// window of 64 calls, 64% of the caller's time went to sendmsg. So while
// this process awaits many replies (IoPolling::holdsSends(): polling on,
// at least kHoldMinAwaited replies due, so the peer has work queued
// anyway), a small data frame sent from outside this connection's read
// loop joins the write queue without a write, and the first one held
// posts a flush to the transport's loop. Whoever runs the loop next
// writes everything held in one sendmsg: the caller's own next wait,
// which drives the loop (Note [Waiting callers drive the transport] in
// rpc/detail/wait_drivers.h), so the requests a caller issued between two
// waits go out together; else an io thread that polls (at once), stands
// by for drivers (within kDriverLinger) or sleeps in epoll (the post
// wakes it). Any write on the connection (a big frame, the
// kHoldMaxFrames-th held one, a frame sent from the read loop, close())
// takes the held frames with it, in order. The price: an asynchronous
// request sent in dense traffic may wait until its caller's next wait or
// the loop's next turn, at most about 0.2 ms, before it is written. A
// wait that gets its answer first leaves a flush queued behind it to that
// next wait or turn too (a waiter runs one handler per step: Note [A
// waiter leaves its next read to the loop]).

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
  // Connected over a local socket rather than TCP.
  bool overLocalSocket() const {
    return overLocalSocket_.load(std::memory_order_relaxed);
  }
  // The first error sticks: pending sends fail with it, the socket shuts
  // down (which ends the pending read), onError runs on the strand.
  // Returns the error that stuck.
  TransportError fail(const TransportError& error);

  // ---- Starting ----

  // Start connecting, or the handshake of an accepted socket, on the
  // strand. Safe to race with TcpTransport::join(): once the io threads
  // are gone the start runs inline, finds the connection failed by close()
  // and does nothing, so no operation is left queued on a loop nobody runs
  // (it would hold this connection, and through it the io_context, for
  // good).
  // Tries `endpoints` in order (a local socket, then TCP: Note [Local
  // sockets for peers on this host]); the connection fails if none
  // connects.
  void startConnecting(std::vector<Endpoint> endpoints);
  void startAccepted();

 private:
  // Nothing starts on a connection that failed (closed before its start
  // ran): it would open a socket and arm a timer nobody waits for. The same
  // holds for every operation started from outside the io threads
  // (beginReadingFromLoop, awaitWritableFromLoop).
  // Connects to endpoints[next], then to the next one if that fails.
  void connectFromLoop(std::vector<Endpoint> endpoints, size_t next);
  void acceptFromLoop();
  bool failedAlready() const;

  bool authenticates() const {
    return !context_->options.sharedSecret.empty();
  }
  // Shared memory segments are on (Note [TCP same-host shared memory]).
  bool sharesMemory() const {
    return context_->options.sharedMemoryMaxBytes > 0;
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

  // `mayUseRing`: a kData frame, which may go through the peer's shared
  // ring instead (Note [Shared rings for small frames]).
  void enqueue(OutFrame frame, bool isData, bool mayUseRing = false);
  // Writes `frame` into the peer's ring, with the bell's frame queued
  // (`rang`) if the peer sleeps. False if it must go by socket (too large,
  // the ring full); `corrupt` then says why the ring cannot be used.
  bool pushToRingLocked(OutFrame& frame, bool& rang, std::string& corrupt);
  // Posts flushQueue() to the loop, or runs it once no io thread is left
  // (Note [Sends held for one write]).
  void postFlush();
  // Writes what the queue holds (frames held by enqueue() or while
  // corked_), unless a write is pending on writability.
  void flushQueue();
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

  // ---- Reading, on the strand (Note [Buffered frame reads]) ----

  struct ReadProgress;
  // What to do once the destinations in fill_ are filled.
  using ReadStep = void (TcpConnectionImpl::*)();
  // One destination of the bytes being read; `tensor` marks a tensor's
  // storage, for the zero-copy vs copied count.
  struct FillTarget {
    char* data;
    size_t bytes;
    bool tensor;
  };
  // Fills fill_ (set by the caller) from the read buffer, then from the
  // socket, and runs `then`. Steps that fill from the buffer run in a
  // loop, not nested, so a buffer of many small frames does not recurse.
  void fillThenFromLoop(ReadStep then);
  void driveReadsFromLoop();
  // Copies buffered bytes into the unfilled destinations.
  void drainReadBufferFromLoop();
  // The buffer is empty and fill_ is not full: reads into the buffer, or
  // straight into the destinations when what is missing is large.
  void startSocketReadFromLoop();
  // Starts the read into the buffer (capacity already set).
  void readIntoBufferFromLoop();
  // Writes what was sent on this connection from its own read loop while
  // corked_ (Note [Buffered frame reads]: the replies to one read's
  // requests go out in one write).
  void uncorkFromLoop();
  void onBufferedReadFromLoop(const AsioError& ec, size_t bytes);
  void onDirectReadFromLoop(const AsioError& ec);
  void readFrameHeaderFromLoop();
  // Reads a body of `bytes` into body_ (a handshake or control frame of
  // type bodyType_), then runs `then`.
  void readBodyFromLoop(size_t bytes, ReadStep then);
  void beginReadingFromLoop();
  void failFromNetworkFromLoop(const AsioError& ec);
  void violationFromLoop(const std::string& what);
  void handshakeFailedFromLoop(const std::string& what);
  void onFrameHeaderFromLoop();
  void onControlFrameFromLoop(const FrameHeader& header);
  void onDataFrameFromLoop(const FrameHeader& header);
  void onLengthsFromLoop();
  void onCmaWordsFromLoop();
  // Where tensor `i` of the frame being read comes from: its shared
  // segment (0: none) and the word that goes with it (Note [TCP same-host
  // shared memory]).
  uint64_t segmentOfFromLoop(size_t i) const;
  uint64_t wordOfFromLoop(size_t i) const;
  // Whether tensor `i` of the frame being read comes by address.
  bool byAddressFromLoop(size_t i) const;
  // Allocates the message the lengths (already validated) describe into
  // incoming_ and reads its inline parts.
  void readPayloadFromLoop();
  void onPayloadFromLoop();
  // Copies the tensors that came by address out of the peer, acks them so
  // the peer may free them, and delivers.
  void finishPayloadFromLoop(Message&& message);
  void deliverFromLoop(Message&& message);

  // ---- Handshake, on the strand (Note [TCP transport handshake]) ----

  void armHandshakeTimerFromLoop();
  void sendHelloFromLoop();
  void onHandshakeFrameFromLoop(const FrameHeader& header);
  // The body of handshake frame bodyType_ is in body_.
  void onHandshakeBodyFromLoop();
  void onHelloFromLoop();
  void onWelcomeFromLoop();
  void onProofFromLoop();
  // Parses body_ as `type`, records the peer's name and host section.
  // False (the handshake failed) if it is refused.
  bool readGreetingFromLoop(FrameType type, Greeting& greeting);
  void completeHandshakeFromLoop();
  void handOverFromLoop();

  // ---- Same-host zero copy, on the strand ----

  // bodyType_ is kCmaProbe, kCmaResult or kAck, whose body is in body_.
  void onCmaBodyFromLoop();
  void onAckFromLoop();
  void onCmaProbeFromLoop();
  void onCmaResultFromLoop();

  // ---- Shared rings, on the strand (Note [Shared rings for small
  // frames] in tcp/shared_ring.h) ----

  // As reader: makes our ring, watches it, and offers it to the peer,
  // which maps our memfds (peerMapsUs_).
  void offerRingFromLoop();
  // As writer: maps the ring whose fd is in body_ (kRingOffer).
  void onRingOfferFromLoop();
  // Whether the reader is at a frame's start (the next bytes it takes are
  // a frame header).
  bool atFrameStartFromLoop() const;
  // At a frame's start: when the record the ring holds for this place in
  // the socket's order is there, its frames are read next. False if the
  // ring broke the protocol (the connection failed).
  bool takeDueRingRecordFromLoop();
  // Whether a record is due at this place (peeked, not taken).
  bool ringRecordDueFromLoop();
  // A polling thread saw records in our ring: read them now if the reader
  // waits at a frame's start, else they are read there.
  void onRingRecordsFromLoop();

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
  FrameType bodyType_ = FrameType::kData; // the frame whose body_ is read
  HandshakeState handshake_;
  bool reading_ = false;
  std::string peerName_;
  Clock::time_point lastReceive_ = Clock::now();
  // Written on the strand, read by metrics on any thread.
  std::atomic<uint64_t> heartbeatMisses_{0};
  std::atomic<bool> overLocalSocket_{false};
  SameHostState sameHost_;
  bool dataCma_ = false; // the frame being read is kDataCma or kDataShared
  bool dataShared_ = false; // ... kDataShared
  // Its id, then per tensor an address (kDataCma) or {segment, word}
  // (kDataShared).
  std::vector<uint64_t> cmaWords_;
  // The peer's segments we mapped.
  SegmentReceiver segmentsIn_;
  Message incoming_; // the data frame being read; its buffers are in fill_
  // The read buffer: bytes read off the socket and not yet parsed are
  // readBuffer_[readBegin_, readEnd_). Allocated at the first read, small
  // until the handshake passed.
  std::unique_ptr<char[]> readBuffer_;
  size_t readCapacity_ = 0;
  size_t readBegin_ = 0;
  size_t readEnd_ = 0;
  std::vector<FillTarget> fill_;
  size_t fillIndex_ = 0; // the first destination not full
  size_t fillOffset_ = 0; // bytes already in fill_[fillIndex_]
  uint64_t fillCopiedTensorBytes_ = 0;
  ReadStep fillThen_ = nullptr;
  bool drivingReads_ = false;
  // Frames sent from this strand while it parses a read wait in queue_
  // until the read is parsed (uncorkFromLoop).
  bool corked_ = false;
  // A socket read is started or posted and has not completed.
  bool socketReadPending_ = false;
  // Frames whose header came off the socket: the place in the socket's
  // order that a ring record's tag names (Note [Shared rings for small
  // frames]).
  uint64_t socketFramesRead_ = 0;
  // Our ring (null: none), its watch entry, and the record being read:
  // while readingRing_, frames are read from ringRecord_[ringBegin_,
  // ringEnd_) instead of the socket.
  std::shared_ptr<SharedRingReader> ringIn_;
  uint64_t ringWatchId_ = 0;
  std::unique_ptr<char[]> ringRecord_;
  size_t ringBegin_ = 0;
  size_t ringEnd_ = 0;
  bool readingRing_ = false;
  bool gotRingOffer_ = false; // as writer
  // Our ring's bytes in the shared memory budget, until the ring goes.
  SharedMemoryCharge ringCharge_;

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
  // A flushQueue() is posted for frames held in queue_ (Note [Sends held
  // for one write]).
  bool flushPosted_ = false;
  bool wroteSinceTick_ = false;
  bool peerReadsUs_ = false; // we may send kDataCma
  bool peerMapsUs_ = false; // we may send kDataShared
  uint64_t nextCmaId_ = 0;
  // Tensors the peer reads from our memory, by message id, until its ack.
  std::map<uint64_t, std::vector<at::Tensor>> awaitingAck_;
  // Our segments the peer maps (thread-safe; used once peerMapsUs_).
  SegmentSender segmentsOut_;
  // Frames put in queue_ since the connection began, the tag of a frame
  // written to the peer's ring (ringOut_, once it offered one).
  uint64_t socketFramesQueued_ = 0;
  std::unique_ptr<SharedRingWriter> ringOut_;
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
