#pragma once

// The soak's account of plain calls, so that a lost or twice-answered call
// shows: the caller counts what it sent, what was answered (and whether the
// answer was the right one) and what failed, per callee; the callee records
// which sequence numbers it served, per caller, one bit each. At the end
// rank 0 gathers every worker's report() and crossCheck() compares, for
// every caller and callee, sent == answered == served.
//
// Thread-safe: callers' continuations and handlers run on pool threads.

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace torchrpc {
namespace soak {

class CallLedger {
 public:
  explicit CallLedger(int64_t worldSize);

  // Caller side. The sequence number of the next call to `callee`.
  int64_t nextSeq(int64_t callee);
  void answered(int64_t callee, bool rightAnswer);
  void failed(int64_t callee);
  // Callee side: `caller`'s call `seq` ran here.
  void served(int64_t caller, int64_t seq);

  // Per peer p: sent, answered, failed, served, served-without-gaps (0/1);
  // then duplicates served, wrong answers.
  std::vector<int64_t> report() const;
  // Compares every worker's report (indexed by rank); returns one line per
  // mismatch, empty when every call was answered exactly once.
  static std::vector<std::string> crossCheck(
      const std::vector<std::vector<int64_t>>& reports);
  // Calls sent, answered and served here, for progress lines.
  int64_t totalSent() const;
  int64_t totalServed() const;

 private:
  static constexpr int64_t kFieldsPerPeer = 5;

  struct Peer {
    int64_t sent = 0;
    int64_t answered = 0;
    int64_t failed = 0;
    int64_t served = 0;
    std::vector<uint64_t> servedBits;
  };

  mutable std::mutex mutex_;
  std::vector<Peer> peers_;
  int64_t duplicates_ = 0;
  int64_t wrongAnswers_ = 0;
};

} // namespace soak
} // namespace torchrpc
