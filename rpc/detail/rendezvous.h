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

// Meets every other worker through the store: publishes this worker's name,
// address and device maps, waits for everyone's, validates names (unique,
// [A-Za-z0-9_.:-], 1..128 characters). Keys live under a prefix that is new
// for each start of a rank, so a store may be reused by a later start.
// Throws c10::Error naming the missing ranks on timeout.
class Rendezvous {
 public:
  Rendezvous(
      c10::intrusive_ptr<c10d::Store> store,
      int64_t rank,
      int64_t worldSize,
      std::chrono::milliseconds timeout);

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
