#include "torchrpc/rpc/transport/tcp/connection.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "torchrpc/rpc/log_level.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace asio = boost::asio;
namespace ip = boost::asio::ip;

namespace {

// sendmsg takes at most IOV_MAX (1024) pieces; a frame has two plus one
// per tensor, so this covers a write of kHoldMaxFrames one-tensor frames.
constexpr size_t kMaxIovecs = 256;

// Note [Sends held for one write]: which frames may be held (a request
// of a one-element tensor is about 150 bytes), and how many at most: half
// of a 64-call window, so that the peer works on one half while the
// caller issues the other (see kCorkMaxFrames).
constexpr size_t kHoldMaxFrameBytes = 4096;
constexpr size_t kHoldMaxFrames = 32;

// Note [Buffered frame reads]: at most this many frames sent from the read
// loop wait for the read to be parsed; the next one writes them all. Of
// the counts tried with 64 calls outstanding (64, 32, 16), 32 gave the
// most calls per second; a reply waits behind at most 31 handlers.
constexpr size_t kCorkMaxFrames = 32;

// A frame goes through the peer's ring only if it has at most this many
// pieces (prefix, body, a tensor each).
constexpr size_t kMaxRingPieces = 34;

} // namespace

TcpConnectionImpl::TcpConnectionImpl(
    std::shared_ptr<TcpContext> context,
    Role role,
    uint64_t id,
    Strand strand,
    Socket socket,
    std::string peer)
    : context_(std::move(context)),
      id_(id),
      strand_(std::move(strand)),
      socket_(std::move(socket)),
      handshakeTimer_(strand_),
      heartbeatTimer_(strand_),
      handshake_(role),
      segmentsIn_(context_->options.limits.maxMessageBytes),
      describe_(std::move(peer)),
      segmentsOut_(
          context_->segmentBytes,
          context_->options.sharedMemoryMaxBytes,
          &context_->copier) {}

// ---- Any thread ----

void TcpConnectionImpl::start(
    Connection::ReceiveCallback onMessage,
    Connection::ErrorCallback onError) {
  bool failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!started_, "Connection::start() called twice");
    started_ = true;
    onMessage_ = std::move(onMessage);
    onError_ = std::move(onError);
    failed = failed_;
  }
  if (failed) {
    scheduleReport();
    return;
  }
  auto self = shared_from_this();
  runOnStrand([self]() { self->beginReadingFromLoop(); });
}

void TcpConnectionImpl::send(Message&& message, Connection::SendCallback done) {
  for (const at::Tensor& tensor : message.tensors) {
    TORCH_CHECK(
        tensor.device().is_cpu() && tensor.is_contiguous(),
        "TcpTransport sends contiguous CPU tensors only");
  }
  if (message.header.size() > std::numeric_limits<uint32_t>::max() ||
      message.tensors.size() > std::numeric_limits<uint32_t>::max()) {
    TransportError error{
        ErrorCode::kTooLarge,
        "message to " + describe() + " does not fit a TCP frame"};
    done(&error);
    return;
  }
  const size_t count = message.tensors.size();
  uint64_t tensorBytes = 0;
  const size_t minBytes =
      std::max<size_t>(1, context_->options.zeroCopyMinBytes);
  std::vector<size_t> lengths(count);
  bool anyLarge = false;
  for (size_t i = 0; i < count; ++i) {
    lengths[i] = message.tensors[i].nbytes();
    tensorBytes += lengths[i];
    anyLarge = anyLarge || lengths[i] >= minBytes;
  }
  // Large tensors go through a shared segment once the peer maps ours
  // (copied in here, on the sending thread), else by address once it
  // proved it can read us; those wait in awaitingAck_ (registered before
  // the frame can go out, so the ack always finds them). See Note [TCP
  // same-host zero copy] and Note [TCP same-host shared memory].
  uint64_t id = 0;
  std::vector<uint64_t> addresses; // empty: a kData frame
  std::vector<uint64_t> segments; // empty: no tensor in a segment
  uint64_t copiedBytes = 0;
  if (anyLarge) {
    bool mapsUs;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      mapsUs = peerMapsUs_ && !failed_;
    }
    if (mapsUs) {
      for (size_t i = 0; i < count; ++i) {
        if (lengths[i] < minBytes) {
          continue;
        }
        std::optional<SegmentPlacement> placed;
        {
          BulkCopyScope bulk(
              context_->polling,
              context_->copier.sharesCopyOf(lengths[i]));
          placed = segmentsOut_.copyIn(message.tensors[i]);
        }
        if (!placed) {
          continue; // by address instead
        }
        if (segments.empty()) {
          segments.assign(count, 0);
          addresses.assign(count, 0);
        }
        segments[i] = placed->segment;
        addresses[i] = static_cast<uint64_t>(placed->fd);
        copiedBytes += lengths[i];
        message.tensors[i] = at::Tensor();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (peerReadsUs_ && !failed_) {
      std::vector<at::Tensor> kept;
      for (size_t i = 0; i < count; ++i) {
        at::Tensor& tensor = message.tensors[i];
        if (lengths[i] >= minBytes && tensor.defined()) {
          if (addresses.empty()) {
            addresses.assign(count, 0);
          }
          addresses[i] = reinterpret_cast<uintptr_t>(tensor.data_ptr());
          kept.push_back(std::move(tensor));
        }
      }
      id = nextCmaId_++;
      if (!kept.empty()) {
        awaitingAck_[id] = std::move(kept);
      }
    }
  }
  context_->tensorBytes.fetch_add(
      tensorBytes - copiedBytes,
      std::memory_order_relaxed);
  context_->copiedTensorBytes.fetch_add(copiedBytes, std::memory_order_relaxed);
  OutFrame frame;
  frame.prefix = encodeDataPrefix(
      static_cast<uint32_t>(message.header.size()),
      lengths,
      id,
      addresses,
      segments);
  frame.total = frame.prefix.size() + message.header.size();
  if (addresses.empty()) {
    // Every tensor is written: the frame takes the message's vector.
    frame.total += tensorBytes;
    frame.tensors = std::move(message.tensors);
  } else {
    for (size_t i = 0; i < count; ++i) {
      // Tensors by address or in a segment are not written.
      if (addresses[i] == 0 && (segments.empty() || segments[i] == 0)) {
        frame.total += lengths[i];
        frame.tensors.push_back(std::move(message.tensors[i]));
      }
    }
  }
  frame.body = std::move(message.header);
  frame.done = std::move(done);
  // A frame with tensors by address or in segments stays on the socket:
  // its acks and segment checks are the socket path's.
  enqueue(std::move(frame), /*isData=*/true, /*mayUseRing=*/addresses.empty());
  // Only now, with the frame written or queued, may an io thread asleep in
  // epoll be woken to poll for the reply (and after any copy above, which
  // a polling thread would have taken a core from). On a virtual machine
  // that wake-up is the dearest step of a send after a quiet spell when it
  // is the one that brings an idle vCPU back (45-75 us, against about 8-12
  // once the vCPU is awake; bench/RESULTS.md, "The first wake-up after
  // computing"): made before the write, it delayed the very message the
  // peer waits for. Made after it, the peer's wake-up has usually brought
  // the other vCPU back already.
  context_->polling.noteSend();
}

void TcpConnectionImpl::close(const std::string& why) {
  std::vector<OutFrame> completed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      return;
    }
    if (open_ && !queue_.empty() && !waitingWritable_ && fd_ >= 0) {
      // Frames held for a write (Note [Sends held for one write]) go out
      // first, as far as the socket takes them without waiting.
      (void)flushLocked(completed);
    }
    if (open_ && queue_.empty() && !waitingWritable_ && fd_ >= 0) {
      std::string frame = encodeFrameHeader(FrameType::kClose, 0, 0);
      // Best effort: the EOF that follows says the same.
      (void)::send(
          fd_,
          frame.data(),
          frame.size(),
          MSG_NOSIGNAL | MSG_DONTWAIT);
    }
  }
  for (OutFrame& frame : completed) {
    if (frame.done) {
      frame.done(nullptr);
    }
  }
  fail(TransportError{
      ErrorCode::kWorkerUnavailable,
      "connection to " + describe() + " " + why});
}

std::string TcpConnectionImpl::describe() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return describe_;
}

TransportError TcpConnectionImpl::fail(const TransportError& error) {
  std::deque<OutFrame> dropped;
  // No ack comes after a failure: the peer no longer reads our memory.
  std::map<uint64_t, std::vector<at::Tensor>> unacked;
  TransportError sticky;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_) {
      failed_ = true;
      first = true;
      error_ = error;
      unacked = std::move(awaitingAck_);
      awaitingAck_.clear();
      dropped = std::move(queue_);
      queue_.clear();
      for (OutFrame& frame : pendingData_) {
        dropped.push_back(std::move(frame));
      }
      pendingData_.clear();
      if (fd_ >= 0) {
        ::shutdown(fd_, SHUT_RDWR);
      }
    }
    sticky = error_;
  }
  if (first) {
    for (OutFrame& frame : dropped) {
      if (frame.done) {
        frame.done(&sticky);
      }
    }
    scheduleReport();
  }
  return sticky;
}

// ---- Starting, on the strand ----

void TcpConnectionImpl::startConnecting(std::vector<Endpoint> endpoints) {
  auto self = shared_from_this();
  runOnStrand([self, endpoints = std::move(endpoints)]() mutable {
    self->connectFromLoop(std::move(endpoints), 0);
  });
}

void TcpConnectionImpl::startAccepted() {
  auto self = shared_from_this();
  runOnStrand([self]() { self->acceptFromLoop(); });
}

bool TcpConnectionImpl::failedAlready() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_;
}

void TcpConnectionImpl::connectFromLoop(
    std::vector<Endpoint> endpoints,
    size_t next) {
  TORCHRPC_ASSERT_IN_LOOP();
  if (failedAlready()) {
    return;
  }
  if (next == 0) {
    armHandshakeTimerFromLoop();
  }
  const Endpoint endpoint = endpoints.at(next);
  auto self = shared_from_this();
  socket_.async_connect(
      endpoint,
      [self, endpoints = std::move(endpoints), next](
          const AsioError& ec) mutable {
        if (ec && next + 1 < endpoints.size() &&
            ec != asio::error::operation_aborted) {
          // Note [Local sockets for peers on this host]: the local socket
          // is gone or refused; TCP may still answer.
          TORCHRPC_LOG(kInfo) << "TcpConnection to " << self->describe()
                              << ": local socket refused (" << ec.message()
                              << "); connecting over TCP";
          AsioError ignored;
          self->socket_.close(ignored);
          self->connectFromLoop(std::move(endpoints), next + 1);
          return;
        }
        if (ec) {
          self->fail(TransportError{
              ErrorCode::kWorkerUnavailable,
              "cannot connect to " + self->describe() + ": " + ec.message()});
          return;
        }
        if (!self->setUpSocketFromLoop()) {
          return;
        }
        self->sendHelloFromLoop();
        self->readFrameHeaderFromLoop();
      });
}

void TcpConnectionImpl::acceptFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  if (failedAlready()) {
    return;
  }
  armHandshakeTimerFromLoop();
  if (setUpSocketFromLoop()) {
    readFrameHeaderFromLoop();
  }
}

bool TcpConnectionImpl::inLoop() const {
  return strand_.running_in_this_thread() || context_->joined.load();
}

template <typename Task>
void TcpConnectionImpl::runOnStrand(Task task) {
  context_->runOnLoop(strand_, task);
}

void TcpConnectionImpl::scheduleReport() {
  auto self = shared_from_this();
  runOnStrand([self]() { self->reportFromLoop(); });
}

bool TcpConnectionImpl::setUpSocketFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  AsioError ec;
  const Endpoint remote = socket_.remote_endpoint(ec);
  const bool local = !ec && isLocal(remote);
  if (!ec && !local) {
    socket_.set_option(ip::tcp::no_delay(true), ec);
  }
  // NB: SO_SNDBUF/SO_RCVBUF stay at the kernel's autotuned defaults: fixing
  // them (1 or 4 MiB) measured slower for 64 MiB messages here.
  std::string peer;
  if (!ec) {
    peer = describeEndpoint(remote, socket_.native_handle());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (failed_) {
    return false;
  }
  fd_ = socket_.native_handle();
  overLocalSocket_.store(local, std::memory_order_relaxed);
  if (handshake_.role == Role::kServer && !peer.empty()) {
    describe_ = local ? peer : "peer at " + peer;
  }
  return true;
}

void TcpConnectionImpl::reportFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  Connection::ErrorCallback onError;
  Connection::ReceiveCallback onMessage;
  TransportError error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!socketClosed_) {
      socketClosed_ = true;
      fd_ = -1;
      AsioError ignored;
      socket_.close(ignored);
    }
    if (started_ && !reported_) {
      reported_ = true;
      onError = std::move(onError_);
      onError_ = nullptr;
      // The callbacks often capture this connection: break the cycle.
      onMessage = std::move(onMessage_);
      onMessage_ = nullptr;
    }
    error = error_;
  }
  handshakeTimer_.cancel();
  heartbeatTimer_.cancel();
  if (ringWatchId_ != 0) {
    context_->rings.remove(ringWatchId_);
    ringWatchId_ = 0;
  }
  // Nothing reads our ring any more: its memory and its share of the
  // budget go now, not when the last handle on this connection does.
  ringIn_.reset();
  ringRecord_.reset();
  readingRing_ = false;
  ringCharge_ = SharedMemoryCharge();
  context_->forget(id_);
  if (onError) {
    onError(error);
  }
}

// ---- Writing, on any thread ----

void TcpConnectionImpl::enqueue(OutFrame frame, bool isData, bool mayUseRing) {
  std::vector<OutFrame> completed;
  TransportError error;
  bool failedAlready = false;
  bool mustWait = false;
  int writeErrno = 0;
  bool inRing = false;
  bool rang = false;
  std::string ringCorrupt;
  // Sent from this connection's own read loop while it parses a read: the
  // loop writes it with the rest (uncorkFromLoop). corked_ is read on the
  // strand only.
  const bool onStrand = strand_.running_in_this_thread();
  const bool corked = onStrand && corked_;
  // Sent from elsewhere in dense traffic: held for the loop's next turn
  // (Note [Sends held for one write]).
  const bool mayHold = isData && !onStrand &&
      frame.total <= kHoldMaxFrameBytes && context_->polling.holdsSends();
  bool post = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      failedAlready = true;
      error = error_;
    } else if (isData && !open_) {
      // Data waits for the handshake.
      pendingData_.push_back(std::move(frame));
      return;
    } else if (
        mayUseRing && ringOut_ != nullptr &&
        pushToRingLocked(frame, rang, ringCorrupt)) {
      inRing = true;
      // The bell goes now (with any frames held before it), unless a
      // pending write or the read loop's uncork takes it.
      if (rang && !waitingWritable_ &&
          !(corked && queue_.size() < kCorkMaxFrames)) {
        writeErrno = flushOrAwaitLocked(completed, &mustWait);
      }
    } else if (!ringCorrupt.empty()) {
      failedAlready = true;
      error = TransportError{
          ErrorCode::kMalformedMessage,
          "connection to " + describe_ + ": " + ringCorrupt};
    } else {
      queue_.push_back(std::move(frame));
      ++socketFramesQueued_;
      if (waitingWritable_ || (corked && queue_.size() < kCorkMaxFrames)) {
        // Written by the pending write, or once the read is parsed.
      } else if (mayHold && queue_.size() < kHoldMaxFrames) {
        post = !flushPosted_;
        flushPosted_ = true;
      } else {
        writeErrno = flushOrAwaitLocked(completed, &mustWait);
      }
    }
  }
  if (failedAlready) {
    if (frame.done) {
      frame.done(&error);
    }
    if (!ringCorrupt.empty()) {
      fail(error);
    }
    return;
  }
  if (inRing) {
    if (frame.done) {
      frame.done(nullptr);
    }
    if (mustWait) {
      auto self = shared_from_this();
      runOnStrand([self]() { self->awaitWritableFromLoop(); });
    }
    finishWrites(completed, writeErrno);
    return;
  }
  if (post) {
    postFlush();
    context_->polling.noteHeldSend();
    return;
  }
  if (mustWait) {
    auto self = shared_from_this();
    runOnStrand([self]() { self->awaitWritableFromLoop(); });
  }
  finishWrites(completed, writeErrno);
}

bool TcpConnectionImpl::pushToRingLocked(
    OutFrame& frame,
    bool& rang,
    std::string& corrupt) {
  // Larger frames are cheaper by socket (two copies either way, and the
  // ring's room is for many small ones).
  if (frame.total > ringFrameMaxBytes(ringOut_->capacity())) {
    return false;
  }
  RingPiece pieces[kMaxRingPieces];
  size_t count = 0;
  pieces[count++] = RingPiece{frame.prefix.data(), frame.prefix.size()};
  pieces[count++] = RingPiece{frame.body.data(), frame.body.size()};
  for (const at::Tensor& tensor : frame.tensors) {
    if (count == kMaxRingPieces) {
      return false;
    }
    pieces[count++] = RingPiece{tensor.data_ptr(), tensor.nbytes()};
  }
  switch (ringOut_->push(pieces, count, socketFramesQueued_)) {
    case SharedRingWriter::Push::kPushed:
      break;
    case SharedRingWriter::Push::kPushedRingBell:
      queue_.push_back(controlFrame(FrameType::kRingBell));
      ++socketFramesQueued_;
      rang = true;
      break;
    case SharedRingWriter::Push::kCorrupt:
      corrupt = ringOut_->why();
      return false;
    default:
      return false; // full or too large: by socket
  }
  wroteSinceTick_ = true;
  return true;
}

void TcpConnectionImpl::postFlush() {
  auto self = shared_from_this();
  // Not to the strand: a flush needs only mutex_, and must not wait behind
  // a read being parsed.
  auto flush = [self]() { self->flushQueue(); };
  if (!context_->postUnlessJoined(context_->io, flush)) {
    flushQueue();
  }
}

void TcpConnectionImpl::flushQueue() {
  std::vector<OutFrame> completed;
  int writeErrno = 0;
  bool mustWait = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    flushPosted_ = false;
    if (failed_ || queue_.empty() || waitingWritable_) {
      return; // nothing held, or writability will flush it
    }
    writeErrno = flushOrAwaitLocked(completed, &mustWait);
  }
  if (mustWait) {
    auto self = shared_from_this();
    runOnStrand([self]() { self->awaitWritableFromLoop(); });
  }
  finishWrites(completed, writeErrno);
}

void TcpConnectionImpl::finishWrites(
    std::vector<OutFrame>& completed,
    int writeErrno) {
  for (OutFrame& frame : completed) {
    if (frame.done) {
      frame.done(nullptr);
    }
  }
  completed.clear();
  if (writeErrno != 0) {
    fail(TransportError{
        ErrorCode::kWorkerUnavailable,
        "connection to " + describe() +
            " failed: write: " + std::strerror(writeErrno)});
  }
}

int TcpConnectionImpl::flushOrAwaitLocked(
    std::vector<OutFrame>& completed,
    bool* mustWait) {
  int writeErrno = flushLocked(completed);
  if (writeErrno == EAGAIN || writeErrno == EWOULDBLOCK) {
    waitingWritable_ = true;
    *mustWait = true;
    return 0;
  }
  return writeErrno;
}

int TcpConnectionImpl::flushLocked(std::vector<OutFrame>& completed) {
  while (!queue_.empty()) {
    iovec iov[kMaxIovecs];
    size_t count = 0;
    size_t skip = queue_.front().written;
    auto add = [&](const void* data, size_t length) {
      if (count == kMaxIovecs || length == 0) {
        return;
      }
      if (length <= skip) {
        skip -= length;
        return;
      }
      iov[count].iov_base =
          const_cast<char*>(static_cast<const char*>(data) + skip);
      iov[count].iov_len = length - skip;
      ++count;
      skip = 0;
    };
    for (const OutFrame& frame : queue_) {
      if (count == kMaxIovecs) {
        break;
      }
      add(frame.prefix.data(), frame.prefix.size());
      add(frame.body.data(), frame.body.size());
      for (const at::Tensor& tensor : frame.tensors) {
        add(tensor.data_ptr(), tensor.nbytes());
      }
    }
    msghdr header{};
    header.msg_iov = iov;
    header.msg_iovlen = count;
    ssize_t sent = ::sendmsg(fd_, &header, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) {
        continue;
      }
      return errno;
    }
    wroteSinceTick_ = true;
    size_t left = static_cast<size_t>(sent);
    while (!queue_.empty()) {
      OutFrame& front = queue_.front();
      size_t take = std::min(left, front.total - front.written);
      front.written += take;
      left -= take;
      if (front.written < front.total) {
        break;
      }
      completed.push_back(std::move(front));
      queue_.pop_front();
    }
  }
  return 0;
}

// ---- Writing, on the strand (only when the socket was full) ----

void TcpConnectionImpl::awaitWritableFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  if (failedAlready()) {
    return; // see startConnecting()
  }
  auto self = shared_from_this();
  socket_.async_wait(Socket::wait_write, [self](const AsioError& ec) {
    self->onWritableFromLoop(ec);
  });
}

void TcpConnectionImpl::onWritableFromLoop(const AsioError& ec) {
  TORCHRPC_ASSERT_IN_LOOP();
  std::vector<OutFrame> completed;
  int writeErrno = 0;
  bool again = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      return;
    }
    if (ec) {
      writeErrno = EPIPE;
    } else {
      writeErrno = flushLocked(completed);
      if (writeErrno == EAGAIN || writeErrno == EWOULDBLOCK) {
        again = true;
        writeErrno = 0;
      } else {
        waitingWritable_ = false;
      }
    }
  }
  if (again) {
    awaitWritableFromLoop();
  }
  finishWrites(completed, writeErrno);
}

// ---- Liveness, on the strand ----

void TcpConnectionImpl::armHeartbeatFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  heartbeatTimer_.expires_after(context_->options.heartbeatInterval);
  auto self = shared_from_this();
  heartbeatTimer_.async_wait([self](const AsioError& ec) {
    if (!ec) {
      self->onHeartbeatTimerFromLoop();
    }
  });
}

void TcpConnectionImpl::onHeartbeatTimerFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(
      Clock::now() - lastReceive_);
  if (silent > context_->options.heartbeatInterval) {
    heartbeatMisses_.fetch_add(1, std::memory_order_relaxed);
    context_->heartbeatMisses.fetch_add(1, std::memory_order_relaxed);
  }
  if (silent > context_->options.peerTimeout) {
    fail(TransportError{
        ErrorCode::kWorkerUnavailable,
        "connection to " + describe() + " failed: no heartbeat for " +
            std::to_string(silent.count()) + " ms"});
    return;
  }
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      return;
    }
    idle = !wroteSinceTick_ && queue_.empty();
    wroteSinceTick_ = false;
  }
  if (idle) {
    enqueue(controlFrame(FrameType::kHeartbeat), false);
    // A heartbeat is not traffic: otherwise the next tick would skip one
    // and the peer would hear from us only every other interval.
    std::lock_guard<std::mutex> lock(mutex_);
    wroteSinceTick_ = false;
  }
  armHeartbeatFromLoop();
}

// ---- TcpConnection ----

TcpConnection::~TcpConnection() {
  impl_->close("dropped by its owner");
}

void TcpConnection::start(ReceiveCallback onMessage, ErrorCallback onError) {
  impl_->start(std::move(onMessage), std::move(onError));
}

void TcpConnection::send(Message&& message, SendCallback done) {
  impl_->send(std::move(message), std::move(done));
}

void TcpConnection::close() {
  impl_->close("closed locally");
}

std::string TcpConnection::describe() const {
  return impl_->describe();
}

uint64_t TcpConnection::heartbeatMisses() const {
  return impl_->heartbeatMisses();
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
