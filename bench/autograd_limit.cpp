// What this machine allows for bench/compare's dist_autograd_overhead
// without an RPC library: the same split training (bench/split_training.h)
// between two processes over one Unix stream socket, with nothing but what
// the workload needs. The owner holds the model and its SGD; per
// distributed iteration the client makes the workload's three exchanges:
//
//   forward   one write of the op and x (4 KiB); the owner runs the model
//             and writes the output (4 KiB), keeping its graph;
//   backward  the client takes out.sum()'s gradient with libtorch's
//             autograd and writes it (4 KiB); the owner runs its graph's
//             backward, which leaves the gradients on its parameters, and
//             writes one byte;
//   step      the owner takes the SGD step, clears the gradients and
//             writes one byte.
//
// No header beyond the op byte, no call ids, futures, contexts, graphs
// across processes, timeouts per call or error path: a bound, not a
// competitor; bench/compare reports it as "limit" beside the workload.
// Like the workload, it alternates local and distributed iterations and
// reports the median of their differences. Each distributed forward's
// output must equal, bit for bit, the local forward's of the same pair, and
// at the end the owner sends its parameters, which must equal those of the
// local model, which took the same steps: exit 1 if not (the split did not
// compute the same training), or if the socket fails, the owner
// dies or a read waits longer than the workload's result timeout. The
// owner is killed by pid however the client ends.
//
//   BUILD_DIR/bench/autograd_limit --workload dist_autograd_overhead
//                                  [--spin-us N] [--quick]
//
// Reads block (a sleeping process, woken by the peer's write) unless
// --spin-us N: then each read first polls the socket for up to N µs.

#include "bench/bench_support.h"
#include "bench/split_training.h"

#include <poll.h>
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

using torchrpc::bench::Clock;

constexpr char kForward = 'F';
constexpr char kBackward = 'B';
constexpr char kStep = 'S';
constexpr char kParameters = 'P';
constexpr size_t kActivationBytes = 1024 * sizeof(float);

// The owner child, in the client (0 in the owner itself).
pid_t ownerPid = 0;
// How long a read polls before it sleeps (--spin-us).
std::chrono::microseconds spin{0};
// How long a read waits in all: the workload's result timeout.
int readTimeoutMs = 240000;

[[noreturn]] void die(const std::string& what) {
  std::cerr << "autograd_limit: " << what
            << (errno != 0 ? std::string(": ") + std::strerror(errno) : "")
            << "\n";
  if (ownerPid > 0) {
    ::kill(ownerPid, SIGKILL);
    ::waitpid(ownerPid, nullptr, 0);
  }
  std::exit(1);
}

// The other side closed its end (or died) while this one still needed it.
[[noreturn]] void peerClosed() {
  errno = 0;
  die(ownerPid > 0 ? "the owner closed the socket"
                   : "the client closed the socket");
}

void writeAll(int fd, const void* data, size_t bytes) {
  const char* next = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::send(fd, next, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) {
      peerClosed();
    }
    if (n <= 0) {
      die("send");
    }
    next += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Reads exactly `bytes`; false at end of file before the first byte (the
// peer closed between messages), dies on anything else.
bool readAll(int fd, void* data, size_t bytes) {
  char* next = static_cast<char*>(data);
  const size_t wanted = bytes;
  while (bytes > 0) {
    const auto spinUntil = Clock::now() + spin;
    ssize_t n = -1;
    do {
      n = ::recv(fd, next, bytes, MSG_DONTWAIT);
    } while (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
             Clock::now() < spinUntil);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd readable{fd, POLLIN, 0};
      const int ready = ::poll(&readable, 1, readTimeoutMs);
      if (ready == 0) {
        errno = ETIMEDOUT;
        die("no message within the result timeout");
      }
      continue; // readable, interrupted or failed: recv says which
    }
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0 && errno == ECONNRESET) {
      peerClosed();
    }
    if (n < 0) {
      die("recv");
    }
    if (n == 0) {
      if (bytes == wanted) {
        return false;
      }
      peerClosed();
    }
    next += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

void readAllOrDie(int fd, void* data, size_t bytes) {
  if (!readAll(fd, data, bytes)) {
    peerClosed();
  }
}

// The owner: serves ops until the client closes the socket.
void own(int fd) {
  auto model = torchrpc::bench::makeSplitTrainingModel();
  torch::optim::SGD sgd(
      model->parameters(),
      torch::optim::SGDOptions(torchrpc::bench::kSplitTrainingLearningRate));
  at::Tensor out;
  const char ack = 1;
  for (;;) {
    char op = 0;
    if (!readAll(fd, &op, 1)) {
      return;
    }
    if (op == kForward) {
      at::Tensor x = at::empty({1, 1024}, at::kFloat);
      readAllOrDie(fd, x.data_ptr(), kActivationBytes);
      out = model->forward(x);
      writeAll(fd, out.data_ptr(), kActivationBytes);
    } else if (op == kBackward) {
      at::Tensor grad = at::empty({1, 1024}, at::kFloat);
      readAllOrDie(fd, grad.data_ptr(), kActivationBytes);
      out.backward(grad);
      out = at::Tensor();
      writeAll(fd, &ack, 1);
    } else if (op == kStep) {
      sgd.step();
      for (auto& p : model->parameters()) {
        p.mutable_grad() = at::Tensor();
      }
      writeAll(fd, &ack, 1);
    } else if (op == kParameters) {
      for (const auto& p : model->parameters()) {
        writeAll(fd, p.data_ptr(), p.numel() * sizeof(float));
      }
    } else {
      errno = 0;
      die("unknown op " + std::to_string(int(op)));
    }
  }
}

// Distributed forwards whose output differed, in its bytes, from the local
// forward of the same pair (the same model after the same steps).
int outputMismatches = 0;

// The client's distributed iteration: the three exchanges. `expected` is the
// local forward's output of the same pair, checked after the iteration.
void distributedIteration(
    int fd,
    const at::Tensor& x,
    const at::Tensor& expected,
    torchrpc::bench::Phases& phases) {
  phases.start();
  char forward[1 + kActivationBytes];
  forward[0] = kForward;
  std::memcpy(forward + 1, x.data_ptr(), kActivationBytes);
  writeAll(fd, forward, sizeof(forward));
  at::Tensor out = at::empty({1, 1024}, at::kFloat);
  readAllOrDie(fd, out.data_ptr(), kActivationBytes);
  phases.end("forward exchange");
  out.requires_grad_();
  out.sum().backward();
  char backward[1 + kActivationBytes];
  backward[0] = kBackward;
  std::memcpy(backward + 1, out.grad().data_ptr(), kActivationBytes);
  writeAll(fd, backward, sizeof(backward));
  char ack = 0;
  readAllOrDie(fd, &ack, 1);
  phases.end("backward exchange");
  writeAll(fd, &kStep, 1);
  readAllOrDie(fd, &ack, 1);
  phases.end("step exchange");
  if (std::memcmp(out.data_ptr(), expected.data_ptr(), kActivationBytes) != 0) {
    ++outputMismatches;
  }
}

// Whether the owner's parameters equal the local model's, bit for bit.
bool sameParameters(int fd, torch::nn::Sequential& local) {
  writeAll(fd, &kParameters, 1);
  bool same = true;
  for (const auto& p : local->parameters()) {
    at::Tensor remote = at::empty_like(p);
    readAllOrDie(fd, remote.data_ptr(), p.numel() * sizeof(float));
    // Bytes, not values: with no activation between the layers, the
    // summed output has no minimum, and a few dozen SGD steps take the
    // parameters to infinities and NaNs, which compare unequal as values.
    const at::Tensor mine = p.detach().contiguous();
    if (std::memcmp(remote.data_ptr(), mine.data_ptr(), mine.nbytes()) != 0) {
      std::cerr << "autograd_limit: a parameter of shape " << p.sizes()
                << " differs from the local model's, in "
                << remote.ne(mine).sum().item<int64_t>() << " elements\n";
      same = false;
    }
  }
  return same;
}

[[noreturn]] void usage() {
  std::cerr << "usage: autograd_limit --workload dist_autograd_overhead "
               "[--spin-us N] [--quick]\n";
  std::exit(2);
}

} // namespace

int main(int argc, char** argv) {
  std::string workload;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--workload" && i + 1 < argc) {
      workload = argv[++i];
    } else if (arg == "--spin-us" && i + 1 < argc) {
      const int micros = std::atoi(argv[++i]);
      if (micros < 0 || micros > 1000000) {
        usage();
      }
      spin = std::chrono::microseconds(micros);
    } else if (arg == "--quick") {
      quick = true;
    } else {
      usage();
    }
  }
  if (workload != "dist_autograd_overhead") {
    usage();
  }
  readTimeoutMs = quick ? 90000 : 240000;

  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    die("socketpair");
  }
  // Forked before either side touches libtorch, whose thread pools do not
  // survive a fork.
  const pid_t child = torchrpc::bench::forkTiedChild([&fds]() {
    ::close(fds[0]);
    own(fds[1]);
    return 0;
  });
  if (child < 0) {
    die("fork");
  }
  ownerPid = child;
  ::close(fds[1]);
  const int fd = fds[0];

  torchrpc::bench::LocalTraining local;
  // Each iteration's phases, for stderr, named as torchrpc_bench's are
  // where they match: what the bare exchanges add to each.
  torchrpc::bench::Phases phases;
  const double overhead = torchrpc::bench::medianSplitTrainingOverhead(
      [&local, &phases]() {
        phases.start();
        local.iterate([&phases](const char* name) { phases.end(name); });
      },
      [fd, &local, &phases]() {
        distributedIteration(fd, local.input(), local.lastOutput(), phases);
      },
      quick,
      [&phases]() { phases.clear(); });
  phases.print(std::cerr);
  const bool same = sameParameters(fd, local.model());
  ::close(fd);
  int status = 0;
  ::waitpid(child, &status, 0);
  ownerPid = 0;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::cerr << "autograd_limit: the owner failed\n";
    return 1;
  }
  if (outputMismatches > 0) {
    std::cerr << "autograd_limit: " << outputMismatches
              << " distributed forwards differed from the local ones\n";
  }
  if (!same || outputMismatches > 0) {
    return 1;
  }
  std::printf(
      "{\"workload\": \"dist_autograd_overhead_limit\", \"metric\": "
      "\"overhead_per_iter\", \"unit\": \"us\", \"value\": %.1f, \"better\": "
      "\"lower\", \"socket\": \"unix\", \"spin_us\": %lld}\n",
      overhead,
      static_cast<long long>(spin.count()));
  return 0;
}
