#include "torchrpc/rpc/transport/tcp/tcp_transport.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <boost/asio/basic_socket_acceptor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "torchrpc/rpc/detail/wait_drivers.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rpc/transport/tcp/connection.h"
#include "torchrpc/rpc/transport/tcp/context.h"
#include "torchrpc/rpc/transport/tcp/endpoints.h"
#include "torchrpc/rpc/transport/tcp/handshake.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace asio = boost::asio;
namespace ip = boost::asio::ip;

using Acceptor = asio::basic_socket_acceptor<asio::generic::stream_protocol>;

namespace {

// How long join() waits for the io threads before it stops them.
constexpr auto kJoinTimeout = std::chrono::seconds(5);
// Back-off after an accept error (e.g. out of file descriptors).
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(50);

// Lets threads waiting for a reply run this transport's loop (Note
// [Waiting callers drive the transport] in rpc/detail/wait_drivers.h).
class TcpWaitDriver : public WaitDriver {
 public:
  explicit TcpWaitDriver(std::shared_ptr<TcpContext> context)
      : context_(std::move(context)) {}

  void beginDriving() override {
    context_->polling.beginDriving();
  }
  bool driveOnce() override {
    return context_->polling.driveOnce();
  }
  void endDriving(bool answered) override {
    context_->polling.endDriving(answered);
  }
  bool driveBlocking(
      std::chrono::microseconds timeout,
      const std::function<bool()>& done) override {
    return context_->polling.driveBlocking(timeout, done);
  }
  void wakeBlockedDriver() override {
    context_->polling.wakeBlockedDriver();
  }

 private:
  const std::shared_ptr<TcpContext> context_;
};

} // namespace

// The transport behind TcpTransport: io threads, the listener (which keeps
// at most kMaxHandshakingConnections accepted connections in their
// handshake, see Note [TCP transport handshake]), connect, close and the
// bounded join. Connections live in connection.h; their shared state in
// TcpContext.
class TcpTransportImpl : public std::enable_shared_from_this<TcpTransportImpl> {
 public:
  const TcpTransportOptions& options() const {
    return context_->options;
  }

  TransportStats stats() const {
    TransportStats out;
    out.zeroCopyBytes = context_->tensorBytes.load(std::memory_order_relaxed);
    out.copiedBytes =
        context_->copiedTensorBytes.load(std::memory_order_relaxed);
    out.reads = context_->socketReads.load(std::memory_order_relaxed);
    out.ringFrames = context_->ringFrames.load(std::memory_order_relaxed);
    out.helperCopiedBytes = context_->copier.helperBytes();
    out.heartbeatMisses =
        context_->heartbeatMisses.load(std::memory_order_relaxed);
    std::lock_guard<std::mutex> guard(context_->mutex);
    out.connectionsOpen = context_->live.size();
    for (const auto& entry : context_->live) {
      auto connection = entry.second.lock();
      if (connection && connection->overLocalSocket()) {
        ++out.localConnectionsOpen;
      }
    }
    return out;
  }

  explicit TcpTransportImpl(TcpTransportOptions options)
      : context_(std::make_shared<TcpContext>(std::move(options))),
        network_(
            context_->options.localSockets ? localNetwork(localHostIdentity())
                                           : std::string()),
        work_(asio::make_work_guard(context_->io)) {
    const TcpTransportOptions& o = context_->options;
    TORCH_CHECK(o.ioThreads >= 1, "TcpTransport needs at least one io thread");
    TORCH_CHECK(
        o.sharedRingBytes == 0 ||
            (o.sharedRingBytes >= kRingMinCapacity &&
             o.sharedRingBytes <= kMaxSharedRingBytes &&
             (o.sharedRingBytes & (o.sharedRingBytes - 1)) == 0),
        "sharedRingBytes must be 0 or a power of two from ",
        kRingMinCapacity,
        " to ",
        kMaxSharedRingBytes,
        " bytes, got ",
        o.sharedRingBytes);
    TORCH_CHECK(
        o.heartbeatInterval.count() > 0 && o.peerTimeout.count() > 0 &&
            o.handshakeTimeout.count() > 0,
        "TcpTransport timeouts must be positive");
    running_ = o.ioThreads;
    for (int i = 0; i < o.ioThreads; ++i) {
      threads_.emplace_back([this]() { runIo(); });
    }
    if (context_->polling.enabled()) {
      waitDriver_ = std::make_unique<WaitDriverRegistration>(
          std::make_shared<TcpWaitDriver>(context_));
    }
  }

  ~TcpTransportImpl() {
    join();
  }

  void listen(Transport::AcceptCallback onAccept) {
    ip::tcp::endpoint endpoint;
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
    AsioError ec;
    std::shared_ptr<Acceptor> tcp = openAcceptor(Endpoint(endpoint), ec);
    std::optional<ip::tcp::endpoint> bound;
    if (!ec) {
      bound = ipEndpointOf(tcp->local_endpoint(ec));
      if (!ec && !bound) {
        ec = asio::error::address_family_not_supported;
      }
    }
    TORCH_CHECK(
        !ec,
        "TcpTransport ",
        context_->options.name,
        " cannot listen on ",
        where,
        ": ",
        ec.message());
    std::vector<std::shared_ptr<Acceptor>> acceptors{tcp};
    std::string address = "tcp://" + endpointString(*bound);
    // Note [Local sockets for peers on this host]. Not offered when /proc
    // does not say where it would be reachable; a failure to open it costs
    // only the faster path.
    if (!network_.empty()) {
      const std::string name = newLocalSocketName();
      std::shared_ptr<Acceptor> local =
          openAcceptor(localSocketEndpoint(name), ec);
      if (ec) {
        TORCHRPC_LOG(kWarning) << "TcpTransport " << context_->options.name
                               << ": no local socket for peers on this host ("
                               << ec.message() << "); they connect over TCP";
      } else {
        acceptors.push_back(local);
        address = withLocalSocket(address, network_, name);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      acceptors_ = acceptors;
      address_ = address;
    }
    {
      // A close() that ran since the check above found no acceptor to close.
      std::lock_guard<std::mutex> lock(context_->mutex);
      if (context_->closed) {
        for (const auto& acceptor : acceptors) {
          AsioError ignored;
          acceptor->close(ignored);
        }
        return;
      }
    }
    std::weak_ptr<TcpTransportImpl> weak = shared_from_this();
    for (const auto& acceptor : acceptors) {
      auto start = [weak, acceptor]() {
        if (auto self = weak.lock()) {
          self->acceptNext(acceptor);
        }
      };
      if (!context_->postUnlessJoined(acceptor->get_executor(), start)) {
        AsioError ignored;
        acceptor->close(ignored); // joined meanwhile: nothing will accept
      }
    }
  }

  std::string address() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return address_;
  }

  std::shared_ptr<Connection> connect(const std::string& address) {
    Strand strand = asio::make_strand(context_->io);
    Socket socket(strand);
    std::shared_ptr<TcpConnectionImpl> impl;
    bool closed;
    {
      // One critical section: a connection made after close() looked at
      // `live` would be closed by no one, and its pending operations would
      // keep it and the io_context alive for good.
      std::lock_guard<std::mutex> lock(context_->mutex);
      const uint64_t id = context_->nextId++;
      closed = context_->closed;
      impl = std::make_shared<TcpConnectionImpl>(
          context_,
          Role::kClient,
          id,
          strand,
          std::move(socket),
          address);
      if (!closed) {
        context_->live[id] = impl;
      }
    }
    auto handle = std::make_shared<TcpConnection>(impl);
    ip::tcp::endpoint endpoint;
    SplitAddress split;
    const std::string scheme = "tcp://";
    if (!splitAddress(address, split) || split.tcp.rfind(scheme, 0) != 0 ||
        !parseHostPort(
            split.tcp.substr(scheme.size()),
            /*portRequired=*/true,
            endpoint)) {
      impl->fail(TransportError{
          ErrorCode::kWorkerUnavailable,
          "not a TCP address ('tcp://ip:port', optionally followed by "
          "'?local=' and a local socket): '" +
              address + "'"});
      return handle;
    }
    if (closed) {
      impl->fail(TransportError{
          ErrorCode::kWorkerUnavailable,
          "transport " + context_->options.name + " is closed"});
      return handle;
    }
    std::vector<Endpoint> endpoints;
    if (split.name && context_->options.localSockets &&
        *split.network == network_) {
      endpoints.push_back(localSocketEndpoint(*split.name));
    }
    endpoints.emplace_back(endpoint);
    impl->startConnecting(std::move(endpoints));
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
    std::vector<std::shared_ptr<Acceptor>> acceptors;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      acceptors = acceptors_;
    }
    for (const auto& acceptor : acceptors) {
      auto closeAcceptor = [acceptor]() {
        AsioError ignored;
        acceptor->close(ignored);
      };
      context_->runOnLoop(acceptor->get_executor(), closeAcceptor);
    }
    for (auto& connection : connections) {
      connection->close(
          "closed: transport " + context_->options.name + " is shutting down");
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closeFinished_ = true;
    }
    closeFinishedCv_.notify_all();
  }

  void join() {
    close();
    for (const std::thread& thread : threads_) {
      TORCH_CHECK(
          thread.get_id() != std::this_thread::get_id(),
          "TcpTransport::join() called from its own io thread");
    }
    {
      // A close() on another thread may still be closing connections; the
      // io threads must outlive what it starts.
      std::unique_lock<std::mutex> lock(mutex_);
      closeFinishedCv_.wait_for(lock, kJoinTimeout, [this]() {
        return closeFinished_;
      });
    }
    // No waiting caller runs the loop from here on: the io threads, then
    // join() itself, finish its work.
    context_->polling.closeToDrivers();
    waitDriver_.reset();
    if (threads_.empty()) {
      return;
    }
    work_.reset();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!runningCv_.wait_for(lock, kJoinTimeout, [this]() {
            return running_ == 0;
          })) {
        TORCHRPC_LOG(kWarning)
            << "TcpTransport " << context_->options.name
            << ": io threads still busy after "
            << std::chrono::duration_cast<std::chrono::seconds>(kJoinTimeout)
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
      acceptors_.clear();
    }
    // Taken before `joined` is set: whoever sees it set and would work
    // inline waits for the poll below (TcpContext::runOnLoop).
    std::lock_guard<std::recursive_mutex> lastPoll(context_->lastPoll);
    {
      std::lock_guard<std::mutex> lock(context_->postMutex);
      context_->joined.store(true);
    }
    // Whatever was posted while the threads were leaving runs here, so that
    // no handler (holding a connection) stays queued.
    context_->io.restart();
    try {
      context_->io.poll();
    } catch (const std::exception& e) {
      TORCHRPC_LOG(kError) << "TcpTransport " << context_->options.name
                           << ": callback threw during join: " << e.what();
    }
  }

  void watchAwaitedReplies(std::shared_ptr<const std::atomic<int64_t>> count) {
    context_->polling.watchAwaitedReplies(std::move(count));
  }

 private:
  void runIo() {
    while (true) {
      try {
        if (context_->polling.enabled()) {
          context_->polling.run();
        } else {
          context_->io.run();
        }
        break;
      } catch (const std::exception& e) {
        // A callback threw; keep serving the other connections.
        TORCHRPC_LOG(kError)
            << "TcpTransport " << context_->options.name
            << ": callback threw on an io thread: " << e.what();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --running_;
    runningCv_.notify_all();
  }

  // A listening acceptor on its own strand: its handlers, the retry
  // timer's and close()'s all run there, never two at once (a waiting
  // caller that drives the loop is another thread).
  std::shared_ptr<Acceptor> openAcceptor(
      const Endpoint& endpoint,
      AsioError& ec) {
    auto acceptor = std::make_shared<Acceptor>(asio::make_strand(context_->io));
    acceptor->open(endpoint.protocol(), ec);
    if (!ec && !isLocal(endpoint)) {
      acceptor->set_option(Acceptor::reuse_address(true), ec);
    }
    if (!ec) {
      acceptor->bind(endpoint, ec);
    }
    if (!ec) {
      acceptor->listen(asio::socket_base::max_listen_connections, ec);
    }
    return acceptor;
  }

  // The acceptor's handlers hold the transport weakly: one left queued
  // (join() stopped a loop that would not finish) must not keep it, and
  // through it the io_context that holds the handler, alive for good.
  void acceptNext(const std::shared_ptr<Acceptor>& acceptor) {
    Strand strand = asio::make_strand(context_->io);
    std::weak_ptr<TcpTransportImpl> weak = shared_from_this();
    acceptor->async_accept(
        strand,
        [weak, acceptor, strand](const AsioError& ec, Socket socket) {
          if (auto self = weak.lock()) {
            self->onAccepted(acceptor, strand, ec, std::move(socket));
          }
        });
  }

  void onAccepted(
      const std::shared_ptr<Acceptor>& acceptor,
      const Strand& strand,
      const AsioError& ec,
      Socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor->is_open()) {
      return;
    }
    if (ec) {
      // E.g. out of file descriptors: back off instead of spinning.
      TORCHRPC_LOG(kWarning)
          << "TcpTransport " << context_->options.name << ": accept failed ("
          << ec.message() << "); retrying";
      auto timer =
          std::make_shared<asio::steady_timer>(acceptor->get_executor());
      timer->expires_after(kAcceptRetryDelay);
      std::weak_ptr<TcpTransportImpl> weak = shared_from_this();
      timer->async_wait([weak, acceptor, timer](const AsioError& e) {
        auto self = weak.lock();
        if (self && !e && acceptor->is_open()) {
          self->acceptNext(acceptor);
        }
      });
      return;
    }
    AsioError ignored;
    const Endpoint remote = socket.remote_endpoint(ignored);
    const std::string peer = describeEndpoint(remote, socket.native_handle());
    std::shared_ptr<TcpConnectionImpl> evicted;
    std::shared_ptr<TcpConnectionImpl> impl;
    {
      std::lock_guard<std::mutex> lock(context_->mutex);
      if (!context_->closed) {
        uint64_t id = context_->nextId++;
        impl = std::make_shared<TcpConnectionImpl>(
            context_,
            Role::kServer,
            id,
            strand,
            std::move(socket),
            isLocal(remote) ? peer : "peer at " + peer);
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
      TORCHRPC_LOG(kWarning)
          << "TcpTransport " << context_->options.name << ": "
          << kMaxHandshakingConnections
          << " connections in their handshake; dropped the oldest, "
          << evicted->describe();
      evicted->fail(TransportError{
          ErrorCode::kWorkerUnavailable,
          "dropped: too many connections in their handshake"});
    }
    if (impl) {
      impl->startAccepted();
    }
  }

  const std::shared_ptr<TcpContext> context_;
  // Where our local sockets are reachable (empty: none offered or tried;
  // Note [Local sockets for peers on this host]).
  const std::string network_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::vector<std::thread> threads_;
  // Set while polling is on; reset by join().
  std::unique_ptr<WaitDriverRegistration> waitDriver_;

  mutable std::mutex mutex_;
  std::condition_variable runningCv_;
  int running_ = 0;
  // Set when the close() that closed the transport has closed every
  // connection it found.
  bool closeFinished_ = false;
  std::condition_variable closeFinishedCv_;
  // TCP's, then the local socket's (if any).
  std::vector<std::shared_ptr<Acceptor>> acceptors_;
  std::string address_;
};

} // namespace tcp

TcpTransport::TcpTransport(TcpTransportOptions options)
    : impl_(std::make_shared<tcp::TcpTransportImpl>(std::move(options))) {}

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

TransportStats TcpTransport::stats() const {
  return impl_->stats();
}

bool TcpTransport::detectsSilentPeers() const {
  return impl_->options().peerTimeout.count() > 0;
}

void TcpTransport::join() {
  impl_->join();
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
