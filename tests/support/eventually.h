#pragma once

// Waits, polling, for something another thread or worker brings about.

#include <chrono>
#include <thread>

namespace torchrpc {
namespace testing {

// True once done() holds, false if it still does not after `limit`.
template <typename Done>
bool eventually(
    Done done,
    std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

} // namespace testing
} // namespace torchrpc
