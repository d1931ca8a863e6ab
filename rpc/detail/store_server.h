#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace torchrpc {
namespace rpc {
namespace detail {

// Note [Rendezvous store]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Rank 0 hosts the key-value store through which workers meet. libtorch's
// c10d TCPStore server, used before, listens on every interface, trusts
// length prefixes (nine bytes make it zero-fill 4 GiB), and its destructor
// joins a thread that a half-sent request blocks. This store instead speaks
// over torchrpc's own TCP transport: its framing caps every message before
// anything is allocated, a peer silent for the peer timeout (a half-sent
// request included) is dropped, a handshake not finished in time is
// dropped, and with a shared secret nothing of an outsider's is read at
// all. On top, the store caps what it keeps:
//   - a key's and a value's size, the keys of one request;
//   - everything it holds (keys plus values), and what pending waits hold,
//     in all: a request over a cap gets an error reply, nothing is stored;
//   - a request that does not parse closes that connection only.
// It listens on the address it is given (the rendezvous host's), never on
// every interface unless told to ("0.0.0.0"). Closing it is bounded
// whatever peers do (TcpTransport::join()).
struct StoreLimits {
  size_t maxKeyBytes = 1024;
  size_t maxValueBytes = size_t(1) << 20;
  size_t maxKeysPerRequest = 4096;
  size_t maxStoredBytes = size_t(64) << 20;
  size_t maxWaitingBytes = size_t(16) << 20;
  // One request on the wire (a key list or a value, plus framing).
  size_t maxRequestBytes() const {
    return maxKeysPerRequest * (maxKeyBytes + 8) + maxValueBytes + 4096;
  }
};

// The store's contents and pending waits; thread-safe. Each operation
// returns an error text (empty: done) instead of throwing, for the server to
// send back.
class StoreState {
 public:
  using WaitDone = std::function<void()>;

  explicit StoreState(StoreLimits limits) : limits_(limits) {}

  std::string set(const std::string& key, std::string value);
  std::optional<std::string> get(const std::string& key) const;
  std::string add(const std::string& key, int64_t delta, int64_t* result);
  bool check(const std::vector<std::string>& keys) const;
  // Calls `done` (without the lock) once every key exists: at once when they
  // do. Returns an error text and does not register when a cap forbids it.
  std::string wait(
      uint64_t waitId,
      std::vector<std::string> keys,
      WaitDone done);
  // Forgets a pending wait; false if it is not (or no longer) pending.
  bool cancelWait(uint64_t waitId);
  // Drops every pending wait (without calling them).
  void clearWaits();

  size_t storedBytes() const;
  size_t pendingWaits() const;
  const StoreLimits& limits() const {
    return limits_;
  }
  // A wait id no other wait of this store has (StoreSession's waits).
  uint64_t newWaitId() {
    return nextWaitId_.fetch_add(1);
  }

 private:
  struct Waiter {
    std::vector<std::string> keys;
    size_t bytes;
    WaitDone done;
  };
  std::string checkKey(const std::string& key) const;
  std::string storeLocked(const std::string& key, std::string value);
  // Waiters whose keys all exist now, removed from waiters_.
  std::vector<WaitDone> readyWaitersLocked();

  const StoreLimits limits_;
  mutable std::mutex mutex_;
  std::map<std::string, std::string> values_;
  size_t storedBytes_ = 0;
  std::map<uint64_t, Waiter> waiters_;
  size_t waitingBytes_ = 0;
  std::atomic<uint64_t> nextWaitId_{1};
};

struct StoreServerOptions {
  // "ip:port" (port 0: the OS picks); IPv6 as "[::1]:port".
  std::string listenAddress = "127.0.0.1:0";
  // When set, every client must prove it knows it (the transport's
  // handshake) before any of its bytes is read.
  std::string sharedSecret;
  StoreLimits limits;
  std::chrono::milliseconds handshakeTimeout{2000};
  std::chrono::milliseconds heartbeatInterval{1000};
  std::chrono::milliseconds peerTimeout{4000};
};

// Serves a StoreState to StoreClients. See Note [Rendezvous store].
class StoreServer {
 public:
  // Binds and starts serving; throws c10::Error naming the address if it
  // cannot bind.
  explicit StoreServer(StoreServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // "tcp://ip:port", what clients connect to.
  std::string address() const;
  // The store itself, for the process that hosts it.
  const std::shared_ptr<StoreState>& state() const {
    return state_;
  }
  // Stops serving; bounded whatever clients do. Idempotent.
  void close();

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
  std::shared_ptr<StoreState> state_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
