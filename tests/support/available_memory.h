#pragma once

// How much memory a test may still allocate, so that tests of very large
// messages can skip, saying why, on a machine too small to run them instead
// of failing (or being killed by the OOM killer) half-way.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace torchrpc {
namespace testing {

constexpr size_t kGiB = size_t(1) << 30;

// The kernel's estimate of memory available without swapping
// (/proc/meminfo "MemAvailable"); nullopt where it cannot be read.
inline std::optional<size_t> availableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string key;
    uint64_t kib = 0;
    std::string unit;
    if (fields >> key >> kib >> unit && key == "MemAvailable:" &&
        unit == "kB") {
      return static_cast<size_t>(kib) * 1024;
    }
  }
  return std::nullopt;
}

inline std::string gibText(size_t bytes) {
  std::ostringstream out;
  out.precision(1);
  out << std::fixed << static_cast<double>(bytes) / kGiB << " GiB";
  return out.str();
}

// Why a test needing `needed` bytes cannot run here, or "" when it can.
inline std::string whyTooSmall(size_t needed) {
  auto available = availableMemoryBytes();
  if (!available) {
    return "cannot read MemAvailable from /proc/meminfo, and this test needs " +
        gibText(needed);
  }
  if (*available < needed) {
    return "this test needs " + gibText(needed) + " of memory and only " +
        gibText(*available) + " is available (MemAvailable)";
  }
  return "";
}

} // namespace testing
} // namespace torchrpc

// Skips the current test, with the reason, unless `needed` bytes of memory
// are available.
#define TORCHRPC_SKIP_UNLESS_MEMORY(needed)                                   \
  do {                                                                        \
    const std::string torchrpcWhy = ::torchrpc::testing::whyTooSmall(needed); \
    if (!torchrpcWhy.empty()) {                                               \
      GTEST_SKIP() << torchrpcWhy;                                            \
    }                                                                         \
  } while (false)
