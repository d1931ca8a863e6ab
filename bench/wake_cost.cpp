// What waking a sleeping thread costs the thread that wakes it, on this
// machine, right after computing and right after sleeping. Every call
// between two idle workers pays such wake-ups (a request wakes the callee,
// the reply wakes the caller), and on a virtual machine the one that must
// bring an idle vCPU back is far dearer than the next
// (bench/RESULTS.md, "The first wake-up after computing").
//
//   BUILD_DIR/bench/wake_cost [--quick]
//
// Two threads sleep in read() on a Unix socket pair each. Each round this
// thread either computes for 3 ms (sums a 32 MiB buffer, as a model's
// layers stream their weights) or sleeps for 3 ms, then writes one byte to
// the first sleeper and one to the second, timing each write: the first
// is a wake-up after a quiet spell, the second one right after another.
// 300 rounds of each kind (60 with --quick), alternating. Prints one JSON
// line with the medians in microseconds and the number of rounds:
//   first_after_compute_us, second_after_compute_us,
//   first_after_sleep_us, second_after_sleep_us, rounds.

#include "bench/bench_support.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using torchrpc::bench::Clock;

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "wake_cost: %s: %s\n", what, std::strerror(errno));
  std::exit(1);
}

// A thread asleep in read() on one end of a socket pair until the other
// end is shut down.
class Sleeper {
 public:
  Sleeper() {
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds_) != 0) {
      die("socketpair");
    }
    thread_ = std::thread([fd = fds_[1]]() {
      char byte;
      for (;;) {
        const ssize_t n = ::read(fd, &byte, 1);
        if (n < 0 && errno == EINTR) {
          continue;
        }
        if (n != 1) {
          return; // shut down
        }
      }
    });
  }
  ~Sleeper() {
    ::shutdown(fds_[0], SHUT_RDWR);
    thread_.join();
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  Sleeper(const Sleeper&) = delete;
  Sleeper& operator=(const Sleeper&) = delete;

  // Wakes the thread; returns how long the write took, in microseconds.
  double wake() {
    const char byte = 1;
    const auto start = Clock::now();
    if (::write(fds_[0], &byte, 1) != 1) {
      die("write");
    }
    return torchrpc::bench::microsSince(start);
  }

 private:
  int fds_[2];
  std::thread thread_;
};

// Sums `buffer`, one float per cache line, for `duration`: in chunks of
// 64 KiB between looks at the clock (a whole pass over 32 MiB takes
// milliseconds), going on where the last chunk stopped. The sum keeps the
// compiler from dropping the loop.
float computeFor(
    const std::vector<float>& buffer,
    std::chrono::milliseconds duration) {
  constexpr size_t kChunk = (64u << 10) / sizeof(float);
  constexpr size_t kStride = 64 / sizeof(float);
  static size_t next = 0;
  float sum = 0;
  const auto until = Clock::now() + duration;
  while (Clock::now() < until) {
    const size_t end = std::min(next + kChunk, buffer.size());
    for (size_t i = next; i < end; i += kStride) {
      sum += buffer[i];
    }
    next = end == buffer.size() ? 0 : end;
  }
  return sum;
}

} // namespace

int main(int argc, char** argv) {
  const bool quick = torchrpc::bench::parseQuickOnly("wake_cost", argc, argv);
  const int rounds = quick ? 60 : 300;
  const auto spell = std::chrono::milliseconds(3);
  std::vector<float> buffer((32u << 20) / sizeof(float), 1.0f);
  Sleeper first;
  Sleeper second;
  std::vector<double> firstAfterCompute, secondAfterCompute;
  std::vector<double> firstAfterSleep, secondAfterSleep;
  float sum = 0;
  for (int round = 0; round < rounds; ++round) {
    sum += computeFor(buffer, spell);
    firstAfterCompute.push_back(first.wake());
    secondAfterCompute.push_back(second.wake());
    std::this_thread::sleep_for(spell);
    firstAfterSleep.push_back(first.wake());
    secondAfterSleep.push_back(second.wake());
  }
  std::fprintf(
      stderr,
      "wake_cost: %d rounds; checksum %.0f\n",
      rounds,
      static_cast<double>(sum));
  std::printf(
      "{\"first_after_compute_us\": %.1f, \"second_after_compute_us\": %.1f, "
      "\"first_after_sleep_us\": %.1f, \"second_after_sleep_us\": %.1f, "
      "\"rounds\": %d}\n",
      torchrpc::bench::median(firstAfterCompute),
      torchrpc::bench::median(secondAfterCompute),
      torchrpc::bench::median(firstAfterSleep),
      torchrpc::bench::median(secondAfterSleep),
      rounds);
  return 0;
}
