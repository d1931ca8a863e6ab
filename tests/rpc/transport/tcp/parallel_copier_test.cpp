// The copier that shares a sender's copy into shared memory with a helper
// thread (Note [Copies into shared memory on two cores],
// rpc/transport/tcp/parallel_copier.h): byte-exact for every size and
// offset of the last chunk, the helper really taking chunks of large
// copies and none of small ones, kept off the sender's CPU (never started
// where it would share the sender's one CPU), asleep between copies, and
// concurrent senders. The transport's
// use of it is tested in shared_memory_test.cpp.

#include <gtest/gtest.h>

#include <sched.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/allowed_cpus.h"
#include "torchrpc/rpc/transport/tcp/parallel_copier.h"

namespace torchrpc {
namespace rpc {
namespace {

using detail::tcp::ParallelCopier;

constexpr size_t kMiB = size_t(1) << 20;

// Bytes that differ at every offset (a chunk copied to the wrong place
// shows), seeded so that two buffers differ.
std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

TEST(ParallelCopier, ChunksAreWholePagesBetween128KiBAnd1MiB) {
  for (size_t n : {kMiB, 4 * kMiB, 5 * kMiB + 3, 64 * kMiB, 1024 * kMiB}) {
    const size_t chunk = ParallelCopier::chunkBytesFor(n);
    EXPECT_EQ(chunk % 4096, 0u) << n;
    EXPECT_GE(chunk, 128u << 10) << n;
    EXPECT_LE(chunk, kMiB) << n;
  }
  EXPECT_EQ(ParallelCopier::chunkBytesFor(4 * kMiB), 128u << 10);
  EXPECT_EQ(ParallelCopier::chunkBytesFor(64 * kMiB), kMiB);
}

TEST(ParallelCopier, CopiesEveryByteWhateverTheLastChunk) {
  ParallelCopier copier(kMiB);
  const size_t chunk = ParallelCopier::chunkBytesFor(8 * kMiB);
  // Below the threshold, at it, and whole, short and one-byte last chunks.
  for (size_t n :
       {size_t(0),
        size_t(1),
        kMiB - 1,
        kMiB,
        8 * kMiB,
        8 * kMiB - chunk + 1,
        8 * kMiB + 1,
        33 * kMiB + 4095}) {
    const std::vector<uint8_t> src = pattern(n, 7);
    // One guard byte each side of the destination must stay as it was.
    std::vector<uint8_t> dst(n + 2, 0xA5);
    copier.copy(dst.data() + 1, src.data(), n);
    EXPECT_EQ(dst.front(), 0xA5) << n;
    EXPECT_EQ(dst.back(), 0xA5) << n;
    // std::equal, not memcmp: the empty source's data() may be null.
    EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin() + 1)) << n;
  }
}

TEST(ParallelCopier, TheHelperTakesChunksOfLargeCopiesOnly) {
  if (testing::allowedCpuCount() < 2) {
    GTEST_SKIP() << "one CPU: the sender copies alone (tested below)";
  }
  ParallelCopier copier(kMiB);
  const std::vector<uint8_t> small = pattern(kMiB - 1, 1);
  std::vector<uint8_t> smallOut(small.size());
  for (int i = 0; i < 20; ++i) {
    copier.copy(smallOut.data(), small.data(), small.size());
  }
  EXPECT_EQ(copier.helperBytes(), 0u);

  // The helper wakes while the sender copies; on a loaded machine it may
  // miss a few copies, never all of 200 (bounded: about a second here).
  const std::vector<uint8_t> src = pattern(32 * kMiB, 2);
  std::vector<uint8_t> dst(src.size());
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int copies = 0;
  while (copier.helperBytes() == 0 && copies < 200 &&
         std::chrono::steady_clock::now() < deadline) {
    std::fill(dst.begin(), dst.end(), 0);
    copier.copy(dst.data(), src.data(), src.size());
    ASSERT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0) << copies;
    ++copies;
  }
  EXPECT_GT(copier.helperBytes(), 0u) << "after " << copies << " copies";
  // Whole chunks only, never more than a copy's worth per copy.
  EXPECT_EQ(
      copier.helperBytes() % ParallelCopier::chunkBytesFor(src.size()),
      0u);
  EXPECT_LE(copier.helperBytes(), uint64_t(copies) * src.size());
}

TEST(ParallelCopier, ZeroMinBytesNeverStartsTheHelper) {
  ParallelCopier copier(0);
  const std::vector<uint8_t> src = pattern(16 * kMiB, 3);
  std::vector<uint8_t> dst(src.size());
  for (int i = 0; i < 10; ++i) {
    copier.copy(dst.data(), src.data(), src.size());
  }
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
  EXPECT_EQ(copier.helperBytes(), 0u);
}

TEST(ParallelCopier, ASenderAllowedOneCpuCopiesAlone) {
  // Two threads on one CPU would only take turns: the helper is kept off
  // the sender's CPU, and here no other is allowed. The sender is a thread
  // of its own, so that pinning it leaves the test's thread as it was.
  ParallelCopier copier(kMiB);
  const std::vector<uint8_t> src = pattern(16 * kMiB, 4);
  std::vector<uint8_t> dst(src.size());
  bool pinned = false;
  std::thread sender([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu(), &one);
    pinned = sched_setaffinity(0, sizeof(one), &one) == 0;
    for (int i = 0; pinned && i < 20; ++i) {
      copier.copy(dst.data(), src.data(), src.size());
    }
  });
  sender.join();
  if (!pinned) {
    GTEST_SKIP() << "cannot pin a thread here";
  }
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
  EXPECT_EQ(copier.helperBytes(), 0u);
}

// Waits (at most 5 s) for the helper of a copier that copied to run.
pid_t helperOf(const ParallelCopier& copier) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (copier.helperThreadId() == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return copier.helperThreadId();
}

// CPU seconds (user and system) a thread of this process has used, from
// /proc/self/task/<tid>/stat; negative if it cannot be read.
double cpuSecondsOf(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), {});
  // The command name may hold spaces: fields are counted after its ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) {
    return -1;
  }
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  long long utime = 0;
  long long stime = 0;
  // Fields 3 to 13, then utime (14) and stime (15).
  for (int i = 3; i <= 13 && (fields >> field); ++i) {
  }
  if (!(fields >> utime >> stime)) {
    return -1;
  }
  return static_cast<double>(utime + stime) / ::sysconf(_SC_CLK_TCK);
}

TEST(ParallelCopier, TheHelperSleepsBetweenCopies) {
  ParallelCopier copier(kMiB);
  const std::vector<uint8_t> src = pattern(8 * kMiB, 6);
  std::vector<uint8_t> dst(src.size());
  copier.copy(dst.data(), src.data(), src.size());
  const pid_t helper = helperOf(copier);
  ASSERT_NE(helper, 0) << "the helper did not start";
  const double before = cpuSecondsOf(helper);
  ASSERT_GE(before, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double after = cpuSecondsOf(helper);
  ASSERT_GE(after, 0);
  // A helper that polled for work would use most of the half second.
  EXPECT_LE(after - before, 0.05);
}

TEST(ParallelCopier, TheHelperIsKeptOffTheSendersCpu) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE && cpus.size() < 2; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) {
      cpus.push_back(cpu);
    }
  }
  if (cpus.size() < 2) {
    GTEST_SKIP() << "one CPU: the sender copies alone (tested above)";
  }
  ParallelCopier copier(kMiB);
  const std::vector<uint8_t> src = pattern(4 * kMiB, 7);
  std::vector<uint8_t> dst(src.size());
  // For each of two CPUs: a sender allowed every CPU but running on that
  // one (pinned there, then let go) copies; the helper may then run on
  // every allowed CPU but that one. A sender that the scheduler moves
  // between letting go and copying is retried (at most 50 times).
  for (int cpu : cpus) {
    bool keptOff = false;
    for (int attempt = 0; attempt < 50 && !keptOff; ++attempt) {
      bool pinned = false;
      std::thread sender([&] {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        pinned = sched_setaffinity(0, sizeof(one), &one) == 0;
        if (!pinned) {
          return;
        }
        std::this_thread::yield();
        sched_setaffinity(0, sizeof(allowed), &allowed);
        copier.copy(dst.data(), src.data(), src.size());
      });
      sender.join();
      if (!pinned) {
        GTEST_SKIP() << "cannot pin a thread here";
      }
      const pid_t helper = helperOf(copier);
      ASSERT_NE(helper, 0) << "the helper did not start";
      cpu_set_t helperCpus;
      CPU_ZERO(&helperCpus);
      ASSERT_EQ(sched_getaffinity(helper, sizeof(helperCpus), &helperCpus), 0);
      cpu_set_t expected = allowed;
      CPU_CLR(cpu, &expected);
      keptOff = CPU_EQUAL(&helperCpus, &expected);
    }
    EXPECT_TRUE(keptOff) << "CPU " << cpu;
  }
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
}

TEST(ParallelCopier, ConcurrentSendersShareOneHelper) {
  ParallelCopier copier(kMiB);
  constexpr int kSenders = 4;
  constexpr int kCopiesEach = 10;
  std::vector<std::vector<uint8_t>> sources;
  for (int s = 0; s < kSenders; ++s) {
    sources.push_back(pattern(3 * kMiB + 17 * s, 10 + s));
  }
  std::vector<int> mismatches(kSenders, 0);
  std::vector<std::thread> senders;
  for (int s = 0; s < kSenders; ++s) {
    senders.emplace_back([&, s] {
      std::vector<uint8_t> dst(sources[s].size());
      for (int i = 0; i < kCopiesEach; ++i) {
        std::fill(dst.begin(), dst.end(), 0);
        copier.copy(dst.data(), sources[s].data(), dst.size());
        if (std::memcmp(dst.data(), sources[s].data(), dst.size()) != 0) {
          ++mismatches[s];
        }
      }
    });
  }
  for (auto& t : senders) {
    t.join();
  }
  for (int s = 0; s < kSenders; ++s) {
    EXPECT_EQ(mismatches[s], 0) << "sender " << s;
  }
}

} // namespace
} // namespace rpc
} // namespace torchrpc
