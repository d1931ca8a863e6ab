#pragma once

// Turns off Note [Spinning on a busy machine] (rpc/detail/busy_wait.h) for
// a test's scope: tests of polling and of waiters that drive the loop
// check which thread polls or reads, and on a busy machine (the suite's
// other shards) long yields would rightly make the process stop polling
// and sleep in epoll instead. busy_wait_test.cpp tests the back-off itself.

#include "torchrpc/rpc/detail/busy_wait.h"

namespace torchrpc {
namespace testing {

class NoContentionBackoff {
 public:
  NoContentionBackoff() {
    rpc::detail::setContentionBackoffEnabled(false);
  }
  ~NoContentionBackoff() {
    rpc::detail::setContentionBackoffEnabled(true);
  }
  NoContentionBackoff(const NoContentionBackoff&) = delete;
  NoContentionBackoff& operator=(const NoContentionBackoff&) = delete;
};

} // namespace testing
} // namespace torchrpc
