#include "torchrpc/rpc/detail/signal_watcher.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/log_level.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

// What the handler reads: lock-free atomics only (Note [Signal watcher]).
struct Slot {
  std::atomic<int> signal{0};
  std::atomic<int> fd{-1};
};

Slot slots[SignalWatcher::kMaxSignalWatchers];
std::atomic<int> handlersRunning{0};

static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void onWatchedSignal(int signal) {
  const int savedErrno = errno;
  handlersRunning.fetch_add(1);
  for (auto& slot : slots) {
    if (slot.signal.load() == signal) {
      int fd = slot.fd.load();
      if (fd >= 0) {
        const char byte = 1;
        // A full pipe already holds a wake-up: nothing is lost.
        (void)!::write(fd, &byte, 1);
      }
    }
  }
  handlersRunning.fetch_sub(1);
  errno = savedErrno;
}

// Registration, off the signal path.
struct Installed {
  int watchers = 0;
  struct sigaction previous {};
};
std::mutex registryMutex;
std::map<int, Installed>& installedHandlers() {
  static auto* installed = new std::map<int, Installed>();
  return *installed;
}

} // namespace

SignalWatcher::SignalWatcher(int signal, std::function<void()> onSignal)
    : signal_(signal),
      onSignal_(std::move(onSignal)) {
  int fds[2];
  TORCH_CHECK(
      ::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0,
      "cannot create a pipe to watch signal ",
      signal,
      ": ",
      std::strerror(errno));
  readFd_ = fds[0];
  writeFd_ = fds[1];
  {
    std::lock_guard<std::mutex> guard(registryMutex);
    for (int i = 0; i < kMaxSignalWatchers; ++i) {
      if (slots[i].signal.load() == 0) {
        slot_ = i;
        break;
      }
    }
    if (slot_ >= 0) {
      Installed& installed = installedHandlers()[signal];
      bool ok = true;
      if (installed.watchers == 0) {
        struct sigaction action {};
        action.sa_handler = onWatchedSignal;
        sigemptyset(&action.sa_mask);
        action.sa_flags = SA_RESTART;
        ok = ::sigaction(signal, &action, &installed.previous) == 0;
      }
      if (ok) {
        ++installed.watchers;
        slots[slot_].signal.store(signal);
        slots[slot_].fd.store(writeFd_);
      } else {
        installedHandlers().erase(signal);
        slot_ = -2;
      }
    }
  }
  if (slot_ < 0) {
    bool full = slot_ == -1;
    int error = errno;
    ::close(readFd_);
    ::close(writeFd_);
    TORCH_CHECK(
        !full,
        "cannot watch signal ",
        signal,
        ": ",
        kMaxSignalWatchers,
        " watchers exist already");
    TORCH_CHECK(
        false,
        "cannot install a handler for signal ",
        signal,
        ": ",
        std::strerror(error));
  }
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    unregister();
    ::close(readFd_);
    ::close(writeFd_);
    throw;
  }
}

SignalWatcher::~SignalWatcher() {
  unregister();
  stopping_.store(true);
  const char byte = 0;
  (void)!::write(writeFd_, &byte, 1);
  thread_.join();
  ::close(readFd_);
  ::close(writeFd_);
}

void SignalWatcher::unregister() {
  {
    std::lock_guard<std::mutex> guard(registryMutex);
    slots[slot_].fd.store(-1);
    slots[slot_].signal.store(0);
    auto it = installedHandlers().find(signal_);
    if (it != installedHandlers().end() && --it->second.watchers == 0) {
      ::sigaction(signal_, &it->second.previous, nullptr);
      installedHandlers().erase(it);
    }
  }
  // A handler that read our descriptor before the slot was cleared is done
  // with it once none runs (Note [Signal watcher]).
  while (handlersRunning.load() != 0) {
    std::this_thread::yield();
  }
}

void SignalWatcher::run() {
  for (;;) {
    pollfd ready{readFd_, POLLIN, 0};
    if (::poll(&ready, 1, -1) < 0 && errno != EINTR) {
      TORCHRPC_LOG(kError) << "watching signal " << signal_
                           << " failed: " << std::strerror(errno);
      return;
    }
    char bytes[64];
    while (::read(readFd_, bytes, sizeof(bytes)) > 0) {
    }
    if (stopping_.load()) {
      return;
    }
    try {
      onSignal_();
    } catch (...) {
      TORCHRPC_LOG(kError) << "on signal " << signal_ << ": "
                           << describeException(std::current_exception());
    }
  }
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
