// Tier 2: what the RRef layer tells of itself, over each transport. Its
// gauges in Runtime::metrics() count its tables exactly, and its part of a
// hang report names each fork that waits, for what and from whom. The
// owner's one pool thread is held by a gate, so that the protocol's
// messages to it wait as long as the test looks.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/gate.h"
#include "tests/support/layer_values.h"
#include "tests/support/rref_cluster.h"

namespace torchrpc {
namespace testing {
namespace {

using namespace std::chrono_literals;
using rref::RRef;

using Gauges = std::map<std::string, double>;

Gauges gauges(
    double owned,
    double userForks,
    double pendingForks,
    double pendingConfirmations) {
  return {
      {"owned", owned},
      {"user_forks", userForks},
      {"pending_forks", pendingForks},
      {"pending_confirmations", pendingConfirmations},
      {"tombstones", 0},
      {"late_uses_refused", 0}};
}

std::string describe(const Gauges& values) {
  std::string out;
  for (const auto& [name, value] : values) {
    out += name + "=" + std::to_string(value) + " ";
  }
  return out;
}

// Waits (bounded) until every worker reports `expected` (one entry per
// rank), then compares, so that a failure shows what each reported.
void expectGauges(RRefCluster& cluster, const std::vector<Gauges>& expected) {
  auto matches = [&]() {
    for (int rank = 0; rank < cluster.size(); ++rank) {
      if (layerValues(cluster[rank], "rref") != expected.at(rank)) {
        return false;
      }
    }
    return true;
  };
  eventually(matches);
  for (int rank = 0; rank < cluster.size(); ++rank) {
    Gauges reported = layerValues(cluster[rank], "rref");
    EXPECT_EQ(reported, expected.at(rank))
        << "worker" << rank << " reports " << describe(reported) << "expected "
        << describe(expected.at(rank));
  }
}

// worker2 keeps the RRefs it is given.
struct Holder {
  std::mutex mutex;
  std::vector<RRef<at::Tensor>> held;
};

class RRefObservability : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<RRefCluster>(
        GetParam(),
        3,
        [this](int rank, rpc::Runtime& rt) {
          rt.functions().add("make", [](double value) {
            return at::full({1}, value);
          });
          rt.functions().add("block", [this]() { return gate_.pass(); });
          if (rank == 2) {
            rt.functions().add("hold", [this](RRef<at::Tensor> r) {
              std::lock_guard<std::mutex> guard(holder_.mutex);
              holder_.held.push_back(r);
              return static_cast<int64_t>(holder_.held.size());
            });
            rt.functions().add("drop_all", [this]() {
              std::vector<RRef<at::Tensor>> dropped;
              std::lock_guard<std::mutex> guard(holder_.mutex);
              dropped.swap(holder_.held);
            });
          }
        },
        [](int rank, rpc::Options& o) {
          // worker1 owns every RRef; blocking its one thread holds every
          // protocol message to it.
          if (rank == 1) {
            o.numWorkerThreads = 1;
          }
        });
  }

  void TearDown() override {
    // However the test ended: no handler waits at shutdown.
    gate_.open();
    if (cluster_) {
      EXPECT_TRUE(cluster_->shutdownAll());
    }
  }

  rpc::Runtime& rt(int rank) {
    return (*cluster_)[rank];
  }

  RRef<at::Tensor> make(double value) {
    return rref::remote<at::Tensor>(rt(0), "worker1", "make", value);
  }

  // What worker0 holds while worker1's thread is held (see holdOwner()).
  struct Held {
    // Confirmed before the owner was held; [0] and [1] were handed to
    // worker2, [2] is being fetched.
    std::vector<RRef<at::Tensor>> settled;
    // Created while the owner is held: unconfirmed.
    RRef<at::Tensor> fresh;
    rpc::Future<at::Tensor> fetch;
    rpc::Future<bool> blocked;
  };

  // Five RRefs owned by worker1, confirmed; then worker1's thread is held
  // and worker0 hands two of them to worker2 (whose kForkNotify waits), asks
  // for a sixth (its kRemote waits), fetches a third and drops two more
  // (one kDeleteFork waits, the other is queued behind it).
  Held holdOwner() {
    Held h;
    for (int i = 0; i < 5; ++i) {
      h.settled.push_back(make(i));
    }
    for (auto& r : h.settled) {
      r.confirmedAsync().wait();
    }
    expectGauges(
        *cluster_,
        {gauges(0, 5, 0, 0), gauges(5, 0, 0, 0), gauges(0, 0, 0, 0)});

    h.blocked = rt(0).withTimeout(30s).rpcAsync<bool>("worker1", "block");
    EXPECT_TRUE(gate_.waitForWaiting(1));
    // R7: worker2 sent its kForkNotify before it answered.
    EXPECT_EQ(rt(0).rpcSync<int64_t>("worker2", "hold", h.settled[0]), 1);
    EXPECT_EQ(rt(0).rpcSync<int64_t>("worker2", "hold", h.settled[1]), 2);
    h.fresh = make(5);
    h.fetch = h.settled[2].toHereAsync();
    h.settled.resize(3);
    return h;
  }

  // Opens the gate and waits for everything holdOwner() left waiting.
  void release(Held& h) {
    gate_.open();
    EXPECT_TRUE(h.blocked.wait());
    EXPECT_TRUE(at::equal(h.fetch.wait(), at::full({1}, 2.0)));
    h.fresh.confirmedAsync().wait();
  }

  // Declared before the cluster: handlers never outlive it.
  Gate gate_;
  Holder holder_;
  std::unique_ptr<RRefCluster> cluster_;
};

TEST_P(RRefObservability, GaugesCountEachTableExactlyAndReturnToZero) {
  // Owned here without a fork anywhere: in no table (R5).
  auto local = RRef<at::Tensor>::local(rt(1), at::ones({1}));
  Held h = holdOwner();
  // worker0: six forks (the two deleted ones until worker1 answers), two
  // handed on and not registered, one unconfirmed. worker1 has not seen
  // the sixth kRemote. worker2: two forks, neither confirmed.
  expectGauges(
      *cluster_,
      {gauges(0, 6, 2, 1), gauges(5, 0, 0, 0), gauges(0, 2, 0, 2)});

  release(h);
  // worker1 registered and confirmed everything, and took the two
  // deletions: four RRefs left, two of them held on both users.
  expectGauges(
      *cluster_,
      {gauges(0, 4, 0, 0), gauges(4, 0, 0, 0), gauges(0, 2, 0, 0)});

  h = Held();
  local = RRef<at::Tensor>();
  rt(0).rpcSync<void>("worker2", "drop_all");
  expectGauges(
      *cluster_,
      {gauges(0, 0, 0, 0), gauges(0, 0, 0, 0), gauges(0, 0, 0, 0)});
}

// How many lines of `report` are "  " + a full match of `line`.
size_t countLines(const std::string& report, const std::string& line) {
  const std::regex pattern("  " + line);
  std::istringstream lines(report);
  size_t count = 0;
  for (std::string text; std::getline(lines, text);) {
    count += std::regex_match(text, pattern) ? 1 : 0;
  }
  return count;
}

// Exactly one line of `report` is `line`.
void expectLine(const std::string& report, const std::string& line) {
  EXPECT_EQ(countLines(report, line), 1u)
      << "not one line matching\n  " << line << "\nin\n"
      << report;
}

size_t linesOf(const std::string& report) {
  return std::count(report.begin(), report.end(), '\n');
}

TEST_P(RRefObservability, AHangReportNamesWhatEachForkWaitsForAndFromWhom) {
  Held h = holdOwner();
  const std::string rref0 = h.settled[0].id().toString();
  const std::string rref1 = h.settled[1].id().toString();
  const std::string fresh = h.fresh.id().toString();
  const std::string fork = "fork ([0-9]+:[0-9]+) of RRef ";
  const std::string awaitsReply =
      " to 'worker1' awaits its reply for [0-9.]+ ms";

  // worker0: its calls to the owner (the fetch among them), the fork it
  // waits to have confirmed, the two it handed to worker2, and its
  // deletion in flight with the one queued behind it.
  std::string report0 = rt(0).hangReport();
  EXPECT_EQ(report0.rfind("'worker0' (rank 0) waits for:\n", 0), 0u) << report0;
  expectLine(report0, "call #[0-9]+ \\(block\\)" + awaitsReply);
  expectLine(report0, "call #[0-9]+ \\(make\\)" + awaitsReply);
  expectLine(report0, "call #[0-9]+ \\(RRef\\.toHere\\)" + awaitsReply);
  expectLine(report0, "call #[0-9]+ \\(rref\\.deleteFork\\)" + awaitsReply);
  expectLine(
      report0,
      "rref: " + fork + fresh +
          " awaits its confirmation by the owner 'worker1'");
  const std::string handed =
      ", handed to 'worker2', awaits its registration by the owner "
      "'worker1'\n";
  std::smatch handed0;
  std::smatch handed1;
  ASSERT_TRUE(std::regex_search(
      report0,
      handed0,
      std::regex("\n  rref: " + fork + rref0 + handed)))
      << report0;
  ASSERT_TRUE(std::regex_search(
      report0,
      handed1,
      std::regex("\n  rref: " + fork + rref1 + handed)))
      << report0;
  expectLine(
      report0,
      "rref: a deletion of forks awaits its answer from the owner "
      "'worker1' \\(1 more queued\\)");
  // Nothing else: four calls, four waits of the RRef layer.
  EXPECT_EQ(linesOf(report0), 1u + 4u + 4u) << report0;

  // worker2: the forks worker0 handed it, each of its own RRef, await
  // their confirmation by the owner, and its kForkNotify calls their reply.
  std::string report2 = rt(2).hangReport();
  EXPECT_EQ(report2.rfind("'worker2' (rank 2) waits for:\n", 0), 0u) << report2;
  expectLine(
      report2,
      "rref: fork " + handed0[1].str() + " of RRef " + rref0 +
          " awaits its confirmation by the owner 'worker1'");
  expectLine(
      report2,
      "rref: fork " + handed1[1].str() + " of RRef " + rref1 +
          " awaits its confirmation by the owner 'worker1'");
  EXPECT_EQ(
      countLines(report2, "call #[0-9]+ \\(rref\\.forkNotify\\)" + awaitsReply),
      2u)
      << report2;
  EXPECT_EQ(linesOf(report2), 1u + 2u + 2u) << report2;

  // worker1 is the one waited for; it waits for nothing.
  EXPECT_EQ(rt(1).hangReport(), "'worker1' (rank 1) waits for nothing\n");

  // The job's report, asked on worker2, carries worker0's part.
  std::string gathered = rt(2).gatherHangReport(5s);
  EXPECT_TRUE(std::regex_search(
      gathered,
      std::regex(
          "'worker0' \\(rank 0\\) waits for:\n(  .*\n)*  rref: " + fork +
          fresh + " awaits its confirmation by the owner 'worker1'\n")))
      << gathered;

  release(h);
  EXPECT_TRUE(eventually([&]() {
    return rt(0).hangReport() == "'worker0' (rank 0) waits for nothing\n" &&
        rt(2).hangReport() == "'worker2' (rank 2) waits for nothing\n";
  })) << rt(0).hangReport()
      << rt(2).hangReport();
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    RRefObservability,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTcp,
        rpc::TransportKind::kTensorPipe),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
