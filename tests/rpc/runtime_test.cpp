// Several workers in one process, over each transport (tier 2).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using rpc::ErrorCode;
using testing::expectNoBacktrace;
using testing::expectRpcError;
using testing::expectRpcErrorFrom;
using testing::LocalCluster;

at::Tensor scale(at::Tensor x, double factor) {
  return x * factor;
}

void registerCommon(int /*rank*/, rpc::Runtime& rt) {
  rt.functions().add("scale", &scale);
  rt.functions().add("echo", [](c10::IValue v) { return v; });
  rt.functions().add("add", [](int64_t a, int64_t b) { return a + b; });
  rt.functions().add("name", [&rt]() { return rt.self().name; });
  rt.functions().add("fail", [](std::string why) -> int64_t {
    throw std::runtime_error("failing on purpose: " + why);
  });
  rt.functions().add("check", [](int64_t value) -> int64_t {
    TORCH_CHECK(value > 0, "check failed on purpose: ", value, " <= 0");
    return value;
  });
  rt.functions().add("sleep_ms", [](int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return ms;
  });
  rt.functions().add("nothing", []() {});
}

class RuntimeTest : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  std::unique_ptr<LocalCluster> cluster(
      int size,
      std::function<void(int, rpc::Options&)> configure = nullptr,
      std::function<void(int, rpc::Runtime&)> setup = nullptr) {
    return std::make_unique<LocalCluster>(
        GetParam(),
        size,
        std::move(configure),
        [setup](int rank, rpc::Runtime& rt) {
          registerCommon(rank, rt);
          if (setup) {
            setup(rank, rt);
          }
        });
  }
};

TEST_P(RuntimeTest, CallsARegisteredFunctionAndGetsItsResult) {
  auto c = cluster(2);
  auto x = at::arange(6, at::kFloat).reshape({2, 3});
  auto y = (*c)[0].rpcSync<at::Tensor>("worker1", "scale", x, 2.5);
  EXPECT_TRUE(at::equal(y, x * 2.5));
  EXPECT_EQ((*c)[1].rpcSync<int64_t>("worker0", "add", 40, 2), 42);
  EXPECT_EQ((*c)[0].rpcSync<std::string>("worker1", "name"), "worker1");
  (*c)[0].rpcSync<void>("worker1", "nothing");
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, AddressesWorkersByNameIdOrInfo) {
  auto c = cluster(3);
  auto& rt = (*c)[0];
  EXPECT_EQ(rt.rpcSync<std::string>("worker2", "name"), "worker2");
  EXPECT_EQ(rt.rpcSync<std::string>(2, "name"), "worker2");
  EXPECT_EQ(rt.rpcSync<std::string>(rt.worker("worker1"), "name"), "worker1");
  EXPECT_EQ(rt.workers().size(), 3u);
  EXPECT_EQ(rt.worker(1).name, "worker1");
  EXPECT_EQ(rt.worker("worker2").id, 2);
  // A worker may call itself.
  EXPECT_EQ(rt.rpcSync<std::string>("worker0", "name"), "worker0");
  EXPECT_THROW(rt.worker("nobody"), c10::Error);
  expectRpcError(
      [&]() { rt.rpcSync<std::string>("nobody", "name"); },
      ErrorCode::kWorkerUnavailable,
      {"nobody", "no such worker"});
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, ValuesOfEveryKindRoundTripExactly) {
  auto c = cluster(2);
  auto& rt = (*c)[0];
  auto echo = [&](const c10::IValue& v) {
    return rt.rpcSync<c10::IValue>("worker1", "echo", v);
  };
  EXPECT_TRUE(echo(c10::IValue()).isNone());
  EXPECT_EQ(echo(true).toBool(), true);
  EXPECT_EQ(echo(int64_t(-7)).toInt(), -7);
  EXPECT_EQ(echo(0.1).toDouble(), 0.1);
  EXPECT_EQ(echo(std::string("h\0i", 3)).toStringRef(), std::string("h\0i", 3));

  c10::List<int64_t> ints({1, 2, 3});
  auto intsBack = echo(ints);
  EXPECT_EQ(*intsBack.type(), *c10::ListType::ofInts());
  EXPECT_EQ(intsBack.toIntVector(), std::vector<int64_t>({1, 2, 3}));
  auto emptyBack = echo(c10::List<double>());
  EXPECT_EQ(*emptyBack.type(), *c10::ListType::ofFloats());

  c10::Dict<std::string, at::Tensor> byName;
  byName.insert("a", at::ones({2}));
  byName.insert("b", at::zeros({3}, at::kLong));
  auto dictBack = echo(byName).toGenericDict();
  EXPECT_EQ(dictBack.size(), 2u);
  EXPECT_TRUE(at::equal(dictBack.at("a").toTensor(), at::ones({2})));
  EXPECT_TRUE(
      at::equal(dictBack.at("b").toTensor(), at::zeros({3}, at::kLong)));

  c10::Dict<int64_t, std::string> byId;
  byId.insert(3, "three");
  EXPECT_EQ(echo(byId).toGenericDict().at(3).toStringRef(), "three");

  auto tuple = c10::ivalue::Tuple::create(
      {c10::IValue(int64_t(1)), c10::IValue("x"), c10::IValue(at::ones({1}))});
  auto tupleBack = echo(tuple).toTuple();
  EXPECT_EQ(tupleBack->elements().size(), 3u);
  EXPECT_EQ(tupleBack->elements()[1].toStringRef(), "x");

  // Nested: a list of dicts of tuples.
  c10::impl::GenericList nested(c10::AnyType::get());
  nested.push_back(c10::IValue(byId));
  nested.push_back(tuple);
  auto nestedBack = echo(nested).toList();
  EXPECT_EQ(nestedBack.size(), 2u);
  EXPECT_EQ(nestedBack.get(0).toGenericDict().at(3).toStringRef(), "three");

  // Deep nesting, near the codec's cap, survives the envelope parser too.
  c10::IValue deep(int64_t(7));
  for (int level = 0; level < 60; ++level) {
    c10::impl::GenericList wrapper(c10::AnyType::get());
    wrapper.push_back(deep);
    deep = wrapper;
  }
  auto deepBack = echo(deep);
  for (int level = 0; level < 60; ++level) {
    ASSERT_TRUE(deepBack.isList()) << "level " << level;
    deepBack = deepBack.toList().get(0);
  }
  EXPECT_EQ(deepBack.toInt(), 7);

  // Tensors: dtypes, views, non-contiguous, empty, requires_grad.
  for (auto dtype :
       {at::kFloat,
        at::kDouble,
        at::kInt,
        at::kLong,
        at::kBool,
        at::kByte,
        at::kHalf,
        at::kBFloat16,
        at::kComplexFloat}) {
    auto t = at::arange(12, at::kDouble).reshape({3, 4}).to(dtype);
    auto back = echo(t).toTensor();
    EXPECT_EQ(back.dtype(), t.dtype());
    EXPECT_TRUE(at::equal(back, t)) << dtype;
  }
  auto base = at::arange(100, at::kFloat);
  auto view = base.narrow(0, 10, 5);
  EXPECT_TRUE(at::equal(echo(view).toTensor(), view));
  auto transposed = at::arange(12, at::kFloat).reshape({3, 4}).t();
  EXPECT_TRUE(at::equal(echo(transposed).toTensor(), transposed));
  auto empty = at::empty({0, 4}, at::kFloat);
  auto emptyTensorBack = echo(empty).toTensor();
  EXPECT_EQ(emptyTensorBack.sizes(), empty.sizes());
  auto leaf = at::ones({2}).set_requires_grad(true);
  EXPECT_TRUE(echo(leaf).toTensor().requires_grad());
  // The receiver's copy is its own: changing it does not touch ours.
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, TypedArgumentsAcceptContainersAndPromotions) {
  auto c = cluster(2, nullptr, [](int, rpc::Runtime& rt) {
    rt.functions().add("sum_list", [](std::vector<int64_t> xs) {
      int64_t s = 0;
      for (auto x : xs) {
        s += x;
      }
      return s;
    });
    rt.functions().add("maybe", [](c10::optional<int64_t> x) {
      return x.value_or(-1);
    });
    rt.functions().add("half", [](float x) { return x / 2; });
  });
  auto& rt = (*c)[0];
  EXPECT_EQ(
      rt.rpcSync<int64_t>("worker1", "sum_list", std::vector<int64_t>{1, 2, 3}),
      6);
  EXPECT_EQ(rt.rpcSync<int64_t>("worker1", "maybe", c10::IValue()), -1);
  EXPECT_EQ(rt.rpcSync<int64_t>("worker1", "maybe", 5), 5);
  EXPECT_EQ(rt.rpcSync<double>("worker1", "half", 3), 1.5);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, UnknownFunctionIsATypedErrorNamingWorkerAndFunction) {
  auto c = cluster(2);
  expectRpcError(
      [&]() { (*c)[0].rpcSync<int64_t>("worker1", "no_such_fn", 1); },
      ErrorCode::kUnknownFunction,
      {"worker1", "no_such_fn"});
  expectRpcError(
      [&]() { (*c)[0].rpcSync<int64_t>("worker1", "aten::no_such_op", 1); },
      ErrorCode::kUnknownFunction,
      {"worker1", "aten::no_such_op"});
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, WrongArgumentsAreATypedErrorNamingTheArgument) {
  auto c = cluster(2);
  auto& rt = (*c)[0];
  expectRpcError(
      [&]() { rt.rpcSync<at::Tensor>("worker1", "scale", at::ones({1}), "x"); },
      ErrorCode::kBadArguments,
      {"worker1", "scale", "argument 2", "str", "float"});
  expectRpcError(
      [&]() { rt.rpcSync<at::Tensor>("worker1", "scale", at::ones({1})); },
      ErrorCode::kBadArguments,
      {"scale", "expects 2 argument(s)", "got 1"});
  // The result does not have the type the caller asked for.
  expectRpcError(
      [&]() { rt.rpcSync<std::string>("worker1", "add", 1, 2); },
      ErrorCode::kBadArguments,
      {"worker1", "add", "int", "str"});
  // The worker keeps serving.
  EXPECT_EQ(rt.rpcSync<int64_t>("worker1", "add", 1, 2), 3);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, RemoteExceptionCarriesItsTextWorkerAndFunction) {
  auto c = cluster(2);
  auto future = (*c)[0].rpcAsync<int64_t>("worker1", "fail", "because");
  expectRpcError(
      [&]() { future.wait(); },
      ErrorCode::kRemoteException,
      {"worker1", "fail", "failing on purpose: because"});
  EXPECT_TRUE(future.hasError());
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, RemoteC10ErrorCarriesItsMessageWithoutABacktrace) {
  auto c = cluster(2);
  auto future = (*c)[0].rpcAsync<int64_t>("worker1", "check", -3);
  std::string text;
  expectRpcErrorFrom(
      [&]() {
        try {
          future.wait();
        } catch (const std::exception& e) {
          text = e.what();
          throw;
        }
      },
      ErrorCode::kRemoteException,
      "worker1",
      {"worker1", "check", "check failed on purpose: -3 <= 0"});
  expectNoBacktrace(text);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, PerCallTimeoutFailsTheCallAndTheWorkerKeepsServing) {
  auto c = cluster(2);
  auto& rt = (*c)[0];
  auto start = std::chrono::steady_clock::now();
  expectRpcError(
      [&]() {
        rt.withTimeout(100ms).rpcSync<int64_t>("worker1", "sleep_ms", 1500);
      },
      ErrorCode::kTimeout,
      {"worker1", "sleep_ms"});
  auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_LT(waited, 1400ms) << "the timeout did not fire before the reply";
  EXPECT_EQ(rt.withTimeout(5s).rpcSync<int64_t>("worker1", "sleep_ms", 1), 1);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, DefaultTimeoutComesFromOptions) {
  auto c = cluster(2, [](int, rpc::Options& o) { o.defaultTimeout = 100ms; });
  expectRpcError(
      [&]() { (*c)[0].rpcSync<int64_t>("worker1", "sleep_ms", 1500); },
      ErrorCode::kTimeout,
      {"sleep_ms"});
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, BuiltinOperatorsAreCallableBySchemaName) {
  auto c = cluster(2);
  auto& rt = (*c)[0];
  auto a = at::arange(4, at::kFloat);
  auto b = at::full({4}, 2.0);
  EXPECT_TRUE(at::equal(
      rt.rpcSync<at::Tensor>("worker1", "aten::add.Tensor", a, b),
      a + b));
  // A default argument (alpha) filled from the schema; explicit alpha.
  EXPECT_TRUE(at::equal(
      rt.rpcSync<at::Tensor>("worker1", "aten::add.Tensor", a, b, 3),
      a + 3 * b));
  auto m = at::arange(6, at::kFloat).reshape({2, 3});
  auto n = at::arange(6, at::kFloat).reshape({3, 2});
  EXPECT_TRUE(at::equal(
      rt.rpcSync<at::Tensor>("worker1", "aten::matmul", m, n),
      at::matmul(m, n)));
  // Overload chosen by the arguments.
  EXPECT_TRUE(
      at::equal(rt.rpcSync<at::Tensor>("worker1", "aten::mul", a, b), a * b));
  expectRpcError(
      [&]() { rt.rpcSync<at::Tensor>("worker1", "aten::add.Tensor", a, "x"); },
      ErrorCode::kBadArguments,
      {"aten::add.Tensor"});
  // An operator that throws is a remote exception.
  expectRpcError(
      [&]() {
        rt.rpcSync<at::Tensor>(
            "worker1",
            "aten::matmul",
            at::ones({2, 3}),
            at::ones({2, 3}));
      },
      ErrorCode::kRemoteException,
      {"aten::matmul"});
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, BuiltinOperatorsCanBeDisabled) {
  auto c =
      cluster(2, [](int, rpc::Options& o) { o.allowBuiltinOperators = false; });
  expectRpcError(
      [&]() {
        (*c)[0].rpcSync<at::Tensor>(
            "worker1",
            "aten::add.Tensor",
            at::ones({1}),
            at::ones({1}));
      },
      ErrorCode::kUnknownFunction,
      {"disabled"});
  EXPECT_TRUE(c->shutdownAll());
}

// Every worker has one server thread. worker0 calls worker1's "relay",
// which calls worker0's "scale" and returns that future instead of waiting:
// with a parked thread this would deadlock (worker1's only thread waits for
// worker0, whose only thread... serves fine; so make it a ping-pong of depth
// 4 through both workers).
TEST_P(RuntimeTest, NestedCallsWithOneThreadDoNotDeadlock) {
  auto c = cluster(
      2,
      [](int, rpc::Options& o) { o.numWorkerThreads = 1; },
      [](int rank, rpc::Runtime& rt) {
        rt.functions().add(
            "bounce",
            [&rt,
             rank](at::Tensor x, int64_t depth) -> rpc::Future<at::Tensor> {
              if (depth == 0) {
                return rpc::makeReadyFuture(x + 1);
              }
              std::string peer = rank == 0 ? "worker1" : "worker0";
              return rt.rpcAsync<at::Tensor>(peer, "bounce", x, depth - 1)
                  .then([](at::Tensor y) { return y * 2; });
            });
      });
  auto y = (*c)[0].withTimeout(10s).rpcSync<at::Tensor>(
      "worker1",
      "bounce",
      at::ones({2}),
      4);
  // ((((1 + 1) * 2) * 2) * 2) * 2 = 32
  EXPECT_TRUE(at::equal(y, at::full({2}, 32.0)));
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, AsynchronousHandlerRepliesWhenItsFutureCompletes) {
  std::vector<std::thread> completers;
  auto c = cluster(2, nullptr, [&completers](int, rpc::Runtime& rt) {
    rt.functions().add("later", [&completers](int64_t v) {
      auto impl = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
      completers.emplace_back([impl, v]() {
        std::this_thread::sleep_for(50ms);
        impl->markCompleted(v * 10);
      });
      return impl;
    });
  });
  EXPECT_EQ((*c)[0].rpcSync<int64_t>("worker1", "later", 4), 40);
  for (auto& t : completers) {
    t.join();
  }
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, ManyConcurrentCallsFromSeveralThreadsAllComplete) {
  auto c = cluster(3);
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t]() {
      std::vector<rpc::Future<int64_t>> futures;
      for (int i = 0; i < 200; ++i) {
        futures.push_back((*c)[t % 3].rpcAsync<int64_t>(
            (t + i) % 3,
            "add",
            int64_t(i),
            int64_t(t)));
      }
      for (int i = 0; i < 200; ++i) {
        if (futures[i].wait() != i + t) {
          ++wrong;
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ((*c)[0].agent().counters().pendingCalls, 0u);
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, GracefulShutdownLetsInFlightCallsComplete) {
  auto c = cluster(2);
  auto slow = (*c)[0].rpcAsync<int64_t>("worker1", "sleep_ms", 300);
  EXPECT_TRUE(c->shutdownAll(/*graceful=*/true));
  EXPECT_EQ(slow.wait(), 300);
  expectRpcError(
      [&]() { (*c)[0].rpcSync<int64_t>("worker1", "add", 1, 2); },
      ErrorCode::kShuttingDown,
      {"shutting down"});
}

TEST_P(RuntimeTest, ImmediateShutdownFailsPendingCalls) {
  auto c = cluster(2);
  auto slow = (*c)[0].rpcAsync<int64_t>("worker1", "sleep_ms", 2000);
  std::this_thread::sleep_for(50ms);
  (*c)[0].shutdown(/*graceful=*/false);
  expectRpcError(
      [&]() { slow.wait(); },
      ErrorCode::kShuttingDown,
      {"worker1", "sleep_ms"});
  expectRpcError(
      [&]() { (*c)[0].rpcSync<int64_t>("worker1", "add", 1, 2); },
      ErrorCode::kShuttingDown,
      {});
}

// A call sent while the runtime closes either goes out before close() (and
// close() fails it) or sees the runtime closed; none is left pending where
// close() no longer looks, which would wait forever (the timers stop too).
TEST_P(RuntimeTest, CallsRacingAnImmediateShutdownAllEnd) {
  auto c = cluster(2);
  constexpr int kThreads = 3;
  // Each thread calls until it has made kCallsAfter calls after the
  // shutdown returned (at most kMaxCalls): some calls surely race it.
  constexpr int kMaxCalls = 5000;
  constexpr int kCallsAfter = 20;
  std::vector<std::vector<rpc::Future<int64_t>>> futures(kThreads);
  std::atomic<int> issued{0};
  std::atomic<bool> shutDownReturned{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t]() {
      int after = 0;
      for (int i = 0; i < kMaxCalls && after < kCallsAfter; ++i) {
        futures[t].push_back((*c)[0].rpcAsync<int64_t>("worker1", "add", i, t));
        issued.fetch_add(1);
        if (shutDownReturned.load()) {
          ++after;
        }
      }
    });
  }
  // Shut down once calls are both answered and still in flight.
  EXPECT_TRUE(testing::eventually([&] {
    auto counters = (*c)[0].agent().counters();
    return issued.load() >= 100 &&
        counters.requestsSent - counters.pendingCalls >= 10;
  }));
  (*c)[0].shutdown(/*graceful=*/false);
  shutDownReturned = true;
  for (auto& thread : threads) {
    thread.join();
  }
  int answered = 0;
  int shutDown = 0;
  for (int t = 0; t < kThreads; ++t) {
    for (size_t i = 0; i < futures[t].size(); ++i) {
      const auto& future = futures[t][i];
      ASSERT_TRUE(testing::eventually([&] { return future.completed(); }, 10s))
          << "call " << i << " of thread " << t << " never ended";
      if (!future.hasError()) {
        EXPECT_EQ(future.wait(), static_cast<int64_t>(i) + t);
        ++answered;
        continue;
      }
      ++shutDown;
      expectRpcError(
          [&]() { future.wait(); },
          ErrorCode::kShuttingDown,
          {"add"});
    }
  }
  EXPECT_GT(answered, 0);
  EXPECT_GE(shutDown, kThreads * kCallsAfter);
  EXPECT_EQ((*c)[0].agent().counters().pendingCalls, 0u);
}

TEST_P(RuntimeTest, PeerThatShutsDownFailsCallsToItWithoutHanging) {
  auto c = cluster(2);
  auto slow =
      (*c)[0].withTimeout(30s).rpcAsync<int64_t>("worker1", "sleep_ms", 1000);
  std::this_thread::sleep_for(50ms);
  (*c)[1].shutdown(/*graceful=*/false);
  try {
    slow.wait();
    // The peer may have finished the call before closing; that is fine.
  } catch (const rpc::RpcError& e) {
    EXPECT_TRUE(
        e.code() == ErrorCode::kWorkerUnavailable ||
        e.code() == ErrorCode::kShuttingDown)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos);
  }
  // New calls to the closed peer fail too, promptly.
  auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(
      (*c)[0].withTimeout(30s).rpcSync<int64_t>("worker1", "add", 1, 2),
      rpc::RpcError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST_P(RuntimeTest, MessagesOverTheCapFailWithTooLarge) {
  auto c = cluster(2, [](int, rpc::Options& o) { o.maxMessageBytes = 4096; });
  expectRpcError(
      [&]() {
        (*c)[0].rpcSync<c10::IValue>("worker1", "echo", at::ones({4096}));
      },
      ErrorCode::kTooLarge,
      {"worker1", "echo", "exceeds"});
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, ValuesThatCannotBeSentFailTheCallNotTheProcess) {
  auto c = cluster(2);
  auto unsendable = c10::IValue(
      c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get()));
  expectRpcError(
      [&]() { (*c)[0].rpcSync<c10::IValue>("worker1", "echo", unsendable); },
      ErrorCode::kBadArguments,
      {"worker1", "echo"});
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, CpuDeviceMapIsHonoured) {
  auto c = cluster(2, [](int rank, rpc::Options& o) {
    o.deviceMaps[rank == 0 ? "worker1" : "worker0"] = {
        {c10::Device("cpu"), c10::Device("cpu")}};
  });
  auto x = at::arange(3, at::kFloat);
  EXPECT_TRUE(
      at::equal((*c)[0].rpcSync<at::Tensor>("worker1", "scale", x, 2), x * 2));
  EXPECT_TRUE(c->shutdownAll());
}

TEST_P(RuntimeTest, StartsAgainInTheSameProcessAfterShutdown) {
  for (int round = 0; round < 2; ++round) {
    auto c = cluster(2);
    EXPECT_EQ((*c)[0].rpcSync<int64_t>("worker1", "add", round, 1), round + 1);
    EXPECT_TRUE(c->shutdownAll());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    RuntimeTest,
    ::testing::Values(
        rpc::TransportKind::kInProcess,
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    testing::transportParamName);

// ---- set-up errors, independent of the transport --------------------------

TEST(RuntimeSetup, InvalidWorkerNameIsRefused) {
  rpc::Options options;
  options.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  EXPECT_THROW(rpc::Runtime("has space", options), c10::Error);
  EXPECT_THROW(rpc::Runtime("", options), c10::Error);
}

TEST(RuntimeSetup, RankOutsideWorldIsRefused) {
  rpc::Options options;
  options.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  options.rank = 2;
  options.worldSize = 2;
  EXPECT_THROW(rpc::Runtime("w", options), c10::Error);
}

TEST(RuntimeSetup, NegativeIoPollingIsRefused) {
  rpc::Options options;
  options.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  options.ioPollWhileAwaiting = std::chrono::microseconds(-1);
  try {
    rpc::Runtime("w", options);
    ADD_FAILURE() << "a negative ioPollWhileAwaiting was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("must not be negative"),
        std::string::npos)
        << e.what();
  }
}

// Transports that cannot authenticate peers must not accept a secret they
// would silently ignore.
void expectSecretRefused(rpc::Options options, const std::string& transport) {
  options.sharedSecret = "job secret";
  try {
    rpc::Runtime("w", options);
    ADD_FAILURE() << "the " << transport << " transport accepted a secret";
  } catch (const c10::Error& e) {
    std::string text = e.what_without_backtrace();
    EXPECT_NE(text.find("Options::sharedSecret"), std::string::npos) << text;
    EXPECT_NE(text.find("TORCHRPC_SHARED_SECRET"), std::string::npos) << text;
    EXPECT_NE(text.find("the " + transport + " transport"), std::string::npos)
        << text;
  }
}

TEST(RuntimeSetup, SharedSecretIsRefusedByTheInProcessTransport) {
  rpc::Options options;
  options.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  // kAuto picks the in-process transport when given a network.
  expectSecretRefused(options, "in-process");
  options.transport = rpc::TransportKind::kInProcess;
  expectSecretRefused(options, "in-process");
}

TEST(RuntimeSetup, SharedSecretIsRefusedByTheTensorPipeTransport) {
  rpc::Options options;
  options.transport = rpc::TransportKind::kTensorPipe;
  expectSecretRefused(options, "TensorPipe");
}

TEST(RuntimeSetup, SharedSecretIsAcceptedByTheTcpTransport) {
  rpc::Options options;
  options.transport = rpc::TransportKind::kTcp;
  options.sharedSecret = "job secret";
  rpc::Runtime runtime("w", options);
  EXPECT_EQ(runtime.self().name, "w");
}

TEST(RuntimeSetup, IoPollingComesFromTheEnvironment) {
  setenv("TORCHRPC_IO_POLL_US", "5000", 1);
  setenv("TORCHRPC_IO_POLL_AWAIT_US", "0", 1);
  auto options = rpc::Options::fromEnvironment();
  EXPECT_EQ(options.ioPollAfterTraffic, std::chrono::microseconds(5000));
  EXPECT_EQ(options.ioPollWhileAwaiting, std::chrono::microseconds(0));
  setenv("TORCHRPC_IO_POLL_US", "-3", 1);
  EXPECT_THROW(rpc::Options::fromEnvironment(), c10::Error);
  unsetenv("TORCHRPC_IO_POLL_US");
  unsetenv("TORCHRPC_IO_POLL_AWAIT_US");
  // Unset, the defaults stand.
  EXPECT_EQ(
      rpc::Options::fromEnvironment().ioPollAfterTraffic,
      rpc::Options().ioPollAfterTraffic);
}

TEST(RuntimeSetup, DeviceMapNamingAMissingDeviceIsRefused) {
  if (at::hasCUDA()) {
    GTEST_SKIP() << "this machine has CUDA";
  }
  rpc::Options options;
  options.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  options.deviceMaps["peer"] = {{c10::Device("cuda:0"), c10::Device("cpu")}};
  try {
    rpc::Runtime rt("w", options);
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos);
  }
}

TEST(RuntimeSetup, DuplicateWorkerNamesFailStart) {
  auto network = std::make_shared<rpc::InProcessNetwork>();
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto options = [&](int rank) {
    rpc::Options o;
    o.rank = rank;
    o.worldSize = 2;
    o.store = store;
    o.inProcessNetwork = network;
    o.rendezvousTimeout = 10s;
    return o;
  };
  rpc::Runtime a("same", options(0));
  rpc::Runtime b("same", options(1));
  auto other = std::async(std::launch::async, [&]() { b.start(); });
  try {
    a.start();
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unique"), std::string::npos);
  }
  EXPECT_THROW(other.get(), c10::Error);
}

TEST(RuntimeSetup, RendezvousTimesOutNamingMissingRanks) {
  rpc::Options o;
  o.rank = 0;
  o.worldSize = 3;
  o.store = c10::make_intrusive<c10d::HashStore>();
  o.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  o.rendezvousTimeout = 200ms;
  rpc::Runtime rt("lonely", o);
  try {
    rt.start();
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("1, 2"), std::string::npos)
        << e.what();
  }
}

TEST(RuntimeSetup, CallsBeforeStartFailClearly) {
  rpc::Options o;
  o.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  rpc::Runtime rt("early", o);
  expectRpcError(
      [&]() { rt.rpcSync<int64_t>("early", "x"); },
      ErrorCode::kWorkerUnavailable,
      {"not started"});
}

} // namespace
} // namespace torchrpc
