// Tier 2: the guarantees of Note [RRef fork protocol] (rref/rref_context.h),
// each exercised with several workers in one process, with delayed and
// reordered delivery forced through the in-process transport.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "tests/support/layer_values.h"
#include "tests/support/rref_cluster.h"
#include "torchrpc/rpc/transport/inprocess/inprocess_transport.h"
#include "torchrpc/rpc/wire/envelope.h"

namespace torchrpc {
namespace testing {
namespace {

using namespace std::chrono_literals;
using rpc::ErrorCode;
using rref::RRef;

// What each worker keeps of the RRefs others hand it.
struct Holder {
  std::mutex mutex;
  std::vector<RRef<at::Tensor>> held;
};

struct Workers {
  std::vector<std::unique_ptr<Holder>> holders;
  std::atomic<int> slowMakeRuns{0};
};

// Registers the functions every worker offers. `workers` outlives the
// cluster.
std::function<void(int, rpc::Runtime&)> functionsFor(Workers& workers) {
  return [&workers](int rank, rpc::Runtime& rt) {
    Holder& holder = *workers.holders.at(rank);
    rt.functions().add("make", [](int64_t n, double value) {
      return at::full({n}, value);
    });
    rt.functions().add("boom", []() -> at::Tensor {
      throw std::runtime_error("boom from the owner");
    });
    rt.functions().add("slow_make", [&workers](int64_t ms, double value) {
      ++workers.slowMakeRuns;
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return at::full({1}, value);
    });
    // Handlers that wait on other workers return futures instead of
    // blocking: a parked pool thread cannot serve the calls it waits for.
    rt.functions().add("sum_rref", [](RRef<at::Tensor> r) {
      return r.toHereAsync().then(
          [](at::Tensor value) { return value.sum().item<double>(); });
    });
    rt.functions().add("is_owner_of", [](RRef<at::Tensor> r) {
      return r.isOwner();
    });
    // Hands the RRef on along `path`; the last worker fetches it.
    rt.functions().add(
        "relay",
        [&rt](RRef<at::Tensor> r, std::vector<int64_t> path)
            -> rpc::Future<double> {
          if (path.empty()) {
            return r.toHereAsync().then(
                [](at::Tensor value) { return value.sum().item<double>(); });
          }
          int64_t next = path.front();
          path.erase(path.begin());
          return rt.rpcAsync<double>(next, "relay", r, path);
        });
    rt.functions().add("hold", [&holder](RRef<at::Tensor> r) {
      std::lock_guard<std::mutex> guard(holder.mutex);
      holder.held.push_back(r);
      return static_cast<int64_t>(holder.held.size());
    });
    rt.functions().add("drop_all", [&holder]() {
      std::vector<RRef<at::Tensor>> dropped;
      std::lock_guard<std::mutex> guard(holder.mutex);
      dropped.swap(holder.held);
    });
  };
}

class RRefProtocol : public ::testing::Test {
 protected:
  void start(
      int worldSize,
      rpc::TransportKind transport = rpc::TransportKind::kInProcess,
      std::function<void(int, rpc::Options&)> configure = nullptr) {
    for (int rank = 0; rank < worldSize; ++rank) {
      workers_.holders.push_back(std::make_unique<Holder>());
    }
    cluster_ = std::make_unique<RRefCluster>(
        transport,
        worldSize,
        functionsFor(workers_),
        std::move(configure));
  }
  void TearDown() override {
    if (cluster_) {
      network().setFaultInjector(nullptr);
      EXPECT_TRUE(cluster_->shutdownAll());
    }
  }
  rpc::Runtime& rt(int rank) {
    return (*cluster_)[rank];
  }
  rref::RRefCounters counters(int rank) {
    return cluster_->context(rank).counters();
  }
  rpc::InProcessNetwork& network() {
    return *cluster_->cluster().network();
  }
  // Delays the chosen messages of the RRef layer out of order.
  void delayRRefMessages(
      std::function<std::chrono::milliseconds(const rpc::MessageSummary&)>
          delayOf) {
    network().setFaultInjector([delayOf](
                                   const std::string&,
                                   const std::string&,
                                   const rpc::Message& m) {
      auto summary = rpc::summarizeMessage(m);
      if (!summary || summary->kind < rref::kRemoteKind ||
          summary->kind > rref::kDeleteForkKind) {
        return rpc::FaultAction::deliver();
      }
      auto delay = delayOf(*summary);
      return delay.count() > 0 ? rpc::FaultAction::delayOutOfOrder(delay)
                               : rpc::FaultAction::deliver();
    });
  }
  template <typename P>
  bool waitUntil(P predicate, std::chrono::milliseconds timeout = 10s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!predicate()) {
      if (std::chrono::steady_clock::now() > deadline) {
        return false;
      }
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }

  Workers workers_;
  std::unique_ptr<RRefCluster> cluster_;
};

// A fork chain through users and back to the creator, and one through the
// owner: A -> B -> C -> A.
TEST_F(RRefProtocol, ForkChainsEndWhereTheyStarted) {
  start(4);
  auto r = rref::remote<at::Tensor>(rt(0), "worker3", "make", 3, 2.0);
  EXPECT_EQ(
      rt(0).rpcSync<double>("worker1", "relay", r, std::vector<int64_t>{2, 0}),
      6.0);
  EXPECT_EQ(
      rt(0).rpcSync<double>("worker1", "relay", r, std::vector<int64_t>{3, 2}),
      6.0);
  EXPECT_EQ(
      rt(0).rpcSync<double>("worker0", "relay", r, std::vector<int64_t>{0}),
      6.0);
  r = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

TEST_F(RRefProtocol, ReferencesComingBackToTheirOwnerBecomeTheValue) {
  start(3);
  // user -> owner
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "make", 1, 1.0);
  EXPECT_TRUE(rt(0).rpcSync<bool>("worker1", "is_owner_of", r));
  // owner -> owner
  auto local = RRef<at::Tensor>::local(rt(1), at::ones({1}));
  EXPECT_TRUE(rt(1).rpcSync<bool>("worker1", "is_owner_of", local));
  // user -> itself
  EXPECT_FALSE(rt(0).rpcSync<bool>("worker0", "is_owner_of", r));
  r = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

// G1: the owner keeps the value while any user holds it, after its creator
// is gone.
TEST_F(RRefProtocol, OwnerKeepsTheValueUntilTheLastUserIsGone) {
  start(3);
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "make", 2, 4.0);
  EXPECT_EQ(rt(0).rpcSync<int64_t>("worker2", "hold", r), 1);
  r = RRef<at::Tensor>();
  ASSERT_TRUE(waitUntil([&]() { return counters(0).userRRefs == 0; }));
  EXPECT_EQ(counters(1).ownerRRefs, 1u);
  EXPECT_EQ(counters(2).userRRefs, 1u);
  {
    std::lock_guard<std::mutex> guard(workers_.holders[2]->mutex);
    EXPECT_TRUE(at::equal(
        workers_.holders[2]->held.at(0).toHere(),
        at::full({2}, 4.0)));
  }
  rt(0).rpcSync<void>("worker2", "drop_all");
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

// R1/R2: a fork in flight keeps its parent's fork: the parent cannot delete
// before the owner has registered the child.
TEST_F(RRefProtocol, AForkInFlightKeepsItsParentsReference) {
  start(3);
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "make", 1, 3.0);
  r.toHere();
  ASSERT_TRUE(waitUntil([&]() { return r.confirmedByOwner(); }));
  delayRRefMessages([](const rpc::MessageSummary& m) {
    // Long enough that a loaded machine still checks within it.
    return m.kind == rref::kForkNotifyKind && !m.isResponse ? 1500ms : 0ms;
  });
  EXPECT_EQ(rt(0).rpcSync<int64_t>("worker2", "hold", r), 1);
  r = RRef<at::Tensor>();
  std::this_thread::sleep_for(100ms);
  // worker2's notify is still on its way: worker0 keeps its fork.
  EXPECT_EQ(counters(0).pendingForks, 1u);
  EXPECT_EQ(counters(0).userRRefs, 1u);
  EXPECT_EQ(counters(2).pendingConfirmations, 1u);
  EXPECT_EQ(counters(1).ownerRRefs, 1u);
  ASSERT_TRUE(waitUntil([&]() { return counters(0).userRRefs == 0; }));
  {
    std::lock_guard<std::mutex> guard(workers_.holders[2]->mutex);
    EXPECT_TRUE(at::equal(
        workers_.holders[2]->held.at(0).toHere(),
        at::full({1}, 3.0)));
  }
  rt(0).rpcSync<void>("worker2", "drop_all");
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

// R6: uses and forks that reach the owner before the kRemote that creates
// the value wait for it.
TEST_F(RRefProtocol, UsesArrivingBeforeTheCreationWaitForIt) {
  start(3);
  delayRRefMessages([](const rpc::MessageSummary& m) {
    return m.kind == rref::kRemoteKind && !m.isResponse ? 300ms : 0ms;
  });
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "make", 2, 5.0);
  auto viaUser = rt(0).rpcAsync<double>("worker2", "sum_rref", r);
  auto fetched = r.toHereAsync();
  auto proxied = r.remote<at::Tensor>("aten::mul.Scalar", 2.0);
  EXPECT_EQ(viaUser.wait(), 10.0);
  EXPECT_TRUE(at::equal(fetched.wait(), at::full({2}, 5.0)));
  EXPECT_TRUE(at::equal(proxied.toHere(), at::full({2}, 10.0)));
  r = RRef<at::Tensor>();
  proxied = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

// G4 when the owner's answer to a use overtakes its answer to the failed
// creation: the use waits for the creation's answer, so once a use has
// failed, sending the fork fails too.
TEST_F(RRefProtocol, AUseFailingBeforeTheCreationsAnswerWaitsForIt) {
  start(3);
  delayRRefMessages([](const rpc::MessageSummary& m) {
    return m.kind == rref::kRemoteKind && m.isResponse ? 300ms : 0ms;
  });
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "boom");
  expectRpcError(
      [&]() { r.toHere(); },
      ErrorCode::kRemoteException,
      {"worker1", "boom from the owner"});
  expectRpcError(
      [&]() { rt(0).rpcSync<double>("worker2", "sum_rref", r); },
      ErrorCode::kBadArguments,
      {"creating it failed", "boom from the owner"});
  r = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

// G2 when a use is still on its way as the creation fails: the use fails
// with the creation's error at once (G4), but the fork is kept until the
// owner has answered the use, so the deletion cannot overtake it and leave
// the use to make a record no one deletes (R6).
TEST_F(RRefProtocol, AUseStillOnItsWayWhenTheCreationFailsKeepsTheFork) {
  start(2);
  delayRRefMessages([](const rpc::MessageSummary& m) {
    return (m.kind == rref::kFetchKind || m.kind == rref::kCallOnKind) &&
            !m.isResponse
        ? 300ms
        : 0ms;
  });
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "boom");
  auto fetched = r.toHereAsync();
  auto called = r.rpcAsync<at::Tensor>("aten::mul.Scalar", 2.0);
  expectRpcError(
      [&]() { fetched.wait(); },
      ErrorCode::kRemoteException,
      {"worker1", "boom from the owner"});
  expectRpcError(
      [&]() { called.wait(); },
      ErrorCode::kRemoteException,
      {"worker1", "boom from the owner"});
  r = RRef<at::Tensor>();
  // Empty tables prove nothing until the owner has answered the delayed
  // uses (a use that made a record no one deletes is never answered).
  EXPECT_TRUE(waitUntil(
      [&]() { return rt(0).agent().counters().pendingCalls == 0; },
      5s));
  EXPECT_TRUE(cluster_->waitForEmptyTables(5s));
}

// R6 after R5: a use keeps its fork until it is answered or times out, so a
// use whose caller stopped waiting can reach the owner after the RRef's last
// fork was deleted. The owner refuses it instead of making a pending record
// that no deletion would ever remove.
TEST_F(RRefProtocol, AUseArrivingAfterItsRRefWasDeletedIsRefused) {
  start(2);
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "make", 1, 3.0);
  EXPECT_TRUE(at::equal(r.toHere(), at::full({1}, 3.0)));
  ASSERT_TRUE(waitUntil([&]() { return r.confirmedByOwner(); }));
  delayRRefMessages([](const rpc::MessageSummary& m) {
    // Long enough that a loaded machine still deletes within it.
    return m.kind == rref::kFetchKind && !m.isResponse ? 1500ms : 0ms;
  });
  auto fetched = r.toHereAsync(100ms);
  expectRpcError(
      [&]() { fetched.wait(); },
      ErrorCode::kTimeout,
      {"worker1", "RRef.toHere"});
  r = RRef<at::Tensor>();
  // The deletion overtakes the delayed fetch: the record goes first.
  ASSERT_TRUE(waitUntil(
      [&]() {
        return counters(0).userRRefs == 0 && counters(1).ownerRRefs == 0;
      },
      5s));
  // Then the fetch arrives and is refused, leaving nothing behind.
  EXPECT_TRUE(waitUntil([&]() { return counters(1).lateUses == 1; }, 5s));
  EXPECT_EQ(layerValue(rt(1), "rref", "late_uses_refused"), 1);
  EXPECT_TRUE(cluster_->waitForEmptyTables(5s));
  EXPECT_EQ(counters(1).ownerRRefs, 0u);
}

// The same for a kRemote whose receiver (the RRef it runs on) was deleted
// while it was on its way: the new RRef fails instead of waiting for a
// value that will never come, and both records go.
TEST_F(RRefProtocol, ACreationOnAnRRefDeletedMeanwhileFails) {
  start(2, rpc::TransportKind::kInProcess, [](int rank, rpc::Options& o) {
    if (rank == 0) {
      o.defaultTimeout = 300ms; // the creator's kRemote times out
    }
  });
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "make", 1, 3.0);
  EXPECT_TRUE(at::equal(r.toHere(), at::full({1}, 3.0)));
  ASSERT_TRUE(waitUntil([&]() { return r.confirmedByOwner(); }));
  delayRRefMessages([](const rpc::MessageSummary& m) {
    return m.kind == rref::kRemoteKind && !m.isResponse ? 1500ms : 0ms;
  });
  auto p = r.remote<at::Tensor>("aten::mul.Scalar", 2.0);
  r = RRef<at::Tensor>();
  // Not a use of p: one would make p's record on worker1 before its kRemote.
  expectRpcError(
      [&]() { p.confirmedAsync().wait(); },
      ErrorCode::kTimeout,
      {"worker1", "aten::mul.Scalar"});
  // The deletion of r overtakes the delayed kRemote.
  ASSERT_TRUE(waitUntil([&]() { return counters(1).ownerRRefs == 0; }, 5s));
  // p is still held, so its kRemote finds no tombstone and runs: on the
  // deleted receiver, it is refused.
  EXPECT_TRUE(waitUntil([&]() { return counters(1).lateUses == 1; }, 5s));
  p = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables(5s));
}

TEST_F(RRefProtocol, ToHereRacesTheOwnersCreationOfTheValue) {
  start(3);
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "slow_make", 200, 7.0);
  auto viaUser = rt(0).rpcAsync<double>("worker2", "sum_rref", r);
  EXPECT_FALSE(r.confirmedByOwner());
  EXPECT_TRUE(at::equal(r.toHere(), at::full({1}, 7.0)));
  EXPECT_EQ(viaUser.wait(), 7.0);
  r = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

// R6: a creator that gave up (timeout) deletes its fork before the kRemote
// arrives; the owner keeps a tombstone and the late kRemote does not run.
TEST_F(RRefProtocol, ADeletionBeforeTheCreationCancelsIt) {
  start(2);
  delayRRefMessages([](const rpc::MessageSummary& m) {
    return m.kind == rref::kRemoteKind && !m.isResponse ? 2000ms : 0ms;
  });
  auto r = rref::remoteWithTimeout<at::Tensor>(
      rt(0),
      100ms,
      "worker1",
      "slow_make",
      1,
      1.0);
  // Nothing names the RRef before its creation has failed: a use in flight
  // would (rightly) keep the fork until it is answered.
  std::this_thread::sleep_for(250ms);
  EXPECT_FALSE(r.confirmedByOwner());
  expectRpcError(
      [&]() { r.toHere(); },
      ErrorCode::kTimeout,
      {"worker1", "slow_make"});
  r = RRef<at::Tensor>();
  ASSERT_TRUE(waitUntil([&]() { return counters(1).tombstones == 1; }));
  // The metrics say so too (the kRemote is still on its way).
  EXPECT_EQ(layerValue(rt(1), "rref", "tombstones"), 1);
  EXPECT_TRUE(cluster_->waitForEmptyTables());
  EXPECT_EQ(layerValue(rt(1), "rref", "tombstones"), 0);
  EXPECT_EQ(workers_.slowMakeRuns.load(), 0);
}

// G1-G3 under load: thousands of forks and deletions from every worker at
// once, with the RRef layer's messages delivered in random order.
class RRefStorm : public RRefProtocol,
                  public ::testing::WithParamInterface<bool> {};

TEST_P(RRefStorm, ThousandsOfConcurrentForksAndDeletionsLeaveNothing) {
  const bool reorder = GetParam();
  constexpr int kWorkers = 4;
  constexpr int kThreadsPerWorker = 2;
  constexpr int kIterations = 150;
  start(kWorkers);
  if (reorder) {
    auto rng = std::make_shared<std::mt19937>(7);
    auto mutex = std::make_shared<std::mutex>();
    delayRRefMessages([rng, mutex](const rpc::MessageSummary&) {
      std::lock_guard<std::mutex> guard(*mutex);
      return std::chrono::milliseconds((*rng)() % 8);
    });
  }
  std::atomic<int> failures{0};
  std::atomic<int> forks{0};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorkers; ++rank) {
    for (int t = 0; t < kThreadsPerWorker; ++t) {
      threads.emplace_back([&, rank, t]() {
        std::mt19937 rng(1000 * rank + t);
        auto pick = [&](int n) { return static_cast<int64_t>(rng() % n); };
        std::vector<std::pair<RRef<at::Tensor>, double>> mine;
        for (int i = 0; i < kIterations; ++i) {
          double value = rank * 10000 + t * 1000 + i;
          int64_t owner = pick(kWorkers);
          auto r = owner == rank && pick(2) == 0
              ? RRef<at::Tensor>::local(rt(rank), at::full({1}, value))
              : rref::remote<at::Tensor>(rt(rank), owner, "make", 1, value);
          try {
            switch (pick(4)) {
              case 0: { // hand it along a random path
                std::vector<int64_t> path{pick(kWorkers), pick(kWorkers)};
                forks += 3;
                if (rt(rank)
                        .rpcSync<double>(pick(kWorkers), "relay", r, path) !=
                    value) {
                  ++failures;
                }
                break;
              }
              case 1: // leave it with someone
                ++forks;
                rt(rank).rpcSync<int64_t>(pick(kWorkers), "hold", r);
                break;
              case 2: // keep it a while
                mine.emplace_back(r, value);
                break;
              default:
                if (r.toHere().item<double>() != value) {
                  ++failures;
                }
            }
            if (mine.size() > 8) {
              auto& [kept, expected] = mine[pick(mine.size())];
              if (kept.toHere().item<double>() != expected) {
                ++failures;
              }
              ++forks;
              rt(rank).rpcSync<int64_t>(pick(kWorkers), "hold", kept);
              mine.clear();
            }
            if (pick(16) == 0) {
              rt(rank).rpcSync<void>(pick(kWorkers), "drop_all");
            }
          } catch (const std::exception& e) {
            ADD_FAILURE() << "worker" << rank << " iteration " << i << ": "
                          << e.what();
            ++failures;
          }
        }
      });
    }
  }
  for (auto& thread : threads) {
    thread.join();
  }
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(forks.load(), 1000);
  for (int rank = 0; rank < kWorkers; ++rank) {
    rt(0).rpcSync<void>(rank, "drop_all");
  }
  EXPECT_TRUE(cluster_->waitForEmptyTables(30s));
}

INSTANTIATE_TEST_SUITE_P(
    Delivery,
    RRefStorm,
    ::testing::Values(false, true),
    [](const ::testing::TestParamInfo<bool>& info) {
      return info.param ? std::string("Reordered") : std::string("InOrder");
    });

// Bytes from a peer never crash a worker: every rref/ message kind with
// random bodies is answered (with an error) and the worker goes on serving.
TEST_F(RRefProtocol, MalformedMessagesAreRefused) {
  start(2);
  std::mt19937 rng(11);
  int answered = 0;
  for (uint32_t kind = rref::kRemoteKind; kind <= rref::kDeleteForkKind;
       ++kind) {
    for (int i = 0; i < 200; ++i) {
      rpc::OutgoingRequest request;
      request.kind = kind;
      request.body.resize(rng() % 24);
      for (auto& byte : request.body) {
        byte = static_cast<char>(rng());
      }
      request.what = "fuzz";
      // A body that parses by chance may name an RRef that never comes;
      // such a fetch waits for it until the deadline.
      request.timeout = 50ms;
      auto reply = rt(0).agent().send("worker1", std::move(request));
      reply->wait();
      ++answered;
    }
  }
  EXPECT_EQ(answered, 6 * 200);
  // Well-formed but lying: a fork notify claiming the owner as parent.
  rpc::OutgoingRequest lying;
  lying.kind = rref::kForkNotifyKind;
  lying.timeout = 5s;
  lying.what = "lie";
  {
    // Built by hand: rref 0:1, fork 1:1, parent 1 (the owner itself).
    const char bytes[] = {
        0x0a,
        0x04,
        0x08,
        0x00,
        0x10,
        0x01, // rref {worker: 0, local: 1}
        0x12,
        0x04,
        0x08,
        0x01,
        0x10,
        0x01, // fork {worker: 1, local: 1}
        0x18,
        0x01}; // parent: 1
    lying.body.assign(bytes, sizeof(bytes));
  }
  expectRpcError(
      [&]() {
        rt(0).agent().send("worker1", std::move(lying))->waitAndThrow();
      },
      ErrorCode::kMalformedMessage,
      {"cannot come from"});
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "make", 1, 2.0);
  EXPECT_TRUE(at::equal(r.toHere(), at::full({1}, 2.0)));
}

} // namespace
} // namespace testing
} // namespace torchrpc
