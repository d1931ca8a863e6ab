#pragma once

// A tiny blocking HTTP/1.1 client over a POSIX socket, for tests that talk
// to a metrics endpoint (rpc/detail/metrics_http_server.h) or scrape a
// running worker. Loopback only (an IPv4 or IPv6 literal); every call has a
// deadline and nothing here waits past it. Enough HTTP for that server:
// bodies framed by Content-Length, or by the end of the connection; no
// chunked bodies.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace torchrpc {
namespace testing {

constexpr std::chrono::milliseconds kHttpTimeout{5000};

struct HttpResponse {
  // 0: no whole response arrived (see error).
  int status = 0;
  std::string reason;
  // As received, in order.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string error;

  // The first header named `name` (case-insensitive); empty if none.
  std::string header(const std::string& name) const {
    for (const auto& entry : headers) {
      if (strcasecmp(entry.first.c_str(), name.c_str()) == 0) {
        return entry.second;
      }
    }
    return "";
  }
  bool hasHeader(const std::string& name) const {
    for (const auto& entry : headers) {
      if (strcasecmp(entry.first.c_str(), name.c_str()) == 0) {
        return true;
      }
    }
    return false;
  }
};

// One connection; requests on it reuse it (keep-alive). Closed on
// destruction.
class HttpConnection {
 public:
  using Clock = std::chrono::steady_clock;

  // Connects to host:port within `timeout`. receiveBufferBytes > 0 shrinks
  // the socket's receive buffer first (a peer slow to take a response).
  explicit HttpConnection(
      int port,
      const std::string& host = "127.0.0.1",
      std::chrono::milliseconds timeout = kHttpTimeout,
      int receiveBufferBytes = 0) {
    sockaddr_storage address{};
    socklen_t length = 0;
    auto* v4 = reinterpret_cast<sockaddr_in*>(&address);
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&address);
    if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
      v4->sin_family = AF_INET;
      v4->sin_port = htons(static_cast<uint16_t>(port));
      length = sizeof(sockaddr_in);
    } else if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
      v6->sin6_family = AF_INET6;
      v6->sin6_port = htons(static_cast<uint16_t>(port));
      length = sizeof(sockaddr_in6);
    } else {
      error_ = "not an IP address: " + host;
      return;
    }
    fd_ = ::socket(address.ss_family, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd_ < 0) {
      error_ = std::string("socket: ") + std::strerror(errno);
      return;
    }
    if (receiveBufferBytes > 0) {
      ::setsockopt(
          fd_,
          SOL_SOCKET,
          SO_RCVBUF,
          &receiveBufferBytes,
          sizeof(receiveBufferBytes));
    }
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&address), length) != 0) {
      if (errno != EINPROGRESS) {
        error_ = std::string("connect: ") + std::strerror(errno);
        close();
        return;
      }
      if (!waitFor(POLLOUT, Clock::now() + timeout)) {
        error_ = "connect: timed out";
        close();
        return;
      }
      int soError = 0;
      socklen_t size = sizeof(soError);
      ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &soError, &size);
      if (soError != 0) {
        error_ = std::string("connect: ") + std::strerror(soError);
        close();
        return;
      }
    }
  }
  ~HttpConnection() {
    close();
  }
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  bool connected() const {
    return fd_ >= 0;
  }
  // Why the connection failed, if it did.
  const std::string& error() const {
    return error_;
  }

  // Sends `bytes` as they are; false if they could not all go within
  // `timeout` (e.g. the server closed).
  bool sendRaw(
      const std::string& bytes,
      std::chrono::milliseconds timeout = kHttpTimeout) {
    auto deadline = Clock::now() + timeout;
    size_t done = 0;
    while (fd_ >= 0 && done < bytes.size()) {
      ssize_t n =
          ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n > 0) {
        done += static_cast<size_t>(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!waitFor(POLLOUT, deadline)) {
          return false;
        }
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        return false;
      }
    }
    return fd_ >= 0;
  }

  // Sends "<method> <path> HTTP/1.1" with a Host header and `extraHeaders`
  // ("Name: value\r\n" each), then reads the response.
  HttpResponse request(
      const std::string& method,
      const std::string& path,
      const std::string& extraHeaders = "",
      std::chrono::milliseconds timeout = kHttpTimeout) {
    auto deadline = Clock::now() + timeout;
    std::string bytes = method + " " + path +
        " HTTP/1.1\r\nHost: localhost\r\n" + extraHeaders + "\r\n";
    if (!sendRaw(bytes, timeout)) {
      HttpResponse response;
      response.error = "could not send the request";
      return response;
    }
    return readResponse(method == "HEAD", remaining(deadline));
  }

  // Reads one response. `head`: it answers a HEAD, so it has no body
  // whatever its Content-Length says.
  HttpResponse readResponse(
      bool head = false,
      std::chrono::milliseconds timeout = kHttpTimeout) {
    auto deadline = Clock::now() + timeout;
    HttpResponse response;
    size_t end;
    while ((end = pending_.find("\r\n\r\n")) == std::string::npos) {
      if (pending_.size() > kMaxHeaderBytes) {
        response.error = "response header too large";
        return response;
      }
      if (!fill(deadline, response.error)) {
        return response;
      }
    }
    std::string header = pending_.substr(0, end + 2);
    pending_.erase(0, end + 4);
    size_t lineEnd = header.find("\r\n");
    std::string statusLine = header.substr(0, lineEnd);
    // "HTTP/1.1 200 OK"
    if (statusLine.rfind("HTTP/1.", 0) != 0 || statusLine.size() < 12) {
      response.error = "not a status line: " + statusLine;
      return response;
    }
    int status = std::atoi(statusLine.substr(9, 3).c_str());
    response.reason = statusLine.size() > 13 ? statusLine.substr(13) : "";
    size_t at = lineEnd + 2;
    while (at < header.size()) {
      size_t next = header.find("\r\n", at);
      std::string line = header.substr(at, next - at);
      at = next + 2;
      size_t colon = line.find(':');
      if (colon == std::string::npos) {
        response.error = "not a header line: " + line;
        return response;
      }
      std::string value = line.substr(colon + 1);
      value.erase(0, value.find_first_not_of(" \t"));
      value.erase(value.find_last_not_of(" \t") + 1);
      response.headers.emplace_back(line.substr(0, colon), value);
    }
    if (!head && response.hasHeader("Content-Length")) {
      size_t length = std::stoull(response.header("Content-Length"));
      if (length > kMaxBodyBytes) {
        response.error = "body too large";
        return response;
      }
      while (pending_.size() < length) {
        if (!fill(deadline, response.error)) {
          return response;
        }
      }
      response.body = pending_.substr(0, length);
      pending_.erase(0, length);
    } else if (!head) {
      // Framed by the end of the connection.
      std::string end;
      while (fill(deadline, end)) {
        if (pending_.size() > kMaxBodyBytes) {
          response.error = "body too large";
          return response;
        }
      }
      if (end == "timed out") {
        response.error = "timed out reading a body framed by EOF";
        return response;
      }
      response.body = std::move(pending_);
      pending_.clear();
    }
    response.status = status;
    return response;
  }

  // True once the server closed its end (EOF or reset) within `timeout`;
  // bytes that arrive meanwhile are dropped.
  bool waitClosedByServer(std::chrono::milliseconds timeout = kHttpTimeout) {
    auto deadline = Clock::now() + timeout;
    std::string error;
    while (fill(deadline, error)) {
      pending_.clear();
    }
    return error != "timed out";
  }

  void close() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

 private:
  static constexpr size_t kMaxHeaderBytes = 64 * 1024;
  static constexpr size_t kMaxBodyBytes = size_t(256) << 20;

  static std::chrono::milliseconds remaining(Clock::time_point deadline) {
    return std::max(
        std::chrono::milliseconds(0),
        std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - Clock::now()));
  }

  // Polls for `events` until the deadline; false if they did not come.
  bool waitFor(short events, Clock::time_point deadline) {
    while (true) {
      int left = static_cast<int>(remaining(deadline).count());
      if (left <= 0) {
        return false;
      }
      pollfd p{fd_, events, 0};
      int n = ::poll(&p, 1, left);
      if (n > 0) {
        return true;
      }
      if (n < 0 && errno != EINTR) {
        return false;
      }
    }
  }

  // Appends what arrives to pending_; false at EOF ("closed"), on an error
  // or at the deadline ("timed out"), saying which in `error`.
  bool fill(Clock::time_point deadline, std::string& error) {
    if (fd_ < 0) {
      error = "not connected";
      return false;
    }
    while (true) {
      char buffer[16384];
      ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n > 0) {
        pending_.append(buffer, static_cast<size_t>(n));
        return true;
      }
      if (n == 0) {
        error = "closed";
        return false;
      }
      if (errno == EINTR) {
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        error = std::string("recv: ") + std::strerror(errno);
        return false;
      }
      if (!waitFor(POLLIN, deadline)) {
        error = "timed out";
        return false;
      }
    }
  }

  int fd_ = -1;
  std::string error_;
  // Received, not yet returned (the next response's start).
  std::string pending_;
};

// GET `path` on a new connection.
inline HttpResponse httpGet(
    int port,
    const std::string& path,
    const std::string& host = "127.0.0.1",
    std::chrono::milliseconds timeout = kHttpTimeout) {
  HttpConnection connection(port, host, timeout);
  if (!connection.connected()) {
    HttpResponse response;
    response.error = connection.error();
    return response;
  }
  return connection.request("GET", path, "", timeout);
}

} // namespace testing
} // namespace torchrpc
