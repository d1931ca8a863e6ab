#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

// NB: Boost.Beast and Asio stay out of this header; the .cpp includes them.

namespace torchrpc {
namespace rpc {
namespace detail {

// Note [Metrics endpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A worker may serve its metrics over HTTP for Prometheus to scrape, in
// Prometheus' text exposition format. Whoever can reach the port can talk
// to it, so every peer is treated as an outsider: nothing it sends may
// crash the process, make the server allocate without a cap, wedge it,
// stretch close(), or keep a legitimate scrape from being served for
// longer than a timeout. Hence the caps:
//   1. Connections: at most maxConnections are open. A connection over the
//      cap makes room by closing the open connection idle longest -- one
//      waiting for a request of which no byte has arrived: fresh, or kept
//      alive between requests, or lingering after its last response (4.);
//      if none is idle, the new connection is answered 503 and closed at
//      once. New connections are always accepted, never left in the
//      kernel's backlog where a scraper would hang until its own timeout.
//      Every connection that is not idle is bounded by a timeout (3.), so a
//      legitimate client waits at most requestTimeout (or writeTimeout) for
//      room, however many connections an outsider opens.
//   2. Memory: a request is a header and nothing else. The header is read
//      into a buffer of at most maxRequestHeaderBytes, and a longer one is
//      answered 431; a request announcing a body (Content-Length > 0, or
//      chunked) is answered 413 before a byte of the body is read. So a
//      connection holds at most maxRequestHeaderBytes of request, plus the
//      response being written.
//   3. Time: a request's whole header must arrive within requestTimeout of
//      the connection being accepted, or of the request's first byte on a
//      kept-alive connection: a slowloris peer trickling bytes is closed
//      then. A response must be taken within writeTimeout (a peer that
//      never reads), a kept-alive connection may idle idleTimeout between
//      requests, and serves at most maxRequestsPerConnection requests.
//      A connection is under one of these timeouts at every moment of its
//      life (the lingering close of 4. included), so none can be forgotten.
//   4. After a response that ends the connection (an error, or
//      "Connection: close") the server shuts down its sending side and
//      reads, and drops, at most 64 KiB for at most 1 s before it closes:
//      closing a socket with unread bytes resets the connection, and the
//      peer would then see the reset instead of the response.
//   5. Logs: at most one line a minute per kind of rejection, saying how
//      many were not logged; the counters count every one. A storm of bad
//      connections does not become a storm of log lines.
//   6. close() closes the listener and every connection on the io thread
//      and joins it within a bound whatever peers do. It cannot interrupt
//      a render() in progress, so render() must not block.
// It listens on the host it is given, never on every interface unless told
// to ("0.0.0.0" or "::").
struct MetricsHttpServerOptions {
  // A literal IPv4/IPv6 address or a host name to bind (the first address
  // it resolves to that binds). Never all interfaces unless told "0.0.0.0".
  std::string host = "127.0.0.1";
  // 0: an ephemeral port.
  uint16_t port = 0;
  // The worker's name, for log lines.
  std::string name;
  // Open connections; a connection over the cap closes the one idle longest,
  // or itself if none is idle. See Note [Metrics endpoint].
  size_t maxConnections = 16;
  // The request line and headers together.
  size_t maxRequestHeaderBytes = 8 * 1024;
  // A whole request must arrive within this (slowloris).
  std::chrono::milliseconds requestTimeout{5000};
  // A response must be taken within this (a peer that never reads).
  std::chrono::milliseconds writeTimeout{10000};
  // A kept-alive connection idle between requests.
  std::chrono::milliseconds idleTimeout{30000};
  // Then the response says "Connection: close".
  size_t maxRequestsPerConnection = 100;
};

class MetricsHttpServerImpl;

// Serves GET /metrics (the body render() returns; 500 naming the cause if it
// throws) and GET / (a one-line index), HEAD of both; other paths 404, other
// methods 405. See Note [Metrics endpoint].
//
// Threads: one io thread of its own runs the listener, the connections and
// render(). Every method may be called from any thread, close() also from
// render(); the destructor must not run inside render().
class MetricsHttpServer {
 public:
  // The body for GET /metrics, called on the server's io thread per scrape.
  // Must not block: close() waits for a render() in progress.
  using Render = std::function<std::string()>;

  // Binds and listens at once and serves on a thread of its own. Throws
  // c10::Error naming host, port and the cause (e.g. address in use,
  // unresolvable host) if it cannot, or if an option is out of range.
  MetricsHttpServer(MetricsHttpServerOptions options, Render render);
  // close(), then join.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // "host:port" actually bound: "127.0.0.1:9100", "[::1]:9100".
  std::string address() const;
  uint16_t port() const;

  // Stops accepting and closes every connection; returns within a bound
  // whatever peers do (unless render() blocks). Idempotent. Called from
  // render(), it stops the server without waiting for its thread.
  void close();

  // Counters, read from any thread; each counts every event since start.
  // GET /metrics answered 200.
  uint64_t scrapesServed() const;
  // render() threw: answered 500.
  uint64_t renderFailures() const;
  // Connections over maxConnections closed at once (503): none was idle.
  uint64_t connectionsRefused() const;
  // Idle connections closed to make room for a new one.
  uint64_t connectionsEvicted() const;
  // Requests rejected: malformed, header too large, with a body, or not
  // received (requestTimeout) or not taken (writeTimeout) in time.
  uint64_t requestsRejected() const;
  // Open now, and of those, idle: waiting for a request of which no byte
  // has arrived, or lingering after their last response.
  size_t openConnections() const;
  size_t idleConnections() const;

 private:
  std::unique_ptr<MetricsHttpServerImpl> impl_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
