#pragma once

// Several workers in one process: tier-2 tests. Each worker is a real
// Runtime with its own agent and transport; they meet through a HashStore.

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/transport_names.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/transport/inprocess/inprocess_transport.h"

namespace torchrpc {
namespace testing {

class LocalCluster {
 public:
  // configure(rank, options) may adjust each worker's options;
  // setup(rank, runtime) registers functions before start(). With
  // kInProcess the workers share the cluster's network().
  LocalCluster(
      rpc::TransportKind transport,
      int worldSize,
      std::function<void(int, rpc::Options&)> configure = nullptr,
      std::function<void(int, rpc::Runtime&)> setup = nullptr)
      : network_(std::make_shared<rpc::InProcessNetwork>()),
        store_(c10::make_intrusive<c10d::HashStore>()) {
    for (int rank = 0; rank < worldSize; ++rank) {
      rpc::Options options;
      options.rank = rank;
      options.worldSize = worldSize;
      options.store = store_;
      options.rendezvousTimeout = std::chrono::seconds(20);
      options.shutdownTimeout = std::chrono::seconds(20);
      options.defaultTimeout = std::chrono::seconds(20);
      options.transport = transport;
      if (transport == rpc::TransportKind::kInProcess) {
        options.inProcessNetwork = network_;
      }
      if (configure) {
        configure(rank, options);
      }
      runtimes_.push_back(std::make_unique<rpc::Runtime>(
          "worker" + std::to_string(rank),
          options));
      if (setup) {
        setup(rank, *runtimes_.back());
      }
    }
    startAll();
  }

  ~LocalCluster() {
    shutdownAll(/*graceful=*/false);
  }

  rpc::Runtime& operator[](int rank) {
    return *runtimes_.at(rank);
  }
  int size() const {
    return static_cast<int>(runtimes_.size());
  }
  const std::shared_ptr<rpc::InProcessNetwork>& network() const {
    return network_;
  }
  const c10::intrusive_ptr<c10d::Store>& store() const {
    return store_;
  }

  // Shuts every worker down concurrently, as separate processes would;
  // returns whether every graceful shutdown completed.
  bool shutdownAll(bool graceful = true) {
    std::vector<std::future<bool>> done;
    for (auto& runtime : runtimes_) {
      rpc::Runtime* r = runtime.get();
      done.push_back(std::async(std::launch::async, [r, graceful]() {
        return r->shutdown(graceful);
      }));
    }
    bool clean = true;
    for (auto& d : done) {
      clean = d.get() && clean;
    }
    return clean;
  }

 private:
  void startAll() {
    std::vector<std::future<void>> started;
    for (auto& runtime : runtimes_) {
      rpc::Runtime* r = runtime.get();
      started.push_back(std::async(std::launch::async, [r]() { r->start(); }));
    }
    for (auto& s : started) {
      s.get(); // rethrows a worker's start() failure
    }
  }

  std::shared_ptr<rpc::InProcessNetwork> network_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::vector<std::unique_ptr<rpc::Runtime>> runtimes_;
};

// Runs fn and expects it to throw an RpcError with `code` whose message
// contains every one of `fragments` and, unless `worker` is empty, whose
// worker() is `worker` (the worker the failed call went to).
template <typename F>
void expectRpcErrorFrom(
    F&& fn,
    rpc::ErrorCode code,
    const std::string& worker,
    std::initializer_list<std::string> fragments) {
  try {
    fn();
    ADD_FAILURE() << "expected RpcError(" << rpc::errorCodeName(code)
                  << "), nothing was thrown";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    if (!worker.empty()) {
      EXPECT_EQ(e.worker(), worker) << e.what();
    }
    for (const auto& fragment : fragments) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "'" << fragment << "' not in: " << e.what();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected RpcError(" << rpc::errorCodeName(code)
                  << "), got: " << e.what();
  }
}

// Expects an error text that came from another worker to be the cause's
// message only: c10::Error::what() appends a C++ backtrace (kilobytes of
// frames) that must not cross the wire, so the text stays under `maxBytes`.
inline void expectNoBacktrace(const std::string& text, size_t maxBytes = 512) {
  EXPECT_EQ(text.find("Exception raised from"), std::string::npos) << text;
  EXPECT_EQ(text.find("frame #"), std::string::npos) << text;
  EXPECT_LT(text.size(), maxBytes) << text;
}

// The same, whichever worker the error names.
template <typename F>
void expectRpcError(
    F&& fn,
    rpc::ErrorCode code,
    std::initializer_list<std::string> fragments) {
  expectRpcErrorFrom(std::forward<F>(fn), code, "", fragments);
}

} // namespace testing
} // namespace torchrpc
