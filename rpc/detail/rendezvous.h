#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "torchrpc/rpc/detail/rendezvous_store.h"
#include "torchrpc/rpc/detail/store_server.h"
#include "torchrpc/rpc/options.h"
#include "torchrpc/rpc/worker_info.h"

namespace torchrpc {
namespace rpc {
namespace detail {

// The store a worker rendezvouses through, and the server when this worker
// hosts it (rank 0 with env:// or tcp://, unless torchrun's agent hosts it).
struct OpenedStore {
  std::unique_ptr<StoreServer> server;
  std::shared_ptr<RendezvousStore> store;
};

// Opens the store named by options.initMethod ("env://", "tcp://host:port",
// "file://path"), or wraps options.store. Rank 0 starts torchrpc's own
// store server (Note [Rendezvous store]) on options.storeListenAddress, by
// default the rendezvous host's address. Throws c10::Error with the reason
// (a missing variable, an address it cannot listen on) on failure.
OpenedStore openStore(const Options& options);

// What every worker learns at start-up.
struct JobLayout {
  std::vector<WorkerInfo> workers; // indexed by id (= rank)
  std::vector<std::string> addresses;
  // Per peer id: the device map that peer uses for requests to us.
  std::map<int64_t, DeviceMap> peerMapsTowardsUs;
};

// Note [Rendezvous keys]
// Keys live under "torchrpc/restart<R>/<S>/" ("torchrpc/<S>/" for R = 0),
// where R is the group's restart generation (torchrun's
// TORCHELASTIC_RESTART_COUNT) and S counts the starts of this rank within
// generation R (a store key per rank, incremented by add()). Guarantees:
//  1. A store reused by a later start in the same process (stop, start
//     again) shows that start only its own keys: S differs.
//  2. A group restarted after a failure meets again even when the store
//     outlived the failed group (torchrun's agent store) and the failed
//     ranks had started different numbers of times (one died before
//     start(), another was waiting in it): R differs, and S restarts at 1
//     for every rank of the new generation.
//  3. Keys of every generation stay in the store; nobody reads another
//     generation's, so stale ones cannot satisfy or block a wait.

// Meets every other worker through the store: publishes this worker's name,
// address and device maps, waits for everyone's, validates names (unique,
// [A-Za-z0-9_.:-], 1..128 characters). See Note [Rendezvous keys].
// While waiting it logs, every progressInterval, the ranks still missing;
// on timeout it throws c10::Error naming exactly those. A failing store is
// reported as the store's error, never as ranks that did not arrive.
class Rendezvous {
 public:
  Rendezvous(
      std::shared_ptr<RendezvousStore> store,
      int64_t rank,
      int64_t worldSize,
      std::chrono::milliseconds timeout,
      int64_t restartCount = 0,
      std::chrono::milliseconds progressInterval = std::chrono::seconds(10));

  JobLayout join(
      const std::string& name,
      const std::string& address,
      const std::map<std::string, DeviceMap>& deviceMaps);

  // Whether a rank is lost (Note [Lost workers]); asked again while a
  // barrier waits, so it may probe the ranks it is asked about.
  using IsLost = std::function<bool(int64_t rank)>;

  // A barrier named `phase`: returns true once every rank arrived that is
  // not lost, false at the deadline (it never throws).
  bool barrier(
      const std::string& phase,
      std::chrono::steady_clock::time_point deadline,
      const IsLost& isLost = nullptr);

  // Whether `rank` reached barrier `phase`; throws c10::Error as the store
  // does when it cannot be asked.
  bool arrived(const std::string& phase, int64_t rank);

  // The last step of a graceful shutdown: every rank but 0 says it is done
  // with the store; rank 0, which may host the store, waits for all of them
  // that are not lost (until the deadline) so that nobody loses the store
  // mid-read.
  bool leave(
      std::chrono::steady_clock::time_point deadline,
      const IsLost& isLost = nullptr);

 private:
  std::string key(const std::string& suffix) const;
  bool waitForKeys(
      const std::vector<std::string>& keys,
      std::chrono::steady_clock::time_point deadline);
  // Waits until keys[rank] exists for every rank (an index into `keys`
  // plus `firstRank`) that isLost does not report lost.
  bool waitForLiveRanks(
      const std::vector<std::string>& keys,
      int64_t firstRank,
      std::chrono::steady_clock::time_point deadline,
      const IsLost& isLost);
  // The ranks whose key in `keys` (indexed by rank) is not in the store.
  std::vector<int64_t> missingRanks(const std::vector<std::string>& keys);

  std::shared_ptr<RendezvousStore> store_;
  int64_t rank_;
  int64_t worldSize_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds progressInterval_;
  std::string prefix_;
};

// Checks a worker name; throws c10::Error saying what is wrong.
void validateWorkerName(const std::string& name);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
