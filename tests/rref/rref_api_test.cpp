// Tier 2: every RRef API call, over each transport, several workers in one
// process.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/custom_class.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "tests/support/eventually.h"
#include "tests/support/rref_cluster.h"

namespace torchrpc {
namespace testing {
namespace {

using namespace std::chrono_literals;
using rpc::ErrorCode;
using rref::RRef;

// A custom class held by reference on its owner; counts live instances so
// tests can see the owner free it.
struct Counter : torch::CustomClassHolder {
  static std::atomic<int> alive;
  int64_t total = 0;
  Counter() {
    ++alive;
  }
  ~Counter() override {
    --alive;
  }
};
std::atomic<int> Counter::alive{0};

const auto kCounterClass =
    torch::class_<Counter>("torchrpc_test", "Counter").def(torch::init<>());

at::Tensor scale(at::Tensor x, double factor) {
  return x * factor;
}

void registerFunctions(int rank, rpc::Runtime& rt) {
  rt.functions().add("scale", &scale);
  rt.functions().add("zeros", [](int64_t n) { return at::zeros({n}); });
  rt.functions().add("to_sparse", [](at::Tensor x) { return x.to_sparse(); });
  rt.functions().add("boom", []() -> at::Tensor {
    throw std::runtime_error("boom from the owner");
  });
  rt.functions().add("slow_scale", [](at::Tensor x, double factor) {
    std::this_thread::sleep_for(300ms);
    return x * factor;
  });
  // Mutates the owner's value in place (the proxy passes the value itself).
  rt.functions().add("add_inplace", [](at::Tensor value, at::Tensor delta) {
    value.add_(delta);
  });
  rt.functions().add("sum_rref", [](RRef<at::Tensor> r) {
    return r.toHere().sum().item<double>();
  });
  rt.functions().add("is_owner_of", [](RRef<at::Tensor> r) {
    return r.isOwner() && r.localValue().sum().item<double>() > 0;
  });
  rt.functions().add("make_local", [&rt](at::Tensor x) {
    return RRef<at::Tensor>::local(rt, x * 10);
  });
  // Sums every RRef[Tensor] in a list, tuple or dict.
  rt.functions().add("sum_nested", [](c10::IValue nested) {
    double total = 0;
    forEachRRefIn(nested, [&](const c10::IValue& v) {
      total += RRef<at::Tensor>::fromIValue(v).toHere().sum().item<double>();
    });
    return total;
  });
  rt.functions().add("new_counter", []() {
    return c10::make_intrusive<Counter>();
  });
  rt.functions().add(
      "counter_add",
      [](c10::intrusive_ptr<Counter> counter, int64_t n) {
        counter->total += n;
        return counter->total;
      });
}

class RRefApi : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<RRefCluster>(GetParam(), 3, &registerFunctions);
  }
  void TearDown() override {
    if (cluster_) {
      EXPECT_TRUE(cluster_->shutdownAll());
    }
  }
  rpc::Runtime& rt(int rank) {
    return (*cluster_)[rank];
  }

  std::unique_ptr<RRefCluster> cluster_;
};

TEST_P(RRefApi, RemoteThenToHereReturnsTheOwnersResult) {
  auto r =
      rref::remote<at::Tensor>(rt(0), "worker1", "scale", at::ones({4}), 2.0);
  EXPECT_FALSE(r.isOwner());
  EXPECT_EQ(r.owner().name, "worker1");
  EXPECT_EQ(r.owner().id, 1);
  EXPECT_EQ(r.ownerName(), "worker1");
  EXPECT_TRUE(at::equal(r.toHere(), at::full({4}, 2.0)));
  EXPECT_TRUE(at::equal(r.toHereAsync().wait(), at::full({4}, 2.0)));
  // toHere() answered after the value existed, and kRemote is answered once
  // it exists, so confirmation follows within the same exchange.
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!r.confirmedByOwner() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(r.confirmedByOwner());
  EXPECT_EQ(cluster_->context(1).counters().ownerRRefs, 1u);
  EXPECT_EQ(cluster_->context(0).counters().userRRefs, 1u);
  r = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

TEST_P(RRefApi, SparseTensorsAreValuesArgumentsAndResults) {
  auto dense = at::tensor({0.0f, 2.0f, 3.0f, 0.0f}).reshape({2, 2});
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "to_sparse", dense);
  auto here = r.toHere();
  ASSERT_TRUE(here.is_sparse());
  EXPECT_TRUE(at::equal(here.to_dense(), dense));
  auto scaled =
      rt(0).rpcSync<at::Tensor>("worker1", "scale", dense.to_sparse(), 2.0);
  ASSERT_TRUE(scaled.is_sparse());
  EXPECT_TRUE(at::equal(scaled.to_dense(), dense * 2));
  r = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

TEST_P(RRefApi, ConfirmedAsyncCompletesOnceTheOwnerHasTheValue) {
  auto r = rref::remote<at::Tensor>(
      rt(0),
      "worker1",
      "slow_scale",
      at::ones({1}),
      2.0);
  EXPECT_FALSE(r.confirmedByOwner());
  r.confirmedAsync().wait();
  EXPECT_TRUE(r.confirmedByOwner());
  // A fork that came from the owner is confirmed on arrival.
  auto made =
      rt(0).rpcSync<RRef<at::Tensor>>("worker2", "make_local", at::ones({1}));
  EXPECT_TRUE(made.confirmedByOwner());
  made.confirmedAsync().wait();
  auto failed = rref::remote<at::Tensor>(rt(0), "worker1", "boom");
  expectRpcError(
      [&]() { failed.confirmedAsync().wait(); },
      ErrorCode::kRemoteException,
      {"boom from the owner"});
  EXPECT_FALSE(failed.confirmedByOwner());
}

TEST_P(RRefApi, DeletionsToOneOwnerTravelTogether) {
  std::vector<RRef<at::Tensor>> many;
  for (int i = 0; i < 64; ++i) {
    many.push_back(rref::remote<at::Tensor>(rt(0), "worker1", "zeros", 1));
  }
  for (auto& r : many) {
    r.confirmedAsync().wait();
  }
  auto before = rt(0).agent().counters().requestsSent;
  many.clear();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
  auto deletions = rt(0).agent().counters().requestsSent - before;
  EXPECT_GE(deletions, 1u);
  // One deletion is in flight per owner and the rest wait to go together
  // when it is answered; how many go per message depends on how fast the
  // owner answers while the loop above drops the others (usually a handful
  // of messages; 47 once with two test binaries sharing two cores). Without
  // batching it would be 64.
  EXPECT_LT(deletions, 64u) << "64 deletions took " << deletions << " messages";
}

TEST_P(RRefApi, RemoteRunsBuiltinOperators) {
  auto r = rref::remote<at::Tensor>(
      rt(0),
      2,
      "aten::add.Tensor",
      at::ones({3}),
      at::full({3}, 4.0));
  EXPECT_TRUE(at::equal(r.toHere(), at::full({3}, 5.0)));
}

TEST_P(RRefApi, RemoteToSelfGivesAnOwnerRRef) {
  auto r =
      rref::remote<at::Tensor>(rt(0), "worker0", "scale", at::ones({2}), 3.0);
  EXPECT_TRUE(r.isOwner());
  EXPECT_TRUE(r.confirmedByOwner());
  EXPECT_TRUE(at::equal(r.localValue(), at::full({2}, 3.0)));
  EXPECT_TRUE(at::equal(r.toHere(), at::full({2}, 3.0)));
}

TEST_P(RRefApi, ToHereOnTheOwnerIsACopy) {
  auto r = RRef<at::Tensor>::local(rt(1), at::ones({3}));
  at::Tensor copy = r.toHere();
  copy.add_(1);
  EXPECT_TRUE(at::equal(r.localValue(), at::ones({3})));
  at::Tensor value = r.localValue();
  value.add_(1); // the value itself
  EXPECT_TRUE(at::equal(r.localValue(), at::full({3}, 2.0)));
}

TEST_P(RRefApi, LocalValueOnAUserIsAClearError) {
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "zeros", 2);
  try {
    r.localValue();
    ADD_FAILURE() << "localValue() on a user did not throw";
  } catch (const c10::Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("owned by 'worker1'"), std::string::npos) << what;
    EXPECT_NE(what.find("toHere()"), std::string::npos) << what;
  }
}

TEST_P(RRefApi, ProxyCallsReachTheValueItself) {
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "zeros", 3);
  r.rpcSync<void>("add_inplace", at::ones({3}));
  r.rpcAsync<void>("add_inplace", at::full({3}, 2.0)).wait();
  EXPECT_TRUE(at::equal(r.toHere(), at::full({3}, 3.0)));
  // The same through an owner RRef, with no message at all.
  auto local = RRef<at::Tensor>::local(rt(2), at::zeros({2}));
  local.rpcSync<void>("add_inplace", at::ones({2}));
  EXPECT_TRUE(at::equal(local.localValue(), at::ones({2})));
}

TEST_P(RRefApi, ProxyRemoteCreatesAnRRefOnTheSameOwner) {
  auto r =
      rref::remote<at::Tensor>(rt(0), "worker2", "scale", at::ones({2}), 2.0);
  auto r2 = r.remote<at::Tensor>("scale", 5.0);
  EXPECT_EQ(r2.owner().id, 2);
  EXPECT_TRUE(at::equal(r2.toHere(), at::full({2}, 10.0)));
  // From the owner itself.
  auto local = RRef<at::Tensor>::local(rt(1), at::ones({1}));
  auto local2 = local.remote<at::Tensor>("scale", 7.0);
  EXPECT_TRUE(local2.isOwner());
  EXPECT_TRUE(at::equal(local2.localValue(), at::full({1}, 7.0)));
  r = RRef<at::Tensor>();
  r2 = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

TEST_P(RRefApi, RRefsAreArgumentsAndResults) {
  auto r =
      rref::remote<at::Tensor>(rt(0), "worker1", "scale", at::ones({4}), 2.0);
  // user -> user: worker2 fetches from worker1.
  EXPECT_EQ(rt(0).rpcSync<double>("worker2", "sum_rref", r), 8.0);
  // user -> owner: worker1 gets its own value back.
  EXPECT_TRUE(rt(0).rpcSync<bool>("worker1", "is_owner_of", r));
  // owner -> user: an RRef as a result.
  auto made =
      rt(0).rpcSync<RRef<at::Tensor>>("worker2", "make_local", at::ones({2}));
  EXPECT_EQ(made.owner().id, 2);
  EXPECT_FALSE(made.isOwner());
  EXPECT_TRUE(at::equal(made.toHere(), at::full({2}, 10.0)));
  r = RRef<at::Tensor>();
  made = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

TEST_P(RRefApi, RRefsTravelInsideListsTuplesAndDicts) {
  auto a =
      rref::remote<at::Tensor>(rt(0), "worker1", "scale", at::ones({2}), 1.0);
  auto b =
      rref::remote<at::Tensor>(rt(0), "worker2", "scale", at::ones({2}), 2.0);
  {
    auto rrefType = c10::RRefType::create(c10::TensorType::get());
    c10::impl::GenericList list(rrefType);
    list.push_back(a.toIValue());
    list.push_back(b.toIValue());
    EXPECT_EQ(
        rt(0).rpcSync<double>("worker1", "sum_nested", c10::IValue(list)),
        6.0);
    auto tuple = c10::ivalue::Tuple::create(
        {a.toIValue(), c10::IValue(5), b.toIValue()});
    EXPECT_EQ(
        rt(0).rpcSync<double>("worker2", "sum_nested", c10::IValue(tuple)),
        6.0);
    c10::impl::GenericDict dict(c10::StringType::get(), rrefType);
    dict.insert("a", a.toIValue());
    dict.insert("b", b.toIValue());
    EXPECT_EQ(
        rt(0).rpcSync<double>("worker0", "sum_nested", c10::IValue(dict)),
        6.0);
  } // the containers hold references too
  a = RRef<at::Tensor>();
  b = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

// G4.
TEST_P(RRefApi, AFailedRemoteFailsEveryUseWithTheOriginalError) {
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "boom");
  expectRpcError(
      [&]() { r.toHere(); },
      ErrorCode::kRemoteException,
      {"worker1", "boom", "boom from the owner"});
  expectRpcError(
      [&]() { r.rpcSync<void>("add_inplace", at::ones({1})); },
      ErrorCode::kRemoteException,
      {"worker1", "boom from the owner"});
  // Sending it fails that call.
  expectRpcError(
      [&]() { rt(0).rpcSync<double>("worker2", "sum_rref", r); },
      ErrorCode::kBadArguments,
      {"creating it failed", "boom from the owner"});
  // A holder that got it before the failure gets the owner's record of it.
  auto slowBoom = rref::remote<at::Tensor>(rt(0), "worker1", "scale", "x", 1.0);
  expectRpcError(
      [&]() { slowBoom.toHere(); },
      ErrorCode::kBadArguments,
      {"worker1", "scale"});
  r = RRef<at::Tensor>();
  slowBoom = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

// G4.
TEST_P(RRefApi, ARemoteThatTimesOutFailsWithTimeout) {
  auto r = rref::remoteWithTimeout<at::Tensor>(
      rt(0),
      50ms,
      "worker1",
      "slow_scale",
      at::ones({1}),
      2.0);
  expectRpcError(
      [&]() { r.toHere(); },
      ErrorCode::kTimeout,
      {"worker1", "slow_scale"});
  r = RRef<at::Tensor>();
  // The owner finishes the value, then frees it once the fork is gone.
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

TEST_P(RRefApi, UnknownWorkerAndFunctionFailAtFirstUse) {
  auto nowhere =
      rref::remote<at::Tensor>(rt(0), "worker9", "scale", at::ones({1}), 1.0);
  expectRpcError(
      [&]() { nowhere.toHere(); },
      ErrorCode::kWorkerUnavailable,
      {"worker9", "no such worker"});
  auto missing = rref::remote<at::Tensor>(rt(0), "worker1", "no_such_function");
  expectRpcError(
      [&]() { missing.toHere(); },
      ErrorCode::kUnknownFunction,
      {"worker1", "no_such_function"});
  nowhere = RRef<at::Tensor>();
  missing = RRef<at::Tensor>();
  EXPECT_TRUE(cluster_->waitForEmptyTables());
}

TEST_P(RRefApi, TypesAreChecked) {
  auto r = rref::remote<at::Tensor>(rt(0), "worker1", "zeros", 2);
  EXPECT_THROW(RRef<int64_t>::fromIValue(r.toIValue()), c10::Error);
  EXPECT_THROW(RRef<at::Tensor>::fromIValue(c10::IValue(3)), c10::Error);
  auto same = RRef<at::Tensor>::fromIValue(r.toIValue());
  EXPECT_TRUE(at::equal(same.toHere(), at::zeros({2})));
  // The owner's value is not what the RRef's type promised.
  auto wrong = rref::remote<std::string>(rt(0), "worker1", "zeros", 2);
  expectRpcError(
      [&]() { wrong.toHere(); },
      ErrorCode::kBadArguments,
      {"Tensor", "str"});
}

// G2: the value itself is freed.
TEST_P(RRefApi, CustomClassesLiveOnTheOwner) {
  int before = Counter::alive.load();
  {
    auto counter = rref::remote<c10::intrusive_ptr<Counter>>(
        rt(0),
        "worker1",
        "new_counter");
    EXPECT_EQ(counter.rpcSync<int64_t>("counter_add", 5), 5);
    EXPECT_EQ(counter.rpcSync<int64_t>("counter_add", 3), 8);
    EXPECT_EQ(Counter::alive.load(), before + 1);
    // An object cannot be copied over the wire.
    expectRpcError(
        [&]() { counter.toHere(); },
        ErrorCode::kBadArguments,
        {"worker1"});
  }
  // The owner frees the object once the last reference is gone. The table
  // empties first; a handler that used the value may still hold it for a
  // moment after its reply went out (seen under TSan), so wait for that too.
  EXPECT_TRUE(cluster_->waitForEmptyTables());
  EXPECT_TRUE(testing::eventually([&]() {
    return Counter::alive.load() == before;
  })) << Counter::alive.load()
      << " alive, " << before << " before";
}

// G5.
TEST_P(RRefApi, GracefulShutdownReleasesEveryRRef) {
  // Held on every worker, forked, when shutdown starts.
  auto r =
      rref::remote<at::Tensor>(rt(0), "worker1", "scale", at::ones({2}), 2.0);
  auto onTwo =
      rt(0).rpcSync<RRef<at::Tensor>>("worker2", "make_local", at::ones({1}));
  EXPECT_EQ(rt(0).rpcSync<double>("worker2", "sum_rref", r), 4.0);
  EXPECT_TRUE(cluster_->shutdownAll());
  for (int rank = 0; rank < 3; ++rank) {
    auto left = cluster_->context(rank).leftAtClose();
    EXPECT_TRUE(allZero(left))
        << "worker" << rank << ": " << describeCounters(left);
    EXPECT_TRUE(allZero(cluster_->context(rank).counters()));
  }
  expectRpcError([&]() { r.toHere(); }, ErrorCode::kShuttingDown, {"worker0"});
  cluster_.reset();
}

// G5 with a creation still in flight when every worker shuts down.
TEST_P(RRefApi, GracefulShutdownWaitsForACreationInFlight) {
  auto slow = rref::remote<at::Tensor>(
      rt(0),
      "worker1",
      "slow_scale",
      at::ones({1}),
      2.0);
  EXPECT_TRUE(cluster_->shutdownAll());
  for (int rank = 0; rank < 3; ++rank) {
    auto left = cluster_->context(rank).leftAtClose();
    EXPECT_TRUE(allZero(left))
        << "worker" << rank << ": " << describeCounters(left);
  }
  EXPECT_TRUE(slow.confirmedByOwner());
  cluster_.reset();
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    RRefApi,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTcp,
        rpc::TransportKind::kTensorPipe),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
