#include "torchrpc/rpc/transport/tcp/connection.h"

// The read state machine of TcpConnectionImpl, on its strand: frame
// headers, then handshake, control or data frames. connection.cpp has the
// rest of the class (sending, failing, liveness).

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <boost/asio/read.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <utility>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/log_level.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace asio = boost::asio;

namespace {

// Bytes per recvmsg on large reads straight into a destination (asio's
// default is 64 KiB, which costs a syscall and a handler per 64 KiB of a
// large tensor).
constexpr size_t kReadChunkBytes = size_t(4) << 20;
// The read buffer once the handshake passed, and before: one handshake
// frame at most.
constexpr size_t kReadBufferBytes = size_t(64) << 10;
constexpr size_t kHandshakeReadBufferBytes =
    kFrameHeaderBytes + kMaxHandshakeBodyBytes;
// Missing bytes of a part from which it is read straight into its
// destination rather than through the buffer.
constexpr size_t kDirectReadBytes = size_t(32) << 10;

// Whether the peer process has exited: no longer there, or a zombie, whose
// descriptors are closed. A peer killed while its ring offer or a segment
// it announced is on the way leaves a descriptor we cannot open; that says
// it left (kWorkerUnavailable), not that it lied (kMalformedMessage).
bool peerProcessGone(pid_t pid) {
  if (pid <= 0) {
    return false; // no same-host peer known: nothing says it left
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) {
    return true;
  }
  // "pid (comm) S ...": comm may hold spaces and parentheses.
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) {
    return false;
  }
  const char state = line[close + 2];
  return state == 'Z' || state == 'X';
}

TransportError peerGoneError(const std::string& connection) {
  return TransportError{
      ErrorCode::kWorkerUnavailable,
      "connection to " + connection + " failed: the peer process is gone"};
}

} // namespace

// ---- Reading, on the strand (Note [Buffered frame reads]) ----

// Counts every chunk that arrives as a sign of life, so a long transfer is
// not taken for silence.
struct TcpConnectionImpl::ReadProgress {
  TcpConnectionImpl* self;
  size_t operator()(const AsioError& ec, size_t /*bytes*/) const {
    self->lastReceive_ = Clock::now();
    return ec ? 0 : kReadChunkBytes;
  }
};

void TcpConnectionImpl::fillThenFromLoop(ReadStep then) {
  TORCHRPC_ASSERT_IN_LOOP();
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(fillThen_ == nullptr);
  fillThen_ = then;
  fillIndex_ = 0;
  fillOffset_ = 0;
  fillCopiedTensorBytes_ = 0;
  if (!drivingReads_) {
    driveReadsFromLoop();
  }
}

void TcpConnectionImpl::driveReadsFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  drivingReads_ = true;
  corked_ = true;
  while (fillThen_ != nullptr) {
    // Note [Shared rings for small frames]: a record due at this place in
    // the socket's order is read before the socket's next frame.
    if (ringIn_ != nullptr && atFrameStartFromLoop() &&
        !takeDueRingRecordFromLoop()) {
      fillThen_ = nullptr; // failed
      break;
    }
    drainReadBufferFromLoop();
    if (fillIndex_ < fill_.size()) {
      if (readingRing_) {
        violationFromLoop("a frame in the shared ring is cut short");
        fillThen_ = nullptr;
        break;
      }
      // What the parsed frames answered goes out before waiting for more.
      uncorkFromLoop();
      if (!socketReadPending_) {
        startSocketReadFromLoop();
      }
      break;
    }
    // The step may ask for the next part: fillThenFromLoop() then only
    // sets fillThen_, and this loop goes on.
    ReadStep step = std::exchange(fillThen_, nullptr);
    (this->*step)();
  }
  uncorkFromLoop();
  drivingReads_ = false;
}

void TcpConnectionImpl::uncorkFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  if (!corked_) {
    return;
  }
  corked_ = false;
  flushQueue();
}

void TcpConnectionImpl::drainReadBufferFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  // From the ring's record while one is read, else from the socket's.
  const char* const source =
      readingRing_ ? ringRecord_.get() : readBuffer_.get();
  size_t& begin = readingRing_ ? ringBegin_ : readBegin_;
  const size_t end = readingRing_ ? ringEnd_ : readEnd_;
  while (fillIndex_ < fill_.size()) {
    FillTarget& target = fill_[fillIndex_];
    const size_t take = std::min(target.bytes - fillOffset_, end - begin);
    if (take > 0) {
      std::memcpy(target.data + fillOffset_, source + begin, take);
      begin += take;
      fillOffset_ += take;
      if (target.tensor) {
        fillCopiedTensorBytes_ += take;
      }
    }
    if (fillOffset_ < target.bytes) {
      return; // the buffer is empty
    }
    ++fillIndex_;
    fillOffset_ = 0;
  }
}

void TcpConnectionImpl::startSocketReadFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(readBegin_ == readEnd_);
  readBegin_ = readEnd_ = 0;
  socketReadPending_ = true;
  size_t missing = fill_[fillIndex_].bytes - fillOffset_;
  for (size_t i = fillIndex_ + 1; i < fill_.size(); ++i) {
    missing += fill_[i].bytes;
  }
  auto self = shared_from_this();
  if (missing >= kDirectReadBytes) {
    std::vector<asio::mutable_buffer> buffers;
    buffers.reserve(fill_.size() - fillIndex_);
    for (size_t i = fillIndex_; i < fill_.size(); ++i) {
      const size_t offset = i == fillIndex_ ? fillOffset_ : 0;
      if (fill_[i].bytes > offset) {
        buffers.push_back(
            asio::buffer(fill_[i].data + offset, fill_[i].bytes - offset));
      }
    }
    asio::async_read(
        socket_,
        buffers,
        ReadProgress{this},
        [self](const AsioError& ec, size_t) {
          self->onDirectReadFromLoop(ec);
        });
    return;
  }
  const size_t capacity =
      handshake_.done ? kReadBufferBytes : kHandshakeReadBufferBytes;
  if (readCapacity_ != capacity) {
    readBuffer_.reset(new char[capacity]);
    readCapacity_ = capacity;
  }
  if (IoPolling::onDrivingThread()) {
    // Note [A waiter leaves its next read to the loop].
    auto read = [self]() {
      // A failure meanwhile closes the socket: nothing is left to read.
      if (!self->failedAlready()) {
        self->readIntoBufferFromLoop();
      }
    };
    context_->runOnLoop(strand_, read);
    return;
  }
  readIntoBufferFromLoop();
}

void TcpConnectionImpl::readIntoBufferFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  auto self = shared_from_this();
  socket_.async_read_some(
      asio::buffer(readBuffer_.get(), readCapacity_),
      [self](const AsioError& ec, size_t bytes) {
        self->onBufferedReadFromLoop(ec, bytes);
      });
}

void TcpConnectionImpl::onBufferedReadFromLoop(
    const AsioError& ec,
    size_t bytes) {
  TORCHRPC_ASSERT_IN_LOOP();
  socketReadPending_ = false;
  if (ec) {
    if (ringIn_ != nullptr && !failedAlready() && atFrameStartFromLoop() &&
        ringRecordDueFromLoop()) {
      // What the peer wrote to the ring before its socket ended comes
      // first, as bytes written before a socket's end do; the next read
      // ends the same way.
      driveReadsFromLoop();
      return;
    }
    failFromNetworkFromLoop(ec);
    return;
  }
  lastReceive_ = Clock::now();
  context_->socketReads.fetch_add(1, std::memory_order_relaxed);
  readBegin_ = 0;
  readEnd_ = bytes;
  driveReadsFromLoop();
}

void TcpConnectionImpl::onDirectReadFromLoop(const AsioError& ec) {
  TORCHRPC_ASSERT_IN_LOOP();
  socketReadPending_ = false;
  if (ec) {
    failFromNetworkFromLoop(ec);
    return;
  }
  context_->socketReads.fetch_add(1, std::memory_order_relaxed);
  fillIndex_ = fill_.size();
  fillOffset_ = 0;
  driveReadsFromLoop();
}

void TcpConnectionImpl::readFrameHeaderFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  fill_.clear();
  fill_.push_back(FillTarget{
      reinterpret_cast<char*>(frameHeader_),
      kFrameHeaderBytes,
      false});
  fillThenFromLoop(&TcpConnectionImpl::onFrameHeaderFromLoop);
}

void TcpConnectionImpl::readBodyFromLoop(size_t bytes, ReadStep then) {
  TORCHRPC_ASSERT_IN_LOOP();
  body_.assign(bytes, '\0');
  fill_.clear();
  if (bytes > 0) {
    fill_.push_back(FillTarget{&body_[0], bytes, false});
  }
  fillThenFromLoop(then);
}

void TcpConnectionImpl::beginReadingFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  if (failedAlready()) {
    return; // see startConnecting()
  }
  if (handshake_.done && !reading_) {
    reading_ = true;
    readFrameHeaderFromLoop();
  }
}

void TcpConnectionImpl::failFromNetworkFromLoop(const AsioError& ec) {
  TORCHRPC_ASSERT_IN_LOOP();
  std::string what = ec == asio::error::eof
      ? std::string("the peer closed the connection")
      : ec.message();
  if (!handshake_.done) {
    handshakeFailedFromLoop(what);
    return;
  }
  fail(TransportError{
      ErrorCode::kWorkerUnavailable,
      "connection to " + describe() + " failed: " + what});
}

void TcpConnectionImpl::violationFromLoop(const std::string& what) {
  TORCHRPC_ASSERT_IN_LOOP();
  if (!handshake_.done) {
    handshakeFailedFromLoop(what);
    return;
  }
  fail(TransportError{
      ErrorCode::kMalformedMessage,
      "connection to " + describe() + ": " + what});
}

void TcpConnectionImpl::handshakeFailedFromLoop(const std::string& what) {
  TORCHRPC_ASSERT_IN_LOOP();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      return;
    }
  }
  std::string detail = "handshake with " + describe() + " failed: " + what;
  TORCHRPC_LOG(kWarning) << "TcpTransport " << context_->options.name << ": "
                         << detail << "; dropped";
  fail(TransportError{ErrorCode::kWorkerUnavailable, detail});
}

// Validates the header, then hands the frame to its kind's reader.
void TcpConnectionImpl::onFrameHeaderFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  const FrameHeader header = decodeFrameHeader(frameHeader_);
  if (!readingRing_) {
    ++socketFramesRead_;
  }
  const std::string refusal = checkFrameHeader(header);
  if (!refusal.empty()) {
    violationFromLoop(refusal);
    return;
  }
  if (readingRing_) {
    // Note [Shared rings for small frames]: the ring carries data only;
    // everything else keeps the socket's order.
    if (header.type != FrameType::kData) {
      violationFromLoop(
          "a shared ring carries data frames only, not frame type " +
          std::to_string(static_cast<int>(header.type)));
      return;
    }
    context_->ringFrames.fetch_add(1, std::memory_order_relaxed);
  }
  if (!handshake_.done) {
    onHandshakeFrameFromLoop(header);
    return;
  }
  switch (header.type) {
    case FrameType::kHeartbeat:
    case FrameType::kClose:
    case FrameType::kCmaProbe:
    case FrameType::kCmaResult:
    case FrameType::kAck:
    case FrameType::kRingOffer:
    case FrameType::kRingBell:
      onControlFrameFromLoop(header);
      return;
    case FrameType::kData:
    case FrameType::kDataCma:
    case FrameType::kDataShared:
      onDataFrameFromLoop(header);
      return;
    default:
      violationFromLoop(
          "unexpected frame type " +
          std::to_string(static_cast<int>(header.type)));
      return;
  }
}

void TcpConnectionImpl::onControlFrameFromLoop(const FrameHeader& header) {
  TORCHRPC_ASSERT_IN_LOOP();
  const FrameType type = header.type;
  if (type == FrameType::kHeartbeat) {
    if (header.bodyBytes != 0 || header.count != 0) {
      violationFromLoop("heartbeat frame with a body");
      return;
    }
    readFrameHeaderFromLoop();
    return;
  }
  if (type == FrameType::kRingBell) {
    // Its only work, reading the records before it, was done at its
    // start (driveReadsFromLoop).
    if (header.bodyBytes != 0 || header.count != 0 || ringIn_ == nullptr) {
      violationFromLoop("unexpected shared ring bell");
      return;
    }
    readFrameHeaderFromLoop();
    return;
  }
  if (type == FrameType::kClose) {
    fail(TransportError{
        ErrorCode::kWorkerUnavailable,
        "connection to " + describe() + " closed by the peer"});
    return;
  }
  if (header.bodyBytes != cmaBodyBytes(type) || header.count != 0) {
    violationFromLoop("malformed control frame");
    return;
  }
  bodyType_ = type;
  readBodyFromLoop(header.bodyBytes, &TcpConnectionImpl::onCmaBodyFromLoop);
}

void TcpConnectionImpl::onDataFrameFromLoop(const FrameHeader& header) {
  TORCHRPC_ASSERT_IN_LOOP();
  dataShared_ = header.type == FrameType::kDataShared;
  dataCma_ = header.type == FrameType::kDataCma || dataShared_;
  if (dataCma_ &&
      (!(dataShared_ ? sameHost_.weMapPeer : sameHost_.weReadPeer) ||
       header.count == 0)) {
    violationFromLoop("unexpected zero-copy data frame");
    return;
  }
  const std::string refusal =
      checkDataFrameCaps(header, context_->options.limits);
  if (!refusal.empty()) {
    violationFromLoop(refusal);
    return;
  }
  bodyBytes_ = header.bodyBytes;
  const size_t count = header.count;
  if (count == 0) {
    lengths_.clear();
    onLengthsFromLoop();
    return;
  }
  // Bounded by maxTensorsPerMessage, checked above.
  lengths_.assign(count, 0);
  fill_.clear();
  fill_.push_back(FillTarget{
      reinterpret_cast<char*>(lengths_.data()),
      count * sizeof(uint64_t),
      false});
  fillThenFromLoop(&TcpConnectionImpl::onLengthsFromLoop);
}

void TcpConnectionImpl::onLengthsFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  const std::string refusal =
      decodeTensorLengths(lengths_, bodyBytes_, context_->options.limits);
  if (!refusal.empty()) {
    violationFromLoop(refusal);
    return;
  }
  if (readingRing_) {
    // Before anything is allocated: a frame in a ring record is all there
    // (the lengths are within the caps, so the sum cannot wrap).
    uint64_t need = bodyBytes_;
    for (uint64_t length : lengths_) {
      need += length;
    }
    if (need > ringEnd_ - ringBegin_) {
      violationFromLoop("a frame in the shared ring is cut short");
      return;
    }
  }
  if (!dataCma_) {
    readPayloadFromLoop();
    return;
  }
  cmaWords_.assign(lengths_.size() * (dataShared_ ? 2 : 1) + 1, 0);
  fill_.clear();
  fill_.push_back(FillTarget{
      reinterpret_cast<char*>(cmaWords_.data()),
      cmaWords_.size() * sizeof(uint64_t),
      false});
  fillThenFromLoop(&TcpConnectionImpl::onCmaWordsFromLoop);
}

void TcpConnectionImpl::onCmaWordsFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  decodeLeWords(cmaWords_);
  readPayloadFromLoop();
}

uint64_t TcpConnectionImpl::segmentOfFromLoop(size_t i) const {
  TORCHRPC_ASSERT_IN_LOOP();
  return dataShared_ ? cmaWords_[2 * i + 1] : 0;
}

uint64_t TcpConnectionImpl::wordOfFromLoop(size_t i) const {
  TORCHRPC_ASSERT_IN_LOOP();
  return dataShared_ ? cmaWords_[2 * i + 2] : cmaWords_[i + 1];
}

bool TcpConnectionImpl::byAddressFromLoop(size_t i) const {
  TORCHRPC_ASSERT_IN_LOOP();
  return dataCma_ && segmentOfFromLoop(i) == 0 && wordOfFromLoop(i) != 0;
}

void TcpConnectionImpl::readPayloadFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  // fill_ points into incoming_ (a short header lives inside the
  // std::string), which stays put until onPayloadFromLoop moves it out.
  incoming_ = Message();
  std::string refusal;
  try {
    incoming_.header.resize(bodyBytes_);
    incoming_.tensors.resize(lengths_.size());
    for (size_t i = 0; i < lengths_.size() && refusal.empty(); ++i) {
      const uint64_t segment = dataShared_ ? segmentOfFromLoop(i) : 0;
      if (segment == 0) {
        incoming_.tensors[i] = context_->pool->allocate(lengths_[i]);
        continue;
      }
      const uint64_t fd = wordOfFromLoop(i);
      refusal = segmentsIn_.view(
          sameHost_.peerPid,
          SegmentPlacement{
              segment,
              fd > uint64_t(std::numeric_limits<int>::max())
                  ? -1
                  : static_cast<int>(fd)},
          lengths_[i],
          incoming_.tensors[i]);
    }
  } catch (const std::exception& e) {
    incoming_ = Message();
    fail(TransportError{
        ErrorCode::kWorkerUnavailable,
        "connection to " + describe() +
            ": cannot allocate a message: " + describeException(e)});
    return;
  }
  if (!refusal.empty()) {
    incoming_ = Message();
    if (peerProcessGone(sameHost_.peerPid)) {
      fail(peerGoneError(describe()));
      return;
    }
    violationFromLoop(refusal);
    return;
  }
  fill_.clear();
  if (bodyBytes_ > 0) {
    fill_.push_back(FillTarget{&incoming_.header[0], bodyBytes_, false});
  }
  for (size_t i = 0; i < lengths_.size(); ++i) {
    if (lengths_[i] > 0 && !byAddressFromLoop(i) &&
        !(dataShared_ && segmentOfFromLoop(i) != 0)) {
      fill_.push_back(FillTarget{
          static_cast<char*>(incoming_.tensors[i].data_ptr()),
          lengths_[i],
          true});
    }
  }
  fillThenFromLoop(&TcpConnectionImpl::onPayloadFromLoop);
}

void TcpConnectionImpl::onPayloadFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  uint64_t tensorBytes = 0;
  for (uint64_t length : lengths_) {
    tensorBytes += length;
  }
  // Bytes read by address and straight into storage are zero-copy; those
  // that came through the read buffer were copied once.
  context_->tensorBytes.fetch_add(
      tensorBytes - fillCopiedTensorBytes_,
      std::memory_order_relaxed);
  context_->copiedTensorBytes.fetch_add(
      fillCopiedTensorBytes_,
      std::memory_order_relaxed);
  finishPayloadFromLoop(std::move(incoming_));
}

void TcpConnectionImpl::finishPayloadFromLoop(Message&& message) {
  TORCHRPC_ASSERT_IN_LOOP();
  if (dataCma_) {
    bool anyByAddress = false;
    for (size_t i = 0; i < lengths_.size(); ++i) {
      if (!byAddressFromLoop(i)) {
        continue;
      }
      anyByAddress = true;
      int error = readFromPeer(
          sameHost_.peerPid,
          static_cast<char*>(message.tensors[i].data_ptr()),
          wordOfFromLoop(i),
          lengths_[i]);
      if (error == ESRCH) {
        fail(peerGoneError(describe()));
        return;
      }
      if (error != 0) {
        violationFromLoop(
            std::string("cannot read an announced tensor: ") +
            std::strerror(error));
        return;
      }
    }
    lastReceive_ = Clock::now();
    // Tensors in segments need no ack: the receiver's storage releases
    // them (Note [TCP same-host shared memory]).
    if (anyByAddress) {
      enqueue(controlFrame(FrameType::kAck, encodeAck(cmaWords_[0])), false);
    }
  }
  deliverFromLoop(std::move(message));
}

void TcpConnectionImpl::deliverFromLoop(Message&& message) {
  TORCHRPC_ASSERT_IN_LOOP();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      return;
    }
  }
  context_->polling.noteTraffic();
  // onMessage_ changes only on this strand once started.
  onMessage_(std::move(message));
  readFrameHeaderFromLoop();
}

// ---- Handshake, on the strand ----

void TcpConnectionImpl::armHandshakeTimerFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  auto timeout = context_->options.handshakeTimeout;
  handshakeTimer_.expires_after(timeout);
  auto self = shared_from_this();
  handshakeTimer_.async_wait([self, timeout](const AsioError& ec) {
    if (ec || self->handshake_.done) {
      return;
    }
    self->handshakeFailedFromLoop(
        "no handshake within " + std::to_string(timeout.count()) + " ms");
  });
}

void TcpConnectionImpl::sendHelloFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  Greeting hello;
  hello.auth = authenticates();
  handshake_.clientNonce = hello.auth ? randomBytes(kNonceBytes) : "";
  hello.nonce = handshake_.clientNonce;
  hello.name = context_->options.name;
  hello.host = sameHost_.ourSection(context_->host);
  enqueue(
      controlFrame(FrameType::kHello, encodeGreeting(FrameType::kHello, hello)),
      false);
}

void TcpConnectionImpl::onHandshakeFrameFromLoop(const FrameHeader& header) {
  TORCHRPC_ASSERT_IN_LOOP();
  const FrameType expected = expectedHandshakeFrame(handshake_);
  if (header.type != expected || header.count != 0 ||
      header.bodyBytes > kMaxHandshakeBodyBytes) {
    violationFromLoop(
        "unexpected handshake frame (type " +
        std::to_string(static_cast<int>(header.type)) + ", " +
        std::to_string(header.bodyBytes) + " bytes)");
    return;
  }
  bodyType_ = expected;
  readBodyFromLoop(
      header.bodyBytes,
      &TcpConnectionImpl::onHandshakeBodyFromLoop);
}

void TcpConnectionImpl::onHandshakeBodyFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  if (bodyType_ == FrameType::kHello) {
    onHelloFromLoop();
  } else if (bodyType_ == FrameType::kWelcome) {
    onWelcomeFromLoop();
  } else {
    onProofFromLoop();
  }
}

bool TcpConnectionImpl::readGreetingFromLoop(
    FrameType type,
    Greeting& greeting) {
  TORCHRPC_ASSERT_IN_LOOP();
  const std::string refusal =
      decodeGreeting(type, body_, authenticates(), greeting);
  if (!refusal.empty()) {
    handshakeFailedFromLoop(refusal);
    return false;
  }
  peerName_ = greeting.name;
  if (greeting.host) {
    sameHost_.notePeerSection(context_->host, *greeting.host);
  }
  return true;
}

// Server: answers with kWelcome (and our proof, with a secret).
void TcpConnectionImpl::onHelloFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  Greeting hello;
  if (!readGreetingFromLoop(FrameType::kHello, hello)) {
    return;
  }
  handshake_.clientNonce = hello.nonce;
  Greeting welcome;
  welcome.auth = hello.auth;
  if (welcome.auth) {
    handshake_.serverNonce = randomBytes(kNonceBytes);
    welcome.nonce = handshake_.serverNonce;
    welcome.proof = proofOf(
        context_->options.sharedSecret,
        Role::kServer,
        handshake_.clientNonce,
        handshake_.serverNonce);
  }
  welcome.name = context_->options.name;
  if (sameHost_.peerSentHost) {
    welcome.host = sameHost_.ourSection(context_->host);
    sameHost_.offeredCma = welcome.host.has_value();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    describe_ = "'" + hello.name + "' (" + describe_ + ")";
  }
  enqueue(
      controlFrame(
          FrameType::kWelcome,
          encodeGreeting(FrameType::kWelcome, welcome)),
      false);
  if (welcome.auth) {
    handshake_.awaitingProof = true;
    readFrameHeaderFromLoop();
  } else {
    completeHandshakeFromLoop();
  }
}

// Client: the server proved it knows the secret; now we prove it, and
// answer a zero-copy offer.
void TcpConnectionImpl::onWelcomeFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  Greeting welcome;
  if (!readGreetingFromLoop(FrameType::kWelcome, welcome)) {
    return;
  }
  if (welcome.auth) {
    const std::string& secret = context_->options.sharedSecret;
    handshake_.serverNonce = welcome.nonce;
    if (!equalInConstantTime(
            welcome.proof,
            proofOf(
                secret,
                Role::kServer,
                handshake_.clientNonce,
                handshake_.serverNonce))) {
      handshakeFailedFromLoop("the server does not know the shared secret");
      return;
    }
    enqueue(
        controlFrame(
            FrameType::kProof,
            proofOf(
                secret,
                Role::kClient,
                handshake_.clientNonce,
                handshake_.serverNonce)),
        false);
  }
  if (sameHost_.peerSentHost && !sameHost_.ourChallenge.empty()) {
    // Tell the server whether we can read it, and where it finds its
    // challenge in our memory.
    sameHost_.weReadPeer = sameHost_.probePeer(welcome.host->address);
    sameHost_.weMapPeer = sameHost_.weReadPeer && sharesMemory();
    sameHost_.sentCmaProbe = true;
    enqueue(
        controlFrame(
            FrameType::kCmaProbe,
            encodeCmaProbe(
                sameHost_.weReadPeer,
                sameHost_.weMapPeer,
                sameHost_.probeAddress())),
        false);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    describe_ = "'" + welcome.name + "' at " + describe_;
  }
  completeHandshakeFromLoop();
}

// Server, with a secret: the client's proof.
void TcpConnectionImpl::onProofFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  std::string proof;
  const std::string refusal = decodeProof(body_, proof);
  if (!refusal.empty()) {
    handshakeFailedFromLoop(refusal);
    return;
  }
  if (!equalInConstantTime(
          proof,
          proofOf(
              context_->options.sharedSecret,
              Role::kClient,
              handshake_.clientNonce,
              handshake_.serverNonce))) {
    handshakeFailedFromLoop("wrong shared secret");
    return;
  }
  completeHandshakeFromLoop();
}

void TcpConnectionImpl::completeHandshakeFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  handshake_.done = true;
  handshakeTimer_.cancel();
  lastReceive_ = Clock::now();
  std::vector<OutFrame> completed;
  int writeErrno = 0;
  bool mustWait = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      return;
    }
    open_ = true;
    for (OutFrame& frame : pendingData_) {
      queue_.push_back(std::move(frame));
      ++socketFramesQueued_;
    }
    pendingData_.clear();
    if (!waitingWritable_ && !queue_.empty()) {
      writeErrno = flushOrAwaitLocked(completed, &mustWait);
    }
  }
  if (mustWait) {
    awaitWritableFromLoop();
  }
  armHeartbeatFromLoop();
  finishWrites(completed, writeErrno);
  if (handshake_.role == Role::kServer) {
    handOverFromLoop();
  }
  bool started;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    started = started_;
  }
  if (started) {
    beginReadingFromLoop();
  }
}

void TcpConnectionImpl::handOverFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  std::shared_ptr<Transport::AcceptCallback> onAccept =
      context_->handshakePassed(id_);
  if (!onAccept) {
    fail(TransportError{
        ErrorCode::kWorkerUnavailable,
        "transport closed during handshake"});
    return;
  }
  (*onAccept)(std::make_shared<TcpConnection>(shared_from_this()));
}

// ---- Same-host zero copy, on the strand ----

void TcpConnectionImpl::onCmaBodyFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  if (bodyType_ == FrameType::kAck) {
    onAckFromLoop();
  } else if (bodyType_ == FrameType::kRingOffer) {
    onRingOfferFromLoop();
  } else if (bodyType_ == FrameType::kCmaProbe) {
    onCmaProbeFromLoop();
  } else {
    onCmaResultFromLoop();
  }
}

void TcpConnectionImpl::onAckFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  uint64_t id = 0;
  decodeAck(body_, id); // the length was checked
  std::vector<at::Tensor> released;
  bool unknown = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = awaitingAck_.find(id);
    if (it != awaitingAck_.end()) {
      released = std::move(it->second);
      awaitingAck_.erase(it);
    } else if (!failed_) {
      unknown = true;
    }
  }
  if (unknown) {
    violationFromLoop("ack for an unknown message");
    return;
  }
  readFrameHeaderFromLoop();
}

// Server: the client says whether it can read us and where our challenge
// is in its memory; we answer whether we can read it.
void TcpConnectionImpl::onCmaProbeFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  bool peerReadsUs = false;
  bool peerMapsUs = false;
  uint64_t address = 0;
  if (handshake_.role != Role::kServer || !sameHost_.offeredCma ||
      sameHost_.gotCmaFrame ||
      !decodeCmaProbe(body_, peerReadsUs, peerMapsUs, address)) {
    violationFromLoop("unexpected zero-copy probe");
    return;
  }
  sameHost_.gotCmaFrame = true;
  sameHost_.weReadPeer = sameHost_.probePeer(address);
  sameHost_.weMapPeer = sameHost_.weReadPeer && sharesMemory();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    peerReadsUs_ = peerReadsUs;
    peerMapsUs_ = peerReadsUs && peerMapsUs && sharesMemory();
  }
  enqueue(
      controlFrame(
          FrameType::kCmaResult,
          encodeCmaResult(sameHost_.weReadPeer, sameHost_.weMapPeer)),
      false);
  offerRingFromLoop();
  readFrameHeaderFromLoop();
}

void TcpConnectionImpl::onCmaResultFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  bool peerReadsUs = false;
  bool peerMapsUs = false;
  if (handshake_.role != Role::kClient || !sameHost_.sentCmaProbe ||
      sameHost_.gotCmaFrame ||
      !decodeCmaResult(body_, peerReadsUs, peerMapsUs)) {
    violationFromLoop("unexpected zero-copy result");
    return;
  }
  sameHost_.gotCmaFrame = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    peerReadsUs_ = peerReadsUs;
    peerMapsUs_ = peerReadsUs && peerMapsUs && sharesMemory();
  }
  offerRingFromLoop();
  readFrameHeaderFromLoop();
}

// ---- Shared rings, on the strand ----

void TcpConnectionImpl::offerRingFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  bool peerMapsUs = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    peerMapsUs = peerMapsUs_ && !failed_;
  }
  // A ring helps only while this side polls (Note [Rings while the loop
  // polls] in tcp/ring_watch.h); asleep, each message would ring.
  const size_t capacity = context_->options.sharedRingBytes;
  if (!peerMapsUs || capacity == 0 || !context_->polling.enabled() ||
      ringIn_ != nullptr) {
    return;
  }
  // Charged to the shared memory budget, as segments are: a peer that
  // opens many connections gets no more than sharedMemoryMaxBytes of it.
  SharedMemoryCharge charge = SharedMemoryCharge::tryCharge(
      context_->segmentBytes,
      ringBytesFor(capacity),
      context_->options.sharedMemoryMaxBytes);
  if (!charge.held()) {
    return; // small messages from this peer use the socket
  }
  uint64_t cookie = 0;
  const std::string random = randomBytes(sizeof(cookie));
  std::memcpy(&cookie, random.data(), sizeof(cookie));
  std::string why;
  std::unique_ptr<SharedRingMemory> memory =
      SharedRingMemory::create(capacity, cookie, why);
  if (memory == nullptr) {
    TORCHRPC_LOG(kWarning) << "TcpTransport " << context_->options.name
                           << ": no shared ring for " << describe() << ": "
                           << why << "; its small messages use the socket";
    return;
  }
  const int fd = memory->fd();
  ringIn_ = std::make_shared<SharedRingReader>(std::move(memory));
  ringCharge_ = std::move(charge);
  ringRecord_.reset(new char[ringFrameMaxBytes(capacity)]);
  std::weak_ptr<TcpConnectionImpl> weak = shared_from_this();
  ringWatchId_ = context_->rings.add(ringIn_, [weak]() {
    if (auto self = weak.lock()) {
      auto drain = [self]() { self->onRingRecordsFromLoop(); };
      self->context_->postUnlessJoined(self->strand_, drain);
    }
  });
  std::string body;
  appendU64(body, static_cast<uint64_t>(fd));
  appendU64(body, cookie);
  enqueue(controlFrame(FrameType::kRingOffer, std::move(body)), false);
}

void TcpConnectionImpl::onRingOfferFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  uint64_t fd = 0;
  uint64_t cookie = 0;
  BodyReader reader(body_);
  reader.u64(fd); // the length was checked
  reader.u64(cookie);
  if (!sameHost_.weMapPeer || gotRingOffer_ ||
      fd > uint64_t(std::numeric_limits<int>::max())) {
    violationFromLoop("unexpected shared ring offer");
    return;
  }
  gotRingOffer_ = true;
  std::string why;
  std::unique_ptr<SharedRingMemory> memory = SharedRingMemory::mapPeer(
      sameHost_.peerPid,
      static_cast<int>(fd),
      kMaxSharedRingBytes,
      why);
  if (memory == nullptr) {
    if (peerProcessGone(sameHost_.peerPid)) {
      fail(peerGoneError(describe()));
      return;
    }
    violationFromLoop(why);
    return;
  }
  if (memory->cookie() != cookie) {
    violationFromLoop(
        "the shared ring mapped is not the one offered (its descriptor "
        "was reused, or the peer lies)");
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_) {
      ringOut_ = std::make_unique<SharedRingWriter>(std::move(memory));
    }
  }
  readFrameHeaderFromLoop();
}

bool TcpConnectionImpl::atFrameStartFromLoop() const {
  TORCHRPC_ASSERT_IN_LOOP();
  return fillThen_ == &TcpConnectionImpl::onFrameHeaderFromLoop &&
      fillIndex_ == 0 && fillOffset_ == 0;
}

bool TcpConnectionImpl::takeDueRingRecordFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  if (readingRing_) {
    if (ringBegin_ < ringEnd_) {
      return true; // more frames in this record
    }
    readingRing_ = false;
  }
  uint64_t tag = 0;
  size_t length = 0;
  switch (ringIn_->peek(tag, length)) {
    case SharedRingReader::Read::kEmpty:
      return true;
    case SharedRingReader::Read::kCorrupt:
      violationFromLoop(ringIn_->why());
      return false;
    case SharedRingReader::Read::kRecord:
      break;
  }
  if (tag > socketFramesRead_) {
    return true; // it follows a frame still on the socket
  }
  const size_t maxBytes = ringFrameMaxBytes(ringIn_->capacity());
  if (tag < socketFramesRead_) {
    violationFromLoop(
        "a record in the shared ring is out of order (it follows socket "
        "frame " +
        std::to_string(tag) + ", " + std::to_string(socketFramesRead_) +
        " were read)");
    return false;
  }
  if (length == 0 || length > maxBytes) {
    violationFromLoop(
        "a record in the shared ring of " + std::to_string(length) +
        " bytes (a frame of 16 to " + std::to_string(maxBytes) + " expected)");
    return false;
  }
  ringIn_->take(ringRecord_.get());
  ringBegin_ = 0;
  ringEnd_ = length;
  readingRing_ = true;
  lastReceive_ = Clock::now();
  return true;
}

bool TcpConnectionImpl::ringRecordDueFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  uint64_t tag = 0;
  size_t length = 0;
  return ringIn_->peek(tag, length) == SharedRingReader::Read::kRecord &&
      tag == socketFramesRead_;
}

void TcpConnectionImpl::onRingRecordsFromLoop() {
  TORCHRPC_ASSERT_IN_LOOP();
  // Only a reader that waits at a frame's start for the socket reads them
  // now; one in a frame reads them when it ends.
  if (ringIn_ == nullptr || !reading_ || drivingReads_ ||
      fillThen_ == nullptr || !atFrameStartFromLoop() ||
      readBegin_ != readEnd_ || failedAlready()) {
    return;
  }
  driveReadsFromLoop();
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
