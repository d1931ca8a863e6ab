#include "tests/soak/call_ledger.h"

#include <sstream>

namespace torchrpc {
namespace soak {

CallLedger::CallLedger(int64_t worldSize) : peers_(worldSize) {}

int64_t CallLedger::nextSeq(int64_t callee) {
  std::lock_guard<std::mutex> lock(mutex_);
  return peers_.at(callee).sent++;
}

void CallLedger::answered(int64_t callee, bool rightAnswer) {
  std::lock_guard<std::mutex> lock(mutex_);
  peers_.at(callee).answered++;
  if (!rightAnswer) {
    wrongAnswers_++;
  }
}

void CallLedger::failed(int64_t callee) {
  std::lock_guard<std::mutex> lock(mutex_);
  peers_.at(callee).failed++;
}

void CallLedger::served(int64_t caller, int64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& peer = peers_.at(caller);
  auto word = static_cast<size_t>(seq / 64);
  uint64_t bit = uint64_t(1) << (seq % 64);
  if (peer.servedBits.size() <= word) {
    peer.servedBits.resize(word + 1, 0);
  }
  if (peer.servedBits[word] & bit) {
    duplicates_++;
    return;
  }
  peer.servedBits[word] |= bit;
  peer.served++;
}

std::vector<int64_t> CallLedger::report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> out;
  for (const Peer& peer : peers_) {
    // Without gaps: exactly the sequence numbers 0 .. served-1 are set.
    bool contiguous = true;
    for (int64_t seq = 0; seq < peer.served && contiguous; ++seq) {
      contiguous = (peer.servedBits[seq / 64] >> (seq % 64)) & 1;
    }
    out.insert(
        out.end(),
        {peer.sent,
         peer.answered,
         peer.failed,
         peer.served,
         contiguous ? 1 : 0});
  }
  out.push_back(duplicates_);
  out.push_back(wrongAnswers_);
  return out;
}

std::vector<std::string> CallLedger::crossCheck(
    const std::vector<std::vector<int64_t>>& reports) {
  std::vector<std::string> problems;
  auto world = static_cast<int64_t>(reports.size());
  auto expectedSize = static_cast<size_t>(world * kFieldsPerPeer + 2);
  for (int64_t rank = 0; rank < world; ++rank) {
    if (reports[rank].size() != expectedSize) {
      problems.push_back(
          "worker" + std::to_string(rank) + " sent a malformed report");
      return problems;
    }
  }
  for (int64_t caller = 0; caller < world; ++caller) {
    const auto& mine = reports[caller];
    for (int64_t callee = 0; callee < world; ++callee) {
      const auto* out = &mine[callee * kFieldsPerPeer];
      const auto* in = &reports[callee][caller * kFieldsPerPeer];
      int64_t sent = out[0], answered = out[1], failed = out[2];
      int64_t served = in[3];
      bool contiguous = in[4] == 1;
      if (sent != answered || answered != served || failed != 0 ||
          !contiguous) {
        std::ostringstream line;
        line << "worker" << caller << " -> worker" << callee << ": sent "
             << sent << ", answered " << answered << ", failed " << failed
             << ", served " << served
             << (contiguous ? "" : " (with gaps in the sequence numbers)");
        problems.push_back(line.str());
      }
    }
    int64_t duplicates = mine[world * kFieldsPerPeer];
    int64_t wrong = mine[world * kFieldsPerPeer + 1];
    if (duplicates != 0) {
      problems.push_back(
          "worker" + std::to_string(caller) + " served " +
          std::to_string(duplicates) + " call(s) twice");
    }
    if (wrong != 0) {
      problems.push_back(
          "worker" + std::to_string(caller) + " got " + std::to_string(wrong) +
          " wrong answer(s)");
    }
  }
  return problems;
}

int64_t CallLedger::totalSent() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (const Peer& peer : peers_) {
    total += peer.sent;
  }
  return total;
}

int64_t CallLedger::totalServed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (const Peer& peer : peers_) {
    total += peer.served;
  }
  return total;
}

} // namespace soak
} // namespace torchrpc
