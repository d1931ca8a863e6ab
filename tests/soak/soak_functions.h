#pragma once

// What every soak worker serves: the plain call the ledger accounts for,
// RRef values and forks a third worker checks (and sometimes keeps for a
// while), the pieces of the small model, and rank 0's barrier and report
// gathering. Registered before start().

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>

#include "tests/soak/call_ledger.h"
#include "torchrpc/torchrpc.h"

namespace torchrpc {
namespace soak {

// The value an RRef of the soak holds: n copies of base, in double so that
// its sum is exact.
inline at::Tensor filled(int64_t n, double base) {
  return at::full({n}, base, at::kDouble);
}

// What a plain call's callee answers for sequence number seq.
inline at::Tensor callAnswer(const at::Tensor& x, int64_t seq) {
  return x + static_cast<double>(seq);
}

// The shared state of one worker's handlers.
class SoakState {
 public:
  static constexpr size_t kMaxKept = 8;
  static constexpr int64_t kPhases = 2;

  explicit SoakState(int64_t worldSize) : ledger(worldSize) {}

  // Keeps a fork handed to this worker, dropping the oldest beyond
  // kMaxKept (a deletion while the value's other forks live on).
  void keep(RRef<at::Tensor> rref);
  // Drops every kept fork.
  void dropKept();

  CallLedger ledger;
  // Rank 0: how many workers reached each barrier.
  std::array<std::atomic<int64_t>, kPhases> arrived{};

 private:
  std::mutex mutex_;
  std::deque<RRef<at::Tensor>> kept_;
};

void addSoakFunctions(torchrpc::Runtime& rt, SoakState& state);

} // namespace soak
} // namespace torchrpc
