#pragma once

// Runs a callback on a thread of its own when the process receives a signal
// (Note [Signal watcher]); Runtime uses it to print a hang report on demand.

#include <atomic>
#include <functional>
#include <thread>

namespace torchrpc {
namespace rpc {
namespace detail {

// Note [Signal watcher]
// ~~~~~~~~~~~~~~~~~~~~~
// A signal handler may do almost nothing: ours writes a byte to the pipe of
// every watcher of that signal (write(2) is async-signal-safe), and each
// watcher's thread, blocked in poll(2) on its pipe, runs the callback where
// anything is allowed. Signals that arrive while a callback runs coalesce
// into one more call.
//
// The handler finds the pipes in a fixed table of atomics, so registering
// takes no lock it could meet. A watcher that goes away clears its slot and
// then waits until no handler is running before it closes its pipe: a
// handler that had read the slot must not write to a descriptor number the
// process has meanwhile reused. The first watcher of a signal installs the
// handler; the last one restores the disposition it found. At most
// kMaxSignalWatchers watchers exist at once (runtimes in one process).
class SignalWatcher {
 public:
  static constexpr int kMaxSignalWatchers = 64;

  // Throws c10::Error if the table is full or the handler cannot be
  // installed.
  SignalWatcher(int signal, std::function<void()> onSignal);
  // Stops watching and waits for a callback that is running.
  ~SignalWatcher();
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

 private:
  // Clears the slot, restores the disposition if last, and waits until no
  // handler runs.
  void unregister();
  void run();

  const int signal_;
  const std::function<void()> onSignal_;
  int readFd_ = -1;
  int writeFd_ = -1;
  int slot_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
