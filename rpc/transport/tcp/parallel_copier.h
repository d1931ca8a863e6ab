#pragma once

// A memcpy that a helper thread shares: what a sender uses to copy a large
// tensor into a shared segment (Note [Copies into shared memory on two
// cores]).

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// Note [Copies into shared memory on two cores]
//
// Why: a same-host tensor costs its sender one memcpy into a shared
// segment and its receiver nothing (Note [TCP same-host shared memory]),
// so that memcpy is the transfer. One core copies at its own memory
// bandwidth, far below the machine's: on the 2-vCPU machine of
// bench/RESULTS.md one thread copies 4 MiB at 11-12 GB/s and 64 MiB at
// 5-6, two threads at 20-21 and 11-16.
//
// How: a copy of at least `minBytes` is cut into chunks. The sending
// thread queues it for the copier's one helper thread and copies chunks
// itself; each thread claims the next chunk with one atomic add, so a
// helper that wakes late (or never, on a busy machine) only takes fewer
// chunks, and the copy never waits for a thread that has not started.
// The sender then waits for the chunks the helper claimed, at most one
// chunk's copy, spinning briefly and then yielding.
//
// Where the helper runs: never on the sender's CPU. Woken by the sender,
// the scheduler tends to queue it on the sender's own CPU when every other
// CPU is busy, and a peer's io thread polling after traffic (Note [Polling
// after traffic]) keeps the other one busy; the two copying threads then
// took turns on one CPU, slower than one alone: 8-9 GB/s for 4 MiB in
// half the runs, against 15-18 in the others. So before queueing a copy
// the sender sets the helper's affinity to its own allowed CPUs less the
// one it runs on (a syscall only when that CPU changed), and where that
// leaves none, copies alone.
//
// The helper starts on the first such copy and sleeps on a condition
// variable between copies, so an idle transport uses no CPU. Smaller
// copies are a plain memcpy: waking the helper costs several
// microseconds, a copy of less than a MiB takes tens.
class ParallelCopier {
 public:
  // minBytes 0: never a helper.
  explicit ParallelCopier(size_t minBytes);
  // Joins the helper; no copy may be running.
  ~ParallelCopier();
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  // memcpy(dst, src, n), returning once all of it is copied. Thread-safe.
  void copy(void* dst, const void* src, size_t n);
  // Whether a copy of `n` bytes is offered to the helper.
  bool sharesCopyOf(size_t n) const {
    return minBytes_ > 0 && n >= minBytes_;
  }

  // The chunk a copy of `n` bytes is cut into (tests).
  static size_t chunkBytesFor(size_t n);
  // The bytes the helper has copied, counted before their chunk is reported
  // done, so a copy() that returned is included.
  uint64_t helperBytes() const;
  // The helper's kernel thread id once it runs, else 0: tests read its CPU
  // time and affinity through it.
  pid_t helperThreadId() const {
    return helperTid_.load(std::memory_order_acquire);
  }

 private:
  struct Job;
  void helperLoop();
  // Keeps the helper off `cpu`, the sender's: false when no other CPU is
  // allowed.
  bool keepHelperOffLocked(int cpu);
  // Claims and copies chunks until none is left; adds their bytes to
  // `counter`.
  static void copyChunks(Job& job, std::atomic<uint64_t>* counter);

  const size_t minBytes_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  std::atomic<uint64_t> helperBytes_{0};
  std::atomic<pid_t> helperTid_{0};
  std::thread helper_; // started by the first copy of minBytes
  int helperKeptOff_ = -1; // the CPU the helper's affinity leaves out
};

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
