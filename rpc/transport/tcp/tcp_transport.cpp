#include "torchrpc/rpc/transport/tcp/tcp_transport.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <boost/asio/basic_socket_acceptor.hpp>
#include <boost/asio/basic_stream_socket.hpp>
#include <boost/asio/basic_waitable_timer.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "torchrpc/rpc/transport/receive_buffer_pool.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

using Clock = std::chrono::steady_clock;
using Strand = asio::strand<asio::io_context::executor_type>;
using Socket = asio::basic_stream_socket<tcp, Strand>;
using Timer =
    asio::basic_waitable_timer<Clock, asio::wait_traits<Clock>, Strand>;
using AsioError = boost::system::error_code;

// See Note [TCP transport wire format].
constexpr uint32_t kMagic = 0x43505254; // "TRPC" as little-endian bytes
constexpr uint8_t kVersion = 1;
constexpr size_t kFrameHeaderBytes = 16;
constexpr size_t kMaxHandshakeBodyBytes = 4096;
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kMaxHandshakingConnections = 64;
// sendmsg takes at most IOV_MAX (1024) pieces; a few dozen cover a frame.
constexpr size_t kMaxIovecs = 64;
// Bytes per recvmsg on large reads (asio's default is 64 KiB, which costs a
// syscall and a handler per 64 KiB of a large tensor).
constexpr size_t kReadChunkBytes = size_t(4) << 20;
// How long join() waits for the io threads before it stops them.
constexpr auto kJoinTimeout = std::chrono::seconds(5);
// Back-off after an accept error (e.g. out of file descriptors).
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(50);

enum class FrameType : uint8_t {
  kHello = 1,
  kWelcome = 2,
  kProof = 3,
  kData = 4,
  kHeartbeat = 5,
  kClose = 6,
  kCmaProbe = 7,
  kCmaResult = 8,
  kDataCma = 9,
  kAck = 10,
};

// Same-host zero copy, see Note [TCP transport wire format].
constexpr size_t kChallengeBytes = 16;
// process_vm_readv moves at most this much per call (it caps a call at
// MAX_RW_COUNT anyway); looping keeps a short read from being an error.
constexpr size_t kMaxPeerReadBytes = size_t(1) << 30;

// What tells two processes they share a kernel and a pid namespace, so the
// pid a peer announces names the peer. Empty bootId: unknown, no zero copy.
struct HostIdentity {
  std::string bootId;
  uint64_t pidNamespace = 0;
};

HostIdentity localHostIdentity() {
  HostIdentity identity;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  struct stat info {};
  if (std::getline(in, bootId) && !bootId.empty() &&
      ::stat("/proc/self/ns/pid", &info) == 0) {
    identity.bootId = bootId;
    identity.pidNamespace = info.st_ino;
  }
  return identity;
}

// Reads `length` bytes at `from` in process `pid` into `to`. Returns 0 or
// the errno (EFAULT for a read that makes no progress).
int readFromPeer(pid_t pid, char* to, uint64_t from, size_t length) {
  size_t done = 0;
  while (done < length) {
    size_t chunk = std::min(length - done, kMaxPeerReadBytes);
    iovec local{to + done, chunk};
    iovec remote{reinterpret_cast<void*>(from + done), chunk};
    ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return errno;
    }
    if (n == 0) {
      return EFAULT;
    }
    done += static_cast<size_t>(n);
  }
  return 0;
}

const char* const kClientRole = "torchrpc-tcp-v1 client";
const char* const kServerRole = "torchrpc-tcp-v1 server";

void putU16(char* out, uint16_t value) {
  for (int i = 0; i < 2; ++i) {
    out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
}
void putU32(char* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) {
    out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
}
void putU64(char* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
}
uint64_t getLe(const unsigned char* in, int bytes) {
  uint64_t value = 0;
  for (int i = bytes - 1; i >= 0; --i) {
    value = (value << 8) | in[i];
  }
  return value;
}

std::string frameHeader(FrameType type, uint32_t bodyBytes, uint32_t count) {
  std::string out(kFrameHeaderBytes, '\0');
  putU32(&out[0], kMagic);
  out[4] = static_cast<char>(kVersion);
  out[5] = static_cast<char>(type);
  putU16(&out[6], 0);
  putU32(&out[8], bodyBytes);
  putU32(&out[12], count);
  return out;
}

std::string randomNonce(size_t bytes = kNonceBytes) {
  std::string nonce(bytes, '\0');
  TORCH_CHECK(
      RAND_bytes(
          reinterpret_cast<unsigned char*>(&nonce[0]),
          static_cast<int>(nonce.size())) == 1,
      "TcpTransport: RAND_bytes failed");
  return nonce;
}

// HMAC-SHA256(secret, role | 0 | client nonce | server nonce).
std::string proofOf(
    const std::string& secret,
    const char* role,
    const std::string& clientNonce,
    const std::string& serverNonce) {
  std::string data = std::string(role) + '\0' + clientNonce + serverNonce;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  const unsigned char* result = HMAC(
      EVP_sha256(),
      secret.data(),
      static_cast<int>(secret.size()),
      reinterpret_cast<const unsigned char*>(data.data()),
      data.size(),
      out,
      &length);
  TORCH_CHECK(
      result != nullptr && length == kProofBytes,
      "TcpTransport: HMAC-SHA256 failed");
  return std::string(reinterpret_cast<char*>(out), length);
}

bool equalInConstantTime(const std::string& a, const std::string& b) {
  return a.size() == b.size() &&
      CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// Reads a handshake body; every accessor fails (returns false) instead of
// reading past the end.
class BodyReader {
 public:
  explicit BodyReader(const std::string& body) : body_(body) {}

  bool u8(uint8_t& out) {
    if (offset_ + 1 > body_.size()) {
      return false;
    }
    out = static_cast<uint8_t>(body_[offset_++]);
    return true;
  }
  bool bytes(size_t count, std::string& out) {
    if (count > body_.size() - offset_) {
      return false;
    }
    out = body_.substr(offset_, count);
    offset_ += count;
    return true;
  }
  bool shortString(std::string& out) {
    std::string length;
    if (!bytes(2, length)) {
      return false;
    }
    return bytes(
        getLe(reinterpret_cast<const unsigned char*>(length.data()), 2),
        out);
  }
  bool u64(uint64_t& out) {
    std::string bytes8;
    if (!bytes(8, bytes8)) {
      return false;
    }
    out = getLe(reinterpret_cast<const unsigned char*>(bytes8.data()), 8);
    return true;
  }
  bool atEnd() const {
    return offset_ == body_.size();
  }

 private:
  const std::string& body_;
  size_t offset_ = 0;
};

void appendShortString(std::string& out, const std::string& value) {
  size_t length = std::min<size_t>(value.size(), 1024);
  char prefix[2];
  putU16(prefix, static_cast<uint16_t>(length));
  out.append(prefix, 2);
  out.append(value, 0, length);
}

// "ip:port", IPv6 in brackets.
std::string endpointString(const tcp::endpoint& endpoint) {
  const asio::ip::address address = endpoint.address();
  std::string host = address.to_string();
  if (address.is_v6()) {
    host = "[" + host + "]";
  }
  return host + ":" + std::to_string(endpoint.port());
}

// Parses "ip", "ip:port", "[ip6]" or "[ip6]:port". False if it does not.
bool parseHostPort(
    const std::string& text,
    bool portRequired,
    tcp::endpoint& endpoint) {
  std::string host = text;
  std::string port;
  if (!text.empty() && text[0] == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos) {
      return false;
    }
    host = text.substr(1, close - 1);
    std::string rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':') {
        return false;
      }
      port = rest.substr(1);
    }
  } else if (std::count(text.begin(), text.end(), ':') == 1) {
    size_t colon = text.find(':');
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (port.empty() && portRequired) {
    return false;
  }
  unsigned long portNumber = 0;
  if (!port.empty()) {
    if (port.size() > 5 ||
        port.find_first_not_of("0123456789") != std::string::npos) {
      return false;
    }
    portNumber = std::stoul(port);
    if (portNumber > 65535) {
      return false;
    }
  }
  AsioError ec;
  asio::ip::address address = asio::ip::make_address(host, ec);
  if (ec) {
    return false;
  }
  endpoint = tcp::endpoint(address, static_cast<uint16_t>(portNumber));
  return true;
}

// One outgoing frame and what keeps its bytes alive.
struct OutFrame {
  std::string prefix; // frame header + tensor lengths
  std::string body;
  std::vector<at::Tensor> tensors;
  Connection::SendCallback done; // empty for control frames
  size_t total = 0;
  size_t written = 0;
};

OutFrame controlFrame(FrameType type, std::string body = std::string()) {
  OutFrame frame;
  frame.prefix =
      frameHeader(type, static_cast<uint32_t>(body.size()), /*count=*/0);
  frame.body = std::move(body);
  frame.total = frame.prefix.size() + frame.body.size();
  return frame;
}

} // namespace

class TcpConnectionImpl;

// What the transport and its connections share. Connections hold it, so a
// connection the user keeps after the transport died still has its
// io_context (with no thread left to run it).
struct TcpContext {
  explicit TcpContext(TcpTransportOptions opts)
      : options(std::move(opts)),
        io(std::max(1, options.ioThreads)),
        pool(ReceiveBufferPool::create()),
        host(options.sameHostZeroCopy ? localHostIdentity() : HostIdentity()) {}

  const TcpTransportOptions options;
  asio::io_context io;
  const std::shared_ptr<ReceiveBufferPool> pool;
  const HostIdentity host;
  // Set once the io threads are gone: work is then done inline.
  std::atomic<bool> joined{false};
  // For the io threads' polling (Note [Polling after traffic]): when a data
  // frame last went out or came in (steady clock, ns), and the count of
  // replies this process awaits (set once; owned by awaitedOwner).
  std::atomic<int64_t> lastTraffic{0};
  std::atomic<const std::atomic<int64_t>*> awaitedReplies{nullptr};
  // Io threads of a polling transport blocked in the kernel (a thread about
  // to block may not count yet: then it misses one wake-up to poll, which
  // costs only latency).
  std::atomic<int> sleepingIoThreads{0};
  std::shared_ptr<const std::atomic<int64_t>> awaitedOwner;

  bool polls() const {
    return options.pollAfterTraffic.count() > 0 ||
        options.pollWhileAwaiting.count() > 0;
  }

  void noteTraffic() {
    if (polls()) {
      lastTraffic.store(
          Clock::now().time_since_epoch().count(),
          std::memory_order_relaxed);
    }
  }

  // Called when this process sends a data frame (on the sending thread):
  // an io thread asleep in the kernel would only wake for the answer, too
  // late to poll for it, so it is woken now to start polling.
  void noteSend() {
    if (!polls()) {
      return;
    }
    noteTraffic();
    if (sleepingIoThreads.load() > 0 && keepPolling()) {
      asio::post(io, []() {});
    }
  }

  // Whether an io thread that found nothing to do should poll on.
  bool keepPolling() const {
    auto quiet = std::chrono::nanoseconds(
        Clock::now().time_since_epoch().count() -
        lastTraffic.load(std::memory_order_relaxed));
    if (quiet < options.pollAfterTraffic) {
      return true;
    }
    const std::atomic<int64_t>* awaited = awaitedReplies.load();
    return quiet < options.pollWhileAwaiting && awaited != nullptr &&
        awaited->load(std::memory_order_relaxed) > 0;
  }

  std::mutex mutex;
  bool closed = false;
  uint64_t nextId = 0;
  std::map<uint64_t, std::weak_ptr<TcpConnectionImpl>> live;
  // Accepted connections still in their handshake, oldest first.
  std::deque<std::pair<uint64_t, std::weak_ptr<TcpConnectionImpl>>> handshaking;
  std::shared_ptr<Transport::AcceptCallback> onAccept;

  void forget(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex);
    live.erase(id);
    for (auto it = handshaking.begin(); it != handshaking.end(); ++it) {
      if (it->first == id) {
        handshaking.erase(it);
        break;
      }
    }
  }
};

// One connection's socket and state. Internal: the user holds a
// TcpConnection handle, whose destruction closes this; asynchronous
// operations hold a shared_ptr to this until they complete.
//
// Reads, timers and the user's onMessage/onError run on strand_; writes run
// on whichever thread sends, under mutex_ (see Note [TCP transport wire
// format] for why). The fd is closed only under mutex_, after failed_ is
// set, so a writer never writes to a reused fd.
class TcpConnectionImpl
    : public std::enable_shared_from_this<TcpConnectionImpl> {
 public:
  enum class Role { kClient, kServer };

  TcpConnectionImpl(
      std::shared_ptr<TcpContext> context,
      Role role,
      uint64_t id,
      Strand strand,
      Socket socket,
      std::string peer)
      : context_(std::move(context)),
        role_(role),
        id_(id),
        strand_(std::move(strand)),
        socket_(std::move(socket)),
        handshakeTimer_(strand_),
        heartbeatTimer_(strand_),
        describe_(std::move(peer)) {}

  // ---- Called on any thread ----

  void start(
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

  void send(Message&& message, Connection::SendCallback done) {
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
    context_->noteSend();
    const size_t count = message.tensors.size();
    const size_t minBytes =
        std::max<size_t>(1, context_->options.zeroCopyMinBytes);
    std::vector<size_t> lengths(count);
    bool anyLarge = false;
    for (size_t i = 0; i < count; ++i) {
      lengths[i] = message.tensors[i].nbytes();
      anyLarge = anyLarge || lengths[i] >= minBytes;
    }
    // Large tensors go by address once the peer proved it can read us;
    // they then wait in awaitingAck_ (registered before the frame can go
    // out, so the ack always finds them).
    bool byAddress = false;
    uint64_t id = 0;
    std::vector<uint64_t> addresses;
    if (anyLarge) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (peerReadsUs_ && !failed_) {
        byAddress = true;
        id = nextCmaId_++;
        addresses.assign(count, 0);
        std::vector<at::Tensor>& kept = awaitingAck_[id];
        for (size_t i = 0; i < count; ++i) {
          at::Tensor& tensor = message.tensors[i];
          if (lengths[i] >= minBytes) {
            addresses[i] = reinterpret_cast<uintptr_t>(tensor.data_ptr());
            kept.push_back(std::move(tensor));
          }
        }
      }
    }
    OutFrame frame;
    frame.prefix = frameHeader(
        byAddress ? FrameType::kDataCma : FrameType::kData,
        static_cast<uint32_t>(message.header.size()),
        static_cast<uint32_t>(count));
    frame.prefix.resize(
        kFrameHeaderBytes + 8 * count + (byAddress ? 8 * (count + 1) : 0));
    frame.total = frame.prefix.size() + message.header.size();
    for (size_t i = 0; i < count; ++i) {
      putU64(&frame.prefix[kFrameHeaderBytes + 8 * i], lengths[i]);
    }
    if (byAddress) {
      char* words = &frame.prefix[kFrameHeaderBytes + 8 * count];
      putU64(words, id);
      for (size_t i = 0; i < count; ++i) {
        putU64(words + 8 * (i + 1), addresses[i]);
      }
    }
    for (size_t i = 0; i < count; ++i) {
      // Moved-from (by address) tensors are not written.
      if (!byAddress || addresses[i] == 0) {
        frame.total += lengths[i];
        frame.tensors.push_back(std::move(message.tensors[i]));
      }
    }
    frame.body = std::move(message.header);
    frame.done = std::move(done);
    enqueue(std::move(frame), /*isData=*/true);
  }

  // Fails the connection; tells the peer with a kClose frame when that can
  // go out without waiting.
  void close(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed_) {
        return;
      }
      if (open_ && queue_.empty() && !waitingWritable_ && fd_ >= 0) {
        std::string frame = frameHeader(FrameType::kClose, 0, 0);
        // Best effort: the EOF that follows says the same.
        (void)::send(
            fd_,
            frame.data(),
            frame.size(),
            MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
    fail(TransportError{
        ErrorCode::kWorkerUnavailable,
        "connection to " + describe() + " " + why});
  }

  std::string describe() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return describe_;
  }

  // The first error sticks: pending sends fail with it, the socket shuts
  // down (which ends the pending read), onError runs on the strand.
  TransportError fail(const TransportError& error) {
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

  void connectFromLoop(const tcp::endpoint& endpoint) {
    armHandshakeTimerFromLoop();
    auto self = shared_from_this();
    socket_.async_connect(endpoint, [self](const AsioError& ec) {
      if (ec) {
        self->fail(TransportError{
            ErrorCode::kWorkerUnavailable,
            "cannot connect to " + self->describe() + ": " + ec.message()});
        return;
      }
      if (!self->setUpSocketFromLoop()) {
        return;
      }
      self->clientNonce_ = self->authenticates() ? randomNonce() : "";
      std::string body(1, self->authenticates() ? '\1' : '\0');
      body += self->clientNonce_;
      appendShortString(body, self->context_->options.name);
      self->appendHostSectionFromLoop(body, /*announce=*/false);
      self->enqueue(controlFrame(FrameType::kHello, body), false);
      self->readFrameHeaderFromLoop();
    });
  }

  void acceptFromLoop() {
    armHandshakeTimerFromLoop();
    if (setUpSocketFromLoop()) {
      readFrameHeaderFromLoop();
    }
  }

 private:
  bool authenticates() const {
    return !context_->options.sharedSecret.empty();
  }

  // Runs `task` on the strand, or inline once no io thread is left.
  template <typename Task>
  void runOnStrand(Task task) {
    if (context_->joined.load()) {
      task();
    } else {
      asio::post(strand_, std::move(task));
    }
  }

  void scheduleReport() {
    auto self = shared_from_this();
    runOnStrand([self]() { self->reportFromLoop(); });
  }

  bool setUpSocketFromLoop() {
    AsioError ec;
    socket_.set_option(tcp::no_delay(true), ec);
    // NB: SO_SNDBUF/SO_RCVBUF stay at the kernel's autotuned defaults:
    // fixing them (1 or 4 MiB) measured slower for 64 MiB messages here.
    std::string peer;
    tcp::endpoint remote = socket_.remote_endpoint(ec);
    if (!ec) {
      peer = endpointString(remote);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      return false;
    }
    fd_ = socket_.native_handle();
    if (role_ == Role::kServer && !peer.empty()) {
      describe_ = "peer at " + peer;
    }
    return true;
  }

  // Closes the socket, stops the timers and runs onError once (if started).
  void reportFromLoop() {
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
    context_->forget(id_);
    if (onError) {
      onError(error);
    }
  }

  // ---- Writing, on any thread ----

  void enqueue(OutFrame frame, bool isData) {
    std::vector<OutFrame> completed;
    TransportError error;
    bool failedAlready = false;
    bool mustWait = false;
    int writeErrno = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed_) {
        failedAlready = true;
        error = error_;
      } else if (isData && !open_) {
        // Data waits for the handshake.
        pendingData_.push_back(std::move(frame));
        return;
      } else {
        queue_.push_back(std::move(frame));
        if (!waitingWritable_) {
          writeErrno = flushOrAwaitLocked(completed, &mustWait);
        }
      }
    }
    if (failedAlready) {
      if (frame.done) {
        frame.done(&error);
      }
      return;
    }
    if (mustWait) {
      auto self = shared_from_this();
      runOnStrand([self]() { self->awaitWritableFromLoop(); });
    }
    finishWrites(completed, writeErrno);
  }

  void finishWrites(std::vector<OutFrame>& completed, int writeErrno) {
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

  // flushLocked(), and when the socket is full, marks that the rest waits
  // for writability (*mustWait: the caller arms the wait once unlocked).
  // Returns 0 or the errno of a failed write.
  int flushOrAwaitLocked(std::vector<OutFrame>& completed, bool* mustWait) {
    int writeErrno = flushLocked(completed);
    if (writeErrno == EAGAIN || writeErrno == EWOULDBLOCK) {
      waitingWritable_ = true;
      *mustWait = true;
      return 0;
    }
    return writeErrno;
  }

  // Writes what the socket takes without blocking. Returns 0 when the
  // queue is empty, EAGAIN when the socket is full, else the errno.
  int flushLocked(std::vector<OutFrame>& completed) {
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

  void awaitWritableFromLoop() {
    auto self = shared_from_this();
    socket_.async_wait(Socket::wait_write, [self](const AsioError& ec) {
      self->onWritableFromLoop(ec);
    });
  }

  void onWritableFromLoop(const AsioError& ec) {
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

  // ---- Reading, on the strand ----

  // Counts every chunk that arrives as a sign of life, so a long transfer
  // is not taken for silence.
  struct ReadProgress {
    TcpConnectionImpl* self;
    size_t operator()(const AsioError& ec, size_t /*bytes*/) const {
      self->lastReceive_ = Clock::now();
      return ec ? 0 : kReadChunkBytes;
    }
  };

  void readFrameHeaderFromLoop() {
    auto self = shared_from_this();
    asio::async_read(
        socket_,
        asio::buffer(frameHeader_, kFrameHeaderBytes),
        ReadProgress{this},
        [self](const AsioError& ec, size_t) {
          self->onFrameHeaderFromLoop(ec);
        });
  }

  void beginReadingFromLoop() {
    if (handshakeDone_ && !reading_) {
      reading_ = true;
      readFrameHeaderFromLoop();
    }
  }

  void failFromNetwork(const AsioError& ec) {
    std::string what = ec == asio::error::eof
        ? std::string("the peer closed the connection")
        : ec.message();
    if (!handshakeDone_) {
      handshakeFailedFromLoop(what);
      return;
    }
    fail(TransportError{
        ErrorCode::kWorkerUnavailable,
        "connection to " + describe() + " failed: " + what});
  }

  void violationFromLoop(const std::string& what) {
    if (!handshakeDone_) {
      handshakeFailedFromLoop(what);
      return;
    }
    fail(TransportError{
        ErrorCode::kMalformedMessage,
        "connection to " + describe() + ": " + what});
  }

  void handshakeFailedFromLoop(const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed_) {
        return;
      }
    }
    std::string detail = "handshake with " + describe() + " failed: " + what;
    LOG(WARNING) << "TcpTransport " << context_->options.name << ": " << detail
                 << "; dropped";
    fail(TransportError{ErrorCode::kWorkerUnavailable, detail});
  }

  void onFrameHeaderFromLoop(const AsioError& ec) {
    if (ec) {
      failFromNetwork(ec);
      return;
    }
    const auto* in = frameHeader_;
    uint32_t magic = static_cast<uint32_t>(getLe(in, 4));
    uint8_t version = in[4];
    auto type = static_cast<FrameType>(in[5]);
    uint16_t reserved = static_cast<uint16_t>(getLe(in + 6, 2));
    size_t bodyBytes = getLe(in + 8, 4);
    size_t count = getLe(in + 12, 4);
    if (magic != kMagic) {
      violationFromLoop("not a torchrpc TCP frame (bad magic)");
      return;
    }
    if (version != kVersion) {
      violationFromLoop(
          "unsupported protocol version " + std::to_string(version));
      return;
    }
    if (reserved != 0) {
      violationFromLoop("reserved frame bits set");
      return;
    }
    if (!handshakeDone_) {
      FrameType expected = role_ == Role::kClient ? FrameType::kWelcome
          : awaitingProof_                        ? FrameType::kProof
                                                  : FrameType::kHello;
      if (type != expected || count != 0 ||
          bodyBytes > kMaxHandshakeBodyBytes) {
        violationFromLoop(
            "unexpected handshake frame (type " +
            std::to_string(static_cast<int>(type)) + ", " +
            std::to_string(bodyBytes) + " bytes)");
        return;
      }
      body_.assign(bodyBytes, '\0');
      auto self = shared_from_this();
      asio::async_read(
          socket_,
          asio::buffer(&body_[0], body_.size()),
          ReadProgress{this},
          [self](const AsioError& ec, size_t) {
            if (ec) {
              self->failFromNetwork(ec);
              return;
            }
            self->onHandshakeBodyFromLoop();
          });
      return;
    }
    const TransportLimits& limits = context_->options.limits;
    switch (type) {
      case FrameType::kHeartbeat:
        if (bodyBytes != 0 || count != 0) {
          violationFromLoop("heartbeat frame with a body");
          return;
        }
        readFrameHeaderFromLoop();
        return;
      case FrameType::kClose:
        fail(TransportError{
            ErrorCode::kWorkerUnavailable,
            "connection to " + describe() + " closed by the peer"});
        return;
      case FrameType::kCmaProbe:
      case FrameType::kCmaResult:
      case FrameType::kAck: {
        size_t expected = type == FrameType::kCmaProbe ? 9
            : type == FrameType::kAck                  ? 8
                                                       : 1;
        if (bodyBytes != expected || count != 0) {
          violationFromLoop("malformed control frame");
          return;
        }
        body_.assign(bodyBytes, '\0');
        auto self = shared_from_this();
        asio::async_read(
            socket_,
            asio::buffer(&body_[0], body_.size()),
            ReadProgress{this},
            [self, type](const AsioError& ec, size_t) {
              if (ec) {
                self->failFromNetwork(ec);
                return;
              }
              self->onControlBodyFromLoop(type);
            });
        return;
      }
      case FrameType::kData:
        dataCma_ = false;
        break;
      case FrameType::kDataCma:
        if (!weReadPeer_ || count == 0) {
          violationFromLoop("unexpected zero-copy data frame");
          return;
        }
        dataCma_ = true;
        break;
      default:
        violationFromLoop(
            "unexpected frame type " + std::to_string(static_cast<int>(type)));
        return;
    }
    if (count > limits.maxTensorsPerMessage) {
      violationFromLoop(
          std::to_string(count) + " tensors exceed the cap of " +
          std::to_string(limits.maxTensorsPerMessage));
      return;
    }
    if (bodyBytes > limits.maxHeaderBytes) {
      violationFromLoop(
          "header of " + std::to_string(bodyBytes) +
          " bytes exceeds the cap of " + std::to_string(limits.maxHeaderBytes));
      return;
    }
    if (bodyBytes > limits.maxMessageBytes) {
      violationFromLoop(
          "message exceeds the cap of " +
          std::to_string(limits.maxMessageBytes) + " bytes");
      return;
    }
    bodyBytes_ = bodyBytes;
    if (count == 0) {
      lengths_.clear();
      onLengthsFromLoop();
      return;
    }
    // Bounded by maxTensorsPerMessage, checked above.
    lengths_.assign(count, 0);
    auto self = shared_from_this();
    asio::async_read(
        socket_,
        asio::buffer(lengths_.data(), count * sizeof(uint64_t)),
        ReadProgress{this},
        [self](const AsioError& ec, size_t) {
          if (ec) {
            self->failFromNetwork(ec);
            return;
          }
          self->onLengthsFromLoop();
        });
  }

  void onLengthsFromLoop() {
    const TransportLimits& limits = context_->options.limits;
    size_t total = bodyBytes_;
    for (uint64_t& length : lengths_) {
      length = getLe(reinterpret_cast<const unsigned char*>(&length), 8);
      // Compared one by one first so that the sum cannot wrap.
      if (length > limits.maxMessageBytes ||
          total + length > limits.maxMessageBytes) {
        violationFromLoop(
            "message exceeds the cap of " +
            std::to_string(limits.maxMessageBytes) + " bytes");
        return;
      }
      total += length;
    }
    if (!dataCma_) {
      readPayloadFromLoop();
      return;
    }
    cmaWords_.assign(lengths_.size() + 1, 0);
    auto self = shared_from_this();
    asio::async_read(
        socket_,
        asio::buffer(cmaWords_.data(), cmaWords_.size() * sizeof(uint64_t)),
        ReadProgress{this},
        [self](const AsioError& ec, size_t) {
          if (ec) {
            self->failFromNetwork(ec);
            return;
          }
          for (uint64_t& word : self->cmaWords_) {
            word = getLe(reinterpret_cast<const unsigned char*>(&word), 8);
          }
          self->readPayloadFromLoop();
        });
  }

  // Whether tensor `i` of the frame being read comes by address.
  bool byAddressFromLoop(size_t i) const {
    return dataCma_ && cmaWords_[i + 1] != 0;
  }

  // Allocates the message the lengths (already validated) describe and
  // reads its inline parts.
  void readPayloadFromLoop() {
    // The buffers point into the holder: a short header lives inside the
    // std::string, so the message must not move before the read completes.
    auto holder = std::make_shared<Message>();
    Message& message = *holder;
    try {
      message.header.resize(bodyBytes_);
      message.tensors.reserve(lengths_.size());
      for (uint64_t length : lengths_) {
        message.tensors.push_back(context_->pool->allocate(length));
      }
    } catch (const std::exception& e) {
      fail(TransportError{
          ErrorCode::kWorkerUnavailable,
          "connection to " + describe() +
              ": cannot allocate a message: " + e.what()});
      return;
    }
    std::vector<asio::mutable_buffer> buffers;
    buffers.reserve(1 + lengths_.size());
    if (bodyBytes_ > 0) {
      buffers.push_back(asio::buffer(&message.header[0], bodyBytes_));
    }
    for (size_t i = 0; i < lengths_.size(); ++i) {
      if (lengths_[i] > 0 && !byAddressFromLoop(i)) {
        buffers.push_back(
            asio::buffer(message.tensors[i].data_ptr(), lengths_[i]));
      }
    }
    if (buffers.empty()) {
      finishPayloadFromLoop(std::move(message));
      return;
    }
    auto self = shared_from_this();
    asio::async_read(
        socket_,
        buffers,
        ReadProgress{this},
        [self, holder](const AsioError& ec, size_t) {
          if (ec) {
            self->failFromNetwork(ec);
            return;
          }
          self->finishPayloadFromLoop(std::move(*holder));
        });
  }

  // Copies the tensors that came by address out of the peer, acks them so
  // the peer may free them, and delivers.
  void finishPayloadFromLoop(Message&& message) {
    if (dataCma_) {
      for (size_t i = 0; i < lengths_.size(); ++i) {
        if (!byAddressFromLoop(i)) {
          continue;
        }
        int error = readFromPeer(
            peerPid_,
            static_cast<char*>(message.tensors[i].data_ptr()),
            cmaWords_[i + 1],
            lengths_[i]);
        if (error == ESRCH) {
          fail(TransportError{
              ErrorCode::kWorkerUnavailable,
              "connection to " + describe() +
                  " failed: the peer process is gone"});
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
      std::string id(8, '\0');
      putU64(&id[0], cmaWords_[0]);
      enqueue(controlFrame(FrameType::kAck, std::move(id)), false);
    }
    deliverFromLoop(std::move(message));
  }

  void deliverFromLoop(Message&& message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed_) {
        return;
      }
    }
    context_->noteTraffic();
    // onMessage_ changes only on this strand once started.
    onMessage_(std::move(message));
    readFrameHeaderFromLoop();
  }

  // ---- Handshake, on the strand ----

  void armHandshakeTimerFromLoop() {
    auto timeout = context_->options.handshakeTimeout;
    handshakeTimer_.expires_after(timeout);
    auto self = shared_from_this();
    handshakeTimer_.async_wait([self, timeout](const AsioError& ec) {
      if (ec || self->handshakeDone_) {
        return;
      }
      self->handshakeFailedFromLoop(
          "no handshake within " + std::to_string(timeout.count()) + " ms");
    });
  }

  void onHandshakeBodyFromLoop() {
    BodyReader reader(body_);
    const std::string& secret = context_->options.sharedSecret;
    if (role_ == Role::kServer && awaitingProof_) {
      std::string proof;
      if (!reader.bytes(kProofBytes, proof) || !reader.atEnd()) {
        violationFromLoop("malformed proof");
        return;
      }
      if (!equalInConstantTime(
              proof,
              proofOf(secret, kClientRole, clientNonce_, serverNonce_))) {
        handshakeFailedFromLoop("wrong shared secret");
        return;
      }
      completeHandshakeFromLoop();
      return;
    }
    uint8_t auth = 0;
    if (!reader.u8(auth) || auth > 1) {
      violationFromLoop("malformed handshake");
      return;
    }
    if ((auth == 1) != authenticates()) {
      handshakeFailedFromLoop(
          authenticates() ? "the peer has no shared secret"
                          : "the peer requires a shared secret");
      return;
    }
    std::string nonce;
    std::string proof;
    std::string name;
    if (auth && !reader.bytes(kNonceBytes, nonce)) {
      violationFromLoop("malformed handshake");
      return;
    }
    if (role_ == Role::kClient && auth && !reader.bytes(kProofBytes, proof)) {
      violationFromLoop("malformed handshake");
      return;
    }
    uint64_t probeAddress = 0;
    if (!reader.shortString(name) ||
        !readHostSectionFromLoop(reader, probeAddress) || !reader.atEnd()) {
      violationFromLoop("malformed handshake");
      return;
    }
    peerName_ = name;
    if (role_ == Role::kServer) {
      clientNonce_ = nonce;
      std::string reply(1, auth ? '\1' : '\0');
      if (auth) {
        serverNonce_ = randomNonce();
        reply += serverNonce_;
        reply += proofOf(secret, kServerRole, clientNonce_, serverNonce_);
      }
      appendShortString(reply, context_->options.name);
      if (peerSentHost_) {
        offeredCma_ = appendHostSectionFromLoop(reply, /*announce=*/true);
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        describe_ = "'" + name + "' (" + describe_ + ")";
      }
      enqueue(controlFrame(FrameType::kWelcome, reply), false);
      if (auth) {
        awaitingProof_ = true;
        readFrameHeaderFromLoop();
      } else {
        completeHandshakeFromLoop();
      }
      return;
    }
    // Client: the server proved it knows the secret; now we prove it.
    if (auth) {
      serverNonce_ = nonce;
      if (!equalInConstantTime(
              proof,
              proofOf(secret, kServerRole, clientNonce_, serverNonce_))) {
        handshakeFailedFromLoop("the server does not know the shared secret");
        return;
      }
      enqueue(
          controlFrame(
              FrameType::kProof,
              proofOf(secret, kClientRole, clientNonce_, serverNonce_)),
          false);
    }
    if (peerSentHost_ && !ourChallenge_.empty()) {
      // The server offered zero copy: tell it whether we can read it, and
      // where it finds its challenge in our memory.
      weReadPeer_ = probePeerFromLoop(probeAddress);
      std::string offer(1, weReadPeer_ ? '\1' : '\0');
      char word[8];
      putU64(word, peerOnHost_ ? reinterpret_cast<uintptr_t>(probe_) : 0);
      offer.append(word, 8);
      sentCmaProbe_ = true;
      enqueue(controlFrame(FrameType::kCmaProbe, offer), false);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      describe_ = "'" + name + "' at " + describe_;
    }
    completeHandshakeFromLoop();
  }

  void completeHandshakeFromLoop() {
    handshakeDone_ = true;
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
    if (role_ == Role::kServer) {
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

  void handOverFromLoop();

  // ---- Same-host zero copy, on the strand ----

  // Ends a handshake body with our host section; the server also announces
  // where it keeps the client's challenge. False if zero copy is off.
  bool appendHostSectionFromLoop(std::string& out, bool announce) {
    const HostIdentity& host = context_->host;
    if (host.bootId.empty()) {
      return false;
    }
    ourChallenge_ = randomNonce(kChallengeBytes);
    out += '\1';
    appendShortString(out, host.bootId);
    char word[8];
    putU64(word, host.pidNamespace);
    out.append(word, 8);
    putU64(word, static_cast<uint64_t>(::getpid()));
    out.append(word, 8);
    out += ourChallenge_;
    if (announce) {
      putU64(word, peerOnHost_ ? reinterpret_cast<uintptr_t>(probe_) : 0);
      out.append(word, 8);
    }
    return true;
  }

  // Reads the peer's optional host section. False if it is malformed.
  bool readHostSectionFromLoop(BodyReader& reader, uint64_t& address) {
    address = 0;
    if (reader.atEnd()) {
      return true;
    }
    uint8_t flag = 0;
    std::string bootId;
    std::string challenge;
    uint64_t pidNamespace = 0;
    uint64_t pid = 0;
    if (!reader.u8(flag) || flag != 1 || !reader.shortString(bootId) ||
        !reader.u64(pidNamespace) || !reader.u64(pid) ||
        !reader.bytes(kChallengeBytes, challenge)) {
      return false;
    }
    if (role_ == Role::kClient && !reader.u64(address)) {
      return false;
    }
    peerSentHost_ = true;
    const HostIdentity& host = context_->host;
    peerOnHost_ = !host.bootId.empty() && bootId == host.bootId &&
        pidNamespace == host.pidNamespace && pid > 0 &&
        pid <= static_cast<uint64_t>(std::numeric_limits<pid_t>::max());
    if (peerOnHost_) {
      peerPid_ = static_cast<pid_t>(pid);
      std::memcpy(probe_, challenge.data(), kChallengeBytes);
    }
    return true;
  }

  // Whether the peer's memory at `address` holds the challenge we sent:
  // then peerPid_ is the peer (or lets the peer write its memory).
  bool probePeerFromLoop(uint64_t address) {
    if (!peerOnHost_ || address == 0 || ourChallenge_.empty()) {
      return false;
    }
    std::string got(kChallengeBytes, '\0');
    return readFromPeer(peerPid_, &got[0], address, got.size()) == 0 &&
        equalInConstantTime(got, ourChallenge_);
  }

  // kCmaProbe, kCmaResult or kAck, whose body is in body_.
  void onControlBodyFromLoop(FrameType type) {
    BodyReader reader(body_);
    uint8_t flag = 0;
    uint64_t word = 0;
    if (type == FrameType::kAck) {
      reader.u64(word);
      std::vector<at::Tensor> released;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = awaitingAck_.find(word);
        if (it != awaitingAck_.end()) {
          released = std::move(it->second);
          awaitingAck_.erase(it);
        } else if (!failed_) {
          flag = 1;
        }
      }
      if (flag) {
        violationFromLoop("ack for an unknown message");
        return;
      }
      readFrameHeaderFromLoop();
      return;
    }
    if (type == FrameType::kCmaProbe) {
      if (role_ != Role::kServer || !offeredCma_ || gotCmaFrame_ ||
          !reader.u8(flag) || flag > 1 || !reader.u64(word)) {
        violationFromLoop("unexpected zero-copy probe");
        return;
      }
      gotCmaFrame_ = true;
      weReadPeer_ = probePeerFromLoop(word);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        peerReadsUs_ = flag == 1;
      }
      enqueue(
          controlFrame(
              FrameType::kCmaResult,
              std::string(1, weReadPeer_ ? 1 : 0)),
          false);
      readFrameHeaderFromLoop();
      return;
    }
    // kCmaResult
    if (role_ != Role::kClient || !sentCmaProbe_ || gotCmaFrame_ ||
        !reader.u8(flag) || flag > 1) {
      violationFromLoop("unexpected zero-copy result");
      return;
    }
    gotCmaFrame_ = true;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      peerReadsUs_ = flag == 1;
    }
    readFrameHeaderFromLoop();
  }

  // ---- Liveness, on the strand ----

  void armHeartbeatFromLoop() {
    heartbeatTimer_.expires_after(context_->options.heartbeatInterval);
    auto self = shared_from_this();
    heartbeatTimer_.async_wait([self](const AsioError& ec) {
      if (!ec) {
        self->onHeartbeatTimerFromLoop();
      }
    });
  }

  void onHeartbeatTimerFromLoop() {
    auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(
        Clock::now() - lastReceive_);
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

  const std::shared_ptr<TcpContext> context_;
  const Role role_;
  const uint64_t id_;
  Strand strand_;
  Socket socket_;
  Timer handshakeTimer_;
  Timer heartbeatTimer_;

  // Strand only.
  unsigned char frameHeader_[kFrameHeaderBytes];
  size_t bodyBytes_ = 0;
  std::vector<uint64_t> lengths_;
  std::string body_; // handshake bodies
  bool handshakeDone_ = false;
  bool awaitingProof_ = false;
  bool reading_ = false;
  std::string clientNonce_;
  std::string serverNonce_;
  std::string peerName_;
  Clock::time_point lastReceive_ = Clock::now();
  // Zero copy (strand only): the challenge we sent, the peer's challenge
  // as we expose it to the peer, and what we learned about the peer.
  std::string ourChallenge_;
  unsigned char probe_[kChallengeBytes] = {};
  bool peerSentHost_ = false;
  bool peerOnHost_ = false;
  pid_t peerPid_ = 0;
  bool offeredCma_ = false; // server: sent a host section in kWelcome
  bool sentCmaProbe_ = false; // client
  bool gotCmaFrame_ = false; // kCmaProbe or kCmaResult seen
  bool weReadPeer_ = false; // kDataCma frames are accepted
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

  friend class TcpConnection;
};

// What the user holds: dropping it closes the connection, as with a socket.
class TcpConnection : public Connection {
 public:
  explicit TcpConnection(std::shared_ptr<TcpConnectionImpl> impl)
      : impl_(std::move(impl)) {}

  ~TcpConnection() override {
    impl_->close("dropped by its owner");
  }

  void start(ReceiveCallback onMessage, ErrorCallback onError) override {
    impl_->start(std::move(onMessage), std::move(onError));
  }

  void send(Message&& message, SendCallback done) override {
    impl_->send(std::move(message), std::move(done));
  }

  void close() override {
    impl_->close("closed locally");
  }

  std::string describe() const override {
    return impl_->describe();
  }

 private:
  const std::shared_ptr<TcpConnectionImpl> impl_;
};

void TcpConnectionImpl::handOverFromLoop() {
  std::shared_ptr<Transport::AcceptCallback> onAccept;
  {
    std::lock_guard<std::mutex> lock(context_->mutex);
    for (auto it = context_->handshaking.begin();
         it != context_->handshaking.end();
         ++it) {
      if (it->first == id_) {
        context_->handshaking.erase(it);
        break;
      }
    }
    if (!context_->closed) {
      onAccept = context_->onAccept;
    }
  }
  if (!onAccept) {
    fail(TransportError{
        ErrorCode::kWorkerUnavailable,
        "transport closed during handshake"});
    return;
  }
  (*onAccept)(std::make_shared<TcpConnection>(shared_from_this()));
}

class TcpTransportImpl : public std::enable_shared_from_this<TcpTransportImpl> {
 public:
  explicit TcpTransportImpl(TcpTransportOptions options)
      : context_(std::make_shared<TcpContext>(std::move(options))),
        work_(asio::make_work_guard(context_->io)) {
    const TcpTransportOptions& o = context_->options;
    TORCH_CHECK(o.ioThreads >= 1, "TcpTransport needs at least one io thread");
    TORCH_CHECK(
        o.heartbeatInterval.count() > 0 && o.peerTimeout.count() > 0 &&
            o.handshakeTimeout.count() > 0,
        "TcpTransport timeouts must be positive");
    running_ = o.ioThreads;
    for (int i = 0; i < o.ioThreads; ++i) {
      threads_.emplace_back([this]() { runIo(); });
    }
  }

  ~TcpTransportImpl() {
    join();
  }

  void listen(Transport::AcceptCallback onAccept) {
    tcp::endpoint endpoint;
    const std::string& where = context_->options.listenAddress;
    TORCH_CHECK(
        parseHostPort(where, /*portRequired=*/false, endpoint),
        "TcpTransport: cannot parse listen address '",
        where,
        "'");
    {
      std::lock_guard<std::mutex> lock(context_->mutex);
      TORCH_CHECK(!context_->closed, "TcpTransport::listen() after close()");
      TORCH_CHECK(!context_->onAccept, "TcpTransport::listen() called twice");
      context_->onAccept =
          std::make_shared<Transport::AcceptCallback>(std::move(onAccept));
    }
    auto acceptor = std::make_shared<tcp::acceptor>(context_->io);
    AsioError ec;
    acceptor->open(endpoint.protocol(), ec);
    if (!ec) {
      acceptor->set_option(tcp::acceptor::reuse_address(true), ec);
    }
    if (!ec) {
      acceptor->bind(endpoint, ec);
    }
    if (!ec) {
      acceptor->listen(asio::socket_base::max_listen_connections, ec);
    }
    tcp::endpoint bound;
    if (!ec) {
      bound = acceptor->local_endpoint(ec);
    }
    TORCH_CHECK(
        !ec,
        "TcpTransport ",
        context_->options.name,
        " cannot listen on ",
        where,
        ": ",
        ec.message());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      acceptor_ = acceptor;
      address_ = "tcp://" + endpointString(bound);
    }
    auto self = shared_from_this();
    asio::post(context_->io, [self, acceptor]() {
      self->acceptNext(acceptor);
    });
  }

  std::string address() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return address_;
  }

  std::shared_ptr<Connection> connect(const std::string& address) {
    Strand strand = asio::make_strand(context_->io);
    Socket socket(strand);
    uint64_t id;
    bool closed;
    {
      std::lock_guard<std::mutex> lock(context_->mutex);
      id = context_->nextId++;
      closed = context_->closed;
    }
    auto impl = std::make_shared<TcpConnectionImpl>(
        context_,
        TcpConnectionImpl::Role::kClient,
        id,
        strand,
        std::move(socket),
        address);
    auto handle = std::make_shared<TcpConnection>(impl);
    tcp::endpoint endpoint;
    const std::string scheme = "tcp://";
    if (address.rfind(scheme, 0) != 0 ||
        !parseHostPort(
            address.substr(scheme.size()),
            /*portRequired=*/true,
            endpoint)) {
      impl->fail(TransportError{
          ErrorCode::kWorkerUnavailable,
          "not a TCP address ('tcp://ip:port'): '" + address + "'"});
      return handle;
    }
    if (closed) {
      impl->fail(TransportError{
          ErrorCode::kWorkerUnavailable,
          "transport " + context_->options.name + " is closed"});
      return handle;
    }
    {
      std::lock_guard<std::mutex> lock(context_->mutex);
      context_->live[id] = impl;
    }
    asio::post(strand, [impl, endpoint]() { impl->connectFromLoop(endpoint); });
    return handle;
  }

  void close() {
    std::vector<std::shared_ptr<TcpConnectionImpl>> connections;
    {
      std::lock_guard<std::mutex> lock(context_->mutex);
      if (context_->closed) {
        return;
      }
      context_->closed = true;
      for (auto& entry : context_->live) {
        if (auto connection = entry.second.lock()) {
          connections.push_back(std::move(connection));
        }
      }
    }
    std::shared_ptr<tcp::acceptor> acceptor;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      acceptor = acceptor_;
    }
    if (acceptor) {
      asio::post(context_->io, [acceptor]() {
        AsioError ignored;
        acceptor->close(ignored);
      });
    }
    for (auto& connection : connections) {
      connection->close(
          "closed: transport " + context_->options.name + " is shutting down");
    }
  }

  void join() {
    close();
    for (const std::thread& thread : threads_) {
      TORCH_CHECK(
          thread.get_id() != std::this_thread::get_id(),
          "TcpTransport::join() called from its own io thread");
    }
    if (threads_.empty()) {
      return;
    }
    work_.reset();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!runningCv_.wait_for(lock, kJoinTimeout, [this]() {
            return running_ == 0;
          })) {
        LOG(WARNING) << "TcpTransport " << context_->options.name
                     << ": io threads still busy after "
                     << std::chrono::duration_cast<std::chrono::seconds>(
                            kJoinTimeout)
                            .count()
                     << " s; stopping them";
        context_->io.stop();
      }
    }
    for (std::thread& thread : threads_) {
      thread.join();
    }
    threads_.clear();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      acceptor_.reset();
    }
    context_->joined.store(true);
    // Whatever was posted while the threads were leaving runs here, so that
    // no handler (holding a connection) stays queued.
    context_->io.restart();
    try {
      context_->io.poll();
    } catch (const std::exception& e) {
      LOG(ERROR) << "TcpTransport " << context_->options.name
                 << ": callback threw during join: " << e.what();
    }
  }

  void watchAwaitedReplies(std::shared_ptr<const std::atomic<int64_t>> count) {
    TORCH_CHECK(!context_->awaitedOwner, "watchAwaitedReplies() called twice");
    context_->awaitedOwner = std::move(count);
    context_->awaitedReplies.store(context_->awaitedOwner.get());
  }

 private:
  void runIo() {
    while (true) {
      try {
        if (context_->polls()) {
          runIoPolling();
        } else {
          context_->io.run();
        }
        break;
      } catch (const std::exception& e) {
        // A callback threw; keep serving the other connections.
        LOG(ERROR) << "TcpTransport " << context_->options.name
                   << ": callback threw on an io thread: " << e.what();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --running_;
    runningCv_.notify_all();
  }

  // Note [Polling after traffic]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // An io thread normally sleeps in epoll_wait, and on a virtual machine
  // waking it (and its idle vCPU) costs tens to hundreds of microseconds per
  // message, more the longer it slept. When polling is on, an io thread
  // that finds nothing ready keeps polling instead (a zero-timeout
  // epoll_wait, yielding the CPU in between) while the last data frame is
  // younger than pollAfterTraffic (a conversation's next message is likely
  // near), or younger than pollWhileAwaiting while this process awaits
  // replies (its callers are blocked anyway). Then it sleeps as before.
  // Heartbeats do not count as traffic, so an idle worker uses no CPU; a
  // busy one spends up to a core on lower latency (one io thread per
  // process polls at a time). bench/RESULTS.md has the measurements.
  void runIoPolling() {
    asio::io_context& io = context_->io;
    PollingSlot slot;
    while (!io.stopped()) {
      if (io.poll() > 0) {
        continue;
      }
      if (context_->keepPolling() && !io.stopped() && slot.take()) {
        std::this_thread::yield();
        continue;
      }
      slot.release();
      if (sleepUntilWork() == 0) {
        return; // stopped, or no work left
      }
    }
  }

  // io.run_one(), counted in sleepingIoThreads meanwhile.
  size_t sleepUntilWork() {
    struct Counted {
      std::atomic<int>& count;
      explicit Counted(std::atomic<int>& c) : count(c) {
        count.fetch_add(1);
      }
      ~Counted() {
        count.fetch_sub(1);
      }
    } counted(context_->sleepingIoThreads);
    return context_->io.run_one();
  }

  // At most one io thread of a process polls at a time, so several workers
  // in one process (tests, mostly) never poll at once. Released when the
  // thread stops polling, also by an exception from a handler.
  class PollingSlot {
   public:
    PollingSlot() = default;
    PollingSlot(const PollingSlot&) = delete;
    PollingSlot& operator=(const PollingSlot&) = delete;
    ~PollingSlot() {
      release();
    }

    // True if this thread holds the slot (already, or from now on).
    bool take() {
      if (!held_) {
        held_ = holders().fetch_add(1) == 0;
        if (!held_) {
          holders().fetch_sub(1); // another io thread polls
        }
      }
      return held_;
    }

    void release() {
      if (held_) {
        holders().fetch_sub(1);
        held_ = false;
      }
    }

   private:
    static std::atomic<int>& holders() {
      static std::atomic<int> count{0};
      return count;
    }

    bool held_ = false;
  };

  void acceptNext(const std::shared_ptr<tcp::acceptor>& acceptor) {
    Strand strand = asio::make_strand(context_->io);
    auto self = shared_from_this();
    acceptor->async_accept(
        strand,
        [self, acceptor, strand](const AsioError& ec, Socket socket) {
          self->onAccepted(acceptor, strand, ec, std::move(socket));
        });
  }

  void onAccepted(
      const std::shared_ptr<tcp::acceptor>& acceptor,
      const Strand& strand,
      const AsioError& ec,
      Socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor->is_open()) {
      return;
    }
    if (ec) {
      // E.g. out of file descriptors: back off instead of spinning.
      LOG(WARNING) << "TcpTransport " << context_->options.name
                   << ": accept failed (" << ec.message() << "); retrying";
      auto timer = std::make_shared<asio::steady_timer>(context_->io);
      timer->expires_after(kAcceptRetryDelay);
      auto self = shared_from_this();
      timer->async_wait([self, acceptor, timer](const AsioError& e) {
        if (!e && acceptor->is_open()) {
          self->acceptNext(acceptor);
        }
      });
      return;
    }
    AsioError ignored;
    tcp::endpoint remote = socket.remote_endpoint(ignored);
    std::shared_ptr<TcpConnectionImpl> evicted;
    std::shared_ptr<TcpConnectionImpl> impl;
    {
      std::lock_guard<std::mutex> lock(context_->mutex);
      if (!context_->closed) {
        uint64_t id = context_->nextId++;
        impl = std::make_shared<TcpConnectionImpl>(
            context_,
            TcpConnectionImpl::Role::kServer,
            id,
            strand,
            std::move(socket),
            "peer at " + endpointString(remote));
        context_->live[id] = impl;
        if (context_->handshaking.size() >= kMaxHandshakingConnections) {
          evicted = context_->handshaking.front().second.lock();
          context_->handshaking.pop_front();
        }
        context_->handshaking.emplace_back(id, impl);
      }
    }
    acceptNext(acceptor);
    if (evicted) {
      LOG(WARNING) << "TcpTransport " << context_->options.name << ": "
                   << kMaxHandshakingConnections
                   << " connections in their handshake; dropped the oldest, "
                   << evicted->describe();
      evicted->fail(TransportError{
          ErrorCode::kWorkerUnavailable,
          "dropped: too many connections in their handshake"});
    }
    if (impl) {
      asio::post(strand, [impl]() { impl->acceptFromLoop(); });
    }
  }

  const std::shared_ptr<TcpContext> context_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::vector<std::thread> threads_;

  mutable std::mutex mutex_;
  std::condition_variable runningCv_;
  int running_ = 0;
  std::shared_ptr<tcp::acceptor> acceptor_;
  std::string address_;
};

TcpTransport::TcpTransport(TcpTransportOptions options)
    : impl_(std::make_shared<TcpTransportImpl>(std::move(options))) {}

TcpTransport::~TcpTransport() {
  impl_->join();
}

std::string TcpTransport::name() const {
  return "tcp";
}

void TcpTransport::listen(AcceptCallback onAccept) {
  impl_->listen(std::move(onAccept));
}

std::string TcpTransport::address() const {
  return impl_->address();
}

std::shared_ptr<Connection> TcpTransport::connect(const std::string& address) {
  return impl_->connect(address);
}

void TcpTransport::close() {
  impl_->close();
}

void TcpTransport::watchAwaitedReplies(
    std::shared_ptr<const std::atomic<int64_t>> count) {
  impl_->watchAwaitedReplies(std::move(count));
}

void TcpTransport::join() {
  impl_->join();
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
