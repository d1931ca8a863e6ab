#pragma once

// Several workers in one process with the RRef layer installed, plus the
// checks the RRef suites share.

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "tests/support/local_cluster.h"
#include "torchrpc/rref/rref.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {
namespace testing {

inline std::string describeCounters(const rref::RRefCounters& c) {
  std::ostringstream out;
  out << "owner=" << c.ownerRRefs << " user=" << c.userRRefs
      << " pendingForks=" << c.pendingForks
      << " pendingConfirmations=" << c.pendingConfirmations
      << " tombstones=" << c.tombstones;
  return out.str();
}

inline bool allZero(const rref::RRefCounters& c) {
  return c.ownerRRefs == 0 && c.userRRefs == 0 && c.pendingForks == 0 &&
      c.pendingConfirmations == 0 && c.tombstones == 0;
}

// Calls visit(element) for each element of a list or tuple, or each value
// of a dict, that is an RRef, in order; other values are skipped.
template <typename Visit>
void forEachRRefIn(const c10::IValue& container, Visit&& visit) {
  auto visitIfRRef = [&](const c10::IValue& v) {
    if (v.isRRef()) {
      visit(v);
    }
  };
  if (container.isList()) {
    for (const auto& v : container.toListRef()) {
      visitIfRRef(v);
    }
  } else if (container.isTuple()) {
    for (const auto& v : container.toTupleRef().elements()) {
      visitIfRRef(v);
    }
  } else if (container.isGenericDict()) {
    for (const auto& entry : container.toGenericDict()) {
      visitIfRRef(entry.value());
    }
  }
}

class RRefCluster {
 public:
  // setup(rank, runtime) registers functions before start().
  RRefCluster(
      rpc::TransportKind transport,
      int worldSize,
      std::function<void(int, rpc::Runtime&)> setup = nullptr,
      std::function<void(int, rpc::Options&)> configure = nullptr)
      : cluster_(
            transport,
            worldSize,
            std::move(configure),
            [setup](int rank, rpc::Runtime& runtime) {
              rref::RRefContext::install(runtime);
              if (setup) {
                setup(rank, runtime);
              }
            }) {}

  rpc::Runtime& operator[](int rank) {
    return cluster_[rank];
  }
  rref::RRefContext& context(int rank) {
    return *rref::RRefContext::of(cluster_[rank]);
  }
  int size() const {
    return cluster_.size();
  }
  LocalCluster& cluster() {
    return cluster_;
  }

  // Waits (bounded) until every worker's RRef tables are empty; reports the
  // counters of every worker that is not.
  ::testing::AssertionResult waitForEmptyTables(
      std::chrono::milliseconds timeout = std::chrono::seconds(15)) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      std::string report;
      for (int rank = 0; rank < size(); ++rank) {
        auto counters = context(rank).counters();
        if (!allZero(counters)) {
          report += " worker" + std::to_string(rank) + ": " +
              describeCounters(counters) + ";";
        }
      }
      if (report.empty()) {
        return ::testing::AssertionSuccess();
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return ::testing::AssertionFailure()
            << "RRef tables not empty:" << report;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  bool shutdownAll(bool graceful = true) {
    return cluster_.shutdownAll(graceful);
  }

 private:
  LocalCluster cluster_;
};

} // namespace testing
} // namespace torchrpc
