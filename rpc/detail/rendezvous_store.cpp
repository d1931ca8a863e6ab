#include "torchrpc/rpc/detail/rendezvous_store.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "torchrpc/rpc/detail/store_server.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

class C10dRendezvousStore : public RendezvousStore {
 public:
  C10dRendezvousStore(c10::intrusive_ptr<c10d::Store> store, std::string what)
      : store_(std::move(store)),
        what_(std::move(what)),
        isTcpStore_(dynamic_cast<c10d::TCPStore*>(store_.get()) != nullptr) {}

  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto bytes = store_->get(key);
    return std::string(bytes.begin(), bytes.end());
  }
  int64_t add(const std::string& key, int64_t delta) override {
    return store_->add(key, delta);
  }
  bool check(const std::vector<std::string>& keys) override {
    return store_->check(keys);
  }
  bool wait(
      const std::vector<std::string>& keys,
      std::chrono::milliseconds timeout) override {
    if (!isTcpStore_) {
      try {
        store_->wait(keys, std::max(timeout, std::chrono::milliseconds(1)));
        return true;
      } catch (const std::exception&) {
        // c10d reports a timeout and a broken store alike; a store that
        // still answers timed out, one that does not throws from check().
      }
      return store_->check(keys);
    }
    // The rendezvous waits in slices, and a TCPStore client whose wait()
    // timed out is broken from then on (libtorch 1.13: the wait's late
    // answer is still due, and the client's next get() fails with "Socket
    // Timeout"): poll check() instead.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::milliseconds(5);
    while (!store_->check(keys)) {
      auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        return false;
      }
      std::this_thread::sleep_for(
          std::min<std::chrono::nanoseconds>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    return true;
  }
  std::string describe() const override {
    return what_;
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string what_;
  const bool isTcpStore_;
};

class LocalRendezvousStore : public RendezvousStore {
 public:
  LocalRendezvousStore(std::shared_ptr<StoreState> state, std::string what)
      : state_(std::move(state)),
        what_(std::move(what)) {}

  void set(const std::string& key, const std::string& value) override {
    std::string error = state_->set(key, value);
    TORCH_CHECK(error.empty(), what_, " refused set(", key, "): ", error);
  }
  std::string get(const std::string& key) override {
    auto value = state_->get(key);
    TORCH_CHECK(value, what_, " has no key '", key, "'");
    return *value;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t result = 0;
    std::string error = state_->add(key, delta, &result);
    TORCH_CHECK(error.empty(), what_, " refused add(", key, "): ", error);
    return result;
  }
  bool check(const std::vector<std::string>& keys) override {
    return state_->check(keys);
  }
  bool wait(
      const std::vector<std::string>& keys,
      std::chrono::milliseconds timeout) override {
    struct Signal {
      std::mutex mutex;
      std::condition_variable ready;
      bool done = false;
    };
    auto signal = std::make_shared<Signal>();
    uint64_t waitId = state_->newWaitId();
    std::string error = state_->wait(waitId, keys, [signal]() {
      std::lock_guard<std::mutex> guard(signal->mutex);
      signal->done = true;
      signal->ready.notify_all();
    });
    TORCH_CHECK(error.empty(), what_, " refused a wait: ", error);
    std::unique_lock<std::mutex> lock(signal->mutex);
    if (signal->ready.wait_for(lock, timeout, [&] { return signal->done; })) {
      return true;
    }
    lock.unlock();
    state_->cancelWait(waitId);
    return state_->check(keys);
  }
  std::string describe() const override {
    return what_;
  }

 private:
  std::shared_ptr<StoreState> state_;
  std::string what_;
};

} // namespace

std::unique_ptr<RendezvousStore> wrapC10dStore(
    c10::intrusive_ptr<c10d::Store> store,
    std::string description) {
  TORCH_CHECK(store, "no store to rendezvous through");
  return std::make_unique<C10dRendezvousStore>(
      std::move(store),
      std::move(description));
}

std::unique_ptr<RendezvousStore> localStore(
    std::shared_ptr<StoreState> state,
    std::string description) {
  return std::make_unique<LocalRendezvousStore>(
      std::move(state),
      std::move(description));
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
