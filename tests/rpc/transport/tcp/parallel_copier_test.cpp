// The copier that shares a sender's copy into shared memory with a helper
// thread (Note [Copies into shared memory on two cores],
// rpc/transport/tcp/parallel_copier.h): byte-exact for every size and
// offset of the last chunk, the helper really taking chunks of large
// copies and none of small ones, never where it would share the sender's
// one CPU, and concurrent senders. The transport's
// use of it is tested in shared_memory_test.cpp.

#include <gtest/gtest.h>

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

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
