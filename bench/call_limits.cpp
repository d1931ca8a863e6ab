// What this machine allows for two of bench/compare's workloads without an
// RPC library: the same exchange (a one-element float tensor, the server
// returns x + 1 computed by libtorch) between two processes over one
// socket, with nothing but what the workload needs. Requests and replies
// are bare 4-byte floats: no header, no call id (the socket keeps them in
// order), no futures, no call table, no timeouts, no error path. Per call
// the server makes its input tensor and x + 1, the client a tensor of the
// reply, as torchrpc's and gRPC's benchmarks do. So these are bounds, not
// competitors; bench/compare reports them as "limit" beside the workloads.
//
//   BUILD_DIR/bench/call_limits --workload W [--socket unix|tcp|shm]
//                               [--blocking] [--calls N] [--quick]
//
// calls_per_s_64_outstanding: at most 64 calls outstanding; both sides
// batch every write (all the requests a read's replies make room for in one
// write, all the replies to one read in one write), and reads block.
//
// call_rtt_1elem: one call at a time, each timed; the median. Both sides
// poll non-blocking reads, as torchrpc's waiting callers and io threads do
// after traffic (Note [Polling after traffic]); --blocking makes them
// sleep in recv() instead, which shows what one wake-up costs here.
//
// The socket is a Unix stream socket by default, which is what torchrpc
// connects two workers of one host with (Note [Local sockets for peers on
// this host]); --socket tcp uses loopback TCP, torchrpc's path between
// hosts. --socket shm (call_rtt_1elem only) replaces the socket with one
// shared page that both sides spin on: the round trip of the same
// exchange without the kernel, what a same-host shared-memory path could
// reach at best. Prints one JSON line like the other benchmarks. Exits 1
// if an answer is wrong, a socket fails or the server dies; the server
// child is killed by pid however the client ends.

#include "bench/bench_support.h"

#include <ATen/ATen.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int kWindow = 64;
constexpr size_t kValueBytes = sizeof(float);

// The server child, in the client (0 in the child itself).
pid_t serverPid = 0;
// Reads poll (MSG_DONTWAIT and retry) instead of sleeping in the kernel.
bool pollReads = false;

[[noreturn]] void die(const std::string& what) {
  std::cerr << "call_limits: " << what << ": " << std::strerror(errno) << "\n";
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
  const int flags = pollReads ? MSG_DONTWAIT : 0;
  for (;;) {
    ssize_t n = ::recv(fd, buffer.data() + have, buffer.size() - have, flags);
    if (n < 0 &&
        (errno == EINTR ||
         (pollReads && (errno == EAGAIN || errno == EWOULDBLOCK)))) {
      continue;
    }
    if (n < 0) {
      die("recv");
    }
    return n == 0 ? 0 : have + static_cast<size_t>(n);
  }
}

// The client's check of one reply, through a tensor as the benchmarks do.
// The socket modes send 1 every time (the stream keeps replies in order);
// the shared page varies its requests, so that a stale reply shows.
void checkReply(const char* bytes, float expected = 2.0f) {
  at::Tensor reply = at::empty({1}, at::kFloat);
  std::memcpy(reply.data_ptr(), bytes, kValueBytes);
  if (reply.item<float>() != expected) {
    errno = 0;
    die("wrong answer " + std::to_string(reply.item<float>()));
  }
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
      checkReply(in.data() + i * kValueBytes);
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

// Makes `calls` calls one at a time; returns each call's time in µs.
std::vector<double> roundTrips(int fd, int calls) {
  const float one = 1.0f;
  std::vector<char> in(64);
  std::vector<double> micros;
  micros.reserve(static_cast<size_t>(calls));
  for (int i = 0; i < calls; ++i) {
    const auto start = std::chrono::steady_clock::now();
    writeAll(fd, reinterpret_cast<const char*>(&one), kValueBytes);
    size_t have = 0;
    while (have < kValueBytes) {
      have = readSome(fd, in, have);
      if (have == 0) {
        errno = ECONNRESET;
        die("server closed");
      }
    }
    checkReply(in.data());
    micros.push_back(std::chrono::duration<double, std::micro>(
                         std::chrono::steady_clock::now() - start)
                         .count());
  }
  return micros;
}

// --socket shm: one page shared by the client and the server child. A
// request is its float in `request` and then the call's number in
// `requestSeq`; the reply the same in `reply` and `replySeq`. The client
// waits for replySeq to reach the call's number, the server for requestSeq
// to move, both spinning on the load as the socket modes spin on recv.
struct SharedExchange {
  alignas(64) std::atomic<uint32_t> requestSeq{0};
  float request = 0;
  alignas(64) std::atomic<uint32_t> replySeq{0};
  float reply = 0;
  // Set by the client when it is done: the server returns.
  alignas(64) std::atomic<bool> closed{false};
};
static_assert(
    std::atomic<uint32_t>::is_always_lock_free &&
        std::atomic<bool>::is_always_lock_free,
    "atomics shared between processes must be lock-free");

SharedExchange* mapSharedExchange() {
  void* page = ::mmap(
      nullptr,
      sizeof(SharedExchange),
      PROT_READ | PROT_WRITE,
      MAP_SHARED | MAP_ANONYMOUS,
      -1,
      0);
  if (page == MAP_FAILED) {
    die("mmap a shared page");
  }
  return new (page) SharedExchange();
}

// serve() over the shared page, until the client closes it. The server is
// killed when the client dies (PR_SET_PDEATHSIG, set by its caller), so
// the spin is bounded by the client's life.
void serveShared(SharedExchange& shared) {
  uint32_t seen = 0;
  for (;;) {
    const uint32_t now = shared.requestSeq.load(std::memory_order_acquire);
    if (now == seen) {
      if (shared.closed.load(std::memory_order_acquire)) {
        return;
      }
      continue;
    }
    seen = now;
    at::Tensor x = at::empty({1}, at::kFloat);
    std::memcpy(x.data_ptr(), &shared.request, kValueBytes);
    at::Tensor y = x + 1;
    std::memcpy(&shared.reply, y.data_ptr(), kValueBytes);
    shared.replySeq.store(now, std::memory_order_release);
  }
}

// Fails (die) if the server child has exited: the client then stops
// waiting for a reply, as the socket modes do at end of stream.
void checkServerAlive() {
  int status = 0;
  if (::waitpid(serverPid, &status, WNOHANG) == serverPid) {
    serverPid = 0; // reaped: nothing left to kill
    errno = 0;
    die("the server died");
  }
}

// roundTrips() over the shared page; `first` is the first call's number.
// Call n sends n % 1024, so that a reply to an earlier call would be wrong.
std::vector<double> sharedRoundTrips(
    SharedExchange& shared,
    uint32_t first,
    int calls) {
  std::vector<double> micros;
  micros.reserve(static_cast<size_t>(calls));
  for (int i = 0; i < calls; ++i) {
    const uint32_t seq = first + static_cast<uint32_t>(i);
    const float value = static_cast<float>(seq % 1024);
    const auto start = std::chrono::steady_clock::now();
    shared.request = value;
    shared.requestSeq.store(seq, std::memory_order_release);
    for (uint64_t spins = 1;
         shared.replySeq.load(std::memory_order_acquire) != seq;
         ++spins) {
      if ((spins & 0xffff) == 0) {
        checkServerAlive();
      }
    }
    char bytes[kValueBytes];
    std::memcpy(bytes, &shared.reply, kValueBytes);
    checkReply(bytes, value + 1.0f);
    micros.push_back(std::chrono::duration<double, std::micro>(
                         std::chrono::steady_clock::now() - start)
                         .count());
  }
  return micros;
}

// A connected pair of sockets: a Unix stream socket pair, or loopback TCP
// (a listener on an ephemeral port of 127.0.0.1, one connection).
std::pair<int, int> connectedPair(bool tcp) {
  int fds[2];
  if (!tcp) {
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) {
      die("socketpair");
    }
    return {fds[0], fds[1]};
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
  int client = ::socket(AF_INET, SOCK_STREAM, 0);
  if (client < 0 ||
      ::connect(
          client,
          reinterpret_cast<sockaddr*>(&address),
          sizeof(address)) != 0) {
    die("connect");
  }
  int server = ::accept(listener, nullptr, nullptr);
  if (server < 0) {
    die("accept");
  }
  ::close(listener);
  int one = 1;
  ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return {client, server};
}

// Reaps the server child once the client is done with it; false (having
// said so) if the server failed.
bool reapServer(pid_t child) {
  int status = 0;
  ::waitpid(child, &status, 0);
  serverPid = 0;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::cerr << "call_limits: the server failed\n";
    return false;
  }
  return true;
}

// Closes the client's socket, which ends the server, and reaps it.
bool endServer(int clientFd, pid_t child) {
  ::close(clientFd);
  return reapServer(child);
}

// The round trip's distribution (stderr) and JSON line (stdout).
void reportRoundTrips(
    const std::vector<double>& micros,
    const std::string& socketName) {
  torchrpc::bench::printDistribution("call_limits: round trip", micros);
  std::printf(
      "{\"workload\": \"call_rtt_1elem_limit\", \"metric\": \"median_rtt\", "
      "\"unit\": \"us\", \"value\": %.2f, \"better\": \"lower\", \"socket\": "
      "\"%s\", \"reads\": \"%s\"}\n",
      torchrpc::bench::median(micros),
      socketName.c_str(),
      pollReads ? "polled" : "blocking");
}

[[noreturn]] void usage() {
  std::cerr << "usage: call_limits --workload "
               "calls_per_s_64_outstanding|call_rtt_1elem "
               "[--socket unix|tcp|shm] [--blocking] [--calls N] [--quick]\n";
  std::exit(2);
}

} // namespace

int main(int argc, char** argv) {
  std::string workload;
  std::string socketName = "unix";
  bool blocking = false;
  bool quick = false;
  int calls = -1;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--workload" && i + 1 < argc) {
      workload = argv[++i];
    } else if (arg == "--socket" && i + 1 < argc) {
      socketName = argv[++i];
      if (socketName != "unix" && socketName != "tcp" && socketName != "shm") {
        usage();
      }
    } else if (arg == "--blocking") {
      blocking = true;
    } else if (arg == "--quick") {
      quick = true;
    } else if (arg == "--calls" && i + 1 < argc) {
      calls = std::atoi(argv[++i]);
    } else {
      usage();
    }
  }
  const bool pipelinedWorkload = workload == "calls_per_s_64_outstanding";
  if (!pipelinedWorkload && workload != "call_rtt_1elem") {
    usage();
  }
  const bool shared = socketName == "shm";
  if (shared && (pipelinedWorkload || blocking)) {
    std::cerr << "call_limits: --socket shm measures call_rtt_1elem with "
                 "polled reads only\n";
    return 2;
  }
  // The workloads' own counts (bench/README.md); the pipelined bound runs
  // longer, its rate is steadier for it.
  if (calls < 0) {
    calls =
        pipelinedWorkload ? (quick ? 30000 : 300000) : (quick ? 1000 : 5000);
  }
  const int warmUp = pipelinedWorkload ? calls / 10 : (quick ? 100 : 500);
  if (calls < (pipelinedWorkload ? kWindow : 1)) {
    std::cerr << "call_limits: --calls must be at least "
              << (pipelinedWorkload ? kWindow : 1) << "\n";
    return 2;
  }
  // The pipelined bound blocks in reads (its reads find a batch each); the
  // round trip polls unless told to block.
  pollReads = !pipelinedWorkload && !blocking;

  if (shared) {
    SharedExchange* exchange = mapSharedExchange();
    pid_t child = torchrpc::bench::forkTiedChild([exchange]() {
      serveShared(*exchange);
      return 0;
    });
    if (child < 0) {
      die("fork");
    }
    serverPid = child;
    sharedRoundTrips(*exchange, 1, warmUp);
    std::vector<double> micros =
        sharedRoundTrips(*exchange, 1 + static_cast<uint32_t>(warmUp), calls);
    exchange->closed.store(true, std::memory_order_release);
    if (!reapServer(child)) {
      return 1;
    }
    reportRoundTrips(micros, socketName);
    return 0;
  }

  const auto [clientFd, serverFd] = connectedPair(socketName == "tcp");
  pid_t child = ::fork();
  if (child < 0) {
    die("fork");
  }
  if (child == 0) {
    ::close(clientFd);
    serve(serverFd);
    ::_exit(0);
  }
  serverPid = child;
  ::close(serverFd);
  if (pipelinedWorkload) {
    pipelined(clientFd, warmUp);
    const double seconds = pipelined(clientFd, calls);
    if (!endServer(clientFd, child)) {
      return 1;
    }
    std::printf(
        "{\"workload\": \"calls_per_s_64_outstanding_limit\", \"metric\": "
        "\"throughput\", \"unit\": \"calls/s\", \"value\": %.0f, \"better\": "
        "\"higher\", \"socket\": \"%s\"}\n",
        calls / seconds,
        socketName.c_str());
    return 0;
  }
  roundTrips(clientFd, warmUp);
  std::vector<double> micros = roundTrips(clientFd, calls);
  if (!endServer(clientFd, child)) {
    return 1;
  }
  reportRoundTrips(micros, socketName);
  return 0;
}
