#include "torchrpc/rpc/transport/tcp/parallel_copier.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <system_error>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace {

constexpr size_t kMinChunk = size_t(128) << 10;
constexpr size_t kMaxChunk = size_t(1) << 20;
constexpr size_t kPage = 4096;

// Spins before the sender yields while the helper finishes its last chunk:
// about the copy of one small chunk.
constexpr int kSpinsBeforeYield = 4096;

void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

} // namespace

struct ParallelCopier::Job {
  char* dst = nullptr;
  const char* src = nullptr;
  size_t bytes = 0;
  size_t chunk = 0;
  size_t chunks = 0;
  std::atomic<size_t> next{0}; // the next chunk to claim
  std::atomic<size_t> done{0}; // chunks copied
};

ParallelCopier::ParallelCopier(size_t minBytes) : minBytes_(minBytes) {}

ParallelCopier::~ParallelCopier() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (helper_.joinable()) {
    helper_.join();
  }
}

size_t ParallelCopier::chunkBytesFor(size_t n) {
  // Small enough that the two threads end close together (the sender waits
  // for at most one of the helper's chunks), large enough that claiming
  // costs nothing: 32 chunks, each 128 KiB to 1 MiB, whole pages.
  const size_t chunk = std::clamp(n / 32, kMinChunk, kMaxChunk);
  return (chunk + kPage - 1) & ~(kPage - 1);
}

uint64_t ParallelCopier::helperBytes() const {
  return helperBytes_.load(std::memory_order_relaxed);
}

void ParallelCopier::copyChunks(Job& job, std::atomic<uint64_t>* counter) {
  for (;;) {
    const size_t i = job.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job.chunks) {
      return;
    }
    const size_t offset = i * job.chunk;
    const size_t length = std::min(job.chunk, job.bytes - offset);
    std::memcpy(job.dst + offset, job.src + offset, length);
    if (counter != nullptr) {
      counter->fetch_add(length, std::memory_order_relaxed);
    }
    // Release: the sender's acquire of `done` sees these bytes written.
    job.done.fetch_add(1, std::memory_order_release);
  }
}

void ParallelCopier::copy(void* dst, const void* src, size_t n) {
  if (n == 0) {
    return; // an empty tensor's pointers may be null, which memcpy forbids
  }
  if (!sharesCopyOf(n)) {
    std::memcpy(dst, src, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->dst = static_cast<char*>(dst);
  job->src = static_cast<const char*>(src);
  job->bytes = n;
  job->chunk = chunkBytesFor(n);
  job->chunks = (n + job->chunk - 1) / job->chunk;
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!helper_.joinable()) {
      try {
        helper_ = std::thread([this] { helperLoop(); });
      } catch (const std::system_error&) {
        // No thread to be had (a process or cgroup limit): this copy, and
        // the next ones until a thread starts, are the sender's alone.
      }
    }
    if (helper_.joinable() && keepHelperOffLocked(sched_getcpu())) {
      queue_.push_back(job);
      queued = true;
    }
  }
  if (!queued) {
    std::memcpy(dst, src, n);
    return;
  }
  wake_.notify_one();
  copyChunks(*job, nullptr);
  // The helper's claimed chunks are being copied: wait for them.
  int spins = 0;
  while (job->done.load(std::memory_order_acquire) < job->chunks) {
    if (spins < kSpinsBeforeYield) {
      ++spins;
      cpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
  // A helper that never got to the job finds nothing left in it, but need
  // not find it at all.
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find(queue_.begin(), queue_.end(), job);
  if (it != queue_.end()) {
    queue_.erase(it);
  }
}

bool ParallelCopier::keepHelperOffLocked(int cpu) {
  if (cpu < 0 || cpu == helperKeptOff_) {
    return true;
  }
  // The sender's own allowed CPUs (a cpuset or taskset may narrow them),
  // less the one it runs on.
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 ||
      cpu >= CPU_SETSIZE) {
    return true; // more CPUs than a cpu_set_t holds: left to the scheduler
  }
  CPU_CLR(cpu, &allowed);
  if (CPU_COUNT(&allowed) == 0) {
    return false; // one CPU: two threads would only take turns on it
  }
  if (pthread_setaffinity_np(
          helper_.native_handle(),
          sizeof(allowed),
          &allowed) == 0) {
    helperKeptOff_ = cpu;
  }
  return true;
}

void ParallelCopier::helperLoop() {
  helperTid_.store(::gettid(), std::memory_order_release);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) {
      return;
    }
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    copyChunks(*job, &helperBytes_);
    job.reset(); // the sender may be gone; nothing of it stays here
    lock.lock();
  }
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
