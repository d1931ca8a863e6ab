#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
} // namespace c10d

namespace torchrpc {
namespace rpc {
namespace detail {

class StoreState;

// What the rendezvous needs of a key-value store. Three kinds serve it:
// torchrpc's own store (rank 0 reads its StoreState directly, the others
// are StoreClients; Note [Rendezvous store]) and any c10d::Store (a
// user's, file://, torchrun's agent store). Failures of the store itself
// throw c10::Error naming it.
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;

  virtual void set(const std::string& key, const std::string& value) = 0;
  // set() for a worker on its way out, bounded by `deadline`. Returns false,
  // instead of waiting for it to come back, when the store has gone away
  // (it served this process and now refuses connections: rank 0 left);
  // throws c10::Error when the store refuses the key or the deadline passes.
  // Stores that cannot go away on their own (a c10d store, rank 0's own)
  // just set().
  virtual bool setBefore(
      const std::string& key,
      const std::string& value,
      std::chrono::steady_clock::time_point /*deadline*/) {
    set(key, value);
    return true;
  }
  // The key's value; throws c10::Error if it does not exist.
  virtual std::string get(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Whether every key exists.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // True once every key exists; false when `timeout` passes first.
  virtual bool wait(
      const std::vector<std::string>& keys,
      std::chrono::milliseconds timeout) = 0;
  // For errors: where the store is.
  virtual std::string describe() const = 0;
};

// A c10d::Store seen as a RendezvousStore.
std::unique_ptr<RendezvousStore> wrapC10dStore(
    c10::intrusive_ptr<c10d::Store> store,
    std::string description);

// The store rank 0 hosts, read in its own process.
std::unique_ptr<RendezvousStore> localStore(
    std::shared_ptr<StoreState> state,
    std::string description);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
