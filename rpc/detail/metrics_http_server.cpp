#include "torchrpc/rpc/detail/metrics_http_server.h"
#include "torchrpc/rpc/log_level.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/status.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/verb.hpp>
#include <boost/beast/http/write.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

namespace torchrpc {
namespace rpc {
namespace detail {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using Tcp = asio::ip::tcp;
using ErrorCode = boost::system::error_code;
using Clock = std::chrono::steady_clock;

namespace {

// How long close() waits for the io thread before it stops the io_context.
constexpr auto kJoinTimeout = std::chrono::seconds(2);
// Back-off after an accept error (e.g. out of file descriptors).
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(50);
// The lingering close. See Note [Metrics endpoint], 4.
constexpr auto kLingerTimeout = std::chrono::seconds(1);
constexpr size_t kLingerBytes = 64 * 1024;
constexpr size_t kLingerChunkBytes = 4096;
// See Note [Metrics endpoint], 5.
constexpr auto kLogInterval = std::chrono::seconds(60);
// A render() error quoted in a 500 body and a log line.
constexpr size_t kMaxCauseBytes = 512;
// Below this, no legitimate scraper's request line and headers would fit.
constexpr size_t kMinRequestHeaderBytes = 256;

const char* const kMetricsContentType =
    "text/plain; version=0.0.4; charset=utf-8";
const char* const kTextContentType = "text/plain; charset=utf-8";
const char* const kAllowedMethods = "GET, HEAD";

// What a connection over the cap gets when no connection is idle; written
// without waiting (see MetricsHttpServerImpl::refuseFromLoop).
const std::string& refusalBytes() {
  static const std::string bytes = []() {
    std::string body = "too many connections to the metrics endpoint\n";
    return "HTTP/1.1 503 Service Unavailable\r\n"
           "Content-Type: text/plain; charset=utf-8\r\n"
           "Retry-After: 1\r\n"
           "Connection: close\r\n"
           "Content-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
  }();
  return bytes;
}

std::string endpointString(const Tcp::endpoint& endpoint) {
  const asio::ip::address address = endpoint.address();
  std::string host = address.to_string();
  if (address.is_v6()) {
    host = "[" + host + "]";
  }
  return host + ":" + std::to_string(endpoint.port());
}

// An exception's text fit for one line of a response body or a log: no
// control characters (a newline would end the line; a c10::Error's
// backtrace is left out), and bounded.
std::string oneLine(std::string text) {
  if (text.size() > kMaxCauseBytes) {
    text.resize(kMaxCauseBytes);
    text += "...";
  }
  for (char& c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      c = ' ';
    }
  }
  return text;
}

std::string describeException(std::exception_ptr error) {
  try {
    std::rethrow_exception(std::move(error));
  } catch (const c10::Error& e) {
    return oneLine(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return oneLine(e.what());
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

bool isParseError(const ErrorCode& ec) {
  return ec.category() ==
      http::make_error_code(http::error::bad_method).category();
}

} // namespace

// Kinds of rejected connections, each logged at most once per kLogInterval.
enum class LogKind {
  kMalformed,
  kHeaderTooLarge,
  kBody,
  kRequestTimeout,
  kWriteTimeout,
  kOverCap,
  kEvicted,
  kAcceptFailed,
  kRenderFailed,
  kCount,
};

class MetricsHttpConnection;

// The server behind MetricsHttpServer: its listener, connections and io
// thread. Connections reach it through a plain reference: their handlers run
// only on the io thread, which close() joins before the server is destroyed,
// and handlers never run are destroyed with io_ without touching it.
class MetricsHttpServerImpl {
 public:
  MetricsHttpServerImpl(
      MetricsHttpServerOptions options,
      MetricsHttpServer::Render render);
  ~MetricsHttpServerImpl();

  std::string address() const {
    return address_;
  }
  uint16_t port() const {
    return port_;
  }
  void close();

  // The io thread's side, used by the connections.
  bool onLoop() const;
  bool onIoThread() const {
    return std::this_thread::get_id() == threadId_.load();
  }
  const MetricsHttpServerOptions& options() const {
    return options_;
  }
  asio::io_context& io() {
    return io_;
  }
  // render() on the io thread: the body, or nullopt and the cause.
  std::optional<std::string> renderFromLoop(std::string& cause);
  // Logs what `compose()` returns, prefixed with this server, unless a line
  // of the same kind went out less than kLogInterval ago; the next one that
  // goes out says how many did not.
  template <typename Compose>
  void warnFromLoop(LogKind kind, Compose compose);
  // A connection closed: it leaves the table.
  void forgetFromLoop(uint64_t id);

  std::atomic<uint64_t> scrapesServed{0};
  std::atomic<uint64_t> renderFailures{0};
  std::atomic<uint64_t> connectionsRefused{0};
  std::atomic<uint64_t> connectionsEvicted{0};
  std::atomic<uint64_t> requestsRejected{0};
  std::atomic<size_t> openConnections{0};
  std::atomic<size_t> idleConnections{0};

 private:
  struct LogThrottle {
    Clock::time_point nextAt{};
    uint64_t suppressed = 0;
  };

  void bind();
  void runIo();
  void acceptNextFromLoop();
  void onAcceptedFromLoop(const ErrorCode& ec, Tcp::socket socket);
  // Closes the idle connection idle longest; false if none is idle.
  bool evictFromLoop();
  void refuseFromLoop(Tcp::socket socket, const std::string& peer);
  void closeAllFromLoop();

  const MetricsHttpServerOptions options_;
  const MetricsHttpServer::Render render_;
  // Declared before everything holding sockets and timers: destroyed last.
  asio::io_context io_{1};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>>
      work_;
  Tcp::acceptor acceptor_{io_};
  std::string address_;
  uint16_t port_ = 0;
  // "metrics endpoint of worker0 at 127.0.0.1:9100", for log lines.
  std::string describe_;

  // The io thread's.
  std::map<uint64_t, std::shared_ptr<MetricsHttpConnection>> connections_;
  uint64_t nextId_ = 1;
  bool closedFromLoop_ = false;
  std::array<LogThrottle, static_cast<size_t>(LogKind::kCount)> throttles_;
  asio::steady_timer acceptRetryTimer_{io_};

  // close()'s: closeMutex_ guards closing_; joinMutex_ serializes joiners
  // and is never taken on the io thread (render() may call close()).
  std::mutex closeMutex_;
  bool closing_ = false;
  std::mutex joinMutex_;
  std::thread thread_;
  // Set by the io thread itself as it starts.
  std::atomic<std::thread::id> threadId_{};
  std::atomic<bool> joined_{false};
  std::mutex runningMutex_;
  std::condition_variable runningCv_;
  bool running_ = false;
};

// One accepted connection: a request header at a time, answered, then the
// next (keep-alive) or a lingering close. Every phase runs under a timeout;
// see Note [Metrics endpoint]. Lives in the server's table and in the
// handlers it has pending; everything runs on the io thread.
class MetricsHttpConnection
    : public std::enable_shared_from_this<MetricsHttpConnection> {
 public:
  enum class State {
    // Waiting for a request's first byte: fresh, or between requests.
    kAwaiting,
    // A request's header is arriving.
    kReading,
    kWriting,
    // After its last response: dropping what the peer still sends.
    kLingering,
    kClosed,
  };

  MetricsHttpConnection(
      MetricsHttpServerImpl& server,
      uint64_t id,
      Tcp::socket socket,
      std::string peer)
      : server_(server),
        id_(id),
        socket_(std::move(socket)),
        peer_(std::move(peer)),
        buffer_(server.options().maxRequestHeaderBytes),
        timer_(server.io()) {}

  void startFromLoop();
  // Closes the socket at once; pending handlers then see the state. Quiet:
  // whoever closes for a reason logs and counts it.
  void closeFromLoop();

  bool idle() const {
    return state_ == State::kAwaiting || state_ == State::kLingering;
  }
  // Idle and nothing unread in the socket: a request that has arrived but
  // whose readiness the loop has not handled yet is not idle.
  bool evictableFromLoop() {
    if (!idle()) {
      return false;
    }
    ErrorCode ec;
    size_t unread = socket_.available(ec);
    return !ec && (unread == 0 || state_ == State::kLingering);
  }
  Clock::time_point idleSince() const {
    return idleSince_;
  }
  const std::string& peer() const {
    return peer_;
  }

 private:
  using Parser = http::request_parser<http::empty_body>;
  using Response = http::response<http::string_body>;

  void setStateFromLoop(State state);
  void armTimerFromLoop(std::chrono::milliseconds timeout);
  void onTimeoutFromLoop();
  void awaitRequestFromLoop();
  void onReadableFromLoop(const ErrorCode& ec);
  void readHeaderFromLoop();
  void onHeaderFromLoop(const ErrorCode& ec);
  void respondFromLoop();
  // Answers `status` with a one-line `reason`, counts the request as
  // rejected, logs it (throttled), and ends the connection.
  void rejectFromLoop(http::status status, LogKind kind, std::string reason);
  Response textResponse(http::status status, std::string body) const;
  void writeFromLoop(Response response, bool keepAlive);
  void onWrittenFromLoop(const ErrorCode& ec, bool keepAlive);
  void lingerFromLoop();
  void lingerReadFromLoop();

  MetricsHttpServerImpl& server_;
  const uint64_t id_;
  Tcp::socket socket_;
  const std::string peer_;
  State state_ = State::kAwaiting;
  // No request served yet: the first one's deadline runs from the accept.
  bool fresh_ = true;
  size_t requests_ = 0;
  Clock::time_point idleSince_ = Clock::now();
  // Bounded by maxRequestHeaderBytes; holds pipelined bytes between
  // requests.
  beast::flat_buffer buffer_;
  std::optional<Parser> parser_;
  std::optional<Response> response_;
  // response_ answers GET /metrics with 200.
  bool scrapeInFlight_ = false;
  size_t lingered_ = 0;
  asio::steady_timer timer_;
  // A timer cancelled after it expired still runs its handler with success:
  // the handler checks that its generation is still the armed one.
  uint64_t timerGeneration_ = 0;
};

// ---- MetricsHttpConnection
// ---------------------------------------------------

void MetricsHttpConnection::setStateFromLoop(State state) {
  bool wasIdle = idle();
  state_ = state;
  if (idle() && !wasIdle) {
    server_.idleConnections.fetch_add(1);
    idleSince_ = Clock::now();
  } else if (!idle() && wasIdle) {
    server_.idleConnections.fetch_sub(1);
  }
}

void MetricsHttpConnection::startFromLoop() {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(server_.onLoop());
  server_.idleConnections.fetch_add(1); // born kAwaiting
  armTimerFromLoop(server_.options().requestTimeout);
  awaitRequestFromLoop();
}

void MetricsHttpConnection::closeFromLoop() {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(server_.onLoop());
  if (state_ == State::kClosed) {
    return;
  }
  setStateFromLoop(State::kClosed);
  ErrorCode ignored;
  socket_.close(ignored);
  timer_.cancel();
  ++timerGeneration_;
  server_.forgetFromLoop(id_);
}

void MetricsHttpConnection::armTimerFromLoop(
    std::chrono::milliseconds timeout) {
  uint64_t generation = ++timerGeneration_;
  timer_.expires_after(timeout);
  auto self = shared_from_this();
  timer_.async_wait([self, generation](const ErrorCode& ec) {
    if (ec == asio::error::operation_aborted ||
        generation != self->timerGeneration_ ||
        self->state_ == State::kClosed) {
      return;
    }
    self->onTimeoutFromLoop();
  });
}

void MetricsHttpConnection::onTimeoutFromLoop() {
  switch (state_) {
    case State::kAwaiting:
      if (!fresh_) {
        break; // idle between requests for idleTimeout: nothing wrong
      }
      [[fallthrough]];
    case State::kReading:
      server_.requestsRejected.fetch_add(1);
      server_.warnFromLoop(LogKind::kRequestTimeout, [this]() {
        return "closed the connection from " + peer_ +
            ": no whole request within " +
            std::to_string(server_.options().requestTimeout.count()) + " ms";
      });
      break;
    case State::kWriting:
      server_.requestsRejected.fetch_add(1);
      server_.warnFromLoop(LogKind::kWriteTimeout, [this]() {
        return "closed the connection from " + peer_ +
            ": it did not take a response within " +
            std::to_string(server_.options().writeTimeout.count()) + " ms";
      });
      break;
    case State::kLingering:
    case State::kClosed:
      break;
  }
  closeFromLoop();
}

void MetricsHttpConnection::awaitRequestFromLoop() {
  setStateFromLoop(State::kAwaiting);
  if (buffer_.size() > 0) {
    // A pipelined request is already here.
    onReadableFromLoop(ErrorCode());
    return;
  }
  auto self = shared_from_this();
  socket_.async_wait(Tcp::socket::wait_read, [self](const ErrorCode& ec) {
    self->onReadableFromLoop(ec);
  });
}

void MetricsHttpConnection::onReadableFromLoop(const ErrorCode& ec) {
  if (state_ == State::kClosed) {
    return;
  }
  if (ec) {
    closeFromLoop();
    return;
  }
  setStateFromLoop(State::kReading);
  if (!fresh_) {
    // A kept-alive connection's request runs from its first byte.
    armTimerFromLoop(server_.options().requestTimeout);
  }
  readHeaderFromLoop();
}

void MetricsHttpConnection::readHeaderFromLoop() {
  const size_t limit = server_.options().maxRequestHeaderBytes;
  parser_.emplace();
  parser_->header_limit(static_cast<uint32_t>(
      std::min<size_t>(limit, std::numeric_limits<uint32_t>::max())));
  // A body is refused before it is read: with a limit of 0, a
  // Content-Length > 0 fails the header (http::error::body_limit).
  parser_->body_limit(0);
  auto self = shared_from_this();
  http::async_read_header(
      socket_,
      buffer_,
      *parser_,
      [self](const ErrorCode& ec, size_t) { self->onHeaderFromLoop(ec); });
}

void MetricsHttpConnection::onHeaderFromLoop(const ErrorCode& ec) {
  if (state_ == State::kClosed) {
    return;
  }
  const MetricsHttpServerOptions& options = server_.options();
  if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
    rejectFromLoop(
        http::status::request_header_fields_too_large,
        LogKind::kHeaderTooLarge,
        "request header over " + std::to_string(options.maxRequestHeaderBytes) +
            " bytes");
    return;
  }
  if (ec == http::error::body_limit) {
    rejectFromLoop(
        http::status::payload_too_large,
        LogKind::kBody,
        "a request with a body (this endpoint takes none)");
    return;
  }
  if (ec == http::error::partial_message) {
    // The peer stopped sending mid-header: nobody to answer.
    server_.requestsRejected.fetch_add(1);
    server_.warnFromLoop(LogKind::kMalformed, [this]() {
      return "closed the connection from " + peer_ +
          ": it ended in the middle of a request";
    });
    closeFromLoop();
    return;
  }
  if (ec && isParseError(ec) && ec != http::error::end_of_stream) {
    rejectFromLoop(
        http::status::bad_request,
        LogKind::kMalformed,
        "malformed request: " + ec.message());
    return;
  }
  if (ec) {
    // The peer closed between requests, reset, or we closed it.
    closeFromLoop();
    return;
  }
  if (parser_->chunked()) {
    rejectFromLoop(
        http::status::payload_too_large,
        LogKind::kBody,
        "a request with a chunked body (this endpoint takes none)");
    return;
  }
  respondFromLoop();
}

MetricsHttpConnection::Response MetricsHttpConnection::textResponse(
    http::status status,
    std::string body) const {
  Response response(status, 11);
  response.set(http::field::content_type, kTextContentType);
  response.body() = std::move(body);
  response.prepare_payload();
  return response;
}

void MetricsHttpConnection::rejectFromLoop(
    http::status status,
    LogKind kind,
    std::string reason) {
  server_.requestsRejected.fetch_add(1);
  server_.warnFromLoop(kind, [this, status, &reason]() {
    return "answered " + std::to_string(static_cast<int>(status)) +
        " and closed the connection from " + peer_ + ": " + reason;
  });
  writeFromLoop(textResponse(status, reason + "\n"), /*keepAlive=*/false);
}

void MetricsHttpConnection::respondFromLoop() {
  const auto& request = parser_->get();
  const MetricsHttpServerOptions& options = server_.options();
  ++requests_;
  const bool keepAlive =
      request.keep_alive() && requests_ < options.maxRequestsPerConnection;
  beast::string_view target = request.target();
  target = target.substr(0, target.find('?'));
  const bool head = request.method() == http::verb::head;
  const bool get = request.method() == http::verb::get;

  Response response;
  if (target != "/metrics" && target != "/") {
    response =
        textResponse(http::status::not_found, "not found; try /metrics\n");
  } else if (!get && !head) {
    response = textResponse(
        http::status::method_not_allowed,
        "method not allowed; use GET or HEAD\n");
    response.set(http::field::allow, kAllowedMethods);
  } else if (target == "/") {
    std::string who = options.name.empty() ? "" : " of " + options.name;
    response = textResponse(
        http::status::ok,
        "torchrpc worker metrics" + who + ": GET /metrics\n");
  } else {
    std::string cause;
    std::optional<std::string> body = server_.renderFromLoop(cause);
    if (body) {
      response = Response(http::status::ok, 11);
      response.set(http::field::content_type, kMetricsContentType);
      response.body() = std::move(*body);
      response.prepare_payload();
      // Counted once the peer has taken it.
      scrapeInFlight_ = get;
    } else {
      response = textResponse(
          http::status::internal_server_error,
          "metrics render failed: " + cause + "\n");
    }
  }
  response.version(request.version());
  if (head) {
    // Content-Length stays the GET body's; no body goes out.
    size_t length = response.body().size();
    response.body().clear();
    response.content_length(length);
  }
  writeFromLoop(std::move(response), keepAlive);
}

void MetricsHttpConnection::writeFromLoop(Response response, bool keepAlive) {
  parser_.reset();
  response.keep_alive(keepAlive);
  response_.emplace(std::move(response));
  setStateFromLoop(State::kWriting);
  armTimerFromLoop(server_.options().writeTimeout);
  auto self = shared_from_this();
  http::async_write(
      socket_,
      *response_,
      [self, keepAlive](const ErrorCode& ec, size_t) {
        self->onWrittenFromLoop(ec, keepAlive);
      });
}

void MetricsHttpConnection::onWrittenFromLoop(
    const ErrorCode& ec,
    bool keepAlive) {
  if (state_ == State::kClosed) {
    return;
  }
  response_.reset();
  if (ec) {
    closeFromLoop();
    return;
  }
  if (scrapeInFlight_) {
    scrapeInFlight_ = false;
    server_.scrapesServed.fetch_add(1);
  }
  if (!keepAlive) {
    lingerFromLoop();
    return;
  }
  fresh_ = false;
  armTimerFromLoop(server_.options().idleTimeout);
  awaitRequestFromLoop();
}

void MetricsHttpConnection::lingerFromLoop() {
  setStateFromLoop(State::kLingering);
  ErrorCode ignored;
  socket_.shutdown(Tcp::socket::shutdown_send, ignored);
  buffer_.consume(buffer_.size());
  armTimerFromLoop(
      std::chrono::duration_cast<std::chrono::milliseconds>(kLingerTimeout));
  lingerReadFromLoop();
}

void MetricsHttpConnection::lingerReadFromLoop() {
  if (lingered_ >= kLingerBytes) {
    closeFromLoop();
    return;
  }
  // The request buffer, emptied, holds what is dropped: nothing new is
  // allocated.
  auto space = buffer_.prepare(std::min(kLingerChunkBytes, buffer_.max_size()));
  auto self = shared_from_this();
  socket_.async_read_some(space, [self](const ErrorCode& ec, size_t n) {
    if (self->state_ == State::kClosed) {
      return;
    }
    if (ec) {
      self->closeFromLoop(); // EOF: the peer read the response and closed
      return;
    }
    self->lingered_ += n;
    self->lingerReadFromLoop();
  });
}

// ---- MetricsHttpServerImpl
// ---------------------------------------------------

MetricsHttpServerImpl::MetricsHttpServerImpl(
    MetricsHttpServerOptions options,
    MetricsHttpServer::Render render)
    : options_(std::move(options)),
      render_(std::move(render)) {
  TORCH_CHECK(render_, "the metrics endpoint needs a render function");
  TORCH_CHECK(
      !options_.host.empty(),
      "the metrics endpoint needs a host to listen on (\"0.0.0.0\" for "
      "every interface)");
  TORCH_CHECK(
      options_.maxConnections >= 1 && options_.maxRequestsPerConnection >= 1,
      "the metrics endpoint needs maxConnections and "
      "maxRequestsPerConnection of at least 1");
  TORCH_CHECK(
      options_.maxRequestHeaderBytes >= kMinRequestHeaderBytes,
      "the metrics endpoint needs maxRequestHeaderBytes of at least ",
      kMinRequestHeaderBytes,
      ", got ",
      options_.maxRequestHeaderBytes);
  TORCH_CHECK(
      options_.requestTimeout.count() > 0 &&
          options_.writeTimeout.count() > 0 && options_.idleTimeout.count() > 0,
      "the metrics endpoint's timeouts must be positive");
  bind();
  describe_ = "metrics endpoint" +
      (options_.name.empty() ? "" : " of " + options_.name) + " at " + address_;
  work_.emplace(asio::make_work_guard(io_));
  asio::post(io_, [this]() { acceptNextFromLoop(); });
  running_ = true;
  thread_ = std::thread([this]() { runIo(); });
}

MetricsHttpServerImpl::~MetricsHttpServerImpl() {
  close();
}

void MetricsHttpServerImpl::bind() {
  const std::string& host = options_.host;
  const uint16_t port = options_.port;
  std::vector<Tcp::endpoint> endpoints;
  ErrorCode ec;
  asio::ip::address literal = asio::ip::make_address(host, ec);
  if (!ec) {
    endpoints.emplace_back(literal, port);
  } else {
    Tcp::resolver resolver(io_);
    auto results = resolver.resolve(
        host,
        std::to_string(port),
        Tcp::resolver::numeric_service,
        ec);
    TORCH_CHECK(
        !ec && !results.empty(),
        "the metrics endpoint",
        options_.name.empty() ? "" : " of " + options_.name,
        " cannot listen on ",
        host,
        ":",
        port,
        ": cannot resolve '",
        host,
        "': ",
        ec ? ec.message() : "no address");
    for (const auto& result : results) {
      endpoints.push_back(result.endpoint());
    }
  }
  // The first address that binds, as a scraper given the name would try
  // them.
  std::string causes;
  for (const Tcp::endpoint& endpoint : endpoints) {
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) {
      // A restarted worker can take its port back from TIME_WAIT; a port
      // some socket listens on still fails to bind.
      acceptor_.set_option(Tcp::acceptor::reuse_address(true), ec);
    }
    if (!ec) {
      acceptor_.bind(endpoint, ec);
    }
    if (!ec) {
      acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    }
    Tcp::endpoint bound;
    if (!ec) {
      bound = acceptor_.local_endpoint(ec);
    }
    if (!ec) {
      address_ = endpointString(bound);
      port_ = bound.port();
      return;
    }
    // Which address failed is worth saying only when the name had several.
    causes += (causes.empty() ? "" : "; ") +
        (endpoints.size() > 1 ? endpointString(endpoint) + ": " : "") +
        ec.message();
    ErrorCode ignored;
    acceptor_.close(ignored);
  }
  TORCH_CHECK(
      false,
      "the metrics endpoint",
      options_.name.empty() ? "" : " of " + options_.name,
      " cannot listen on ",
      host,
      ":",
      port,
      ": ",
      causes);
}

bool MetricsHttpServerImpl::onLoop() const {
  // After the io thread is joined, the closing thread stands in for it.
  return onIoThread() || joined_.load();
}

void MetricsHttpServerImpl::runIo() {
  threadId_.store(std::this_thread::get_id());
  while (true) {
    try {
      io_.run();
      break;
    } catch (const std::exception& e) {
      // A handler threw (e.g. out of memory): keep serving the others.
      TORCHRPC_LOG(kError) << describe_ << ": a handler threw: " << e.what();
    }
  }
  std::lock_guard<std::mutex> lock(runningMutex_);
  running_ = false;
  runningCv_.notify_all();
}

void MetricsHttpServerImpl::close() {
  {
    std::lock_guard<std::mutex> lock(closeMutex_);
    if (!closing_) {
      closing_ = true;
      asio::post(io_, [this]() { closeAllFromLoop(); });
      work_.reset();
    }
  }
  if (onIoThread()) {
    return; // inside render(): the thread cannot join itself
  }
  std::lock_guard<std::mutex> joinLock(joinMutex_);
  if (!thread_.joinable()) {
    return;
  }
  {
    std::unique_lock<std::mutex> lock(runningMutex_);
    if (!runningCv_.wait_for(lock, kJoinTimeout, [this]() {
          return !running_;
        })) {
      TORCHRPC_LOG(kWarning)
          << describe_ << ": io thread still busy after "
          << std::chrono::duration_cast<std::chrono::seconds>(kJoinTimeout)
                 .count()
          << " s (a render() that blocks?); stopping it";
      io_.stop();
    }
  }
  thread_.join();
  joined_.store(true);
  // Closes whatever the posted call had no chance to, if io_ was stopped.
  closeAllFromLoop();
}

std::optional<std::string> MetricsHttpServerImpl::renderFromLoop(
    std::string& cause) {
  try {
    return render_();
  } catch (...) {
    cause = describeException(std::current_exception());
  }
  renderFailures.fetch_add(1);
  warnFromLoop(LogKind::kRenderFailed, [&cause]() {
    return "render() threw, answered 500: " + cause;
  });
  return std::nullopt;
}

template <typename Compose>
void MetricsHttpServerImpl::warnFromLoop(LogKind kind, Compose compose) {
  LogThrottle& throttle = throttles_[static_cast<size_t>(kind)];
  Clock::time_point now = Clock::now();
  if (now < throttle.nextAt) {
    ++throttle.suppressed;
    return;
  }
  throttle.nextAt = now + kLogInterval;
  std::string more;
  if (throttle.suppressed > 0) {
    more = " (and " + std::to_string(throttle.suppressed) +
        " more like it not logged since the last line)";
    throttle.suppressed = 0;
  }
  TORCHRPC_LOG(kWarning) << describe_ << ": " << compose() << more;
}

void MetricsHttpServerImpl::forgetFromLoop(uint64_t id) {
  if (connections_.erase(id) > 0) {
    openConnections.fetch_sub(1);
  }
}

void MetricsHttpServerImpl::acceptNextFromLoop() {
  acceptor_.async_accept([this](const ErrorCode& ec, Tcp::socket socket) {
    onAcceptedFromLoop(ec, std::move(socket));
  });
}

void MetricsHttpServerImpl::onAcceptedFromLoop(
    const ErrorCode& ec,
    Tcp::socket socket) {
  if (closedFromLoop_ || ec == asio::error::operation_aborted) {
    return;
  }
  if (ec) {
    // E.g. out of file descriptors: back off instead of spinning.
    warnFromLoop(LogKind::kAcceptFailed, [&ec]() {
      return "accept failed (" + ec.message() + "); retrying";
    });
    acceptRetryTimer_.expires_after(kAcceptRetryDelay);
    acceptRetryTimer_.async_wait([this](const ErrorCode& e) {
      if (!e && !closedFromLoop_) {
        acceptNextFromLoop();
      }
    });
    return;
  }
  ErrorCode ignored;
  std::string peer = endpointString(socket.remote_endpoint(ignored));
  if (connections_.size() >= options_.maxConnections && !evictFromLoop()) {
    refuseFromLoop(std::move(socket), peer);
  } else {
    uint64_t id = nextId_++;
    auto connection = std::make_shared<MetricsHttpConnection>(
        *this,
        id,
        std::move(socket),
        std::move(peer));
    connections_.emplace(id, connection);
    openConnections.fetch_add(1);
    connection->startFromLoop();
  }
  acceptNextFromLoop();
}

bool MetricsHttpServerImpl::evictFromLoop() {
  std::shared_ptr<MetricsHttpConnection> oldest;
  for (auto& entry : connections_) {
    auto& connection = entry.second;
    if (connection->evictableFromLoop() &&
        (!oldest || connection->idleSince() < oldest->idleSince())) {
      oldest = connection;
    }
  }
  if (!oldest) {
    return false;
  }
  connectionsEvicted.fetch_add(1);
  warnFromLoop(LogKind::kEvicted, [this, &oldest]() {
    return std::to_string(options_.maxConnections) +
        " connections open; closed the one idle longest, from " +
        oldest->peer();
  });
  oldest->closeFromLoop();
  return true;
}

void MetricsHttpServerImpl::refuseFromLoop(
    Tcp::socket socket,
    const std::string& peer) {
  connectionsRefused.fetch_add(1);
  warnFromLoop(LogKind::kOverCap, [this, &peer]() {
    return std::to_string(options_.maxConnections) +
        " connections open, none idle; refused the one from " + peer;
  });
  // Best effort, never waiting: a fresh socket's send buffer takes these
  // few bytes unless the peer is gone.
  ErrorCode ignored;
  socket.non_blocking(true, ignored);
  socket.send(asio::buffer(refusalBytes()), 0, ignored);
  socket.shutdown(Tcp::socket::shutdown_both, ignored);
  socket.close(ignored);
}

void MetricsHttpServerImpl::closeAllFromLoop() {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(onLoop());
  closedFromLoop_ = true;
  ErrorCode ignored;
  acceptor_.close(ignored);
  acceptRetryTimer_.cancel();
  // Closing a connection takes it out of the table: iterate over a copy.
  std::vector<std::shared_ptr<MetricsHttpConnection>> open;
  for (auto& entry : connections_) {
    open.push_back(entry.second);
  }
  for (auto& connection : open) {
    connection->closeFromLoop();
  }
  uint64_t suppressed = 0;
  for (LogThrottle& throttle : throttles_) {
    suppressed += throttle.suppressed;
    throttle.suppressed = 0;
  }
  if (suppressed > 0) {
    TORCHRPC_LOG(kWarning) << describe_
                           << ": closed; warnings not logged: " << suppressed
                           << " (its counters count them all)";
  }
}

// ---- MetricsHttpServer
// -------------------------------------------------------

MetricsHttpServer::MetricsHttpServer(
    MetricsHttpServerOptions options,
    Render render)
    : impl_(std::make_unique<MetricsHttpServerImpl>(
          std::move(options),
          std::move(render))) {}

MetricsHttpServer::~MetricsHttpServer() {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(
      !impl_->onIoThread(),
      "a MetricsHttpServer destroyed inside its render()");
  impl_->close();
}

std::string MetricsHttpServer::address() const {
  return impl_->address();
}

uint16_t MetricsHttpServer::port() const {
  return impl_->port();
}

void MetricsHttpServer::close() {
  impl_->close();
}

uint64_t MetricsHttpServer::scrapesServed() const {
  return impl_->scrapesServed.load();
}

uint64_t MetricsHttpServer::renderFailures() const {
  return impl_->renderFailures.load();
}

uint64_t MetricsHttpServer::connectionsRefused() const {
  return impl_->connectionsRefused.load();
}

uint64_t MetricsHttpServer::connectionsEvicted() const {
  return impl_->connectionsEvicted.load();
}

uint64_t MetricsHttpServer::requestsRejected() const {
  return impl_->requestsRejected.load();
}

size_t MetricsHttpServer::openConnections() const {
  return impl_->openConnections.load();
}

size_t MetricsHttpServer::idleConnections() const {
  return impl_->idleConnections.load();
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
