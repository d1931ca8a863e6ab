#pragma once

// One worker's side of the soak: a loop, bounded in time, over a random
// mix (fixed seed per rank and generation) of
//  - plain calls with sequence numbers, asynchronous, up to kCallWindow in
//    flight, each answer checked (the CallLedger accounts for them);
//  - RRefs created on peers, read here, and dropped;
//  - forks: an RRef passed inside a call to a third worker, which checks
//    its value and sometimes keeps it; ours is often dropped while the call
//    is in flight;
//  - training steps of a small model whose parameters live on the next two
//    workers (a RemoteModule and a parameter RRef): forward, distributed
//    backward, DistributedOptimizer step, in a fresh autograd context.
// Synchronous operations throw their RpcError; run() lets it through.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tests/soak/soak_functions.h"
#include "torchrpc/torchrpc.h"

namespace torchrpc {
namespace soak {

struct OpCounts {
  int64_t calls = 0;
  int64_t rrefsCreated = 0;
  int64_t rrefReads = 0;
  int64_t forks = 0;
  int64_t drops = 0;
  int64_t trainSteps = 0;
  int64_t total() const {
    return calls + rrefsCreated + rrefReads + forks + drops + trainSteps;
  }
};

class SoakDriver {
 public:
  static constexpr size_t kCallWindow = 16;
  static constexpr size_t kForkWindow = 8;
  static constexpr size_t kMaxHeld = 12;

  SoakDriver(torchrpc::Runtime& rt, SoakState& state, uint32_t seed);
  ~SoakDriver();

  // Runs operations until `until`; calls tick() between operations.
  void run(
      std::chrono::steady_clock::time_point until,
      const std::function<void()>& tick);
  // Waits for every call in flight, drops every RRef, the model and the
  // optimizer, and waits (up to `timeout`) until every autograd context
  // opened here is released everywhere. Returns the problems found.
  std::vector<std::string> drain(std::chrono::milliseconds timeout);

  const OpCounts& counts() const {
    return counts_;
  }
  // Failures seen so far (wrong fork checks, non-finite losses).
  const std::vector<std::string>& problems() const {
    return problems_;
  }

 private:
  struct Model;
  struct Call {
    rpc::Future<at::Tensor> future;
    int64_t callee;
    int64_t seq;
    at::Tensor x;
  };
  struct Held {
    RRef<at::Tensor> rref;
    double sum;
  };

  int64_t pickPeer();
  void plainCall();
  void createRRef();
  void readRRef();
  void fork();
  void drop();
  void trainStep();
  void settleOldestCall();
  void settleOldestFork();

  torchrpc::Runtime& rt_;
  SoakState& state_;
  std::mt19937 rng_;
  std::unique_ptr<Model> model_;
  std::deque<Call> calls_;
  std::deque<rpc::Future<bool>> forks_;
  std::vector<Held> held_;
  OpCounts counts_;
  std::vector<std::string> problems_;
  int64_t step_ = 0;
};

} // namespace soak
} // namespace torchrpc
