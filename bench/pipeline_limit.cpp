// What this machine allows for calls_per_s_64_outstanding without an RPC
// library: the same exchange (a one-element float tensor, the server
// returns x + 1 computed by libtorch, at most 64 calls outstanding) over one
// loopback TCP connection between two processes, with nothing but what the
// workload needs. Requests and replies are bare 4-byte floats (no header,
// no call id: the connection keeps them in order), both sides batch every
// write (all the requests a read's replies make room for go in one write;
// all the replies to one read in one write), and reads block. Per call the
// server makes its input tensor and x + 1, the client a tensor of the
// reply, as torchrpc's and gRPC's benchmarks do. So this is a bound, not a
// competitor: no framing, no futures, no call table, no error path.
// bench/RESULTS.md compares it with the three sides of bench/compare.
//
//   BUILD_DIR/bench/pipeline_limit [--calls N]
//
// Prints one JSON line like the other benchmarks. Exits 1 if a call's
// answer is wrong or a socket fails; the server child is killed by pid
// however the client ends.

#include <ATen/ATen.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int kWindow = 64;
constexpr size_t kValueBytes = sizeof(float);

// The server child, in the client (0 in the child itself).
pid_t serverPid = 0;

[[noreturn]] void die(const std::string& what) {
  std::cerr << "pipeline_limit: " << what << ": " << std::strerror(errno)
            << "\n";
  if (serverPid > 0) {
    ::kill(serverPid, SIGKILL);
    ::waitpid(serverPid, nullptr, 0);
  }
  std::exit(1);
}

void writeAll(int fd, const char* data, size_t bytes) {
  while (bytes > 0) {
    ssize_t n = ::send(fd, data, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      die("send");
    }
    data += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Reads what the socket has (at least one byte) after `have` buffered
// bytes; returns the new count, 0 at EOF.
size_t readSome(int fd, std::vector<char>& buffer, size_t have) {
  for (;;) {
    ssize_t n = ::recv(fd, buffer.data() + have, buffer.size() - have, 0);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      die("recv");
    }
    return n == 0 ? 0 : have + static_cast<size_t>(n);
  }
}

void noDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Answers every request with x + 1 until the client closes.
void serve(int fd) {
  std::vector<char> in(64 << 10);
  std::vector<char> out;
  size_t have = 0;
  for (;;) {
    size_t now = readSome(fd, in, have);
    if (now == 0) {
      return;
    }
    const size_t whole = now / kValueBytes;
    out.resize(whole * kValueBytes);
    for (size_t i = 0; i < whole; ++i) {
      at::Tensor x = at::empty({1}, at::kFloat);
      std::memcpy(x.data_ptr(), in.data() + i * kValueBytes, kValueBytes);
      at::Tensor y = x + 1;
      std::memcpy(out.data() + i * kValueBytes, y.data_ptr(), kValueBytes);
    }
    writeAll(fd, out.data(), out.size());
    have = now - whole * kValueBytes;
    std::memmove(in.data(), in.data() + whole * kValueBytes, have);
  }
}

// Runs `calls` calls with at most kWindow outstanding; returns seconds.
double pipelined(int fd, int calls) {
  const float one = 1.0f;
  std::vector<char> requests;
  auto queue = [&](int count) {
    for (int i = 0; i < count; ++i) {
      requests.insert(
          requests.end(),
          reinterpret_cast<const char*>(&one),
          reinterpret_cast<const char*>(&one) + kValueBytes);
    }
  };
  std::vector<char> in(64 << 10);
  size_t have = 0;
  const auto start = std::chrono::steady_clock::now();
  int issued = std::min(calls, kWindow);
  queue(issued);
  writeAll(fd, requests.data(), requests.size());
  int answered = 0;
  while (answered < calls) {
    size_t now = readSome(fd, in, have);
    if (now == 0) {
      errno = ECONNRESET;
      die("server closed");
    }
    const size_t whole = now / kValueBytes;
    for (size_t i = 0; i < whole; ++i) {
      at::Tensor reply = at::empty({1}, at::kFloat);
      std::memcpy(reply.data_ptr(), in.data() + i * kValueBytes, kValueBytes);
      if (reply.item<float>() != 2.0f) {
        errno = 0;
        die("wrong answer " + std::to_string(reply.item<float>()));
      }
    }
    answered += static_cast<int>(whole);
    have = now - whole * kValueBytes;
    std::memmove(in.data(), in.data() + whole * kValueBytes, have);
    const int more = std::min<int>(static_cast<int>(whole), calls - issued);
    if (more > 0) {
      requests.clear();
      queue(more);
      writeAll(fd, requests.data(), requests.size());
      issued += more;
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

} // namespace

int main(int argc, char** argv) {
  int calls = 300000;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--calls" && i + 1 < argc) {
      calls = std::atoi(argv[++i]);
    } else {
      std::cerr << "usage: pipeline_limit [--calls N]\n";
      return 2;
    }
  }
  if (calls < kWindow) {
    std::cerr << "pipeline_limit: --calls must be at least " << kWindow << "\n";
    return 2;
  }
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (listener < 0 ||
      ::bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) !=
          0) {
    die("listen on 127.0.0.1");
  }
  pid_t child = ::fork();
  if (child < 0) {
    die("fork");
  }
  if (child == 0) {
    int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) {
      die("accept");
    }
    noDelay(fd);
    serve(fd);
    ::_exit(0);
  }
  serverPid = child;
  ::close(listener);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
          0) {
    die("connect");
  }
  noDelay(fd);
  pipelined(fd, calls / 10); // warm-up
  const double seconds = pipelined(fd, calls);
  ::close(fd);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::cerr << "pipeline_limit: the server failed\n";
    return 1;
  }
  std::printf(
      "{\"workload\": \"calls_per_s_64_outstanding_limit\", \"metric\": "
      "\"throughput\", \"unit\": \"calls/s\", \"value\": %.0f, \"better\": "
      "\"higher\"}\n",
      calls / seconds);
  return 0;
}
