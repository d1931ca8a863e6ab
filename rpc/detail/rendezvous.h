#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "torchrpc/rpc/options.h"
#include "torchrpc/rpc/worker_info.h"

namespace c10d {
class Store;
} // namespace c10d

namespace torchrpc {
namespace rpc {
namespace detail {

// Opens the store named by options.initMethod ("env://", "tcp://host:port",
// "file://path"), or returns options.store. Throws c10::Error with the
// reason (a missing variable, an unreachable master) on failure.
c10::intrusive_ptr<c10d::Store> openStore(const Options& options);

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
// Throws c10::Error naming the missing ranks on timeout.
class Rendezvous {
 public:
  Rendezvous(
      c10::intrusive_ptr<c10d::Store> store,
      int64_t rank,
      int64_t worldSize,
      std::chrono::milliseconds timeout,
      int64_t restartCount = 0);

  JobLayout join(
      const std::string& name,
      const std::string& address,
      const std::map<std::string, DeviceMap>& deviceMaps);

  // A barrier named `phase`: returns true once every rank arrived, false at
  // the deadline (it never throws).
  bool barrier(
      const std::string& phase,
      std::chrono::steady_clock::time_point deadline);

  // The last step of a graceful shutdown: every rank but 0 says it is done
  // with the store; rank 0, which may host the store, waits for all of them
  // (until the deadline) so that nobody loses the store mid-read.
  bool leave(std::chrono::steady_clock::time_point deadline);

 private:
  std::string key(const std::string& suffix) const;
  bool waitForKeys(
      const std::vector<std::string>& keys,
      std::chrono::steady_clock::time_point deadline,
      std::vector<int64_t>* missingRanks);

  c10::intrusive_ptr<c10d::Store> store_;
  int64_t rank_;
  int64_t worldSize_;
  std::chrono::milliseconds timeout_;
  std::string prefix_;
};

// Checks a worker name; throws c10::Error saying what is wrong.
void validateWorkerName(const std::string& name);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
