// Tier 3: the RRef layer with one process per worker, over each real
// transport. References travel between processes (fork chains, back to the
// owner, from the owner, inside containers, from several threads at once);
// at the end every worker's tables are empty. Failed creations, graceful
// shutdown with references still held, and a SIGKILLed owner.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/support/child_processes.h"
#include "tests/support/rref_cluster.h"
#include "torchrpc/torchrpc.h"

namespace torchrpc {
namespace testing {
namespace {

using namespace std::chrono_literals;
using rpc::ErrorCode;
using rref::RRef;
using rref::RRefCounters;
using Clock = std::chrono::steady_clock;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

std::string workerName(int64_t rank) {
  return "worker" + std::to_string(rank);
}

// The value fill(n, base) makes; every check compares against it exactly.
at::Tensor filled(int64_t n, double base) {
  return at::arange(n, at::kDouble) * 0.5 + base;
}

std::vector<int64_t> toVector(const RRefCounters& c) {
  return {
      static_cast<int64_t>(c.ownerRRefs),
      static_cast<int64_t>(c.userRRefs),
      static_cast<int64_t>(c.pendingForks),
      static_cast<int64_t>(c.pendingConfirmations),
      static_cast<int64_t>(c.tombstones)};
}

RRefCounters fromVector(const std::vector<int64_t>& v) {
  RRefCounters c;
  if (v.size() == 5) {
    c.ownerRRefs = v[0];
    c.userRRefs = v[1];
    c.pendingForks = v[2];
    c.pendingConfirmations = v[3];
    c.tombstones = v[4];
  } else {
    c.ownerRRefs = 999; // not a report: never zero
  }
  return c;
}

// The files of one test: the runtime's rendezvous and the test's own
// barriers. The parent removes them before and after.
struct Paths {
  std::string rendezvous;
  std::string coordination;
};

Paths freshPaths(const std::string& tag) {
  std::string base =
      "/tmp/torchrpc_rref_" + tag + "_" + std::to_string(::getpid());
  Paths paths{base + "_rdv", base + "_sync"};
  std::remove(paths.rendezvous.c_str());
  std::remove(paths.coordination.c_str());
  return paths;
}

void removePaths(const Paths& paths) {
  std::remove(paths.rendezvous.c_str());
  std::remove(paths.coordination.c_str());
}

// Barriers and flags between the processes of one test, through a file
// store of the test's own. Every wait is bounded and records a failure when
// it runs out.
class Coordination {
 public:
  Coordination(const std::string& path, int worldSize)
      : store_(c10::make_intrusive<c10d::FileStore>(path, worldSize)),
        worldSize_(worldSize) {
    store_->setTimeout(std::chrono::milliseconds(60s));
    // Creates the file: reads of a missing one fail at the store's timeout
    // rather than at ours.
    store_->add("created", 1);
  }

  bool barrier(const std::string& name, std::chrono::milliseconds limit = 60s) {
    std::string key = "barrier/" + name;
    store_->add(key, 1);
    auto deadline = Clock::now() + limit;
    while (store_->add(key, 0) < worldSize_) {
      if (Clock::now() > deadline) {
        ADD_FAILURE() << "barrier '" << name << "': not every worker came";
        return false;
      }
      std::this_thread::sleep_for(10ms);
    }
    return true;
  }

  void signal(const std::string& name) {
    store_->set("flag/" + name, std::vector<uint8_t>{1});
  }

  bool waitFor(const std::string& name, std::chrono::milliseconds limit = 90s) {
    try {
      store_->wait({"flag/" + name}, limit);
      return true;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "flag '" << name << "' never came: " << e.what();
      return false;
    }
  }

 private:
  c10::intrusive_ptr<c10d::FileStore> store_;
  int64_t worldSize_;
};

// What one process keeps beside its runtime. Declared before the runtime,
// so RRefs held here outlive it.
struct ProcessState {
  std::mutex mutex;
  std::vector<RRef<at::Tensor>> held;
  bool gateOpen = false;
  // Completed by open_gate. Functions waiting for it return futures rather
  // than block a thread of the pool.
  FuturePtr gate =
      c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
};

// Short enough for a failure message.
std::string brief(const at::Tensor& t) {
  if (!t.defined()) {
    return "an undefined tensor";
  }
  std::ostringstream out;
  out << t.sizes() << " " << t.dtype() << " sum " << t.sum().item<double>();
  return out.str();
}

// Checks an RRef where it arrived: ownership, the fetched copy and, on the
// owner, the value itself. Returns whether everything matched.
bool checkHere(
    torchrpc::Runtime& rt,
    const RRef<at::Tensor>& r,
    const at::Tensor& expected) {
  bool owner = r.owner().id == rt.rank();
  EXPECT_EQ(r.isOwner(), owner) << rt.self().name << " " << r.id().toString();
  at::Tensor got = r.toHere();
  bool ok = r.isOwner() == owner && at::equal(got, expected);
  EXPECT_TRUE(at::equal(got, expected))
      << rt.self().name << " fetched " << brief(got) << ", expected "
      << brief(expected);
  if (owner) {
    bool same = at::equal(r.localValue(), expected);
    EXPECT_TRUE(same) << rt.self().name << ": the owner's own value differs";
    ok = ok && same;
  }
  return ok;
}

// Completes with a + b (ints) once both have, without blocking a thread; an
// error of either is the error.
FuturePtr addWhenDone(FuturePtr a, FuturePtr b) {
  auto out = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
  a->addCallback([a, b, out](c10::ivalue::Future&) {
    b->addCallback([a, b, out](c10::ivalue::Future&) {
      if (a->hasError()) {
        out->setError(a->exception_ptr());
      } else if (b->hasError()) {
        out->setError(b->exception_ptr());
      } else {
        out->markCompleted(a->value().toInt() + b->value().toInt());
      }
    });
  });
  return out;
}

std::tuple<int64_t, std::string> describeFailure(
    const std::function<void()>& fn) {
  try {
    fn();
    return {0, "no error"};
  } catch (const rpc::RpcError& e) {
    return {static_cast<int64_t>(e.code()), e.what()};
  } catch (const std::exception& e) {
    return {-1, e.what()};
  }
}

// Every worker of every test registers the same functions.
void registerFunctions(torchrpc::Runtime& rt, ProcessState& state) {
  auto& f = rt.functions();
  f.add("fill", &filled);
  f.add("zeros", [](int64_t n) { return at::zeros({n}, at::kDouble); });
  f.add("slow_fill", [](int64_t n, double base) {
    std::this_thread::sleep_for(200ms);
    return filled(n, base);
  });
  // The proxy passes the owner's value itself: this mutates it.
  f.add("add_inplace", [](at::Tensor value, at::Tensor delta) {
    value.add_(delta);
  });
  // owner -> user: an RRef of a value of this worker as a result.
  f.add("make_local", [&rt](int64_t n, double base) {
    return rt.makeRRef(filled(n, base));
  });
  f.add("echo", [](RRef<at::Tensor> r) { return r; });
  // Checks r here, then hands it to the next worker of `rest` (nested,
  // synchronous): a fork chain. Returns how many hops matched.
  f.add(
      "hop",
      [&rt](
          RRef<at::Tensor> r,
          std::vector<int64_t> rest,
          at::Tensor expected) {
        int64_t ok = checkHere(rt, r, expected) ? 1 : 0;
        if (!rest.empty()) {
          int64_t next = rest.front();
          rest.erase(rest.begin());
          ok += rt.rpcSync<int64_t>(next, "hop", r, rest, expected);
        }
        return ok;
      });
  // The asynchronous form for the concurrent test: no thread blocks, so
  // the pools cannot run dry whatever the interleaving. Forwards r at once
  // (before its own fetch is back) to `forwardTo` unless it is negative.
  f.add(
      "check",
      [&rt](RRef<at::Tensor> r, at::Tensor expected, int64_t forwardTo)
          -> FuturePtr {
        bool owner = r.owner().id == rt.rank();
        EXPECT_EQ(r.isOwner(), owner) << rt.self().name;
        std::string self = rt.self().name;
        // On the owner the value itself is checked too, once it exists (its
        // kRemote may still be on the way: localValue() would block).
        auto here =
            r.toHereAsync().then([r, owner, expected, self](at::Tensor got) {
              bool ok = at::equal(got, expected) &&
                  (!owner || at::equal(r.localValue(), expected));
              EXPECT_TRUE(ok) << self << " fetched " << brief(got)
                              << ", expected " << brief(expected);
              return int64_t(ok ? 1 : 0);
            });
        if (forwardTo < 0) {
          return here.ivalue();
        }
        auto next =
            rt.rpcAsync<int64_t>(forwardTo, "check", r, expected, int64_t(-1));
        return addWhenDone(here.ivalue(), next.ivalue());
      });
  // user -> owner: what the owner sees of an RRef it owns.
  f.add("owner_sees", [](RRef<at::Tensor> r) {
    if (!r.isOwner()) {
      return std::make_tuple(false, int64_t(0), false, at::Tensor());
    }
    at::Tensor value = r.localValue();
    at::Tensor copy = r.toHere();
    return std::make_tuple(
        true,
        reinterpret_cast<int64_t>(value.data_ptr()),
        copy.data_ptr() != value.data_ptr(),
        value);
  });
  // Fetches every RRef in a list, tuple or dict, in order.
  f.add("fetch_all", [](c10::IValue nested) {
    std::vector<at::Tensor> out;
    forEachRRefIn(nested, [&](const c10::IValue& v) {
      out.push_back(RRef<at::Tensor>::fromIValue(v).toHere());
    });
    return out;
  });
  // A user that is not the creator calls through the proxy.
  f.add("proxy_add", [](RRef<at::Tensor> r, at::Tensor delta) {
    r.rpcSync<void>("add_inplace", delta);
  });
  f.add("counters", [&rt]() { return toVector(rt.rrefs().counters()); });
  int64_t rank = rt.rank();
  f.add("boom", [rank]() -> at::Tensor {
    throw std::runtime_error("boom from worker" + std::to_string(rank));
  });
  // Fails once open_gate has run here.
  f.add("gated_boom", [rank, &state]() -> FuturePtr {
    return state.gate->then(
        [rank](c10::ivalue::Future&) -> c10::IValue {
          throw std::runtime_error(
              "gated boom from worker" + std::to_string(rank));
        },
        c10::TensorType::get());
  });
  // Never completes in the test that uses it: its worker is killed.
  f.add("hang", [&state]() -> FuturePtr {
    return state.gate->then(
        [](c10::ivalue::Future&) -> c10::IValue {
          return at::zeros({1}, at::kDouble);
        },
        c10::TensorType::get());
  });
  f.add("open_gate", [&state]() {
    bool first = false;
    {
      std::lock_guard<std::mutex> guard(state.mutex);
      first = !state.gateOpen;
      state.gateOpen = true;
    }
    if (first) {
      state.gate->markCompleted(c10::IValue());
    }
  });
  f.add("to_here_error", [](RRef<at::Tensor> r) {
    return describeFailure([&]() { r.toHere(); });
  });
  f.add("hold", [&rt, &state](RRef<at::Tensor> r, at::Tensor expected) {
    bool ok = checkHere(rt, r, expected);
    std::lock_guard<std::mutex> guard(state.mutex);
    state.held.push_back(std::move(r));
    return ok;
  });
  // toHere() of every RRef held here: the first failure, or (0, "").
  f.add("held_to_here_error", [&state]() {
    std::vector<RRef<at::Tensor>> held;
    {
      std::lock_guard<std::mutex> guard(state.mutex);
      held = state.held;
    }
    for (const auto& r : held) {
      auto failure = describeFailure([&]() { r.toHere(5s); });
      if (std::get<0>(failure) != 0) {
        return failure;
      }
    }
    return std::make_tuple(int64_t(0), std::string());
  });
  f.add("drop_held", [&state]() {
    std::vector<RRef<at::Tensor>> held;
    {
      std::lock_guard<std::mutex> guard(state.mutex);
      held.swap(state.held);
    }
    // Dropped here, outside the lock.
  });
}

// What a worker's body gets.
struct Worker {
  int rank;
  int worldSize;
  torchrpc::Runtime& rt;
  Coordination& sync;
  ProcessState& state;
};

// Forks one process per rank; each starts a worker with every function
// registered and runs body on it. Returns the pids, by rank.
std::vector<pid_t> spawnWorkers(
    ChildProcesses& children,
    int worldSize,
    const Paths& paths,
    rpc::TransportKind transport,
    const std::function<void(Worker&)>& body) {
  std::vector<pid_t> pids;
  for (int rank = 0; rank < worldSize; ++rank) {
    pids.push_back(children.spawn([=]() {
      ProcessState state;
      Coordination sync(paths.coordination, worldSize);
      auto options =
          childWorkerOptions(rank, worldSize, paths.rendezvous, transport);
      options.numWorkerThreads = 8;
      torchrpc::Runtime rt(workerName(rank), options);
      registerFunctions(rt, state);
      rt.start();
      Worker worker{rank, worldSize, rt, sync, state};
      body(worker);
    }));
  }
  return pids;
}

// Polls every worker's counters (its own directly, the others' through
// "counters") until all are zero, or reports them at the deadline.
::testing::AssertionResult tablesEmptyEverywhere(
    torchrpc::Runtime& rt,
    int worldSize,
    std::chrono::milliseconds limit = 20s) {
  auto deadline = Clock::now() + limit;
  while (true) {
    std::string report;
    for (int rank = 0; rank < worldSize; ++rank) {
      auto c = rank == rt.rank()
          ? rt.rrefs().counters()
          : fromVector(rt.rpcSync<std::vector<int64_t>>(rank, "counters"));
      if (!allZero(c)) {
        report += " " + workerName(rank) + ": " + describeCounters(c) + ";";
      }
    }
    if (report.empty()) {
      return ::testing::AssertionSuccess();
    }
    if (Clock::now() > deadline) {
      return ::testing::AssertionFailure()
          << "RRef tables not empty:" << report;
    }
    std::this_thread::sleep_for(10ms);
  }
}

// This worker's own tables, polled until empty.
::testing::AssertionResult ownTablesEmpty(
    torchrpc::Runtime& rt,
    std::chrono::milliseconds limit = 20s) {
  auto deadline = Clock::now() + limit;
  while (true) {
    auto c = rt.rrefs().counters();
    if (allZero(c)) {
      return ::testing::AssertionSuccess();
    }
    if (Clock::now() > deadline) {
      return ::testing::AssertionFailure()
          << rt.self().name
          << ": RRef tables not empty: " << describeCounters(c);
    }
    std::this_thread::sleep_for(10ms);
  }
}

// Graceful shutdown, then the tables as closed() found them.
void shutDownAndExpectNothingLeft(torchrpc::Runtime& rt) {
  EXPECT_TRUE(rt.shutdown()) << rt.self().name;
  auto left = rt.rrefs().leftAtClose();
  EXPECT_TRUE(allZero(left))
      << rt.self().name << " at close: " << describeCounters(left);
  EXPECT_TRUE(allZero(rt.rrefs().counters())) << rt.self().name;
}

// Workers other than the driver: serve until the driver says "done", then
// check their own tables (the driver saw them empty; nothing may have come
// since) and shut down.
void serveUntilDone(Worker& w) {
  ASSERT_TRUE(w.sync.waitFor("done"));
  auto c = w.rt.rrefs().counters();
  EXPECT_TRUE(allZero(c)) << w.rt.self().name << ": " << describeCounters(c);
  shutDownAndExpectNothingLeft(w.rt);
}

class RRefMultiProcess : public ::testing::TestWithParam<rpc::TransportKind> {};

// Four processes. worker0 drives; every other worker checks what reaches it
// inside the calls (a failed check there fails that process).
TEST_P(RRefMultiProcess, ForksTravelBetweenProcessesAndAllTablesEmptyAtTheEnd) {
  auto paths = freshPaths("forks");
  ChildProcesses children;
  auto pids = spawnWorkers(children, 4, paths, GetParam(), [](Worker& w) {
    if (w.rank != 0) {
      serveUntilDone(w);
      return;
    }
    auto& rt = w.rt;
    auto expected = filled(1000, 1.5);
    auto r = rt.remote<at::Tensor>("worker1", "fill", int64_t(1000), 1.5);
    EXPECT_FALSE(r.isOwner());
    EXPECT_EQ(r.ownerName(), "worker1");
    EXPECT_TRUE(at::equal(r.toHere(), expected));
    // The tables are not empty now, so the check at the end means something.
    EXPECT_EQ(
        fromVector(rt.rpcSync<std::vector<int64_t>>("worker1", "counters"))
            .ownerRRefs,
        1u);
    EXPECT_EQ(rt.rrefs().counters().userRRefs, 1u);

    // A fork chain A -> B -> C -> A among users: 0 -> 2 -> 3 -> 0.
    EXPECT_EQ(
        rt.rpcSync<int64_t>(
            "worker2",
            "hop",
            r,
            std::vector<int64_t>{3, 0},
            expected),
        3);
    // One that passes through the owner: 0 -> 2 -> 1 -> 3 -> 0.
    EXPECT_EQ(
        rt.rpcSync<int64_t>(
            "worker2",
            "hop",
            r,
            std::vector<int64_t>{1, 3, 0},
            expected),
        4);

    // user -> owner: the owner gets an owner handle of the value itself
    // (the same storage each time), and toHere() there is a copy.
    auto first = rt.rpcSync<std::tuple<bool, int64_t, bool, at::Tensor>>(
        "worker1",
        "owner_sees",
        r);
    auto second = rt.rpcSync<std::tuple<bool, int64_t, bool, at::Tensor>>(
        "worker1",
        "owner_sees",
        r);
    EXPECT_TRUE(std::get<0>(first));
    EXPECT_TRUE(std::get<2>(first));
    EXPECT_TRUE(at::equal(std::get<3>(first), expected));
    EXPECT_NE(std::get<1>(first), 0);
    EXPECT_EQ(std::get<1>(first), std::get<1>(second));

    // owner -> user: an RRef as a result; then around, through its owner.
    auto made = rt.rpcSync<RRef<at::Tensor>>(
        "worker3",
        "make_local",
        int64_t(7),
        100.0);
    auto madeExpected = filled(7, 100.0);
    EXPECT_FALSE(made.isOwner());
    EXPECT_EQ(made.ownerName(), "worker3");
    EXPECT_TRUE(at::equal(made.toHere(), madeExpected));
    EXPECT_EQ(
        rt.rpcSync<int64_t>(
            "worker2",
            "hop",
            made,
            std::vector<int64_t>{3, 1, 0},
            madeExpected),
        4);
    // An RRef the owner hands back is the same reference.
    auto echoed = rt.rpcSync<RRef<at::Tensor>>("worker3", "echo", made);
    EXPECT_TRUE(echoed.id() == made.id());
    EXPECT_TRUE(at::equal(echoed.toHere(), madeExpected));

    // Inside a list, a tuple and a dict, to users and owners alike.
    {
      auto rrefType = c10::RRefType::create(c10::TensorType::get());
      c10::impl::GenericList list(rrefType);
      list.push_back(r.toIValue());
      list.push_back(made.toIValue());
      auto fromList = rt.rpcSync<std::vector<at::Tensor>>(
          "worker2",
          "fetch_all",
          c10::IValue(list));
      ASSERT_EQ(fromList.size(), 2u);
      EXPECT_TRUE(at::equal(fromList[0], expected));
      EXPECT_TRUE(at::equal(fromList[1], madeExpected));
      auto tuple = c10::ivalue::Tuple::create(
          {made.toIValue(), c10::IValue(int64_t(5)), r.toIValue()});
      auto fromTuple = rt.rpcSync<std::vector<at::Tensor>>(
          "worker3",
          "fetch_all",
          c10::IValue(tuple));
      ASSERT_EQ(fromTuple.size(), 2u);
      EXPECT_TRUE(at::equal(fromTuple[0], madeExpected));
      EXPECT_TRUE(at::equal(fromTuple[1], expected));
      c10::impl::GenericDict dict(c10::StringType::get(), rrefType);
      dict.insert("r", r.toIValue());
      auto fromDict = rt.rpcSync<std::vector<at::Tensor>>(
          "worker1",
          "fetch_all",
          c10::IValue(dict));
      ASSERT_EQ(fromDict.size(), 1u);
      EXPECT_TRUE(at::equal(fromDict[0], expected));
    } // the containers hold references too

    // Proxy calls change the owner's value in place; the next toHere()
    // sees it, from the creator and from another user's proxy.
    auto q = rt.remote<at::Tensor>("worker2", "zeros", int64_t(5));
    q.rpcSync<void>("add_inplace", at::ones({5}, at::kDouble));
    EXPECT_TRUE(at::equal(q.toHere(), at::ones({5}, at::kDouble)));
    rt.rpcSync<void>(
        "worker3",
        "proxy_add",
        q,
        at::full({5}, 2.0, at::kDouble));
    EXPECT_TRUE(at::equal(q.toHere(), at::full({5}, 3.0, at::kDouble)));

    r = RRef<at::Tensor>();
    made = RRef<at::Tensor>();
    echoed = RRef<at::Tensor>();
    q = RRef<at::Tensor>();
    EXPECT_TRUE(tablesEmptyEverywhere(rt, w.worldSize));
    w.sync.signal("done");
    shutDownAndExpectNothingLeft(rt);
  });
  children.expectAllExitCleanly(pids, 120s);
  removePaths(paths);
}

// Every worker runs threads that create, fork, pass and drop RRefs owned by
// any worker (itself too), with fixed seeds; forks are often dropped while
// the call carrying them is still in flight.
constexpr int kStressThreads = 3;
constexpr int kStressIterations = 300;

struct Held {
  RRef<at::Tensor> rref;
  at::Tensor expected;
};

void stressThread(
    torchrpc::Runtime& rt,
    int worldSize,
    int thread,
    std::atomic<int64_t>* checked,
    std::atomic<size_t>* mostHeld) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * rt.rank() + thread));
  auto pick = [&](size_t n) {
    return std::uniform_int_distribution<size_t>(0, n - 1)(rng);
  };
  std::vector<Held> held;
  // Calls in flight and how many checks each must report.
  std::vector<std::pair<rpc::Future<int64_t>, int64_t>> inFlight;
  auto settle = [&]() {
    for (auto& call : inFlight) {
      try {
        EXPECT_EQ(call.first.wait(), call.second);
        *checked += call.second;
      } catch (const std::exception& e) {
        ADD_FAILURE() << rt.self().name << ": " << e.what();
      }
    }
    inFlight.clear();
  };
  for (int iter = 0; iter < kStressIterations; ++iter) {
    double base = rt.rank() * 1e6 + thread * 1e4 + iter;
    auto n = static_cast<int64_t>(1 + pick(16));
    size_t op = held.empty() ? 0 : pick(8);
    int64_t to = static_cast<int64_t>(pick(worldSize));
    size_t i = held.empty() ? 0 : pick(held.size());
    try {
      switch (op) {
        case 0:
        case 1: // create
          held.push_back(
              {rt.remote<at::Tensor>(to, "fill", n, base), filled(n, base)});
          break;
        case 2: // owner -> user
          held.push_back(
              {rt.rpcSync<RRef<at::Tensor>>(to, "make_local", n, base),
               filled(n, base)});
          break;
        case 3:
        case 4: { // fork, maybe on again; maybe drop ours while in flight
          int64_t forward =
              pick(2) == 0 ? static_cast<int64_t>(pick(worldSize)) : -1;
          inFlight.emplace_back(
              rt.rpcAsync<int64_t>(
                  to,
                  "check",
                  held[i].rref,
                  held[i].expected,
                  forward),
              forward >= 0 ? 2 : 1);
          if (pick(2) == 0) {
            held.erase(held.begin() + i);
          }
          break;
        }
        case 5: { // there and back
          auto back = rt.rpcSync<RRef<at::Tensor>>(to, "echo", held[i].rref);
          EXPECT_TRUE(back.id() == held[i].rref.id());
          EXPECT_EQ(back.isOwner(), back.owner().id == rt.rank());
          EXPECT_TRUE(at::equal(back.toHere(), held[i].expected));
          *checked += 1;
          held.push_back({back, held[i].expected});
          break;
        }
        case 6: // read here
          EXPECT_TRUE(at::equal(held[i].rref.toHere(), held[i].expected));
          *checked += 1;
          break;
        default: // drop
          held.erase(held.begin() + i);
          break;
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << rt.self().name << " iteration " << iter << " op " << op
                    << ": " << e.what();
    }
    if (held.size() > 6) {
      held.erase(held.begin());
    }
    if (inFlight.size() >= 4) {
      settle();
    }
    auto c = rt.rrefs().counters();
    size_t now = c.ownerRRefs + c.userRRefs;
    size_t most = mostHeld->load();
    while (now > most && !mostHeld->compare_exchange_weak(most, now)) {
    }
  }
  settle();
}

TEST_P(RRefMultiProcess, ConcurrentForksAndDeletionsLeaveEveryTableEmpty) {
  auto paths = freshPaths("stress");
  ChildProcesses children;
  auto pids = spawnWorkers(children, 3, paths, GetParam(), [](Worker& w) {
    std::atomic<int64_t> checked{0};
    std::atomic<size_t> mostHeld{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kStressThreads; ++t) {
      threads.emplace_back(
          stressThread,
          std::ref(w.rt),
          w.worldSize,
          t,
          &checked,
          &mostHeld);
    }
    for (auto& thread : threads) {
      thread.join();
    }
    // The run did fork things around.
    EXPECT_GT(checked.load(), kStressThreads * kStressIterations / 4);
    EXPECT_GT(mostHeld.load(), 0u);
    // No new reference moves once everyone is here; only deletions and
    // acknowledgements are left in flight.
    ASSERT_TRUE(w.sync.barrier("threads-done"));
    EXPECT_TRUE(ownTablesEmpty(w.rt));
    ASSERT_TRUE(w.sync.barrier("settled"));
    // Still empty once every worker saw its own empty: nothing came late.
    EXPECT_TRUE(allZero(w.rt.rrefs().counters()));
    if (w.rank == 0) {
      EXPECT_TRUE(tablesEmptyEverywhere(w.rt, w.worldSize, 1s));
    }
    ASSERT_TRUE(w.sync.barrier("checked"));
    shutDownAndExpectNothingLeft(w.rt);
  });
  children.expectAllExitCleanly(pids, 240s);
  removePaths(paths);
}

TEST_P(RRefMultiProcess, AFailedRemoteSurfacesAtToHereOnEveryHolder) {
  auto paths = freshPaths("failed");
  ChildProcesses children;
  auto pids = spawnWorkers(children, 3, paths, GetParam(), [](Worker& w) {
    if (w.rank != 0) {
      serveUntilDone(w);
      return;
    }
    auto& rt = w.rt;
    auto r = rt.remote<at::Tensor>("worker1", "boom");
    expectRpcErrorFrom(
        [&]() { r.toHere(); },
        ErrorCode::kRemoteException,
        "worker1",
        {"boom from worker1"});
    expectRpcErrorFrom(
        [&]() { r.rpcSync<void>("add_inplace", at::ones({1})); },
        ErrorCode::kRemoteException,
        "worker1",
        {"boom from worker1"});
    // Sending it on fails that call, naming the original error.
    expectRpcErrorFrom(
        [&]() { rt.rpcSync<bool>("worker2", "hold", r, at::ones({1})); },
        ErrorCode::kBadArguments,
        "worker2",
        {"creating it failed", "boom from worker1"});

    // Handed on before its creation failed: the other holder gets the
    // owner's record of the failure. The gate keeps the owner from failing
    // until the reference has left.
    auto gated = rt.remote<at::Tensor>("worker1", "gated_boom");
    auto elsewhere = rt.rpcAsync<std::tuple<int64_t, std::string>>(
        "worker2",
        "to_here_error",
        gated);
    rt.rpcSync<void>("worker1", "open_gate");
    auto failure = elsewhere.wait();
    EXPECT_EQ(
        std::get<0>(failure),
        static_cast<int64_t>(ErrorCode::kRemoteException))
        << std::get<1>(failure);
    EXPECT_NE(std::get<1>(failure).find("worker1"), std::string::npos)
        << std::get<1>(failure);
    EXPECT_NE(
        std::get<1>(failure).find("gated boom from worker1"),
        std::string::npos)
        << std::get<1>(failure);
    expectRpcErrorFrom(
        [&]() { gated.toHere(); },
        ErrorCode::kRemoteException,
        "worker1",
        {"gated boom from worker1"});

    r = RRef<at::Tensor>();
    gated = RRef<at::Tensor>();
    EXPECT_TRUE(tablesEmptyEverywhere(rt, w.worldSize));
    w.sync.signal("done");
    shutDownAndExpectNothingLeft(rt);
  });
  children.expectAllExitCleanly(pids, 120s);
  removePaths(paths);
}

// Polls this worker's counters until no fork is in flight: every fork it
// handed on was registered and every fork it holds was confirmed.
::testing::AssertionResult noForkInFlight(
    torchrpc::Runtime& rt,
    std::chrono::milliseconds limit = 15s) {
  auto deadline = Clock::now() + limit;
  while (true) {
    auto c = rt.rrefs().counters();
    if (c.pendingForks == 0 && c.pendingConfirmations == 0) {
      return ::testing::AssertionSuccess();
    }
    if (Clock::now() > deadline) {
      return ::testing::AssertionFailure()
          << rt.self().name
          << ": forks still in flight: " << describeCounters(c);
    }
    std::this_thread::sleep_for(5ms);
  }
}

// RRefs held on every worker (as creator, as a later user, as owner) when
// all four shut down together; with `remoteInFlight`, worker0 also starts
// creating one just before.
void shutDownHoldingRRefs(Worker& w, bool remoteInFlight) {
  auto& rt = w.rt;
  RRef<at::Tensor> r1, made, local, slow;
  auto e1 = filled(6, 10.0);
  auto eMade = filled(5, 20.0);
  auto eLocal = filled(4, 30.0);
  if (w.rank == 0) {
    r1 = rt.remote<at::Tensor>("worker1", "fill", int64_t(6), 10.0);
    EXPECT_TRUE(rt.rpcSync<bool>("worker2", "hold", r1, e1));
    EXPECT_TRUE(rt.rpcSync<bool>("worker3", "hold", r1, e1));
    made =
        rt.rpcSync<RRef<at::Tensor>>("worker3", "make_local", int64_t(5), 20.0);
    EXPECT_TRUE(rt.rpcSync<bool>("worker1", "hold", made, eMade));
    local = rt.makeRRef(eLocal.clone());
    EXPECT_TRUE(rt.rpcSync<bool>("worker2", "hold", local, eLocal));
    w.sync.signal("held");
  } else {
    ASSERT_TRUE(w.sync.waitFor("held"));
  }
  // Every worker holds something now (lower bounds: the references above
  // are all still held), and no fork is in flight: what shutdown has to
  // give back is exactly what is held.
  ASSERT_TRUE(noForkInFlight(rt));
  auto c = rt.rrefs().counters();
  const size_t minOwner[] = {1, 1, 0, 1};
  const size_t minUser[] = {2, 1, 2, 1};
  EXPECT_GE(c.ownerRRefs, minOwner[w.rank]) << describeCounters(c);
  EXPECT_GE(c.userRRefs, minUser[w.rank]) << describeCounters(c);
  ASSERT_TRUE(w.sync.barrier("checked"));
  if (remoteInFlight && w.rank == 0) {
    slow = rt.remote<at::Tensor>("worker2", "slow_fill", int64_t(3), 40.0);
  }

  shutDownAndExpectNothingLeft(rt);

  if (w.rank == 0) {
    // A user's handle fails now; an owner's still holds its value.
    expectRpcErrorFrom(
        [&]() { r1.toHere(); },
        ErrorCode::kShuttingDown,
        "worker1",
        {"worker0"});
    if (slow.defined()) {
      expectRpcErrorFrom(
          [&]() { slow.toHere(); },
          ErrorCode::kShuttingDown,
          "worker2",
          {"worker0"});
    }
    EXPECT_TRUE(at::equal(local.localValue(), eLocal));
  } else {
    std::lock_guard<std::mutex> guard(w.state.mutex);
    for (const auto& held : w.state.held) {
      EXPECT_FALSE(held.isOwner());
      expectRpcErrorFrom(
          [&]() { held.toHere(); },
          ErrorCode::kShuttingDown,
          held.ownerName(),
          {rt.self().name});
    }
  }
  // w.state.held outlives the runtime: those handles go after it.
}

TEST_P(RRefMultiProcess, GracefulShutdownGivesBackRRefsHeldOnEveryWorker) {
  auto paths = freshPaths("shutdown");
  ChildProcesses children;
  auto pids = spawnWorkers(children, 4, paths, GetParam(), [](Worker& w) {
    shutDownHoldingRRefs(w, /*remoteInFlight=*/false);
  });
  children.expectAllExitCleanly(pids, 120s);
  removePaths(paths);
}

// A remote() still being created when shutdown starts: shutdown waits for
// its reply and what the reply's continuations do (the agent counts a call
// until they have run), then gives that fork back too.
TEST_P(RRefMultiProcess, GracefulShutdownRightAfterARemoteGivesEverythingBack) {
  auto paths = freshPaths("inflight");
  ChildProcesses children;
  auto pids = spawnWorkers(children, 4, paths, GetParam(), [](Worker& w) {
    shutDownHoldingRRefs(w, /*remoteInFlight=*/true);
  });
  children.expectAllExitCleanly(pids, 120s);
  removePaths(paths);
}

bool waitReadable(int fd, std::chrono::milliseconds limit) {
  pollfd pfd{fd, POLLIN, 0};
  if (::poll(&pfd, 1, static_cast<int>(limit.count())) != 1) {
    return false;
  }
  char byte = 0;
  return ::read(fd, &byte, 1) == 1;
}

// worker1 owns RRefs held by worker0 and worker2, one of them still being
// created and fetched, when the parent SIGKILLs it.
TEST_P(RRefMultiProcess, AKilledOwnerFailsToHereWithWorkerUnavailable) {
  auto paths = freshPaths("kill");
  int ready[2];
  int killed[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(killed), 0);
  ChildProcesses children;
  auto pids = spawnWorkers(children, 3, paths, GetParam(), [&](Worker& w) {
    auto& rt = w.rt;
    if (w.rank == 1) {
      std::this_thread::sleep_for(120s); // killed long before
      return;
    }
    if (w.rank == 2) {
      EXPECT_TRUE(waitReadable(killed[0], 60s));
      ASSERT_TRUE(w.sync.waitFor("done"));
      EXPECT_TRUE(allZero(rt.rrefs().counters()))
          << describeCounters(rt.rrefs().counters());
      rt.shutdown(/*graceful=*/false);
      return;
    }
    auto expected = filled(8, 3.0);
    auto r = rt.remote<at::Tensor>("worker1", "fill", int64_t(8), 3.0);
    EXPECT_TRUE(at::equal(r.toHere(), expected));
    EXPECT_TRUE(rt.rpcSync<bool>("worker2", "hold", r, expected));
    // Never created: its kRemote and a fetch are in flight at the kill.
    auto hung = rt.remote<at::Tensor>("worker1", "hang");
    auto pendingFetch = hung.toHereAsync();
    // Let the fork protocol of r settle first: worker2's registration is
    // confirmed and worker0 heard that its child was accepted. (If the owner
    // dies with kChildAccepted in flight, worker0 keeps its fork until
    // shutdown: the bounded leak of the Note's "Limits".)
    auto settleBy = Clock::now() + 15s;
    bool settled = false;
    while (!settled && Clock::now() < settleBy) {
      auto two =
          fromVector(rt.rpcSync<std::vector<int64_t>>("worker2", "counters"));
      settled = rt.rrefs().counters().pendingForks == 0 &&
          two.pendingConfirmations == 0 && two.pendingForks == 0;
      std::this_thread::sleep_for(5ms);
    }
    ASSERT_TRUE(settled) << describeCounters(rt.rrefs().counters());
    char byte = 1;
    ASSERT_EQ(::write(ready[1], &byte, 1), 1);
    ASSERT_TRUE(waitReadable(killed[0], 60s));
    auto killedAt = Clock::now();

    // The transports see the connection drop: kWorkerUnavailable, long
    // before the 30 s call timeout.
    expectRpcErrorFrom(
        [&]() { pendingFetch.wait(); },
        ErrorCode::kWorkerUnavailable,
        "worker1",
        {});
    expectRpcErrorFrom(
        [&]() { r.toHere(); },
        ErrorCode::kWorkerUnavailable,
        "worker1",
        {});
    expectRpcErrorFrom(
        [&]() { hung.toHere(); },
        ErrorCode::kWorkerUnavailable,
        "worker1",
        {});
    auto onTwo = rt.rpcSync<std::tuple<int64_t, std::string>>(
        "worker2",
        "held_to_here_error");
    EXPECT_EQ(
        std::get<0>(onTwo),
        static_cast<int64_t>(ErrorCode::kWorkerUnavailable))
        << std::get<1>(onTwo);
    EXPECT_NE(std::get<1>(onTwo).find("worker1"), std::string::npos)
        << std::get<1>(onTwo);
    EXPECT_LT(Clock::now() - killedAt, 10s);

    // Giving the references back to a dead owner fails, and the survivors
    // forget them: their tables empty.
    r = RRef<at::Tensor>();
    hung = RRef<at::Tensor>();
    rt.rpcSync<void>("worker2", "drop_held");
    auto deadline = Clock::now() + 15s;
    bool empty = false;
    while (!empty && Clock::now() < deadline) {
      empty = allZero(rt.rrefs().counters()) &&
          allZero(fromVector(
              rt.rpcSync<std::vector<int64_t>>("worker2", "counters")));
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_TRUE(empty) << "worker0: "
                       << describeCounters(rt.rrefs().counters());
    w.sync.signal("done");
    auto shutdownAt = Clock::now();
    rt.shutdown(/*graceful=*/false);
    EXPECT_LT(Clock::now() - shutdownAt, 10s);
  });
  ASSERT_TRUE(waitReadable(ready[0], 60s)) << "worker0 never got ready";
  children.kill(pids[1], SIGKILL);
  EXPECT_EQ(children.wait(pids[1], 10s), 128 + SIGKILL);
  char bytes[2] = {1, 1};
  ASSERT_EQ(::write(killed[1], bytes, 2), 2);
  EXPECT_EQ(children.wait(pids[0], 120s), 0) << "worker0";
  EXPECT_EQ(children.wait(pids[2], 120s), 0) << "worker2";
  for (int fd : {ready[0], ready[1], killed[0], killed[1]}) {
    ::close(fd);
  }
  removePaths(paths);
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    RRefMultiProcess,
    ::testing::Values(
        rpc::TransportKind::kTensorPipe,
        rpc::TransportKind::kTcp),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
